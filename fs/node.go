package fs

import (
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"time"
	"unsafe"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// nodeBase is what every node of the mount has: its place in go-fuse's
// tree and the mount it belongs to. Each node type (dirNode, rootNode,
// segmentNode, symlinkNode, specialNode) embeds it and implements object;
// the operations every object serves the same way are nodeBase's methods
// (Getattr, Setattr, Statx, Statfs, and the attribute calls of objects
// that hold no user attributes), and a node type overrides those it
// serves otherwise.
type nodeBase struct {
	fusefs.Inode
	fs *filesystem
}

// object is what each node type tells the operations they share.
type object interface {
	fusefs.InodeEmbedder
	// withAttrs runs fn with exactly the backing object that holds the
	// node's owner, mode, times and attributes.
	withAttrs(fn func(a *alloc.Ref) error) error
	// stat fills st as stat(2) on the mount shows the node.
	stat(st *unix.Stat_t) error
}

// self returns the node type that embeds n.
func (n *nodeBase) self() object { return n.Operations().(object) }

// path names n in logs: its path in the mount, its last alloc.LogDepth
// components after ".../" when it is deeper.
func (n *nodeBase) path() string {
	var parts []string
	i := n.EmbeddedInode()
	for {
		name, parent := i.Parent()
		if parent == nil {
			break
		}
		if len(parts) == alloc.LogDepth {
			parts = append(parts, "...")
			break
		}
		parts, i = append(parts, name), parent
	}
	slices.Reverse(parts)
	return strings.Join(parts, "/")
}

// leafRef runs fn with the backing object of a node that is not a
// directory: its name in its parent's directory, checked to be its inode.
// A rename between reading the name and opening it is ESTALE, and the
// name is read again.
func (n *nodeBase) leafRef(fn func(r *alloc.Ref) error) error {
	for try := 0; ; try++ {
		name, parent := n.Parent()
		if parent == nil {
			return syscall.ENOENT
		}
		var r *alloc.Ref
		err := dirOf(parent).withDir(func(fd int) (err error) {
			r, err = alloc.OpenRef(fd, name, n.StableAttr().Ino)
			return err
		})
		if errors.Is(err, syscall.ESTALE) && try < 3 {
			continue
		}
		if err != nil {
			return err
		}
		defer r.Close()
		return fn(r)
	}
}

// leafStat is stat for a node whose backing object is what it shows.
func (n *nodeBase) leafStat(st *unix.Stat_t) error {
	return n.leafRef(func(r *alloc.Ref) error { return statOf(r, nil, st) })
}

var (
	_ = (fusefs.NodeGetattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeSetattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeStatxer)((*nodeBase)(nil))
	_ = (fusefs.NodeStatfser)((*nodeBase)(nil))
	_ = (fusefs.NodeGetxattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeListxattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeSetxattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeRemovexattrer)((*nodeBase)(nil))
	_ = (fusefs.NodeIoctler)((*nodeBase)(nil))
	_ = (fusefs.NodeUnlinker)((*nodeBase)(nil))
	_ = (fusefs.NodeRmdirer)((*nodeBase)(nil))
)

// Unlink: only a directory holds names (go-fuse would answer OK).
func (n *nodeBase) Unlink(ctx context.Context, name string) syscall.Errno { return syscall.ENOTDIR }

// Rmdir: only a directory holds names (go-fuse would answer OK).
func (n *nodeBase) Rmdir(ctx context.Context, name string) syscall.Errno { return syscall.ENOTDIR }

// Ioctl serves no ioctl, on any node: each would run on a backing
// descriptor with the daemon's rights (FITRIM, a filesystem shutdown, the
// immutable flag on a backing directory), whatever the caller may do.
func (n *nodeBase) Ioctl(ctx context.Context, f fusefs.FileHandle, cmd uint32, arg uint64, input []byte, output []byte) (int32, syscall.Errno) {
	return 0, syscall.ENOTTY
}

// Getattr answers stat from the backing.
func (n *nodeBase) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st unix.Stat_t
	if err := n.self().stat(&st); err != nil {
		return n.fs.errnoOf("getattr", n, err)
	}
	out.FromStat(toSyscallStat(&st))
	return 0
}

// Statx answers statx from the same stat as Getattr: the basic fields.
func (n *nodeBase) Statx(ctx context.Context, f fusefs.FileHandle, flags, mask uint32, out *fuse.StatxOut) syscall.Errno {
	var a fuse.AttrOut
	if errno := n.self().(fusefs.NodeGetattrer).Getattr(ctx, f, &a); errno != 0 {
		return errno
	}
	out.Statx = fuse.Statx{
		Mask:      unix.STATX_BASIC_STATS,
		Blksize:   a.Blksize,
		Nlink:     a.Nlink,
		Uid:       a.Uid,
		Gid:       a.Gid,
		Mode:      uint16(a.Mode),
		Ino:       a.Ino,
		Size:      a.Size,
		Blocks:    a.Blocks,
		Atime:     fuse.SxTime{Sec: a.Atime, Nsec: a.Atimensec},
		Mtime:     fuse.SxTime{Sec: a.Mtime, Nsec: a.Mtimensec},
		Ctime:     fuse.SxTime{Sec: a.Ctime, Nsec: a.Ctimensec},
		RdevMajor: unix.Major(uint64(a.Rdev)),
		RdevMinor: unix.Minor(uint64(a.Rdev)),
	}
	return 0
}

// Setattr changes mode, owner and times of the node's backing object
// (segments add size: segmentNode.Setattr).
func (n *nodeBase) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if _, ok := in.GetSize(); ok {
		return syscall.EISDIR // only segments have a size to set; the kernel asks for none else
	}
	if err := n.setattr(ctx, in, nil); err != nil {
		return n.fs.errno("setattr", n, "", err)
	}
	return n.Getattr(ctx, f, out)
}

// setattr applies in's owner, mode and times to exactly the node's
// attribute object; after, if set, runs once owner or mode changed (a
// device segment's counter follows them).
func (n *nodeBase) setattr(ctx context.Context, in *fuse.SetAttrIn, after func()) error {
	mode, mok := in.GetMode()
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	mtime, mtok := in.GetMTime()
	atime, atok := in.GetATime()
	kill := in.Valid&fuse.FATTR_KILL_SUIDGID != 0
	if !mok && !uok && !gok && !mtok && !atok && !kill {
		// A change of nothing, such as chown(f, -1, -1): on tmpfs it
		// moves ctime, and so it does on the backing.
		return n.self().withAttrs(func(a *alloc.Ref) error { return a.Chown(-1, -1) })
	}
	err := n.self().withAttrs(func(a *alloc.Ref) error {
		if uok || gok {
			suid, sgid := -1, -1
			if uok {
				suid = int(uid)
			}
			if gok {
				sgid = int(gid)
			}
			undoCharge := func() {}
			if uok {
				var err error
				if undoCharge, err = n.fs.inodes.chown(n.StableAttr().Ino, uid); err != nil {
					return err
				}
			}
			if err := a.Chown(suid, sgid); err != nil {
				undoCharge()
				return err
			}
		}
		if mok {
			if err := a.Chmod(mode); err != nil {
				return err
			}
		}
		if kill && !a.IsSymlink() {
			// A truncate by a user other than root, or a chown
			// (HANDLE_KILLPRIV_V2): as on tmpfs.
			if err := killSetid(a, inGroupOf(ctx)); err != nil {
				return err
			}
		}
		if !mtok && !atok {
			return nil
		}
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		if atok {
			ts[0] = utimeOf(atime, in.Valid&fuse.FATTR_ATIME_NOW != 0)
		}
		if mtok {
			ts[1] = utimeOf(mtime, in.Valid&fuse.FATTR_MTIME_NOW != 0)
		}
		return a.Utimes(ts)
	})
	if after != nil && (mok || uok || gok) {
		after()
	}
	return err
}

// utimeOf is utimensat's time t, or UTIME_NOW where the kernel asked for
// the time now: the backing's clock then sets it together with ctime, as
// on tmpfs, not a moment the daemon read before (touch would show an
// mtime after its ctime).
func utimeOf(t time.Time, now bool) unix.Timespec {
	if now {
		return unix.Timespec{Nsec: unix.UTIME_NOW}
	}
	return unix.NsecToTimespec(t.UnixNano())
}

// killSetid clears the set-id bits of the object a, as the kernel asks
// with FATTR_KILL_SUIDGID: set-user-ID, and set-group-ID if
// group-executable or the caller is not of its group (inGroup).
func killSetid(a *alloc.Ref, inGroup func(uint32) bool) error {
	var st unix.Stat_t
	p, err := a.Path()
	if err == nil {
		err = unix.Stat(p, &st)
	}
	if err != nil {
		return err
	}
	if kill := setidToDrop(&st, inGroup); kill != 0 {
		return a.Chmod(st.Mode &^ kill)
	}
	return nil
}

// setidToDrop returns the set-id bits of st that a write by a process
// other than root clears (should_remove_suid): set-user-ID, and
// set-group-ID if group-executable or the writer is not of the file's
// group (inGroup, supplementary groups included).
func setidToDrop(st *unix.Stat_t, inGroup func(uint32) bool) uint32 {
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return 0
	}
	kill := st.Mode & unix.S_ISUID
	if st.Mode&unix.S_ISGID != 0 && (st.Mode&unix.S_IXGRP != 0 || !inGroup(st.Gid)) {
		kill |= unix.S_ISGID
	}
	return kill
}

// inGroupOf returns whether the caller of ctx is of a group, as
// in_group_or_capable: root is of every group; the supplementary groups
// are read only when the caller's own gid is not the one asked about.
func inGroupOf(ctx context.Context) func(uint32) bool {
	c := caller(ctx)
	return func(gid uint32) bool {
		return c.Uid == 0 || c.Gid == gid || fuseRequester(ctx).InGroup(gid)
	}
}

// Statfs reports the backing's capacity and use, so df shows them, with
// device memory waiting in limbo as used.
func (n *nodeBase) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	var st unix.Statfs_t
	if err := n.fs.store.Statfs(&st); err != nil {
		return n.fs.errnoOf("statfs", n, err)
	}
	if n.fs.gpu != nil {
		// Device memory in limbo takes its room too (devSeg.reserve).
		limbo := (uint64(max(n.fs.gpu.limboBytes.Load(), 0)) + uint64(st.Bsize) - 1) / uint64(st.Bsize)
		st.Bfree -= min(st.Bfree, limbo)
		st.Bavail -= min(st.Bavail, limbo)
	}
	out.FromStatfsT((*syscall.Statfs_t)(unsafe.Pointer(&st)))
	return 0
}

// Getxattr: symbolic links and special files hold no user attributes, as
// on tmpfs.
func (n *nodeBase) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	return 0, syscall.ENODATA
}

// Listxattr lists nothing for objects without user attributes.
func (n *nodeBase) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	return 0, 0
}

// Setxattr is EPERM where tmpfs refuses user attributes.
func (n *nodeBase) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return syscall.EPERM
}

// Removexattr finds nothing to remove.
func (n *nodeBase) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return syscall.ENODATA
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
