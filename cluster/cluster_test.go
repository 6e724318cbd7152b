package cluster

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"tensorfs/cluster/transport"
)

// model is a small published directory: a subdirectory, tensors of a few
// pieces with attributes, an empty file and a file shared by two paths.
func model(t *testing.T) ([]LocalEntry, map[string][]byte) {
	data := map[string][]byte{
		"config.json":        []byte(`{"layers": 2}`),
		"empty":              nil,
		"layers/0.weight":    randomBytes(t, 300<<10+17),
		"layers/1.weight":    randomBytes(t, 1<<20),
		"layers/tied.weight": nil,
	}
	data["layers/tied.weight"] = data["layers/1.weight"]
	root := dirEntry(".")
	root.Xattrs = map[string][]byte{"user.origin": []byte("test")}
	entries := []LocalEntry{root, dirEntry("layers")}
	for p, b := range data {
		e := fileEntry(p, b)
		if p == "layers/1.weight" {
			e.Dtype, e.Shape = "float32", "[512, 512]"
			e.Xattrs = map[string][]byte{"user.note": {0, 1, 2}}
			e.Mode = syscall.S_IFREG | 0o4640 // set-id bits are not published
		}
		entries = append(entries, e)
	}
	return entries, data
}

// TestPublishPull publishes a directory on one node and pulls it on two
// others: the same entries everywhere, byte-identical files, each piece
// served by whoever holds it.
func TestPublishPull(t *testing.T) {
	tc := newTestCluster(t)
	a, b, c := tc.join(tc.config("node-a")), tc.join(tc.config("node-b")), tc.join(tc.config("node-c"))
	ctx := context.Background()

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	events := b.Watch(wctx, nil)

	entries, data := model(t)
	info, err := a.Publish(ctx, "models/tiny", entries, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Publisher != "node-a" || info.Prev != "" || !validID(info.Version) {
		t.Fatalf("publish returned %+v", info)
	}
	select {
	case ev := <-events:
		if ev.Dir != "models/tiny" || ev.Version != info.Version || ev.Deleted {
			t.Fatalf("watch sent %+v, want models/tiny at %s", ev, info.Version)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no watch event for the publish")
	}

	got, err := b.Lookup(ctx, "models/tiny")
	if err != nil || got.Version != info.Version {
		t.Fatalf("lookup: %+v, %v", got, err)
	}
	v, err := b.Version(ctx, got.Version)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Entries) != len(entries) || v.Entries[0].Path != "." || string(v.Entries[0].Xattrs["user.origin"]) != "test" {
		t.Fatalf("version entries: %+v", v.Entries)
	}
	for _, e := range v.Entries {
		if e.Path == "layers/1.weight" {
			if e.Mode != syscall.S_IFREG|0o640 || e.Dtype != "float32" || e.Shape != "[512, 512]" || !bytes.Equal(e.Xattrs["user.note"], []byte{0, 1, 2}) || e.UID != 1000 {
				t.Fatalf("layers/1.weight published as %+v", e)
			}
		}
	}
	if v.Bytes() != int64(300<<10+17+2<<20+len(data["config.json"])) {
		t.Fatalf("version bytes %d", v.Bytes())
	}

	pb, filesB := pullAll(t, b, v)
	if err := pb.Wait(); err != nil {
		t.Fatal(err)
	}
	for p, f := range filesB {
		if !bytes.Equal(contents(t, f), data[p]) {
			t.Fatalf("node-b: %s differs", p)
		}
		select {
		case <-pb.Done(0):
		default:
			t.Fatal("pull done, job 0 not")
		}
	}
	pr := pb.Progress()
	if pr.Bytes != pr.Total || pr.Total != v.Bytes()-int64(len(data["layers/tied.weight"])) || pr.ByPeer["node-a"] != pr.Total {
		t.Fatalf("node-b progress %+v (the tied file is fetched once)", pr)
	}

	// node-c pulls from node-a and node-b.
	pc, filesC := pullAll(t, c, v)
	if err := pc.Wait(); err != nil {
		t.Fatal(err)
	}
	for p, f := range filesC {
		if !bytes.Equal(contents(t, f), data[p]) {
			t.Fatalf("node-c: %s differs", p)
		}
	}
	if by := pc.Progress().ByPeer; by["node-a"] == 0 || by["node-b"] == 0 {
		t.Fatalf("node-c fetched %v: want pieces from both holders", by)
	}
	// Every node holds every piece now, and says so in etcd.
	for _, e := range v.Entries {
		if e.IsDir() {
			continue
		}
		waitFor(t, 5*time.Second, "holders of "+e.Path, func() bool {
			resp, err := a.etcd.Get(ctx, a.keys.holders(e.Content), clientv3.WithPrefix())
			return err == nil && len(resp.Kvs) == 3
		})
	}
}

// TestRepublish publishes a second version: readers of the first keep it,
// an unchanged file keeps its content, and a node holding the first
// version fetches only what changed.
func TestRepublish(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	same, changed := randomBytes(t, 200<<10), randomBytes(t, 100<<10)
	v1info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("same", same), fileEntry("w", randomBytes(t, 100<<10))}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v1, err := b.Version(ctx, v1info.Version)
	if err != nil {
		t.Fatal(err)
	}
	p1, _ := pullAll(t, b, v1)
	if err := p1.Wait(); err != nil {
		t.Fatal(err)
	}
	// The same content again changes nothing.
	again, err := a.Publish(ctx, "m", []LocalEntry{fileEntry("w", randomBytes(t, 0)), dirEntry(".")}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if again.Prev != v1info.Version {
		t.Fatalf("second version records prev %q, want %q", again.Prev, v1info.Version)
	}
	v2info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("same", same), fileEntry("w", changed)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v2info.Prev != again.Version {
		t.Fatalf("third version records prev %q, want %q", v2info.Prev, again.Version)
	}
	if same, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("same", same), fileEntry("w", changed)}, PublishOptions{}); err != nil || !reflect.DeepEqual(same, v2info) {
		t.Fatalf("publishing the current version again: %+v, %v; want %+v", same, err, v2info)
	}
	v2, err := b.Version(ctx, v2info.Version)
	if err != nil {
		t.Fatal(err)
	}
	if v1.Entries[1].Content != v2.Entries[1].Content || v1.Entries[2].Content == v2.Entries[2].Content {
		t.Fatalf("contents: v1 %+v, v2 %+v", v1.Entries, v2.Entries)
	}
	// Two versions are kept: the second stays for its readers, the
	// first went with the swap to the third.
	if _, err := b.Version(ctx, again.Version); err != nil {
		t.Fatalf("the second version is gone: %v", err)
	}
	if _, err := b.Version(ctx, v1info.Version); !errors.Is(err, ErrNotPublished) {
		t.Fatalf("the first version, no longer kept: %v, want ErrNotPublished", err)
	}
	if !slices.Equal(v2info.Kept, []string{again.Version}) {
		t.Fatalf("third version keeps %q, want the second", v2info.Kept)
	}
	p2, files := pullAll(t, b, v2)
	if err := p2.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["same"]), same) || !bytes.Equal(contents(t, files["w"]), changed) {
		t.Fatal("second version differs")
	}
	if pr := p2.Progress(); pr.ByPeer["node-a"] != int64(len(changed)) || pr.Bytes != pr.Total {
		t.Fatalf("second pull %+v: want only the changed file fetched", pr)
	}
	if err := b.Unpublish(ctx, "m", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Lookup(ctx, "m"); !errors.Is(err, ErrNotPublished) {
		t.Fatalf("lookup after unpublish: %v", err)
	}
	for _, v := range []string{v2info.Version, again.Version} {
		if _, err := a.Version(ctx, v); !errors.Is(err, ErrNotPublished) {
			t.Fatalf("version %s after unpublish: %v, want ErrNotPublished", v, err)
		}
	}
}

// TestPublishRefuses checks that bad names and entries are refused with
// ErrInvalid and publish nothing.
func TestPublishRefuses(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	ctx := context.Background()
	file := func(mod func(*LocalEntry)) []LocalEntry {
		e := fileEntry("w", make([]byte, 64))
		mod(&e)
		return []LocalEntry{dirEntry("."), e}
	}
	cases := map[string]struct {
		dir     string
		entries []LocalEntry
	}{
		"absolute dir":      {"/m", []LocalEntry{dirEntry(".")}},
		"dotdot dir":        {"../m", []LocalEntry{dirEntry(".")}},
		"unclean dir":       {"a//b", []LocalEntry{dirEntry(".")}},
		"no root":           {"m", []LocalEntry{fileEntry("w", nil)}},
		"no parent":         {"m", []LocalEntry{dirEntry("."), fileEntry("x/w", nil)}},
		"twice":             {"m", []LocalEntry{dirEntry("."), fileEntry("w", nil), fileEntry("w", nil)}},
		"dotdot path":       {"m", []LocalEntry{dirEntry("."), fileEntry("../w", nil)}},
		"tensorfs xattr":    {"m", file(func(e *LocalEntry) { e.Xattrs = map[string][]byte{"user.tensorfs.flags": []byte("SHARED")} })},
		"trusted xattr":     {"m", file(func(e *LocalEntry) { e.Xattrs = map[string][]byte{"trusted.x": nil} })},
		"tensor as xattr":   {"m", file(func(e *LocalEntry) { e.Xattrs = map[string][]byte{"user.tensor.dtype": []byte("float32")} })},
		"unknown dtype":     {"m", file(func(e *LocalEntry) { e.Dtype = "float33" })},
		"alias dtype":       {"m", file(func(e *LocalEntry) { e.Dtype = "float" })},
		"shape too big":     {"m", file(func(e *LocalEntry) { e.Dtype, e.Shape = "float32", "[17]" })},
		"negative shape":    {"m", file(func(e *LocalEntry) { e.Dtype, e.Shape = "float32", "[-1]" })},
		"symlink":           {"m", file(func(e *LocalEntry) { e.Mode = syscall.S_IFLNK | 0o777 })},
		"file without data": {"m", file(func(e *LocalEntry) { e.Data = nil })},
		"short data":        {"m", file(func(e *LocalEntry) { e.Size = 100 })},
		"directory with dtype": {"m", []LocalEntry{func() LocalEntry {
			d := dirEntry(".")
			d.Dtype = "float32"
			return d
		}()}},
	}
	for name, c := range cases {
		if _, err := a.Publish(ctx, c.dir, c.entries, PublishOptions{}); err == nil {
			t.Errorf("%s: published", name)
		} else if name != "short data" && !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if dirs, _, err := a.Dirs(ctx); err != nil || len(dirs) != 0 {
		t.Fatalf("after refusals: %v published, %v", dirs, err)
	}
}

// lyingSource serves its node's pieces with every byte changed after
// the node verified them: a holder that lies, or a corrupting link.
type lyingSource struct{ transport.Source }

func (s lyingSource) Piece(p transport.Piece, accept []byte) (int, []byte, error) {
	i, b, err := s.Source.Piece(p, accept)
	bad := bytes.Clone(b)
	for i := range bad {
		bad[i] ^= 0x5a
	}
	return i, bad, err
}

// lyingTransport is a Stream transport whose server lies (lyingSource).
type lyingTransport struct{ transport.Transport }

func (t lyingTransport) Start(src transport.Source) error { return t.Transport.Start(lyingSource{src}) }

// TestCorruptPieceRefetched makes one holder serve corrupted bytes: the
// puller refetches those pieces from the other holder, logs it, ends with
// the published bytes, and stops asking the bad holder.
func TestCorruptPieceRefetched(t *testing.T) {
	tc := newTestCluster(t)
	liar := tc.config("node-b")
	tr, err := transport.NewStream(transport.Config{Listen: liar.Listen, Credentials: liar.Credentials})
	if err != nil {
		t.Fatal(err)
	}
	liar.Transport = lyingTransport{tr}
	a, b := tc.join(tc.config("node-a")), tc.join(liar)
	cfg := tc.config("node-c")
	cfg.Parallel, cfg.PerPeer = 2, 1 // both holders are asked from the start
	c := tc.join(cfg)
	ctx := context.Background()
	data := randomBytes(t, 2<<20)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	content := v.Contents[v.Entries[1].Content]
	if err := b.Offer(content.ID(), bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "node-b announces its copy", func() bool {
		resp, err := a.etcd.Get(ctx, a.keys.holder(content.ID(), "node-b"))
		return err == nil && len(resp.Kvs) == 1
	})
	p, files := pullAll(t, c, v)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ from the published ones")
	}
	st := c.Stats()
	if st.BadPieces == 0 || st.BadPieces > maxStrikes || !tc.logs.contains("piece failed verification; fetching it from another holder") {
		t.Fatalf("stats %+v: want between 1 and %d bad pieces, logged", st, maxStrikes)
	}
	if by := p.Progress().ByPeer; by["node-b"] != 0 || by["node-a"] != int64(len(data)) {
		t.Fatalf("verified bytes by peer %v: want all from node-a", by)
	}
}

// TestHolderKilledMidPull kills one of two holders while a pull fetches
// from both: the pull completes from the other.
func TestHolderKilledMidPull(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	c := tc.join(tc.config("node-c"))
	ctx := context.Background()
	data := randomBytes(t, 4<<20)
	slow := newSlowReader(data)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), {Entry: fileEntry("w", data).Entry, Data: slow}}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slow.slow(20 * time.Millisecond)
	v, err := c.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	id := v.Entries[1].Content
	if err := b.Offer(id, slow, int64(len(data))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "node-b announces its copy", func() bool {
		resp, err := a.etcd.Get(ctx, a.keys.holder(id, "node-b"))
		return err == nil && len(resp.Kvs) == 1
	})
	p, files := pullAll(t, c, v)
	waitFor(t, 10*time.Second, "a piece from node-b", func() bool { return p.Progress().ByPeer["node-b"] > 0 })
	b.kill()
	before := p.Progress()
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ")
	}
	after := p.Progress()
	if before.Bytes == after.Total || after.ByPeer["node-a"] <= before.ByPeer["node-a"] {
		t.Fatalf("progress when node-b died %+v, at the end %+v: want the rest from node-a", before, after)
	}
}

// TestEtcdOutage stops etcd: cluster calls fail within the timeout with
// ErrUnavailable, a pull under way completes from the holders it knows,
// and when etcd returns the node announces what it pulled meanwhile and
// the cluster works again.
func TestEtcdOutage(t *testing.T) {
	tc := newTestCluster(t)
	a, b, c := tc.join(tc.config("node-a")), tc.join(tc.config("node-b")), tc.join(tc.config("node-c"))
	ctx := context.Background()
	data := randomBytes(t, 2<<20)
	slow := newSlowReader(data)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), {Entry: fileEntry("w", data).Entry, Data: slow}}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slow.slow(500 * time.Millisecond) // 32 pieces, 4 at a time: the pull outlasts etcd's stop
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	p, files := pullAll(t, b, v)
	waitFor(t, 10*time.Second, "a first piece", func() bool { return p.Progress().Bytes > 0 })

	// Stopping etcd waits for its streams to end; it refuses connections
	// from its start.
	stopped := make(chan struct{})
	go func() {
		tc.etcd.Stop()
		close(stopped)
	}()
	waitFor(t, 5*time.Second, "etcd refuses connections", func() bool {
		c, err := net.Dial("tcp", strings.TrimPrefix(tc.etcd.ClientURL, "https://"))
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	if p.Progress().Bytes == int64(len(data)) {
		t.Fatal("the pull was over before etcd stopped")
	}
	calls := map[string]func() error{
		"lookup":  func() error { _, err := c.Lookup(ctx, "m"); return err },
		"version": func() error { _, err := c.Version(ctx, info.Version); return err },
		"publish": func() error { _, err := a.Publish(ctx, "n", []LocalEntry{dirEntry(".")}, PublishOptions{}); return err },
		"pull": func() error {
			_, err := c.Pull(ctx, []Job{{Content: v.Contents[v.Entries[1].Content], Dst: dst(t, int64(len(data)))}})
			return err
		},
	}
	var wg sync.WaitGroup
	for name, call := range calls {
		wg.Go(func() {
			// A connection made before the stop may still answer while
			// etcd drains its streams: a success is retried.
			start := time.Now()
			err := call()
			for err == nil && time.Since(start) < 5*time.Second {
				time.Sleep(50 * time.Millisecond)
				err = call()
			}
			if took := time.Since(start); !errors.Is(err, ErrUnavailable) || took > 5*time.Second {
				t.Errorf("%s with etcd down: %v after %v; want ErrUnavailable within 5s", name, err, took)
			} else {
				t.Logf("%s with etcd down: %v after %v", name, err, took.Round(time.Millisecond))
			}
		})
	}
	wg.Wait()
	<-stopped
	if err := p.Wait(); err != nil {
		t.Fatalf("pull under way when etcd stopped: %v", err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ")
	}

	if err := tc.etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	// node-b announces the pieces it pulled while etcd was away; node-c
	// can then pull from node-b alone.
	waitFor(t, 15*time.Second, "node-b's pieces announced", func() bool {
		resp, err := c.etcd.Get(ctx, c.keys.holder(v.Entries[1].Content, "node-b"))
		if err != nil || len(resp.Kvs) == 0 {
			return false
		}
		return string(resp.Kvs[0].Value) == holderComplete
	})
	a.kill()
	pc, filesC := pullAll(t, c, v)
	if err := pc.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, filesC["w"]), data) || pc.Progress().ByPeer["node-b"] != int64(len(data)) {
		t.Fatalf("node-c's pull after the outage: %+v", pc.Progress())
	}
	if _, err := b.Publish(ctx, "n", []LocalEntry{dirEntry(".")}, PublishOptions{}); err != nil {
		t.Fatalf("publish after the outage: %v", err)
	}
}

// TestLeaseLost revokes a node's lease behind its back (as its expiry
// would): its keys vanish, and it joins again and announces what it holds.
func TestLeaseLost(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	ctx := context.Background()
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", randomBytes(t, 100<<10))}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := a.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	lease, err := a.lease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.etcd.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "node-a joins again and re-announces", func() bool {
		l, err := a.lease(ctx)
		if err != nil || l == lease {
			return false
		}
		resp, err := a.etcd.Get(ctx, a.keys.holder(v.Entries[1].Content, "node-a"))
		return err == nil && len(resp.Kvs) == 1 && clientv3.LeaseID(resp.Kvs[0].Lease) == l
	})
}

// TestNameInUse joins two daemons with one name: the second waits until
// the first leaves.
func TestNameInUse(t *testing.T) {
	tc := newTestCluster(t)
	first := tc.join(tc.config("node-a"))
	second, err := Join(tc.config("node-a"))
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	ctx := context.Background()
	if _, err := second.Publish(ctx, "m", []LocalEntry{dirEntry(".")}, PublishOptions{}); !errors.Is(err, ErrNameInUse) {
		t.Fatalf("publish from a second node-a: %v, want ErrNameInUse", err)
	}
	if err := second.Joined(); !errors.Is(err, ErrNameInUse) || !strings.Contains(err.Error(), "lease ends in") || !strings.Contains(err.Error(), "another --node") {
		t.Fatalf("the second node-a says %v, want ErrNameInUse saying when the first one's lease ends, and what to do", err)
	}
	first.Close()
	waitFor(t, 10*time.Second, "the second node-a joins", func() bool {
		return second.Joined() == nil
	})
	if first.Joined() != ErrClosed {
		t.Errorf("the first node-a, closed, says %v", first.Joined())
	}
}

// TestRestartOffer restarts a publisher: it offers what it recovered, and
// serves it again; an offer of what was never published is never served.
func TestRestartOffer(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	data := randomBytes(t, 500<<10)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	id := v.Entries[1].Content
	a.Close()

	a2 := tc.join(tc.config("node-a"))
	stranger := hashID([]byte("never published"))
	if err := a2.Offer(stranger, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if err := a2.Offer(id, bytes.NewReader(data[1:]), int64(len(data)-1)); err != nil {
		t.Fatal(err)
	}
	// Both refusals, the short copy's last: the right copy's offer below
	// would find the short one still being checked.
	waitFor(t, 5*time.Second, "refusals logged", func() bool {
		return tc.logs.contains("content="+stranger) && tc.logs.contains("content="+id)
	})
	if err := a2.Offer(id, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	p, files := pullAll(t, b, v)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ")
	}
	if _, _, err := a2.Piece(transport.Piece{Content: stranger}, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("a content never published is served: %v", err)
	}
}

// TestTakeoverBusyUntilOffered checks that a daemon taking over from
// another (Config.Resume) asks peers to come back (ErrBusy) for a content
// it does not know, until it has offered what it recovered; then it
// refuses it (ErrNotServed), as a node that took over from none does at
// once.
func TestTakeoverBusyUntilOffered(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.join(tc.config("node-a"))
	waitFor(t, 5*time.Second, "node-a's lease", func() bool { return a.Lease() != 0 })
	p := transport.Piece{Content: hashID([]byte("never offered"))}
	if _, _, err := a.Piece(p, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("a node that took over from none: %v; want ErrNotServed", err)
	}
	cfg := tc.config("node-a")
	cfg.Resume = a.Lease()
	a.Close()
	a2 := tc.join(cfg)
	if _, _, err := a2.Piece(p, nil); !errors.Is(err, transport.ErrBusy) {
		t.Fatalf("a successor before Offered: %v; want ErrBusy", err)
	}
	a2.Offered()
	if _, _, err := a2.Piece(p, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("a successor after Offered: %v; want ErrNotServed", err)
	}
}

// TestServeOnlyVerified checks what a node's piece server refuses: a
// content it does not hold, and a piece it has not verified yet.
func TestServeOnlyVerified(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	data := randomBytes(t, 256<<10)
	slow := newSlowReader(data)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), {Entry: fileEntry("w", data).Entry, Data: slow}}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slow.slow(time.Second)
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	id := v.Entries[1].Content
	creds := tc.creds("node-x")
	tr, err := transport.NewStream(transport.Config{Credentials: creds, Log: tc.config("node-x").Log})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	f := dst(t, 64<<10)
	if _, err := tr.Fetch(ctx, transport.Peer{Name: "node-b", Addr: b.Addr()}, transport.Piece{Content: id}, transport.Dest{File: f, Len: 64 << 10}); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("node-b served a content it does not hold: %v", err)
	}
	p, _ := pullAll(t, b, v)
	for i := range v.Contents[id].Pieces() {
		if _, _, err := b.Piece(transport.Piece{Content: id, Index: i}, nil); !errors.Is(err, transport.ErrNotServed) {
			t.Fatalf("piece %d served before it was verified: %v", i, err)
		}
	}
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Piece(transport.Piece{Content: id, Index: v.Contents[id].Pieces()}, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("a piece past the end is served: %v", err)
	}
	if n, err := tr.Fetch(ctx, transport.Peer{Name: "node-b", Addr: b.Addr()}, transport.Piece{Content: id, Index: 1}, transport.Dest{File: f, Len: 64 << 10}); err != nil || !bytes.Equal(contents(t, f), data[64<<10:128<<10]) {
		t.Fatalf("node-b's piece 1 after the pull: %d bytes, %v", n, err)
	}
}

// TestPullDiskFull pulls into a destination on a full tmpfs: the pull fails
// with ENOSPC and the node announces nothing of it.
func TestPullDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	data := randomBytes(t, 1<<20)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	mnt := t.TempDir()
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=256k"); err != nil {
		t.Fatal(err)
	}
	defer syscall.Unmount(mnt, syscall.MNT_DETACH)
	f, err := os.Create(mnt + "/w")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(len(data))); err != nil {
		t.Fatal(err)
	}
	id := v.Entries[1].Content
	p, err := b.Pull(ctx, []Job{{Content: v.Contents[id], Dst: f}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("pull onto a full tmpfs: %v, want ENOSPC", err)
	}
	waitFor(t, 5*time.Second, "node-b's holder key removed", func() bool {
		resp, err := a.etcd.Get(ctx, a.keys.holder(id, "node-b"))
		return err == nil && len(resp.Kvs) == 0
	})
	if _, _, err := b.Piece(transport.Piece{Content: id}, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("node-b serves a piece of a failed pull: %v", err)
	}
}

// TestJoinRefuses checks the configuration Join refuses.
func TestJoinRefuses(t *testing.T) {
	tc := newTestCluster(t)
	cases := map[string]func(*Config){
		"no endpoints":     func(c *Config) { c.Endpoints = nil },
		"bad name":         func(c *Config) { c.Node = "Node_A" },
		"no credentials":   func(c *Config) { c.Credentials = nil },
		"another's cert":   func(c *Config) { c.Credentials = tc.creds("node-b") },
		"relative prefix":  func(c *Config) { c.Prefix = "tensorfs/" },
		"short lease":      func(c *Config) { c.LeaseTTL = time.Millisecond },
		"unspecified addr": func(c *Config) { c.Listen = "0.0.0.0:0" },
	}
	for name, mod := range cases {
		cfg := tc.config("node-a")
		mod(&cfg)
		if n, err := Join(cfg); !errors.Is(err, ErrInvalid) {
			if n != nil {
				n.Close()
			}
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	// Without Listen, the piece server listens where etcd is reached from.
	cfg := tc.config("node-a")
	cfg.Listen = ""
	n := tc.join(cfg)
	if host, port, _ := net.SplitHostPort(n.Addr()); host != "127.0.0.1" || port != DefaultPort {
		t.Fatalf("default piece server address %s, want 127.0.0.1:%s", n.Addr(), DefaultPort)
	}
}

// TestManifest checks content hashing and addresses.
func TestManifest(t *testing.T) {
	data := randomBytes(t, 3*65536+5)
	c, err := hashContent(bytes.NewReader(data), int64(len(data)), 65536)
	if err != nil {
		t.Fatal(err)
	}
	if c.Pieces() != 4 {
		t.Fatalf("%d pieces", c.Pieces())
	}
	if off, n := c.PieceRange(3); off != 3*65536 || n != 5 {
		t.Fatalf("last piece at %d, %d bytes", off, n)
	}
	again, err := decodeContent(c.ID(), c.encode())
	if err != nil || !reflect.DeepEqual(again, c) {
		t.Fatalf("decode: %+v, %v", again, err)
	}
	tampered := c.encode()
	tampered[len(tampered)-3] ^= 1
	if _, err := decodeContent(c.ID(), tampered); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("tampered content: %v", err)
	}
	if _, err := hashContent(bytes.NewReader(data[:10]), int64(len(data)), 65536); err == nil {
		t.Fatal("hashing past the data succeeded")
	}
	if got := pieceSizeFor(int64(MaxPieces)*DefaultPieceSize+1, DefaultPieceSize); got != 2*DefaultPieceSize {
		t.Fatalf("piece size for a content over MaxPieces pieces: %d", got)
	}
}

// TestCorruptHeldPieceNotServed: a holder whose bytes were changed under
// it (its file written after it was offered) verifies each piece as it
// is asked for, serves none that fails, logs it and stops announcing it;
// the puller fetches every piece from the other holder.
func TestCorruptHeldPieceNotServed(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	cfg := tc.config("node-c")
	cfg.Parallel, cfg.PerPeer = 2, 1
	c := tc.join(cfg)
	ctx := context.Background()
	data := randomBytes(t, 1<<20)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	content := v.Contents[v.Entries[1].Content]
	held := bytes.Clone(data)
	if err := b.Offer(content.ID(), bytes.NewReader(held), int64(len(held))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "node-b announces its copy", func() bool {
		resp, err := a.etcd.Get(ctx, a.keys.holder(content.ID(), "node-b"))
		return err == nil && len(resp.Kvs) == 1
	})
	for off := 100; off < len(held); off += int(content.PieceSize) {
		copy(held[off:], "MALLORY-WAS-HERE") // each piece, changed under node-b
	}
	p, files := pullAll(t, c, v)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ from the published ones")
	}
	if st := c.Stats(); st.BadPieces != 0 {
		t.Errorf("the puller got %d bad pieces: a holder served bytes that fail verification", st.BadPieces)
	}
	if st := b.Stats(); st.BadPieces == 0 || st.PiecesServed != 0 || !tc.logs.contains("a piece held here fails verification; it is not served") {
		t.Errorf("node-b's stats %+v: want the pieces asked of it found bad and logged, none served", st)
	}
	if by := p.Progress().ByPeer; by["node-a"] != int64(len(data)) {
		t.Errorf("verified bytes by peer %v: want all from node-a", by)
	}
	b.mu.Lock()
	left := b.held[content.ID()].bits.count()
	b.mu.Unlock()
	if want := content.Pieces() - int(b.Stats().BadPieces); left != want {
		t.Errorf("node-b holds %d pieces, want %d: those that failed verification are no longer held", left, want)
	}
}

// TestServeSwapsSource: once Serve names another reader of a content, the
// node serves from it and no longer reads the one it was handed (which
// its caller may then close or reuse); Serve of a content the node does
// not hold serves nothing.
func TestServeSwapsSource(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.join(tc.config("node-a")), tc.join(tc.config("node-b"))
	ctx := context.Background()
	data := randomBytes(t, 1<<20)
	handed := bytes.Clone(data)
	e := fileEntry("w", handed)
	info, err := a.Publish(ctx, "m", []LocalEntry{dirEntry("."), e}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := b.Version(ctx, info.Version)
	if err != nil {
		t.Fatal(err)
	}
	id := v.Entries[1].Content
	a.Serve(id, bytes.NewReader(data))
	for i := range handed {
		handed[i] = 0 // the reader Publish was handed is reused
	}
	stranger := hashID([]byte("never held"))
	a.Serve(stranger, bytes.NewReader(data))
	if _, _, err := a.Piece(transport.Piece{Content: stranger}, nil); !errors.Is(err, transport.ErrNotServed) {
		t.Fatalf("a content served without being held: %v", err)
	}
	p, files := pullAll(t, b, v)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ from the published ones")
	}
	if st := a.Stats(); st.BadPieces != 0 || st.PiecesServed == 0 {
		t.Errorf("node-a's stats %+v: want every piece served from the reader Serve named, none bad", st)
	}
}

// failingReader fails every read: a piece verified from what was written
// is never read back.
type failingReader struct{}

func (failingReader) ReadAt([]byte, int64) (int, error) { return 0, errors.New("read back") }

// TestHashedDest: a piece written in order through its destination is
// verified from the hash of what was written, without reading it back,
// and a changed byte fails it; one written out of order is read back.
func TestHashedDest(t *testing.T) {
	data := randomBytes(t, 200<<10)
	c, err := hashContent(bytes.NewReader(data), int64(len(data)), 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	c.id = hashID(c.encode())
	off, n := c.PieceRange(1)
	write := func(piece []byte, order []int64) (*hashedDest, []byte) {
		file := make([]byte, len(data))
		d := newHashedDest(writerAt(file), off)
		for _, at := range order {
			end := min(at+16<<10, n)
			if _, err := d.WriteAt(piece[at:end], off+at); err != nil {
				t.Fatal(err)
			}
		}
		return d, file
	}
	var inOrder, reversed []int64
	for at := int64(0); at < n; at += 16 << 10 {
		inOrder = append(inOrder, at)
		reversed = append([]int64{at}, reversed...)
	}
	if d, _ := write(data[off:off+n], inOrder); d.verifyPiece(c, failingReader{}, 1) != nil {
		t.Error("a good piece written in order fails verification, or was read back")
	}
	bad := bytes.Clone(data[off : off+n])
	bad[n/2] ^= 1
	if d, _ := write(bad, inOrder); !errors.Is(d.verifyPiece(c, failingReader{}, 1), ErrBadCopy) {
		t.Error("a changed piece written in order passes verification")
	}
	d, file := write(data[off:off+n], reversed)
	if err := d.verifyPiece(c, bytes.NewReader(file), 1); err != nil {
		t.Errorf("a good piece written out of order, read back: %v", err)
	}
	if d.verifyPiece(c, failingReader{}, 1) == nil {
		t.Error("a piece written out of order was not read back")
	}
}

// writerAt is a byte slice as an io.WriterAt.
type writerAt []byte

func (w writerAt) WriteAt(b []byte, off int64) (int, error) { return copy(w[off:], b), nil }
