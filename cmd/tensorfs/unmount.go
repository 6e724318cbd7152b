package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
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
	pid := servingDaemon(mp)
	mounted := mountedAt(mp)
	if !mounted && pid == 0 && !*purge {
		fmt.Fprintf(stderr, "tensorfs unmount: %s is not mounted\n", mp)
		return 1
	}
	if *purge && pid > 0 {
		// The daemon purges the backing as it exits, should its users
		// keep it serving after this command ends.
		if err := os.WriteFile(statePath(mp, ".purge"), []byte(strconv.Itoa(pid)+"\n"), 0o600); err != nil {
			fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
			return 1
		}
	}
	// busy: the mount was in use (or detached already), so the daemon
	// serves on until its last user exits; held counts those users.
	busy, held := !mounted, 0
	if mounted {
		if err := unix.Unmount(mp, 0); err != nil {
			held = holdingProcesses(mp)
			busy = errors.Is(err, unix.EBUSY) || held > 0
			if err := unmount(mp); err != nil {
				fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
				return 1
			}
		}
	}
	if pid > 0 {
		grace := 10 * time.Second
		if busy {
			grace = time.Second // only for users that are exiting already
		}
		switch {
		case waitExit(pid, grace):
		case busy:
			fmt.Fprintln(stdout, busyMessage(mp, pid, held, *purge))
			return 0
		default:
			fmt.Fprintf(stderr, "tensorfs unmount: daemon %d did not exit after the unmount\n", pid)
			return 1
		}
	}
	if *purge {
		if err := alloc.Purge(mp); err != nil {
			fmt.Fprintf(stderr, "tensorfs unmount: purge: %v\n", err)
			return 1
		}
		os.Remove(statePath(mp, ".purge"))
	}
	return 0
}

// busyMessage says what unmount left: a detached mount whose daemon
// serves its users until the last one exits.
func busyMessage(mp string, pid, held int, purge bool) string {
	users := "its files are still in use"
	switch {
	case held == 1:
		users = "1 process still holds files"
	case held > 1:
		users = strconv.Itoa(held) + " processes still hold files"
	}
	then := "serves them until the last one exits"
	if purge {
		then = "purges the backing when the last one exits"
	}
	return fmt.Sprintf("tensorfs unmount: %s detached; %s; the daemon (pid %d) %s", mp, users, pid, then)
}

// holdingProcesses counts the processes other than this one that keep
// the mount at mp busy: an open file, a mapping, a working or root
// directory under it. It reads their paths, so it must run before the
// mount is detached.
func holdingProcesses(mp string) int {
	under := func(p string) bool { return p == mp || strings.HasPrefix(p, mp+"/") }
	holds := func(proc string) bool {
		for _, l := range []string{"cwd", "root"} {
			if t, err := os.Readlink(proc + "/" + l); err == nil && under(t) {
				return true
			}
		}
		fds, _ := os.ReadDir(proc + "/fd")
		for _, fd := range fds {
			if t, err := os.Readlink(proc + "/fd/" + fd.Name()); err == nil && under(t) {
				return true
			}
		}
		maps, _ := os.ReadFile(proc + "/maps")
		for _, line := range strings.Split(string(maps), "\n") {
			// "ADDR PERMS OFFSET DEV INODE    PATH"
			if f := strings.SplitN(line, " ", 6); len(f) == 6 && under(strings.TrimLeft(f[5], " ")) {
				return true
			}
		}
		return false
	}
	procs, _ := os.ReadDir("/proc")
	n := 0
	for _, p := range procs {
		if pid, err := strconv.Atoi(p.Name()); err == nil && pid != os.Getpid() && holds("/proc/"+p.Name()) {
			n++
		}
	}
	return n
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

// servingDaemon returns the pid of a live tensorfs daemon serving mp,
// mounted or detached, or 0: the one its pid file names, or else the one
// listening on its control socket.
func servingDaemon(mp string) int {
	b, _ := os.ReadFile(statePath(mp, ".pid"))
	if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 && isDaemon(pid) {
		return pid
	}
	c, err := net.DialTimeout("unixpacket", statePath(mp, ".sock"), time.Second)
	if err != nil {
		return 0
	}
	defer c.Close()
	pid := 0
	if rc, err := c.(*net.UnixConn).SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) {
			if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
				pid = int(cred.Pid)
			}
		})
	}
	return pid
}

// isDaemon reports whether pid runs "tensorfs mount", so that a pid file
// left by a daemon that died, its pid since reused, blocks nothing.
func isDaemon(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	argv := strings.Split(string(b), "\x00")
	return err == nil && len(argv) > 1 && argv[1] == "mount" && strings.Contains(filepath.Base(argv[0]), "tensorfs")
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
