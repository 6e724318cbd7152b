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
// credentials, taken when it connected, with the permission rules of
// open(2). Segments are reached as the FUSE side reaches them: a Ref
// checked to be the object, classify, and the kind's own methods. ctl logs
// each refusal with the error returned here, which names the path.
type controlBackend struct{ fsys *filesystem }

var _ = (ctl.Backend)(controlBackend{})

// Export opens a KEEPFD segment for the peer: a new open file description
// with the access asked for and permitted, never one the daemon or a
// sender holds.
func (b controlBackend) Export(cred ctl.Cred, path string, write bool) (*os.File, error) {
	who := cred
	var f *os.File
	err := b.walk(who, path, func(dirfd int, name string) error {
		m, err := alloc.OpenRef(dirfd, name, 0)
		if err != nil {
			return err
		}
		defer m.Close()
		s, _, err := b.segment(who, m, write, "")
		if err != nil {
			return err
		}
		flags, err := flagsOf(s, m)
		switch {
		case err != nil:
			return err
		case flags&alloc.KeepFD == 0:
			return fmt.Errorf("%w: export hands out descriptors of KEEPFD segments only", alloc.ErrReadOnly)
		case write && flags&alloc.FromFD != 0:
			return fmt.Errorf("%w: FROMFD segments are read-only", alloc.ErrReadOnly)
		}
		if e, ok := s.(exporter); ok {
			f, err = e.export(write)
			return err
		}
		if f, err = s.descriptor(m, write); err == nil && f == nil {
			err = fmt.Errorf("%w: a %s segment has no descriptor to hand out; open it through the mount", syscall.EOPNOTSUPP, s.kind())
		}
		if err == nil && write {
			if err = b.fsys.frozen(m.Stat().Ino); err != nil {
				f.Close()
				f = nil
			}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", alloc.EscapeText(path), err)
	}
	return f, nil
}

// segment classifies the segment m and checks that who may open it for
// reading, and writing if write: its storage and stat. name, if set,
// names the segment in a refusal.
func (b controlBackend) segment(who ctl.Cred, m *alloc.Ref, write bool, name string) (storage, *unix.Stat_t, error) {
	if m.Stat().Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, nil, fmt.Errorf("%w: not a segment", alloc.ErrInvalid)
	}
	s, err := b.fsys.classify(m)
	if err != nil {
		return nil, nil, err
	}
	var st unix.Stat_t
	if err := statOf(m, s, &st); err != nil {
		return nil, nil, err
	}
	want, what := uint32(4), "read"
	if write {
		want, what = 4|2, "read and write"
	}
	if !permitted(&who, &st, want) {
		if name != "" {
			name += ": "
		}
		return nil, nil, fmt.Errorf("%w: %sno %s permission", syscall.EACCES, name, what)
	}
	return s, &st, nil
}

// flagsOf reads the flags of the segment m, whose storage is s.
func flagsOf(s storage, m *alloc.Ref) (f alloc.Flags, err error) {
	err = s.attrs(m, func(a *alloc.Ref) error {
		p, err := a.Path()
		if err == nil {
			f, err = alloc.ReadFlags(p)
		}
		return err
	})
	return f, err
}

// Import makes the peer's descriptor the segment at path, without a copy.
func (b controlBackend) Import(cred ctl.Cred, path string, f *os.File, dtype, shape string) error {
	who := cred
	err := b.walk(who, path, func(dirfd int, name string) error {
		var dir unix.Stat_t
		if err := unix.Fstat(dirfd, &dir); err != nil {
			return err
		}
		if !permitted(&who, &dir, 2|1) {
			return fmt.Errorf("%w: no write permission on the directory", syscall.EACCES)
		}
		pf, err := alloc.ReadFlags(alloc.FdPath(dirfd))
		if err != nil {
			return err
		}
		if pf&alloc.NoCreate != 0 {
			return errNoCreate
		}
		return b.fsys.importSegment(who, dirfd, name, pf, f, dtype, shape)
	})
	if err != nil {
		return fmt.Errorf("%s: %w", alloc.EscapeText(path), err)
	}
	b.fsys.notifyNewName(path)
	b.fsys.log.Info("imported", "path", alloc.EscapeText(path), "uid", cred.Uid, "pid", cred.Pid)
	return nil
}

// walk resolves the parent directory of path in the backing as the peer
// would: every directory on the way must grant it search permission. It
// runs fn with an O_PATH descriptor of that directory and the final name.
func (b controlBackend) walk(who ctl.Cred, path string, fn func(dirfd int, name string) error) error {
	if !b.fsys.allowOther && who.Uid != 0 && int(who.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: the mount is private to its user (mount with --allow-other to share it)", syscall.EACCES)
	}
	parts := strings.Split(filepath.Clean(path), "/")
	fd, err := unix.FcntlInt(uintptr(b.fsys.store.RootFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	for _, part := range parts[:len(parts)-1] {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || !permitted(&who, &st, 1) {
			unix.Close(fd)
			return fmt.Errorf("%w: no search permission on the way", syscall.EACCES)
		}
		next, err := unix.Openat(fd, part, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return err
		}
		fd = next
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || !permitted(&who, &st, 1) {
		return fmt.Errorf("%w: no search permission on the way", syscall.EACCES)
	}
	return fn(fd, parts[len(parts)-1])
}
