package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
)

// controlBackend serves the control socket's segment operations (package
// ctl) on the mount's backing, checking each request against the peer's
// credentials with the permission rules of open(2).
type controlBackend struct{ fsys *filesystem }

var _ = (ctl.Backend)(controlBackend{})

// Export opens a KEEPFD segment for the peer.
func (b controlBackend) Export(cred ctl.Cred, path string, write bool) (*os.File, error) {
	f, err := b.export(cred, path, write)
	if err != nil {
		b.fsys.log.Info("refused", "op", "export", "path", path, "pid", cred.Pid, "err", err)
	}
	return f, err
}

func (b controlBackend) export(cred ctl.Cred, path string, write bool) (*os.File, error) {
	dirfd, name, err := b.walk(cred, path)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dirfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, fmt.Errorf("%w: %s is not a segment", alloc.ErrInvalid, path)
	}
	r := b.fsys.redirectOf(dirfd, name, &st)
	if err := b.fsys.statSegment(r, dirfd, name, &st); err != nil {
		return nil, err
	}
	want := uint32(4)
	if write {
		want |= 2
	}
	if !permitted(cred, &st, want) {
		return nil, syscall.EACCES
	}
	var f alloc.Flags
	err = b.fsys.withAttrs(r, dirfd, name, func(tfd int, tname string) error {
		return alloc.At(tfd, tname, r.attrIno(st.Ino), func(p string) (err error) {
			f, err = alloc.ReadFlags(p)
			return err
		})
	})
	switch {
	case err != nil:
		return nil, err
	case f&alloc.KeepFD == 0:
		return nil, fmt.Errorf("%w: export hands out descriptors of KEEPFD segments only", alloc.ErrReadOnly)
	case write && f&alloc.FromFD != 0:
		return nil, fmt.Errorf("%w: FROMFD segments are read-only", alloc.ErrReadOnly)
	case r != nil && r.dev != nil:
		return r.dev.export()
	}
	if r != nil && r.imported != "" {
		fd, err := b.fsys.imports.dup(r.imported) // read-only, as imported
		if err != nil {
			return nil, err
		}
		return os.NewFile(uintptr(fd), path), nil
	}
	var file *os.File
	err = b.fsys.withData(r, dirfd, name, func(tfd int, tname string) error {
		mode := unix.O_RDONLY
		if write {
			mode = unix.O_RDWR
		}
		fd, err := openAt(tfd, tname, mode|unix.O_CLOEXEC)
		if err != nil {
			return err
		}
		file = os.NewFile(uintptr(fd), path)
		return nil
	})
	return file, err
}

// Import makes the peer's descriptor the segment at path, without a copy.
func (b controlBackend) Import(cred ctl.Cred, path string, f *os.File, dtype, shape string) error {
	err := b.importFile(cred, path, f, dtype, shape)
	if err != nil {
		b.fsys.log.Info("refused", "op", "import", "path", path, "pid", cred.Pid, "err", err)
	}
	return err
}

func (b controlBackend) importFile(cred ctl.Cred, path string, f *os.File, dtype, shape string) error {
	fd, err := importable(f)
	if err != nil {
		return err
	}
	defer func() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}()
	dirfd, name, err := b.walk(cred, path)
	if err != nil {
		return err
	}
	defer unix.Close(dirfd)
	var dir, st unix.Stat_t
	if err := unix.Fstat(dirfd, &dir); err != nil {
		return err
	}
	if !permitted(cred, &dir, 2|1) {
		return syscall.EACCES
	}
	pf, err := alloc.ReadFlags(alloc.FdPath(dirfd))
	if err != nil {
		return err
	}
	if pf&alloc.NoCreate != 0 {
		return fmt.Errorf("%w: nothing new may be created here", alloc.ErrNoCreate)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	// The marker carries the segment's name, owner, flags and metadata,
	// all set through its own descriptor: a name renamed or replaced
	// meanwhile is never followed. The sender's file is never written.
	marker, err := unix.Openat(dirfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(marker)
	p := alloc.FdPath(marker)
	id := alloc.NewID()
	if os.Geteuid() == 0 {
		err = unix.Fchown(marker, int(cred.Uid), int(cred.Gid))
	}
	if err == nil {
		err = alloc.InheritFlags(pf|alloc.FromFD, p, false)
	}
	for _, a := range [][2]string{{alloc.AttrDtype, dtype}, {alloc.AttrShape, shape}} {
		if err == nil && a[1] != "" {
			err = alloc.Setxattr(alloc.Object{Path: p, Size: st.Size}, a[0], []byte(a[1]), 0)
		}
	}
	if err == nil {
		err = b.fsys.imports.add(id, fd, cred.Uid)
	}
	if err == nil {
		fd = -1 // held by the import now; dropped below on failure
		err = alloc.MarkImport(p, id)
	}
	if err == nil {
		err = unix.Fchmod(marker, 0o444) // last: the daemon may not be root
	}
	if err != nil {
		unlinkIfSame(dirfd, name, marker)
		if fd < 0 {
			b.fsys.imports.drop(id)
		}
		return err
	}
	b.fsys.notifyNewName(path)
	b.fsys.log.Info("imported", "path", path, "bytes", st.Size, "pid", cred.Pid)
	return nil
}

// importable duplicates the peer's descriptor f if it may become a
// segment: an open regular file (a memfd, a file on tmpfs or disk) that
// this very descriptor can read. An O_PATH or write-only descriptor would
// give the segment's readers an access its sender does not have, and a
// file on a FUSE filesystem could be one of this mount's, which the
// daemon would have to serve to itself.
func importable(f *os.File) (int, error) {
	fd, err := dupFile(f)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	var sfs unix.Statfs_t
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err == nil {
		err = unix.Fstat(fd, &st)
	}
	if err == nil {
		err = unix.Fstatfs(fd, &sfs)
	}
	switch {
	case err != nil:
	case fl&unix.O_PATH != 0:
		err = fmt.Errorf("%w: an O_PATH descriptor grants no access to a file's bytes; send one opened for reading", syscall.EBADF)
	case fl&unix.O_ACCMODE == unix.O_WRONLY:
		err = fmt.Errorf("%w: a write-only descriptor cannot be read; send one opened for reading", syscall.EBADF)
	case st.Mode&syscall.S_IFMT != syscall.S_IFREG:
		err = fmt.Errorf("%w: import takes a regular file or memfd", alloc.ErrInvalid)
	case sfs.Type == unix.FUSE_SUPER_MAGIC:
		err = fmt.Errorf("%w: the file is on a FUSE filesystem; a file of a tensorfs mount is shared by its path", alloc.ErrInvalid)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// unlinkIfSame removes name in dirfd if it still names the file open at fd.
func unlinkIfSame(dirfd int, name string, fd int) {
	var a, b unix.Stat_t
	if unix.Fstat(fd, &a) == nil && unix.Fstatat(dirfd, name, &b, unix.AT_SYMLINK_NOFOLLOW) == nil && a.Ino == b.Ino && a.Dev == b.Dev {
		unix.Unlinkat(dirfd, name, 0)
	}
}

// dupFile duplicates f's descriptor without switching f to blocking mode.
func dupFile(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	cerr := rc.Control(func(raw uintptr) {
		fd, err = unix.FcntlInt(raw, unix.F_DUPFD_CLOEXEC, 0)
	})
	if cerr != nil {
		return -1, cerr
	}
	return fd, err
}

// walk resolves the parent directory of path in the backing as the peer
// would: every directory on the way must grant it search permission. It
// returns an O_PATH descriptor of that directory and the final name.
func (b controlBackend) walk(cred ctl.Cred, path string) (int, string, error) {
	if !b.fsys.allowOther && cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return -1, "", fmt.Errorf("%w: the mount is private to its user (mount with --allow-other to share it)", syscall.EACCES)
	}
	parts := strings.Split(filepath.Clean(path), "/")
	fd, err := unix.FcntlInt(uintptr(b.fsys.store.RootFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, "", err
	}
	for _, part := range parts[:len(parts)-1] {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || !permitted(cred, &st, 1) {
			unix.Close(fd)
			return -1, "", syscall.EACCES
		}
		next, err := unix.Openat(fd, part, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return -1, "", err
		}
		fd = next
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || !permitted(cred, &st, 1) {
		unix.Close(fd)
		return -1, "", syscall.EACCES
	}
	return fd, parts[len(parts)-1], nil
}

// permitted applies the mode bits of st to the peer as the kernel would for
// want (4 read, 2 write, 1 execute/search); root may do anything.
func permitted(cred ctl.Cred, st *unix.Stat_t, want uint32) bool {
	if cred.Uid == 0 {
		return true
	}
	mode := st.Mode & 0o777
	switch {
	case cred.Uid == st.Uid:
		mode >>= 6
	case inGroup(cred, st.Gid):
		mode >>= 3
	}
	return mode&want == want
}

// inGroup reports whether the peer's primary or supplementary groups, as
// they were when it connected, include gid.
func inGroup(cred ctl.Cred, gid uint32) bool {
	return cred.InGroup(gid)
}
