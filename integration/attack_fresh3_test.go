package integration

// Attacks of the third fresh round (G*), each run as an unprivileged user
// against a real mount, in both modes.

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// dirFloodScript opens the directory argv[1] (OPENDIR) again and again
// until the first error or its own limit, prints how far it got, and holds
// the descriptors until its stdin closes.
const dirFloodScript = `
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds = []
try:
    while len(fds) < hard - 64:
        fds.append(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY))
    print("held", len(fds), flush=True)
except OSError as e:
    print("errno", e.errno, "after", len(fds), flush=True)
sys.stdin.read()
`

// TestAttackOpendirFlood (G1): every open directory is a descriptor the
// daemon holds (OpendirHandle) and no per-uid bound counts them, unlike
// open segments (TestAttackOpenFlood). A user who opens one directory
// again and again, from as many processes as it takes, fills the daemon's
// descriptor table: root's and other users' creates then fail with EMFILE
// and the control socket stops accepting. Per-uid bounds must hold for
// directory handles too: root and other users keep working.
func TestAttackOpendirFlood(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		_, limit := daemonFDs(t, m.pid)
		var floods []*exec.Cmd
		t.Cleanup(func() {
			for _, f := range floods {
				f.Process.Kill()
				f.Wait()
			}
		})
		var stdins []io.Closer
		held := 0
		// As many processes as the daemon's limit takes (each process
		// stops at its own hard limit, or at the daemon's refusal).
		for i := 0; i < 8 && held < limit; i++ {
			flood := asUser(pyCommand(dirFloodScript, m.path("shared")), userA)
			stdin, _ := flood.StdinPipe()
			stdout, _ := flood.StdoutPipe()
			if err := flood.Start(); err != nil {
				t.Fatal(err)
			}
			floods = append(floods, flood)
			stdins = append(stdins, stdin)
			line, _ := bufio.NewReader(stdout).ReadString('\n')
			t.Logf("flood %d: %s", i, strings.TrimSpace(line))
			var n int
			if _, err := fmt.Sscanf(line, "held %d", &n); err != nil {
				var errno int
				if _, err := fmt.Sscanf(line, "errno %d after %d", &errno, &n); err != nil {
					t.Fatalf("flood %d: %q", i, line)
				}
				held += n
				break // the daemon (or the process) said no
			}
			held += n
		}
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("uid %d holds %d directory handles; the daemon holds %d descriptors of %d", userA, held, fds, limit)
		if err := os.WriteFile(m.path("rootfile"), []byte("root"), 0o644); err != nil {
			t.Errorf("root's create during uid %d's directory flood: %v", userA, err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "echo b > "+m.path("shared/bfile")+" && cat "+m.path("shared/bfile")); err != nil || out != "b\n" {
			t.Errorf("uid %d's create during uid %d's directory flood: %q, %v", userB, userA, out, err)
		}
		if _, err := os.ReadDir(m.path("shared")); err != nil {
			t.Errorf("root's ls during uid %d's directory flood: %v", userA, err)
		}
		for _, s := range stdins {
			s.Close()
		}
	})
}

// keepSizeFillScript fills the tmpfs of the counter file argv[1] with
// fallocate(FALLOC_FL_KEEP_SIZE): its size stays 8 bytes, its blocks take
// every free page; it prints the file's size and 512-byte blocks.
const keepSizeFillScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
p = sys.argv[1]
fd = os.open(p, os.O_RDWR)
free = os.statvfs(p).f_bavail * os.statvfs(p).f_frsize
r = libc.fallocate(fd, 1, ctypes.c_long(4096), ctypes.c_long(free))
st = os.fstat(fd)
print(r, ctypes.get_errno(), st.st_size, st.st_blocks)
`

// TestAttackGPUCounterKeepSize (G2): a reader of a GPU segment (here its
// owner) may write its counter file, and fallocate(FALLOC_FL_KEEP_SIZE)
// on it takes every page of the counters' 64 MiB tmpfs while the file
// stays 8 bytes long. The daemon cuts back only counters longer than 8
// bytes (CounterDir.trim), so it finds nothing to cut: every other
// segment's counter, root's included, is then ENOSPC. One user must not
// take the counters of others: root's new segment gets its counter.
func TestAttackGPUCounterKeepSize(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	out := strings.Fields(pythonAs(t, userA, "/", keepSizeFillScript, counter))
	t.Logf("uid %d's fallocate(KEEP_SIZE) of its counter: rc errno size blocks = %v", userA, out)
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(counter), &fs); err == nil {
		t.Logf("counters' tmpfs: %d of %d blocks free", fs.Bfree, fs.Blocks)
	}
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters with its own: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
}

// removedHeldScript holds the counter file argv[1] by a read-write and an
// O_PATH descriptor, says "held", and at the next line on stdin (its
// segment removed) tries through them what a reader of a removed counter
// could: open it read-write again (/proc/self/fd of the O_PATH one), set
// a user.* attribute, and reserve every free page of the counters' tmpfs
// past its end with fallocate(FALLOC_FL_KEEP_SIZE). It prints "reopen" and
// "setxattr" with ok or the errno, the fallocate's result and errno, the
// file's links and the tmpfs's free blocks, and holds the file until its
// stdin closes.
const removedHeldScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDWR)
path_fd = os.open(sys.argv[1], os.O_PATH)
print("held")
sys.stdin.readline()
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return str(e.errno)
reopen = attempt(lambda: os.open("/proc/self/fd/%d" % path_fd, os.O_RDWR))
setx = attempt(lambda: os.setxattr(fd, "user.x", b"x" * 4096))
free = os.fstatvfs(fd).f_bavail * os.fstatvfs(fd).f_frsize
r = libc.fallocate(fd, 1, ctypes.c_long(4096), ctypes.c_long(free))
e = ctypes.get_errno()
print("reopen", reopen, "setxattr", setx, "fallocate", r, e, "links", os.fstat(fd).st_nlink, "free", os.fstatvfs(fd).f_bavail)
sys.stdin.read()
`

// TestAttackGPUCounterRemovedHeld: the daemon removes a GPU segment's
// counter file with its segment, and a reader who still holds it open
// keeps it, nameless, beyond what trim reached (the names in the
// counters' directory): uid 1000 holds the counter of a segment of its
// own, the segment is removed, and through its descriptor uid 1000 fills
// the counters' tmpfs (fallocate KEEP_SIZE), so that every new counter,
// root's included, would be ENOSPC for as long as it keeps the file. The
// daemon keeps a removed counter that someone holds, takes the readers'
// access to it away (no reopen through an O_PATH descriptor, no user.*
// attributes), and puts back what is reserved through it: root's new
// segment gets its counter.
func TestAttackGPUCounterRemovedHeld(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	holder := startPythonAs(t, userA, "holder", removedHeldScript, counter)
	holder.expect(t, "held")
	if err := os.Remove(seg); err != nil {
		t.Fatal(err)
	}
	eventually(t, "removal of the counter "+counter, func() (bool, string) {
		_, err := os.Lstat(counter)
		return os.IsNotExist(err), fmt.Sprintf("lstat: %v", err)
	})
	out := holder.do(t, "go")
	t.Logf("uid %d through its removed counter: %s", userA, out)
	f := strings.Fields(out)
	if len(f) != 11 || f[0] != "reopen" || f[2] != "setxattr" || f[4] != "fallocate" {
		t.Fatalf("holder: %q", out)
	}
	if f[5] != "0" || f[10] != "0" {
		t.Fatalf("uid %d's fallocate through its removed counter did not fill the counters' tmpfs: %s", userA, out)
	}
	if denied := fmt.Sprint(int(unix.EACCES)); f[1] != denied || f[3] != denied {
		t.Errorf("uid %d on its removed counter: reopen through O_PATH %s, setxattr %s; want both EACCES (%s)", userA, f[1], f[3], denied)
	}
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters through a removed counter it holds: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
	holder.wait(t)
}

// xattrFillScript sets user.* attributes on the counter file argv[1], as
// its write permission lets a reader, until the tmpfs refuses one at
// every size; it prints how many it set and the inodes left free.
const xattrFillScript = `
import os, sys
p, n = sys.argv[1], 0
for size in (65536, 4096, 256, 16, 0):
    try:
        while True:
            os.setxattr(p, "user.x%d" % n, b"x" * size)
            n += 1
    except OSError:
        pass
print(n, os.statvfs(p).f_ffree)
`

// TestAttackGPUCounterXattrs (G2): tmpfs charges user.* attributes to
// the room its inodes share (nr_inodes), and a reader of a GPU segment
// may set them on its counter file (write permission is all it takes):
// enough of them leave no room for another counter file, so every new
// counter, root's included, is ENOSPC. One user must not take the
// counters of others: root's new segment gets its counter.
func TestAttackGPUCounterXattrs(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	out := strings.Fields(pythonAs(t, userA, "/", xattrFillScript, counter))
	t.Logf("uid %d's user.* attributes on its counter: set, inodes free = %v", userA, out)
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters' inodes with attributes: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
}

// sharedPlantScript plants, as its user, SHARED segments whose disk files
// record the path argv[1]/alice/model while they live elsewhere: each
// attempt creates alice/model while a child renames the directory alice
// away; a create whose marker gets its disk id after the rename walked
// the directory (recordSharedPath) keeps the path it computed before.
const sharedPlantScript = `
import os, sys
base, n = sys.argv[1], int(sys.argv[2])
r1, w1 = os.pipe()
pid = os.fork()
if pid == 0:
    for i in range(n):
        if os.read(r1, 1) != b"g":
            break
        try:
            os.rename(base + "/alice", "%s/h%d" % (base, i))
        except OSError:
            pass
    os._exit(0)
for i in range(n):
    try:
        os.mkdir(base + "/alice")
    except FileExistsError:
        pass
    os.write(w1, b"g")
    try:
        fd = os.open(base + "/alice/model", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        os.write(fd, b"attacker")
        os.close(fd)
    except OSError:
        pass
    for _ in range(1000):
        if os.path.isdir("%s/h%d" % (base, i)):
            break
    try:
        os.rename(base + "/alice", "%s/late%d" % (base, i))
    except OSError:
        pass
os.write(w1, b"s")
os.waitpid(pid, 0)
print("done")
`

// TestAttackSharedRecordedPath (G3): a SHARED segment's disk file records
// the path its create computed (d.Path when the create began), and a
// rename of its directory that walks the directory before the new marker
// carries its disk id does not correct it. uid 1000 races its own creates
// against renames of its own directory "alice" in a 1777 SHARED directory
// and leaves disk files that all record persist/alice/model but live
// elsewhere. uid 1001 then keeps its checkpoint at persist/alice/model.
// After unmount --purge (or a reboot: what SHARED is for), recovery from
// the disk puts the first disk file in id order at the recorded path and
// the others beside it: uid 1001's path then holds uid 1000's bytes. What
// recovery puts at a user's path must be that user's own segment.
func TestAttackSharedRecordedPath(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		disk := filepath.Join(t.TempDir(), "disk")
		if err := os.Mkdir(disk, 0o700); err != nil {
			t.Fatal(err)
		}
		m := mountFS(t, mode, "--allow-other", "--disk", disk)
		reachable(t, m.dir)
		persist := m.path("persist")
		if err := os.Mkdir(persist, 0o1777); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(persist, 0o1777); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(persist, "user.tensorfs.flags", []byte("SHARED"), 0); err != nil {
			t.Fatal(err)
		}
		pythonAs(t, userA, "/", sharedPlantScript, persist, "300")
		planted := 0
		ents, _ := os.ReadDir(disk)
		for _, e := range ents {
			v := make([]byte, 4096)
			if n, err := unix.Getxattr(filepath.Join(disk, e.Name()), "trusted.tensorfs.path", v); err == nil && string(v[:n]) == "persist/alice/model" {
				planted++
			}
		}
		t.Logf("uid %d left %d disk files that record persist/alice/model", userA, planted)
		if _, err := os.Stat(filepath.Join(persist, "alice")); !os.IsNotExist(err) {
			t.Fatalf("persist/alice after the attacker: %v, want it absent", err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "mkdir "+persist+"/alice && echo victim > "+persist+"/alice/model"); err != nil {
			t.Fatalf("uid %d's checkpoint: %v\n%s", userB, err, out)
		}
		m.unmount(t, true)
		m2 := m.remount(t)
		p := m2.path("persist/alice/model")
		b, err := os.ReadFile(p)
		var st unix.Stat_t
		unix.Stat(p, &st)
		if err != nil || string(b) != "victim\n" || st.Uid != userB {
			t.Errorf("after unmount --purge and mount, uid %d's persist/alice/model holds %q (owner %d, %v); want its own %q", userB, b, st.Uid, err, "victim\n")
		}
	})
}

// othersMemfdVictimScript makes two memfds, "weights" as memfd_create
// leaves it (0777) and "private" owner-only (0600), prints their modes,
// and hands a read-only descriptor of each to whoever connects to the
// abstract socket argv[1]; once told to on stdin, it prints their modes
// and the first bytes of "weights" again.
const othersMemfdVictimScript = `
import array, os, socket, sys
fd = os.memfd_create("weights")
os.write(fd, b"WEIGHTS!" * 512)
priv = os.memfd_create("private")
os.fchmod(priv, 0o600)
os.write(priv, b"PRIVATE!" * 512)
ro = [os.open("/proc/self/fd/%d" % f, os.O_RDONLY) for f in (fd, priv)]
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind("\0" + sys.argv[1])
l.listen(1)
mode = lambda f: oct(os.fstat(f).st_mode & 0o7777)
print(mode(fd), mode(priv), flush=True)
c, _ = l.accept()
c.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", ro))])
c.close()
sys.stdin.readline()
print(mode(fd), mode(priv), os.pread(fd, 8, 0).decode(), flush=True)
`

// othersMemfdImportScript takes the two descriptors the victim hands out
// on the abstract socket argv[2], tries to make the first owner-only
// itself, and imports each over the control socket argv[1] at argv[3]
// and argv[4]; it prints its own fchmod's errno and each import's ok and
// errno.
const othersMemfdImportScript = `
import array, json, os, socket, sys
v = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
v.connect("\0" + sys.argv[2])
_, anc, _, _ = v.recvmsg(16, socket.CMSG_SPACE(8))
fds = array.array("i", anc[0][2][:8])
try:
    os.fchmod(fds[0], 0o700)
    own = 0
except OSError as e:
    own = e.errno
out = [str(own)]
for fd, path in zip(fds, sys.argv[3:5]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.sendmsg([json.dumps({"v": 1, "op": "import", "path": path}).encode()],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    r = json.loads(s.recv(65536).decode())
    out += [str(r.get("ok")), str(r.get("errno", 0))]
print(" ".join(out))
`

// TestAttackImportOthersMemfd (G4): uid 1000 holds a read-only descriptor
// of uid 1001's memfd, which memfd_create left 0777, and imports it. The
// daemon makes an imported memfd owner-only (memfdOwnerOnly), and as root
// it could: it would change uid 1001's file, which uid 1000 itself cannot
// (its fchmod is EPERM). The daemon must change no file its importer
// could not: the import is refused (EPERM) and the memfd keeps its mode.
// An owner-only memfd of uid 1001's, which no reader could open again for
// writing, is imported as it is.
func TestAttackImportOthersMemfd(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		name := fmt.Sprintf("tensorfs-victim-%s-%d", mode, os.Getpid())
		v := startPythonAs(t, userB, "victim", othersMemfdVictimScript, name)
		if r := v.next(t); r != "0o777 0o600" {
			t.Fatalf("victim's memfds: %s, want 0o777 0o600", r)
		}
		out := strings.TrimSpace(pythonAs(t, userA, "/", othersMemfdImportScript, sock, name, "shared/weights", "shared/private"))
		t.Logf("uid %d: own fchmod errno, then ok and errno of each import: %s", userA, out)
		if want := fmt.Sprintf("%d False %d True 0", unix.EPERM, unix.EPERM); out != want {
			t.Errorf("uid %d's fchmod and imports of uid %d's memfds (0777, 0600): %q, want %q (its fchmod EPERM, the 0777 one refused EPERM, the owner-only one imported)", userA, userB, out, want)
		}
		if _, err := os.Lstat(m.path("shared/weights")); !os.IsNotExist(err) {
			t.Errorf("shared/weights after the refused import: %v, want no such segment", err)
		}
		if b, err := os.ReadFile(m.path("shared/private")); err != nil || !strings.HasPrefix(string(b), "PRIVATE!") {
			t.Errorf("shared/private: %.8q, %v; want the owner-only memfd's bytes", b, err)
		}
		v.send(t, "")
		if r := v.next(t); r != "0o777 0o600 WEIGHTS!" {
			t.Errorf("victim's memfds after uid %d's imports: %s, want 0o777 0o600 WEIGHTS! (their modes unchanged)", userA, r)
		}
	})
}
