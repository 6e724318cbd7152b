package fs

import (
	"errors"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ledger"
)

// inodes charges what users make in the backing to them in the ledger's
// inodes row, in the units tmpfs takes from its pool of inodes
// (nr_inodes): one for each object (segment, directory, symbolic link,
// special file), one more for each further name of it, and a KiB of
// attributes costs one too (tmpfs counts an inode as a KiB of that pool).
// So no user can take all of the backing's inodes, nor the daemon's
// memory, which keeps a node per name the kernel knows (DESIGN.md §9).
//
// Charges are kept by inode number: an object is charged to its owner
// (for itself and its attributes; chown moves it), each further name to
// the user who made it. Giving back a number charged to no one (an object
// the cluster made) is nothing, so the row never counts an object twice
// nor one that is gone. An object's charge goes when its last name goes,
// or, for a segment still open then, when its last handle goes.
type inodes struct {
	row *ledger.Row

	mu sync.Mutex
	of map[uint64]*inodeCharge
}

// inodeCharge is what one object is charged.
type inodeCharge struct {
	owner uint32           // charged for the object and its attributes
	attrs int64            // units of its attributes
	links map[uint32]int64 // units of its further names, by who made them
}

// attrUnits is what an attribute of a name and size costs: tmpfs takes
// the name, the value and a header from the pool, a KiB an inode.
func attrUnits(name string, size int) int64 {
	if size < 0 {
		return 0
	}
	return (int64(len(name)+size) + 64 + 1023) / 1024
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
		row: l.Row(ledger.Spec{Name: "inodes (objects, names past the first, a KiB of attributes each)", Unit: "inode",
			PerUID: max(total/16, 1), Total: total, Over: syscall.EDQUOT, Full: syscall.ENOSPC}),
		of: map[uint64]*inodeCharge{},
	}
}

// reserve charges one to uid before it makes an object or a name: made
// or linked records which, and a make that fails gives it back with
// unreserve.
func (c *inodes) reserve(uid uint32) error { return c.row.Take(uid, 1) }

// unreserve gives back a reservation of uid's that made nothing.
func (c *inodes) unreserve(uid uint32) { c.row.Give(uid, 1) }

// made records that uid's reservation is the new object ino.
func (c *inodes) made(ino uint64, uid uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.goneLocked(ino) // a number given again: its object is gone
	c.of[ino] = &inodeCharge{owner: uid}
}

// linked records that uid's reservation is a further name of ino.
func (c *inodes) linked(ino uint64, uid uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.of[ino]
	if ch == nil { // an object charged to no one: its names are not either
		c.row.Give(uid, 1)
		return
	}
	if ch.links == nil {
		ch.links = map[uint32]int64{}
	}
	ch.links[uid]++
}

// unlinked gives back one further name of ino, uid's if uid made one: a
// name of an object with others went.
func (c *inodes) unlinked(ino uint64, uid uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.of[ino]
	if ch == nil || len(ch.links) == 0 {
		return
	}
	if ch.links[uid] == 0 {
		for other := range ch.links {
			uid = other
			break
		}
	}
	c.row.Give(uid, 1)
	if ch.links[uid]--; ch.links[uid] == 0 {
		delete(ch.links, uid)
	}
}

// gone gives back everything ino is charged: the object is gone.
func (c *inodes) gone(ino uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.goneLocked(ino)
}

func (c *inodes) goneLocked(ino uint64) {
	ch := c.of[ino]
	if ch == nil {
		return
	}
	c.row.Give(ch.owner, 1+ch.attrs)
	for uid, n := range ch.links {
		c.row.Give(uid, n)
	}
	delete(c.of, ino)
}

// attrs charges ino's owner delta more units of attributes (less, for a
// negative delta, down to none), or refuses (EDQUOT) past the owner's
// share; it returns the change it made, which undoes it negated.
func (c *inodes) attrs(ino uint64, delta int64) (int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.of[ino]
	switch {
	case ch == nil || delta == 0:
		return 0, nil
	case delta > 0:
		if err := c.row.Take(ch.owner, delta); err != nil {
			return 0, err
		}
	default:
		delta = max(delta, -ch.attrs)
		c.row.Give(ch.owner, -delta)
	}
	ch.attrs += delta
	return delta, nil
}

// chown moves ino's object and attributes to uid, or refuses (EDQUOT)
// when that is past uid's share: a chown makes the object uid's, as a
// quota would count it. undo moves them back, for a chown the backing
// then refused.
func (c *inodes) chown(ino uint64, uid uint32) (undo func(), err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.of[ino]
	if ch == nil || ch.owner == uid {
		return func() {}, nil
	}
	if err := c.row.Take(uid, 1+ch.attrs); err != nil {
		return nil, err
	}
	old := ch.owner
	c.row.Give(old, 1+ch.attrs)
	ch.owner = uid
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.of[ino] == ch && ch.owner == uid {
			c.row.Give(uid, 1+ch.attrs)
			c.row.Add(old, 1+ch.attrs)
			ch.owner = old
		}
	}, nil
}

// count charges the object st, found in the backing at mount, to its
// owner whatever the bounds: itself, its further names and its stored
// attributes, which size tells.
func (c *inodes) count(st *unix.Stat_t, attrs int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.of[st.Ino] != nil {
		return // a further name of an object counted
	}
	ch := &inodeCharge{owner: st.Uid, attrs: attrs}
	c.row.Add(st.Uid, 1+attrs)
	if n := int64(st.Nlink) - 1; n > 0 && st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		ch.links = map[uint32]int64{st.Uid: n}
		c.row.Add(st.Uid, n)
	}
	c.of[st.Ino] = ch
}

// countBacking charges every object below rootFd to its owner (the root
// directory itself is the mount's), at any depth (alloc.Tree). A walk
// cut short never concludes that what it did not reach is free: the
// owner of the directory it could not finish is charged her whole share
// on top, until the next count.
func (c *inodes) countBacking(rootFd int) error {
	err := alloc.Tree(rootFd, func(e *alloc.Entry) error {
		c.count(&e.Stat, storedAttrUnits(alloc.FdPath(e.Dirfd)+"/"+e.Name))
		return nil
	})
	var cut *alloc.CutError
	if errors.As(err, &cut) {
		c.row.Add(cut.Dir.Uid, c.row.Spec().PerUID)
	}
	return err
}

// storedAttrUnits is what the attributes stored on the object at p (not
// followed) cost; what cannot be read costs nothing.
func storedAttrUnits(p string) int64 {
	size, err := unix.Llistxattr(p, nil)
	if err != nil || size == 0 {
		return 0
	}
	buf := make([]byte, size)
	if size, err = unix.Llistxattr(p, buf); err != nil {
		return 0
	}
	var units int64
	for _, name := range strings.Split(string(buf[:size]), "\x00") {
		if n, err := unix.Lgetxattr(p, name, nil); name != "" && err == nil {
			units += attrUnits(name, n)
		}
	}
	return units
}
