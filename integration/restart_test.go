package integration

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// startClient starts the takeover client (takeoverMain) in m/d, where it
// keeps its working directory and d/f open, and returns it with its
// check: the client writes "round N" to f through its descriptor, reads
// it back, stats it, lists its directory and makes newN there, and the
// check fails the test on any error.
func startClient(t *testing.T, m *mount) (c *lineChild, check func(when string)) {
	t.Helper()
	if err := os.MkdirAll(m.path("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.path("d/f"), []byte("start"), 0o644); err != nil {
		t.Fatal(err)
	}
	c = startTakeover(t, "client", "", m.dir, nil)
	if l := c.next(t, "the open"); l != "ready" {
		t.Fatalf("client: %s", l)
	}
	return c, func(when string) {
		t.Helper()
		io.WriteString(c.stdin, "check\n")
		if l := c.next(t, "a check"); l != "ok" {
			t.Fatalf("client %s: %s", when, l)
		}
	}
}

// stopClient ends the client and checks what its rounds left: newN
// holding "round N" for each, and f the last round's.
func stopClient(t *testing.T, m *mount, c *lineChild, rounds int) {
	t.Helper()
	c.stdin.Close()
	for range c.lines {
	} // it exited: its descriptor and directory are let go
	for i := 0; i < rounds; i++ {
		b, err := os.ReadFile(filepath.Join(m.dir, "d", fmt.Sprintf("new%d", i)))
		if want := fmt.Sprintf("round %d", i); err != nil || string(b) != want {
			t.Errorf("new%d: %q %v, want %q", i, b, err, want)
		}
	}
	if b, err := os.ReadFile(m.path("d/f")); err != nil || string(b) != fmt.Sprintf("round %d", rounds-1) {
		t.Errorf("d/f: %q %v", b, err)
	}
}

// TestRestartKeepsClients: tensorfs restart three times while a client
// keeps its working directory in the mount and a segment open; after
// each, the client writes and reads through its descriptor, stats it,
// lists its directory and makes a file there with no error.
func TestRestartKeepsClients(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, check := startClient(t, m)
		check("before the restarts")
		for i := 0; i < 3; i++ {
			m.restart(t, "")
			check(fmt.Sprintf("after restart %d", i+1))
		}
		stopClient(t, m, c, 4)
	})
}

// TestRestartCommand: tensorfs restart --binary has a copy of the binary
// take the live mount over while a client works in it, and bytes and
// attributes are as they were; a restart with a binary that cannot start
// fails, says why, and leaves the mount served by the daemon it had. The
// keeper's and the daemon's handover sockets refuse a user.
func TestRestartCommand(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		for _, ext := range []string{".handover", ".keeper"} {
			sock := alloc.StatePath(m.dir, ext)
			if out, err := runAs(t, userA, "/", "python3", "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1])", sock); err == nil {
				t.Fatalf("uid %d connected to %s\n%s", userA, sock, out)
			}
		}
		c, check := startClient(t, m)
		if err := unix.Setxattr(m.path("d/f"), "user.k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
		check("before the restart")
		dir := t.TempDir()
		next, broken := filepath.Join(dir, "tensorfs-next"), filepath.Join(dir, "tensorfs-broken")
		self, err := os.ReadFile(tensorfs)
		if err == nil {
			err = writeExecutable(next, self)
		}
		if err == nil {
			err = writeExecutable(broken, []byte("#!/bin/sh\necho this binary is broken >&2\nexit 1\n"))
		}
		if err != nil {
			t.Fatal(err)
		}
		pid := m.restart(t, next)
		check("after the restart")
		out := runExpectFail(t, tensorfs, "restart", "--binary", broken, m.dir)
		if !strings.Contains(out, "this binary is broken") {
			t.Errorf("a failed restart does not say why: %s", out)
		}
		if m.daemonPid(t) != pid || unix.Kill(pid, 0) != nil {
			t.Fatalf("the daemon %d no longer serves after a failed restart", pid)
		}
		check("after a failed restart")
		if v, err := getxattr(m.path("d/f"), "user.k"); err != nil || string(v) != "v" {
			t.Errorf("user.k: %q %v", v, err)
		}
		stopClient(t, m, c, 3)
	})
}

// TestKeeperSurvivesCrash: the daemon, run through a wrapper script given
// to tensorfs restart --binary, is SIGKILLed three times while a client
// keeps its working directory in the mount and a segment open; each time
// the keeper starts a new daemon that takes the connection over, and the
// client's next check (descriptor, directory, new file) succeeds. Then
// the wrapper's path is given another file: the keeper runs the binary
// it checked (held open), so a SIGKILL brings back a daemon all the same
// and the new file never runs. Then the wrapper fails: a SIGKILL leaves
// the mount as a crash does today: the keeper exits, its log says why,
// and unmount cleans up.
func TestKeeperSurvivesCrash(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, check := startClient(t, m)
		check("before the crashes")
		dir := t.TempDir()
		bin, fail, ran := filepath.Join(dir, "tensorfs-wrap"), filepath.Join(dir, "fail"), filepath.Join(dir, "ran")
		wrapper := fmt.Sprintf("#!/bin/sh\nif [ -e %s ]; then echo this binary is broken >&2; exit 1; fi\nexec %s \"$@\"\n", fail, tensorfs)
		if err := writeExecutable(bin, []byte(wrapper)); err != nil {
			t.Fatal(err)
		}
		m.restart(t, bin)
		crash := func(when string) {
			t.Helper()
			old := m.daemonPid(t)
			if err := unix.Kill(old, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			check(when)
			if pid := m.daemonPid(t); pid == old {
				t.Fatalf("%s: the pid file still names the dead daemon %d", when, old)
			}
		}
		for i := 0; i < 3; i++ {
			crash(fmt.Sprintf("after crash %d", i+1))
		}

		other := filepath.Join(dir, "other")
		err := writeExecutable(other, []byte("#!/bin/sh\ntouch "+ran+"\necho the replaced binary ran >&2\nexit 1\n"))
		if err == nil {
			err = os.Rename(other, bin)
		}
		if err != nil {
			t.Fatal(err)
		}
		crash("after a crash with the binary's path replaced")
		if _, err := os.Stat(ran); err == nil || strings.Contains(m.stderr.String(), "the replaced binary ran") {
			t.Errorf("the keeper ran what replaced the binary it checked:\n%s", tail(m.stderr.String()))
		}
		stopClient(t, m, c, 5)

		if err := os.WriteFile(fail, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		m.crashed = true
		unix.Kill(m.daemonPid(t), unix.SIGKILL)
		<-m.exited
		if _, err := getxattr(m.dir, statsXattr); !errors.Is(err, syscall.ENOTCONN) {
			t.Errorf("the mount after a crash with a broken binary: %v, want ENOTCONN", err)
		}
		if log := m.stderr.String(); !strings.Contains(log, "this binary is broken") || !strings.Contains(log, "no daemon serves the mount any more") {
			t.Errorf("the keeper's log does not say why the mount is gone:\n%s", tail(log))
		}
	})
}

// stressEnv runs the test binary as TestRestartUnderLoad's clients, in
// the directory it names.
const stressEnv = "TENSORFS_TEST_STRESS"

func init() {
	if dir := os.Getenv(stressEnv); dir != "" {
		os.Exit(stressMain(dir))
	}
}

// stressOp is one client operation that took longer than a millisecond:
// when it started and how long it took, in nanoseconds.
type stressOp struct {
	Start, Dur int64
}

// stressReport is what the clients print when stdin ends.
type stressReport struct {
	Ops    map[string]int `json:"ops"`
	Errors []string       `json:"errors"`
	Slow   []stressOp     `json:"slow"`
	Files  int            `json:"files"`
}

// stressMain runs five clients in dir until stdin ends, then prints a
// stressReport: a writer makes w-N (N's bytes, user.n = N), a holder
// writes and reads back h through one descriptor, a mapper writes and
// reads m through one shared mapping, a lister lists dir, a reader reads
// x's user.k. Every error counts; none may happen.
func stressMain(dir string) int {
	var mu sync.Mutex
	rep := stressReport{Ops: map[string]int{}}
	stop := make(chan struct{})
	op := func(name string, fn func() error) {
		t0 := time.Now()
		err := fn()
		d := time.Since(t0)
		mu.Lock()
		defer mu.Unlock()
		rep.Ops[name]++
		if err != nil && len(rep.Errors) < 20 {
			rep.Errors = append(rep.Errors, fmt.Sprintf("%s: %v", name, err))
		}
		if d > time.Millisecond {
			rep.Slow = append(rep.Slow, stressOp{t0.UnixNano(), int64(d)})
		}
	}
	h, err := os.OpenFile(filepath.Join(dir, "h"), os.O_RDWR, 0)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	mf, err := os.OpenFile(filepath.Join(dir, "m"), os.O_RDWR, 0)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	mapping, err := unix.Mmap(int(mf.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	clients := map[string]func(i int) error{
		"write": func(i int) error {
			p := filepath.Join(dir, fmt.Sprintf("w-%d", i))
			if err := os.WriteFile(p, []byte(strconv.Itoa(i)), 0o644); err != nil {
				return err
			}
			mu.Lock()
			rep.Files = i + 1
			mu.Unlock()
			return unix.Setxattr(p, "user.n", []byte(strconv.Itoa(i)), 0)
		},
		"pwrite": func(i int) error {
			b := []byte(fmt.Sprintf("%08d", i))
			if _, err := h.WriteAt(b, int64(i%64)*8); err != nil {
				return err
			}
			got := make([]byte, 8)
			if _, err := h.ReadAt(got, int64(i%64)*8); err != nil || string(got) != string(b) {
				return fmt.Errorf("read back %q: %v", got, err)
			}
			return nil
		},
		"mmap": func(i int) error {
			b := []byte(fmt.Sprintf("%08d", i))
			copy(mapping[(i%64)*8:], b)
			if string(mapping[(i%64)*8:(i%64)*8+8]) != string(b) {
				return fmt.Errorf("the mapping does not hold what was written")
			}
			return unix.Msync(mapping, unix.MS_SYNC)
		},
		"readdir": func(int) error { _, err := os.ReadDir(dir); return err },
		"getxattr": func(int) error {
			b := make([]byte, 16)
			n, err := unix.Getxattr(filepath.Join(dir, "x"), "user.k", b)
			if err == nil && string(b[:n]) != "v" {
				err = fmt.Errorf("user.k is %q", b[:n])
			}
			return err
		},
	}
	var wg sync.WaitGroup
	for name, fn := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				op(name, func() error { return fn(i) })
				// Paced, so that clients whose operations never reach
				// the daemon (passthrough) do not take its CPUs.
				time.Sleep(100 * time.Microsecond)
			}
		}()
	}
	fmt.Println("running")
	io.Copy(io.Discard, os.Stdin)
	close(stop)
	wg.Wait()
	b, _ := json.Marshal(rep)
	fmt.Println(string(b))
	return 0
}

// stressEvents is how many restarts and SIGKILLs TestRestartUnderLoad
// makes in each mode: TENSORFS_RESTARTS (the 20), else 3.
func stressEvents() int {
	if n, err := strconv.Atoi(os.Getenv("TENSORFS_RESTARTS")); err == nil && n > 0 {
		return n
	}
	return 3
}

// TestRestartUnderLoad: five clients (new files with an attribute,
// pwrite and pread through a descriptor, writes through a shared
// mapping, directory listings, getxattr) work while the daemon is
// restarted (tensorfs restart) and SIGKILLed, alternately, N times each.
// No client sees an error; every file and attribute is there at the
// end; the longest pause a client saw around each restart and each
// SIGKILL is logged (median and worst).
func TestRestartUnderLoad(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("load")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for name, size := range map[string]int{"h": 512, "m": 4096, "x": 0} {
			if err := os.WriteFile(filepath.Join(dir, name), make([]byte, size), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := unix.Setxattr(filepath.Join(dir, "x"), "user.k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
		self, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		c := &lineChild{cmd: exec.Command(self), lines: make(chan string, 64), out: &lockedBuffer{}}
		c.cmd.Env = []string{stressEnv + "=" + dir}
		c.cmd.Stderr = c.out
		if c.stdin, err = c.cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		stdout, err := c.cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.cmd.Process.Kill(); c.cmd.Wait() })
		go func() {
			sc := bufio.NewScanner(stdout)
			sc.Buffer(nil, 16<<20)
			for sc.Scan() {
				c.lines <- sc.Text()
			}
			close(c.lines)
		}()
		if l := c.next(t, "the start"); l != "running" {
			t.Fatalf("clients: %s", l)
		}
		type event struct {
			kind       string
			start, end int64
		}
		var events []event
		settle := func() { time.Sleep(50 * time.Millisecond) } // the clients run between events
		n := stressEvents()
		for i := 0; i < n; i++ {
			settle()
			t0 := time.Now().UnixNano()
			m.restart(t, "")
			events = append(events, event{"restart", t0, time.Now().UnixNano()})
			settle()
			old := m.daemonPid(t)
			t0 = time.Now().UnixNano()
			if err := unix.Kill(old, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			events = append(events, event{"sigkill", t0, t0})
			eventually(t, "a new daemon after SIGKILL", func() (bool, string) {
				_, err := getxattr(m.dir, statsXattr)
				b, _ := os.ReadFile(alloc.StatePath(m.dir, ".pid"))
				return err == nil && strings.TrimSpace(string(b)) != strconv.Itoa(old), fmt.Sprint(err)
			})
		}
		settle()
		c.stdin.Close()
		var rep stressReport
		if l := c.next(t, "the report"); json.Unmarshal([]byte(l), &rep) != nil {
			t.Fatalf("clients: %s", l)
		}
		if len(rep.Errors) > 0 {
			t.Errorf("the clients saw errors: %s", strings.Join(rep.Errors, "; "))
		}
		for name, count := range rep.Ops {
			if count < 2*n {
				t.Errorf("the %s client ran %d times only", name, count)
			}
		}
		for i := 0; i < rep.Files; i++ {
			p := filepath.Join(dir, fmt.Sprintf("w-%d", i))
			b, err := os.ReadFile(p)
			v, xerr := getxattr(p, "user.n")
			if err != nil || string(b) != strconv.Itoa(i) || xerr != nil || string(v) != strconv.Itoa(i) {
				t.Errorf("%s: %q %v, user.n %q %v", p, b, err, v, xerr)
			}
		}
		pauses := map[string][]time.Duration{}
		for _, e := range events {
			var worst time.Duration
			for _, o := range rep.Slow {
				if o.Start <= e.end && o.Start+o.Dur >= e.start {
					worst = max(worst, time.Duration(o.Dur))
				}
			}
			pauses[e.kind] = append(pauses[e.kind], worst)
		}
		for kind, p := range pauses {
			slices.Sort(p)
			t.Logf("%s mode, %d %ss: the longest pause a client saw: median %v, worst %v (ops: %v)", m.mode, len(p), kind, p[len(p)/2], p[len(p)-1], rep.Ops)
		}
	})
}
