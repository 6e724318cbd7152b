package fs

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

var _ = (fusefs.NodeLookuper)((*node)(nil))

// Lookup finds name in the backing directory.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := n.withDir(func(fd int) (err error) {
		ch, err = n.child(ctx, fd, name, out)
		return err
	})
	if err != nil {
		return nil, n.fs.errnoOf("lookup", n, err)
	}
	return ch, 0
}

// child makes the inode for the backing object name in dirfd, found by
// a lookup.
func (n *node) child(ctx context.Context, dirfd int, name string, out *fuse.EntryOut) (*fusefs.Inode, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, err
	}
	return n.newChild(ctx, dirfd, name, &st, n.fs.redirectOf(dirfd, name, &st), out)
}

// newChild makes the inode for the backing object name in dirfd, whose
// stat is st and whose redirect is r; a redirected segment's stat is
// taken again (statSegment).
func (n *node) newChild(ctx context.Context, dirfd int, name string, st *unix.Stat_t, r *redirect, out *fuse.EntryOut) (*fusefs.Inode, error) {
	if r != nil {
		if err := n.fs.statSegment(r, dirfd, name, st); err != nil {
			return nil, err
		}
	}
	out.Attr.FromStat(toSyscallStat(st))
	ch := n.fs.newNode(st.Mode&syscall.S_IFMT, r)
	return n.NewInode(ctx, ch, fusefs.StableAttr{Mode: st.Mode & syscall.S_IFMT, Ino: st.Ino}), nil
}

// creatable returns the directory's flags, or ErrNoCreate for a NOCREATE
// directory.
func (n *node) creatable() (alloc.Flags, error) {
	f, err := n.flags()
	if err != nil {
		return 0, err
	}
	if f&alloc.NoCreate != 0 {
		return f, fmt.Errorf("%w: nothing new may be created here", alloc.ErrNoCreate)
	}
	return f, nil
}

// adopt finishes a new backing object, name in dirfd, whose bytes live
// where r says: it belongs to the caller (the daemon may be root),
// inherits the directory's flags, and is returned as an inode. On
// failure the object is removed again.
func (n *node) adopt(ctx context.Context, dirfd int, name string, parentFlags alloc.Flags, r *redirect, out *fuse.EntryOut) (*fusefs.Inode, error) {
	var st unix.Stat_t
	err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if err == nil {
		err = n.fs.withAttrs(r, dirfd, name, func(tfd int, tname string) error {
			uid, gid, ok := n.fs.owner(ctx, dirfd)
			if ok && (r != nil || uint32(uid) != st.Uid || uint32(gid) != st.Gid) {
				if err := unix.Fchownat(tfd, tname, uid, gid, nofollow(tname)); err != nil {
					return err
				}
				st.Uid, st.Gid = uint32(uid), uint32(gid)
			}
			if st.Mode&syscall.S_IFMT == syscall.S_IFLNK {
				return nil
			}
			return alloc.At(tfd, tname, r.attrIno(st.Ino), func(p string) error {
				return alloc.InheritFlags(parentFlags, p, st.Mode&syscall.S_IFMT == syscall.S_IFDIR)
			})
		})
	}
	if err == nil && r == nil && n.fs.gpu != nil {
		r, err = n.fs.inheritDevice(dirfd, name, &st)
	}
	var ch *fusefs.Inode
	if err == nil {
		ch, err = n.newChild(ctx, dirfd, name, &st, r, out)
	}
	if err != nil {
		if unix.Unlinkat(dirfd, name, 0) != nil {
			unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
		}
		n.fs.release(r)
		return nil, err
	}
	return ch, nil
}

var _ = (fusefs.NodeMkdirer)((*node)(nil))

// Mkdir makes a directory that inherits this one's flags.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := n.withDir(func(fd int) error {
		f, err := n.creatable()
		if err != nil {
			return err
		}
		if err := unix.Mkdirat(fd, name, mode); err != nil {
			return err
		}
		ch, err = n.adopt(ctx, fd, name, f, nil, out)
		return err
	})
	return ch, n.fs.errno("mkdir", n, name, err)
}

var _ = (fusefs.NodeMknoder)((*node)(nil))

// Mknod makes a special file; the kernel serves it, tensorfs keeps only
// its metadata.
func (n *node) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := n.withDir(func(fd int) error {
		f, err := n.creatable()
		if err != nil {
			return err
		}
		if err := unix.Mknodat(fd, name, mode, int(rdev)); err != nil {
			return err
		}
		ch, err = n.adopt(ctx, fd, name, f, nil, out)
		return err
	})
	return ch, n.fs.errno("mknod", n, name, err)
}

var _ = (fusefs.NodeSymlinker)((*node)(nil))

// Symlink makes a symbolic link.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := n.withDir(func(fd int) error {
		f, err := n.creatable()
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, fd, name); err != nil {
			return err
		}
		ch, err = n.adopt(ctx, fd, name, f, nil, out)
		return err
	})
	return ch, n.fs.errno("symlink", n, name, err)
}

var _ = (fusefs.NodeLinker)((*node)(nil))

// Link gives an existing segment a second name.
func (n *node) Link(ctx context.Context, target fusefs.InodeEmbedder, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := n.withDir(func(fd int) error {
		if _, err := n.creatable(); err != nil {
			return err
		}
		t := target.(*node)
		if t.redir() != nil {
			return fmt.Errorf("%w: SHARED and imported segments have one name", syscall.EXDEV)
		}
		var err error
		if t.isSymlink() {
			// linkat without AT_SYMLINK_FOLLOW links the name itself.
			err = t.at(func(tfd int, tname string) error { return unix.Linkat(tfd, tname, fd, name, 0) })
		} else {
			// p is the /proc link of exactly t's object (an O_TMPFILE
			// segment's too), which the kernel follows to that inode.
			err = t.path(func(p string) error { return unix.Linkat(unix.AT_FDCWD, p, fd, name, unix.AT_SYMLINK_FOLLOW) })
		}
		if err != nil {
			return err
		}
		ch, err = n.child(ctx, fd, name, out)
		return err
	})
	return ch, n.fs.errno("link", n, name, err)
}

var _ = (fusefs.NodeUnlinker)((*node)(nil))

// Unlink removes a name.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	err := n.withDir(func(fd int) error {
		r := n.fs.lastLinkRedirect(fd, name)
		watched := n.fs.watchedLastLink(fd, name)
		if err := unix.Unlinkat(fd, name, 0); err != nil {
			return err
		}
		n.fs.watches.unwatch(watched)
		return n.fs.release(r)
	})
	return n.fs.errno("unlink", n, name, err)
}

var _ = (fusefs.NodeRmdirer)((*node)(nil))

// Rmdir removes an empty directory.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	err := n.withDir(func(fd int) error { return unix.Unlinkat(fd, name, unix.AT_REMOVEDIR) })
	return n.fs.errno("rmdir", n, name, err)
}

var _ = (fusefs.NodeRenamer)((*node)(nil))

// Rename moves a name. A NOCREATE destination takes no new names; an
// EXCLUSIVE one never replaces an existing segment.
func (n *node) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dst := newParent.(*node)
	err := n.withDir(func(fd int) error {
		return dst.withDir(func(dfd int) error {
			if dst != n || flags&unix.RENAME_EXCHANGE == 0 {
				f, err := dst.flags()
				if err != nil {
					return err
				}
				if f&alloc.NoCreate != 0 && dst != n {
					return fmt.Errorf("%w: nothing may be moved in", alloc.ErrNoCreate)
				}
				if f&alloc.Exclusive != 0 && flags&unix.RENAME_EXCHANGE == 0 {
					flags |= unix.RENAME_NOREPLACE
				}
			}
			var replaced *redirect
			var watched uint64
			if flags&unix.RENAME_EXCHANGE == 0 {
				replaced = n.fs.lastLinkRedirect(dfd, newName)
				watched = n.fs.watchedLastLink(dfd, newName)
			}
			err := unix.Renameat2(fd, name, dfd, newName, uint(flags))
			if errors.Is(err, unix.EEXIST) && flags&unix.RENAME_NOREPLACE != 0 {
				return fmt.Errorf("%w: %s", alloc.ErrExists, newName)
			}
			if err == nil {
				n.fs.watches.unwatch(watched)
				err = n.fs.release(replaced)
			}
			if err == nil {
				alloc.At(dfd, newName, 0, func(p string) error {
					n.fs.store.RecordSharedPath(p, dst.Path(nil)+"/"+newName)
					return nil
				})
			}
			return err
		})
	})
	return n.fs.errno("rename", n, name, err)
}

var _ = (fusefs.NodeOpendirHandler)((*node)(nil))

// OpendirHandle lists the backing directory.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	var dfd int
	err := n.withDir(func(fd int) (err error) {
		dfd, err = unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		return nil, 0, n.fs.errnoOf("opendir", n, err)
	}
	ds, errno := fusefs.NewLoopbackDirStreamFd(dfd)
	return ds, 0, errno
}

var _ = (fusefs.NodeReadlinker)((*node)(nil))

// Readlink reads a symbolic link.
func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	buf := make([]byte, unix.PathMax)
	var sz int
	err := n.at(func(fd int, name string) (err error) {
		sz, err = unix.Readlinkat(fd, name, buf)
		return err
	})
	if err != nil {
		return nil, n.fs.errnoOf("readlink", n, err)
	}
	return buf[:sz], 0
}
