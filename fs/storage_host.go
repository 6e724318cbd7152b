package fs

import (
	"os"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// host is the default kind (SHAREDMEM): the segment's backing file on the
// backing tmpfs holds its bytes and its attributes.
type host struct{}

func (host) kind() alloc.Kind { return alloc.Host }

func (host) attrs(m *alloc.Ref, fn func(*alloc.Ref) error) error { return fn(m) }

func (host) overlay(*alloc.Ref, *unix.Stat_t) error { return nil }

func (host) open(n *segmentNode, m *alloc.Ref, h handle, flags uint32) (segmentHandle, error) {
	bflags, pt := n.fs.backingFlags(flags)
	fd, err := m.Open(bflags)
	if err != nil {
		return nil, err
	}
	if h.writable {
		if err := n.fs.frozen(m.Stat().Ino); err != nil {
			unix.Close(fd)
			return nil, err
		}
	}
	return &fileHandle{handle: h, fd: fd, passthrough: pt, attrsHere: true}, nil
}

func (host) resize(m *alloc.Ref, size int64) error { return resizeFile(m, size) }

func (host) descriptor(m *alloc.Ref, write bool) (*os.File, error) { return openFile(m, write) }

func (host) mapped(m *alloc.Ref) (fileID, uint32, bool) {
	return fileID{m.Stat().Dev, m.Stat().Ino}, anyUID, true
}

func (host) handle(m *alloc.Ref) (string, error) { return os.Readlink(alloc.FdPath(m.Fd())) }

func (host) release() error { return nil }

// resizeFile sets the size of the regular file r (alloc.Resize: growth
// reserves its pages).
func resizeFile(r *alloc.Ref, size int64) error {
	fd, err := r.Open(unix.O_WRONLY)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return alloc.Resize(fd, size)
}

// openFile opens the regular file r for a control-socket peer: read-only,
// or read-write when write is asked.
func openFile(r *alloc.Ref, write bool) (*os.File, error) {
	return segmentFile(r.Open(accessMode(write)))
}

// accessMode is the open flag of read-only, or read-write when write.
func accessMode(write bool) int {
	if write {
		return unix.O_RDWR
	}
	return unix.O_RDONLY
}

// segmentFile is a File of fd, an open's result.
func segmentFile(fd int, err error) (*os.File, error) {
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "segment"), nil
}
