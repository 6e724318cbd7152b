package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// handlesScript holds descriptors of segments and answers one line per
// command on stdin: "flood P" opens P read-only until the daemon refuses
// ("errno E N": N held), "open P" opens it once more ("ok" or "errno E"),
// "create P" makes P and writes a line to it,
// "map P" maps the last descriptor of P, "unmap P" and "close P" let P's
// mapping and descriptors go, "ok" each.
const handlesScript = `
import mmap, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds, maps = {}, {}
for line in sys.stdin:
    cmd, p = line.split()
    try:
        if cmd == "flood":
            while len(fds.setdefault(p, [])) < hard - 64:
                fds[p].append(os.open(p, os.O_RDONLY))
            print("no limit after", len(fds[p]), flush=True)
            continue
        if cmd == "open":
            fds.setdefault(p, []).append(os.open(p, os.O_RDWR if os.access(p, os.W_OK) else os.O_RDONLY))
        elif cmd == "create":
            fds.setdefault(p, []).append(os.open(p, os.O_RDWR | os.O_CREAT, 0o644))
            os.write(fds[p][-1], b"unlink me\n")
        elif cmd == "map":
            maps[p] = mmap.mmap(fds[p][-1], 0)
        elif cmd == "unmap":
            maps.pop(p).close()
        elif cmd == "close":
            for fd in fds.pop(p):
                os.close(fd)
        print("ok", flush=True)
    except OSError as e:
        print("errno", e.errno, len(fds.get(p, [])), flush=True)
`

// crash SIGKILLs m's daemon, as a crash, and returns once the daemon
// its keeper started instead serves the mount.
func (m *mount) crash(t *testing.T) {
	t.Helper()
	old := m.daemonPid(t)
	if err := unix.Kill(old, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a new daemon serves after the crash", func() (bool, string) {
		b, _ := os.ReadFile(alloc.StatePath(m.dir, ".pid"))
		pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		if pid <= 0 || pid == old || unix.Kill(pid, 0) != nil {
			return false, fmt.Sprintf("the pid file names %q", b)
		}
		if _, err := getxattr(m.dir, statsXattr); err != nil {
			return false, err.Error()
		}
		m.pid = pid
		return true, ""
	})
}

// TestRestartChargesHandles: the handles a daemon inherits are charged to
// their openers, as the daemon that opened them charged them. Uid 65534
// opens a segment until the daemon refuses (EMFILE: its share); after a
// restart and after a crash the ledger still charges it every handle, and
// its next open is still EMFILE (before, each takeover let it hold
// another share); root still opens. Once it closes them, the charge goes
// and it opens again.
func TestRestartChargesHandles(t *testing.T) {
	t.Parallel()
	const nobody = 65534
	forEachMode(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		p := m.path("f")
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		c := startPythonAs(t, nobody, "holder", handlesScript)
		var held int64
		if _, err := fmt.Sscanf(c.do(t, "flood "+p), fmt.Sprintf("errno %d %%d", int(syscall.EMFILE)), &held); err != nil || held == 0 {
			t.Fatalf("uid %d opening again and again: want EMFILE after some opens (%v)", nobody, err)
		}
		if n := ledgerHeld(t, m, "descriptors", nobody); n != held {
			t.Fatalf("the ledger charges uid %d %d descriptors, want the %d it holds", nobody, n, held)
		}
		for _, takeover := range []string{"restart", "crash"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			if n := ledgerHeld(t, m, "descriptors", nobody); n != held {
				t.Errorf("after a %s the ledger charges uid %d %d descriptors, want the %d it holds", takeover, nobody, n, held)
			}
			if got := c.do(t, "open "+p); !strings.HasPrefix(got, fmt.Sprintf("errno %d ", int(syscall.EMFILE))) {
				t.Errorf("after a %s uid %d, holding its share, opens once more: %q, want EMFILE", takeover, nobody, got)
			}
			if b, err := os.ReadFile(p); err != nil || string(b) != "x" {
				t.Errorf("after a %s root's open: %q %v", takeover, b, err)
			}
		}
		if got := c.do(t, "close "+p); got != "ok" {
			t.Fatalf("close: %s", got)
		}
		eventually(t, "the charge goes with the handles", func() (bool, string) {
			n := ledgerHeld(t, m, "descriptors", nobody)
			return n == 0, fmt.Sprintf("uid %d is charged %d descriptors", nobody, n)
		})
		if got := c.do(t, "open "+p); got != "ok" {
			t.Errorf("uid %d's open once its handles went: %s", nobody, got)
		}
		c.wait(t)
	}, "--allow-other")
}

// named reports whether p's directory lists it, as the daemon answers
// (a lookup may be answered from the kernel's cache).
func named(t *testing.T, p string) bool {
	t.Helper()
	ents, err := os.ReadDir(filepath.Dir(p))
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(ents, func(e os.DirEntry) bool { return e.Name() == filepath.Base(p) })
}

// TestRestartKeepsRefcount: a segment's refcount and holders count the
// descriptors opened before a restart and before a crash, as before them
// (issue 27: refcount went from 1 to 0), in both modes; and an UNLINK
// segment opened and mapped before a restart keeps its name while mapped
// and loses it at the last close and unmap after it.
func TestRestartKeepsRefcount(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p, u := m.path("f"), m.path("u/s")
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(m.path("u"), 0o755); err != nil {
			t.Fatal(err)
		}
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "UNLINK", m.path("u"))
		c := startPython(t, "holder", handlesScript)
		for _, cmd := range []string{"open " + p, "open " + p, "create " + u, "map " + u} {
			if got := c.do(t, cmd); got != "ok" {
				t.Fatalf("%s: %s", cmd, got)
			}
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", c.cmd.Process.Pid))
		holders := fmt.Sprintf("%d %s 2\n", c.cmd.Process.Pid, strings.TrimSpace(string(comm)))
		check := func(when string) {
			t.Helper()
			if v, err := getxattr(p, "user.tensorfs.refcount"); err != nil || string(v) != "2" {
				t.Errorf("%s: refcount %q %v, want 2", when, v, err)
			}
			if v, err := getxattr(p, "user.tensorfs.holders"); err != nil || string(v) != holders {
				t.Errorf("%s: holders %q %v, want %q", when, v, err, holders)
			}
		}
		check("before the restart")
		m.restart(t, "")
		check("after the restart")
		m.crash(t)
		check("after the crash")
		if !named(t, u) {
			t.Fatalf("the UNLINK segment mapped across a restart and a crash lost its name")
		}
		for _, cmd := range []string{"close " + u, "unmap " + u, "close " + p} {
			if got := c.do(t, cmd); got != "ok" {
				t.Fatalf("%s: %s", cmd, got)
			}
		}
		eventually(t, "the UNLINK segment goes at its last close and unmap", func() (bool, string) {
			return !named(t, u), "it is still there"
		})
		if v, err := getxattr(p, "user.tensorfs.refcount"); err != nil || string(v) != "0" {
			t.Errorf("refcount once closed: %q %v, want 0", v, err)
		}
		c.wait(t)
	})
}

// TestAttackOpenAdoptedFlag: the daemon knows a handle it adopts from an
// earlier daemon, charged past the bound, by O_NOCTTY in its open flags,
// which the kernel clears from every open it sends: uid 65534's opens,
// creates, O_TMPFILE opens and directory opens with O_NOCTTY all stop at
// its share (EMFILE).
func TestAttackOpenAdoptedFlag(t *testing.T) {
	t.Parallel()
	const nobody = 65534
	m := mountFS(t, "passthrough", "--allow-other")
	reachable(t, m.dir)
	stickyDir(t, m.path("s"))
	if err := os.WriteFile(m.path("s/f"), []byte("x"), 0o666); err != nil {
		t.Fatal(err)
	}
	out, err := runAs(t, nobody, "/", systemPython, "-c", `
import os, sys, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
d = sys.argv[1]
for name, fn in [("open", lambda i: os.open(d + "/f", os.O_RDONLY | os.O_NOCTTY)),
                 ("create", lambda i: os.open(d + "/c%d" % i, os.O_RDWR | os.O_CREAT | os.O_NOCTTY)),
                 ("tmpfile", lambda i: os.open(d, os.O_RDWR | os.O_TMPFILE | os.O_NOCTTY)),
                 ("opendir", lambda i: os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOCTTY))]:
    fds = []
    try:
        while len(fds) < hard - 64:
            fds.append(fn(len(fds)))
        print(name, "no limit after", len(fds))
    except OSError as e:
        print(name, "errno", e.errno, len(fds))
    for fd in fds:
        os.close(fd)
`, m.path("s"))
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	lines := strings.Split(out, "\n")
	for _, op := range []string{"open", "create", "tmpfile", "opendir"} {
		want := fmt.Sprintf("%s errno %d ", op, int(syscall.EMFILE))
		if !slices.ContainsFunc(lines, func(l string) bool { return strings.HasPrefix(l, want) }) {
			t.Errorf("uid %d's %ss with O_NOCTTY: want EMFILE at its share, got:\n%s", nobody, op, out)
		}
	}
}

// TestRestartTmpfile: an O_TMPFILE segment not linked yet is a node in
// no directory, as one unlinked while open: across a restart and a crash
// its opener reads, writes and stats it through its descriptor, and its
// inode stays charged to her; linked then (linkat AT_EMPTY_PATH), it
// keeps its name and its charge once closed.
func TestRestartTmpfile(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		c := startPython(t, "holder", `
import ctypes, os, sys
d = sys.argv[1]
fd = os.open(d, os.O_RDWR | os.O_TMPFILE, 0o600)
os.write(fd, b"hello")
print("ready", flush=True)
for line in sys.stdin:
    try:
        if line.strip() == "link":
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.linkat(fd, b"", -100, (d + "/named").encode(), 0x1000) != 0: # AT_FDCWD, AT_EMPTY_PATH
                raise OSError(ctypes.get_errno(), "linkat")
            os.close(fd)
            print("linked", flush=True)
            continue
        os.pwrite(fd, b"H", 0)
        print(os.fstat(fd).st_size, os.pread(fd, 5, 0).decode(), flush=True)
    except OSError as e:
        print("errno", e.errno, flush=True)
`, m.dir)
		c.expect(t, "ready")
		charged := ledgerHeld(t, m, "inodes", 0)
		for _, takeover := range []string{"restart", "crash"} {
			if takeover == "restart" {
				m.restart(t, "")
			} else {
				m.crash(t)
			}
			time.Sleep(1100 * time.Millisecond) // the kernel's attributes expire
			if got := c.do(t, "check"); got != "5 Hello" {
				t.Errorf("after a %s, an O_TMPFILE segment's size and bytes through its descriptor: %q, want \"5 Hello\"", takeover, got)
			}
			if n := ledgerHeld(t, m, "inodes", 0); n != charged {
				t.Errorf("after a %s root is charged %d inodes, want the %d before", takeover, n, charged)
			}
		}
		if got := c.do(t, "link"); got != "linked" {
			t.Fatalf("link: %s", got)
		}
		if b, err := os.ReadFile(m.path("named")); err != nil || string(b) != "Hello" {
			t.Errorf("the O_TMPFILE segment linked after the takeovers: %q %v", b, err)
		}
		if n := ledgerHeld(t, m, "inodes", 0); n != charged {
			t.Errorf("once linked and closed, root is charged %d inodes, want %d", n, charged)
		}
		c.wait(t)
	})
}
