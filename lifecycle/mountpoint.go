// Package lifecycle is a tensorfs mount's life on this machine: readying
// a mountpoint (cleaning the stale mount a crashed daemon left, refusing
// one still served), starting the daemon and serving until unmounted or
// signalled, knowing which daemon serves a mountpoint (its pid file, its
// control socket), unmounting, and purging the backing, at once or, asked
// over the control socket, when the daemon exits.
//
// A daemon's state lives beside its backing in alloc's state directory:
// MOUNTPOINT-HASH.pid names the daemon from before it touches the backing
// until it exits, .sock is its control socket and .log the log of a
// daemon started in the background.
package lifecycle

import (
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ServedError is Prepare's refusal while a daemon still serves the
// mountpoint: its mount is detached, but processes still use its files,
// and it owns the backing.
type ServedError struct {
	Mountpoint string
	Pid        int
}

func (e *ServedError) Error() string {
	return fmt.Sprintf("%s is still served by tensorfs daemon pid %d (its mount is detached but files are in use); "+
		"run tensorfs unmount %s and wait for their users to exit, or kill %d, then mount again", e.Mountpoint, e.Pid, e.Mountpoint, e.Pid)
}

// Prepare readies the absolute path mp for a new daemon, before anything
// touches the backing: a stale mount left by a daemon that died is
// detached; mp must then be a directory, not mounted, and not served by
// a live daemon (*ServedError), whose live segments recovery would take
// for leftovers.
func Prepare(mp string) error {
	if err := cleanStale(mp); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Stat(mp, &st); err != nil {
		return fmt.Errorf("mountpoint %s: %w (create it with mkdir -p)", mp, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("mountpoint %s is not a directory", mp)
	}
	if mountedAt(mp) {
		return fmt.Errorf("%s is already mounted; run tensorfs unmount %s first", mp, mp)
	}
	if pid := serving(mp); pid > 0 {
		return &ServedError{Mountpoint: mp, Pid: pid}
	}
	return nil
}

// cleanStale detaches the mount at mp if its daemon died (ENOTCONN).
// statfs asks the daemon every time, where stat may be answered from the
// kernel's attribute cache.
func cleanStale(mp string) error {
	var sfs unix.Statfs_t
	if err := unix.Statfs(mp, &sfs); !errors.Is(err, unix.ENOTCONN) {
		return nil
	}
	if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
		if out, ferr := exec.Command("fusermount3", "-u", "-z", mp).CombinedOutput(); ferr != nil {
			return fmt.Errorf("clean stale mount at %s: %v (%s)", mp, err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}

// mountedAt reports whether the absolute path mp is the root of a mount in
// this namespace, live or stale. It reads /proc/self/mountinfo and never
// touches mp, which may hang or fail on a stale mount.
func mountedAt(mp string) bool {
	return mountDev(mp) != 0
}

// mountDev returns the device number of the mount at mp, 0 for none. It
// reads /proc/self/mountinfo: a stat of mp would wait for the daemon,
// which a successor must not (it is the daemon the mount waits for).
func mountDev(mp string) uint64 {
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mp))
	if err != nil || len(mounts) == 0 {
		return 0
	}
	m := mounts[len(mounts)-1]
	return unix.Mkdev(uint32(m.Major), uint32(m.Minor))
}
