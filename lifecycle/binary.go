package lifecycle

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// selfExe is this process's own executable: the inode it runs from, not
// a path someone could have replaced since.
const selfExe = "/proc/self/exe"

// BinaryFd is the descriptor a kept daemon finds its own binary on (the
// one its keeper checked and ran): CloseBinaryFd closes it.
const BinaryFd = KeeperFd + 1

// CloseBinaryFd closes BinaryFd in a kept daemon, so that its children do
// not inherit it; only if it is an O_PATH descriptor, as the keeper's is
// (a keeper from before BinaryFd passes nothing there).
func CloseBinaryFd() {
	if fl, err := unix.FcntlInt(BinaryFd, unix.F_GETFL, 0); err == nil && fl&unix.O_PATH != 0 {
		unix.Close(BinaryFd)
	}
}

// binary is an executable the keeper runs as daemons: a descriptor of the
// inode it checked, which it runs again after a crash, so that whatever
// later takes its path changes nothing.
type binary struct {
	f    *os.File // O_PATH
	path string   // as given, for messages and the daemon's argv[0]
}

// selfBinary returns the keeper's own executable, which root ran already.
func selfBinary() (*binary, error) {
	f, err := os.OpenFile(selfExe, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	path, err := os.Executable()
	if err != nil {
		path = selfExe
	}
	return &binary{f: f, path: path}, nil
}

// openBinary opens the executable at the absolute path p, one component
// at a time without following a symbolic link, and checks it as sudo and
// ssh check their files: it and every directory above it belong to root
// (or to this process's user) and no one else may write them (a sticky
// directory such as /tmp may be writable by all: no one else can rename
// what it holds). Anything else is refused: a user who could replace it
// or a directory above it would choose what the keeper runs as root.
func openBinary(p string) (*binary, error) {
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return nil, fmt.Errorf("the binary %q: want a clean absolute path", p)
	}
	fd, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	at := "/"
	for _, name := range strings.Split(p[1:], "/") {
		if err := checkOwner(fd, at, true); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("refused to run %s: %w", p, err)
		}
		next, err := unix.Openat(fd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("the binary %s: %w", p, err)
		}
		fd, at = next, filepath.Join(at, name)
	}
	b := &binary{f: os.NewFile(uintptr(fd), p), path: p}
	if err := b.check(); err != nil {
		b.f.Close()
		return nil, err
	}
	return b, nil
}

// check checks that b is still a regular file that belongs to root (or to
// this process's user) and that no one else may write.
func (b *binary) check() error {
	if err := checkOwner(int(b.f.Fd()), b.path, false); err != nil {
		return fmt.Errorf("refused to run %s: %w", b.path, err)
	}
	return nil
}

// checkOwner checks the object open at fd, named at for messages: a
// directory if dir, else a regular file, owned by root or this process's
// user, and writable by no group or other (a sticky directory excepted).
func checkOwner(fd int, at string, dir bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("%s: %w", at, err)
	}
	kind, want := "a regular file", uint32(unix.S_IFREG)
	if dir {
		kind, want = "a directory", unix.S_IFDIR
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return fmt.Errorf("%s is a symbolic link; give the path it points to", at)
	case st.Mode&unix.S_IFMT != want:
		return fmt.Errorf("%s is not %s", at, kind)
	case st.Uid != 0 && int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s belongs to uid %d, who could change what runs as uid %d; it must be root's", at, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0 && !(dir && st.Mode&unix.S_ISVTX != 0):
		return fmt.Errorf("%s is writable by group or others (mode %04o), who could change what runs as uid %d", at, st.Mode&0o7777, os.Geteuid())
	}
	return nil
}

// command returns a command that runs b itself with args, through its
// descriptor (BinaryFd in the child, so that an interpreter reads the
// very script), with keeper on KeeperFd.
func (b *binary) command(keeper *os.File, args ...string) *exec.Cmd {
	cmd := exec.Command(fmt.Sprintf("/proc/self/fd/%d", BinaryFd), args...)
	cmd.Args[0] = b.path
	cmd.ExtraFiles = []*os.File{keeper, b.f} // KeeperFd, BinaryFd
	return cmd
}
