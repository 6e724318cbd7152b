package cluster

// What publishers hold in etcd, read from the namespace itself (no count
// is kept anywhere else), and the collection of versions no directory
// keeps any longer.

import (
	"context"
	"encoding/json"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultKeep is how many versions of a directory stay in etcd, the
// current one included (PublishOptions.Keep).
const DefaultKeep = 2

// Usage is what published directories hold in etcd.
type Usage struct {
	Dirs     int64 // published directories
	Versions int64 // versions kept, the current ones included
	Entries  int64 // entries (files and directories) of those versions
	Bytes    int64 // bytes of their keys and values in etcd
}

// DirUsage is what one published directory holds, charged to the uid
// that published its current version.
type DirUsage struct {
	UID uint32
	Usage
}

// PublishOptions says who publishes and what bounds them.
type PublishOptions struct {
	// UID is the publisher's uid, recorded with the directory: what it
	// holds in etcd is charged to it.
	UID uint32
	// Keep is how many versions of the directory stay in etcd, the new
	// one included (DefaultKeep if 0); older ones are deleted with the
	// swap to the new one.
	Keep int
	// Admit, if set, decides whether the publish may go on: all is what
	// every uid's directories hold (the directory's current version
	// included), was what the directory holds now (zero if it is not
	// published) and now what it will hold. It is asked before anything
	// is written and again, at the revision it swaps at, before the
	// swap: an error refuses the publish.
	Admit func(all map[uint32]Usage, was, now DirUsage) error
}

// namespace is the published directories and the headers of the
// versions in etcd, read at one revision.
type namespace struct {
	keys    keys
	rev     int64
	dirs    map[string]DirInfo
	headers map[string]versionHeader
}

// readNamespace reads the published directories and version headers.
func (n *Node) readNamespace(ctx context.Context) (*namespace, error) {
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Txn(tctx).Then(
		clientv3.OpGet(n.keys.dirs(), clientv3.WithPrefix()),
		clientv3.OpGet(n.keys.versions(), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, n.etcdErr("read the published directories", err)
	}
	ns := &namespace{keys: n.keys, rev: resp.Header.Revision, dirs: map[string]DirInfo{}, headers: map[string]versionHeader{}}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		dir := strings.TrimPrefix(string(kv.Key), n.keys.dirs())
		info, err := decodeDir(dir, kv.Value)
		if err != nil {
			// No node makes it, and it names no publisher to charge.
			n.log.Warn("cluster: skipping a corrupt directory key", "err", err)
			continue
		}
		ns.dirs[dir] = info
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		var h versionHeader
		if err := json.Unmarshal(kv.Value, &h); err != nil {
			n.log.Warn("cluster: skipping a corrupt version header", "key", string(kv.Key))
			continue
		}
		ns.headers[strings.TrimPrefix(string(kv.Key), n.keys.versions())] = h
	}
	return ns, nil
}

// usage returns what the directory info holds: its versions' entries
// and manifest bytes, and its own key.
func (ns *namespace) usage(info DirInfo) DirUsage {
	u := DirUsage{UID: info.UID}
	if info.Version == "" {
		return u
	}
	value, _ := json.Marshal(info)
	u.Dirs, u.Bytes = 1, int64(len(ns.keys.dir(info.Dir))+len(value))
	for _, vid := range info.versions() {
		h := ns.headers[vid]
		u.Versions++
		u.Entries += int64(h.Entries)
		u.Bytes += h.Manifest
	}
	return u
}

// usages returns what each uid's directories hold.
func (ns *namespace) usages() map[uint32]Usage {
	all := map[uint32]Usage{}
	for _, info := range ns.dirs {
		d := ns.usage(info)
		u := all[d.UID]
		u.Dirs += d.Dirs
		u.Versions += d.Versions
		u.Entries += d.Entries
		u.Bytes += d.Bytes
		all[d.UID] = u
	}
	return all
}

// kept reports whether a directory other than dir keeps version vid.
func (ns *namespace) kept(vid, dir string) bool {
	for d, info := range ns.dirs {
		if d != dir && slices.Contains(info.versions(), vid) {
			return true
		}
	}
	return false
}

// versions returns the versions the directory keeps, newest first.
func (info DirInfo) versions() []string {
	if info.Version == "" {
		return nil
	}
	return append([]string{info.Version}, info.Kept...)
}

// successor returns the record that makes vid the current version of
// the directory cur is, keeping keep versions, and the versions it no
// longer keeps.
func successor(cur DirInfo, vid string, keep int) (DirInfo, []string) {
	next := DirInfo{Dir: cur.Dir, Version: vid, Prev: cur.Version}
	var dropped []string
	for _, v := range cur.versions() {
		switch {
		case v == vid:
		case len(next.Kept)+1 < keep:
			next.Kept = append(next.Kept, v)
		default:
			dropped = append(dropped, v)
		}
	}
	return next, dropped
}

// swap commits ops (a change of dir's key) if no published directory
// changed since ns was read and cmps hold, deleting in the same
// transaction the versions dropped that no other directory keeps (their
// entries and headers), then the contents only they used. It reports
// whether it committed.
func (n *Node) swap(ctx context.Context, ns *namespace, dir string, ops []clientv3.Op, dropped []string, cmps ...clientv3.Cmp) (bool, error) {
	gone := map[string][]string{}
	for _, vid := range dropped {
		if !validID(vid) || ns.kept(vid, dir) {
			continue
		}
		cids, err := n.versionContents(ctx, vid)
		if err != nil {
			return false, err
		}
		gone[vid] = cids
		ops = append(ops, clientv3.OpDelete(n.keys.entries(vid), clientv3.WithPrefix()), clientv3.OpDelete(n.keys.version(vid)))
	}
	tctx, cancel := n.timeout(ctx)
	resp, err := n.etcd.Txn(tctx).If(append(cmps, n.unchanged(ns))...).Then(ops...).Commit()
	cancel()
	if err != nil {
		return false, n.etcdErr("change "+dir, err)
	}
	if !resp.Succeeded {
		return false, nil
	}
	for vid, cids := range gone {
		n.collectContents(ctx, vid, cids)
	}
	if len(gone) > 0 {
		n.log.Info("cluster: versions no directory keeps deleted", "dir", dir, "versions", len(gone))
	}
	return true, nil
}

// versionContents returns the IDs of the contents version vid's entries
// name, each once.
func (n *Node) versionContents(ctx context.Context, vid string) ([]string, error) {
	tctx, cancel := n.timeout(ctx)
	defer cancel()
	resp, err := n.etcd.Get(tctx, n.keys.entries(vid), clientv3.WithPrefix())
	if err != nil {
		return nil, n.etcdErr("read version "+vid, err)
	}
	var ids []string
	for _, kv := range resp.Kvs {
		var e Entry
		if json.Unmarshal(kv.Value, &e) == nil && validID(e.Content) {
			ids = append(ids, e.Content)
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids), nil
}

// collectContents deletes the references of version vid, whose keys a
// swap deleted, to the contents cids, unless vid was written again since
// (a publish writes a version's header before its references), and then
// each of those contents no version refers to (a publish writes a
// reference before its content). What a daemon that dies on the way
// leaves stays.
func (n *Node) collectContents(ctx context.Context, vid string, cids []string) {
	for len(cids) > 0 {
		batch := cids[:min(len(cids), maxTxnOps)]
		cids = cids[len(batch):]
		refs := make([]clientv3.Op, len(batch))
		ifFree := make([]clientv3.Op, len(batch))
		for i, cid := range batch {
			refs[i] = clientv3.OpDelete(n.keys.ref(cid, vid))
			ifFree[i] = clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(n.keys.refs(cid)), "=", 0).WithPrefix()},
				[]clientv3.Op{clientv3.OpDelete(n.keys.content(cid))}, nil)
		}
		tctx, cancel := n.timeout(ctx)
		resp, err := n.etcd.Txn(tctx).If(clientv3.Compare(clientv3.CreateRevision(n.keys.version(vid)), "=", 0)).Then(refs...).Commit()
		if err == nil && resp.Succeeded {
			_, err = n.etcd.Txn(tctx).Then(ifFree...).Commit()
		}
		cancel()
		if err != nil {
			n.log.Warn("cluster: contents of a deleted version stay in etcd", "version", vid, "err", n.etcdErr("delete contents", err))
			return
		}
		if !resp.Succeeded {
			return // published again: its references stand
		}
	}
}

// unchanged is the condition of a swap made on what ns read: no
// published directory changed since (one removed only frees).
func (n *Node) unchanged(ns *namespace) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(n.keys.dirs()), "<", ns.rev+1).WithPrefix()
}
