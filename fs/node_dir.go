package fs

import (
	"container/list"
	"sync"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// dirNode is a directory of the mount. Its backing directory is reached
// through an O_PATH descriptor opened relative to its parent's and
// checked to be its inode; descriptors are a bounded cache (dirFds), so
// no user can make the daemon hold more of them by making directories.
type dirNode struct {
	nodeBase
	attrCache

	// fd, users, forgotten and idle belong to the mount's dirFds and are
	// guarded by its mutex.
	fd        int // -1: closed
	users     int // requests using fd
	forgotten bool
	idle      *list.Element // in dirFds.idle while open and unused
}

// rootNode is the mount's root: a directory that also answers the
// mount-wide attributes (stats, the control socket's path). Its
// descriptor is the store's and is never closed while mounted.
type rootNode struct {
	dirNode
}

// dirOf returns the directory of a node's parent or root.
func dirOf(i *fusefs.Inode) *dirNode {
	switch d := i.Operations().(type) {
	case *dirNode:
		return d
	case *rootNode:
		return &d.dirNode
	}
	panic("tensorfs: a parent that is not a directory")
}

// withDir runs fn with the O_PATH descriptor of the directory's backing,
// which stays open until fn returns.
func (d *dirNode) withDir(fn func(fd int) error) error {
	fd, err := d.fs.dirs.acquire(d)
	if err != nil {
		return err
	}
	defer d.fs.dirs.release(d)
	return fn(fd)
}

// openBelow opens the directory's backing as name in the directory open
// at pfd, making sure the name still leads to this directory (ESTALE).
func (d *dirNode) openBelow(pfd int, name string) (int, error) {
	fd, err := unix.Openat(pfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino != d.StableAttr().Ino {
		unix.Close(fd)
		return -1, syscall.ESTALE
	}
	return fd, nil
}

func (d *dirNode) withAttrs(fn func(a *alloc.Ref) error) error {
	return d.withDir(func(fd int) error {
		r, err := alloc.OpenRef(fd, "", 0)
		if err != nil {
			return err
		}
		defer r.Close()
		return fn(r)
	})
}

func (d *dirNode) stat(st *unix.Stat_t) error {
	return d.withDir(func(fd int) error { return unix.Fstat(fd, st) })
}

var _ = (fusefs.NodeOnForgetter)((*dirNode)(nil))

// OnForget closes the directory's descriptor; it is opened again if the
// node comes back.
func (d *dirNode) OnForget() { d.fs.dirs.forget(d) }

// OnForget keeps the root's descriptor: the kernel forgets the root only
// at unmount.
func (r *rootNode) OnForget() {}

// dirFds is the bounded cache of directory descriptors. A directory
// in use keeps its descriptor; of those not in use, at most max stay
// open, the least recently used closing first. Lock order: dirFds.mu is
// taken alone, never while a descriptor is opened.
type dirFds struct {
	max  int
	mu   sync.Mutex
	open int       // descriptors open, in use or idle
	idle list.List // of *dirNode, least recently used first
}

// defaultDirFds bounds the idle directory descriptors of a mount.
const defaultDirFds = 1024

func newDirFds(max int) *dirFds { return &dirFds{max: max} }

// pin gives d the descriptor fd for good: the root's.
func (c *dirFds) pin(d *dirNode, fd int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d.fd, d.users = fd, 1
	c.open++
}

// acquire returns d's descriptor, opening it if it is closed, and counts
// a user until release. A closed descriptor is reopened without
// recursion, since a chain of directories is as deep as a user makes it:
// the walk goes up to the nearest ancestor whose descriptor is open, then
// opens each directory below it relative to its parent's, checked to be
// its inode. Each one opened joins the cache, so the cache keeps the
// deepest of them and a request near the bottom of the chain reopens
// little.
func (c *dirFds) acquire(d *dirNode) (int, error) {
	if fd, ok := c.use(d); ok {
		return fd, nil
	}
	var closed []*dirNode // d, then its closed ancestors upward
	var names []string    // the name of each in its parent
	top := d
	pfd := -1
	for pfd < 0 {
		name, parent := top.Parent()
		if parent == nil {
			return -1, syscall.ENOENT
		}
		closed, names = append(closed, top), append(names, name)
		top = dirOf(parent)
		pfd, _ = c.use(top)
	}
	for i := len(closed) - 1; i >= 0; i-- {
		fd, err := closed[i].openBelow(pfd, names[i])
		if err == nil {
			fd = c.install(closed[i], fd)
		}
		c.release(top)
		if err != nil {
			return -1, err
		}
		top, pfd = closed[i], fd
	}
	return pfd, nil
}

// use counts a user of d's descriptor and returns it, if it is open.
func (c *dirFds) use(d *dirNode) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d.fd < 0 {
		return -1, false
	}
	d.users++
	if d.idle != nil {
		c.idle.Remove(d.idle)
		d.idle = nil
	}
	return d.fd, true
}

// install gives d the descriptor fd just opened, unless another request
// opened one meanwhile (fd is closed, and d's returned), and counts a user
// until release.
func (c *dirFds) install(d *dirNode, fd int) int {
	c.mu.Lock()
	extra := -1
	if d.fd >= 0 {
		extra, fd = fd, d.fd
		if d.idle != nil {
			c.idle.Remove(d.idle)
			d.idle = nil
		}
	} else {
		d.fd = fd
		c.open++
	}
	d.users++
	closing := c.trimLocked(c.max)
	c.mu.Unlock()
	if extra >= 0 {
		unix.Close(extra)
	}
	closeAll(closing)
	return fd
}

// release ends a use of d's descriptor: the last user closes it if the
// kernel forgot d meanwhile, else it joins the idle ones.
func (c *dirFds) release(d *dirNode) {
	c.mu.Lock()
	var closing []int
	if d.users--; d.users == 0 {
		if d.forgotten {
			closing = append(closing, d.fd)
			d.fd, d.forgotten = -1, false
			c.open--
		} else {
			d.idle = c.idle.PushBack(d)
		}
	}
	closing = append(closing, c.trimLocked(c.max)...)
	c.mu.Unlock()
	closeAll(closing)
}

// forget closes d's descriptor, or has its last user close it.
func (c *dirFds) forget(d *dirNode) {
	c.mu.Lock()
	fd := -1
	switch {
	case d.users > 0:
		d.forgotten = true
	case d.fd >= 0:
		if d.idle != nil {
			c.idle.Remove(d.idle)
			d.idle = nil
		}
		fd, d.fd = d.fd, -1
		c.open--
	}
	c.mu.Unlock()
	if fd >= 0 {
		unix.Close(fd)
	}
}

// trimLocked takes the least recently used idle descriptors past max out
// of the cache and returns them for the caller to close unlocked.
func (c *dirFds) trimLocked(max int) []int {
	var fds []int
	for c.open > max && c.idle.Len() > 0 {
		d := c.idle.Remove(c.idle.Front()).(*dirNode)
		d.idle = nil
		fds = append(fds, d.fd)
		d.fd = -1
		c.open--
	}
	return fds
}

// closeIdle closes every idle descriptor, once the kernel serves the
// mount no more: it forgets no node at unmount.
func (c *dirFds) closeIdle() {
	c.mu.Lock()
	closing := c.trimLocked(0)
	c.mu.Unlock()
	closeAll(closing)
}

// stats reports the descriptors open, for the mount's statistics.
func (c *dirFds) stats() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return map[string]int{"open": c.open, "idle": c.idle.Len(), "max": c.max}
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// newDir makes the node of a directory.
func (fsys *filesystem) newDir() *dirNode {
	return &dirNode{nodeBase: nodeBase{fs: fsys}, fd: -1}
}

// creatable returns the directory's flags for a request that makes a name
// in it, refusing with ErrNoCreate in a NOCREATE directory.
func (d *dirNode) creatable() (alloc.Flags, error) {
	f, err := d.flags(d)
	if err != nil {
		return 0, err
	}
	if f&alloc.NoCreate != 0 {
		return f, errNoCreate
	}
	return f, nil
}
