package integration

// Attacks on the backing and the import path, each run as an unprivileged
// user (userA, a child with SysProcAttr.Credential) against a real mount,
// in both modes: the rows C1, C2, C3, H2, H3 and M1 of the security issue.
// Each asserts that the attack is refused and that nothing outside the
// mount changed.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// attackMount mounts tensorfs in m's mode (with --allow-other when shared)
// below a directory every user can search, with a 1777 directory
// "shared" at its root, as a machine's scratch space would have.
func attackMount(t *testing.T, mode string, shared bool) *mount {
	t.Helper()
	return attackMountEnv(t, mode, shared, nil)
}

// attackMountEnv is attackMount with env added to the daemon's
// environment (mountFSEnv).
func attackMountEnv(t *testing.T, mode string, shared bool, env []string) *mount {
	t.Helper()
	var args []string
	if shared {
		args = append(args, "--allow-other")
	}
	m := mountFSEnv(t, mode, env, args...)
	reachable(t, m.dir)
	if err := os.Mkdir(m.path("shared"), 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(m.path("shared"), 0o1777); err != nil {
		t.Fatal(err)
	}
	return m
}

// backingOf returns the mount's backing directory, from its stats.
func backingOf(t *testing.T, m *mount) string {
	t.Helper()
	b, _ := m.stats(t)["backing"].(string)
	if b == "" {
		t.Fatal("stats name no backing")
	}
	return b
}

// victim makes a root-owned 0600 file outside every mount, in a directory
// only root may enter, and returns its path; checkVictim fails if its
// bytes, mode, owner or attributes changed, or if it is gone.
func victim(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "private")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "secret")
	if err := os.WriteFile(p, []byte("root's secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func checkVictim(t *testing.T, p string) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "root's secret\n" {
		t.Errorf("victim %s: %q, %v; want its bytes unchanged", p, b, err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatalf("victim %s: %v", p, err)
	}
	if st.Mode&0o7777 != 0o600 || st.Uid != 0 || st.Gid != 0 {
		t.Errorf("victim %s: mode %#o owner %d:%d, want 0600 0:0", p, st.Mode&0o7777, st.Uid, st.Gid)
	}
	if out := run(t, "getfattr", "--absolute-names", "-d", "-m", "-", p); strings.TrimSpace(out) != "" {
		t.Errorf("victim %s gained attributes:\n%s", p, out)
	}
}

// TestAttackBackingUnreachable (M1, C2, C3): a user can neither read nor
// change the backing directly, on a shared mount or a private one; only
// the daemon's user may read the backing path of a segment.
func TestAttackBackingUnreachable(t *testing.T) {
	t.Parallel()
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("allow-other=%v", shared), func(t *testing.T) {
			forEachModeOnce(t, func(t *testing.T, mode string) {
				m := attackMount(t, mode, shared)
				if err := os.WriteFile(m.path("pub"), []byte("public"), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Mkdir(m.path("shared/me"), 0o777); err != nil {
					t.Fatal(err)
				}
				b := backingOf(t, m)
				for _, c := range [][]string{
					{"cat", filepath.Join(b, "pub")},
					{"ls", b},
					{"touch", filepath.Join(b, "shared", "planted")},
					{"ln", "-s", "/etc/shadow", filepath.Join(b, "shared", "me", "t")},
					{"setfattr", "-n", "user.tensorfs.disk", "-v", "../x", filepath.Join(b, "pub")},
				} {
					if out, err := runAs(t, userA, "/", c[0], c[1:]...); err == nil {
						t.Errorf("uid %d: %s succeeded in the backing:\n%s", userA, strings.Join(c, " "), out)
					}
				}
				if _, err := os.Lstat(filepath.Join(b, "shared", "planted")); err == nil {
					t.Errorf("uid %d planted a file in the backing", userA)
				}
				var parent unix.Stat_t
				if err := unix.Stat(filepath.Dir(b), &parent); err != nil || parent.Mode&0o077 != 0 {
					t.Errorf("backing's parent %s: mode %#o, %v; want no access for group and others", filepath.Dir(b), parent.Mode&0o7777, err)
				}
				if !shared {
					return
				}
				// The mount itself serves what the modes allow.
				if out, err := runAs(t, userA, "/", "cat", m.path("pub")); err != nil || out != "public" {
					t.Errorf("uid %d cat of the 0644 segment through the mount: %q, %v", userA, out, err)
				}
				out, err := runAs(t, userA, "/", "getfattr", "-n", "user.tensorfs.handle", m.path("pub"))
				if err == nil || !strings.Contains(out, "Permission denied") {
					t.Errorf("uid %d read the handle path: %v\n%s", userA, err, out)
				}
				if out := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.tensorfs.handle", m.path("pub")); out != filepath.Join(b, "pub") {
					t.Errorf("root's handle path is %q, want %q", out, filepath.Join(b, "pub"))
				}
				if out := run(t, "getfattr", "-d", "-m", "-", m.path("pub")); strings.Contains(out, "handle") {
					// root lists it; a user does not (below)
				} else {
					t.Errorf("root's getfattr -d does not list the handle:\n%s", out)
				}
				if out, _ := runAs(t, userA, "/", "getfattr", "-d", "-m", "-", m.path("pub")); strings.Contains(out, "handle") {
					t.Errorf("uid %d's getfattr -d lists the handle:\n%s", userA, out)
				}
			})
		})
	}
}

// forEachModeOnce runs fn as subtests "passthrough" and "classic", leaving
// the mount to fn.
func forEachModeOnce(t *testing.T, fn func(t *testing.T, mode string)) {
	t.Helper()
	for _, mode := range []string{"passthrough", "classic"} {
		t.Run(mode, func(t *testing.T) { fn(t, mode) })
	}
}

// TestAttackForgedState (C3): internal state cannot be set through the
// mount: the daemon's names are refused, other namespaces are not served,
// and a remount's recovery leaves what is outside the backing alone.
func TestAttackForgedState(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		v := victim(t)
		own := m.path("shared/own")
		if out, err := runAs(t, userA, "/", "touch", own); err != nil {
			t.Fatalf("uid %d touch: %v\n%s", userA, err, out)
		}
		for _, a := range [][2]string{
			{"user.tensorfs.disk", "../../../" + v},
			{"user.tensorfs.import", "0123456789abcdef"},
			{"user.tensorfs.devsize", "1"},
			{"user.tensorfs.refcount", "0"},
			{"trusted.tensorfs.disk", "0123456789abcdef"},
			{"security.capability", "x"},
		} {
			if out, err := runAs(t, userA, "/", "setfattr", "-n", a[0], "-v", a[1], own); err == nil {
				t.Errorf("uid %d set %s on its segment:\n%s", userA, a[0], out)
			}
		}
		// Root is refused other namespaces too: the daemon would set them
		// on the backing with its own privileges.
		if _, err := runTimeout(commandTimeout, "setfattr", "-n", "security.tensorfs", "-v", "x", own); err == nil {
			t.Errorf("root set a security.* attribute through the mount")
		}
		m.unmount(t, false)
		m = m.remount(t)
		if _, err := os.Stat(m.path("shared/own")); err != nil {
			t.Errorf("the user's segment is gone after recovery: %v", err)
		}
		checkVictim(t, v)
	})
}

// TestAttackSymlinkRace (C2, H2 through the mount): while a user keeps
// renaming a symbolic link to a root file over the name of its own
// segment, chmod, setxattr, truncate and import of that name never reach
// the root file.
func TestAttackSymlinkRace(t *testing.T) {
	// Serial: its flipper spins a CPU for the whole race; among parallel
	// tests on two CPUs the 1500 rounds once starved past commandTimeout.
	// Its two modes run at once: each waits on its daemon's locks more
	// than it runs (alone, a mode kept one CPU busy of two).
	forEachModeOnce(t, func(t *testing.T, mode string) {
		t.Parallel()
		m := attackMount(t, mode, true)
		v := victim(t)
		dir := m.path("shared/me")
		if out, err := runAs(t, userA, "/", "mkdir", dir); err != nil {
			t.Fatalf("uid %d mkdir: %v\n%s", userA, err, out)
		}
		sock := controlSocket(t, m)
		flipper := asUser(pyCommand(attackFlipScript, dir, v), userA)
		if err := flipper.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { flipper.Process.Kill(); flipper.Wait() })
		out := pythonAs(t, userA, "/", attackRaceScript, dir, "shared/me/seg", sock)
		var res map[string]int
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("race script said %q: %v", out, err)
		}
		t.Logf("race rounds: %v", res)
		if res["imports"]+res["chmods"]+res["xattrs"]+res["truncates"] == 0 {
			t.Errorf("the race never hit the segment: %v", res)
		}
		flipper.Process.Kill()
		flipper.Wait()
		checkVictim(t, v)
		m.unmount(t, false)
		m = m.remount(t) // recovery walks what the race left
		checkVictim(t, v)
	})
}

// attackFlipScript (argv: dir, target) loops: make a symbolic link to
// target and rename it over dir/seg, then put a file back at dir/seg.
const attackFlipScript = `
import os, sys
d, target = sys.argv[1], sys.argv[2]
while True:
    try:
        os.symlink(target, d + "/l")
        os.rename(d + "/l", d + "/seg")
        os.unlink(d + "/seg")
        open(d + "/seg", "w").close()
    except OSError:
        pass
`

// attackRaceScript (argv: dir, rel, socket) chmods, sets attributes on,
// truncates and imports memfds at dir/seg for a bounded number of rounds
// and prints how many of each reached a segment.
const attackRaceScript = `
import array, json, os, socket, sys
d, rel, sock = sys.argv[1:4]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sock)
n = {"chmods": 0, "xattrs": 0, "truncates": 0, "imports": 0}
for i in range(1500):
    p = d + "/seg"
    for key, fn in (("chmods", lambda: os.chmod(p, 0o4777)),
                    ("xattrs", lambda: os.setxattr(p, "user.mine", b"1")),
                    ("truncates", lambda: os.truncate(p, 4096))):
        try:
            fn()
            n[key] += 1
        except OSError:
            pass
    fd = os.memfd_create("m")
    os.write(fd, b"imported")
    s.sendmsg([json.dumps({"v": 1, "op": "import", "path": rel}).encode()],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
    reply = json.loads(s.recv(65536))
    if reply.get("ok"):
        n["imports"] += 1
print(json.dumps(n))
`

// TestAttackImportDescriptors (C1, H3): an import carries exactly the
// sender's access: O_PATH and write-only descriptors are refused, a
// read-only one gives a read-only segment, and a descriptor of a file of
// the mount itself is refused without hanging the daemon.
func TestAttackImportDescriptors(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		v := victim(t)
		// A file uid userA may write but not read, and one it may read.
		wo := filepath.Join(t.TempDir(), "wo")
		os.WriteFile(wo, []byte("write-only"), 0o200)
		os.Chown(wo, userA, userA)
		reachable(t, wo)
		// Import takes shared memory: a file on /dev/shm (tmpfs), as
		// torch's share_memory_() makes. A world-readable file on disk
		// would let its importer learn who maps it (holders): refused.
		shm, err := os.CreateTemp("/dev/shm", "tensorfs-attack-ro-")
		if err != nil {
			t.Fatal(err)
		}
		ro := shm.Name()
		t.Cleanup(func() { os.Remove(ro) })
		shm.WriteString("readable")
		shm.Chmod(0o644)
		shm.Close()
		disk := filepath.Join(t.TempDir(), "disk")
		os.WriteFile(disk, []byte("on disk"), 0o644)
		reachable(t, disk)
		if err := os.WriteFile(m.path("shared/onmount"), []byte("on the mount"), 0o666); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			file, how, dest string
			errno           syscall.Errno
		}{
			{"/etc/shadow", "path", "shared/c1", syscall.EBADF},
			{wo, "w", "shared/wo", syscall.EBADF},
			{m.path("shared/onmount"), "r", "shared/self", syscall.EINVAL},
			{"/dev/null", "r", "shared/dev", syscall.EINVAL},
			{disk, "r", "shared/disk", syscall.EINVAL},
			{"/etc/passwd", "r", "shared/passwd", syscall.EINVAL},
			{ro, "r", "shared/ro", 0},
		} {
			out := pythonAs(t, userA, "/", attackImportScript, sock, c.file, c.how, c.dest)
			var reply struct {
				OK    bool   `json:"ok"`
				Errno int    `json:"errno"`
				Error string `json:"error"`
			}
			if err := json.Unmarshal([]byte(out), &reply); err != nil {
				t.Fatalf("import script said %q: %v", out, err)
			}
			if c.errno == 0 {
				if !reply.OK {
					t.Errorf("import of a read-only descriptor of %s: %+v", c.file, reply)
				}
				continue
			}
			if reply.OK || syscall.Errno(reply.Errno) != c.errno {
				t.Errorf("import (%s) of %s: %+v, want errno %d (%v)", c.how, c.file, reply, c.errno, c.errno)
			}
			if _, err := os.Lstat(m.path(c.dest)); err == nil {
				t.Errorf("refused import left %s", c.dest)
			}
		}
		// The read-only import reads, and refuses writes, for its owner too.
		if out, err := runAs(t, userA, "/", "cat", m.path("shared/ro")); err != nil || out != "readable" {
			t.Errorf("cat of the imported segment: %q, %v", out, err)
		}
		if out, err := runAs(t, userA, "/", "sh", "-c", "echo x >> "+m.path("shared/ro")); err == nil {
			t.Errorf("uid %d wrote its read-only import:\n%s", userA, out)
		}
		// The daemon still serves, from several threads at once.
		pythonAs(t, userA, "/", `
import sys, threading
def read():
    for _ in range(50):
        open(sys.argv[1], "rb").read()
ts = [threading.Thread(target=read) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
`, m.path("shared/onmount"))
		checkVictim(t, v)
	})
}

// attackImportScript (argv: socket, file, how, dest) opens file as "path"
// (O_PATH), "r" or "w", sends it as an import to dest and prints the reply.
const attackImportScript = `
import array, json, os, socket, sys
sock, f, how, dest = sys.argv[1:5]
flags = {"path": os.O_PATH, "r": os.O_RDONLY, "w": os.O_WRONLY}[how]
fd = os.open(f, flags)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sock)
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": dest}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(s.recv(65536).decode())
`

// TestAttackStateFiles (M1, M3): a daemonized mount's log is the daemon's
// alone, and its backing stays nosuid,nodev across the remount that
// recovery after a crash does (with --capacity).
func TestAttackStateFiles(t *testing.T) {
	t.Parallel()
	requireEnvironment(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	before := mountSet()
	pid := ccMountDaemonized(t, dir, "passthrough", "--capacity", "64M")
	var st unix.Stat_t
	if err := unix.Stat(alloc.StatePath(dir, ".log"), &st); err != nil || st.Mode&0o077 != 0 {
		t.Errorf("daemon log: mode %#o, %v; want no access for group and others", st.Mode&0o7777, err)
	}
	if out, err := runAs(t, userA, "/", "cat", alloc.StatePath(dir, ".log")); err == nil {
		t.Errorf("uid %d read the daemon's log:\n%s", userA, out)
	}
	unix.Kill(parentOf(pid), unix.SIGKILL) // the keeper: its daemon dies with it
	eventually(t, "daemon dies", func() (bool, string) {
		return unix.Kill(pid, 0) == unix.ESRCH, "still alive"
	})
	pid = ccMountDaemonized(t, dir, "passthrough", "--capacity", "128M")
	found := false
	for _, e := range readMountinfo() {
		if e.mountPoint == alloc.PrivateBacking(dir) {
			found = true
			if !strings.Contains(e.options, "nosuid") || !strings.Contains(e.options, "nodev") {
				t.Errorf("backing remounted with %q, want nosuid,nodev", e.options)
			}
		}
	}
	if !found {
		t.Errorf("no backing mount at %s", alloc.PrivateBacking(dir))
	}
	ccUnmountPurgeDaemonized(t, dir, pid, before)
}

// TestAttackImportFlood (H4, imports): each import keeps a descriptor in
// the daemon, from the budget open segments draw on: one user's imports
// stop at its share with EMFILE, which also refuses that user's opens
// while they hold it, and root and other users keep importing and
// opening.
func TestAttackImportFlood(t *testing.T) {
	t.Parallel()
	m := attackMount(t, "passthrough", true)
	sock := controlSocket(t, m)
	if err := os.WriteFile(m.path("shared/f"), []byte("x"), 0o666); err != nil {
		t.Fatal(err)
	}
	flood := asUser(pyCommand(`
import array, errno, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
n = 0
while n < 100000:
    fd = os.memfd_create("m")
    s.sendmsg([json.dumps({"v": 1, "op": "import", "path": "shared/i%d" % n}).encode()],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
    r = json.loads(s.recv(65536))
    if not r["ok"]:
        print("errno", r["errno"], "after", n, flush=True)
        break
    n += 1
try:
    os.close(os.open(sys.argv[2], os.O_RDONLY))
    print("opened", flush=True)
except OSError as e:
    print("open errno", e.errno, flush=True)
sys.stdin.read()
`, sock, m.path("shared/f")), userA)
	stdin, _ := flood.StdinPipe()
	stdout, _ := flood.StdoutPipe()
	if err := flood.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { flood.Process.Kill(); flood.Wait() })
	r := bufio.NewReader(stdout)
	line, _ := r.ReadString('\n')
	var n int
	if _, err := fmt.Sscanf(line, fmt.Sprintf("errno %d after %%d", int(syscall.EMFILE)), &n); err != nil || n == 0 {
		t.Fatalf("uid %d importing again and again: %q, want EMFILE from the daemon after some imports", userA, line)
	}
	t.Logf("uid %d: EMFILE after %d imports", userA, n)
	if line, _ = r.ReadString('\n'); line != fmt.Sprintf("open errno %d\n", int(syscall.EMFILE)) {
		t.Errorf("uid %d's open while its imports hold its share: %q, want EMFILE", userA, line)
	}
	if err := os.WriteFile(m.path("after"), []byte("served"), 0o644); err != nil {
		t.Errorf("root's create after the flood: %v", err)
	}
	if out, err := runAs(t, userB, "/", "cat", m.path("after")); err != nil || out != "served" {
		t.Errorf("another user's read after the flood: %q, %v", out, err)
	}
	out := pythonAs(t, userB, "/", `
import array, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
fd = os.memfd_create("m")
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": "shared/b"}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(json.loads(s.recv(65536))["ok"])
`, sock)
	if strings.TrimSpace(out) != "True" {
		t.Errorf("another user's import after the flood: %q", out)
	}
	stdin.Close()
	flood.Wait()
}

// TestAttackOpenFlood (H4 through FUSE): every open segment holds a
// descriptor in the daemon; one user holds at most its share (EMFILE past
// it) and root and other users keep opening.
func TestAttackOpenFlood(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		p := m.path("shared/f")
		if err := os.WriteFile(p, []byte("x"), 0o666); err != nil {
			t.Fatal(err)
		}
		flood := asUser(pyCommand(`
import errno, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds = []
try:
    while len(fds) < hard - 64:
        fds.append(os.open(sys.argv[1], os.O_RDONLY))
    print("no limit after", len(fds), flush=True)
except OSError as e:
    print("errno", e.errno, "after", len(fds), flush=True)
sys.stdin.read()
`, p), userA)
		stdin, _ := flood.StdinPipe()
		stdout, _ := flood.StdoutPipe()
		if err := flood.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { flood.Process.Kill(); flood.Wait() })
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		if !strings.HasPrefix(line, fmt.Sprintf("errno %d ", int(syscall.EMFILE))) {
			t.Errorf("uid %d opening one segment again and again: %q, want EMFILE from the daemon", userA, line)
		}
		if b, err := os.ReadFile(p); err != nil || string(b) != "x" {
			t.Errorf("root's open during the flood: %q, %v", b, err)
		}
		if out, err := runAs(t, userB, "/", "cat", p); err != nil || out != "x" {
			t.Errorf("uid %d's open during the flood: %q, %v", userB, out, err)
		}
		stdin.Close()
		flood.Wait()
		eventually(t, "uid "+fmt.Sprint(userA)+" opens again once its files are closed", func() (bool, string) {
			out, err := runAs(t, userA, "/", "cat", p)
			return err == nil, fmt.Sprint(out, err)
		})
	})
}
