package alloc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Entry is an object Tree found, valid while Tree's fn runs.
type Entry struct {
	Dirfd  int         // the directory that holds it
	Name   string      // its name there
	Stat   unix.Stat_t // its stat, not followed
	Parent uint64      // the inode of the directory that holds it; 0 in the walk's start
	names  []string    // the names of the directories from the start down to Dirfd
}

// Rel is e's path relative to the walk's start. It is as long as e is
// deep, so it is built only when asked.
func (e *Entry) Rel() string {
	return strings.Join(append(e.names[:len(e.names):len(e.names)], e.Name), "/")
}

// LogDepth is how many components of a path log lines name. A chain of
// directories is as deep as a user makes it: naming all of it would cost
// each line time and log bytes in proportion.
const LogDepth = 64

// Tail names e in log lines: its path relative to the walk's start, its
// last LogDepth components after ".../" when it is deeper.
func (e *Entry) Tail() string {
	if len(e.names) < LogDepth {
		return e.Rel()
	}
	tail := e.names[len(e.names)-LogDepth+1:]
	return ".../" + strings.Join(append(tail[:len(tail):len(tail)], e.Name), "/")
}

// CutError is Tree's error when it could not walk the whole of a
// directory: Dir is that directory's stat (its owner may have made what
// the walk did not reach).
type CutError struct {
	Dir unix.Stat_t
	Err error
}

// Error says which directory the walk could not finish, and why.
func (e *CutError) Error() string {
	return fmt.Sprintf("walk cut in directory inode %d (uid %d): %v", e.Dir.Ino, e.Dir.Uid, e.Err)
}

// Unwrap is the reason.
func (e *CutError) Unwrap() error { return e.Err }

// Tree calls fn for every object below the directory open at dirfd, at
// any depth, depth first, a directory before what it holds. Unlike Walk
// it has no depth limit: it goes through the tree as a descent does,
// holding one descriptor of its own at a time (two while it moves a
// level), and for each level below the start a name, a stat and two
// offsets, however deep a user made a chain; it reads a directory's names
// a buffer at a time, and goes on in a directory it comes back up to
// after the one it entered, found again at its offset (or, where fn
// removed names before it and the filesystem's offsets count entries,
// as tmpfs's did before Linux 6.6, by its name). An entry removed meanwhile
// is skipped, and so is a directory replaced since fn saw it. fn's error
// stops the walk and is returned as it is; ErrSkipDir for a directory
// skips its contents. Any other error stops it as a *CutError.
func Tree(dirfd int, fn func(e *Entry) error) error {
	t := tree{fn: fn, buf: make([]byte, 8192)}
	fd, err := unix.Openat(dirfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Fstat(dirfd, &t.cur)
		return t.cut(err)
	}
	t.d.fd = fd
	defer func() { unix.Close(t.d.fd) }()
	if err := unix.Fstat(fd, &t.cur); err != nil {
		return t.cut(err)
	}
	for {
		e, at, err := t.next()
		switch {
		case err != nil:
			return err
		case e != nil:
			err = t.enter(e, at)
		case len(t.d.names) == 0:
			return nil
		default:
			err = t.leave()
		}
		if err != nil {
			return err
		}
	}
}

// tree is one Tree walk.
type tree struct {
	d   descent
	fn  func(e *Entry) error
	buf []byte      // for getdents
	at  []resume    // where to go on in each directory above d's
	cur unix.Stat_t // the directory d is in
}

// cut is the walk's error err in the directory it is in.
func (t *tree) cut(err error) error {
	return &CutError{Dir: t.cur, Err: err}
}

// resume is where a walk goes on in a directory it went down from: the
// offsets of the start and the end of the entry it entered.
type resume struct{ at, off int64 }

// next calls fn for the names of the directory d is in, from its offset
// on, and returns the first directory fn did not skip, with where its
// entry is; nil at the directory's end.
func (t *tree) next() (*Entry, resume, error) {
	pos, err := unix.Seek(t.d.fd, 0, io.SeekCurrent)
	if err != nil {
		return nil, resume{}, t.cut(err)
	}
	for {
		n, err := unix.Getdents(t.d.fd, t.buf)
		if err != nil {
			return nil, resume{}, t.cut(err)
		}
		if n == 0 {
			return nil, resume{}, nil
		}
		for b := t.buf[:n]; len(b) > 0; {
			off, name, reclen := dirent(b)
			b = b[reclen:]
			at := resume{pos, off}
			pos = off
			if name == "." || name == ".." {
				continue
			}
			e := &Entry{Dirfd: t.d.fd, Name: name, names: t.d.names}
			if len(t.d.names) > 0 {
				e.Parent = t.cur.Ino
			}
			if unix.Fstatat(t.d.fd, name, &e.Stat, unix.AT_SYMLINK_NOFOLLOW) != nil {
				continue // removed meanwhile
			}
			dir := e.Stat.Mode&syscall.S_IFMT == syscall.S_IFDIR
			err := t.fn(e)
			if err == ErrSkipDir && dir {
				continue
			}
			if err != nil {
				return nil, resume{}, err
			}
			if dir {
				return e, at, nil
			}
		}
	}
}

// dirent reads the linux_dirent64 at the start of b: the offset after
// it, its name and its length.
func dirent(b []byte) (int64, string, int) {
	off := int64(binary.NativeEndian.Uint64(b[8:16]))
	reclen := int(binary.NativeEndian.Uint16(b[16:18]))
	return off, unix.ByteSliceToString(b[19:reclen]), reclen
}

// enter goes down into the directory e, whose entry is at at in the
// directory d is in; one gone or replaced since fn saw it is left.
func (t *tree) enter(e *Entry, at resume) error {
	if _, err := unix.Seek(t.d.fd, at.off, io.SeekStart); err != nil {
		return t.cut(err)
	}
	err := t.d.down(e.Name)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
		return nil
	}
	if err != nil {
		return &CutError{Dir: e.Stat, Err: err}
	}
	t.at = append(t.at, at)
	if err := unix.Fstat(t.d.fd, &t.cur); err != nil {
		return t.cut(err)
	}
	if t.cur.Dev != e.Stat.Dev || t.cur.Ino != e.Stat.Ino {
		return t.leave() // replaced since the stat: not the directory fn saw
	}
	return nil
}

// leave goes back up to the directory above, where it left off.
func (t *tree) leave() error {
	name, err := t.d.up()
	if err != nil {
		return t.cut(err)
	}
	last := len(t.at) - 1
	at := t.at[last]
	t.at = t.at[:last]
	if err := unix.Fstat(t.d.fd, &t.cur); err != nil {
		return t.cut(err)
	}
	if err := t.resume(name, at); err != nil {
		return t.cut(err)
	}
	return nil
}

// resume sets the directory d is in to go on after name, the directory
// the walk came back up from, whose entry was at at. The entry is read
// again there; where it moved (fn removed names before it, and the
// offsets count entries), it is looked for from the directory's start;
// once gone, the walk goes on from the offset after it.
func (t *tree) resume(name string, at resume) error {
	for _, from := range []int64{at.at, 0} {
		if _, err := unix.Seek(t.d.fd, from, io.SeekStart); err != nil {
			return err
		}
		off, found, err := t.find(name, from != 0)
		if err != nil {
			return err
		}
		if found {
			at.off = off
			break
		}
	}
	_, err := unix.Seek(t.d.fd, at.off, io.SeekStart)
	return err
}

// find reads the directory d is in, from its offset, for name (in its
// first entry only, dots aside, when first), and returns the offset
// after it.
func (t *tree) find(name string, first bool) (int64, bool, error) {
	for {
		n, err := unix.Getdents(t.d.fd, t.buf)
		if err != nil || n == 0 {
			return 0, false, err
		}
		for b := t.buf[:n]; len(b) > 0; {
			off, got, reclen := dirent(b)
			b = b[reclen:]
			switch {
			case got == name:
				return off, true, nil
			case first && got != "." && got != "..":
				return 0, false, nil
			}
		}
	}
}
