package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// handle is an open segment. In passthrough mode the kernel does its
// reads, writes and mmaps against fd; otherwise the embedded
// LoopbackFile serves them from fd (with splice for reads).
type handle struct {
	*fusefs.LoopbackFile
	node *node
	fd   int
	pid  uint32
	// uid opened it; its handle budget counts the handle until Release.
	uid uint32
	// writable is true when fd was opened for writing.
	writable bool
	// seg is the device segment whose bytes this handle reads and
	// writes; nil for host segments, whose bytes are at fd.
	seg *devSeg
}

var (
	_ = (fusefs.FilePassthroughFder)((*handle)(nil))
	_ = (fusefs.FileReleaser)((*handle)(nil))
)

// PassthroughFd hands fd to the kernel when passthrough is in force.
func (h *handle) PassthroughFd() (int, bool) {
	return h.fd, h.node.fs.passthrough && h.seg == nil
}

// Release closes the backing descriptor and drops the handle's
// reference; an UNLINK segment whose last reference goes is removed.
func (h *handle) Release(ctx context.Context) syscall.Errno {
	h.node.release(h) // first: the node must not hand out a closed fd
	if h.seg != nil {
		h.seg.closed()
	}
	errno := h.LoopbackFile.Release(ctx)
	h.node.fs.handles.give(h.uid)
	return errno
}

// backingFlags turns the flags of a FUSE open into those of the backing
// open. In passthrough mode the kernel shares one backing file among all
// opens of a segment, so it is opened read-write without O_APPEND or
// O_DIRECT, which the kernel applies per open itself.
func (fsys *filesystem) backingFlags(flags uint32) int {
	if fsys.passthrough {
		return unix.O_RDWR | unix.O_CLOEXEC
	}
	keep := unix.O_ACCMODE | unix.O_APPEND | unix.O_DIRECT | unix.O_SYNC | unix.O_DSYNC | unix.O_NOATIME
	return int(flags)&keep | unix.O_CLOEXEC
}

// openFlags is the FOPEN_ answer for n. A device segment is read and
// written through the daemon (direct I/O), which also makes mmap fail
// with ENODEV: its bytes are not in host memory. close() needs no FLUSH: writes
// never wait in the daemon and the kernel keeps locks itself. Without
// passthrough the page cache is kept across opens, since writes come
// through this mount, except for segments whose bytes also change
// outside it: imported ones and KEEPFD ones, whose descriptors are handed
// out.
func (n *node) openFlags() uint32 {
	if n.device() != nil {
		return fuse.FOPEN_DIRECT_IO | fuse.FOPEN_NOFLUSH
	}
	if n.fs.passthrough {
		return fuse.FOPEN_NOFLUSH
	}
	if f, err := n.flags(); err != nil || f&(alloc.KeepFD|alloc.FromFD) != 0 {
		return fuse.FOPEN_NOFLUSH
	}
	return fuse.FOPEN_NOFLUSH | fuse.FOPEN_KEEP_CACHE
}

// processOf returns the process (thread group) of a thread: FUSE names
// the calling thread, holders are processes.
func (fsys *filesystem) processOf(tid uint32) uint32 {
	fsys.tgidsMu.Lock()
	pid, ok := fsys.tgids[tid]
	fsys.tgidsMu.Unlock()
	if ok {
		return pid
	}
	pid = readTgid(tid)
	fsys.tgidsMu.Lock()
	if len(fsys.tgids) >= maxTgids {
		fsys.tgids = map[uint32]uint32{}
	}
	fsys.tgids[tid] = pid
	fsys.tgidsMu.Unlock()
	return pid
}

// maxTgids bounds the thread to process cache; it starts over when full.
const maxTgids = 1 << 16

// readTgid reads a thread's process from /proc.
func readTgid(tid uint32) uint32 {
	f, err := os.Open("/proc/" + strconv.Itoa(int(tid)) + "/status")
	if err != nil {
		return tid
	}
	defer f.Close()
	buf := make([]byte, 512) // Tgid is among the first lines
	n, _ := f.Read(buf)
	for _, line := range strings.Split(string(buf[:n]), "\n") {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			if pid, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				return uint32(pid)
			}
		}
	}
	return tid
}

// newHandle wraps an open backing descriptor and counts the reference;
// the caller took the handle from the caller's budget (takeHandle).
func (n *node) newHandle(ctx context.Context, fd, flags int) *handle {
	h := &handle{
		LoopbackFile: fusefs.NewLoopbackFile(fd).(*fusefs.LoopbackFile),
		node:         n,
		fd:           fd,
		pid:          n.fs.processOf(caller(ctx).Pid),
		uid:          caller(ctx).Uid,
		writable:     flags&unix.O_ACCMODE != unix.O_RDONLY,
		seg:          n.device(),
	}
	if h.seg != nil {
		h.seg.opened()
	}
	n.acquire(h)
	return h
}

var _ = (fusefs.NodeOpener)((*node)(nil))

// Open opens a segment. Writing a FROMFD segment is refused; O_TRUNC of
// a segment with bytes in an EXCLUSIVE directory is refused (the kernel
// hides O_CREAT from OPEN, and truncation is the harm EXCLUSIVE prevents).
func (n *node) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	var h *handle
	err := n.fs.takeHandle(ctx, func() error {
		return n.at(func(dirfd int, name string) (err error) {
			h, err = n.open(ctx, dirfd, name, flags)
			return err
		})
	})
	if err != nil {
		return nil, 0, n.fs.errno("open", n, "", err)
	}
	return h, n.openFlags(), 0
}

// open opens n, whose backing object is name in dirfd, for a FUSE open
// with flags, and counts the handle.
func (n *node) open(ctx context.Context, dirfd int, name string, flags uint32) (*handle, error) {
	n.opening.RLock()
	defer n.opening.RUnlock()
	bflags := n.fs.backingFlags(flags)
	var fd int
	var err error
	if r := n.redir(); r != nil && r.imported != "" {
		// The sender's own open file, shared: never reopened, so never
		// with more access than the sender gave.
		bflags = unix.O_RDONLY | unix.O_CLOEXEC
		if flags&unix.O_ACCMODE != unix.O_RDONLY {
			return nil, fmt.Errorf("%w: FROMFD segments are read-only", alloc.ErrReadOnly)
		}
		fd, err = n.fs.imports.dup(r.imported)
	} else {
		err = n.fs.withAttrs(n.redir(), dirfd, name, func(tfd int, tname string) (err error) {
			fd, err = n.openBacking(tfd, tname, flags, bflags)
			return err
		})
	}
	if err == nil && (flags&unix.O_ACCMODE != unix.O_RDONLY || flags&unix.O_TRUNC != 0) {
		if err = n.dropSetid(fd, caller(ctx)); err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		return nil, err
	}
	return n.newHandle(ctx, fd, bflags), nil
}

// openBacking opens n's backing object, name in dirfd, with bflags for a
// FUSE open with flags, truncating it for O_TRUNC.
func (n *node) openBacking(dirfd int, name string, flags uint32, bflags int) (int, error) {
	if flags&unix.O_TRUNC != 0 {
		if err := n.checkTruncate(); err != nil {
			return -1, err
		}
	}
	fd, err := openAt(dirfd, name, bflags)
	if err != nil || flags&unix.O_TRUNC == 0 {
		return fd, err
	}
	err = unix.Ftruncate(fd, 0)
	if seg := n.device(); seg != nil {
		seg.mu.Lock()
		err = seg.resize(0)
		seg.mu.Unlock()
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// dropSetid clears the set-id bits of the segment open at fd that a
// write by caller would clear on tmpfs (should_remove_suid): set-user-ID,
// and set-group-ID if group-executable or caller is not of its group;
// root keeps them. The daemon never sees a passthrough write, so this is
// done when the segment is opened for writing, and the kernel's cached
// mode is dropped.
func (n *node) dropSetid(fd int, c *fuse.Caller) error {
	if c.Uid == 0 {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if kill := setidToDrop(&st, c.Gid); kill != 0 {
		if err := unix.Fchmod(fd, st.Mode&07777&^kill); err != nil {
			return err
		}
		n.NotifyContent(-1, 0)
	}
	return nil
}

// setidToDrop returns the set-id bits of st that a write by a process of
// group gid (not root) clears.
func setidToDrop(st *unix.Stat_t, gid uint32) uint32 {
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return 0
	}
	kill := st.Mode & unix.S_ISUID
	if st.Mode&unix.S_ISGID != 0 && (st.Mode&unix.S_IXGRP != 0 || st.Gid != gid) {
		kill |= unix.S_ISGID
	}
	return kill
}

// checkTruncate refuses O_TRUNC of a segment with bytes in an EXCLUSIVE
// directory.
func (n *node) checkTruncate() error {
	_, parent := n.Parent()
	if parent == nil {
		return nil
	}
	pf, err := parent.Operations().(*node).flags()
	if err != nil || pf&alloc.Exclusive == 0 {
		return err
	}
	var st unix.Stat_t
	if err := n.stat(&st); err != nil {
		return err
	}
	if st.Size > 0 {
		return fmt.Errorf("%w: O_TRUNC of a segment with %d bytes", alloc.ErrExists, st.Size)
	}
	return nil
}

var _ = (fusefs.NodeCreater)((*node)(nil))

// Create makes and opens a new segment that inherits the directory's
// flags. In an EXCLUSIVE directory an existing name is EEXIST.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	var ch *fusefs.Inode
	var h *handle
	err := n.fs.takeHandle(ctx, func() error {
		return n.withDir(func(dirfd int) error {
			pf, err := n.creatable()
			if err != nil {
				return err
			}
			bflags := n.fs.backingFlags(flags)
			fd, err := unix.Openat(dirfd, name, bflags|unix.O_CREAT|unix.O_EXCL, mode)
			if errors.Is(err, unix.EEXIST) {
				if flags&unix.O_EXCL != 0 {
					return err
				}
				if pf&alloc.Exclusive != 0 {
					return fmt.Errorf("%w: %s", alloc.ErrExists, name)
				}
				// Lost a race with another creator: open what is there.
				if ch, err = n.child(ctx, dirfd, name, out); err != nil {
					return err
				}
				h, err = ch.Operations().(*node).open(ctx, dirfd, name, flags)
				return err
			}
			if err != nil {
				return err
			}
			var r *redirect
			if pf&alloc.Shared != 0 {
				// The marker stays empty; the bytes live on --disk.
				marker := fd
				var id string
				fd, id, err = n.fs.sharedFile(marker, name, n.Path(nil), bflags, mode)
				unix.Close(marker)
				if err != nil {
					unix.Unlinkat(dirfd, name, 0)
					return err
				}
				r = &redirect{disk: id}
			}
			if ch, err = n.adopt(ctx, dirfd, name, pf, r, out); err != nil {
				unix.Close(fd)
				return err
			}
			h = ch.Operations().(*node).newHandle(ctx, fd, bflags)
			return nil
		})
	})
	if err != nil {
		return nil, nil, 0, n.fs.errno("create", n, name, err)
	}
	return ch, h, ch.Operations().(*node).openFlags(), 0
}

var _ = (fusefs.NodeTmpfiler)((*node)(nil))

// Tmpfile makes an open segment in no directory (O_TMPFILE); linkat can
// give it a name later.
func (n *node) Tmpfile(ctx context.Context, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	var ch *fusefs.Inode
	var h *handle
	err := n.fs.takeHandle(ctx, func() error {
		return n.withDir(func(dirfd int) error {
			pf, err := n.creatable()
			if err != nil {
				return err
			}
			bflags := n.fs.backingFlags(flags)
			fd, err := unix.Openat(dirfd, ".", bflags|unix.O_TMPFILE, mode)
			if err != nil {
				return err
			}
			p := alloc.FdPath(fd)
			var st unix.Stat_t
			if uid, gid, ok := n.fs.owner(ctx, dirfd); ok {
				err = unix.Fchown(fd, uid, gid)
			}
			if err == nil {
				err = alloc.InheritFlags(pf, p, false)
			}
			if err == nil {
				err = unix.Fstat(fd, &st)
			}
			if err != nil {
				unix.Close(fd)
				return err
			}
			out.Attr.FromStat(toSyscallStat(&st))
			ch = n.NewInode(ctx, n.fs.newNode(syscall.S_IFREG, nil), fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: st.Ino})
			h = ch.Operations().(*node).newHandle(ctx, fd, bflags)
			return nil
		})
	})
	if err != nil {
		return nil, nil, 0, n.fs.errno("tmpfile", n, "", err)
	}
	return ch, h, ch.Operations().(*node).openFlags(), 0
}

var (
	_ = (fusefs.FileWriter)((*handle)(nil))
	_ = (fusefs.FileWritever)((*handle)(nil))
)

// Write refuses to grow a segment past alloc.MaxSegmentSize (EFBIG).
// Only classic mode sees writes; in passthrough mode the kernel's own
// limits apply.
func (h *handle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	if off+int64(len(data)) > alloc.MaxSegmentSize {
		return 0, syscall.EFBIG
	}
	if h.seg != nil {
		if err := h.seg.write(data, off); err != nil {
			return 0, h.node.fs.errno("write", h.node, "", err)
		}
		return uint32(len(data)), 0
	}
	return h.LoopbackFile.Write(ctx, data, off)
}

// Writev is Write for a vector of buffers.
func (h *handle) Writev(ctx context.Context, data [][]byte, off int64) (uint32, syscall.Errno) {
	end := off
	for _, d := range data {
		end += int64(len(d))
	}
	if end > alloc.MaxSegmentSize {
		return 0, syscall.EFBIG
	}
	if h.seg != nil {
		var n uint32
		for _, d := range data {
			w, errno := h.Write(ctx, d, off)
			n, off = n+w, off+int64(w)
			if errno != 0 {
				return n, errno
			}
		}
		return n, 0
	}
	return h.LoopbackFile.Writev(ctx, data, off)
}

var (
	_ = (fusefs.FileReader)((*handle)(nil))
	_ = (fusefs.FileAllocater)((*handle)(nil))
)

// Read serves a device segment's bytes; a host segment's come from fd.
func (h *handle) Read(ctx context.Context, buf []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if h.seg == nil {
		return h.LoopbackFile.Read(ctx, buf, off)
	}
	n, err := h.seg.read(buf, off)
	if err != nil {
		return nil, h.node.fs.errno("read", h.node, "", err)
	}
	return fuse.ReadResultData(buf[:n]), 0
}

// Allocate reserves a host segment's pages; a device segment grows.
func (h *handle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	if h.seg == nil {
		return h.LoopbackFile.Allocate(ctx, off, size, mode)
	}
	if mode != 0 {
		return syscall.EOPNOTSUPP
	}
	h.seg.mu.Lock()
	defer h.seg.mu.Unlock()
	if end := int64(off + size); end > h.seg.size {
		return h.node.fs.errno("fallocate", h.node, "", h.seg.resize(end))
	}
	return 0
}
