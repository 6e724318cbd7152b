package fs

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// shared is a SHARED segment: a file on the --disk directory, named by
// its id, holds its bytes and its attributes, so that both outlive the
// backing (and a purge); the backing holds an empty marker at the
// segment's name.
type shared struct {
	store *alloc.Store
	id    string
}

func (shared) kind() alloc.Kind { return alloc.Disk }

// attrs reaches the disk file by its id in the daemon's private disk
// directory; ids are checked before they name a file (alloc.ReadMarker).
func (s shared) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error {
	r, err := alloc.OpenRef(s.store.DiskFd, s.id, 0)
	if err != nil {
		return err
	}
	defer r.Close()
	return fn(r)
}

// overlay is the disk file's stat, with the marker's inode and links.
func (s shared) overlay(m *alloc.Ref, st *unix.Stat_t) error {
	return s.attrs(m, func(r *alloc.Ref) error {
		ino, nlink := st.Ino, st.Nlink
		if err := unix.Fstat(r.Fd(), st); err != nil {
			return err
		}
		st.Ino, st.Nlink = ino, nlink
		return nil
	})
}

func (s shared) open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error) {
	bflags, pt := n.fs.backingFlags(flags)
	var fd int
	err := s.attrs(m, func(r *alloc.Ref) (err error) {
		fd, err = r.Open(bflags)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &fileHandle{handle: h, fd: fd, passthrough: pt, attrsHere: true}, nil
}

func (s shared) resize(m *alloc.Ref, size int64) error {
	return s.attrs(m, func(r *alloc.Ref) error { return resizeFile(r, size) })
}

func (s shared) descriptor(m *alloc.Ref, write bool) (f *os.File, err error) {
	err = s.attrs(m, func(r *alloc.Ref) error {
		f, err = openFile(r, write)
		return err
	})
	return f, err
}

func (s shared) mapped(m *alloc.Ref) (id fileID, uid uint32, ok bool) {
	s.attrs(m, func(r *alloc.Ref) error {
		id, uid, ok = fileID{r.Stat().Dev, r.Stat().Ino}, anyUID, true
		return nil
	})
	return id, uid, ok
}

func (s shared) handle(m *alloc.Ref) (p string, err error) {
	err = s.attrs(m, func(r *alloc.Ref) error {
		p, err = os.Readlink(alloc.FdPath(r.Fd()))
		return err
	})
	return p, err
}

func (s shared) release() error { return s.store.RemoveShared(s.id) }

// createShared makes the disk file of a new SHARED segment whose marker
// is open at marker, and returns it open with flags, as the segment's
// storage. The disk file records the marker's path as the kernel names it
// while no rename runs (sharedPaths), so that a rename either comes
// before and is in that path, or after and records the new one.
func (fsys *filesystem) createShared(marker int, flags int, mode uint32) (int, storage, error) {
	if fsys.store.Disk == "" {
		return -1, nil, fmt.Errorf("%w: the directory is SHARED", alloc.ErrNoDisk)
	}
	fsys.sharedPaths.Lock()
	defer fsys.sharedPaths.Unlock()
	rel, err := fsys.store.RelPath(marker)
	if err != nil {
		return -1, nil, err
	}
	fd, id, err := fsys.store.CreateShared(alloc.FdPath(marker), rel, flags, mode)
	if err != nil {
		return -1, nil, err
	}
	return fd, shared{fsys.store, id}, nil
}
