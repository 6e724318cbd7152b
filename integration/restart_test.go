package integration

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

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
			err = os.WriteFile(next, self, 0o755)
		}
		if err == nil {
			err = os.WriteFile(broken, []byte("#!/bin/sh\necho this binary is broken >&2\nexit 1\n"), 0o755)
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

// TestKeeperSurvivesCrash: the daemon is SIGKILLed three times while a
// client keeps its working directory in the mount and a segment open;
// each time the keeper starts a new daemon that takes the connection
// over, and the client's next check (descriptor, directory, new file)
// succeeds. Then the daemon's binary is replaced by one that cannot
// start, and a SIGKILL leaves the mount as a crash does today: the
// keeper exits, its log says why, and unmount cleans up.
func TestKeeperSurvivesCrash(t *testing.T) {
	forEachMode(t, func(t *testing.T, m *mount) {
		c, check := startClient(t, m)
		check("before the crashes")
		dir := t.TempDir()
		bin := filepath.Join(dir, "tensorfs-next")
		self, err := os.ReadFile(tensorfs)
		if err == nil {
			err = os.WriteFile(bin, self, 0o755)
		}
		if err != nil {
			t.Fatal(err)
		}
		m.restart(t, bin)
		for i := 0; i < 3; i++ {
			old := m.daemonPid(t)
			if err := unix.Kill(old, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			check(fmt.Sprintf("after crash %d", i+1))
			if pid := m.daemonPid(t); pid == old {
				t.Fatalf("crash %d: the pid file still names the dead daemon %d", i+1, old)
			}
		}
		stopClient(t, m, c, 4)

		broken := filepath.Join(dir, "broken")
		if err := os.WriteFile(broken, []byte("#!/bin/sh\necho this binary is broken >&2\nexit 1\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(broken, bin); err != nil {
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
