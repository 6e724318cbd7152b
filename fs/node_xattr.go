package fs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

var _ = (fusefs.NodeGetxattrer)((*node)(nil))

// Getxattr answers tensorfs's virtual attributes and reads stored ones.
func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	if n.isSymlink() || !userAttr(attr) {
		return 0, syscall.ENODATA
	}
	if alloc.TensorAttr(attr) && n.StableAttr().Mode == syscall.S_IFREG {
		l, err := n.tensorLayout()
		if err != nil {
			return 0, n.fs.errnoOf("getxattr "+attr, n, err)
		}
		if v := l.Get(attr); v != "" {
			return xattrReply(dest, []byte(v))
		}
		return 0, syscall.ENODATA
	}
	v, ok, err := n.virtualAttr(ctx, attr)
	if err != nil {
		return 0, n.fs.errno("getxattr "+attr, n, "", err)
	}
	if ok {
		return xattrReply(dest, v)
	}
	var sz int
	err = n.path(func(p string) (err error) {
		sz, err = alloc.Getxattr(p, attr, dest)
		return err
	})
	return uint32(sz), n.fs.errnoOf("getxattr "+attr, n, err)
}

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

// userAttr reports whether attr is in the user namespace, the only one a
// mount serves: the daemon's own state is in the trusted one, and
// security.* names would be set with the daemon's privileges.
func userAttr(attr string) bool { return strings.HasPrefix(attr, "user.") }

// mayHaveHandle reports whether the caller may read user.tensorfs.handle:
// the backing is private to the daemon, so its path is for the daemon's
// own user and root; others get a descriptor through the socket's export.
func (fsys *filesystem) mayHaveHandle(ctx context.Context) bool {
	uid := caller(ctx).Uid
	return uid == 0 || int(uid) == os.Geteuid()
}

// virtualAttr computes the attributes tensorfs derives rather than stores.
// ok is false when attr is stored (or absent) on the backing.
func (n *node) virtualAttr(ctx context.Context, attr string) (v []byte, ok bool, err error) {
	dir := n.isDir()
	file := n.StableAttr().Mode == syscall.S_IFREG
	switch {
	case attr == alloc.AttrFlags && (dir || file):
		f, err := n.flags()
		if err != nil {
			return nil, false, err
		}
		if f&(alloc.SharedMem|alloc.Shared|alloc.FromFD) == 0 && n.device() == nil {
			f |= alloc.SharedMem // the default storage
		}
		return []byte(f.String()), true, nil
	case attr == alloc.AttrDevice && (dir || file):
		var sz int
		buf := make([]byte, 64)
		err := n.path(func(p string) (err error) {
			sz, err = alloc.Getxattr(p, attr, buf)
			return err
		})
		if errors.Is(err, alloc.ErrNoAttr) {
			return []byte("cpu"), true, nil
		}
		return buf[:sz], true, err
	case attr == alloc.AttrRefcount && file:
		return []byte(strconv.Itoa(n.refcount())), true, nil
	case attr == alloc.AttrHolders && file:
		return []byte(n.holders()), true, nil
	case attr == alloc.AttrHandle && file && !n.fs.mayHaveHandle(ctx):
		return nil, true, fmt.Errorf("%w: the backing path is for the daemon's user and root; use the control socket's export", syscall.EACCES)
	case attr == alloc.AttrHandle && file && n.imported():
		// The sender's file may have no name; the daemon's descriptor
		// opens the same pages.
		target, err := n.fs.imports.procLink(n.redir().imported)
		return []byte(target), true, err
	case attr == alloc.AttrHandle && file:
		var target string
		err := n.at(func(fd int, name string) error {
			d, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
			target = filepath.Join(d, name)
			return err
		})
		return []byte(target), true, err
	case (attr == alloc.AttrRbytes || attr == alloc.AttrRsegments) && dir:
		var segs, size int64
		err := n.withDir(func(fd int) error {
			segs, size = n.fs.subtreeUsage(fd)
			return nil
		})
		if attr == alloc.AttrRbytes {
			return []byte(strconv.FormatInt(size, 10)), true, err
		}
		return []byte(strconv.FormatInt(segs, 10)), true, err
	case strings.HasPrefix(attr, "user.tensorfs.cuda.") && n.device() != nil:
		v, err := n.fs.cudaAttr(n.device(), attr)
		return v, true, err
	case attr == alloc.AttrSocket && n == n.fs.root && n.fs.socket != "":
		return []byte(n.fs.socket), true, nil
	case attr == alloc.AttrStats && n == n.fs.root:
		b, err := json.Marshal(n.fs.stats())
		return b, true, err
	}
	return nil, false, nil
}

// virtualNames lists the computed attributes a node of this kind has for
// the caller.
func (n *node) virtualNames(ctx context.Context) []string {
	switch {
	case n == n.fs.root:
		names := []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRbytes, alloc.AttrRsegments, alloc.AttrStats}
		if n.fs.socket != "" {
			names = append(names, alloc.AttrSocket)
		}
		return names
	case n.isDir():
		return []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRbytes, alloc.AttrRsegments}
	case n.device() != nil:
		names := []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRefcount, alloc.AttrHolders, alloc.AttrCudaRefCounter}
		if n.device().Size() > 0 { // no memory, no handles yet
			names = append(names, alloc.AttrCudaIPCHandle, alloc.AttrCudaOffset, alloc.AttrCudaEventHandle)
		}
		return names
	case n.StableAttr().Mode == syscall.S_IFREG && n.fs.mayHaveHandle(ctx):
		return []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRefcount, alloc.AttrHolders, alloc.AttrHandle}
	case n.StableAttr().Mode == syscall.S_IFREG:
		return []string{alloc.AttrFlags, alloc.AttrDevice, alloc.AttrRefcount, alloc.AttrHolders}
	}
	return nil
}

var _ = (fusefs.NodeListxattrer)((*node)(nil))

// Listxattr lists stored and virtual names, so getfattr -d shows them all.
func (n *node) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	if n.isSymlink() {
		return 0, 0
	}
	var stored []string
	err := n.path(func(p string) (err error) {
		stored, err = alloc.Listxattr(p)
		return err
	})
	if err != nil {
		return 0, n.fs.errnoOf("listxattr", n, err)
	}
	var b bytes.Buffer
	virtual := n.virtualNames(ctx)
	for _, name := range virtual {
		b.WriteString(name)
		b.WriteByte(0)
	}
	for _, name := range stored {
		if name != alloc.AttrFlags && name != alloc.AttrDevice {
			b.WriteString(name)
			b.WriteByte(0)
		}
	}
	return xattrReply(dest, b.Bytes())
}

var _ = (fusefs.NodeSetxattrer)((*node)(nil))

// Setxattr validates and stores an attribute; a refusal changes nothing
// and is logged with its reason.
func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if n.isSymlink() {
		return syscall.EPERM // as on tmpfs: symbolic links carry no user attributes
	}
	if !userAttr(attr) {
		err := fmt.Errorf("%w: only user.* attributes are stored", syscall.EOPNOTSUPP)
		return n.fs.errno("setxattr "+attr, n, "", err)
	}
	tensor := alloc.TensorAttr(attr) && !n.isDir()
	switch {
	case attr == alloc.AttrFlags:
		defer n.changingAttrs()()
	case tensor:
		n.attrMu.Lock()
		defer n.attrMu.Unlock()
	}
	var st unix.Stat_t
	err := n.stat(&st)
	if n.isDir() {
		st.Size = 0 // flags and device of a directory have no emptiness rule
	}
	if err == nil && attr == alloc.AttrDevice && !n.isDir() {
		n.opening.Lock()
		defer n.opening.Unlock()
		if !n.awaitClosed() {
			err = fmt.Errorf("%w: the device of a segment changes while nobody has it open", alloc.ErrNotEmpty)
		}
	}
	if err == nil {
		ino := n.redir().attrIno(n.StableAttr().Ino)
		err = n.at(func(fd int, name string) error {
			return alloc.At(fd, name, ino, func(p string) error {
				obj := alloc.Object{
					Path:    p,
					Dir:     n.isDir(),
					Size:    st.Size,
					HasDisk: n.fs.store.Disk != "",
					GPU:     n.fs.gpuName(),
				}
				if tensor {
					return n.setTensorAttr(obj, attr, data, int(flags))
				}
				err := alloc.Setxattr(obj, attr, data, int(flags))
				if err == nil && attr == alloc.AttrDevice && !n.isDir() {
					err = n.fs.moveToDevice(n, fd, name, &st)
				}
				return err
			})
		})
	}
	return n.fs.errno("setxattr "+attr, n, "", err)
}

// setTensorAttr stores a tensor attribute on the segment obj, checked
// against the cached layout, and caches the new layout; the caller holds
// attrMu.
func (n *node) setTensorAttr(obj alloc.Object, attr string, data []byte, flags int) error {
	cur, err := n.tensorLayoutLocked()
	if err != nil {
		return err
	}
	next, err := alloc.SetTensorAttr(obj, cur, attr, data, flags)
	if err == nil {
		n.layout.Store(&next)
	}
	return err
}

var _ = (fusefs.NodeRemovexattrer)((*node)(nil))

// Removexattr removes a stored attribute.
func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if n.isSymlink() || !userAttr(attr) {
		return syscall.ENODATA
	}
	if attr == alloc.AttrFlags || alloc.TensorAttr(attr) {
		defer n.changingAttrs()()
	}
	err := n.path(func(p string) error { return alloc.Removexattr(p, attr) })
	if errors.Is(err, alloc.ErrNoAttr) {
		return syscall.ENODATA
	}
	return n.fs.errno("removexattr "+attr, n, "", err)
}

// subtreeUsage counts the segments below the directory open at dirfd and
// the bytes they hold: an imported or device segment's backing file is an
// empty marker, so its bytes are counted where they live.
func (fsys *filesystem) subtreeUsage(dirfd int) (segments, bytes int64) {
	alloc.Walk(dirfd, func(fd int, name, _ string, st *unix.Stat_t) error {
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return nil
		}
		segments++
		size := st.Size
		if size == 0 {
			alloc.At(fd, name, st.Ino, func(p string) error {
				if id := alloc.ImportID(p); id != "" {
					fsys.imports.with(id, func(fd int) error {
						var st unix.Stat_t
						if unix.Fstat(fd, &st) == nil {
							size = st.Size
						}
						return nil
					})
				} else if alloc.DeviceOf(p) != "cpu" {
					size = alloc.ReadDeviceState(p).Size
				}
				return nil
			})
		}
		bytes += size
		return nil
	})
	return segments, bytes
}

// acquire records a new open handle, then stops a watch for the last
// mapping of the segment (watchMapped).
func (n *node) acquire(h *handle) {
	n.mu.Lock()
	n.handles = append(n.handles, h)
	n.mu.Unlock()
	n.fs.watches.unwatch(n.StableAttr().Ino)
}

// release drops an open handle and reclaims an UNLINK segment whose last
// reference went.
func (n *node) release(h *handle) {
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
		n.fs.reclaimLater(n)
	}
}

// closeWait bounds how long a device change waits for handles to go.
const closeWait = 200 * time.Millisecond

// awaitClosed waits up to closeWait for n's handles to be released and
// reports whether none is left: the kernel sends RELEASE after close(2)
// returns, so a close followed at once by a request may find the handle
// still open.
func (n *node) awaitClosed() bool {
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

// openHandles returns the number of open handles by the pid that opened them.
func (n *node) openHandles() map[uint32]int {
	n.mu.Lock()
	defer n.mu.Unlock()
	m := make(map[uint32]int, len(n.handles))
	for _, h := range n.handles {
		m[h.pid]++
	}
	return m
}

// refcount is the number of references across all processes: open
// handles, and mappings of processes without a handle (references).
func (n *node) refcount() int {
	c := 0
	for _, h := range n.references() {
		c += h
	}
	return c
}

// holders returns one line per process: pid, command name, references.
// The name is escaped (alloc.Escape), so that every line has exactly three
// space-separated fields whatever a process calls itself.
func (n *node) holders() string {
	open := n.references()
	pids := make([]int, 0, len(open))
	for pid := range open {
		pids = append(pids, int(pid))
	}
	sort.Ints(pids)
	var b strings.Builder
	for _, pid := range pids {
		fmt.Fprintf(&b, "%d %s %d\n", pid, alloc.Escape(comm(pid)), open[uint32(pid)])
	}
	return b.String()
}

// comm returns a process's command name as the process set it, "?" once
// it has exited or when the name is empty.
func comm(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	name := strings.TrimSuffix(string(b), "\n")
	if err != nil || name == "" {
		return "?"
	}
	return name
}
