package fs

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// segmentNode is a regular file of the mount: a segment. Where its bytes
// and attributes live is its kind (storage), decided once by classify.
// Its backing object is reached through its parent's descriptor and its
// name, checked to be its inode, so that a segment costs no descriptor
// while it is not open.
type segmentNode struct {
	nodeBase
	attrCache

	// kind is the segment's storage; it is swapped only while opening is
	// held for writing, when an empty segment changes device.
	kind kindRef
	// opening is held for reading while the segment is opened and its
	// handle counted, for writing while its device changes, so that no
	// open finds it half moved.
	opening sync.RWMutex

	// mu protects handles and idle.
	mu sync.Mutex
	// handles are the segment's open handles; nil when none.
	handles []*handle
	// idle, when not nil, is closed when the last handle goes.
	idle chan struct{}
	// released is when a handle was last released, since epoch.
	released atomic.Int64
	// orphan is set once the segment's last name went, or while an
	// O_TMPFILE segment has none: its inode's charge goes when its last
	// handle and mapping do (filesystem.orphaned).
	orphan atomic.Bool
	// held, in a successor while Adopt opens an orphan's handles again,
	// is the backing file its predecessor handed over (adoptOrphan).
	held *alloc.Ref
}

// newSegment makes the node of a segment whose storage is s.
func (fsys *filesystem) newSegment(s storage) *segmentNode {
	n := &segmentNode{nodeBase: nodeBase{fs: fsys}}
	n.kind.store(s)
	return n
}

// storage returns where the segment's bytes and attributes live.
func (n *segmentNode) storage() storage { return n.kind.load() }

// withMarker runs fn with the segment's backing object (the marker of a
// segment whose bytes live elsewhere), checked to be its inode. A segment
// in no directory (unlinked while open, or made with O_TMPFILE) is
// reached through one of its open handles, where its kind allows.
func (n *segmentNode) withMarker(fn func(m *alloc.Ref) error) error {
	if _, parent := n.Parent(); parent != nil {
		return n.leafRef(fn)
	}
	n.mu.Lock()
	var h segmentHandle
	if len(n.handles) > 0 {
		h = n.handles[0].open
	}
	held := n.held // only while Adopt runs, before the daemon serves
	n.mu.Unlock()
	if h == nil && held != nil {
		return fn(held)
	}
	if h == nil {
		return syscall.ENOENT
	}
	r, err := h.attrRef()
	if err != nil {
		return err
	}
	defer r.Close()
	return fn(r)
}

func (n *segmentNode) withAttrs(fn func(a *alloc.Ref) error) error {
	return n.withMarker(func(m *alloc.Ref) error { return n.storage().attrs(m, fn) })
}

func (n *segmentNode) stat(st *unix.Stat_t) error {
	return n.withMarker(func(m *alloc.Ref) error { return statOf(m, n.storage(), st) })
}

var (
	_ = (fusefs.NodeGetattrer)((*segmentNode)(nil))
	_ = (fusefs.NodeSetattrer)((*segmentNode)(nil))
	_ = (fusefs.NodeOpener)((*segmentNode)(nil))
	_ = (fusefs.NodeCopyFileRanger)((*segmentNode)(nil))
)

// Getattr answers stat through an open handle when the kernel names one
// (fstat of an unlinked segment works so), else from the backing.
func (n *segmentNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st unix.Stat_t
	ok := false
	var err error
	if h, isSeg := f.(segmentHandle); isSeg {
		ok, err = h.fstat(&st)
	}
	if !ok && err == nil {
		err = n.stat(&st)
	}
	if err != nil {
		return n.fs.errnoOf("getattr", &n.nodeBase, err)
	}
	out.FromStat(toSyscallStat(&st))
	return 0
}

// Setattr changes owner, mode and times where the segment's attributes
// live, and its size. Growth reserves memory, so ENOSPC comes here, not as
// a SIGBUS later.
func (n *segmentNode) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	err := attrsFixed(n.storage())
	if err == nil {
		err = n.setattr(ctx, in, n.followAccess)
	}
	if size, ok := in.GetSize(); ok && err == nil {
		if h, isSeg := f.(segmentHandle); isSeg && h.common().writable {
			err = h.truncate(int64(size))
		} else {
			err = n.withMarker(func(m *alloc.Ref) error { return n.storage().resize(m, int64(size)) })
		}
	}
	if err != nil {
		return n.fs.errno("setattr", &n.nodeBase, "", err)
	}
	return n.Getattr(ctx, f, out)
}

// followAccess makes a device segment's consumer counter follow a chmod
// or chown of the segment.
func (n *segmentNode) followAccess() {
	if d, ok := n.storage().(device); ok {
		d.seg.followAccess()
	}
}

// Open opens the segment. Writing a FROMFD segment is refused; O_TRUNC of
// a segment with bytes in an EXCLUSIVE directory is refused (the kernel
// hides O_CREAT from OPEN, and truncation is the harm EXCLUSIVE prevents).
func (n *segmentNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	var h segmentHandle
	err := n.fs.takeHandle(ctx, flags&openAdopted != 0, func() error {
		n.opening.RLock()
		defer n.opening.RUnlock()
		return n.withMarker(func(m *alloc.Ref) (err error) {
			h, err = n.open(ctx, m, flags)
			return err
		})
	})
	if err != nil {
		return nil, 0, n.fs.errno("open", &n.nodeBase, "", err)
	}
	return h, h.fuseFlags(), 0
}

// open opens the segment, whose backing object is m, for a FUSE open with
// flags, and counts the handle; n.opening is held.
func (n *segmentNode) open(ctx context.Context, m *alloc.Ref, flags uint32) (segmentHandle, error) {
	trunc := flags&unix.O_TRUNC != 0
	if trunc {
		if err := n.checkTruncate(m); err != nil {
			return nil, err
		}
	}
	c := caller(ctx)
	base := handle{node: n, pid: n.fs.processOf(c.Pid), uid: c.Uid, writable: flags&unix.O_ACCMODE != unix.O_RDONLY}
	s := n.storage()
	h, err := s.open(n, m, base, flags)
	if err != nil {
		return nil, err
	}
	if trunc {
		err = s.resize(m, 0)
	}
	if err == nil && (base.writable || trunc) && flags&openAdopted == 0 {
		err = n.dropSetid(ctx, m) // an adopted handle's opener did when it opened
	}
	if err != nil {
		h.close()
		return nil, err
	}
	n.track(h.common(), h)
	return h, nil
}

// dropSetid clears the set-id bits that a write by the caller would
// clear on tmpfs (writerDrops). The daemon never sees a passthrough write,
// so this is done when the segment is opened for writing, and the
// kernel's cached mode is dropped.
func (n *segmentNode) dropSetid(ctx context.Context, m *alloc.Ref) error {
	return n.storage().attrs(m, func(a *alloc.Ref) error {
		dropped, err := writerDrops(ctx, a, a.Stat()) // just opened: what the kernel checked
		if dropped {
			n.NotifyContent(-1, 0)
		}
		return err
	})
}

// writerDrops clears on a, whose stat is st, the set-id bits that a write
// by the caller of ctx would clear on tmpfs (should_remove_suid); root
// keeps them. It reports whether it cleared any.
func writerDrops(ctx context.Context, a *alloc.Ref, st *unix.Stat_t) (bool, error) {
	if caller(ctx).Uid == 0 {
		return false, nil
	}
	kill := setidToDrop(st, inGroupOf(ctx))
	if kill == 0 {
		return false, nil
	}
	return true, a.Chmod(st.Mode &^ kill)
}

// checkTruncate refuses O_TRUNC of a segment with bytes in an EXCLUSIVE
// directory.
func (n *segmentNode) checkTruncate(m *alloc.Ref) error {
	_, parent := n.Parent()
	if parent == nil {
		return nil
	}
	d := dirOf(parent)
	pf, err := d.flags(d)
	if err != nil || pf&alloc.Exclusive == 0 {
		return err
	}
	var st unix.Stat_t
	if err := statOf(m, n.storage(), &st); err != nil {
		return err
	}
	if st.Size > 0 {
		return fmt.Errorf("%w: O_TRUNC of a segment with %d bytes", alloc.ErrExists, st.Size)
	}
	return nil
}

// track records a new open handle of the segment, then stops a watch for
// its last mapping (watchMapped).
func (n *segmentNode) track(h *handle, open segmentHandle) {
	h.open = open
	n.mu.Lock()
	n.handles = append(n.handles, h)
	n.mu.Unlock()
	n.fs.watches.unwatch(n.StableAttr().Ino)
}

// release drops an open handle and reclaims an UNLINK segment whose last
// reference went.
func (n *segmentNode) release(h *handle) {
	n.released.Store(int64(time.Since(epoch)))
	n.mu.Lock()
	for i, o := range n.handles {
		if o == h {
			n.handles = append(n.handles[:i], n.handles[i+1:]...)
			break
		}
	}
	left := len(n.handles)
	if left == 0 {
		n.handles = nil
		if n.idle != nil {
			close(n.idle)
			n.idle = nil
		}
	}
	n.mu.Unlock()
	if left == 0 {
		n.fs.reclaimLater(n, h.uid)
	}
}

// closeWait bounds how long a device change waits for handles to go.
const closeWait = 200 * time.Millisecond

// awaitClosed waits up to closeWait for the segment's handles to be
// released and reports whether none is left: the kernel sends RELEASE
// after close(2) returns, so a close followed at once by a request may
// find the handle still open.
func (n *segmentNode) awaitClosed() bool {
	timeout := time.NewTimer(closeWait)
	defer timeout.Stop()
	for {
		n.mu.Lock()
		if len(n.handles) == 0 {
			n.mu.Unlock()
			return true
		}
		if n.idle == nil {
			n.idle = make(chan struct{})
		}
		idle := n.idle
		n.mu.Unlock()
		select {
		case <-idle:
		case <-timeout.C:
			return false
		}
	}
}

// openHandles returns the number of open handles by the process that
// opened them.
func (n *segmentNode) openHandles() map[uint32]int {
	n.mu.Lock()
	defer n.mu.Unlock()
	m := make(map[uint32]int, len(n.handles))
	for _, h := range n.handles {
		m[h.pid]++
	}
	return m
}

// maxCopyChunk bounds one copy_file_range reply (a uint32 count); the
// kernel asks again for the rest.
const maxCopyChunk = 1 << 30

// CopyFileRange copies between two open segments of the mount inside the
// daemon: host to device and back run in the device process at DMA speed
// (cp uses copy_file_range), host to host in the kernel.
func (n *segmentNode) CopyFileRange(ctx context.Context, fhIn fusefs.FileHandle, offIn uint64, out *fusefs.Inode,
	fhOut fusefs.FileHandle, offOut uint64, length uint64, flags uint64) (uint32, syscall.Errno) {
	in, okIn := fhIn.(segmentHandle)
	dst, okOut := fhOut.(segmentHandle)
	if !okIn || !okOut || flags != 0 {
		return 0, syscall.EINVAL
	}
	if !dst.common().writable {
		return 0, syscall.EBADF
	}
	size := int64(min(length, maxCopyChunk))
	var copied int64
	var err error
	src, _ := in.(*fileHandle)
	to, _ := dst.(*fileHandle)
	switch {
	case src != nil && to != nil:
		var c int
		oi, oo := int64(offIn), int64(offOut)
		c, err = unix.CopyFileRange(src.fd, &oi, to.fd, &oo, int(size), 0)
		copied = int64(c)
	case src != nil:
		var st unix.Stat_t
		if err = unix.Fstat(src.fd, &st); err == nil {
			copied = min(size, st.Size-int64(offIn))
			if copied > 0 {
				err = dst.(*deviceHandle).seg.fromFile(src.fd, int64(offIn), int64(offOut), copied)
			}
		}
	case to != nil:
		copied, err = in.(*deviceHandle).seg.toFile(to.fd, int64(offIn), int64(offOut), size)
	default:
		copied, err = copyDeviceToDevice(in.(*deviceHandle).seg, int64(offIn), dst.(*deviceHandle).seg, int64(offOut), size)
	}
	if err != nil {
		return 0, n.fs.errno("copy_file_range", &n.nodeBase, "", err)
	}
	return uint32(max(copied, 0)), 0
}

// copyDeviceToDevice copies through host memory; the pair is rare.
func copyDeviceToDevice(src *devSeg, offIn int64, dst *devSeg, offOut, size int64) (int64, error) {
	buf := make([]byte, min(size, 4<<20))
	var done int64
	for done < size {
		n, err := src.read(buf[:min(int64(len(buf)), size-done)], offIn+done)
		if err != nil || n == 0 {
			return done, err
		}
		if err := dst.write(buf[:n], offOut+done); err != nil {
			return done, err
		}
		done += int64(n)
	}
	return done, nil
}
