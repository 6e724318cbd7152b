package integration

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAttackRestartUnlinkedOpen: a file a client holds open after its
// last name went is a node the kernel holds that no name reaches, so a
// successor cannot look it up. It used to be unknown to the successor:
// each fstat of it panicked in go-fuse and logged a stack (2.6 KB per
// fstat, a log flood any user could cause by keeping such a file across
// a restart), and the file failed (EIO). Now the predecessor hands its
// backing file over (after a crash, the keeper's journal does) and the
// successor registers it under the same node ID: across a restart, a
// crash and a restart again (the successor hands over what it adopted),
// fstat, read and write through the descriptor work, as uid 65534,
// 100 fstats log nothing, and the last close gives the inode back.
func TestAttackRestartUnlinkedOpen(t *testing.T) {
	t.Parallel()
	const nobody = 65534
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		stickyDir(t, m.path("shared"))
		c := startPythonAs(t, nobody, "holder", `
import os, sys
p = sys.argv[1]
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"hello")
os.unlink(p)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        os.close(fd)
        print("closed", flush=True)
        continue
    try:
        n = 0
        for _ in range(100):
            n += os.fstat(fd).st_size == 5
        os.pwrite(fd, b"H", 0)
        print(n, os.pread(fd, 5, 0).decode(), flush=True)
    except OSError as e:
        print("errno", e.errno, flush=True)
`, m.path("shared/gone"))
		c.expect(t, "ready")
		inodes := func() int64 { return ledgerHeld(t, m, "inodes", nobody) }
		charged := inodes()
		for _, takeover := range []string{"restart", "crash", "restart"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			time.Sleep(1100 * time.Millisecond) // the kernel's attributes expire
			before := len(m.stderr.String())
			got := c.do(t, "check")
			logged := m.stderr.String()[before:]
			if got != "100 Hello" {
				t.Errorf("after a %s, 100 fstats, a write and a read of a file unlinked while open: %q, want every fstat to see its 5 bytes and the bytes written", takeover, got)
			}
			if n := strings.Count(logged, "panic"); n > 0 || len(logged) > 1024 {
				t.Errorf("after a %s, the checks logged %d bytes, %d panics:\n%s", takeover, len(logged), n, tail(logged))
			}
			if n := inodes(); n != charged {
				t.Errorf("after a %s uid %d is charged %d inodes, want the %d before", takeover, nobody, n, charged)
			}
		}
		if got := c.do(t, "close"); got != "closed" {
			t.Fatalf("close: %s", got)
		}
		eventually(t, "the unlinked file's inode is given back at its last close", func() (bool, string) {
			n := inodes()
			return n == charged-1, fmt.Sprintf("uid %d is charged %d inodes, want %d", nobody, n, charged-1)
		})
		c.wait(t)
	}, "--allow-other")
}

// TestAttackRestartRemovedCwd: a directory removed while a process works
// in it is a node the kernel holds that no name reaches, and that no
// handle names. The daemon hands its node ID over (after a crash, the
// keeper's journal does), and its successor answers it ESTALE, quietly,
// across a restart, a crash and a restart again: before, each stat of "."
// panicked in go-fuse and logged a stack (2.6 KB), as uid 65534 could
// repeat at will.
func TestAttackRestartRemovedCwd(t *testing.T) {
	t.Parallel()
	const nobody = 65534
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		stickyDir(t, m.path("shared"))
		c := startPythonAs(t, nobody, "worker", `
import os, sys
os.mkdir(sys.argv[1])
os.chdir(sys.argv[1])
os.rmdir(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    failed = {}
    for _ in range(100):
        try:
            os.stat(".")
        except OSError as e:
            failed[e.errno] = failed.get(e.errno, 0) + 1
    print(failed, flush=True)
`, m.path("shared/d"))
		c.expect(t, "ready")
		for _, takeover := range []string{"restart", "crash", "restart"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			time.Sleep(1100 * time.Millisecond) // the kernel's attributes expire
			before := len(m.stderr.String())
			got := c.do(t, "stat")
			logged := m.stderr.String()[before:]
			if want := fmt.Sprintf("{%d: 100}", int(syscall.ESTALE)); got != want {
				t.Errorf("100 stats of a removed working directory after a %s failed with %s, want %s (ESTALE)", takeover, got, want)
			}
			if len(logged) > 0 {
				t.Errorf("100 stats of a removed working directory after a %s logged %d bytes:\n%s", takeover, len(logged), tail(logged))
			}
		}
		c.wait(t)
	}, "--allow-other")
}
