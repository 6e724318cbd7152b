package fs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/procfs"
)

// attrCache caches the stored flags and tensor layout of a directory or
// segment: they change only through this mount's Setxattr and
// Removexattr, which keep the cache.
type attrCache struct {
	// flagsPlus1 is the stored flags plus one; 0 means not read yet.
	flagsPlus1 atomic.Int64
	// layout is the stored tensor attributes; nil means not read yet.
	layout atomic.Pointer[alloc.Layout]
	// mu serializes filling the caches with changing what they hold, so
	// that a read of old attributes cannot be cached after a change.
	mu sync.Mutex
}

// flags returns the flags stored on o, whose cache c is.
func (c *attrCache) flags(o object) (alloc.Flags, error) {
	if v := c.flagsPlus1.Load(); v > 0 {
		return alloc.Flags(v - 1), nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if v := c.flagsPlus1.Load(); v > 0 {
		return alloc.Flags(v - 1), nil
	}
	var f alloc.Flags
	err := o.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			f, err = alloc.ReadFlags(p)
		}
		return err
	})
	if err == nil {
		c.flagsPlus1.Store(int64(f) + 1)
	}
	return f, err
}

// tensorLayout returns the valid tensor attributes stored on the segment
// n, whose cache c is.
func (c *attrCache) tensorLayout(n *segmentNode) (alloc.Layout, error) {
	if l := c.layout.Load(); l != nil {
		return *l, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tensorLayoutLocked(n)
}

// tensorLayoutLocked is tensorLayout for a caller that holds c.mu.
func (c *attrCache) tensorLayoutLocked(n *segmentNode) (alloc.Layout, error) {
	if l := c.layout.Load(); l != nil {
		return *l, nil
	}
	var l alloc.Layout
	err := n.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			l, err = n.fs.readLayout(p, n.path())
		}
		return err
	})
	if err == nil {
		c.layout.Store(&l)
	}
	return l, err
}

// readLayout reads the tensor attributes stored on the backing object at
// p, the segment name in the mount: a value that fails validation (a peer
// holding a descriptor of the backing file stored it there) is not served,
// and logged.
func (fsys *filesystem) readLayout(p, name string) (alloc.Layout, error) {
	l, err := alloc.ReadLayout(p)
	if errors.Is(err, alloc.ErrBadStored) {
		fsys.log.Warn("stored tensor attributes fail validation", "path", alloc.EscapeText(name), "err", err)
		err = nil
	}
	return l, err
}

// changing holds off filling the caches while stored attributes change;
// call the function it returns once they have.
func (c *attrCache) changing() func() {
	c.mu.Lock()
	return func() {
		c.flagsPlus1.Store(0)
		c.layout.Store(nil)
		c.mu.Unlock()
	}
}

// userAttr reports whether attr is in the user namespace, the only one a
// mount serves: the daemon's own state is in the trusted one, and
// security.* names would be set with the daemon's privileges.
func userAttr(attr string) bool { return strings.HasPrefix(attr, "user.") }

// xattrReply answers a getxattr or listxattr of value v into dest: its
// size when dest is empty (the caller asks how much room it needs),
// ERANGE when it does not fit.
func xattrReply(dest, v []byte) (uint32, syscall.Errno) {
	if len(dest) == 0 {
		return uint32(len(v)), 0
	}
	if len(dest) < len(v) {
		return uint32(len(v)), syscall.ERANGE
	}
	return uint32(copy(dest, v)), 0
}

// storedAttr reads a stored attribute of o into dest.
func storedAttr(o object, attr string, dest []byte) (int, error) {
	var sz int
	err := o.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			sz, err = alloc.Getxattr(p, attr, dest)
		}
		return err
	})
	return sz, err
}

// listAttrs lists o's virtual names, then its stored ones: of a segment
// (l not nil), tensor attributes only where its layout l holds a valid
// value (alloc.ReadLayout).
func listAttrs(o object, virtual []string, l *alloc.Layout, dest []byte) (uint32, error) {
	var stored []string
	err := o.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			stored, err = alloc.Listxattr(p)
		}
		return err
	})
	if err != nil {
		return 0, err
	}
	var b bytes.Buffer
	for _, name := range virtual {
		b.WriteString(name)
		b.WriteByte(0)
	}
	for _, name := range stored {
		if l != nil && alloc.TensorAttr(name) && l.Get(name) == "" {
			continue
		}
		b.WriteString(name)
		b.WriteByte(0)
	}
	n, errno := xattrReply(dest, b.Bytes())
	if errno != 0 {
		return n, errno
	}
	return n, nil
}

// flagsAttr is user.tensorfs.flags as shown: the stored flags, and
// SHAREDMEM where the bytes are in the backing tmpfs by default.
func flagsAttr(f alloc.Flags, defaultStorage bool) []byte {
	if f&(alloc.SharedMem|alloc.Shared|alloc.FromFD) == 0 && defaultStorage {
		f |= alloc.SharedMem
	}
	return []byte(f.String())
}

// deviceAttr is user.tensorfs.device as shown: "cpu" unless stored.
func deviceAttr(o object) ([]byte, error) {
	var dev string
	err := o.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			dev, err = alloc.ReadDevice(p)
		}
		return err
	})
	return []byte(dev), err
}

// setAttr validates and stores an attribute on o, the object of cache c,
// whose size (for the emptiness rules) is size; a refusal changes nothing
// and is logged with its reason.
func (fsys *filesystem) setAttr(o object, c *attrCache, dir bool, size int64, attr string, data []byte, flags uint32) error {
	if !userAttr(attr) {
		return fmt.Errorf("%w: only user.* attributes are stored", syscall.EOPNOTSUPP)
	}
	if attr == alloc.AttrFlags {
		defer c.changing()()
	}
	return o.withAttrs(func(a *alloc.Ref) error {
		p, err := a.Path()
		if err != nil {
			return err
		}
		undo, err := fsys.chargeAttr(o, p, attr, len(data))
		if err != nil {
			return err
		}
		obj := alloc.Object{Path: p, Dir: dir, Size: size, HasDisk: fsys.store.Disk != "", GPU: fsys.gpuName()}
		if err := alloc.Setxattr(obj, attr, data, int(flags)); err != nil {
			undo()
			return err
		}
		return nil
	})
}

// chargeAttr charges o's owner for attr stored on the file at p with a
// value of size bytes, less what its value there costs now (its inodes,
// as tmpfs counts attributes): EDQUOT past the owner's share. undo gives
// the change back.
func (fsys *filesystem) chargeAttr(o object, p, attr string, size int) (undo func(), err error) {
	old, err := unix.Getxattr(p, alloc.StoredName(attr), nil)
	if err != nil {
		old = -1
	}
	ino := o.EmbeddedInode().StableAttr().Ino
	done, err := fsys.inodes.attrs(ino, attrUnits(attr, size)-attrUnits(attr, old))
	if err != nil {
		return nil, err
	}
	return func() { fsys.inodes.attrs(ino, -done) }, nil
}

// mayChangeFlags refuses (EPERM) a change of flags by anyone but the
// owner of st and root, as chattr(1) and FS_IOC_SETFLAGS do: the kernel
// lets every writer set user.* attributes, but flags decide what the
// daemon does with root's rights (UNLINK removes the name, which a writer
// in a sticky directory may not).
func mayChangeFlags(uid uint32, attr string, st *unix.Stat_t) error {
	if attr != alloc.AttrFlags || uid == 0 || uid == st.Uid {
		return nil
	}
	return fmt.Errorf("%w: only the owner (uid %d) or root changes flags", syscall.EPERM, st.Uid)
}

// removeAttr removes a stored attribute of o.
func (fsys *filesystem) removeAttr(uid uint32, o object, c *attrCache, attr string) error {
	if !userAttr(attr) {
		return alloc.ErrNoAttr
	}
	if attr == alloc.AttrFlags || alloc.TensorAttr(attr) {
		defer c.changing()()
	}
	return o.withAttrs(func(a *alloc.Ref) error {
		if err := mayChangeFlags(uid, attr, a.Stat()); err != nil {
			return err
		}
		p, err := a.Path()
		if err != nil {
			return err
		}
		undo, err := fsys.chargeAttr(o, p, attr, -1)
		if err != nil {
			return err
		}
		if err := alloc.Removexattr(p, attr); err != nil {
			undo()
			return err
		}
		return nil
	})
}

var (
	_ = (fusefs.NodeGetxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeListxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeSetxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeRemovexattrer)((*dirNode)(nil))
)

// Getxattr answers a directory's virtual attributes and reads stored ones.
func (d *dirNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	var v []byte
	var err error
	switch {
	case !userAttr(attr):
		return 0, syscall.ENODATA
	case attr == alloc.AttrFlags:
		var f alloc.Flags
		if f, err = d.flags(d); err == nil {
			v = flagsAttr(f, true)
		}
	case attr == alloc.AttrDevice:
		v, err = deviceAttr(d)
	case attr == alloc.AttrRbytes || attr == alloc.AttrRsegments:
		// Walks: each waits for the caller's others (usageWalks), outside
		// the handover's gate.
		d.fs.parked(func() { v, err = d.usageAttr(ctx, attr) })
	case attr == alloc.AttrCluster:
		d.fs.parked(func() { v, err = d.fs.clusterAttr(fuseRequester(ctx), d) })
	default:
		var sz int
		sz, err = storedAttr(d, attr, dest)
		if err == nil {
			return uint32(sz), 0
		}
	}
	if err != nil {
		return 0, d.fs.errno("getxattr "+attr, &d.nodeBase, "", err)
	}
	return xattrReply(dest, v)
}

// usageAttr is rbytes or rsegments: what the subtree holds, counting only
// the directories the caller may list (read and search), as du would.
func (d *dirNode) usageAttr(ctx context.Context, attr string) ([]byte, error) {
	who := fuseRequester(ctx)
	var segs, size int64
	err := d.withDir(func(fd int) error {
		var err error
		segs, size, err = d.fs.subtreeUsage(fd, who.Uid, &who)
		return err
	})
	if attr == alloc.AttrRbytes {
		return []byte(strconv.FormatInt(size, 10)), err
	}
	return []byte(strconv.FormatInt(segs, 10)), err
}

// dirAttrs are a directory's virtual attributes.
var dirAttrs = []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRbytes, alloc.AttrRsegments}

// Listxattr lists a directory's stored and virtual names.
func (d *dirNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	n, err := listAttrs(d, append(dirAttrs[:len(dirAttrs):len(dirAttrs)], d.fs.clusterAttrs(d)...), nil, dest)
	return n, d.fs.errnoOf("listxattr", &d.nodeBase, err)
}

// Setxattr validates and stores a directory's attribute: its flags and
// device are inherited by what is made in it.
func (d *dirNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	var st unix.Stat_t
	err := d.stat(&st)
	if err == nil {
		err = mayChangeFlags(caller(ctx).Uid, attr, &st)
	}
	if err == nil {
		err = d.fs.setAttr(d, &d.attrCache, true, 0, attr, data, flags)
	}
	return d.fs.errno("setxattr "+attr, &d.nodeBase, "", err)
}

// Removexattr removes a stored attribute of a directory.
func (d *dirNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return d.fs.attrErrno("removexattr "+attr, &d.nodeBase, d.fs.removeAttr(caller(ctx).Uid, d, &d.attrCache, attr))
}

// Getxattr adds the mount's statistics and its control socket's path.
func (r *rootNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	switch {
	case attr == alloc.AttrStats:
		var st map[string]any
		var err error
		r.fs.parked(func() { st, err = r.fs.stats(caller(ctx).Uid) }) // a walk, as rbytes
		var b []byte
		if err == nil {
			b, err = json.Marshal(st)
		}
		if err != nil {
			return 0, r.fs.errnoOf("getxattr "+attr, &r.nodeBase, err)
		}
		return xattrReply(dest, b)
	case attr == alloc.AttrSocket && r.fs.socket != "":
		return xattrReply(dest, []byte(r.fs.socket))
	}
	return r.dirNode.Getxattr(ctx, attr, dest)
}

// Listxattr lists the root's names.
func (r *rootNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	names := append(dirAttrs[:len(dirAttrs):len(dirAttrs)], alloc.AttrStats)
	if r.fs.socket != "" {
		names = append(names, alloc.AttrSocket)
	}
	n, err := listAttrs(r, names, nil, dest)
	return n, r.fs.errnoOf("listxattr", &r.nodeBase, err)
}

var (
	_ = (fusefs.NodeGetxattrer)((*segmentNode)(nil))
	_ = (fusefs.NodeListxattrer)((*segmentNode)(nil))
	_ = (fusefs.NodeSetxattrer)((*segmentNode)(nil))
	_ = (fusefs.NodeRemovexattrer)((*segmentNode)(nil))
)

// Getxattr answers a segment's virtual attributes, its tensor attributes
// from the cache, and reads stored ones.
func (n *segmentNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	var v []byte
	var err error
	dev, onDevice := n.storage().(device)
	switch {
	case !userAttr(attr):
		return 0, syscall.ENODATA
	case alloc.TensorAttr(attr):
		var l alloc.Layout
		if l, err = n.tensorLayout(n); err == nil {
			if v = []byte(l.Get(attr)); len(v) == 0 {
				return 0, syscall.ENODATA
			}
		}
	case attr == alloc.AttrFlags:
		var f alloc.Flags
		if f, err = n.flags(n); err == nil {
			v = flagsAttr(f, !onDevice)
		}
	case attr == alloc.AttrDevice:
		v, err = deviceAttr(n)
	case attr == alloc.AttrRefcount:
		// Scans of every process's mappings: outside the handover's
		// gate, as the walks are.
		n.fs.parked(func() { v, err = n.refcount() })
	case attr == alloc.AttrHolders:
		n.fs.parked(func() { v, err = n.holders() })
	case attr == alloc.AttrHandle:
		v, err = n.handleAttr(ctx)
	case onDevice && strings.HasPrefix(attr, "user.tensorfs.cuda."):
		v, err = cudaAttr(dev.seg, attr)
	default:
		var sz int
		sz, err = storedAttr(n, attr, dest)
		if err == nil {
			return uint32(sz), 0
		}
	}
	if err != nil {
		return 0, n.fs.attrErrno("getxattr "+attr, &n.nodeBase, err)
	}
	return xattrReply(dest, v)
}

// handleAttr is user.tensorfs.handle: the path of the file that holds the
// segment's bytes, for the daemon's own user and root; others get a
// descriptor through the control socket.
func (n *segmentNode) handleAttr(ctx context.Context) ([]byte, error) {
	if !n.fs.mayHaveHandle(ctx) {
		return nil, fmt.Errorf("%w: the backing path is for the daemon's user and root; use the control socket's export", syscall.EACCES)
	}
	var p string
	err := n.withMarker(func(m *alloc.Ref) (err error) {
		p, err = n.storage().handle(m)
		return err
	})
	return []byte(p), err
}

// mayHaveHandle reports whether the caller may read user.tensorfs.handle:
// the backing is private to the daemon, so its path is for the daemon's
// own user and root.
func (fsys *filesystem) mayHaveHandle(ctx context.Context) bool {
	uid := caller(ctx).Uid
	return uid == 0 || int(uid) == os.Geteuid()
}

// segmentAttrs are every segment's virtual attributes.
var segmentAttrs = []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRefcount, alloc.AttrHolders}

// Listxattr lists a segment's stored and virtual names, so getfattr -d
// shows them all.
func (n *segmentNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	names := segmentAttrs[:len(segmentAttrs):len(segmentAttrs)]
	s := n.storage()
	_, unreachable := s.(unavailable) // no file holds its bytes: no handle
	switch d, onDevice := s.(device); {
	case onDevice:
		names = append(names, alloc.AttrCudaRefCounter)
		if d.seg.Size() > 0 { // no memory, no handles yet
			names = append(names, alloc.AttrCudaIPCHandle, alloc.AttrCudaOffset, alloc.AttrCudaEventHandle)
		}
	case !unreachable && n.fs.mayHaveHandle(ctx):
		names = append(names, alloc.AttrHandle)
	}
	l, err := n.tensorLayout(n)
	if err != nil {
		return 0, n.fs.errnoOf("listxattr", &n.nodeBase, err)
	}
	sz, err := listAttrs(n, names, &l, dest)
	return sz, n.fs.errnoOf("listxattr", &n.nodeBase, err)
}

// Setxattr validates and stores a segment's attribute. Tensor attributes
// are checked against the cached layout; a device change waits for the
// segment's handles to close and moves it.
func (n *segmentNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	err := n.setxattr(caller(ctx).Uid, attr, data, flags)
	errno := n.fs.errno("setxattr "+attr, &n.nodeBase, "", err)
	if errno == syscall.EAGAIN {
		// The VFS answers a filesystem's EAGAIN from setxattr with
		// EOPNOTSUPP (__vfs_setxattr_noperm), as if the attribute were
		// not supported: a lease in the way of a device change
		// (alloc.ErrLeased) is EBUSY instead.
		errno = syscall.EBUSY
	}
	return errno
}

func (n *segmentNode) setxattr(uid uint32, attr string, data []byte, flags uint32) error {
	if err := attrsFixed(n.storage()); err != nil {
		return err
	}
	if attr == alloc.AttrDevice {
		n.opening.Lock()
		defer n.opening.Unlock()
		if k := n.storage().kind(); k != alloc.Host && k != alloc.Device {
			return fmt.Errorf("%w: %s segments live on the CPU", alloc.ErrInvalid, k)
		}
		if !n.awaitClosed() {
			return fmt.Errorf("%w: the device of a segment changes while nobody has it open", alloc.ErrNotEmpty)
		}
	}
	if alloc.TensorAttr(attr) {
		n.attrCache.mu.Lock()
		defer n.attrCache.mu.Unlock()
	}
	return n.withMarker(func(m *alloc.Ref) error {
		var st unix.Stat_t
		if err := statOf(m, n.storage(), &st); err != nil {
			return err
		}
		if err := mayChangeFlags(uid, attr, &st); err != nil {
			return err
		}
		if alloc.TensorAttr(attr) {
			return n.setTensorAttr(m, st.Size, attr, data, int(flags))
		}
		if err := n.fs.setAttr(n, &n.attrCache, false, st.Size, attr, data, flags); err != nil || attr != alloc.AttrDevice {
			return err
		}
		return n.fs.moveDevice(n, m)
	})
}

// setTensorAttr stores a tensor attribute on the segment, checked against
// the cached layout and its size, and caches the new layout; the caller
// holds the cache's lock.
func (n *segmentNode) setTensorAttr(m *alloc.Ref, size int64, attr string, data []byte, flags int) error {
	cur, err := n.tensorLayoutLocked(n)
	if err != nil {
		return err
	}
	return n.storage().attrs(m, func(a *alloc.Ref) error {
		p, err := a.Path()
		if err != nil {
			return err
		}
		next, err := alloc.SetTensorAttr(alloc.Object{Path: p, Size: size}, cur, attr, data, flags)
		if err == nil {
			n.layout.Store(&next)
		}
		return err
	})
}

// Removexattr removes a stored attribute of a segment. Removing a GPU
// segment's device moves it to the CPU, as setting "cpu" does: while it is
// empty and nobody has it open.
func (n *segmentNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if _, onDevice := n.storage().(device); onDevice && attr == alloc.AttrDevice {
		return n.fs.errno("removexattr "+attr, &n.nodeBase, "", n.setxattr(caller(ctx).Uid, attr, []byte("cpu"), 0))
	}
	err := attrsFixed(n.storage())
	if err == nil {
		err = n.fs.removeAttr(caller(ctx).Uid, n, &n.attrCache, attr)
	}
	return n.fs.attrErrno("removexattr "+attr, &n.nodeBase, err)
}

// attrErrno is errno for attribute requests, where an absent name is an
// answer (ENODATA), not a refusal worth a log line.
func (fsys *filesystem) attrErrno(op string, n *nodeBase, err error) syscall.Errno {
	if errors.Is(err, alloc.ErrNoAttr) {
		return syscall.ENODATA
	}
	return fsys.errno(op, n, "", err)
}

// refcount is the number of references across all processes, in
// decimal: open handles, and mappings of processes without a handle
// (references); an error when the daemon could not see every mapping.
func (n *segmentNode) refcount() ([]byte, error) {
	refs, err := n.references()
	if err != nil {
		return nil, err
	}
	c := 0
	for _, h := range refs {
		c += h
	}
	return []byte(strconv.Itoa(c)), nil
}

// holders returns one line per process: pid, command name, references;
// an error when the daemon could not see every mapping. The name is
// escaped (alloc.Escape), so that every line has exactly three
// space-separated fields whatever a process calls itself.
func (n *segmentNode) holders() ([]byte, error) {
	open, err := n.references()
	if err != nil {
		return nil, err
	}
	pids := make([]int, 0, len(open))
	for pid := range open {
		pids = append(pids, int(pid))
	}
	sort.Ints(pids)
	var b strings.Builder
	for _, pid := range pids {
		fmt.Fprintf(&b, "%d %s %d\n", pid, alloc.Escape(comm(pid)), open[uint32(pid)])
	}
	return []byte(b.String()), nil
}

// comm returns a process's command name as the process set it, "?" once
// it has exited or when the name is empty.
func comm(pid int) string {
	b, err := procfs.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	name := strings.TrimSuffix(string(b), "\n")
	if err != nil || name == "" {
		return "?"
	}
	return name
}

// subtreeUsage counts the segments below the directory open at dirfd and
// the bytes they hold, for uid (charged the walk's descriptors), entering
// only directories who (nil: anyone) may list: an imported or device segment's backing file is an empty marker,
// so its bytes are counted where they live. A segment with several names
// (tied weights) counts once. A subtree too deep to walk is an error
// (ELOOP), never a smaller count. A uid's walks run one at a time
// (usageWalks).
func (fsys *filesystem) subtreeUsage(dirfd int, uid uint32, who *ctl.Cred) (segments, bytes int64, err error) {
	defer fsys.usageWalks.lock(uid)()
	linked := map[uint64]bool{}
	err = fsys.walkFor(uid, dirfd, func(fd int, name, _ string, st *unix.Stat_t) error {
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if who != nil && !permitted(who, st, 4|1) {
				return alloc.ErrSkipDir
			}
		case syscall.S_IFREG:
			if st.Nlink > 1 {
				if linked[st.Ino] {
					return nil
				}
				linked[st.Ino] = true
			}
			segments++
			if _, err := fsys.segmentKind(fd, name, st); err == nil {
				bytes += st.Size
			}
		}
		return nil
	})
	return segments, bytes, err
}
