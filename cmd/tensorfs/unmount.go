package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

func runUnmount(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs unmount", flag.ContinueOnError)
	purge := set.Bool("purge", false, "also release the backing memory (SHARED segments on disk are kept)")
	if code, ok := parseFlags(set, args, "[--purge] MOUNTPOINT", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs unmount: want exactly one MOUNTPOINT")
		return 2
	}
	mp, err := filepath.Abs(set.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
		return 1
	}
	pid := daemonPid(mp)
	if mountedAt(mp) {
		if err := unmount(mp); err != nil {
			fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
			return 1
		}
	} else if !*purge {
		fmt.Fprintf(stderr, "tensorfs unmount: %s is not mounted\n", mp)
		return 1
	}
	if pid > 0 && !waitExit(pid, 10*time.Second) {
		fmt.Fprintf(stderr, "tensorfs unmount: daemon %d did not exit after the unmount\n", pid)
		return 1
	}
	if *purge {
		if err := alloc.Purge(mp); err != nil {
			fmt.Fprintf(stderr, "tensorfs unmount: purge: %v\n", err)
			return 1
		}
	}
	return 0
}

// unmount detaches the FUSE mount at mp; a busy mount is detached lazily
// so that it goes away once its last user does.
func unmount(mp string) error {
	err := unix.Unmount(mp, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(mp, unix.MNT_DETACH)
	}
	if errors.Is(err, unix.EPERM) {
		if out, ferr := exec.Command("fusermount3", "-u", "-z", mp).CombinedOutput(); ferr != nil {
			return fmt.Errorf("unmount %s: %v (%s)", mp, ferr, strings.TrimSpace(string(out)))
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("unmount %s: %w", mp, err)
	}
	return nil
}

// daemonPid returns the pid of the daemon serving mp, 0 if unknown.
func daemonPid(mp string) int {
	b, err := os.ReadFile(statePath(mp, ".pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// waitExit waits for a process to exit. A pidfd becomes readable once
// the process has exited, reaped or not (the daemon is not our child).
func waitExit(pid int, timeout time.Duration) bool {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return errors.Is(err, unix.ESRCH)
	}
	defer unix.Close(fd)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, int(timeout.Milliseconds()))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n > 0
	}
}
