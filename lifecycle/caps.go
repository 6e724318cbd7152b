package lifecycle

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// droppedEnv marks a process that DropCapability has executed again, so
// that it does not do so twice.
const droppedEnv = "TENSORFS_CAPS_DROPPED"

// DropCapability makes this process run without capability c from now on,
// in every thread, for good: it removes c from the bounding, inheritable
// and ambient sets and executes the same program again with the same
// arguments (the new program's permitted and effective sets then lack c).
// Linux keeps capabilities per thread and a Go program has many, which a
// change in one thread does not reach; an exec replaces them all. Call it
// first thing in main, before anything that an exec would lose. It
// returns nil without an exec where there is nothing to do (not root, or
// c not in the bounding set) or where it was done already, and an error
// where the exec failed or c cannot be dropped (no CAP_SETPCAP).
//
// The daemon drops CAP_SYS_RESOURCE: with it, its writes to a SHARED
// segment's --disk would use the blocks ext4 keeps for root and pass disk
// quotas (DESIGN.md §9).
func DropCapability(c int) error {
	if os.Geteuid() != 0 || os.Getenv(droppedEnv) != "" {
		return nil
	}
	if in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0); err != nil || in == 0 {
		return nil
	}
	// The sets are the calling thread's: the exec must come from it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
		return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear the ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[c/32].Inheritable &^= 1 << (c % 32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	env := append(os.Environ(), droppedEnv+"=1")
	// Its own inode, not its path, which may name another file by now.
	return fmt.Errorf("execute %s again without capability %d: %w", selfExe, c, unix.Exec(selfExe, os.Args, env))
}
