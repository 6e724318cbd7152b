package fs

import (
	"context"
	"errors"
	"fmt"
	"path"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ledger"
)

var (
	_ = (fusefs.NodeLookuper)((*dirNode)(nil))
	_ = (fusefs.NodeMkdirer)((*dirNode)(nil))
	_ = (fusefs.NodeMknoder)((*dirNode)(nil))
	_ = (fusefs.NodeSymlinker)((*dirNode)(nil))
	_ = (fusefs.NodeLinker)((*dirNode)(nil))
	_ = (fusefs.NodeCreater)((*dirNode)(nil))
	_ = (fusefs.NodeTmpfiler)((*dirNode)(nil))
	_ = (fusefs.NodeUnlinker)((*dirNode)(nil))
	_ = (fusefs.NodeRmdirer)((*dirNode)(nil))
	_ = (fusefs.NodeRenamer)((*dirNode)(nil))
	_ = (fusefs.NodeOpendirHandler)((*dirNode)(nil))
)

// errNoCreate refuses a new name in a NOCREATE directory.
var errNoCreate = fmt.Errorf("%w: nothing new may be created here", alloc.ErrNoCreate)

// Lookup finds name in the backing directory.
func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := d.withDir(func(fd int) (err error) {
		ch, err = d.child(ctx, fd, name, out)
		return err
	})
	if err != nil {
		return nil, d.fs.errnoOf("lookup", &d.nodeBase, err)
	}
	return ch, 0
}

// child makes the inode of the backing object name in dirfd: a node of
// the object's type, and for a segment of its kind (classify).
func (d *dirNode) child(ctx context.Context, dirfd int, name string, out *fuse.EntryOut) (*fusefs.Inode, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, err
	}
	var node fusefs.InodeEmbedder
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		node = d.fs.newDir()
	case syscall.S_IFLNK:
		node = &symlinkNode{nodeBase{fs: d.fs}}
	case syscall.S_IFREG:
		s, err := d.fs.segmentKind(dirfd, name, &st)
		if err != nil {
			return nil, err
		}
		node = d.fs.newSegment(s)
	default:
		node = &specialNode{nodeBase{fs: d.fs}}
	}
	out.Attr.FromStat(toSyscallStat(&st))
	return d.NewInode(ctx, node, fusefs.StableAttr{Mode: st.Mode & syscall.S_IFMT, Ino: st.Ino}), nil
}

// segmentKind classifies the segment name in dirfd, whose stat is st, and
// refreshes st with what stat shows of it. A segment with bytes in its
// backing file is a host segment (markers are empty), which costs no
// further call.
func (fsys *filesystem) segmentKind(dirfd int, name string, st *unix.Stat_t) (storage, error) {
	if fsys.hostBySize(st) {
		return host{}, nil
	}
	m, err := alloc.OpenRef(dirfd, name, st.Ino)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	s, err := fsys.classify(m)
	if err == nil {
		err = statOf(m, s, st)
	}
	return s, err
}

// adopt finishes a new backing object a, made in the directory open at
// dirfd, whose storage is s (nil for an object that is not a segment, and
// for an O_TMPFILE segment, which stays a host one): it belongs to the
// caller (the daemon may be root), inherits the directory's flags and
// device, and st is what stat shows of it now, for the reply. A segment
// its creator opened for writing (writer) loses the set-id bits a write
// would clear (writerDrops), as an open for writing of an existing one
// does. It returns the object's storage, which a device directory changes.
func (d *dirNode) adopt(ctx context.Context, dirfd int, a *alloc.Ref, pf alloc.Flags, s storage, writer bool, st *unix.Stat_t) (storage, error) {
	attrs := func(fn func(*alloc.Ref) error) error { return fn(a) }
	if s != nil {
		attrs = func(fn func(*alloc.Ref) error) error { return s.attrs(a, fn) }
	}
	err := attrs(func(o *alloc.Ref) error {
		if err := d.fs.giveToCaller(ctx, dirfd, o); err != nil {
			return err
		}
		if o.IsSymlink() {
			return nil
		}
		p, _ := o.Path()
		if err := alloc.InheritFlags(pf, p, o.Stat().Mode&syscall.S_IFMT == syscall.S_IFDIR); err != nil || !writer {
			return err
		}
		var now unix.Stat_t
		if err := unix.Fstat(o.Fd(), &now); err != nil {
			return err
		}
		_, err := writerDrops(ctx, o, &now)
		return err
	})
	mode := a.Stat().Mode & syscall.S_IFMT
	if err == nil && (mode == syscall.S_IFDIR || mode == syscall.S_IFREG && s != nil && s.kind() == alloc.Host) {
		var ds storage
		if ds, err = d.fs.inheritDevice(dirfd, a); ds != nil {
			s = ds
		}
	}
	if err == nil {
		err = statOf(a, s, st) // now: the caller's, with its flags and device
	}
	return s, err
}

// giveToCaller makes the new object o the caller's (the daemon may be
// root), with the directory's group if it is set-group-ID. chown(2)
// clears set-id bits, which the caller asked for: they are set again, as
// tmpfs keeps them, less set-group-ID for a caller outside the group.
func (fsys *filesystem) giveToCaller(ctx context.Context, dirfd int, o *alloc.Ref) error {
	uid, gid, ok := fsys.owner(ctx, dirfd)
	st := o.Stat()
	if !ok || uint32(uid) == st.Uid && uint32(gid) == st.Gid {
		return nil
	}
	if err := o.Chown(uid, gid); err != nil {
		return err
	}
	mode := st.Mode & 07777
	if mode&(unix.S_ISUID|unix.S_ISGID) == 0 || o.IsSymlink() || st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		return nil
	}
	if who := fuseRequester(ctx); who.Uid != 0 && !who.InGroup(uint32(gid)) {
		mode &^= unix.S_ISGID
	}
	return o.Chmod(mode)
}

// made returns the Ref of the object just made at name in dirfd; the
// kernel holds the directory's lock while it makes a name, so nothing
// else can have moved it since.
func made(dirfd int, name string) (*alloc.Ref, error) {
	return alloc.OpenRef(dirfd, name, 0)
}

// undo removes the object a that a failed request made at name in dirfd,
// if name still holds it.
func undo(dirfd int, name string, a *alloc.Ref) {
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Ino != a.Stat().Ino {
		return
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
	} else {
		unix.Unlinkat(dirfd, name, 0)
	}
}

// makeNode runs make to create name in the directory, then adopts the new
// object and returns its inode, made by node (with the object's storage
// for a segment: s, or what the directory's device makes it); a refusal
// or failure leaves nothing behind.
func (d *dirNode) makeNode(ctx context.Context, op, name string, out *fuse.EntryOut, s storage, make func(dirfd int) error, node func(storage) fusefs.InodeEmbedder) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	err := d.withDir(func(fd int) error {
		pf, err := d.creatable()
		if err != nil {
			return err
		}
		uid := caller(ctx).Uid
		if err := d.fs.inodes.reserve(uid); err != nil {
			return err
		}
		if err := make(fd); err != nil {
			d.fs.inodes.unreserve(uid)
			return err
		}
		a, err := made(fd, name)
		if err != nil {
			d.fs.inodes.unreserve(uid)
			return err
		}
		defer a.Close()
		var st unix.Stat_t
		s, err := d.adopt(ctx, fd, a, pf, s, false, &st)
		if err != nil {
			undo(fd, name, a)
			d.fs.inodes.unreserve(uid)
			return err
		}
		d.fs.inodes.made(st.Ino, uid)
		out.Attr.FromStat(toSyscallStat(&st))
		ch = d.NewInode(ctx, node(s), fusefs.StableAttr{Mode: st.Mode & syscall.S_IFMT, Ino: st.Ino})
		return nil
	})
	return ch, d.fs.errno(op, &d.nodeBase, name, err)
}

// Mkdir makes a directory that inherits this one's flags and device.
func (d *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return d.makeNode(ctx, "mkdir", name, out, nil,
		func(fd int) error { return unix.Mkdirat(fd, name, mode) },
		func(storage) fusefs.InodeEmbedder { return d.fs.newDir() })
}

// Mknod makes a special file, which the kernel serves (tensorfs keeps
// only its metadata), or an empty segment.
func (d *dirNode) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	make := func(fd int) error { return unix.Mknodat(fd, name, mode, int(rdev)) }
	if mode&syscall.S_IFMT == syscall.S_IFREG {
		if f, err := d.flags(d); err == nil && f&alloc.Shared != 0 {
			return nil, d.fs.errno("mknod", &d.nodeBase, name, fmt.Errorf("%w: SHARED segments are made by open(O_CREAT)", syscall.EOPNOTSUPP))
		}
		return d.makeNode(ctx, "mknod", name, out, host{}, make,
			func(s storage) fusefs.InodeEmbedder { return d.fs.newSegment(s) })
	}
	return d.makeNode(ctx, "mknod", name, out, nil, make,
		func(storage) fusefs.InodeEmbedder { return &specialNode{nodeBase{fs: d.fs}} })
}

// Symlink makes a symbolic link.
func (d *dirNode) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return d.makeNode(ctx, "symlink", name, out, nil,
		func(fd int) error { return unix.Symlinkat(target, fd, name) },
		func(storage) fusefs.InodeEmbedder { return &symlinkNode{nodeBase{fs: d.fs}} })
}

// Create makes and opens a new segment that inherits the directory's
// flags and device. In an EXCLUSIVE directory an existing name is EEXIST.
func (d *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	var ch *fusefs.Inode
	var h segmentHandle
	err := d.fs.takeHandle(ctx, false, func() error {
		return d.withDir(func(dirfd int) (err error) {
			ch, h, err = d.create(ctx, dirfd, name, flags, mode, out)
			return err
		})
	})
	if err != nil {
		return nil, nil, 0, d.fs.errno("create", &d.nodeBase, name, err)
	}
	return ch, h, h.fuseFlags(), 0
}

func (d *dirNode) create(ctx context.Context, dirfd int, name string, flags, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, segmentHandle, error) {
	pf, err := d.creatable()
	if err != nil {
		return nil, nil, err
	}
	bflags, pt := d.fs.backingFlags(flags)
	uid := caller(ctx).Uid
	if err := d.fs.inodes.reserve(uid); err != nil {
		return nil, nil, err
	}
	fd, err := unix.Openat(dirfd, name, bflags|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW, mode)
	if err != nil {
		d.fs.inodes.unreserve(uid)
	}
	if errors.Is(err, unix.EEXIST) {
		return d.openExisting(ctx, dirfd, name, pf, flags, out)
	}
	if err != nil {
		return nil, nil, err
	}
	a, err := alloc.OpenRef(fd, "", 0)
	if err != nil {
		unix.Close(fd)
		unix.Unlinkat(dirfd, name, 0)
		d.fs.inodes.unreserve(uid)
		return nil, nil, err
	}
	defer a.Close()
	var s storage = host{}
	if pf&alloc.Shared != 0 {
		// The marker stays empty; the bytes live on --disk.
		marker := fd
		fd, s, err = d.fs.createShared(marker, bflags, mode)
		unix.Close(marker)
	}
	var st unix.Stat_t
	if err == nil {
		s, err = d.adopt(ctx, dirfd, a, pf, s, flags&unix.O_ACCMODE != unix.O_RDONLY, &st)
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		undo(dirfd, name, a)
		d.fs.inodes.unreserve(uid)
		if s != nil {
			s.release()
		}
		return nil, nil, err
	}
	d.fs.inodes.made(st.Ino, uid)
	seg := d.fs.newSegment(s)
	out.Attr.FromStat(toSyscallStat(&st))
	ch := d.NewInode(ctx, seg, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: st.Ino})
	c := caller(ctx)
	base := handle{node: seg, pid: d.fs.processOf(c.Pid), uid: c.Uid, writable: flags&unix.O_ACCMODE != unix.O_RDONLY}
	var h segmentHandle
	if dev, ok := s.(device); ok {
		unix.Close(fd) // the backing file stays the empty marker
		h, _ = dev.open(seg, a, base, flags)
	} else {
		h = &fileHandle{handle: base, fd: fd, passthrough: pt, attrsHere: true}
	}
	seg.track(h.common(), h)
	return ch, h, nil
}

// openExisting answers a CREATE of a name that exists: EEXIST for
// O_EXCL and in an EXCLUSIVE directory; else the name appeared since the
// kernel looked (another creator, an import), and it is opened.
func (d *dirNode) openExisting(ctx context.Context, dirfd int, name string, pf alloc.Flags, flags uint32, out *fuse.EntryOut) (*fusefs.Inode, segmentHandle, error) {
	switch {
	case flags&unix.O_EXCL != 0:
		return nil, nil, unix.EEXIST
	case pf&alloc.Exclusive != 0:
		return nil, nil, fmt.Errorf("%w: %s", alloc.ErrExists, name)
	}
	ch, err := d.child(ctx, dirfd, name, out)
	if err != nil {
		return nil, nil, err
	}
	seg, ok := ch.Operations().(*segmentNode)
	if !ok {
		return nil, nil, syscall.EISDIR
	}
	m, err := alloc.OpenRef(dirfd, name, ch.StableAttr().Ino)
	if err != nil {
		return nil, nil, err
	}
	defer m.Close()
	seg.opening.RLock()
	defer seg.opening.RUnlock()
	h, err := seg.open(ctx, m, flags)
	if err != nil {
		return nil, nil, err
	}
	// The open may have truncated it or cleared its set-id bits.
	var st unix.Stat_t
	if err := statOf(m, seg.storage(), &st); err != nil {
		seg.release(h.common()) // takeHandle gives the budget back
		h.close()
		return nil, nil, err
	}
	out.Attr.FromStat(toSyscallStat(&st))
	return ch, h, nil
}

// Tmpfile makes an open segment in no directory (O_TMPFILE); linkat can
// give it a name later.
func (d *dirNode) Tmpfile(ctx context.Context, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	var ch *fusefs.Inode
	var h *fileHandle
	err := d.fs.takeHandle(ctx, false, func() error {
		return d.withDir(func(dirfd int) error {
			pf, err := d.creatable()
			if err != nil {
				return err
			}
			bflags, pt := d.fs.backingFlags(flags)
			c := caller(ctx)
			if err := d.fs.inodes.reserve(c.Uid); err != nil {
				return err
			}
			fd, err := unix.Openat(dirfd, ".", bflags|unix.O_TMPFILE, mode)
			if err != nil {
				d.fs.inodes.unreserve(c.Uid)
				return err
			}
			var st unix.Stat_t
			a, err := alloc.OpenRef(fd, "", 0)
			if err == nil {
				_, err = d.adopt(ctx, dirfd, a, pf, nil, true, &st) // O_TMPFILE is for writing
				a.Close()
			}
			if err != nil {
				unix.Close(fd)
				d.fs.inodes.unreserve(c.Uid)
				return err
			}
			d.fs.inodes.made(st.Ino, c.Uid)
			out.Attr.FromStat(toSyscallStat(&st))
			seg := d.fs.newSegment(host{})
			ch = d.NewInode(ctx, seg, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: st.Ino})
			h = &fileHandle{handle: handle{node: seg, pid: d.fs.processOf(c.Pid), uid: c.Uid, writable: flags&unix.O_ACCMODE != unix.O_RDONLY},
				fd: fd, passthrough: pt, attrsHere: true, unnamed: true}
			seg.track(&h.handle, h)
			seg.orphan.Store(true) // in no directory, as one whose last name went
			d.fs.orphans.add(seg)
			return nil
		})
	})
	if err != nil {
		return nil, nil, 0, d.fs.errno("tmpfile", &d.nodeBase, "", err)
	}
	return ch, h, h.fuseFlags(), 0
}

// Link gives an existing segment, symbolic link or special file a second
// name. SHARED, imported and device segments have one name (EXDEV): their
// marker is not their bytes.
func (d *dirNode) Link(ctx context.Context, target fusefs.InodeEmbedder, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var ch *fusefs.Inode
	uid := caller(ctx).Uid
	err := d.withDir(func(fd int) error {
		if _, err := d.creatable(); err != nil {
			return err
		}
		if err := d.fs.inodes.reserve(uid); err != nil { // tmpfs takes an inode for every name
			return err
		}
		first := false // an O_TMPFILE segment's first name: charged as the object
		link := func(r *alloc.Ref) error {
			var st unix.Stat_t
			first = unix.Fstat(r.Fd(), &st) == nil && st.Nlink == 0
			// The /proc link of exactly r's object (an O_TMPFILE
			// segment's too), which the kernel follows to that inode.
			return unix.Linkat(unix.AT_FDCWD, alloc.FdPath(r.Fd()), fd, name, unix.AT_SYMLINK_FOLLOW)
		}
		var err error
		switch t := target.(type) {
		case *segmentNode:
			if k := t.storage().kind(); k != alloc.Host {
				err = fmt.Errorf("%w: %s segments have one name", syscall.EXDEV, k)
				break
			}
			err = t.withMarker(link)
		case *symlinkNode:
			err = t.leafRef(link)
		case *specialNode:
			err = t.leafRef(link)
		default:
			err = syscall.EPERM // directories have one name
		}
		if err != nil {
			d.fs.inodes.unreserve(uid)
			return err
		}
		if first {
			d.fs.inodes.unreserve(uid)
			if seg, ok := target.(*segmentNode); ok {
				d.fs.orphans.named(seg)
			}
		} else {
			d.fs.inodes.linked(target.EmbeddedInode().StableAttr().Ino, uid)
		}
		ch, err = d.child(ctx, fd, name, out)
		return err
	})
	return ch, d.fs.errno("link", &d.nodeBase, name, err)
}

// lastLink returns the inode of the object name in dirfd, whether name is
// its last name (a directory's only one), and, for the last name of a
// segment whose kind holds something to free once the name goes, its
// storage; 0 when name is not there.
func (fsys *filesystem) lastLink(dirfd int, name string) (s storage, ino uint64, last bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, 0, false, nil // the removal itself says why
	}
	last = st.Mode&syscall.S_IFMT == syscall.S_IFDIR || st.Nlink == 1
	if !last || st.Mode&syscall.S_IFMT != syscall.S_IFREG || fsys.hostBySize(&st) {
		return nil, st.Ino, last, nil // a host segment: nothing to free
	}
	s, err = fsys.segmentKind(dirfd, name, &st)
	return s, st.Ino, last, err
}

// nameGone settles the charge of the object ino whose name in d uid just
// removed: a further name gives back one; the last gives back the object,
// at once or, for a segment still open or mapped, once let go.
func (d *dirNode) nameGone(name string, ino uint64, last bool, uid uint32) {
	switch {
	case ino == 0:
	case !last:
		d.fs.inodes.unlinked(ino, uid)
	default:
		d.fs.watches.unwatch(ino)
		if ch := d.GetChild(name); ch != nil {
			if seg, ok := ch.Operations().(*segmentNode); ok && ch.StableAttr().Ino == ino {
				seg.orphan.Store(true)
				d.fs.orphans.add(seg) // journaled before the unlink is answered
				d.fs.orphaned(seg)    // as tmpfs frees it: before the unlink is answered
				return
			}
		}
		d.fs.inodes.gone(ino)
	}
}

// Unlink removes a name; the last name of a segment frees what its kind
// holds (a disk file, an import, device memory).
func (d *dirNode) Unlink(ctx context.Context, name string) syscall.Errno {
	err := d.withDir(func(fd int) error {
		s, ino, last, err := d.fs.lastLink(fd, name)
		if err != nil {
			return err
		}
		if err := unix.Unlinkat(fd, name, 0); err != nil {
			return err
		}
		d.nameGone(name, ino, last, caller(ctx).Uid)
		if s != nil {
			return s.release()
		}
		return nil
	})
	return d.fs.errno("unlink", &d.nodeBase, name, err)
}

// Rmdir removes an empty directory; a published one's removal is
// recorded, by the name it was published at, so that its version is not
// made here again (removedHere).
func (d *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno {
	err := d.withDir(func(fd int) error {
		_, ino, _, _ := d.fs.lastLink(fd, name)
		rec := d.fs.publishedAt(fd, name)
		if err := unix.Unlinkat(fd, name, unix.AT_REMOVEDIR); err != nil {
			return err
		}
		d.fs.inodes.gone(ino)
		if rec != nil {
			d.fs.cl.removedHere(path.Join(d.Path(nil), name), rec)
		}
		if ch := d.GetChild(name); ch != nil && ch.StableAttr().Ino == ino {
			d.fs.orphans.addUnnamed(ino) // a process may work in it
		}
		return nil
	})
	return d.fs.errno("rmdir", &d.nodeBase, name, err)
}

// Rename moves a name. A NOCREATE directory takes no new names, from a
// move (within it too: its set of names is sealed) or an exchange from
// elsewhere; an EXCLUSIVE one never has a name's segment
// replaced or exchanged.
func (d *dirNode) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dst := dirOf(newParent.EmbeddedInode())
	exchange := flags&unix.RENAME_EXCHANGE != 0
	err := d.withDir(func(fd int) error {
		return dst.withDir(func(dfd int) error {
			df, err := dst.flags(dst)
			if err != nil {
				return err
			}
			sf := df
			if dst != d {
				if sf, err = d.flags(d); err != nil {
					return err
				}
			}
			switch {
			case dst != d && df&alloc.NoCreate != 0:
				return fmt.Errorf("%w: nothing may be moved in", alloc.ErrNoCreate)
			case !exchange && df&alloc.NoCreate != 0:
				return fmt.Errorf("%w: its names are sealed (rename within it neither makes nor replaces one)", alloc.ErrNoCreate)
			case dst != d && exchange && sf&alloc.NoCreate != 0:
				return fmt.Errorf("%w: an exchange would move a name into this NOCREATE directory", alloc.ErrNoCreate)
			case exchange && (df|sf)&alloc.Exclusive != 0:
				return fmt.Errorf("%w: an exchange would give a name of an EXCLUSIVE directory another segment", alloc.ErrExists)
			case df&alloc.Exclusive != 0:
				flags |= unix.RENAME_NOREPLACE
			}
			if err := d.fs.clusterStays(fd, name, d); err != nil {
				return err
			}
			if exchange {
				if err := d.fs.clusterStays(dfd, newName, dst); err != nil {
					return err
				}
			}
			var replaced storage
			var ino uint64
			var last bool
			if !exchange {
				if replaced, ino, last, err = d.fs.lastLink(dfd, newName); err != nil {
					return err
				}
			}
			err = d.fs.renameRecorded(fd, name, dfd, newName, flags)
			if errors.Is(err, unix.EEXIST) && flags&unix.RENAME_NOREPLACE != 0 {
				return fmt.Errorf("%w: %s", alloc.ErrExists, newName)
			}
			if err != nil {
				return err
			}
			dst.nameGone(newName, ino, last, caller(ctx).Uid)
			if replaced != nil {
				err = replaced.release()
			}
			return err
		})
	})
	return d.fs.errno("rename", &d.nodeBase, name, err)
}

// clusterStays refuses, with EXDEV as a link is, a rename of name in
// dirfd if it is what the cluster made on this node: a pulled segment, or
// a directory made for a published one (alloc.MarkMade). Their names stay
// where the cluster put them, inside the version that charges them to its
// publisher and whose unpublish finds them there; moved out, they would
// be charged to no one. mv copies instead: the copies are the mover's.
// A directory on the way to a published directory made here, anyone's,
// stays too: a node finds what a version made by its path when it is
// unpublished. dirfd is the directory parent's.
func (fsys *filesystem) clusterStays(dirfd int, name string, parent *dirNode) error {
	if fsys.cl == nil {
		return nil // no cluster: nothing here is a version's
	}
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
		return nil // the rename itself says why
	}
	made := false
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		made = fsys.pulled.has(st.Ino)
	case unix.S_IFDIR:
		fd, err := unix.Openat(dirfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		dir, err := alloc.ReadMade(alloc.FdPath(fd))
		unix.Close(fd)
		if err != nil {
			return err
		}
		made = dir != ""
		if !made && fsys.cl.placedBelow(path.Join(parent.Path(nil), name)) {
			return fmt.Errorf("%w: %s holds a published directory the cluster made here, which stays where it put it (copy it instead)", syscall.EXDEV, alloc.EscapeText(name))
		}
	}
	if made {
		return fmt.Errorf("%w: %s was made here by the cluster, and stays where it put it (copy it instead)", syscall.EXDEV, alloc.EscapeText(name))
	}
	return nil
}

// renameRecorded renames name in fd to newName in dfd and records the
// paths of the SHARED segments it moves, as one step for creates of
// SHARED segments (createShared holds sharedPaths too).
func (fsys *filesystem) renameRecorded(fd int, name string, dfd int, newName string, flags uint32) error {
	if fsys.store.Disk == "" {
		return unix.Renameat2(fd, name, dfd, newName, uint(flags))
	}
	fsys.sharedPaths.Lock()
	defer fsys.sharedPaths.Unlock()
	if err := unix.Renameat2(fd, name, dfd, newName, uint(flags)); err != nil {
		return err
	}
	fsys.recordSharedPath(dfd, newName)
	if flags&unix.RENAME_EXCHANGE != 0 {
		fsys.recordSharedPath(fd, name)
	}
	return nil
}

// recordSharedPath notes on a SHARED segment's disk file that its marker
// is now name in dirfd, at that path in the backing as the kernel names
// it, so that recovery from the disk alone puts it there; for a
// directory, on the disk file of every SHARED segment below it. Other
// objects are left alone. The caller holds sharedPaths. A failure is
// logged, and the walk goes on to the other segments: the rename itself
// happened.
func (fsys *filesystem) recordSharedPath(dirfd int, name string) {
	var failed error
	record := func(dirfd int, name, rel string) {
		err := alloc.At(dirfd, name, 0, func(p string) error { return fsys.store.RecordSharedPath(p, rel) })
		if err != nil && !errors.Is(err, syscall.ELOOP) { // ELOOP: a symbolic link took the name
			failed = err
		}
	}
	dir, err := fsys.store.RelPath(dirfd)
	rel := path.Join(dir, name)
	var st unix.Stat_t
	if err == nil {
		err = unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	}
	switch {
	case err != nil:
	case st.Mode&unix.S_IFMT == unix.S_IFREG:
		record(dirfd, name, rel)
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
		var fd int
		if fd, err = unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); err != nil {
			break
		}
		err = alloc.Walk(fd, func(dirfd int, name, below string, st *unix.Stat_t) error {
			if st.Mode&unix.S_IFMT == unix.S_IFREG {
				record(dirfd, name, rel+"/"+below)
			}
			return nil
		})
		unix.Close(fd)
	}
	if err == nil {
		err = failed
	}
	if err != nil && (!errors.Is(err, syscall.ELOOP) || errors.Is(err, alloc.ErrTooDeep)) {
		fsys.log.Error("SHARED segments moved, but a disk file still records an old path; recovery from --disk alone would put it there", "path", rel, "err", err)
	}
}

// OpendirHandle lists the backing directory. The listing's descriptor is
// one of the caller's descriptors (fs/budget.go), as an open segment's is.
func (d *dirNode) OpendirHandle(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	var dfd int
	err := d.fs.takeHandle(ctx, flags&openAdopted != 0, func() error {
		return d.withDir(func(fd int) (err error) {
			dfd, err = unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			return err
		})
	})
	if err != nil {
		return nil, 0, d.fs.errnoOf("opendir", &d.nodeBase, err)
	}
	ds, _ := fusefs.NewLoopbackDirStreamFd(dfd)
	return &dirHandle{ds: ds, handles: d.fs.handles, uid: caller(ctx).Uid}, 0, 0
}

// dirHandle is an open directory: it lists, seeks and syncs, and nothing
// else (go-fuse's directory stream would also run ioctls). Its descriptor
// counts against uid's budget until it is released.
type dirHandle struct {
	ds      fusefs.DirStream
	handles *ledger.Row
	uid     uint32
}

var (
	_ = (fusefs.FileReaddirenter)((*dirHandle)(nil))
	_ = (fusefs.FileSeekdirer)((*dirHandle)(nil))
	_ = (fusefs.FileFsyncdirer)((*dirHandle)(nil))
	_ = (fusefs.FileReleasedirer)((*dirHandle)(nil))
)

// Readdirent returns the next entry.
func (h *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	return h.ds.(fusefs.FileReaddirenter).Readdirent(ctx)
}

// Seekdir moves to a position a listing returned.
func (h *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	return h.ds.(fusefs.FileSeekdirer).Seekdir(ctx, off)
}

// Fsyncdir syncs the directory.
func (h *dirHandle) Fsyncdir(ctx context.Context, flags uint32) syscall.Errno {
	return h.ds.(fusefs.FileFsyncdirer).Fsyncdir(ctx, flags)
}

// Releasedir closes the listing's descriptor.
func (h *dirHandle) Releasedir(ctx context.Context, flags uint32) {
	h.ds.(fusefs.FileReleasedirer).Releasedir(ctx, flags)
	h.handles.Give(h.uid, 1)
}
