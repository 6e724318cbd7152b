package integration

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestRestartKeepsClients: a successor takes the live mount over three
// times (tensorfs mount --takeover, what tensorfs restart runs) while a
// client keeps its working directory in the mount and a segment open;
// after each, the client writes and reads through its descriptor, stats
// it, lists its directory and makes a file there with no error, and the
// mount never goes away.
func TestRestartKeepsClients(t *testing.T) {
	forEachMode(t, func(t *testing.T, m *mount) {
		if err := os.MkdirAll(m.path("d"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.path("d/f"), []byte("start"), 0o644); err != nil {
			t.Fatal(err)
		}
		client := startTakeover(t, "client", "", m.dir, nil)
		if l := client.next(t, "the open"); l != "ready" {
			t.Fatalf("client: %s", l)
		}
		round := 0
		check := func(when string) {
			t.Helper()
			io.WriteString(client.stdin, "check\n")
			if l := client.next(t, "a check"); l != "ok" {
				t.Fatalf("client %s: %s", when, l)
			}
			round++
		}
		check("before the restarts")
		for i := 0; i < 3; i++ {
			m = m.takeover(t)
			check(fmt.Sprintf("after restart %d", i+1))
		}
		client.stdin.Close()
		for range client.lines {
		} // the client has exited: its descriptor and directory are let go
		for i := 0; i < round; i++ {
			b, err := os.ReadFile(filepath.Join(m.dir, "d", fmt.Sprintf("new%d", i)))
			if want := fmt.Sprintf("round %d", i); err != nil || string(b) != want {
				t.Fatalf("new%d: %q %v, want %q", i, b, err, want)
			}
		}
		if b, err := os.ReadFile(m.path("d/f")); err != nil || string(b) != fmt.Sprintf("round %d", round-1) {
			t.Fatalf("d/f: %q %v", b, err)
		}
	})
}

// TestRestartCommand: tensorfs restart --binary has a copy of the binary
// take the live mount over (the old daemon exits 0) while a client works
// in it, and bytes and attributes are as they were; a restart with a
// binary that cannot start fails, says why, and leaves the mount served
// by the daemon it had. The handover socket refuses a user.
func TestRestartCommand(t *testing.T) {
	forEachMode(t, func(t *testing.T, m *mount) {
		if err := os.MkdirAll(m.path("d"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.path("d/f"), []byte("start"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(m.path("d/f"), "user.k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
		sock := alloc.StatePath(m.dir, ".handover")
		if out, err := runAs(t, userA, "/", "python3", "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1])", sock); err == nil {
			t.Fatalf("uid %d connected to the handover socket %s\n%s", userA, sock, out)
		}
		client := startTakeover(t, "client", "", m.dir, nil)
		if l := client.next(t, "the open"); l != "ready" {
			t.Fatalf("client: %s", l)
		}
		check := func(when string) {
			t.Helper()
			io.WriteString(client.stdin, "check\n")
			if l := client.next(t, "a check"); l != "ok" {
				t.Fatalf("client %s: %s", when, l)
			}
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
		out := run(t, tensorfs, "restart", "--binary", next, m.dir)
		var pid int
		var mode string
		fmt.Sscanf(out[strings.Index(out, "(")+1:], "ready pid=%d mode=%s", &pid, &mode)
		if pid <= 0 || pid == m.pid || mode != m.mode {
			t.Fatalf("tensorfs restart: %s", out)
		}
		select {
		case <-m.exited:
		case <-time.After(exitTimeout):
			t.Fatalf("the old daemon %d still runs", m.pid)
		}
		if m.exitErr != nil {
			t.Errorf("the old daemon exited with %v", m.exitErr)
		}
		m.finished = true
		t.Cleanup(func() { stopDaemon(t, m.dir, pid) })
		check("after the restart")

		out = runExpectFail(t, tensorfs, "restart", "--binary", broken, m.dir)
		if !strings.Contains(out, "this binary is broken") {
			t.Errorf("a failed restart does not say why: %s", out)
		}
		if !isDaemon(pid) {
			t.Fatalf("the daemon %d is gone after a failed restart", pid)
		}
		check("after a failed restart")
		if b, err := os.ReadFile(m.path("d/f")); err != nil || string(b) != "round 2" {
			t.Errorf("d/f: %q %v", b, err)
		}
		if v, err := getxattr(m.path("d/f"), "user.k"); err != nil || string(v) != "v" {
			t.Errorf("user.k: %q %v", v, err)
		}
		client.stdin.Close()
		for range client.lines {
		}
	})
}

// isDaemon reports whether pid is alive.
func isDaemon(pid int) bool { return unix.Kill(pid, 0) == nil }

// stopDaemon unmounts mp (tensorfs unmount --purge), served by pid, which
// is no child of the test, waits for pid to exit and checks its log.
func stopDaemon(t *testing.T, mp string, pid int) {
	t.Helper()
	if out, err := runTimeout(exitTimeout, tensorfs, "unmount", "--purge", mp); err != nil {
		t.Errorf("tensorfs unmount --purge %s: %v\n%s", mp, err, out)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err == nil {
		n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(exitTimeout.Milliseconds()))
		unix.Close(fd)
		if n != 1 {
			t.Errorf("daemon %d still running after unmount", pid)
			unix.Kill(pid, unix.SIGKILL)
		}
	}
	if isMounted(mp) {
		t.Errorf("%s still mounted", mp)
		lazyUnmount(mp)
	}
	log, _ := os.ReadFile(alloc.StatePath(mp, ".log"))
	for _, bad := range []string{"panic", "DATA RACE"} {
		if strings.Contains(string(log), bad) {
			t.Errorf("the daemon's log contains %q:\n%s", bad, tail(string(log)))
		}
	}
}
