package alloc

import (
	"fmt"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// FdPath returns the /proc path of the object open at fd. It names that
// very inode: nothing is looked up again by name.
func FdPath(fd int) string {
	return "/proc/self/fd/" + strconv.Itoa(fd)
}

// At runs fn with a path that names exactly the object name in the
// directory open at dirfd (an empty name: the object open at dirfd). The
// object is opened with O_PATH|O_NOFOLLOW, so a name that was replaced
// with a symbolic link meanwhile is never followed: At refuses symbolic
// links with ELOOP. A nonzero ino is the inode the caller means; another
// object found at name is refused with ESTALE.
func At(dirfd int, name string, ino uint64, fn func(path string) error) error {
	if name == "" {
		return fn(FdPath(dirfd))
	}
	fd, err := unix.Openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	switch {
	case st.Mode&syscall.S_IFMT == syscall.S_IFLNK:
		return fmt.Errorf("%s is a symbolic link: %w", name, syscall.ELOOP)
	case ino != 0 && st.Ino != ino:
		return fmt.Errorf("%s is no longer the object asked for: %w", name, syscall.ESTALE)
	}
	return fn(FdPath(fd))
}

// Walk calls fn for every object below the directory open at dirfd,
// depth first, with the descriptor of the directory that holds it, its
// name, its path relative to dirfd and its stat. It opens each directory
// by name with O_NOFOLLOW relative to its parent's descriptor, so a
// symbolic link is never entered, whatever is renamed meanwhile. An
// unreadable entry is skipped; fn's error stops the walk.
func Walk(dirfd int, fn func(dirfd int, name, rel string, st *unix.Stat_t) error) error {
	return walk(dirfd, "", fn)
}

func walk(dirfd int, rel string, fn func(dirfd int, name, rel string, st *unix.Stat_t) error) error {
	fd, err := unix.Openat(dirfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), rel)
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, name := range names {
		var st unix.Stat_t
		if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			continue
		}
		p := name
		if rel != "" {
			p = rel + "/" + name
		}
		if err := fn(dirfd, name, p, &st); err != nil {
			return err
		}
		if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			continue
		}
		sub, err := unix.Openat(dirfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		err = walk(sub, p, fn)
		unix.Close(sub)
		if err != nil {
			return err
		}
	}
	return nil
}
