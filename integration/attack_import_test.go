package integration

// Attacks on imports, each run as an unprivileged user in both modes: an
// imported segment's holders name only the processes that map it through
// the mount and its sender's, and the daemon changes no memfd mode its
// importer could not.

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAttackHoldersOfImport (F6): an imported segment's holders name the
// processes that map it through the mount and its sender's own, never
// another user's process that maps the sender's file by itself.
func TestAttackHoldersOfImport(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		shm, err := os.CreateTemp("/dev/shm", "tensorfs-holders-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(shm.Name()) })
		shm.Write(make([]byte, 4096))
		shm.Chmod(0o644)
		shm.Close()
		// Root maps the file, as a process of another user would.
		rootMapper := startPython(t, "root-mapper", `
import mmap, os, sys
f = open(sys.argv[1], "rb")
mm = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
f.close()
print("mapped", os.getpid(), flush=True)
sys.stdin.readline()
`, shm.Name())
		rootPid := strings.Fields(rootMapper.next(t))[1]
		out := pythonAs(t, userA, "/", attackImportScript, sock, shm.Name(), "r", "shared/imp")
		if !strings.Contains(out, `"ok": true`) && !strings.Contains(out, `"ok":true`) {
			t.Fatalf("import of a readable /dev/shm file: %s", out)
		}
		time.Sleep(150 * time.Millisecond) // past the mapping scan's cache
		holders, err := runAs(t, userA, "/", "getfattr", "--absolute-names", "--only-values", "-n", "user.tensorfs.holders", m.path("shared/imp"))
		if err != nil {
			t.Fatalf("getfattr holders: %v\n%s", err, holders)
		}
		for _, line := range strings.Split(holders, "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == rootPid {
				t.Errorf("holders of uid %d's import name root's process %s, which maps the file by itself:\n%s", userA, rootPid, holders)
			}
		}
		rootMapper.send(t, "")
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
