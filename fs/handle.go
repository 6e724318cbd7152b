package fs

import (
	"context"
	"fmt"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// The operations an open segment serves are written down here, one
// method each, for the two handle types: fileHandle (bytes in a host
// file: host, SHARED and imported segments) and deviceHandle (bytes in
// device memory). Nothing is inherited from go-fuse's LoopbackFile, which
// would run any ioctl, lseek or fallocate on the backing descriptor with
// the daemon's rights. Every node answers ioctl with ENOTTY
// (nodeBase.Ioctl), before a handle is asked; what a handle does not
// serve, go-fuse answers: locks ENOTSUP (never asked: locks are not
// negotiated, the kernel keeps them). The operation matrix test
// (ops_test.go) checks every FUSE opcode on every kind of node.

// handle is what every open segment keeps, whatever its kind.
type handle struct {
	node *segmentNode
	// pid is the process (thread group) that opened it.
	pid uint32
	// uid opened it; its handle budget counts the handle until Release.
	uid uint32
	// writable is true when the FUSE open allows writing; the kernel
	// checks it too, this is the daemon's own check.
	writable bool
	// open is the handle as its kind serves it.
	open segmentHandle
}

// segmentHandle is an open segment as its kind serves it.
type segmentHandle interface {
	fusefs.FileHandle
	fusefs.FileReleaser
	// common returns the handle's kind-independent state.
	common() *handle
	// fstat fills st's size, blocks and times from the open bytes; false
	// when the handle has no file of its own to stat.
	fstat(st *unix.Stat_t) (bool, error)
	// truncate sets the segment's size through the handle.
	truncate(size int64) error
	// attrRef returns the object holding the segment's attributes,
	// reached through the handle: for a segment in no directory.
	attrRef() (*alloc.Ref, error)
	// fuseFlags is the FOPEN_ answer for the handle.
	fuseFlags() uint32
	// close releases what the handle holds of its kind (Release, or an
	// open that failed after the kind opened it).
	close()
}

func (h *handle) common() *handle { return h }

// release ends the handle's part in its segment: the node forgets it (and
// an UNLINK segment whose last reference went is removed), what its kind
// holds is closed, and the opener's budget gets the handle back.
func (h *handle) release() {
	h.node.release(h)
	h.open.close()
	h.node.fs.handles.Give(h.uid, 1)
}

// errno logs a refused handle operation and maps its error.
func (h *handle) errno(op string, err error) syscall.Errno {
	return h.node.fs.errno(op, &h.node.nodeBase, "", err)
}

// fileHandle serves a segment whose bytes are in a host file, open at fd
// with the access the FUSE open needs (read-write in passthrough mode,
// where the kernel shares one backing file among all opens of a segment
// and checks each open's own access itself).
type fileHandle struct {
	handle
	fd int
	// passthrough is true when the kernel does reads, writes and mmaps
	// against fd itself.
	passthrough bool
	// attrsHere is true when fd's file holds the segment's attributes
	// too (host and SHARED segments; not an imported one's).
	attrsHere bool
	// unnamed is true for an O_TMPFILE segment's handle: at close, a
	// segment no name was given is gone, and so is its inode's charge.
	unnamed bool
}

var (
	_ = (fusefs.FilePassthroughFder)((*fileHandle)(nil))
	_ = (fusefs.FileReleaser)((*fileHandle)(nil))
	_ = (fusefs.FileReader)((*fileHandle)(nil))
	_ = (fusefs.FileWriter)((*fileHandle)(nil))
	_ = (fusefs.FileWritever)((*fileHandle)(nil))
	_ = (fusefs.FileFsyncer)((*fileHandle)(nil))
	_ = (fusefs.FileFlusher)((*fileHandle)(nil))
	_ = (fusefs.FileAllocater)((*fileHandle)(nil))
	_ = (fusefs.FileLseeker)((*fileHandle)(nil))
)

// PassthroughFd hands fd to the kernel when passthrough is in force.
func (h *fileHandle) PassthroughFd() (int, bool) { return h.fd, h.passthrough }

// Release closes the descriptor after the node has forgotten the handle,
// so that the node never hands out a closed descriptor.
func (h *fileHandle) Release(ctx context.Context) syscall.Errno {
	h.release()
	return 0
}

func (h *fileHandle) close() {
	var st unix.Stat_t
	if h.unnamed && unix.Fstat(h.fd, &st) == nil && st.Nlink == 0 {
		h.node.fs.inodes.gone(st.Ino)
	}
	unix.Close(h.fd)
}

// fuseFlags: close() needs no FLUSH (writes never wait in the daemon and
// the kernel keeps locks itself). Without passthrough the page cache is
// kept across opens, since writes come through this mount, except for
// segments whose bytes also change outside it: imported ones and KEEPFD
// ones, whose descriptors are handed out.
func (h *fileHandle) fuseFlags() uint32 {
	if h.passthrough {
		return fuse.FOPEN_NOFLUSH
	}
	if f, err := h.node.flags(h.node); err != nil || f&(alloc.KeepFD|alloc.FromFD) != 0 {
		return fuse.FOPEN_NOFLUSH
	}
	return fuse.FOPEN_NOFLUSH | fuse.FOPEN_KEEP_CACHE
}

// Read serves a classic-mode read by splicing from fd.
func (h *fileHandle) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultFd(uintptr(h.fd), off, len(buf)), 0
}

// Write serves a classic-mode write, refusing to grow the segment past
// alloc.MaxSegmentSize (EFBIG); in passthrough mode the kernel's own
// limits apply.
func (h *fileHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	return h.Writev(ctx, [][]byte{data}, off)
}

// Writev is Write for a vector of buffers.
func (h *fileHandle) Writev(ctx context.Context, data [][]byte, off int64) (uint32, syscall.Errno) {
	if err := h.checkWrite(off, data); err != nil {
		return 0, h.errno("write", err)
	}
	n, err := unix.Pwritev(h.fd, data, off)
	if err != nil {
		return uint32(max(n, 0)), h.errno("write", err)
	}
	return uint32(n), 0
}

// checkWrite refuses a write through a handle not opened for writing, or
// past alloc.MaxSegmentSize.
func (h *handle) checkWrite(off int64, data [][]byte) error {
	end := off
	for _, d := range data {
		end += int64(len(d))
	}
	switch {
	case !h.writable:
		return fmt.Errorf("%w: the segment was not opened for writing", syscall.EBADF)
	case off < 0 || end > alloc.MaxSegmentSize:
		return fmt.Errorf("%w: a write to byte %d is past the largest segment", alloc.ErrTooBig, end)
	}
	return nil
}

// Fsync flushes a SHARED segment's disk file; on tmpfs it costs nothing.
func (h *fileHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	return h.errno("fsync", unix.Fsync(h.fd))
}

// Flush has nothing to do: writes never wait in the daemon, and the
// kernel keeps locks itself (opens answer FOPEN_NOFLUSH, so it is not
// even asked).
func (h *fileHandle) Flush(ctx context.Context) syscall.Errno { return 0 }

// Allocate reserves or releases the segment's pages: mode 0 (grow and
// reserve, ENOSPC on a full mount), FALLOC_FL_KEEP_SIZE, and
// FALLOC_FL_PUNCH_HOLE with it. Other modes are EOPNOTSUPP.
func (h *fileHandle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	err := checkAllocate(&h.handle, off, size, mode)
	if err == nil {
		err = unix.Fallocate(h.fd, mode, int64(off), int64(size))
	}
	return h.errno("fallocate", err)
}

// checkAllocate refuses a fallocate through a handle not opened for
// writing, of a mode tensorfs does not serve, or past the largest segment.
func checkAllocate(h *handle, off, size uint64, mode uint32) error {
	switch mode {
	case 0, unix.FALLOC_FL_KEEP_SIZE, unix.FALLOC_FL_KEEP_SIZE | unix.FALLOC_FL_PUNCH_HOLE:
	default:
		return fmt.Errorf("%w: fallocate mode %#x", syscall.EOPNOTSUPP, mode)
	}
	if !h.writable {
		return fmt.Errorf("%w: the segment was not opened for writing", syscall.EBADF)
	}
	if off+size < off || off+size > alloc.MaxSegmentSize {
		return fmt.Errorf("%w: fallocate to byte %d", alloc.ErrTooBig, off+size)
	}
	return nil
}

// Lseek answers SEEK_DATA and SEEK_HOLE from the file's own extents; the
// kernel does the other whences itself.
func (h *fileHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	if whence != unix.SEEK_DATA && whence != unix.SEEK_HOLE {
		return 0, syscall.EINVAL
	}
	// A descriptor of its own, so that no other request's offset moves.
	fd, err := unix.FcntlInt(uintptr(h.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return 0, h.errno("lseek", err)
	}
	defer unix.Close(fd)
	pos, err := unix.Seek(fd, int64(off), int(whence))
	if err != nil {
		return 0, toErrno(err) // ENXIO past the end is an answer, not a refusal
	}
	return uint64(pos), 0
}

// fstat answers for a file that holds the attributes too; an imported
// segment's owner and mode are its marker's, not the sender's file's.
func (h *fileHandle) fstat(st *unix.Stat_t) (bool, error) {
	if !h.attrsHere {
		return false, nil
	}
	return true, unix.Fstat(h.fd, st)
}

func (h *fileHandle) truncate(size int64) error {
	if !h.writable {
		return fmt.Errorf("%w: the segment was not opened for writing", syscall.EBADF)
	}
	return alloc.Resize(h.fd, size)
}

func (h *fileHandle) attrRef() (*alloc.Ref, error) {
	if !h.attrsHere {
		return nil, fmt.Errorf("%w: the segment's attributes went with its last name", syscall.ENOENT)
	}
	return alloc.OpenRef(h.fd, "", 0)
}

// deviceHandle serves a device segment: the daemon copies every read and
// write between the caller and device memory (direct I/O; mmap is ENODEV).
type deviceHandle struct {
	handle
	seg *devSeg
}

var (
	_ = (fusefs.FileReleaser)((*deviceHandle)(nil))
	_ = (fusefs.FileReader)((*deviceHandle)(nil))
	_ = (fusefs.FileWriter)((*deviceHandle)(nil))
	_ = (fusefs.FileFsyncer)((*deviceHandle)(nil))
	_ = (fusefs.FileFlusher)((*deviceHandle)(nil))
	_ = (fusefs.FileAllocater)((*deviceHandle)(nil))
	_ = (fusefs.FileLseeker)((*deviceHandle)(nil))
)

// Release forgets the handle; a segment removed meanwhile frees its
// memory from limbo once nothing refers to it.
func (h *deviceHandle) Release(ctx context.Context) syscall.Errno {
	h.release()
	return 0
}

func (h *deviceHandle) close() { h.seg.closed() }

// fuseFlags: the daemon serves every read and write (direct I/O), which
// also makes mmap fail with ENODEV: the bytes are not in host memory.
func (h *deviceHandle) fuseFlags() uint32 { return fuse.FOPEN_DIRECT_IO | fuse.FOPEN_NOFLUSH }

// Read copies bytes out of device memory.
func (h *deviceHandle) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n, err := h.seg.read(buf, off)
	if err != nil {
		return nil, h.errno("read", err)
	}
	return fuse.ReadResultData(buf[:n]), 0
}

// Write copies bytes into device memory, growing the segment as a file
// grows.
func (h *deviceHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	err := h.checkWrite(off, [][]byte{data})
	if err == nil {
		err = h.seg.write(data, off)
	}
	if err != nil {
		return 0, h.errno("write", err)
	}
	return uint32(len(data)), 0
}

// Fsync has nothing to flush: device memory is the segment.
func (h *deviceHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno { return 0 }

// Flush has nothing to do (see fileHandle.Flush).
func (h *deviceHandle) Flush(ctx context.Context) syscall.Errno { return 0 }

// Allocate grows the segment (mode 0); the other modes tensorfs serves
// change nothing on a device, whose memory is always allocated.
func (h *deviceHandle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	err := checkAllocate(&h.handle, off, size, mode)
	if err == nil && mode == 0 {
		err = h.seg.grow(int64(off + size))
	}
	return h.errno("fallocate", err)
}

// Lseek answers SEEK_DATA and SEEK_HOLE: device memory has no holes.
func (h *deviceHandle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	size := uint64(h.seg.Size())
	switch {
	case whence != unix.SEEK_DATA && whence != unix.SEEK_HOLE:
		return 0, syscall.EINVAL
	case off >= size:
		return 0, syscall.ENXIO
	case whence == unix.SEEK_DATA:
		return off, 0
	}
	return size, 0
}

func (h *deviceHandle) fstat(st *unix.Stat_t) (bool, error) { return false, nil }

func (h *deviceHandle) truncate(size int64) error {
	if !h.writable {
		return fmt.Errorf("%w: the segment was not opened for writing", syscall.EBADF)
	}
	return h.seg.resize(size)
}

func (h *deviceHandle) attrRef() (*alloc.Ref, error) { return h.seg.backingRef() }
