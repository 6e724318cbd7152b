package lifecycle

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
)

// Fake daemons are this test binary run as "tensorfs mount MOUNTPOINT"
// with LIFECYCLE_TEST_DAEMON set to what it should do (fakeDaemonMain).
func TestMain(m *testing.M) {
	if mode := os.Getenv("LIFECYCLE_TEST_DAEMON"); mode != "" {
		os.Exit(fakeDaemonMain(mode, os.Args[len(os.Args)-1]))
	}
	if c := os.Getenv("LIFECYCLE_TEST_DROP"); c != "" {
		n, _ := strconv.Atoi(c)
		os.Exit(capsChildMain(n))
	}
	os.Exit(m.Run())
}

// fakeDaemonMain plays a daemon of mp. Modes:
//
//	idle   say "up", then wait for stdin to close
//	ctl    listen on mp's control socket, say "up", say "purge asked"
//	       for each purge request, and wait for stdin to close
//	latectl  as ctl, but say "up" 300 ms before it listens
//	ready  print a ready line and exit
//	fail   write a reason to stderr and exit 1
func fakeDaemonMain(mode, mp string) int {
	switch mode {
	case "ready":
		fmt.Printf("ready pid=%d mode=test mountpoint=%s\n", os.Getpid(), mp)
		return 0
	case "fail":
		fmt.Fprintln(os.Stderr, "lifecycle test: the backing is on fire")
		return 1
	case "ctl", "latectl":
		if mode == "latectl" {
			fmt.Println("up")
			time.Sleep(300 * time.Millisecond)
		}
		s, err := ctl.Listen(ctl.Config{Path: alloc.StatePath(mp, ".sock"), Backend: noSegments{}, Owner: uint32(os.Geteuid()),
			Purge: func() error { fmt.Println("purge asked"); return nil }})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer s.Close()
	case "idle":
	default:
		return 2
	}
	if mode != "latectl" {
		fmt.Println("up")
	}
	io.Copy(io.Discard, os.Stdin)
	return 0
}

// noSegments is a ctl.Backend without segments.
type noSegments struct{}

func (noSegments) Export(ctl.Cred, string, bool) (*os.File, error) { return nil, syscall.ENOENT }
func (noSegments) Import(ctl.Cred, string, *os.File, string, string) error {
	return syscall.EROFS
}

// fakeDaemon is a running fakeDaemonMain.
type fakeDaemon struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	pid   int
}

// startFake starts a fake daemon of mp in mode and waits for it to be up;
// the cleanup stops it.
func startFake(t *testing.T, mode, mp string) *fakeDaemon {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	d := &fakeDaemon{cmd: &exec.Cmd{Path: self, Args: []string{"tensorfs", "mount", mp}}, lines: make(chan string, 16)}
	d.cmd.Env = append(os.Environ(), "LIFECYCLE_TEST_DAEMON="+mode)
	d.cmd.Stderr = os.Stderr
	if d.stdin, err = d.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := d.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d.pid = d.cmd.Process.Pid
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			d.lines <- sc.Text()
		}
		close(d.lines)
	}()
	t.Cleanup(d.stop)
	if line := d.next(t); line != "up" {
		t.Fatalf("fake daemon %s says %q, want up", mode, line)
	}
	return d
}

// next returns the daemon's next line, "" once it has exited.
func (d *fakeDaemon) next(t *testing.T) string {
	t.Helper()
	select {
	case line := <-d.lines:
		return line
	case <-time.After(10 * time.Second):
		t.Fatal("fake daemon: no line within 10s")
		return ""
	}
}

// stop makes the daemon exit and reaps it.
func (d *fakeDaemon) stop() {
	d.stdin.Close()
	d.cmd.Wait()
}

// mountpoint returns a fresh directory to use as a mountpoint; the
// cleanup removes its state and backing.
func mountpoint(t *testing.T) string {
	t.Helper()
	mp := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := alloc.MakeStateDir(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, ext := range []string{".pid", ".sock", ".log"} {
			os.Remove(alloc.StatePath(mp, ext))
		}
		os.RemoveAll(alloc.PrivateBacking(mp))
	})
	return mp
}

// writePid writes mp's pid file naming pid.
func writePid(t *testing.T, mp string, pid int) {
	t.Helper()
	if err := os.WriteFile(alloc.StatePath(mp, ".pid"), []byte(strconv.Itoa(pid)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// exitedPid returns the pid of a process that has exited and been reaped.
func exitedPid(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

// needRoot skips tests that mount.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
}

// mountTmpfs mounts a small tmpfs at dir; the cleanup detaches it.
func mountTmpfs(t *testing.T, dir string) {
	t.Helper()
	needRoot(t)
	if err := unix.Mount("lifecycle-test", dir, "tmpfs", 0, "size=1M"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
}

// TestServing: the live daemon of a mountpoint is the one its pid file
// names, if that process runs "tensorfs mount", or else the one listening
// on its control socket.
func TestServing(t *testing.T) {
	mp := mountpoint(t)
	if pid := serving(mp); pid != 0 {
		t.Fatalf("serving(fresh mountpoint) = %d", pid)
	}
	d := startFake(t, "idle", mp)
	writePid(t, mp, d.pid)
	if pid := serving(mp); pid != d.pid {
		t.Errorf("serving = %d, want the daemon its pid file names, %d", pid, d.pid)
	}
	for what, pid := range map[string]int{"a process that is no daemon": os.Getpid(), "an exited process": exitedPid(t)} {
		writePid(t, mp, pid)
		if got := serving(mp); got != 0 {
			t.Errorf("pid file naming %s (%d): serving = %d, want 0", what, pid, got)
		}
	}
	os.Remove(alloc.StatePath(mp, ".pid"))
	c := startFake(t, "ctl", mp)
	if pid := serving(mp); pid != c.pid {
		t.Errorf("without a pid file: serving = %d, want the control socket's daemon %d", pid, c.pid)
	}
}

// TestIsDaemon: only a process running "tensorfs mount" is a daemon.
func TestIsDaemon(t *testing.T) {
	d := startFake(t, "idle", mountpoint(t))
	for pid, want := range map[int]bool{d.pid: true, os.Getpid(): false, exitedPid(t): false} {
		if got := isDaemon(pid); got != want {
			t.Errorf("isDaemon(%d) = %v, want %v", pid, got, want)
		}
	}
}

// TestWritePidFile: the pid file names this process until removed; one
// that never served (a failed takeover) names its predecessor again.
func TestWritePidFile(t *testing.T) {
	mp := mountpoint(t)
	p := alloc.StatePath(mp, ".pid")
	writePid(t, mp, 1)
	failed, err := writePidFile(mp)
	if err != nil {
		t.Fatal(err)
	}
	failed(false)
	if b, err := os.ReadFile(p); err != nil || string(b) != "1\n" {
		t.Errorf("pid file after a failed takeover holds %q, %v; want the predecessor's", b, err)
	}
	remove, err := writePidFile(mp)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(p); err != nil || string(b) != strconv.Itoa(os.Getpid())+"\n" {
		t.Errorf("pid file holds %q, %v", b, err)
	}
	remove(true)
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pid file after remove: %v", err)
	}
}

// TestPrepare: a missing mountpoint, a file, a mounted directory and one
// that a daemon still serves are refused, each saying what to do; a plain
// directory is ready.
func TestPrepare(t *testing.T) {
	mp := mountpoint(t)
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{mp + "-missing": "mkdir -p", file: "not a directory"} {
		if err := Prepare(path); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Prepare(%s) = %v, want an error saying %q", path, err, want)
		}
	}
	if err := Prepare(mp); err != nil {
		t.Fatalf("Prepare(a plain directory) = %v", err)
	}

	d := startFake(t, "idle", mp)
	writePid(t, mp, d.pid)
	err := Prepare(mp)
	var served *ServedError
	if !errors.As(err, &served) || served.Pid != d.pid || !strings.Contains(err.Error(), fmt.Sprintf("kill %d", d.pid)) {
		t.Errorf("Prepare(served by %d) = %v, want a ServedError naming it", d.pid, err)
	}
	os.Remove(alloc.StatePath(mp, ".pid"))

	mountTmpfs(t, mp)
	if err := Prepare(mp); err == nil || !strings.Contains(err.Error(), "already mounted") {
		t.Errorf("Prepare(mounted) = %v, want already mounted", err)
	}
}

// TestPrepareStale: a FUSE mount whose daemon is gone (ENOTCONN) is
// detached, and the mountpoint is then ready.
func TestPrepareStale(t *testing.T) {
	needRoot(t)
	mp := mountpoint(t)
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no FUSE: %v", err)
	}
	err = unix.Mount("lifecycle-test", mp, "fuse.lifecycle-test", unix.MS_NOSUID|unix.MS_NODEV,
		fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd))
	unix.Close(fd) // the "daemon" dies
	if err != nil {
		t.Skipf("mount fuse: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mp, unix.MNT_DETACH) })
	var sfs unix.Statfs_t
	if err := unix.Statfs(mp, &sfs); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("statfs of the dead mount: %v, want ENOTCONN", err)
	}
	if !mountedAt(mp) {
		t.Fatal("mountedAt(stale mount) = false")
	}
	if err := Prepare(mp); err != nil {
		t.Fatalf("Prepare(stale mount) = %v", err)
	}
	if mountedAt(mp) {
		t.Error("the stale mount is still there")
	}
}

// TestUnmount: nothing to unmount is an error unless purging; an idle
// mount goes at once, one in use is detached and its users counted.
func TestUnmount(t *testing.T) {
	mp := mountpoint(t)
	if _, err := Unmount(mp, false); !errors.Is(err, ErrNotMounted) {
		t.Errorf("Unmount(not mounted) = %v, want ErrNotMounted", err)
	}
	backing := fillBacking(t, mp)
	if res, err := Unmount(mp, true); err != nil || res != (Unmounted{}) {
		t.Errorf("Unmount(not mounted, purge) = %+v, %v", res, err)
	}
	if _, err := os.Stat(backing); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("backing after a purge without daemon: %v", err)
	}

	mountTmpfs(t, mp)
	if res, err := Unmount(mp, false); err != nil || res.Busy || mountedAt(mp) {
		t.Errorf("Unmount(idle tmpfs) = %+v, %v; mounted after: %v", res, err, mountedAt(mp))
	}

	mountTmpfs(t, mp)
	holder := exec.Command("sleep", "60")
	holder.Dir = mp
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { holder.Process.Kill(); holder.Wait() }()
	// No daemon serves on: not Busy.
	if res, err := Unmount(mp, false); err != nil || res != (Unmounted{Held: 1}) || mountedAt(mp) {
		t.Errorf("Unmount(tmpfs a process is in) = %+v, %v; mounted after: %v; want 1 held, detached", res, err, mountedAt(mp))
	}
}

// fillBacking makes mp's private backing with a segment in it and returns
// the segment's path.
func fillBacking(t *testing.T, mp string) string {
	t.Helper()
	dir := alloc.PrivateBacking(mp)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	seg := filepath.Join(dir, "w")
	if err := os.WriteFile(seg, []byte("weights"), 0o600); err != nil {
		t.Fatal(err)
	}
	return seg
}

// TestUnmountPurgeServed: unmount --purge of a mount a daemon still
// serves asks the daemon, over its control socket, to purge when it
// exits, and leaves the backing to it; once the daemon is gone, the next
// unmount --purge purges. Without --purge nothing is asked. A daemon that
// cannot be asked refuses the purge before anything is unmounted.
func TestUnmountPurgeServed(t *testing.T) {
	mp := mountpoint(t)
	seg := fillBacking(t, mp)
	d := startFake(t, "ctl", mp)
	writePid(t, mp, d.pid)

	if res, err := Unmount(mp, false); err != nil || res != (Unmounted{Pid: d.pid, Busy: true}) {
		t.Errorf("Unmount(served) = %+v, %v; want busy, served by %d", res, err, d.pid)
	}
	if res, err := Unmount(mp, true); err != nil || res != (Unmounted{Pid: d.pid, Busy: true}) {
		t.Errorf("Unmount(served, purge) = %+v, %v; want busy, served by %d", res, err, d.pid)
	}
	if line := d.next(t); line != "purge asked" {
		t.Errorf("the daemon heard %q, want one purge request", line)
	}
	if _, err := os.Stat(seg); err != nil {
		t.Errorf("the backing went while its daemon serves: %v", err)
	}
	d.stop()
	if res, err := Unmount(mp, true); err != nil || res != (Unmounted{}) {
		t.Errorf("Unmount(purge) once the daemon is gone = %+v, %v", res, err)
	}
	if _, err := os.Stat(seg); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("backing after the purge: %v", err)
	}

	// A daemon without a control socket cannot be asked: nothing happens.
	needRoot(t)
	idle := startFake(t, "idle", mp)
	writePid(t, mp, idle.pid)
	mountTmpfs(t, mp)
	if _, err := Unmount(mp, true); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("ask daemon %d to purge", idle.pid)) {
		t.Errorf("Unmount(purge) of a daemon without a socket = %v, want a refusal naming it", err)
	}
	if !mountedAt(mp) {
		t.Error("a refused purge unmounted")
	}
}

// TestUnmountPurgeSocketLate: a daemon that serves but listens on its
// control socket a moment after its pid file is written (a crash's
// successor) is asked to purge once it listens, not refused: the
// refusal failed tensorfs unmount --purge run right after a crash.
func TestUnmountPurgeSocketLate(t *testing.T) {
	mp := mountpoint(t)
	fillBacking(t, mp)
	d := startFake(t, "latectl", mp)
	writePid(t, mp, d.pid)
	if res, err := Unmount(mp, true); err != nil || res != (Unmounted{Pid: d.pid, Busy: true}) {
		t.Errorf("Unmount(purge) of a daemon that listens 300 ms late = %+v, %v; want busy, served by %d", res, err, d.pid)
	}
	if line := d.next(t); line != "purge asked" {
		t.Errorf("the daemon heard %q, want one purge request", line)
	}
}

// TestHoldingProcesses: processes with their working directory or an
// open file under the mountpoint count, others do not.
func TestHoldingProcesses(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if n := holdingProcesses(dir); n != 0 {
		t.Fatalf("holdingProcesses(fresh directory) = %d", n)
	}
	in := exec.Command("sleep", "60")
	in.Dir = dir
	open := exec.Command("sh", "-c", "exec 3<f; cd /; exec sleep 60")
	open.Dir = dir
	for _, c := range []*exec.Cmd{in, open} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { c.Process.Kill(); c.Wait() }()
	}
	deadline := time.Now().Add(5 * time.Second)
	n := 0
	for n = holdingProcesses(dir); n != 2 && time.Now().Before(deadline); n = holdingProcesses(dir) {
		time.Sleep(10 * time.Millisecond) // until sh has moved out
	}
	if n != 2 {
		t.Errorf("holdingProcesses = %d, want 2 (a working directory, an open file)", n)
	}
	if n := holdingProcesses(dir + "-other"); n != 0 {
		t.Errorf("holdingProcesses(a sibling with the same prefix) = %d, want 0", n)
	}
}

// TestWaitExit: a live process times out, an exited one (reaped or not)
// returns at once.
func TestWaitExit(t *testing.T) {
	c := exec.Command("sleep", "60")
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	if waitExit(c.Process.Pid, 50*time.Millisecond) {
		t.Error("waitExit(a live process) = true")
	}
	c.Process.Kill()
	if !waitExit(c.Process.Pid, 5*time.Second) {
		t.Error("waitExit(a killed, unreaped process) = false")
	}
	c.Wait()
	if !waitExit(exitedPid(t), time.Second) {
		t.Error("waitExit(a reaped process) = false")
	}
}

// TestStart: Start returns the daemon's ready line and its log; a daemon
// that fails is an error quoting its log.
func TestStart(t *testing.T) {
	mp := mountpoint(t)
	t.Setenv("LIFECYCLE_TEST_DAEMON", "ready")
	ready, logPath, err := Start(mp, []string{"mount", "-f", mp})
	if err != nil || !strings.HasPrefix(ready, "ready pid=") || !strings.HasSuffix(ready, " mode=test mountpoint="+mp) {
		t.Fatalf("Start = %q, %v", ready, err)
	}
	if fi, err := os.Stat(logPath); err != nil || logPath != alloc.StatePath(mp, ".log") || fi.Mode().Perm() != 0o600 {
		t.Errorf("log %s: %v, %v; want mode 0600 at %s", logPath, fi, err, alloc.StatePath(mp, ".log"))
	}
	t.Setenv("LIFECYCLE_TEST_DAEMON", "fail")
	if _, _, err := Start(mp, []string{"mount", "-f", mp}); err == nil ||
		!strings.Contains(err.Error(), "the backing is on fire") || !strings.Contains(err.Error(), logPath) {
		t.Errorf("Start(a failing daemon) = %v, want its log's path and last line", err)
	}
}
