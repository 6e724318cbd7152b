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
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
	"tensorfs/ledger"
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
	// etcd are the bounds a publish is checked against, each with how
	// it reads a usage.
	etcd []etcdBound
	// inodes and bytes are what publications make on this node, by
	// publisher: rows of the mount's ledger.
	inodes, bytes *ledger.Row
}

// etcdBound is one bound on what publishers hold in etcd.
type etcdBound struct {
	spec ledger.Spec
	of   func(cluster.Usage) int64
}

// quota is a row whose refusals are EDQUOT (past a user's share) and
// ENOSPC (past a total).
func quota(name, unit string, perUID, total int64) ledger.Spec {
	return ledger.Spec{Name: name, Unit: unit, PerUID: perUID, Total: total, Over: syscall.EDQUOT, Full: syscall.ENOSPC}
}

// newBounds fills in b: the etcd bounds from its quota, the node's from
// the backing open at rootFd (its inodes and capacity), rows of l.
func newBounds(b ClusterBounds, rootFd int, l *ledger.Ledger) (*bounds, error) {
	var sf unix.Statfs_t
	if err := unix.Fstatfs(rootFd, &sf); err != nil {
		return nil, fmt.Errorf("cluster bounds: statfs of the backing: %w", err)
	}
	inodes, capacity := int64(sf.Files), int64(sf.Blocks)*sf.Bsize
	if inodes <= 0 { // a backing that counts no inodes
		inodes = math.MaxInt64 / 2
	}
	total := cmp.Or(b.EtcdQuota, DefaultEtcdQuota) / 2
	return &bounds{
		keep: cmp.Or(b.Keep, cluster.DefaultKeep),
		etcd: []etcdBound{
			{quota("published directories (--cluster-user-dirs)", "directory", cmp.Or(b.Dirs, ledger.Share(total>>16)), total>>16),
				func(u cluster.Usage) int64 { return u.Dirs }},
			{quota("published entries, of every version kept (--cluster-user-entries)", "entry", cmp.Or(b.Entries, ledger.Share(total>>8)), total>>8),
				func(u cluster.Usage) int64 { return u.Entries }},
			{quota("bytes of published manifests in etcd (--cluster-user-bytes)", "byte", cmp.Or(b.Bytes, ledger.Share(total)), total),
				func(u cluster.Usage) int64 { return u.Bytes }},
		},
		inodes: l.Row(quota("inodes of published versions made on this node (--cluster-node-inodes)", "inode", cmp.Or(b.NodeInodes, ledger.Share(inodes)), inodes)),
		bytes:  l.Row(quota("bytes of published versions made on this node (--cluster-node-bytes)", "byte", cmp.Or(b.NodeBytes, ledger.Share(capacity)), capacity)),
	}, nil
}

// log says which bounds are in force.
func (b *bounds) log(log *slog.Logger) {
	for _, e := range b.etcd {
		log.Info("cluster: publishers' bound in etcd", "what", e.spec.Name, "per_uid", e.spec.PerUID, "total", e.spec.Total)
	}
	for _, r := range []*ledger.Row{b.inodes, b.bytes} {
		log.Info("cluster: publishers' bound on this node", "what", r.Spec().Name, "per_uid", r.Spec().PerUID, "total", r.Spec().Total)
	}
	log.Info("cluster: versions kept per published directory", "keep", b.keep)
}

// admit decides whether a publish may make a directory that held was
// hold now, when every uid's directories hold all: each bound is a row
// filled from all, the directory's share given back, its new one taken.
// Refused: EDQUOT past the publisher's share, ENOSPC past a total.
func (b *bounds) admit(all map[uint32]cluster.Usage, was, now cluster.DirUsage) error {
	l := ledger.New()
	for _, e := range b.etcd {
		r := l.Row(e.spec)
		for uid, u := range all {
			r.Add(uid, e.of(u))
		}
		r.Give(was.UID, e.of(was.Usage))
		if err := r.Take(now.UID, e.of(now.Usage)); err != nil {
			return refusal(err, r, now.UID, e.of(now.Usage))
		}
	}
	return nil
}

// refusal says, of a refusal by r of n more to uid, what uid and all
// users held.
func refusal(err error, r *ledger.Row, uid uint32, n int64) error {
	return fmt.Errorf("%w: it holds %d and needs %d more (all users hold %d)", err, r.Held(uid), n, r.Used())
}

// charge is what one published directory's version made here is
// charged: inodes and bytes, to its publisher.
type charge struct {
	uid           uint32
	inodes, bytes int64
}

// newCharge is the charge to uid of a version of the published
// directory dir of inodes and bytes, and of the directories on dir's
// path, which a node makes where they are missing (counted whether or
// not it made them). Root's bytes are not charged: root's versions are
// made whatever their size (a node may show a model larger than itself
// and hold part of it), since a pull past the backing's capacity is
// ENOSPC.
func newCharge(dir string, uid uint32, inodes, bytes int64) charge {
	if uid == 0 {
		bytes = 0
	}
	return charge{uid, inodes + int64(strings.Count(dir, "/")), bytes}
}

// chargeLocked charges dir's version made here to next.uid in place of
// what dir was charged, or refuses it past next.uid's bounds on this
// node, changing nothing. nsMu is held.
func (c *clusterFS) chargeLocked(dir string, next charge) error {
	b, prev := c.bounds, c.charges[dir]
	b.inodes.Give(prev.uid, prev.inodes)
	b.bytes.Give(prev.uid, prev.bytes)
	err := b.inodes.Take(next.uid, next.inodes)
	if err != nil {
		err = refusal(err, b.inodes, next.uid, next.inodes)
	} else if err = b.bytes.Take(next.uid, next.bytes); err != nil {
		err = refusal(err, b.bytes, next.uid, next.bytes)
		b.inodes.Give(next.uid, next.inodes)
	}
	if err != nil {
		b.inodes.Add(prev.uid, prev.inodes)
		b.bytes.Add(prev.uid, prev.bytes)
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

// refuse records on the published directory info.Dir (made if missing,
// as openPath makes it for owner) that its version info.Version is not
// made here, and why.
func (c *clusterFS) refuse(info cluster.DirInfo, owner ctl.Cred, why error) {
	c.fsys.log.Warn("cluster: a published version past its publisher's bounds on this node is not made", "dir", alloc.EscapeText(info.Dir),
		"version", info.Version, "publisher", info.Publisher, "uid", info.UID, "err", why)
	top, err := c.refusedDir(info.Dir, owner)
	if err == nil {
		defer unix.Close(top)
		var rec dirRecord
		if old, _ := alloc.ReadPublished(alloc.FdPath(top)); old != nil {
			json.Unmarshal(old, &rec)
		}
		rec.Dir = info.Dir
		rec.Refused = &refusedVersion{Version: info.Version, Publisher: info.Publisher, UID: info.UID, Reason: why.Error()}
		b, _ := json.Marshal(rec)
		err = alloc.MarkPublished(alloc.FdPath(top), b)
	}
	if err != nil {
		c.fsys.log.Warn("cluster: the refusal is not recorded on the directory", "dir", alloc.EscapeText(info.Dir), "err", err)
	}
}

// refusedDir opens the published directory dir of a version refused
// here, to record why on it: made if missing, but only where its parent
// is (the directories on its path are charged to a version made here,
// and this one is not).
func (c *clusterFS) refusedDir(dir string, owner ctl.Cred) (int, error) {
	if parent := path.Dir(dir); parent != "." {
		fd, err := openBeneath(c.fsys.store.RootFd, parent)
		if err != nil {
			return -1, err
		}
		unix.Close(fd)
	}
	return c.openPath(dir, owner)
}

// recount charges the published directories found in the backing to
// their publishers, whatever the bounds (a restart finds what it made),
// at any depth (alloc.Tree).
func (c *clusterFS) recount() {
	alloc.Tree(c.fsys.store.RootFd, func(e *alloc.Entry) error {
		if e.Stat.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			return nil
		}
		dfd, err := unix.Openat(e.Dirfd, e.Name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil
		}
		defer unix.Close(dfd)
		var rec dirRecord
		if b, err := alloc.ReadPublished(alloc.FdPath(dfd)); err == nil && b != nil && json.Unmarshal(b, &rec) == nil && rec.Version != "" {
			rel := e.Rel()
			ch := c.count(dfd, rel, rec.UID)
			c.charges[rel] = ch
			c.mu.Lock()
			c.placed[rel] = true
			c.mu.Unlock()
			c.bounds.inodes.Add(ch.uid, ch.inodes)
			c.bounds.bytes.Add(ch.uid, ch.bytes)
		}
		return nil
	})
}

// count returns the charge to uid of the published directory dir, open
// at top: it and its objects, up to the published directories below it
// (charged on their own), and the published sizes of its pulled
// segments.
func (c *clusterFS) count(top int, dir string, uid uint32) charge {
	inodes, bytes := int64(1), int64(0)
	alloc.Tree(top, func(e *alloc.Entry) error {
		if isPublishedDir(e.Dirfd, e.Name, &e.Stat) {
			return alloc.ErrSkipDir
		}
		inodes++
		if p := c.fsys.pulled.get(e.Stat.Ino); p != nil && e.Stat.Mode&syscall.S_IFMT == syscall.S_IFREG {
			size, _ := p.state()
			bytes += size
		}
		return nil
	})
	return newCharge(dir, uid, inodes, bytes)
}

// isPublishedDir reports whether name in fd, of stat st, is a directory
// that holds a published version's record: a walk of one published
// directory leaves those below it to their own.
func isPublishedDir(fd int, name string, st *unix.Stat_t) bool {
	if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return false
	}
	var rec []byte
	alloc.At(fd, name, st.Ino, func(p string) (err error) {
		rec, err = alloc.ReadPublished(p)
		return err
	})
	return rec != nil
}
