package main

// Which mount holds a path, from /proc/self/mountinfo: the CLI's commands
// that read or write segments refuse a path outside a tensorfs mount
// (--allow-outside lets them), and tensorfs status finds every mount.

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// fsType is the filesystem type a tensorfs mount has in the mount table
// (FUSE's "fuse." and the name fs.Mount gives).
const fsType = "fuse.tensorfs"

// mountEntry is what the CLI uses of a line of /proc/self/mountinfo.
type mountEntry struct {
	dev    uint64 // st_dev of the files on it
	point  string // where it is mounted
	fsType string // "fuse.tensorfs", "ext4"...
}

// readMounts returns the mount table of this process, in its order
// (a later mount over the same point hides an earlier one).
func readMounts() ([]mountEntry, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, err
	}
	out := make([]mountEntry, len(infos))
	for i, m := range infos {
		out[i] = mountEntry{dev: unix.Mkdev(uint32(m.Major), uint32(m.Minor)), point: m.Mountpoint, fsType: m.FSType}
	}
	return out, nil
}

// tensorfsMounts returns the mount points of every tensorfs mount in the
// mount table, each once.
func tensorfsMounts() ([]string, error) {
	mounts, err := readMounts()
	if err != nil {
		return nil, err
	}
	var out []string
	seen := map[string]bool{}
	for _, m := range mounts {
		if m.fsType == fsType && !seen[m.point] {
			seen[m.point] = true
			out = append(out, m.point)
		}
	}
	return out, nil
}

// mountOf returns the mount that holds path, or, when path does not exist
// yet, its nearest existing ancestor: of the mounts in the table on the
// same device whose point is a prefix of its real path, the longest (the
// last, of several at one point).
func mountOf(path string) (mountEntry, error) {
	p, err := filepath.Abs(path)
	if err != nil {
		return mountEntry{}, err
	}
	var st unix.Stat_t
	for {
		err := unix.Stat(p, &st)
		if err == nil {
			break
		}
		if errors.Is(err, unix.ENOTCONN) {
			return mountEntry{}, fmt.Errorf("%s: the tensorfs daemon is gone (%v): remount it with tensorfs mount", path, err)
		}
		parent := filepath.Dir(p)
		if !(errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR)) || parent == p {
			return mountEntry{}, &os.PathError{Op: "stat", Path: path, Err: err}
		}
		p = parent
	}
	if real, err := filepath.EvalSymlinks(p); err == nil {
		p = real
	}
	mounts, err := readMounts()
	if err != nil {
		return mountEntry{}, err
	}
	var found *mountEntry
	for i, m := range mounts {
		if m.dev == st.Dev && (m.point == "/" || p == m.point || strings.HasPrefix(p, m.point+"/")) &&
			(found == nil || len(m.point) >= len(found.point)) {
			found = &mounts[i]
		}
	}
	if found == nil {
		return mountEntry{}, fmt.Errorf("%s: no mount in /proc/self/mountinfo holds it", path)
	}
	return *found, nil
}

// checkInside returns nil when path (or, if it does not exist, where it
// would be made) is in a tensorfs mount, and otherwise an error that says
// where it is instead.
func checkInside(path string) error {
	m, err := mountOf(path)
	if err != nil {
		return err
	}
	if m.fsType != fsType {
		return fmt.Errorf("%s is not in a tensorfs mount: it is on %s, mounted at %s (tensorfs status lists the tensorfs mounts)", path, m.fsType, m.point)
	}
	return nil
}

// allowOutside adds the --allow-outside flag to a command's flags.
func allowOutside(set *flag.FlagSet, what string) *bool {
	return set.Bool("allow-outside", false, what+" a path outside any tensorfs mount too")
}

// checkPaths checks that each path is in a tensorfs mount, unless allowed;
// it prints one line for each that is not, and returns the paths that are.
func checkPaths(cmd string, paths []string, allowed bool, stderr io.Writer) (ok []string) {
	for _, p := range paths {
		if !allowed {
			if err := checkInside(p); err != nil {
				fmt.Fprintf(stderr, "%s: %s; or pass --allow-outside\n", cmd, alloc.EscapeText(err.Error()))
				continue
			}
		}
		ok = append(ok, p)
	}
	return ok
}
