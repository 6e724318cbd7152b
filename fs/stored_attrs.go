package fs

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// storedAttrs caches the flags and tensor attributes read from host
// segments the kernel knows no node for (a node has its own cache,
// attrCache), by inode, for the socket's load: a model loaded again and
// again by processes that never look its names up through the mount
// reads no attribute after the first load. An entry is valid only while
// the inode's ctime is what it was before the attributes were read (every
// change of an attribute, through the mount or a descriptor handed out,
// moves it), so nothing has to tell the cache of a change. It holds at
// most maxStoredAttrs entries whoever fills it (one goes at random to
// make room): what it takes is bounded by construction (DESIGN.md §9).
type storedAttrs struct {
	mu sync.Mutex
	by map[uint64]attrsAt
}

// attrsAt is one inode's cached attributes and the ctime they hold for.
type attrsAt struct {
	ctime unix.Timespec
	flags alloc.Flags
	lay   alloc.Layout
}

// maxStoredAttrs bounds storedAttrs' entries (about 150 bytes each).
var maxStoredAttrs = 1 << 15

// settled is how old a ctime must be for attributes read under it to be
// cached: a change later than that moves it even where the kernel's clock
// for timestamps is a coarse tick behind.
const settled = 50 * time.Millisecond

// get returns the attributes cached for the inode st, if its ctime is
// still theirs.
func (c *storedAttrs) get(st *unix.Stat_t) (alloc.Flags, alloc.Layout, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.by[st.Ino]
	if !ok || a.ctime != st.Ctim {
		return 0, alloc.Layout{}, false
	}
	return a.flags, a.lay, true
}

// put caches f and l, read from the inode st after st was taken, unless
// st's ctime is too recent to tell a later change from it (settled).
func (c *storedAttrs) put(st *unix.Stat_t, f alloc.Flags, l alloc.Layout) {
	if time.Since(time.Unix(st.Ctim.Unix())) < settled {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.by == nil {
		c.by = make(map[uint64]attrsAt)
	}
	if _, ok := c.by[st.Ino]; !ok && len(c.by) >= maxStoredAttrs {
		for ino := range c.by {
			delete(c.by, ino)
			break
		}
	}
	c.by[st.Ino] = attrsAt{ctime: st.Ctim, flags: f, lay: l}
}
