package fs

import (
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// redirect says where the bytes of a segment whose backing file is only
// a marker live (see alloc's marker.go), and its attributes. A nil
// *redirect means the backing object itself.
type redirect struct {
	// disk is the id of a SHARED segment's disk file, which holds its
	// bytes and its attributes (so that both outlive the backing).
	disk string
	// imported is the id of a descriptor imported over the control socket,
	// which holds the bytes; the attributes stay on the marker, never on
	// the sender's file.
	imported string
	// dev is a device segment, whose bytes are in GPU memory; the
	// attributes stay on the (empty) backing file.
	dev *devSeg
}

// imports holds the descriptors of imported (FROMFD) segments.
type imports struct {
	// mu is held for reading while a descriptor is used, for writing
	// while one is added or closed.
	mu  sync.RWMutex
	fds map[string]int
}

func (im *imports) add(id string, fd int) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.fds == nil {
		im.fds = map[string]int{}
	}
	im.fds[id] = fd
}

// any reports whether the daemon holds imports; markers of an earlier
// daemon's imports were removed at recovery.
func (im *imports) any() bool {
	im.mu.RLock()
	defer im.mu.RUnlock()
	return len(im.fds) > 0
}

// with runs fn with the descriptor of import id.
func (im *imports) with(id string, fn func(fd int) error) error {
	im.mu.RLock()
	defer im.mu.RUnlock()
	fd, ok := im.fds[id]
	if !ok {
		return syscall.ENOENT
	}
	return fn(fd)
}

func (im *imports) drop(id string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if fd, ok := im.fds[id]; ok {
		unix.Close(fd)
		delete(im.fds, id)
	}
}

// redirectOf reads the marker at name in dirfd, whose stat is st: nil
// for an ordinary backing object. Only empty files can be markers.
func (fsys *filesystem) redirectOf(dirfd int, name string, st *unix.Stat_t) *redirect {
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Size != 0 {
		return nil
	}
	p := procPath(dirfd, name)
	if fsys.imports.any() {
		if id := alloc.ImportID(p); id != "" {
			return &redirect{imported: id}
		}
	}
	if fsys.store.Disk != "" {
		if id := alloc.SharedID(p); id != "" {
			return &redirect{disk: id}
		}
	}
	if fsys.gpu != nil && alloc.DeviceOf(p) != "cpu" {
		if seg, err := fsys.gpu.segment(st.Ino, dirfd, name); err == nil {
			return &redirect{dev: seg}
		}
	}
	return nil
}

// withAttrs runs fn with a descriptor and name that reach the attributes
// of the segment whose marker is name in dirfd.
func (fsys *filesystem) withAttrs(r *redirect, dirfd int, name string, fn func(tfd int, tname string) error) error {
	if r != nil && r.disk != "" {
		return fn(fsys.store.DiskFd, r.disk)
	}
	return fn(dirfd, name)
}

// withData runs fn with a descriptor and name that reach the bytes of the
// segment whose marker is name in dirfd.
func (fsys *filesystem) withData(r *redirect, dirfd int, name string, fn func(tfd int, tname string) error) error {
	if r != nil && r.imported != "" {
		return fsys.imports.with(r.imported, func(fd int) error { return fn(fd, "") })
	}
	return fsys.withAttrs(r, dirfd, name, fn)
}

// statSegment fills st for the segment whose marker is name in dirfd:
// the marker's identity, owner and mode with the size and times of where
// its bytes live.
func (fsys *filesystem) statSegment(r *redirect, dirfd int, name string, st *unix.Stat_t) error {
	if err := unix.Fstatat(dirfd, name, st, nofollow(name)); err != nil || r == nil {
		return err
	}
	if r.dev != nil {
		st.Size = r.dev.Size()
		st.Blocks = (st.Size + 511) / 512
		return nil
	}
	ino, nlink := st.Ino, st.Nlink
	mode, uid, gid := st.Mode, st.Uid, st.Gid
	err := fsys.withData(r, dirfd, name, func(tfd int, tname string) error {
		return unix.Fstatat(tfd, tname, st, nofollow(tname))
	})
	st.Ino, st.Nlink = ino, nlink
	if r.imported != "" {
		st.Mode, st.Uid, st.Gid = mode, uid, gid
	}
	return err
}

// lastLinkRedirect returns the redirect of the marker at name when name is
// its last link, so that removing name must release what it redirects to.
func (fsys *filesystem) lastLinkRedirect(dirfd int, name string) *redirect {
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Nlink != 1 {
		return nil
	}
	return fsys.redirectOf(dirfd, name, &st)
}

// release frees what a removed marker redirected to.
func (fsys *filesystem) release(r *redirect) error {
	switch {
	case r == nil:
	case r.disk != "":
		return fsys.store.RemoveShared(r.disk)
	case r.imported != "":
		fsys.imports.drop(r.imported)
	case r.dev != nil:
		fsys.gpu.drop(r.dev.ino)
	}
	return nil
}
