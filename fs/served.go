package fs

// The backing files the cluster reads published contents from
// (DESIGN.md §9, §10): kept by path and inode, not by descriptor, and
// opened on demand through a small cache.

import (
	"container/list"
	"errors"
	"os"
	"path"
	"sync"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// loc is where a backing file lies: its path relative to the backing's
// root, and its inode.
type loc struct {
	rel string
	ino uint64
}

// maxServedFds bounds the idle descriptors of servedFds.
const maxServedFds = 64

// servedFds is the bounded cache of the backing files the cluster reads
// from, open read-only, by location. A file being read keeps its
// descriptor; of those not being read, at most maxServedFds stay open, the
// least recently used closing first. Lock order: servedFds.mu is taken
// alone, never while a file is opened.
type servedFds struct {
	root int // the backing's root
	mu   sync.Mutex
	open map[loc]*servedFd
	idle list.List // of *servedFd, least recently used first
}

// servedFd is one open file of servedFds.
type servedFd struct {
	l     loc
	f     *os.File
	users int           // reads in flight
	idle  *list.Element // in servedFds.idle while open and unused
}

// acquire returns the file at l, opening it if it is closed, and counts a
// user until release.
func (c *servedFds) acquire(l loc) (*servedFd, error) {
	c.mu.Lock()
	e := c.useLocked(l)
	c.mu.Unlock()
	if e != nil {
		return e, nil
	}
	f, err := openLoc(c.root, l)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.useLocked(l); e != nil { // another read opened it meanwhile
		f.Close()
		return e, nil
	}
	if c.open == nil {
		c.open = map[loc]*servedFd{}
	}
	e = &servedFd{l: l, f: f, users: 1}
	c.open[l] = e
	return e, nil
}

// useLocked counts a user of the file at l and returns it, if it is open.
func (c *servedFds) useLocked(l loc) *servedFd {
	e := c.open[l]
	if e == nil {
		return nil
	}
	e.users++
	if e.idle != nil {
		c.idle.Remove(e.idle)
		e.idle = nil
	}
	return e
}

// release ends a use of e: the last user closes it if its location was
// forgotten meanwhile, else it joins the idle ones.
func (c *servedFds) release(e *servedFd) {
	var closing []*os.File
	c.mu.Lock()
	if e.users--; e.users == 0 {
		if c.open[e.l] == e {
			e.idle = c.idle.PushBack(e)
			closing = c.trimLocked(maxServedFds)
		} else {
			closing = append(closing, e.f)
		}
	}
	c.mu.Unlock()
	closeFiles(closing)
}

// forget closes the file at l, or has its last user close it: the
// segment there is no longer served (a descriptor kept would keep a
// removed file's bytes).
func (c *servedFds) forget(l loc) {
	c.mu.Lock()
	e := c.open[l]
	if e == nil {
		c.mu.Unlock()
		return
	}
	delete(c.open, l)
	idle := e.users == 0
	if idle {
		c.idle.Remove(e.idle)
		e.idle = nil
	}
	c.mu.Unlock()
	if idle {
		e.f.Close()
	}
}

// trimLocked takes the least recently used idle files past max out of
// the cache and returns them for the caller to close unlocked.
func (c *servedFds) trimLocked(max int) []*os.File {
	var files []*os.File
	for c.idle.Len() > max {
		e := c.idle.Remove(c.idle.Front()).(*servedFd)
		e.idle = nil
		delete(c.open, e.l)
		files = append(files, e.f)
	}
	return files
}

// closeIdle closes every idle file, at unmount once the cluster reads
// no more.
func (c *servedFds) closeIdle() {
	c.mu.Lock()
	closing := c.trimLocked(0)
	c.mu.Unlock()
	closeFiles(closing)
}

// readAt reads the file at l through the cache.
func (c *servedFds) readAt(l loc, b []byte, off int64) (int, error) {
	e, err := c.acquire(l)
	if err != nil {
		return 0, err
	}
	defer c.release(e)
	return e.f.ReadAt(b, off)
}

// locReader reads the backing file at a location through the cache: what
// a publish hands the cluster to hash.
type locReader struct {
	fds *servedFds
	l   loc
}

func (r locReader) ReadAt(b []byte, off int64) (int, error) { return r.fds.readAt(r.l, b, off) }

// refAt runs fn with a Ref of the object at l, reached below the
// directory open at root one component at a time without following a
// symbolic link, if it is still inode l.ino: ESTALE if another object is
// there now.
func refAt(root int, l loc, fn func(*alloc.Ref) error) error {
	dir, err := openBeneath(root, path.Dir(l.rel))
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	r, err := alloc.OpenRef(dir, path.Base(l.rel), l.ino)
	if err != nil {
		return err
	}
	defer r.Close()
	return fn(r)
}

// pathAt runs fn with a path that names exactly the object at l in the
// backing, found as refAt finds it.
func (fsys *filesystem) pathAt(l loc, fn func(path string) error) error {
	return refAt(fsys.store.RootFd, l, func(r *alloc.Ref) error {
		p, err := r.Path()
		if err != nil {
			return err
		}
		return fn(p)
	})
}

// openLoc opens the regular file at l read-only, found as refAt finds it.
func openLoc(root int, l loc) (*os.File, error) {
	var f *os.File
	err := refAt(root, l, func(r *alloc.Ref) error {
		fd, err := r.Open(unix.O_RDONLY)
		if err == nil {
			f = os.NewFile(uintptr(fd), l.rel)
		}
		return err
	})
	return f, err
}

// openBeneath opens (O_PATH) the directory rel below the directory open at
// top, without following a symbolic link or leaving top.
func openBeneath(top int, rel string) (int, error) {
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS}
	return unix.Openat2(top, rel, &how)
}

// moved reports whether err says that a segment is no longer at its
// location: removed, renamed, replaced, or a symbolic link on the way.
func moved(err error) bool {
	for _, e := range []error{unix.ENOENT, unix.ESTALE, unix.ENOTDIR, unix.ELOOP, unix.EXDEV} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
