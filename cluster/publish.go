package cluster

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// maxTxnBytes bounds the values written by one transaction (etcd refuses
// requests over 1.5 MiB by default).
const maxTxnBytes = 1 << 20

// LocalEntry is an entry to publish and, for a file, its bytes.
type LocalEntry struct {
	Entry
	// Data holds a file's Entry.Size bytes; nil for a directory. The node
	// serves the published pieces from it until Drop or Serve: it must not
	// change.
	Data io.ReaderAt
}

// DirInfo is the current version of a published directory.
type DirInfo struct {
	Dir       string    `json:"-"`
	Version   string    `json:"version"`
	Publisher string    `json:"publisher"`
	UID       uint32    `json:"uid"` // the publisher's uid: what the directory holds is charged to it
	Time      time.Time `json:"time"`
	Prev      string    `json:"prev,omitempty"` // the version it replaced
	Kept      []string  `json:"kept,omitempty"` // earlier versions still in etcd, newest first
}

// DirEvent is a change to the published directories.
type DirEvent struct {
	DirInfo
	Deleted bool // the directory was unpublished
	// Missed is set on a deletion found by reading the directories again
	// (at the start, or after the watch broke), not seen as it happened:
	// the directory was unpublished, or etcd lost it.
	Missed bool
}

// manifestSlack is what a version's header and the number in it add to
// the bytes of its keys, at most.
const manifestSlack = 128

// Publish makes entries (a whole tree: "." and every parent of every path)
// the current version of dir, cluster-wide, for opts.UID, and serves its
// files' pieces from their Data. Files are hashed here (Entry.Content is
// ignored); set-id bits (and a file's sticky bit) are not published.
// Publishing what is already current changes nothing. Concurrent
// publishers of one dir are ordered; each version records the one it
// replaced, and versions past opts.Keep are deleted with the swap.
// Fails with ErrInvalid for a bad name or entry, ErrUnavailable when
// etcd does not answer, and with opts.Admit's error, having written
// nothing, when it refuses.
func (n *Node) Publish(ctx context.Context, dir string, local []LocalEntry, opts PublishOptions) (DirInfo, error) {
	if err := CheckDir(dir); err != nil {
		return DirInfo{}, err
	}
	local = slices.Clone(local)
	slices.SortFunc(local, func(a, b LocalEntry) int { return entryOrder(a.Entry, b.Entry) })
	entries := make([]Entry, len(local))
	for i := range local {
		e := &local[i].Entry
		strip := uint32(0o7000) // a file's set-id and sticky bits
		if e.IsDir() {
			strip = 0o6000 // a directory keeps its sticky bit
		}
		if e.Mode&strip != 0 {
			n.log.Info("cluster: publishing without set-id bits", "dir", dir, "path", e.Path, "mode", fmt.Sprintf("%o", e.Mode))
			e.Mode &^= strip
		}
		if !e.IsDir() && local[i].Data == nil {
			return DirInfo{}, fmt.Errorf("%w: %s: file %q has no data", ErrInvalid, dir, e.Path)
		}
		if err := e.check(); err != nil {
			return DirInfo{}, fmt.Errorf("%w: %s: %w", ErrInvalid, dir, err)
		}
		entries[i] = *e
	}
	if err := checkTree(entries); err != nil {
		return DirInfo{}, fmt.Errorf("%s: %w", dir, err)
	}
	contents, err := n.hashFiles(local)
	if err != nil {
		return DirInfo{}, fmt.Errorf("cluster: publish %s: %w", dir, err)
	}
	encoded := make([][]byte, len(entries))
	for i := range entries {
		if c := contents[i]; c != nil {
			entries[i].Content = c.ID()
		}
		encoded[i] = encodeEntry(&entries[i])
	}
	vid := versionID(encoded)
	ops, header := n.versionOps(vid, entries, encoded, contents)

	if _, err := n.lease(ctx); err != nil {
		return DirInfo{}, fmt.Errorf("cluster: publish %s: %w", dir, err)
	}
	ns, err := n.readNamespace(ctx)
	if err == nil && ns.dirs[dir].Version != vid {
		_, _, err = n.admit(ns, dir, vid, header, opts)
	}
	if err != nil {
		return DirInfo{}, fmt.Errorf("cluster: publish %s: %w", dir, err)
	}
	// Serve the pieces before any key names them.
	var added []string
	seen := map[string]bool{}
	for i, c := range contents {
		if c == nil || seen[c.ID()] {
			continue
		}
		seen[c.ID()] = true
		bits := newBitmap(c.Pieces())
		bits.fill(c.Pieces())
		if n.hold(c, local[i].Data, bits, false) == nil {
			added = append(added, c.ID())
		}
	}
	info, err := n.publish(ctx, dir, vid, header, ops, opts)
	if err != nil {
		for _, id := range added {
			n.Drop(id)
		}
		return DirInfo{}, fmt.Errorf("cluster: publish %s: %w", dir, err)
	}
	n.log.Info("cluster: published", "dir", dir, "version", vid, "entries", len(entries), "prev", info.Prev, "uid", info.UID)
	return info, nil
}

// versionOps returns the writes of version vid's keys: its header first
// (the collection of contents leaves the references of a version whose
// header exists: see collectContents), then, for each of its contents,
// its reference and the content, then its entries; and the header, which
// records the bytes they take in etcd.
func (n *Node) versionOps(vid string, entries []Entry, encoded [][]byte, contents []*Content) ([]clientv3.Op, versionHeader) {
	var ops []clientv3.Op
	h := versionHeader{Entries: len(entries), Manifest: int64(len(n.keys.version(vid)) + manifestSlack)}
	seen := map[string]bool{}
	for _, c := range contents {
		if c == nil || seen[c.ID()] {
			continue
		}
		seen[c.ID()] = true
		ops = append(ops, clientv3.OpPut(n.keys.ref(c.ID(), vid), ""), clientv3.OpPut(n.keys.content(c.ID()), string(c.encode())))
	}
	for i := range entries {
		ops = append(ops, clientv3.OpPut(n.keys.entry(vid, entries[i].Path), string(encoded[i])))
		h.Bytes += entries[i].Size
	}
	for _, op := range ops {
		h.Manifest += int64(len(op.KeyBytes()) + len(op.ValueBytes()))
	}
	header, _ := json.Marshal(h)
	return append([]clientv3.Op{clientv3.OpPut(n.keys.version(vid), string(header))}, ops...), h
}

// admit checks that opts.UID may change dir (mayChange) and asks
// opts.Admit whether dir may become version vid (whose header is h) on
// what ns read, and returns the record that makes it so and the
// versions that record no longer keeps.
func (n *Node) admit(ns *namespace, dir, vid string, h versionHeader, opts PublishOptions) (DirInfo, []string, error) {
	cur, published := ns.dirs[dir]
	cur.Dir = dir
	if err := mayChange(cur, published, opts.UID); err != nil {
		return DirInfo{}, nil, err
	}
	next, dropped := successor(cur, vid, cmp.Or(opts.Keep, DefaultKeep))
	next.UID, next.Publisher, next.Time = opts.UID, n.cfg.Node, time.Now().UTC()
	if opts.Admit == nil {
		return next, dropped, nil
	}
	ns.headers[vid] = h
	return next, dropped, opts.Admit(ns.usages(), ns.usage(cur), ns.usage(next))
}

// mayChange refuses a change of the directory cur by uid unless it is not
// published, uid published it, or uid is root: ErrNotPublisher, naming
// the publisher.
func mayChange(cur DirInfo, published bool, uid uint32) error {
	if !published || uid == 0 || uid == cur.UID {
		return nil
	}
	return fmt.Errorf("%w: %s is published by uid %d: only that uid, or root, may publish a new version of it or unpublish it (uid %d asked)", ErrNotPublisher, cur.Dir, cur.UID, uid)
}

// publish writes a version's keys (ops), then the publisher's holder
// keys, and swaps dir to it, deleting the versions it no longer keeps in
// the same transaction; a publish that fails after its first write
// (refused at the swap, or etcd failing part way) deletes the keys it
// wrote, unless a directory names the version. Keys deleted meanwhile by
// a swap that dropped the same version are written again.
func (n *Node) publish(ctx context.Context, dir, vid string, h versionHeader, ops []clientv3.Op, opts PublishOptions) (_ DirInfo, err error) {
	defer func() {
		if err != nil {
			n.discard(n.ctx, vid) // even when ctx has ended
		}
	}()
	if err := n.putAll(ctx, ops); err != nil {
		return DirInfo{}, err
	}
	if err := n.flush(); err != nil {
		return DirInfo{}, err
	}
	for {
		ns, err := n.readNamespace(ctx)
		if err != nil {
			return DirInfo{}, err
		}
		if cur := ns.dirs[dir]; cur.Version == vid {
			return cur, nil
		}
		if _, ok := ns.headers[vid]; !ok {
			if err := n.putAll(ctx, ops); err != nil {
				return DirInfo{}, err
			}
			continue
		}
		info, dropped, err := n.admit(ns, dir, vid, h, opts)
		if err != nil {
			return DirInfo{}, err
		}
		value, _ := json.Marshal(info)
		ok, err := n.swap(ctx, ns, dir, []clientv3.Op{clientv3.OpPut(n.keys.dir(dir), string(value))}, dropped,
			clientv3.Compare(clientv3.CreateRevision(n.keys.version(vid)), ">", 0))
		if err != nil {
			return DirInfo{}, err
		}
		if ok {
			return info, nil
		}
	}
}

// discard deletes the keys of version vid, written by a publish that
// then failed, unless a directory keeps it.
func (n *Node) discard(ctx context.Context, vid string) {
	for {
		ns, err := n.readNamespace(ctx)
		var ok bool
		if err == nil {
			ok, err = n.swap(ctx, ns, "", nil, []string{vid})
		}
		if err != nil {
			n.log.Warn("cluster: a refused version's keys stay in etcd", "version", vid, "err", err)
			return
		}
		if ok {
			return
		}
	}
}

// putAll writes ops in transactions of at most maxTxnOps operations and
// about maxTxnBytes bytes.
func (n *Node) putAll(ctx context.Context, ops []clientv3.Op) error {
	for len(ops) > 0 {
		k, size := 0, 0
		for k < len(ops) && k < maxTxnOps && (k == 0 || size+len(ops[k].ValueBytes()) <= maxTxnBytes) {
			size += len(ops[k].ValueBytes())
			k++
		}
		tctx, cancel := n.timeout(ctx)
		_, err := n.etcd.Txn(tctx).Then(ops[:k]...).Commit()
		cancel()
		if err != nil {
			return n.etcdErr("write manifests", err)
		}
		ops = ops[k:]
	}
	return nil
}

// hashFiles hashes the files of local, several at once; the result has a
// Content at each file's index.
func (n *Node) hashFiles(local []LocalEntry) ([]*Content, error) {
	out := make([]*Content, len(local))
	errs := make([]error, len(local))
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	var wg sync.WaitGroup
	for i := range local {
		if local[i].IsDir() {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			out[i], errs[i] = hashContent(local[i].Data, local[i].Size, n.cfg.PieceSize)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("hash %q: %w", local[i].Path, errs[i])
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// getDir returns dir's current version and its key's ModRevision (0 and a
// zero DirInfo when it is not published).
func (n *Node) getDir(ctx context.Context, dir string) (DirInfo, int64, error) {
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Get(tctx, n.keys.dir(dir))
	if err != nil {
		return DirInfo{}, 0, n.etcdErr("look up "+dir, err)
	}
	if len(resp.Kvs) == 0 {
		return DirInfo{Dir: dir}, 0, nil
	}
	info, err := decodeDir(dir, resp.Kvs[0].Value)
	return info, resp.Kvs[0].ModRevision, err
}

// decodeDir parses the value of a dirs/ key, whose name is dir.
func decodeDir(dir string, b []byte) (DirInfo, error) {
	info := DirInfo{Dir: dir}
	if err := CheckDir(dir); err != nil {
		return info, fmt.Errorf("%w: directory %q: %v", ErrCorrupt, dir, err)
	}
	if err := json.Unmarshal(b, &info); err != nil || !validID(info.Version) || slices.ContainsFunc(info.Kept, invalidID) {
		return info, fmt.Errorf("%w: directory %s: %q", ErrCorrupt, dir, b)
	}
	return info, nil
}

// invalidID reports whether s is not a valid ID.
func invalidID(s string) bool { return !validID(s) }

// Lookup returns the current version of a published directory, or
// ErrNotPublished.
func (n *Node) Lookup(ctx context.Context, dir string) (DirInfo, error) {
	if err := CheckDir(dir); err != nil {
		return DirInfo{}, err
	}
	info, rev, err := n.getDir(ctx, dir)
	if err == nil && rev == 0 {
		err = fmt.Errorf("cluster: %s: %w", dir, ErrNotPublished)
	}
	return info, err
}

// Dirs returns every published directory and the etcd revision they were
// read at.
func (n *Node) Dirs(ctx context.Context) ([]DirInfo, int64, error) {
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Get(tctx, n.keys.dirs(), clientv3.WithPrefix())
	if err != nil {
		return nil, 0, n.etcdErr("list published directories", err)
	}
	var out []DirInfo
	for _, kv := range resp.Kvs {
		dir := strings.TrimPrefix(string(kv.Key), n.keys.dirs())
		info, err := decodeDir(dir, kv.Value)
		if err != nil {
			n.log.Warn("cluster: skipping a corrupt directory key", "err", err)
			continue
		}
		out = append(out, info)
	}
	return out, resp.Header.Revision, nil
}

// Unpublish removes a directory from the cluster's namespace for uid, and
// its versions with it unless another directory keeps them: only its
// publisher or root may (ErrNotPublisher). Every node keeps serving what
// it holds until it drops it.
func (n *Node) Unpublish(ctx context.Context, dir string, uid uint32) error {
	if err := CheckDir(dir); err != nil {
		return err
	}
	for {
		ns, err := n.readNamespace(ctx)
		if err != nil {
			return err
		}
		cur, ok := ns.dirs[dir]
		if !ok {
			return fmt.Errorf("cluster: %s: %w", dir, ErrNotPublished)
		}
		if err := mayChange(cur, true, uid); err != nil {
			return err
		}
		ok, err = n.swap(ctx, ns, dir, []clientv3.Op{clientv3.OpDelete(n.keys.dir(dir))}, cur.versions())
		if err != nil {
			return err
		}
		if ok {
			n.log.Info("cluster: unpublished", "dir", dir)
			return nil
		}
	}
}

// Version reads a published version: its entries, checked against its ID,
// and the contents of its files, checked against theirs.
func (n *Node) Version(ctx context.Context, vid string) (*Version, error) {
	if !validID(vid) {
		return nil, fmt.Errorf("%w: version ID %q", ErrInvalid, vid)
	}
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Txn(tctx).Then(
		clientv3.OpGet(n.keys.version(vid)),
		clientv3.OpGet(n.keys.entries(vid), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, n.etcdErr("read version "+vid, err)
	}
	hkv, ekv := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(hkv) == 0 {
		return nil, fmt.Errorf("cluster: version %s: %w", vid, ErrNotPublished)
	}
	var header versionHeader
	if err := json.Unmarshal(hkv[0].Value, &header); err != nil || header.Entries != len(ekv) {
		return nil, fmt.Errorf("%w: version %s: header %q, %d entries", ErrCorrupt, vid, hkv[0].Value, len(ekv))
	}
	v := &Version{ID: vid, Entries: make([]Entry, len(ekv)), Contents: map[string]*Content{}}
	raw := map[string][]byte{}
	for i, kv := range ekv {
		e := &v.Entries[i]
		if err := json.Unmarshal(kv.Value, e); err != nil || n.keys.entry(vid, e.Path) != string(kv.Key) {
			return nil, fmt.Errorf("%w: version %s: entry %q", ErrCorrupt, vid, kv.Key)
		}
		if err := e.check(); err != nil {
			return nil, fmt.Errorf("%w: version %s: %v", ErrCorrupt, vid, err)
		}
		raw[e.Path] = kv.Value
	}
	slices.SortFunc(v.Entries, entryOrder)
	encoded := make([][]byte, len(v.Entries))
	for i := range v.Entries {
		encoded[i] = raw[v.Entries[i].Path]
	}
	if versionID(encoded) != vid {
		return nil, fmt.Errorf("%w: version %s: its entries do not hash to its ID", ErrCorrupt, vid)
	}
	if err := checkTree(v.Entries); err != nil {
		return nil, fmt.Errorf("%w: version %s: %v", ErrCorrupt, vid, err)
	}
	var ids []string
	for i := range v.Entries {
		if e := &v.Entries[i]; !e.IsDir() {
			if !validID(e.Content) {
				return nil, fmt.Errorf("%w: version %s: %q: content %q", ErrCorrupt, vid, e.Path, e.Content)
			}
			ids = append(ids, e.Content)
		}
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	for len(ids) > 0 {
		k := min(len(ids), maxTxnOps)
		if err := n.getContents(ctx, ids[:k], v.Contents); err != nil {
			return nil, err
		}
		ids = ids[k:]
	}
	for i := range v.Entries {
		if e := &v.Entries[i]; !e.IsDir() && v.Contents[e.Content].Size != e.Size {
			return nil, fmt.Errorf("%w: version %s: %q has %d bytes, its content %d", ErrCorrupt, vid, e.Path, e.Size, v.Contents[e.Content].Size)
		}
	}
	return v, nil
}

// getContents reads the contents ids (at most maxTxnOps) into out.
func (n *Node) getContents(ctx context.Context, ids []string, out map[string]*Content) error {
	ops := make([]clientv3.Op, len(ids))
	for i, id := range ids {
		ops[i] = clientv3.OpGet(n.keys.content(id))
	}
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Txn(tctx).Then(ops...).Commit()
	if err != nil {
		return n.etcdErr("read contents", err)
	}
	for i, id := range ids {
		kvs := resp.Responses[i].GetResponseRange().Kvs
		if len(kvs) == 0 {
			return fmt.Errorf("cluster: content %s: %w", id, ErrNotPublished)
		}
		c, err := decodeContent(id, kvs[0].Value)
		if err != nil {
			return err
		}
		out[id] = c
	}
	return nil
}

// Content reads one published content.
func (n *Node) Content(ctx context.Context, id string) (*Content, error) {
	if !validID(id) {
		return nil, fmt.Errorf("%w: content ID %q", ErrInvalid, id)
	}
	out := map[string]*Content{}
	if err := n.getContents(ctx, []string{id}, out); err != nil {
		return nil, err
	}
	return out[id], nil
}

// Watch sends the published directories as they are, then every change,
// until ctx ends (then it closes the channel). known are the directories
// the caller holds already: each one not published is sent as deleted
// (Missed).
// While etcd is unreachable it waits; when etcd returns it goes on where
// it left off, or, if that history is gone (compacted), sends what
// changed meanwhile, deletions included (watchPrefix).
func (n *Node) Watch(ctx context.Context, known []string) <-chan DirEvent {
	ch := make(chan DirEvent, 16)
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(n.ctx, cancel) // end with the node too
	seed := map[string]int64{}
	for _, dir := range known {
		seed[n.keys.dir(dir)] = 0
	}
	go func() {
		defer close(ch)
		defer stop()
		defer cancel()
		n.watchPrefix(ctx, n.keys.dirs(), seed, 0, func(ev *clientv3.Event) bool {
			dir := strings.TrimPrefix(string(ev.Kv.Key), n.keys.dirs())
			de := DirEvent{DirInfo: DirInfo{Dir: dir}, Deleted: ev.Type == clientv3.EventTypeDelete}
			de.Missed = de.Deleted && ev.Kv.ModRevision == 0
			if !de.Deleted {
				info, err := decodeDir(dir, ev.Kv.Value)
				if err != nil {
					n.log.Warn("cluster: skipping a corrupt directory key", "err", err)
					return true
				}
				de.DirInfo = info
			}
			select {
			case ch <- de:
				return true
			case <-ctx.Done():
				return false
			}
		})
	}()
	return ch
}
