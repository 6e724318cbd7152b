package fs

import (
	"errors"
	"fmt"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
)

var _ = (ctl.Loader)(controlBackend{})

// Load serves the control socket's load: the segments under a directory,
// each with a descriptor, for a client that maps a whole state dict in one
// request. Permissions are open(2)'s: search on every directory on the
// way, read (to list) on every directory walked, read (and write if asked)
// on every segment; one refusal refuses the request.
func (b controlBackend) Load(cred ctl.Cred, dir string, write bool, after string, max int) ([]ctl.Segment, []*os.File, bool, error) {
	l := &loader{b: b, cred: cred, write: write, after: strings.Split(after, "/"), max: max}
	if after == "" {
		l.after = nil
	}
	err := l.start(dir)
	if err != nil {
		for _, f := range l.files {
			if f != nil {
				f.Close()
			}
		}
		b.fsys.log.Info("refused", "op", "load", "path", dir, "pid", cred.Pid, "err", err)
		return nil, nil, false, err
	}
	return l.segs, l.files, l.more, nil
}

// loader is one load request's walk: depth first, entries in byte order,
// so that names come in the order of their components and a request can
// resume after the last name of the one before.
type loader struct {
	b     controlBackend
	cred  ctl.Cred
	write bool
	after []string // components of the name to resume after; nil from the start
	max   int

	segs  []ctl.Segment
	files []*os.File // nil for a segment without a descriptor
	more  bool
}

// errFull stops the walk once max segments are collected and another follows.
var errFull = errors.New("load: reply full")

func (l *loader) start(dir string) error {
	parent, name, err := l.b.walk(l.cred, dir)
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	err = l.dir(parent, name, nil)
	if err == errFull {
		l.more = true
		return nil
	}
	return err
}

// dir walks the directory name in parentfd, whose components below the
// requested directory are rel.
func (l *loader) dir(parentfd int, name string, rel []string) error {
	fd, err := unix.Openat(parentfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if !permitted(l.cred, &st, 4|1) {
		return fmt.Errorf("%w: %s: listing it needs read and search permission", syscall.EACCES, display(rel))
	}
	names, err := f.Readdirnames(-1)
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, child := range names {
		crel := append(slices.Clip(rel), child)
		if l.before(crel) {
			continue
		}
		var cst unix.Stat_t
		if err := unix.Fstatat(fd, child, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue // removed meanwhile
			}
			return err
		}
		switch cst.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			err = l.dir(fd, child, crel)
		case syscall.S_IFREG:
			err = l.segment(fd, child, crel, &cst)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// before reports whether the entry rel comes at or before the name to
// resume after, with nothing after it to visit: a directory on the way to
// that name is walked.
func (l *loader) before(rel []string) bool {
	if l.after == nil {
		return false
	}
	for i, c := range rel {
		if i == len(l.after) {
			return false // below the name: a directory's content comes after it
		}
		if c != l.after[i] {
			return c < l.after[i]
		}
	}
	return len(rel) == len(l.after) // the name itself; a prefix is a directory on the way
}

// segment adds the segment name in dirfd, whose stat is st.
func (l *loader) segment(dirfd int, name string, rel []string, st *unix.Stat_t) error {
	if len(l.segs) == l.max {
		return errFull
	}
	seg := ctl.Segment{Name: path.Join(rel...)}
	fsys := l.b.fsys
	r := fsys.redirectOf(dirfd, name, st)
	if r == nil {
		file, err := l.plain(dirfd, name, rel, &seg)
		if file != nil {
			l.segs = append(l.segs, seg)
			l.files = append(l.files, file)
		}
		return err
	}
	// A SHARED segment's bytes are its disk file; an imported segment's
	// are its sender's descriptor and a GPU segment's device memory: the
	// client opens those two through the mount.
	if err := fsys.statSegment(r, dirfd, name, st); err != nil {
		return err
	}
	if err := l.permit(st, rel); err != nil {
		return err
	}
	seg.Size = st.Size
	err := fsys.withAttrs(r, dirfd, name, func(tfd int, tname string) error {
		return alloc.At(tfd, tname, r.attrIno(st.Ino), func(p string) error {
			return readAttrs(&seg, func(attr string, buf []byte) (int, error) { return unix.Getxattr(p, attr, buf) })
		})
	})
	if err == nil {
		err = l.checkFlags(&seg, rel)
	}
	if err != nil {
		return err
	}
	var file *os.File
	if r.disk != "" {
		err = fsys.withData(r, dirfd, name, func(tfd int, tname string) error {
			fd, err := openAt(tfd, tname, l.mode())
			if err == nil {
				file = os.NewFile(uintptr(fd), seg.Name)
			}
			return err
		})
		if err != nil {
			return err
		}
	}
	l.segs = append(l.segs, seg)
	l.files = append(l.files, file)
	return nil
}

// plain opens the ordinary backing file name in dirfd (its bytes and its
// attributes in one object) and fills seg from the open file, so that
// what is checked is what is handed out. It returns nil for an object
// that is no longer a regular file.
func (l *loader) plain(dirfd int, name string, rel []string, seg *ctl.Segment) (*os.File, error) {
	fd, err := openAt(dirfd, name, l.mode()|unix.O_NONBLOCK)
	if errors.Is(err, unix.ENOENT) {
		return nil, nil // removed meanwhile
	}
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err = unix.Fstat(fd, &st); err == nil && st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		unix.Close(fd)
		return nil, nil // replaced meanwhile
	}
	if err == nil {
		err = l.permit(&st, rel)
	}
	if err == nil {
		seg.Size = st.Size
		err = readAttrs(seg, func(attr string, buf []byte) (int, error) { return unix.Fgetxattr(fd, attr, buf) })
	}
	if err == nil {
		err = l.checkFlags(seg, rel)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), seg.Name), nil
}

// mode is the open(2) flags of the descriptors handed out.
func (l *loader) mode() int {
	if l.write {
		return unix.O_RDWR | unix.O_CLOEXEC
	}
	return unix.O_RDONLY | unix.O_CLOEXEC
}

// permit applies open(2)'s permission check to the segment rel, whose
// stat is st.
func (l *loader) permit(st *unix.Stat_t, rel []string) error {
	want, what := uint32(4), "read"
	if l.write {
		want, what = 4|2, "read and write"
	}
	if !permitted(l.cred, st, want) {
		return fmt.Errorf("%w: %s: no %s permission", syscall.EACCES, display(rel), what)
	}
	return nil
}

// checkFlags refuses write access to a FROMFD segment.
func (l *loader) checkFlags(seg *ctl.Segment, rel []string) error {
	if f, _ := alloc.ParseFlags(seg.Flags); l.write && f&alloc.FromFD != 0 {
		return fmt.Errorf("%w: %s is FROMFD (imported, read-only): load it without write", alloc.ErrReadOnly, display(rel))
	}
	return nil
}

// readAttrs fills seg's flags and tensor attributes with get, a getxattr.
func readAttrs(seg *ctl.Segment, get func(attr string, buf []byte) (int, error)) error {
	buf := make([]byte, 8192)
	for _, a := range []struct {
		name string
		v    *string
	}{{alloc.AttrFlags, &seg.Flags}, {alloc.AttrDtype, &seg.Dtype}, {alloc.AttrShape, &seg.Shape},
		{alloc.AttrStride, &seg.Stride}, {alloc.AttrOffset, &seg.Offset}} {
		n, err := get(a.name, buf)
		switch {
		case errors.Is(err, unix.ENODATA):
		case err != nil:
			return err
		default:
			*a.v = string(buf[:n])
		}
	}
	return nil
}

// display names a segment or directory of a load in messages.
func display(rel []string) string {
	if len(rel) == 0 {
		return "the directory"
	}
	return alloc.EscapeText(path.Join(rel...))
}
