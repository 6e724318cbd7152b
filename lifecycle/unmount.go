package lifecycle

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/procfs"
)

// ErrNotMounted is returned by Unmount when nothing is mounted at the
// mountpoint, no daemon serves it and no purge was asked for.
var ErrNotMounted = errors.New("not mounted")

// Unmounted says what Unmount did.
type Unmounted struct {
	// Pid is the daemon that served the mount, 0 if none did.
	Pid int
	// Busy is set when the daemon serves on: its mount was in use (or
	// detached already), so it is detached and the daemon serves its
	// users until the last one exits, and purges then if asked.
	Busy bool
	// Held counts the processes that held the mount's files when it was
	// detached, 0 if none or unknown.
	Held int
}

// Unmount unmounts the absolute path mp and waits for its daemon to
// exit. A busy mount is detached, and Unmount returns with Busy set once
// users still exiting have had a second. With purge the backing goes too:
// the daemon is asked over its control socket to purge it when it exits
// (before anything is unmounted: a refusal changes nothing), and once it
// has exited, or if none served mp, Unmount purges it itself.
func Unmount(mp string, purge bool) (Unmounted, error) {
	pid := serving(mp)
	dev := mountDev(mp)
	mounted := dev != 0
	if !mounted && pid == 0 && !purge {
		return Unmounted{}, fmt.Errorf("%s is %w", mp, ErrNotMounted)
	}
	if purge && pid > 0 {
		if err := askPurge(mp, pid); err != nil {
			return Unmounted{}, err
		}
	}
	res := Unmounted{Pid: pid, Busy: !mounted}
	if mounted {
		if err := unix.Unmount(mp, 0); err != nil {
			res.Held = holdingProcesses(mp)
			res.Busy = errors.Is(err, unix.EBUSY) || res.Held > 0
			if err := detach(mp); err != nil {
				return Unmounted{}, err
			}
		}
	}
	if pid > 0 {
		grace := 10 * time.Second
		if res.Busy {
			grace = time.Second // only for users that are exiting already
		}
		switch {
		case waitExit(pid, grace):
		case res.Busy:
			return res, nil
		default:
			if held := mountedElsewhere(dev, 3); held != "" {
				return Unmounted{}, fmt.Errorf("%s is unmounted here, but daemon %d serves on: the filesystem is "+
					"still mounted in another mount namespace (a container's, or one unshare made), that of %s; "+
					"the daemon exits once it is unmounted there or those processes end", mp, pid, held)
			}
			return Unmounted{}, fmt.Errorf("daemon %d did not exit after the unmount", pid)
		}
	}
	res.Busy = false
	if purge {
		if err := alloc.Purge(mp); err != nil {
			return Unmounted{}, fmt.Errorf("purge: %w", err)
		}
	}
	return res, nil
}

// purgeDialWait bounds how long askPurge waits for a daemon that serves
// to listen on its control socket.
const purgeDialWait = 2 * time.Second

// askPurge asks the daemon pid, which serves mp, to purge its backing
// when it exits. A daemon just started (a restart's or a crash's
// successor) writes its pid file a moment before its control socket
// listens: the socket is dialed again while pid lives, for purgeDialWait
// at most.
func askPurge(mp string, pid int) error {
	c, err := ctl.DialServing(alloc.StatePath(mp, ".sock"), purgeDialWait, func() bool { return unix.Kill(pid, 0) == nil })
	if err != nil {
		return fmt.Errorf("ask daemon %d to purge: %w", pid, err)
	}
	defer c.Close()
	cred, err := c.Peer()
	switch {
	case err != nil:
		return fmt.Errorf("ask daemon %d to purge: %w", pid, err)
	case int(cred.Pid) != pid:
		return fmt.Errorf("ask daemon %d to purge: its control socket is pid %d's", pid, cred.Pid)
	}
	if err := c.Purge(); err != nil {
		return fmt.Errorf("ask daemon %d to purge: %w", pid, err)
	}
	return nil
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
		maps, _ := procfs.ReadFile(proc + "/maps") // never waits on a lease
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

// mountedElsewhere names up to limit processes ("pid 12 (sleep)") whose
// mount namespace, not this process's, has the filesystem of device dev
// mounted: a copy of the mount that namespace took when it was made,
// which keeps the connection, and so the daemon, alive after the mount
// here is gone. "" when there are none, or dev is 0, or /proc says no.
func mountedElsewhere(dev uint64, limit int) string {
	self, err := os.Readlink("/proc/self/ns/mnt")
	if dev == 0 || err != nil {
		return ""
	}
	ofDev := func(m *mountinfo.Info) (skip, stop bool) {
		return unix.Mkdev(uint32(m.Major), uint32(m.Minor)) != dev, false
	}
	seen := map[string]bool{self: true}
	var held []string
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		ns, err := os.Readlink("/proc/" + p.Name() + "/ns/mnt")
		if err != nil || seen[ns] {
			continue
		}
		seen[ns] = true
		info, _ := procfs.ReadFile("/proc/" + p.Name() + "/mountinfo")
		if mounts, err := mountinfo.GetMountsFromReader(bytes.NewReader(info), ofDev); err == nil && len(mounts) > 0 {
			comm, _ := procfs.ReadFile("/proc/" + p.Name() + "/comm")
			held = append(held, fmt.Sprintf("pid %d (%s)", pid, alloc.EscapeText(strings.TrimSpace(string(comm)))))
			if len(held) == limit {
				break
			}
		}
	}
	return strings.Join(held, ", ")
}

// detach unmounts mp; a busy mount is detached lazily, so that it goes
// away once its last user does. A user who is not root goes through
// fusermount3.
func detach(mp string) error {
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
