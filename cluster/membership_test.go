package cluster

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"tensorfs/cluster/transport"
	"tensorfs/cluster/transport/fake"
)

// gatedSource serves its node's pieces one at a time, the first limit
// at once and the others once open is closed, and records the pieces
// asked for and those it sent, in the order it chose them.
type gatedSource struct {
	transport.Source
	limit int
	open  chan struct{}
	one   sync.Mutex // held while a piece is chosen, read and recorded

	mu          sync.Mutex
	served      int
	asked, sent []int
}

func (s *gatedSource) Piece(p transport.Piece, accept []byte) (int, []byte, error) {
	s.mu.Lock()
	s.served++
	held := s.served > s.limit
	s.mu.Unlock()
	if held {
		<-s.open
	}
	s.one.Lock()
	defer s.one.Unlock()
	i, b, err := s.Source.Piece(p, accept)
	if err == nil {
		s.mu.Lock()
		s.asked, s.sent = append(s.asked, p.Index), append(s.sent, i)
		s.mu.Unlock()
	}
	return i, b, err
}

// gatedTransport is a transport whose server is a gatedSource.
type gatedTransport struct {
	transport.Transport
	src *gatedSource
}

func (t gatedTransport) Start(src transport.Source) error {
	t.src.Source = src
	return t.Transport.Start(t.src)
}

// holderKeys returns the holder keys of content id by node: each with
// its value and version (how many times it was written since made).
func holderKeys(t *testing.T, n *Node, id string) map[string]*mvccpb.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := n.etcd.Get(ctx, n.keys.holders(id), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*mvccpb.KeyValue{}
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), n.keys.holders(id))] = kv
	}
	return out
}

// TestPullLearnsFromMembers: a puller learns which pieces a member (a
// node pulling the content, whose holder key says only "partial") holds
// from the member itself, over the transport, and fetches them from it:
// with the publisher holding back all but the 16 pieces it sent the
// first puller, the second gets them from the first (but for those it
// asked the publisher for before the first told it what it had); etcd
// holds one key per node per content all along, written when its node
// began holding the content and when it held all of it (and once more,
// the same, if the node's join rewrote what it holds after its pull
// began), however many pieces move. Over the fake transport and the
// real one.
func TestPullLearnsFromMembers(t *testing.T) {
	t.Run("fake", func(t *testing.T) {
		nw := fake.NewNetwork()
		testPullLearnsFromMembers(t, func(name string) transport.Transport { return nw.New(name, 0) })
	})
	t.Run("stream", func(t *testing.T) { testPullLearnsFromMembers(t, nil) })
}

// testPullLearnsFromMembers is TestPullLearnsFromMembers over the
// transports newTr makes (nil: Stream transports on loopback).
func testPullLearnsFromMembers(t *testing.T, newTr func(name string) transport.Transport) {
	tc := newTestCluster(t)
	tr := func(name string) transport.Transport {
		if newTr != nil {
			return newTr(name)
		}
		s, err := transport.NewStream(transport.Config{Listen: "127.0.0.1:0", Credentials: tc.creds(name)})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	gate := &gatedSource{limit: 16, open: make(chan struct{})}
	opened := sync.OnceFunc(func() { close(gate.open) })
	t.Cleanup(opened)
	cfgA := tc.config("node-a")
	cfgA.Transport = gatedTransport{tr("node-a"), gate}
	a := tc.join(cfgA)
	ctx := context.Background()
	data, vid := publishFile(t, a, 2<<20) // 32 pieces of 64 KiB: node-a sends 16 at first
	pull := func(name string) (*Pull, map[string]*os.File, string) {
		cfg := tc.config(name)
		cfg.Transport = tr(name)
		n := tc.join(cfg)
		v, err := n.Version(ctx, vid)
		if err != nil {
			t.Fatal(err)
		}
		p, f := pullAll(t, n, v)
		return p, f, v.Entries[1].Content
	}
	// checkKeys checks etcd has a key per node of those named: complete
	// for the publisher, partial for the others, each written at most
	// twice (once, and perhaps by its join's rewrite).
	checkKeys := func(id string, nodes ...string) {
		t.Helper()
		keys := holderKeys(t, a, id)
		if len(keys) != len(nodes) {
			t.Fatalf("holder keys %v: want one for each of %v", keys, nodes)
		}
		for _, node := range nodes {
			kv := keys[node]
			want := holderPartial
			if node == "node-a" {
				want = holderComplete
			}
			if kv == nil || string(kv.Value) != want || kv.Version > 2 {
				t.Fatalf("%s's holder key %v: want %q, written at most twice", node, kv, want)
			}
		}
	}
	pb, filesB, id := pull("node-b")
	waitFor(t, 10*time.Second, "node-b holds 16 pieces", func() bool { return pb.Progress().Bytes == 1<<20 })
	checkKeys(id, "node-a", "node-b")
	pc, filesC, _ := pull("node-c")
	const piece = 64 << 10
	waitFor(t, 10*time.Second, "node-c holds node-b's pieces", func() bool {
		return pc.Progress().ByPeer["node-b"] >= (16-DefaultPerPeer)*piece
	})
	checkKeys(id, "node-a", "node-b", "node-c")
	if by := pc.Progress().ByPeer; by["node-a"] != 0 {
		t.Fatalf("node-c fetched %v: node-a sends nothing meanwhile", by)
	}
	opened()
	for _, pf := range []struct {
		p     *Pull
		files map[string]*os.File
	}{{pb, filesB}, {pc, filesC}} {
		if err := pf.p.Wait(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(contents(t, pf.files["w"]), data) {
			t.Fatal("pulled bytes differ")
		}
	}
	waitFor(t, 5*time.Second, "every node's key says complete, written at most three times", func() bool {
		keys := holderKeys(t, a, id)
		for _, kv := range keys {
			if string(kv.Value) != holderComplete || kv.Version > 3 {
				return false
			}
		}
		return len(keys) == 3
	})
}

// hiddenTransport is a fake transport whose node refuses to be watched:
// its peers learn nothing of which pieces it holds.
type hiddenTransport struct{ *fake.Transport }

func (t hiddenTransport) Start(src transport.Source) error {
	return t.Transport.Start(hiddenSource{src})
}

type hiddenSource struct{ transport.Source }

func (hiddenSource) Holding([]string) (transport.Watcher, error) {
	return nil, fmt.Errorf("%w: hidden", transport.ErrBusy)
}

// TestSuperSeed: the publisher, the only holder, sends no piece twice
// before it has sent every piece once, however the pullers ask: asked
// for a piece, it sends the one it has sent least of those the puller
// lacks. The pullers refuse to be watched, so each knows of the
// publisher's pieces only, as a puller of a large cluster knows of 32
// members' (without super-seeding they ask it for the same pieces); each
// ends with the published bytes.
func TestSuperSeed(t *testing.T) {
	tc := newTestCluster(t)
	nw := fake.NewNetwork()
	gate := &gatedSource{open: make(chan struct{})} // node-a sends once every pull began
	opened := sync.OnceFunc(func() { close(gate.open) })
	t.Cleanup(opened)
	cfgA := tc.config("node-a")
	cfgA.Transport = gatedTransport{nw.New("node-a", 0), gate}
	a := tc.join(cfgA)
	ctx := context.Background()
	data, vid := publishFile(t, a, 2<<20) // 32 pieces
	var pulls []*Pull
	var files []map[string]*os.File
	for _, name := range []string{"node-b", "node-c", "node-d"} {
		cfg := tc.config(name)
		cfg.Transport = hiddenTransport{nw.New(name, 0)}
		cfg.Parallel, cfg.PerPeer = 1, 1 // each request accepts every piece its puller lacks
		n := tc.join(cfg)
		v, err := n.Version(ctx, vid)
		if err != nil {
			t.Fatal(err)
		}
		p, f := pullAll(t, n, v)
		pulls, files = append(pulls, p), append(files, f)
	}
	opened()
	for i, p := range pulls {
		if err := p.Wait(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(contents(t, files[i]["w"]), data) {
			t.Fatalf("pull %d: bytes differ", i)
		}
	}
	gate.mu.Lock()
	defer gate.mu.Unlock()
	t.Logf("node-a was asked for %v, sent %v", gate.asked, gate.sent)
	if len(gate.sent) < 32 {
		t.Fatalf("node-a sent %d pieces: want every one at least once", len(gate.sent))
	}
	first := slices.Clone(gate.sent[:32])
	slices.Sort(first)
	if len(slices.Compact(first)) != 32 {
		t.Fatalf("node-a's first 32 sends %v: a piece went twice before every piece once", gate.sent[:32])
	}
}

// claimingTransport is a fake transport whose node tells those who
// watch it that it holds every piece of the contents it holds part of.
type claimingTransport struct{ *fake.Transport }

func (t claimingTransport) Start(src transport.Source) error {
	return t.Transport.Start(claimingSource{src})
}

type claimingSource struct{ transport.Source }

func (s claimingSource) Holding(ids []string) (transport.Watcher, error) {
	w, err := s.Source.Holding(ids)
	return claimingWatcher{w}, err
}

type claimingWatcher struct{ transport.Watcher }

func (w claimingWatcher) Bits(i int) []byte {
	b := w.Watcher.Bits(i)
	for k := range b {
		b[k] = 0xff
	}
	return b
}

// TestLyingMember: a member that claims, over the transport, pieces it
// lacks is asked for them, refuses each (it serves only what it holds),
// and the puller fetches them from the publisher: its bitmap is a hint,
// and the pull ends with the published bytes.
func TestLyingMember(t *testing.T) {
	tc := newTestCluster(t)
	nw := fake.NewNetwork()
	config := func(name string, tr transport.Transport) Config {
		cfg := tc.config(name)
		cfg.Transport = tr
		return cfg
	}
	gate := &gatedSource{open: make(chan struct{})} // node-a sends once node-c heard node-b
	opened := sync.OnceFunc(func() { close(gate.open) })
	t.Cleanup(opened)
	a := tc.join(config("node-a", gatedTransport{nw.New("node-a", 0), gate}))
	b := tc.join(config("node-b", claimingTransport{nw.New("node-b", 0)}))
	c := tc.join(config("node-c", nw.New("node-c", 0)))
	ctx := context.Background()
	data, vid := publishFile(t, a, 1<<20) // 16 pieces
	v, err := b.Version(ctx, vid)
	if err != nil {
		t.Fatal(err)
	}
	content := v.Contents[v.Entries[1].Content]
	if err := b.hold(content, dst(t, content.Size), newBitmap(content.Pieces()), true); err != nil { // a member holding nothing
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "node-b's holder key", func() bool {
		kv := holderKeys(t, a, content.ID())["node-b"]
		return kv != nil && string(kv.Value) == holderPartial
	})
	p, files := pullAll(t, c, v)
	waitFor(t, 5*time.Second, "node-c hears from node-b", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		h := p.groups[0].holders["node-b"]
		return h != nil && h.bits.count() == content.Pieces()
	})
	opened()
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(contents(t, files["w"]), data) {
		t.Fatal("pulled bytes differ")
	}
	if by := p.Progress().ByPeer; by["node-a"] != int64(len(data)) {
		t.Errorf("node-c fetched %v: want every piece from node-a", by)
	}
	if c.Stats().FailedFetches == 0 || b.Stats().PiecesServed != 0 || !tc.logs.contains("cluster: peer does not serve a piece it announced; asking another") {
		t.Errorf("node-c: %+v, node-b: %+v: want node-c to have asked node-b, node-b to have served nothing, and the refusals logged", c.Stats(), b.Stats())
	}
}

// publishFile publishes on n a directory "m" of one file "w" of size
// random bytes, and returns them and the version's ID.
func publishFile(t *testing.T, n *Node, size int) ([]byte, string) {
	t.Helper()
	data := randomBytes(t, size)
	info, err := n.Publish(context.Background(), "m", []LocalEntry{dirEntry("."), fileEntry("w", data)}, PublishOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return data, info.Version
}
