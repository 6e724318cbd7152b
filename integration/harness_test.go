// Package integration tests the real tensorfs binary through real mounts.
//
// TestMain builds ./cmd/tensorfs once; mountFS starts it in the foreground
// on a fresh mountpoint and registers a cleanup that unmounts it and checks
// that nothing leaked: no panic or data race in the daemon, no mount of its
// own left behind, no file descriptor of the test's left on the mount.
// TestMain checks, once for the package, that the test process ends with
// the descriptors it started with and that no mount is left below its
// temporary directory.
//
// The leak checks look only at the test's own mountpoint, backing and
// processes, so tests call t.Parallel, and each gets its own mount and
// temporary directory. A test stays serial (no t.Parallel, with a comment
// saying why) when it depends on process-wide or machine-wide state (the
// umask, the environment, the count of all tensorfs processes) or needs
// the CPUs to itself. Serial tests run first, alone (a serial race whose
// modes each leave a CPU idle runs the two at once); the parallel ones run
// together, up to -parallel at a time (scripts/test.sh sets it: most of
// their time is spent waiting on daemons and python children). Long tests
// run their two modes in parallel too (forEachModeParallel), and a daemon
// that needs a variable in its environment gets it alone (mountFSEnv,
// forEachModeEnv), so that its test need not be serial.
//
// Without root or /dev/fuse, or when the binary cannot be built or mounted,
// the tests skip with the reason; under CI=true (or TENSORFS_STRICT=1, which
// scripts/test.sh sets) they fail instead. TENSORFS_BIN=path runs them
// against a prebuilt binary instead of building ./cmd/tensorfs;
// TENSORFS_DEBUG=1 adds --debug to every mount.
package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/lifecycle"
)

const (
	readyTimeout   = 20 * time.Second // from start to the ready line
	exitTimeout    = 30 * time.Second // from unmount to daemon exit
	commandTimeout = 2 * time.Minute  // any helper command (run, python, unmount)
	statsXattr     = "user.tensorfs.stats"
)

var (
	repoRoot   string // absolute path of the module root
	tmpRoot    string // TMPDIR for this test process; every mountpoint is under it
	tensorfs   string // the built binary
	buildErr   error  // why the binary is not there
	fuseAtBoot map[mountEntry]bool
)

// daemonOwnGC is the environment of a daemon whose memory a test
// measures: GOGC unset, so that it collects at its own target, not at
// the 200 TestMain gives the others.
var daemonOwnGC = []string{"GOGC="}

// strict reports whether an environment problem must fail rather than skip.
func strict() bool {
	return os.Getenv("CI") == "true" || os.Getenv("TENSORFS_STRICT") == "1"
}

// skipOrFail skips the test with the reason, or fails it under strict().
func skipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	if strict() {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	var err error
	repoRoot, err = findRepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		return 1
	}
	tmpRoot, err = os.MkdirTemp("", "tensorfs-integration-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		return 1
	}
	if tmpRoot, err = filepath.EvalSymlinks(tmpRoot); err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		return 1
	}
	// t.TempDir honours TMPDIR, so every mountpoint lands under tmpRoot and
	// a mount leaked by this process can be told from other packages' ones.
	os.Setenv("TMPDIR", tmpRoot)
	// A race-built daemon sleeps a second at exit to flush reports unless
	// told not to; reports are written all the same.
	os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	// A daemon collects at GOGC 50 unless GOGC is set: race-built, with
	// the small heaps of the tests, that took half of its CPU (a third
	// of some tests'). Every daemon but those of the tests that measure
	// its memory (daemonOwnGC) collects at 200.
	if os.Getenv("GOGC") == "" {
		os.Setenv("GOGC", "200")
	}

	// Start the runtime poller now, so its fds are not counted as leaks.
	if r, w, err := os.Pipe(); err == nil {
		r.Close()
		w.Close()
	}
	fdsAtStart := openFDs()

	fuseAtBoot = map[mountEntry]bool{}
	for _, e := range readMountinfo() {
		if isFuse(e) {
			fuseAtBoot[e] = true
		}
	}

	if bin := os.Getenv("TENSORFS_BIN"); bin != "" {
		tensorfs = bin // a prebuilt binary, for debugging the harness
	} else {
		tensorfs, buildErr = buildBinary(filepath.Join(tmpRoot, "tensorfs"))
	}
	if buildErr != nil {
		fmt.Fprintln(os.Stderr, "integration: building tensorfs:", buildErr)
	}

	code := m.Run()

	if leaked := newFDs(fdsAtStart); len(leaked) > 0 {
		fmt.Fprintf(os.Stderr, "integration: the tests left %d fds open: %s\n", len(leaked), strings.Join(leaked, ", "))
		code = 1
	}
	// Any fuse mount of ours still there is a leak: report and detach it.
	for _, e := range readMountinfo() {
		if !isFuse(e) || fuseAtBoot[e] {
			continue
		}
		if e.mountPoint == tmpRoot || strings.HasPrefix(e.mountPoint, tmpRoot+"/") {
			fmt.Fprintf(os.Stderr, "integration: leaked mount %s (%s)\n", e.mountPoint, e.fsType)
			lazyUnmount(e.mountPoint)
			code = 1
		}
	}
	// So is a private backing tmpfs left mounted: its name carries the
	// mountpoint's path, and so the number of tmpRoot.
	tag := "-" + strings.TrimPrefix(filepath.Base(tmpRoot), "tensorfs-integration-") + "-"
	for _, e := range readMountinfo() {
		if e.fsType == "tmpfs" && strings.HasPrefix(e.mountPoint, "/run/tensorfs/backing/") && strings.Contains(e.mountPoint, tag) {
			fmt.Fprintf(os.Stderr, "integration: leaked backing %s\n", e.mountPoint)
			lazyUnmount(e.mountPoint)
			code = 1
		}
	}
	if err := os.RemoveAll(tmpRoot); err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
	}
	return code
}

// findRepoRoot walks up from the working directory to the tensorfs go.mod.
func findRepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(bytes.TrimSpace(data), []byte("module tensorfs")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod of module tensorfs above the working directory")
		}
		dir = parent
	}
}

// raceEnabled reports whether this test binary was built with -race; the
// daemon is then built with -race too, so its races show in its stderr.
func raceEnabled() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" && s.Value == "true" {
			return true
		}
	}
	return false
}

// buildBinary runs go build ./cmd/tensorfs into out.
func buildBinary(out string) (string, error) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	args := []string{"build", "-o", out}
	if raceEnabled() {
		args = append(args, "-race")
	}
	args = append(args, "./cmd/tensorfs")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, gobin, args...)
	cmd.Dir = repoRoot
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return out, nil
}

// lockedBuffer is a bytes.Buffer safe for concurrent Write and String.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// lineWatcher collects the daemon's stdout and hands its first line to ready.
type lineWatcher struct {
	lockedBuffer
	once  sync.Once
	ready chan string
}

func (w *lineWatcher) Write(p []byte) (int, error) {
	n, err := w.lockedBuffer.Write(p)
	if s := w.String(); strings.Contains(s, "\n") {
		w.once.Do(func() { w.ready <- strings.TrimSpace(s[:strings.Index(s, "\n")]) })
	}
	return n, err
}

// mount is one running tensorfs daemon and its mountpoint.
type mount struct {
	dir    string // absolute mountpoint
	mode   string // "passthrough" or "classic", as reported by the daemon
	pid    int
	cmd    *exec.Cmd
	stderr *lockedBuffer

	args     []string      // extra arguments, for remount
	env      []string      // KEY=VALUE added to the daemon's environment, for remount
	stdout   *lineWatcher  // everything the daemon printed on stdout
	exited   chan struct{} // closed once the daemon has exited
	exitErr  error         // cmd.Wait's result, valid after exited
	added    []mountEntry  // this daemon's mounts: its fuse mount, its private backing
	crashed  bool          // killed by kill9: only check that it was cleaned
	finished bool          // cleanup done
}

// mountFS mounts tensorfs in mode ("passthrough" or "classic") on a fresh
// mountpoint under t.TempDir, waits for its ready line and registers the
// unmount-and-check cleanup. extraArgs go before the mountpoint.
func mountFS(t *testing.T, mode string, extraArgs ...string) *mount {
	t.Helper()
	return mountFSEnv(t, mode, nil, extraArgs...)
}

// mountFSEnv is mountFS with env (KEY=VALUE) added to the daemon's
// environment alone, so that a test which needs the daemon (or its GPU
// helper) to see a variable need not change the test process's with
// t.Setenv, and can run in parallel.
func mountFSEnv(t *testing.T, mode string, env []string, extraArgs ...string) *mount {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return startMountEnv(t, dir, mode, extraArgs, env, false)
}

// remount starts a new daemon on the same mountpoint with the same mode and
// arguments (after kill9, or after unmount without purge) and returns it.
// A daemon that does not start fails the test, never skips it: the
// environment was good enough for the first mount.
func (m *mount) remount(t *testing.T) *mount {
	t.Helper()
	return startMountEnv(t, m.dir, m.mode, m.args, m.env, true)
}

// forEachMode runs fn as subtests "passthrough" and "classic", one after
// the other, each on its own fresh mount made with extraArgs.
func forEachMode(t *testing.T, fn func(t *testing.T, m *mount), extraArgs ...string) {
	t.Helper()
	eachMode(t, false, fn, nil, extraArgs)
}

// forEachModeEnv is forEachMode with env (KEY=VALUE) added to each
// daemon's environment alone (mountFSEnv).
func forEachModeEnv(t *testing.T, env []string, fn func(t *testing.T, m *mount), extraArgs ...string) {
	t.Helper()
	eachMode(t, false, fn, env, extraArgs)
}

// forEachModeParallel is forEachMode with the two subtests run in parallel,
// with each other and with the other parallel tests: for long tests, so
// that their modes do not run end to end. It returns before the subtests
// run, so fn must share nothing mutable between the modes and the caller
// must do nothing after it that depends on them.
func forEachModeParallel(t *testing.T, fn func(t *testing.T, m *mount), extraArgs ...string) {
	t.Helper()
	eachMode(t, true, fn, nil, extraArgs)
}

// eachMode runs fn as subtests "passthrough" and "classic", in parallel
// if told to, each on its own fresh mount made with env and extraArgs.
func eachMode(t *testing.T, parallel bool, fn func(t *testing.T, m *mount), env, extraArgs []string) {
	t.Helper()
	for _, mode := range []string{"passthrough", "classic"} {
		t.Run(mode, func(t *testing.T) {
			if parallel {
				t.Parallel()
			}
			fn(t, mountFSEnv(t, mode, env, extraArgs...))
		})
	}
}

func requireEnvironment(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		skipOrFail(t, "tensorfs integration tests need root (uid %d)", os.Geteuid())
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		skipOrFail(t, "no /dev/fuse: %v", err)
	}
	if buildErr != nil {
		skipOrFail(t, "tensorfs binary did not build: %v", buildErr)
	}
}

// startMount starts a daemon on dir; one that does not get ready skips the
// test (fails it under strict(), or when mustStart).
func startMount(t *testing.T, dir, mode string, extraArgs []string, mustStart bool) *mount {
	t.Helper()
	return startMountEnv(t, dir, mode, extraArgs, nil, mustStart)
}

// startMountEnv is startMount with env (KEY=VALUE) added to the daemon's
// environment.
func startMountEnv(t *testing.T, dir, mode string, extraArgs, env []string, mustStart bool) *mount {
	t.Helper()
	requireEnvironment(t)
	notStarted := func(format string, args ...any) {
		t.Helper()
		if mustStart {
			t.Fatalf(format, args...)
		}
		skipOrFail(t, format, args...)
	}
	args := []string{"mount", "-f", "--capacity", "256M"}
	switch mode {
	case "passthrough":
	case "classic":
		args = append(args, "--no-passthrough")
	default:
		t.Fatalf("mountFS: unknown mode %q", mode)
	}
	if os.Getenv("TENSORFS_DEBUG") == "1" {
		args = append(args, "--debug")
	}
	args = append(args, extraArgs...)
	args = append(args, dir)

	m := &mount{
		dir:    dir,
		mode:   mode,
		args:   slices.Clone(extraArgs),
		env:    slices.Clone(env),
		stderr: &lockedBuffer{},
		stdout: &lineWatcher{ready: make(chan string, 1)},
		exited: make(chan struct{}),
	}
	before := mountSet()

	m.cmd = exec.Command(tensorfs, args...)
	if len(env) > 0 {
		m.cmd.Env = append(os.Environ(), env...)
	}
	m.cmd.Stdout = m.stdout
	m.cmd.Stderr = m.stderr
	m.cmd.WaitDelay = 5 * time.Second // a helper holding our pipes cannot hang Wait
	// If the test process dies, the daemon gets SIGTERM and unmounts.
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := m.cmd.Start(); err != nil {
		notStarted("starting %s: %v", tensorfs, err)
	}
	go func() {
		m.exitErr = m.cmd.Wait()
		close(m.exited)
	}()

	timer := time.NewTimer(readyTimeout)
	defer timer.Stop()
	var line string
	select {
	case line = <-m.stdout.ready:
	case <-m.exited:
		m.finished = true
		m.cleanupFailedStart(t)
		notStarted("tensorfs %s exited before ready: %v\nstdout:\n%s\nstderr:\n%s",
			strings.Join(args, " "), m.exitErr, m.stdout.String(), tail(m.stderr.String()))
	case <-timer.C:
		m.cmd.Process.Kill()
		<-m.exited
		m.finished = true
		m.cleanupFailedStart(t)
		notStarted("tensorfs %s: no ready line within %v\nstdout:\n%s\nstderr:\n%s",
			strings.Join(args, " "), readyTimeout, m.stdout.String(), tail(m.stderr.String()))
	}
	t.Cleanup(func() { m.finish(t, true) })

	fields := parseReady(line)
	if fields == nil {
		t.Fatalf("bad ready line %q (want \"ready pid=N mode=M mountpoint=P\")", line)
	}
	// The foreground process is the keeper; the ready line names its
	// daemon.
	m.pid, _ = strconv.Atoi(fields["pid"])
	if m.pid <= 0 || parentOf(m.pid) != m.cmd.Process.Pid {
		t.Errorf("ready line %q: pid is not the keeper's (%d) daemon", line, m.cmd.Process.Pid)
	}
	if fields["mode"] != mode {
		t.Fatalf("asked for %s mode, daemon reports mode=%s (ready line %q)\nstderr:\n%s",
			mode, fields["mode"], line, tail(m.stderr.String()))
	}
	if fields["mountpoint"] != dir {
		t.Errorf("ready line %q: mountpoint is not %s", line, dir)
	}
	if !isMounted(dir) {
		t.Fatalf("ready line printed but %s is not a fuse mount in /proc/self/mountinfo", dir)
	}
	// Attribute to this daemon its fuse mount and the mount holding its
	// backing directory (stats "backing"), if they are new; other mounts
	// appearing meanwhile belong to other tests' daemons.
	backing := ""
	if raw, err := getxattr(dir, statsXattr); err == nil {
		var st map[string]any
		if json.Unmarshal(raw, &st) == nil {
			backing, _ = st["backing"].(string)
		}
	}
	for _, e := range readMountinfo() {
		if before[e] {
			continue
		}
		switch {
		case isFuse(e):
			if e.mountPoint != dir {
				continue
			}
		case backing != "":
			if backing != e.mountPoint && !strings.HasPrefix(backing, e.mountPoint+"/") {
				continue
			}
		}
		m.added = append(m.added, e)
	}
	return m
}

// parseReady splits "ready k=v k=v ..." into a map, or returns nil.
func parseReady(line string) map[string]string {
	f := strings.Fields(line)
	if len(f) < 4 || f[0] != "ready" {
		return nil
	}
	out := map[string]string{}
	for _, kv := range f[1:] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil
		}
		out[k] = v
	}
	for _, k := range []string{"pid", "mode", "mountpoint"} {
		if out[k] == "" {
			return nil
		}
	}
	return out
}

// cleanupFailedStart detaches whatever a daemon that never got ready left.
func (m *mount) cleanupFailedStart(t *testing.T) {
	if isMounted(m.dir) {
		t.Logf("detaching %s left by a failed start", m.dir)
		lazyUnmount(m.dir)
	}
}

// path returns the absolute path of rel inside the mount.
func (m *mount) path(rel string) string {
	return filepath.Join(m.dir, rel)
}

// stats returns the root's user.tensorfs.stats JSON, decoded.
func (m *mount) stats(t *testing.T) map[string]any {
	t.Helper()
	raw, err := getxattr(m.dir, statsXattr)
	if err != nil {
		t.Fatalf("getxattr %s %s: %v", m.dir, statsXattr, err)
	}
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s is not a JSON object: %v\n%s", statsXattr, err, raw)
	}
	return out
}

// requests returns how many FUSE requests of opcode op ("READ", "OPEN"...)
// the daemon has served, from stats()["requests"]; 0 if op never came.
func (m *mount) requests(t *testing.T, op string) int {
	t.Helper()
	st := m.stats(t)
	reqs, ok := st["requests"].(map[string]any)
	if !ok {
		t.Fatalf("%s has no \"requests\" object: %v", statsXattr, st)
	}
	v, ok := reqs[op]
	if !ok {
		return 0
	}
	n, ok := v.(float64)
	if !ok {
		t.Fatalf("%s requests[%q] = %v, not a number", statsXattr, op, v)
	}
	return int(n)
}

// getxattr reads a whole extended attribute, growing the buffer as needed.
func getxattr(path, name string) ([]byte, error) {
	size := 4096
	for {
		buf := make([]byte, size)
		n, err := unix.Getxattr(path, name, buf)
		if err == unix.ERANGE {
			n, err = unix.Getxattr(path, name, nil)
			if err != nil {
				return nil, err
			}
			size = n + 1024
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// writeExecutable writes data to path, mode 0755, through a child (sh):
// a descriptor of the test process's open for writing would be inherited
// by the children other tests fork meanwhile, and an exec of path failed
// with ETXTBSY while one of them had not yet exec'd (Go issue 22315).
func writeExecutable(path string, data []byte) error {
	cmd := exec.Command("/bin/sh", "-c", `cat > "$1" && chmod 755 "$1"`, "sh", path)
	cmd.Stdin = bytes.NewReader(data)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("write %s: %v: %s", path, err, out)
	}
	return nil
}

// logMatch waits for a line of the daemon's log that re matches and
// returns re's submatches of it: the log reaches the test through a pipe
// of its own, maybe after the ready line or a request's reply.
func (m *mount) logMatch(t *testing.T, what string, re *regexp.Regexp) []string {
	t.Helper()
	var sub []string
	eventually(t, what+" in the daemon's log", func() (bool, string) {
		sub = re.FindStringSubmatch(m.stderr.String())
		return sub != nil, tail(m.stderr.String())
	})
	return sub
}

// pidfdExited waits up to d for the process of pidfd to exit and reports
// whether it has (a poll interrupted by a signal, as the Go runtime's
// preemption does, goes on waiting).
func pidfdExited(pidfd int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}, int(time.Until(deadline).Milliseconds()))
		if err != unix.EINTR || time.Until(deadline) <= 0 {
			return err == nil && n > 0
		}
	}
}

// kill9 SIGKILLs the daemon and waits for it. The mount is then stale; its
// cleanup only checks that a remount or unmount cleaned it up, detaching it
// with fusermount3 -u -z / umount -l if not.
func (m *mount) kill9(t *testing.T) {
	t.Helper()
	m.crashed = true
	if err := m.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", m.cmd.Process.Pid, err)
	}
	select {
	case <-m.exited:
	case <-time.After(exitTimeout):
		t.Fatalf("keeper %d did not die of SIGKILL within %v", m.cmd.Process.Pid, exitTimeout)
	}
	// Its daemon dies with it (a SIGKILL from the kernel).
	if fd, err := unix.PidfdOpen(m.pid, 0); err == nil {
		exited := pidfdExited(fd, exitTimeout)
		unix.Close(fd)
		if !exited {
			t.Fatalf("daemon %d did not die with its keeper within %v", m.pid, exitTimeout)
		}
	}
}

// parentOf returns pid's parent, 0 if unknown.
func parentOf(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// unmount unmounts now (tensorfs unmount [--purge]) and runs every leak
// check; the cleanup then does nothing more for this mount.
func (m *mount) unmount(t *testing.T, purge bool) {
	t.Helper()
	m.finish(t, purge)
}

// finish tears the mount down and runs the leak checks, once.
func (m *mount) finish(t *testing.T, purge bool) {
	t.Helper()
	if m.finished {
		return
	}
	m.finished = true
	defer func() {
		if t.Failed() {
			t.Logf("daemon %s (pid %d) stderr:\n%s", m.dir, m.pid, tail(m.stderr.String()))
		}
	}()
	if m.crashed {
		m.finishCrashed(t)
		m.checkOutput(t)
		return
	}

	if leaked := fdsUnder(m.dir); len(leaked) > 0 {
		t.Errorf("test still holds fds on %s at unmount: %s", m.dir, strings.Join(leaked, ", "))
	}
	m.checkLedger(t)

	wait := exitTimeout
	var st syscall.Stat_t
	syscall.Stat(m.dir, &st) // the connection's device, for holdersOn
	fuseID := 0
	for _, e := range m.added {
		if isFuse(e) {
			fuseID = e.id
		}
	}
	if err := unmountNow(m.dir, purge); err != nil {
		t.Errorf("%v", err)
		m.cmd.Process.Signal(syscall.SIGTERM)
		wait = 5 * time.Second // already failed: give SIGTERM a moment only
	}
	select {
	case <-m.exited:
	case <-time.After(wait):
		holders := holdersOn(fuseID, st.Dev)
		t.Errorf("daemon %d still running %v after unmount; files on the mount held by: %s; its goroutines follow (SIGQUIT)",
			m.pid, wait, strings.Join(holders, ", "))
		if self := strconv.Itoa(os.Getpid()) + " "; slices.ContainsFunc(holders, func(h string) bool { return strings.HasPrefix(h, self) }) {
			buf := make([]byte, 4<<20)
			t.Logf("this test process holds it; its goroutines:\n%s", buf[:runtime.Stack(buf, true)])
		}
		m.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-m.exited:
		case <-time.After(5 * time.Second):
			m.cmd.Process.Kill()
			<-m.exited
		}
	}
	if m.exitErr != nil {
		t.Errorf("daemon exited with %v, want exit 0", m.exitErr)
	}
	m.checkOutput(t)

	if isMounted(m.dir) {
		t.Errorf("%s still mounted after unmount", m.dir)
		lazyUnmount(m.dir)
	}
	if purge {
		m.checkAddedGone(t)
	}
}

// unmountNow unmounts dir as tensorfs unmount [--purge] does, by the same
// function, in this process: the command itself has tests of its own, and
// a race-built process for each mount's teardown cost the suite 13
// CPU-seconds. A busy mount is no error, as for the command: the wait for
// the daemon's exit that follows names what holds it.
func unmountNow(dir string, purge bool) error {
	done := make(chan error, 1)
	go func() {
		_, err := lifecycle.Unmount(dir, purge)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("unmount (purge %v) %s: %w", purge, dir, err)
		}
		return nil
	case <-time.After(exitTimeout):
		return fmt.Errorf("unmount (purge %v) %s: no answer in %v", purge, dir, exitTimeout)
	}
}

// finishCrashed makes sure a killed daemon's mounts are gone: a remount's
// cleanup or tensorfs unmount --purge must have removed them.
func (m *mount) finishCrashed(t *testing.T) {
	t.Helper()
	if isMounted(m.dir) || m.addedPresent() {
		if out, err := runTimeout(exitTimeout, tensorfs, "unmount", "--purge", m.dir); err != nil {
			t.Errorf("tensorfs unmount --purge %s after kill -9: %v\n%s", m.dir, err, out)
		}
	}
	if isMounted(m.dir) {
		t.Errorf("stale mount %s survived tensorfs unmount --purge", m.dir)
		lazyUnmount(m.dir)
	}
	m.checkAddedGone(t)
	for _, ext := range []string{".pid", ".sock", ".handover", ".keeper"} {
		p := alloc.StatePath(m.dir, ext)
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s survived tensorfs unmount --purge after a crash", p)
		}
	}
}

// checkLedger fails for every row of the daemon's ledger that was given
// back more than it held (drift: a charge given back twice), the one
// invariant every test checks of the ledger. A mount whose statistics
// cannot be read (the test broke it) is not checked.
func (m *mount) checkLedger(t *testing.T) {
	t.Helper()
	raw, err := getxattr(m.dir, statsXattr)
	if err != nil {
		return
	}
	var stats struct {
		Ledger []struct {
			Name  string `json:"name"`
			Drift int64  `json:"drift"`
		} `json:"ledger"`
	}
	if json.Unmarshal(raw, &stats) != nil {
		return
	}
	for _, r := range stats.Ledger {
		if r.Drift != 0 {
			t.Errorf("the ledger's row %q was given back %d more than it held", r.Name, r.Drift)
		}
	}
}

// checkOutput fails on panics and data races in what the daemon printed.
func (m *mount) checkOutput(t *testing.T) {
	t.Helper()
	out := m.stderr.String() + m.stdout.String()
	for _, bad := range []string{"panic", "DATA RACE"} {
		if strings.Contains(out, bad) {
			t.Errorf("daemon output contains %q:\n%s", bad, tail(out))
		}
	}
}

// addedPresent reports whether any mount the daemon made is still there.
func (m *mount) addedPresent() bool {
	ids := mountSet()
	for _, e := range m.added {
		if ids[e] {
			return true
		}
	}
	return false
}

// checkAddedGone fails for, and detaches, every mount that appeared with
// this daemon (its fuse mount, its private tmpfs) and is still there.
func (m *mount) checkAddedGone(t *testing.T) {
	t.Helper()
	ids := mountSet()
	for _, e := range m.added {
		if ids[e] {
			t.Errorf("mount %s (%s %s) made by the daemon is still there after unmount --purge",
				e.mountPoint, e.fsType, e.source)
			lazyUnmount(e.mountPoint)
		}
	}
}

// run runs a real tool and returns its combined output, failing the test
// (with that output) if it does not exit 0.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := runTimeout(commandTimeout, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// runExpectFail runs a real tool that must fail and returns its combined
// output; a zero exit fails the test.
func runExpectFail(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := runTimeout(commandTimeout, name, args...)
	var exitErr *exec.ExitError
	if err == nil {
		t.Fatalf("%s %s succeeded, want failure\n%s", name, strings.Join(args, " "), out)
	} else if !errors.As(err, &exitErr) {
		t.Fatalf("%s %s did not run: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func runTimeout(d time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second
	b, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("%w (timed out after %v)", err, d)
	}
	return string(b), err
}

const systemPython = "/usr/bin/python3"

var (
	numpyOnce sync.Once
	numpyErr  error
)

// python runs /usr/bin/python3 -c script args... and returns its stdout,
// failing with stdout and stderr if it exits non-zero. Without numpy it
// skips (fails under CI).
func python(t *testing.T, script string, args ...string) string {
	t.Helper()
	numpyOnce.Do(func() {
		var out string
		out, numpyErr = runTimeout(commandTimeout, systemPython, "-c", "import numpy")
		if numpyErr != nil {
			numpyErr = fmt.Errorf("%s cannot import numpy: %v %s", systemPython, numpyErr, out)
		}
	})
	if numpyErr != nil {
		skipOrFail(t, "%v (apt-get install python3-numpy)", numpyErr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, systemPython, append([]string{"-c", script}, args...)...)
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("python: %v\nscript:\n%s\nstdout:\n%s\nstderr:\n%s", err, script, stdout.String(), stderr.String())
	}
	return stdout.String()
}

// mountEntry is one line of /proc/self/mountinfo.
type mountEntry struct {
	id         int
	mountPoint string
	options    string // the mount's own options: rw,nosuid,nodev,...
	fsType     string
	source     string
}

func isFuse(e mountEntry) bool {
	return e.fsType == "fuse" || strings.HasPrefix(e.fsType, "fuse.")
}

func readMountinfo() []mountEntry {
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil
	}
	out := make([]mountEntry, 0, len(mounts))
	for _, m := range mounts {
		out = append(out, mountEntry{id: m.ID, mountPoint: m.Mountpoint, options: m.Options, fsType: m.FSType, source: m.Source})
	}
	return out
}

// mountSet returns the current mounts. Entries are compared whole, as the
// kernel reuses mount ids as soon as they are free.
func mountSet() map[mountEntry]bool {
	set := map[mountEntry]bool{}
	for _, e := range readMountinfo() {
		set[e] = true
	}
	return set
}

// isMounted reports whether dir is a fuse mountpoint.
func isMounted(dir string) bool {
	for _, e := range readMountinfo() {
		if e.mountPoint == dir && isFuse(e) {
			return true
		}
	}
	return false
}

// lazyUnmount detaches dir with fusermount3 -u -z, else umount -l, else
// umount2(MNT_DETACH).
func lazyUnmount(dir string) {
	if _, err := runTimeout(exitTimeout, "fusermount3", "-u", "-z", dir); err == nil {
		return
	}
	if _, err := runTimeout(exitTimeout, "umount", "-l", dir); err == nil {
		return
	}
	unix.Unmount(dir, unix.MNT_DETACH)
}

// openFDs maps this process's open fds to what they point at.
func openFDs() map[string]string {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil
	}
	out := map[string]string{}
	for _, e := range ents {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the fd ReadDir itself used, closed by now
		}
		out[e.Name()] = target
	}
	return out
}

// newFDs lists this process's fds that were not open, or pointed
// elsewhere, in before.
func newFDs(before map[string]string) []string {
	var out []string
	for fd, target := range openFDs() {
		if before[fd] != target {
			out = append(out, fd+"->"+target)
		}
	}
	slices.Sort(out)
	return out
}

// fdsUnder lists this process's fds that point inside dir.
func fdsUnder(dir string) []string {
	var out []string
	for fd, target := range openFDs() {
		if target == dir || strings.HasPrefix(target, dir+"/") {
			out = append(out, fd+"->"+target)
		}
	}
	slices.Sort(out)
	return out
}

// holdersOn lists the processes with files open or mapped on the mount
// whose id is mnt and device dev, as "PID COMM fd N" or "PID COMM maps"
// (a detached mount's files no longer show its path; fdinfo and maps are
// read without a request to any FUSE daemon, which may hang).
func holdersOn(mnt int, dev uint64) []string {
	var out []string
	mntLine := fmt.Sprintf("mnt_id:\t%d\n", mnt)
	devField := fmt.Sprintf(" %02x:%02x ", unix.Major(dev), unix.Minor(dev))
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil {
			continue
		}
		dir := "/proc/" + p.Name()
		comm, _ := os.ReadFile(dir + "/comm")
		who := p.Name() + " " + strings.TrimSpace(string(comm))
		fds, _ := os.ReadDir(dir + "/fdinfo")
		for _, fd := range fds {
			if b, _ := os.ReadFile(dir + "/fdinfo/" + fd.Name()); strings.Contains(string(b), mntLine) {
				target, _ := os.Readlink(dir + "/fd/" + fd.Name())
				out = append(out, who+" fd "+fd.Name()+" ("+target+")")
			}
		}
		if b, _ := os.ReadFile(dir + "/maps"); strings.Contains(string(b), devField) {
			out = append(out, who+" maps")
		}
	}
	if len(out) == 0 {
		return []string{"none"}
	}
	return out
}

// tail keeps the last 64 KiB of s.
func tail(s string) string {
	const max = 64 << 10
	if len(s) > max {
		return "...\n" + s[len(s)-max:]
	}
	return s
}

// TestMountSmoke proves the harness: dd in, cp and cmp out, df, ls, stats.
func TestMountSmoke(t *testing.T) {
	t.Parallel()
	src := filepath.Join(t.TempDir(), "src.bin")
	run(t, "dd", "if=/dev/urandom", "of="+src, "bs=1M", "count=4", "status=none")

	forEachMode(t, func(t *testing.T, m *mount) {
		dst := m.path("smoke.bin")
		run(t, "dd", "if="+src, "of="+dst, "bs=64k", "conv=fsync", "status=none")

		back := filepath.Join(t.TempDir(), "back.bin")
		run(t, "cp", dst, back)
		run(t, "cmp", src, back)
		run(t, "cmp", src, dst)

		if fi, err := os.Stat(dst); err != nil || fi.Size() != 4<<20 {
			t.Fatalf("stat %s: %v %v, want 4 MiB", dst, fi, err)
		}
		if out := run(t, "df", "-P", m.dir); !strings.Contains(out, m.dir) {
			t.Errorf("df -P %s does not show the mount:\n%s", m.dir, out)
		}
		if out := run(t, "ls", m.dir); strings.TrimSpace(out) != "smoke.bin" {
			t.Errorf("ls %s = %q, want smoke.bin", m.dir, out)
		}

		if got := m.stats(t)["mode"]; got != m.mode {
			t.Errorf("stats mode = %v, want %s", got, m.mode)
		}
		if n := m.requests(t, "OPEN"); n == 0 {
			t.Errorf("stats counted no OPEN requests")
		}
		reads, writes := m.requests(t, "READ"), m.requests(t, "WRITE")
		switch m.mode {
		case "passthrough":
			// The kernel carries the data: no read or write reaches the daemon.
			if reads != 0 || writes != 0 {
				t.Errorf("passthrough: daemon served %d READ and %d WRITE requests, want 0", reads, writes)
			}
		case "classic":
			if writes == 0 {
				t.Errorf("classic: daemon served no WRITE requests")
			}
		}
	})
}

// restart has a new daemon take the live mount over (tensorfs restart
// [--binary binary]) and returns its pid, once the old daemon, whose pid
// the pid file named, has exited; the keeper (m.pid) stays.
func (m *mount) restart(t *testing.T, binary string) int {
	t.Helper()
	old := m.daemonPid(t)
	args := []string{"restart", m.dir}
	if binary != "" {
		args = []string{"restart", "--binary", binary, m.dir}
	}
	out := run(t, tensorfs, args...)
	var pid int
	var mode string
	fmt.Sscanf(out[strings.Index(out, "(")+1:], "ready pid=%d mode=%s", &pid, &mode)
	if pid <= 0 || pid == old || mode != m.mode || pid != m.daemonPid(t) {
		t.Fatalf("tensorfs %s: %s", strings.Join(args, " "), out)
	}
	if unix.Kill(old, 0) == nil {
		t.Fatalf("the old daemon %d runs on after the restart", old)
	}
	m.pid = pid
	return pid
}

// daemonPid is the pid of the daemon that the keeper m runs, as its pid
// file names it.
func (m *mount) daemonPid(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile(alloc.StatePath(m.dir, ".pid"))
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		t.Fatalf("the pid file of %s: %q %v", m.dir, b, err)
	}
	return pid
}
