package alloc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/fdpass"
)

// FdPath returns the /proc path of the object open at fd. It names that
// very inode: nothing is looked up again by name.
func FdPath(fd int) string {
	return "/proc/self/fd/" + strconv.Itoa(fd)
}

// Ref is an O_PATH descriptor of exactly one backing object: opened by
// name without following a symbolic link, and checked to be the inode the
// caller meant. Every access to a backing object by name goes through a
// Ref (DESIGN.md §9, "one mechanism"): the object is found once, checked
// once, and every later call (attributes, owner, times, a real open) acts
// on that inode, whatever is renamed meanwhile.
type Ref struct {
	fd int
	st unix.Stat_t
}

// OpenRef opens name in the directory open at dirfd; an empty name: the
// object open at dirfd itself (a segment in no directory, reached
// through its open handle). A nonzero ino is the inode the caller means;
// another object at name is refused with ESTALE, so that the kernel looks
// the name up again.
func OpenRef(dirfd int, name string, ino uint64) (*Ref, error) {
	var fd int
	var err error
	if name == "" {
		fd, err = unix.FcntlInt(uintptr(dirfd), unix.F_DUPFD_CLOEXEC, 0)
	} else {
		fd, err = unix.Openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return nil, err
	}
	r := &Ref{fd: fd}
	if err := unix.Fstat(fd, &r.st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if ino != 0 && r.st.Ino != ino {
		unix.Close(fd)
		return nil, fmt.Errorf("%s is no longer the object asked for: %w", name, syscall.ESTALE)
	}
	return r, nil
}

// Close releases the descriptor.
func (r *Ref) Close() error { return unix.Close(r.fd) }

// Stat returns the object's stat as it was when the Ref was opened: its
// identity (inode, device, type) holds, but its owner, mode, size and
// times may have changed since; what a reply shows comes from a fresh
// fstat of Fd.
func (r *Ref) Stat() *unix.Stat_t { return &r.st }

// Fd returns the O_PATH descriptor, valid until Close.
func (r *Ref) Fd() int { return r.fd }

// IsSymlink reports whether the object is a symbolic link.
func (r *Ref) IsSymlink() bool { return r.st.Mode&syscall.S_IFMT == syscall.S_IFLNK }

// Path returns a /proc path that names exactly the object, for the calls
// that take a path (xattrs, chmod). A symbolic link has none: the path
// would reach what it points to.
func (r *Ref) Path() (string, error) {
	if r.IsSymlink() {
		return "", fmt.Errorf("a symbolic link: %w", syscall.ELOOP)
	}
	return FdPath(r.fd), nil
}

// Open opens the object itself with flags (O_RDONLY, O_WRONLY or O_RDWR,
// and O_NONBLOCK, O_APPEND...): a new open file description of this very
// inode, never of a name. Only regular files are opened, so that no
// special file planted at a name is ever opened by the daemon. Open
// never waits for a lease to break (fdpass.OpenNoWait): a lease in the
// way is ErrLeased.
func (r *Ref) Open(flags int) (int, error) {
	if r.st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return -1, fmt.Errorf("not a regular file (mode %#o): %w", r.st.Mode, syscall.EINVAL)
	}
	return r.same(fdpass.OpenNoWait(FdPath(r.fd), flags&^(unix.O_CREAT|unix.O_EXCL|unix.O_TRUNC|unix.O_NOFOLLOW)))
}

// OpenAt is Open through the object's name in the directory open at
// dirfd, where the caller found it, rather than through /proc/self/fd: a
// shorter lookup, for a caller that opens many (a control-socket load).
// The name is not followed (O_NOFOLLOW), the open does not wait
// (O_NONBLOCK: a FIFO put at the name meanwhile opens at once, a socket
// fails), and what it opened must be this very object, else ESTALE.
func (r *Ref) OpenAt(dirfd int, name string, flags int) (int, error) {
	if r.st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return -1, fmt.Errorf("not a regular file (mode %#o): %w", r.st.Mode, syscall.EINVAL)
	}
	return r.same(fdpass.OpenAtNoWait(dirfd, name, flags&^(unix.O_CREAT|unix.O_EXCL|unix.O_TRUNC)|unix.O_NOFOLLOW|unix.O_NOCTTY))
}

// same returns fd, an open's result, if it is the object itself; else it
// closes fd and returns ESTALE.
func (r *Ref) same(fd int, err error) (int, error) {
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino != r.st.Ino || st.Dev != r.st.Dev {
		unix.Close(fd)
		return -1, fmt.Errorf("reopen reached another object: %w", syscall.ESTALE)
	}
	return fd, nil
}

// Utimes sets the object's access and modification times (UTIME_OMIT
// keeps one); a symbolic link's own times.
func (r *Ref) Utimes(ts []unix.Timespec) error {
	if r.IsSymlink() {
		return unix.UtimesNanoAt(r.fd, "", ts, unix.AT_EMPTY_PATH)
	}
	return unix.UtimesNanoAt(unix.AT_FDCWD, FdPath(r.fd), ts, 0)
}

// Chown sets the object's owner and group (-1 keeps one); a symbolic
// link's own.
func (r *Ref) Chown(uid, gid int) error {
	return unix.Fchownat(r.fd, "", uid, gid, unix.AT_EMPTY_PATH)
}

// Chmod sets the object's mode bits; symbolic links have none to set.
func (r *Ref) Chmod(mode uint32) error {
	p, err := r.Path()
	if err != nil {
		return fmt.Errorf("%w: symbolic links have no mode of their own", syscall.EOPNOTSUPP)
	}
	return unix.Chmod(p, mode&07777)
}

// Readlink returns a symbolic link's target.
func (r *Ref) Readlink() ([]byte, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(r.fd, "", buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}

// At runs fn with a path that names exactly the object name in the
// directory open at dirfd (an empty name: the object open at dirfd),
// found as OpenRef finds it; a symbolic link is refused with ELOOP.
func At(dirfd int, name string, ino uint64, fn func(path string) error) error {
	r, err := OpenRef(dirfd, name, ino)
	if err != nil {
		return err
	}
	defer r.Close()
	p, err := r.Path()
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return fn(p)
}

// MaxDepth is how many levels of directories Walk enters below the one
// it starts from: each level holds a descriptor while the walk is in it,
// and a user can make a chain of directories as deep as they like.
const MaxDepth = 256

// ErrTooDeep is returned by Walk, once it has walked the rest, when it
// left directories deeper than MaxDepth unentered.
var ErrTooDeep = fmt.Errorf("%w: directories nested more than %d deep", syscall.ELOOP, MaxDepth)

// Walk calls fn for every object below the directory open at dirfd,
// depth first, with the descriptor of the directory that holds it, its
// name, its path relative to dirfd and its stat. It opens each directory
// by name with O_NOFOLLOW relative to its parent's descriptor, so a
// symbolic link is never entered, whatever is renamed meanwhile, and
// enters at most MaxDepth levels (ErrTooDeep). An entry removed meanwhile
// is skipped; fn's error stops the walk, and so does any other error
// opening a directory; ErrSkipDir for the directory fn was called with
// skips its contents.
func Walk(dirfd int, fn func(dirfd int, name, rel string, st *unix.Stat_t) error) error {
	return WalkHeld(dirfd, nil, nil, fn)
}

// WalkHeld is Walk that calls hold before it opens a directory to walk
// it and release once it has closed it, so that whoever asked for the
// walk is charged the descriptor it keeps for each level it is in, the
// first included (up to MaxDepth+1 at once); an error from hold stops
// the walk. nil hold and release charge nothing.
func WalkHeld(dirfd int, hold func() error, release func(), fn func(dirfd int, name, rel string, st *unix.Stat_t) error) error {
	w := walker{fn: fn, hold: hold, release: release}
	if err := w.walk(dirfd, ".", "", 0, 0); err != nil {
		return err
	}
	if w.tooDeep {
		return ErrTooDeep
	}
	return nil
}

// ErrSkipDir, returned by Walk's fn for a directory, skips its contents.
var ErrSkipDir = errors.New("skip this directory")

// WalkBatch is how many names a walk reads from a directory at a time:
// it holds at most that many for each level it is in, however many
// names a user gave a directory.
const WalkBatch = 256

// walker is one Walk: its function, and whether it left a directory
// unentered for its depth.
type walker struct {
	fn      func(dirfd int, name, rel string, st *unix.Stat_t) error
	hold    func() error // before a directory's descriptor is opened; nil: nothing
	release func()       // after it is closed
	tooDeep bool
}

// walk opens the directory name in dirfd (rel below the walk's start, at
// depth) and calls entry for each of its names, read a batch at a time.
// Unless ino is 0 (the start), a name that is no longer the directory
// ino that the walk's stat saw is skipped.
func (w *walker) walk(dirfd int, name, rel string, ino uint64, depth int) error {
	if w.hold != nil {
		if err := w.hold(); err != nil {
			return err
		}
		defer w.release()
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	switch {
	case err == nil:
	case ino == 0:
		return err
	case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP):
		return nil // removed or replaced since the stat
	default:
		return fmt.Errorf("%s: %w", rel, err)
	}
	d := os.NewFile(uintptr(fd), rel)
	defer d.Close()
	var st unix.Stat_t
	if ino != 0 && (unix.Fstat(fd, &st) != nil || st.Ino != ino) {
		return nil // replaced since the stat: not the directory fn saw
	}
	for {
		names, err := d.Readdirnames(WalkBatch)
		for _, name := range names {
			if err := w.entry(fd, name, rel, depth); err != nil {
				return err
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// entry calls fn for name in the directory open at dirfd (rel below the
// walk's start, at depth) and walks it if it is a directory.
func (w *walker) entry(dirfd int, name, rel string, depth int) error {
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
		return nil
	}
	if rel != "" {
		rel += "/"
	}
	rel += name
	dir := st.Mode&syscall.S_IFMT == syscall.S_IFDIR
	err := w.fn(dirfd, name, rel, &st)
	if err == ErrSkipDir && dir {
		return nil
	}
	if err != nil || !dir {
		return err
	}
	if depth == MaxDepth {
		w.tooDeep = true
		return nil
	}
	return w.walk(dirfd, name, rel, st.Ino, depth+1)
}

// RemoveTree removes path and, for a directory, everything below it, as
// os.RemoveAll does but without recursion: a chain of directories is as
// deep as a user made it, and os.RemoveAll holds a descriptor and a
// buffer per level on its way down. RemoveTree goes down and back up as
// a descent does, holding one directory's descriptor at a time (ESTALE
// when a directory moved meanwhile); a symbolic link is removed, never
// entered. A path that does not exist is no error.
func RemoveTree(path string) error {
	err := unix.Unlink(path)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) {
		return err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	d := descent{fd: fd}
	buf := make([]byte, 8192)
	for {
		below, err := removeEntries(d.fd, buf)
		if err == nil && below != "" {
			if err = d.down(below); err == nil {
				continue
			}
		}
		if err == nil && len(d.names) == 0 {
			unix.Close(d.fd)
			return unix.Rmdir(path)
		}
		if err == nil {
			// d's directory is empty: up to the one above, and remove it.
			var name string
			if name, err = d.up(); err == nil {
				if err = unix.Unlinkat(d.fd, name, unix.AT_REMOVEDIR); errors.Is(err, unix.ENOENT) {
					err = nil
				}
			}
		}
		if err != nil {
			unix.Close(d.fd)
			return fmt.Errorf("remove %s: %w", path, err)
		}
	}
}

// descent is a walk through a tree of directories that holds one
// directory's descriptor at a time (RemoveTree, Tree): it goes down by
// name (O_NOFOLLOW, so a symbolic link is never entered) and back up by
// "..", checked to be the directory it came down from. A level costs it
// a name and a stat, never a descriptor or a stack frame, however deep
// a user made a chain.
type descent struct {
	fd    int           // the directory it is in, its own
	above []unix.Stat_t // the directory above each one entered
	names []string      // the name of each one entered
}

// down enters the directory name in the one d is in.
func (d *descent) down(name string) error {
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		return err
	}
	sub, err := unix.Openat(d.fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	unix.Close(d.fd)
	d.fd, d.above, d.names = sub, append(d.above, st), append(d.names, name)
	return nil
}

// up goes back to the directory above the one d is in, and returns the
// name it came up from; ESTALE when ".." is no longer the directory it
// came down from (one moved meanwhile).
func (d *descent) up() (string, error) {
	up, err := unix.Openat(d.fd, "..", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	unix.Close(d.fd)
	d.fd = up
	last := len(d.names) - 1
	want, name := d.above[last], d.names[last]
	d.above, d.names = d.above[:last], d.names[:last]
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil || st.Dev != want.Dev || st.Ino != want.Ino {
		return "", fmt.Errorf("%w: a directory moved while it was walked", syscall.ESTALE)
	}
	return name, nil
}

// removeEntries removes what the directory open at fd holds, other than
// directories, and returns the name of a directory in it, or "" once it
// is empty: once a pass through it from its start removed nothing (a
// directory may list an entry late when others go meanwhile). buf is its
// buffer for getdents.
func removeEntries(fd int, buf []byte) (string, error) {
	for removed := true; removed; {
		removed = false
		if _, err := unix.Seek(fd, 0, io.SeekStart); err != nil {
			return "", err
		}
		for {
			n, err := unix.Getdents(fd, buf)
			if err != nil {
				return "", err
			}
			if n == 0 {
				break
			}
			_, _, names := unix.ParseDirent(buf[:n], -1, nil)
			for _, name := range names {
				err := unix.Unlinkat(fd, name, 0)
				if errors.Is(err, unix.EISDIR) {
					return name, nil
				}
				if err != nil && !errors.Is(err, unix.ENOENT) {
					return "", fmt.Errorf("%s: %w", name, err)
				}
				removed = true
			}
		}
	}
	return "", nil
}
