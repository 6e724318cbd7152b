package lifecycle

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/procfs"
)

// serving returns the pid of a live tensorfs daemon serving mp, mounted or
// detached, or 0: the one its pid file names, or else the one listening on
// its control socket.
func serving(mp string) int {
	b, _ := os.ReadFile(alloc.StatePath(mp, ".pid"))
	if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 && isDaemon(pid) {
		return pid
	}
	return ctl.ServingPid(alloc.StatePath(mp, ".sock"), 0)
}

// isDaemon reports whether pid runs "tensorfs mount", so that a pid file
// left by a daemon that died, its pid since reused, blocks nothing.
func isDaemon(pid int) bool {
	b, err := procfs.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	argv := strings.Split(string(b), "\x00")
	return err == nil && len(argv) > 1 && argv[1] == "mount" && strings.Contains(filepath.Base(argv[0]), "tensorfs")
}

// writePidFile says that this process serves mp, until the returned
// function removes the file; or, for a process that never served
// (served false), names again the one the file named before, if any (a
// predecessor whose mount a failed takeover leaves it).
func writePidFile(mp string) (remove func(served bool), err error) {
	if err := alloc.MakeStateDir(); err != nil {
		return nil, err
	}
	p := alloc.StatePath(mp, ".pid")
	prev, _ := os.ReadFile(p)
	if err := os.WriteFile(p, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return nil, err
	}
	return func(served bool) {
		if served || len(prev) == 0 || os.WriteFile(p, prev, 0o644) != nil {
			os.Remove(p)
		}
	}, nil
}

// waitExit waits up to timeout for the process pid to exit and reports
// whether it did. A pidfd becomes readable once the process has exited,
// reaped or not (a daemon is not our child).
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
