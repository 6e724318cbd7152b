package fs

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// node is a file, directory or special file of the mount. It keeps no
// descriptor of its own unless it is a directory: a segment is reached
// through its parent's descriptor and its name, so nothing leaks when
// go-fuse drops a node that lost a lookup race.
type node struct {
	fusefs.Inode
	fs *filesystem

	// dir is a directory's descriptor; nil for other nodes.
	dir *dirState

	// redirPtr says where a SHARED, imported or device segment's bytes
	// and attributes live; nil for other nodes. Set at creation, and when
	// an empty segment changes device.
	redirPtr atomic.Pointer[redirect]

	// flagsPlus1 caches the stored flags plus one; 0 means not read yet.
	// Flags change only through Setxattr and Removexattr, which reset it.
	flagsPlus1 atomic.Int64
	// layout caches a segment's stored tensor attributes; nil means not
	// read yet. They change only through Setxattr, which updates it, and
	// Removexattr, which resets it.
	layout atomic.Pointer[alloc.Layout]
	// attrMu serializes filling the caches with changing what they hold,
	// so that a read of old attributes cannot be cached after a change.
	attrMu sync.Mutex

	// opening is held for reading while a segment is opened and its
	// handle counted, for writing while its device changes, so that no
	// open finds it half moved.
	opening sync.RWMutex

	// mu protects handles and idle.
	mu sync.Mutex
	// handles are the segment's open file handles; nil when none, so a
	// closed segment costs no memory for them.
	handles []*handle
	// idle, when not nil, is closed when the last handle goes.
	idle chan struct{}
	// released is when a handle was last released, since epoch.
	released atomic.Int64
}

// dirState is what a directory node keeps beyond other nodes.
type dirState struct {
	// mu protects the fields below; it is never held while fd is used,
	// so uses may nest. Lock order: a node before its parent.
	mu sync.Mutex
	// fd is an O_PATH descriptor of the directory's backing, opened on
	// first use relative to the parent's; -1 when closed.
	fd int
	// users counts the withDir calls using fd; forgotten asks the last
	// of them to close it (the kernel forgot the node meanwhile).
	users     int
	forgotten bool
}

// newNode makes a node for a backing object of the given type (S_IFMT
// bits) whose bytes live where r says (nil: in the backing object).
func (fsys *filesystem) newNode(mode uint32, r *redirect) *node {
	n := &node{fs: fsys}
	n.redirPtr.Store(r)
	if mode == syscall.S_IFDIR {
		n.dir = &dirState{fd: -1}
	}
	return n
}

func (n *node) isDir() bool { return n.StableAttr().Mode == syscall.S_IFDIR }

// imported reports whether n is a segment imported over the control
// socket (FROMFD).
func (n *node) imported() bool {
	r := n.redir()
	return r != nil && r.imported != ""
}

// redir returns where n's bytes live (see redirect); nil for the backing.
func (n *node) redir() *redirect { return n.redirPtr.Load() }

// device returns n's device segment, nil for a host segment.
func (n *node) device() *devSeg {
	if r := n.redir(); r != nil {
		return r.dev
	}
	return nil
}

func (n *node) isSymlink() bool { return n.StableAttr().Mode == syscall.S_IFLNK }

// withDir runs fn with the O_PATH descriptor of directory n's backing,
// which stays open until fn returns.
func (n *node) withDir(fn func(fd int) error) error {
	d := n.dir
	if d == nil {
		return syscall.ENOTDIR
	}
	d.mu.Lock()
	if d.fd < 0 {
		if err := n.openDirLocked(); err != nil {
			d.mu.Unlock()
			return err
		}
	}
	fd := d.fd
	d.users++
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		if d.users--; d.users == 0 && d.forgotten {
			unix.Close(d.fd)
			d.fd, d.forgotten = -1, false
		}
		d.mu.Unlock()
	}()
	return fn(fd)
}

// openDirLocked opens dirfd relative to the parent's descriptor, making
// sure the name still leads to this directory.
func (n *node) openDirLocked() error {
	name, parent := n.Parent()
	if parent == nil {
		return syscall.ENOENT
	}
	return parent.Operations().(*node).withDir(func(pfd int) error {
		fd, err := unix.Openat(pfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Ino != n.StableAttr().Ino {
			unix.Close(fd)
			return syscall.ESTALE
		}
		n.dir.fd = fd
		return nil
	})
}

// at runs fn with a descriptor and a name that reach n's backing, where
// its attributes live: its parent's and its name; for a directory its own
// and "."; for a SHARED segment its disk file. A segment in no directory
// (unlinked, or made with O_TMPFILE) is reached through one of its open
// handles, with the name "": the object open at the descriptor itself.
func (n *node) at(fn func(dirfd int, name string) error) error {
	if r := n.redir(); r != nil && r.disk != "" {
		return n.fs.withAttrs(r, -1, "", fn)
	}
	if n.isDir() {
		return n.withDir(func(fd int) error { return fn(fd, ".") })
	}
	name, parent := n.Parent()
	if parent == nil {
		fd, err := n.dupHandleFd()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return fn(fd, "")
	}
	return parent.Operations().(*node).withDir(func(fd int) error { return fn(fd, name) })
}

// dupHandleFd returns a duplicate of an open handle's descriptor, for a
// segment that is in no directory; the caller closes it. A duplicate
// stays valid when the handle is released meanwhile.
func (n *node) dupHandleFd() (int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.handles) == 0 {
		return -1, syscall.ENOENT
	}
	return unix.FcntlInt(uintptr(n.handles[0].fd), unix.F_DUPFD_CLOEXEC, 0)
}

// path runs fn with a /proc path that names exactly n's backing object
// (alloc.At): never a symbolic link, never another object that took its
// name meanwhile.
func (n *node) path(fn func(p string) error) error {
	ino := n.redir().attrIno(n.StableAttr().Ino)
	return n.at(func(fd int, name string) error { return alloc.At(fd, name, ino, fn) })
}

// nofollow is the *at flag that acts on name itself rather than what it
// links to, and on the descriptor itself for an empty name.
func nofollow(name string) int {
	if name == "" {
		return unix.AT_EMPTY_PATH
	}
	return unix.AT_SYMLINK_NOFOLLOW
}

// stat fills st with the segment's attributes.
func (n *node) stat(st *unix.Stat_t) error {
	return n.at(func(fd int, name string) error {
		if r := n.redir(); r != nil && r.disk == "" {
			return n.fs.statSegment(r, fd, name, st)
		}
		return unix.Fstatat(fd, name, st, nofollow(name))
	})
}

// flags returns the flags stored on n's backing object.
func (n *node) flags() (alloc.Flags, error) {
	if v := n.flagsPlus1.Load(); v > 0 {
		return alloc.Flags(v - 1), nil
	}
	n.attrMu.Lock()
	defer n.attrMu.Unlock()
	if v := n.flagsPlus1.Load(); v > 0 {
		return alloc.Flags(v - 1), nil
	}
	var f alloc.Flags
	err := n.path(func(p string) (err error) {
		f, err = alloc.ReadFlags(p)
		return err
	})
	if err == nil {
		n.flagsPlus1.Store(int64(f) + 1)
	}
	return f, err
}

// tensorLayout returns the tensor attributes stored on n's backing object.
func (n *node) tensorLayout() (alloc.Layout, error) {
	if l := n.layout.Load(); l != nil {
		return *l, nil
	}
	n.attrMu.Lock()
	defer n.attrMu.Unlock()
	return n.tensorLayoutLocked()
}

// tensorLayoutLocked is tensorLayout for a caller that holds attrMu.
func (n *node) tensorLayoutLocked() (alloc.Layout, error) {
	if l := n.layout.Load(); l != nil {
		return *l, nil
	}
	var l alloc.Layout
	err := n.path(func(p string) (err error) {
		l, err = alloc.ReadLayout(p)
		return err
	})
	if err == nil {
		n.layout.Store(&l)
	}
	return l, err
}

// changingAttrs holds off filling the caches while stored attributes
// change; call the function it returns once they have.
func (n *node) changingAttrs() func() {
	n.attrMu.Lock()
	return func() {
		n.flagsPlus1.Store(0)
		n.layout.Store(nil)
		n.attrMu.Unlock()
	}
}

var _ = (fusefs.NodeOnForgetter)((*node)(nil))

// OnForget closes a directory's descriptor; it is opened again if the
// node comes back.
func (n *node) OnForget() {
	if n.dir == nil || n == n.fs.root {
		return
	}
	d := n.dir
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.users > 0:
		d.forgotten = true // the last user closes it
	case d.fd >= 0:
		unix.Close(d.fd)
		d.fd = -1
	}
}

var _ = (fusefs.NodeGetattrer)((*node)(nil))

// Getattr answers stat from the backing, through an open handle when the
// kernel names one (so fstat of an unlinked segment works).
func (n *node) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st unix.Stat_t
	var err error
	if h, ok := f.(*handle); ok && h.seg == nil {
		err = unix.Fstat(h.fd, &st)
	} else {
		err = n.stat(&st)
	}
	if err != nil {
		return n.fs.errnoOf("getattr", n, err)
	}
	out.FromStat(toSyscallStat(&st))
	out.Ino = n.StableAttr().Ino
	return 0
}

var _ = (fusefs.NodeSetattrer)((*node)(nil))

// Setattr changes mode, owner, size and times of the backing object.
// Growth reserves pages (alloc.Resize), so ENOSPC comes here, not as a
// SIGBUS later.
func (n *node) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if err := n.setattr(f, in); err != nil {
		return n.fs.errno("setattr", n, "", err)
	}
	return n.Getattr(ctx, f, out)
}

// setattr applies in: owner and mode to exactly n's object (a symbolic
// link's own owner, never what it points to), then size and times.
func (n *node) setattr(f fusefs.FileHandle, in *fuse.SetAttrIn) error {
	mode, mok := in.GetMode()
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	suid, sgid := -1, -1
	if uok {
		suid = int(uid)
	}
	if gok {
		sgid = int(gid)
	}
	switch {
	case mok && n.isSymlink():
		return syscall.EOPNOTSUPP
	case (uok || gok) && n.isSymlink():
		if err := n.at(func(fd int, name string) error { return unix.Fchownat(fd, name, suid, sgid, nofollow(name)) }); err != nil {
			return err
		}
	case mok || uok || gok:
		err := n.path(func(p string) error {
			if uok || gok {
				if err := unix.Chown(p, suid, sgid); err != nil {
					return err
				}
			}
			if mok {
				return unix.Chmod(p, mode&07777)
			}
			return nil
		})
		n.followAccess()
		if err != nil {
			return err
		}
	}
	return n.at(func(fd int, name string) error {
		if sz, ok := in.GetSize(); ok {
			if n.imported() {
				return fmt.Errorf("%w: an imported (FROMFD) segment keeps the size its owner gave it", alloc.ErrReadOnly)
			}
			if err := n.resize(f, fd, name, int64(sz)); err != nil {
				return err
			}
		}
		if in.Valid&fuse.FATTR_KILL_SUIDGID != 0 && !n.isSymlink() {
			// A truncate by a user other than root, or a chown
			// (HANDLE_KILLPRIV_V2).
			if err := n.path(killSetid); err != nil {
				return err
			}
		}
		mtime, mok := in.GetMTime()
		atime, aok := in.GetATime()
		if !mok && !aok {
			return nil
		}
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		if aok {
			ts[0] = unix.NsecToTimespec(atime.UnixNano())
		}
		if mok {
			ts[1] = unix.NsecToTimespec(mtime.UnixNano())
		}
		return utimesAt(fd, name, ts)
	})
}

// killSetid clears the set-id bits of the object at p, as the kernel asks
// with FATTR_KILL_SUIDGID: set-user-ID, and set-group-ID if
// group-executable.
func killSetid(p string) error {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return err
	}
	if kill := setidToDrop(&st, st.Gid); kill != 0 {
		return unix.Chmod(p, st.Mode&07777&^kill)
	}
	return nil
}

// utimesAt sets the times of the object name in dirfd, never following a
// symbolic link at name; an empty name: the object open at dirfd.
func utimesAt(dirfd int, name string, ts []unix.Timespec) error {
	if name == "" {
		return unix.UtimesNanoAt(unix.AT_FDCWD, alloc.FdPath(dirfd), ts, 0)
	}
	return unix.UtimesNanoAt(dirfd, name, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// resize truncates or grows the segment, through the handle when there
// is one.
func (n *node) resize(f fusefs.FileHandle, dirfd int, name string, size int64) error {
	if seg := n.device(); seg != nil {
		seg.mu.Lock()
		defer seg.mu.Unlock()
		return seg.resize(size)
	}
	if h, ok := f.(*handle); ok && h.writable {
		return alloc.Resize(h.fd, size)
	}
	fd, err := openAt(dirfd, name, unix.O_WRONLY|unix.O_CLOEXEC)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return alloc.Resize(fd, size)
}

var _ = (fusefs.NodeStatfser)((*node)(nil))

// Statfs reports the backing's capacity and use, so df shows them.
func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var st unix.Statfs_t
	if err := n.fs.store.Statfs(&st); err != nil {
		return n.fs.errnoOf("statfs", n, err)
	}
	out.FromStatfsT((*syscall.Statfs_t)(unsafe.Pointer(&st)))
	return 0
}

// toSyscallStat converts a unix.Stat_t for go-fuse, which takes syscall's;
// on Linux the two are the same kernel struct.
func toSyscallStat(st *unix.Stat_t) *syscall.Stat_t {
	return (*syscall.Stat_t)(unsafe.Pointer(st))
}

// caller returns the credentials of the process behind a request.
func caller(ctx context.Context) *fuse.Caller {
	c, ok := fuse.FromContext(ctx)
	if !ok {
		return &fuse.Caller{}
	}
	return c
}

// openAt opens the backing object name in dirfd, never following a
// symbolic link at name; an empty name reopens the object open at dirfd,
// which must be one of the daemon's own backing files.
func openAt(dirfd int, name string, flags int) (int, error) {
	if name == "" {
		return unix.Open(alloc.FdPath(dirfd), flags&^unix.O_NOFOLLOW, 0)
	}
	return unix.Openat(dirfd, name, flags|unix.O_NOFOLLOW, 0)
}
