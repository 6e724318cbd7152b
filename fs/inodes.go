package fs

import (
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ledger"
)

// inodes charges the objects users make in the backing (segments,
// directories, symbolic links, special files) to their owners in the
// ledger's inodes row, so that no user can take all of the backing's
// inodes, nor the daemon's memory, which keeps a node for each object the
// kernel knows (DESIGN.md §9). Charges are kept by inode number: each
// number is charged once, to one uid, and giving back a number charged to
// no one (an object the cluster made, or one an earlier mount's walk did
// not reach) is nothing, so the row never counts an object twice nor one
// that is gone.
type inodes struct {
	row *ledger.Row

	mu  sync.Mutex
	uid map[uint64]uint32 // inode → the uid it is charged to
}

// newInodes sizes the inodes row from the backing's inodes (statfs
// f_files of dirfd's filesystem): a sixteenth for one user, an eighth
// root's alone. A filesystem that counts no inodes gets 1<<32.
func newInodes(l *ledger.Ledger, dirfd int) *inodes {
	total := int64(1) << 32
	var sfs unix.Statfs_t
	if unix.Fstatfs(dirfd, &sfs) == nil && sfs.Files > 0 {
		total = int64(min(sfs.Files, 1<<40))
	}
	return &inodes{
		row: l.Row(ledger.Spec{Name: "inodes (segments, directories, symbolic links, special files)", Unit: "inode",
			PerUID: max(total/16, 1), Total: total, Over: syscall.EDQUOT, Full: syscall.ENOSPC}),
		uid: map[uint64]uint32{},
	}
}

// reserve charges one to uid before it makes an object: made records
// which, and a make that fails gives it back with unreserve.
func (c *inodes) reserve(uid uint32) error { return c.row.Take(uid, 1) }

// unreserve gives back a reservation of uid's that made nothing.
func (c *inodes) unreserve(uid uint32) { c.row.Give(uid, 1) }

// made records that uid's reservation is the object ino.
func (c *inodes) made(ino uint64, uid uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.uid[ino]; ok { // a number given again: its object is gone
		c.row.Give(old, 1)
	}
	c.uid[ino] = uid
}

// count charges ino to uid whatever the bounds: an object the backing
// held at mount.
func (c *inodes) count(ino uint64, uid uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.uid[ino]; !ok {
		c.row.Add(uid, 1)
		c.uid[ino] = uid
	}
}

// gone gives back ino's charge: its last name went.
func (c *inodes) gone(ino uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if uid, ok := c.uid[ino]; ok {
		c.row.Give(uid, 1)
		delete(c.uid, ino)
	}
}

// chown moves ino's charge to uid, or refuses (EDQUOT) when uid holds its
// share: a chown makes the object uid's, as a quota would count it. undo
// moves it back, for a chown the backing then refused.
func (c *inodes) chown(ino uint64, uid uint32) (undo func(), err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	old, ok := c.uid[ino]
	if !ok || old == uid {
		return func() {}, nil
	}
	if err := c.row.Take(uid, 1); err != nil {
		return nil, err
	}
	c.row.Give(old, 1)
	c.uid[ino] = uid
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.uid[ino] == uid {
			c.row.Give(uid, 1)
			c.row.Add(old, 1)
			c.uid[ino] = old
		}
	}, nil
}

// countBacking charges every object below rootFd that alloc.Walk
// reaches to its owner (the root directory itself is the mount's).
func (c *inodes) countBacking(rootFd int) error {
	return alloc.Walk(rootFd, func(_ int, _, _ string, st *unix.Stat_t) error {
		c.count(st.Ino, st.Uid)
		return nil
	})
}
