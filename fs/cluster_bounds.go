package fs

// What one user's publications may take (DESIGN.md §10): in etcd, which
// every node shares, checked at each publish against what the namespace
// holds; and on this node, charged when a version is made here and
// recounted from the backing at mount.

import (
	"cmp"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
)

// DefaultEtcdQuota is etcd's default space quota, which sizes the
// default bounds of what publishers hold in etcd.
const DefaultEtcdQuota = 2 << 30

// ClusterBounds bound what one user's publications take; 0 is the
// default. Root is bound by the totals only, an eighth of which is root's
// alone; the default share of one user is an eighth of the rest.
type ClusterBounds struct {
	// EtcdQuota is etcd's space quota (DefaultEtcdQuota): half of it is
	// what all publishers may hold (the rest is for holder and node
	// keys, and for the history etcd keeps until it compacts).
	EtcdQuota int64
	// Bytes is the bytes of keys and values in etcd one user's published
	// directories may hold, their kept versions' manifests included.
	Bytes int64
	// Entries is the entries (segments and directories) of the versions
	// one user's published directories keep (default: one per 256 bytes
	// of the bytes' share).
	Entries int64
	// Dirs is the directories one user may publish (default: one per 64
	// KiB of the bytes' share).
	Dirs int64
	// Keep is how many versions of a directory stay in etcd, the current
	// one included (cluster.DefaultKeep).
	Keep int
	// NodeInodes and NodeBytes are the inodes and bytes one user's
	// publications may make on this node (default: a share of the
	// backing's inodes and capacity).
	NodeInodes, NodeBytes int64
}

// bounds are a mount's cluster bounds, filled in: per user and in total.
type bounds struct {
	keep int
	// etcd: the budgets a publish is checked against, each with how it
	// reads a usage.
	etcd []etcdBound
	// inodes and bytes are what publications make on this node, by
	// publisher.
	inodes, bytes *budget
}

// etcdBound is one bound on what publishers hold in etcd.
type etcdBound struct {
	what          string
	perUID, total int64
	of            func(cluster.Usage) int64
}

// newQuota is a budget whose refusals are EDQUOT (past a user's share)
// and ENOSPC (past a total).
func newQuota(what string, perUID, total int64) *budget {
	b := newBudget(what, perUID, total)
	b.overUser, b.overAll = syscall.EDQUOT, syscall.ENOSPC
	return b
}

// share is one user's default share of total: an eighth of what root's
// eighth leaves.
func share(total int64) int64 { return (total - total/8) / 8 }

// newBounds fills in b: the etcd bounds from its quota, the node's from
// the backing open at rootFd (its inodes and capacity).
func newBounds(b ClusterBounds, rootFd int) (*bounds, error) {
	var sf unix.Statfs_t
	if err := unix.Fstatfs(rootFd, &sf); err != nil {
		return nil, fmt.Errorf("cluster bounds: statfs of the backing: %w", err)
	}
	inodes, capacity := int64(sf.Files), int64(sf.Blocks)*sf.Bsize
	if inodes <= 0 { // a backing that counts no inodes
		inodes = math.MaxInt64 / 2
	}
	total := cmp.Or(b.EtcdQuota, DefaultEtcdQuota) / 2
	// Bytes come when a segment is pulled, and a pull past the backing's
	// capacity is ENOSPC: root's versions are made whatever their size
	// (a node may show a model larger than itself and hold part of it),
	// users' together up to the capacity less root's eighth.
	bytes := newQuota("bytes of published versions made on this node (--cluster-node-bytes)", cmp.Or(b.NodeBytes, share(capacity)), math.MaxInt64/2)
	bytes.shared = capacity - capacity/8
	return &bounds{
		keep: cmp.Or(b.Keep, cluster.DefaultKeep),
		etcd: []etcdBound{
			{"published directories (--cluster-user-dirs)", cmp.Or(b.Dirs, share(total>>16)), total >> 16, func(u cluster.Usage) int64 { return u.Dirs }},
			{"published entries, of every version kept (--cluster-user-entries)", cmp.Or(b.Entries, share(total>>8)), total >> 8, func(u cluster.Usage) int64 { return u.Entries }},
			{"bytes of published manifests in etcd (--cluster-user-bytes)", cmp.Or(b.Bytes, share(total)), total, func(u cluster.Usage) int64 { return u.Bytes }},
		},
		inodes: newQuota("inodes of published versions made on this node (--cluster-node-inodes)", cmp.Or(b.NodeInodes, share(inodes)), inodes),
		bytes:  bytes,
	}, nil
}

// log says which bounds are in force.
func (b *bounds) log(log *slog.Logger) {
	for _, e := range b.etcd {
		log.Info("cluster: publishers' bound in etcd", "what", e.what, "per_uid", e.perUID, "total", e.total)
	}
	for _, q := range []*budget{b.inodes, b.bytes} {
		log.Info("cluster: publishers' bound on this node", "what", q.what, "per_uid", q.perUID, "total", q.total)
	}
	log.Info("cluster: versions kept per published directory", "keep", b.keep)
}

// admit decides whether a publish may make a directory that held was
// hold now, when every uid's directories hold all: each bound is a
// budget filled from all, the directory's share given back, its new
// one taken. Refused: EDQUOT past the publisher's share, ENOSPC past a
// total.
func (b *bounds) admit(all map[uint32]cluster.Usage, was, now cluster.DirUsage) error {
	for _, e := range b.etcd {
		q := newQuota(e.what, e.perUID, e.total)
		for uid, u := range all {
			q.add(uid, e.of(u))
		}
		q.give(was.UID, e.of(was.Usage))
		if err := q.take(now.UID, e.of(now.Usage)); err != nil {
			return err
		}
	}
	return nil
}

// charge is what one published directory's version made here is
// charged: inodes and bytes, to its publisher.
type charge struct {
	uid           uint32
	inodes, bytes int64
}

// chargeLocked charges dir's version made here to next.uid in place of
// what dir was charged, or refuses it past next.uid's bounds on this
// node, changing nothing. nsMu is held.
func (c *clusterFS) chargeLocked(dir string, next charge) error {
	b, prev := c.bounds, c.charges[dir]
	b.inodes.give(prev.uid, prev.inodes)
	b.bytes.give(prev.uid, prev.bytes)
	err := b.inodes.take(next.uid, next.inodes)
	if err == nil {
		if err = b.bytes.take(next.uid, next.bytes); err != nil {
			b.inodes.give(next.uid, next.inodes)
		}
	}
	if err != nil {
		b.inodes.add(prev.uid, prev.inodes)
		b.bytes.add(prev.uid, prev.bytes)
		return err
	}
	if next == (charge{}) {
		delete(c.charges, dir)
	} else {
		c.charges[dir] = next
	}
	return nil
}

// refusedVersion is a version not made here, as user.tensorfs.cluster
// shows it.
type refusedVersion struct {
	Version   string `json:"version"`
	Publisher string `json:"publisher"`
	UID       uint32 `json:"uid"`
	Reason    string `json:"reason"`
}

// refuse records on the published directory info.Dir (made if missing)
// that its version info.Version is not made here, and why.
func (c *clusterFS) refuse(info cluster.DirInfo, why error) {
	c.fsys.log.Warn("cluster: a published version past its publisher's bounds on this node is not made", "dir", alloc.EscapeText(info.Dir),
		"version", info.Version, "publisher", info.Publisher, "uid", info.UID, "err", why)
	top, err := c.openPath(info.Dir, true)
	if err == nil {
		defer unix.Close(top)
		var rec dirRecord
		if old, _ := alloc.ReadPublished(alloc.FdPath(top)); old != nil {
			json.Unmarshal(old, &rec)
		}
		rec.Refused = &refusedVersion{Version: info.Version, Publisher: info.Publisher, UID: info.UID, Reason: why.Error()}
		b, _ := json.Marshal(rec)
		err = alloc.MarkPublished(alloc.FdPath(top), b)
	}
	if err != nil {
		c.fsys.log.Warn("cluster: the refusal is not recorded on the directory", "dir", alloc.EscapeText(info.Dir), "err", err)
	}
}

// recount charges the published directories found in the backing to
// their publishers, whatever the bounds (a restart finds what it made).
func (c *clusterFS) recount() {
	alloc.Walk(c.fsys.store.RootFd, func(fd int, name, rel string, st *unix.Stat_t) error {
		if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			return nil
		}
		dfd, err := unix.Openat(fd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil
		}
		defer unix.Close(dfd)
		var rec dirRecord
		if b, err := alloc.ReadPublished(alloc.FdPath(dfd)); err == nil && b != nil && json.Unmarshal(b, &rec) == nil && rec.Version != "" {
			ch := c.count(dfd, rec.UID)
			c.charges[rel] = ch
			c.bounds.inodes.add(ch.uid, ch.inodes)
			c.bounds.bytes.add(ch.uid, ch.bytes)
		}
		return nil
	})
}

// count returns the charge to uid of the published directory open at
// top: it and its objects, up to the published directories below it
// (charged on their own), and the published sizes of its pulled
// segments.
func (c *clusterFS) count(top int, uid uint32) charge {
	ch := charge{uid: uid, inodes: 1}
	alloc.Walk(top, func(fd int, name, _ string, st *unix.Stat_t) error {
		if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
			var rec []byte
			alloc.At(fd, name, st.Ino, func(p string) (err error) {
				rec, err = alloc.ReadPublished(p)
				return err
			})
			if rec != nil {
				return alloc.ErrSkipDir
			}
		}
		ch.inodes++
		if p := c.fsys.pulled.get(st.Ino); p != nil && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
			size, _ := p.state()
			ch.bytes += size
		}
		return nil
	})
	return ch
}
