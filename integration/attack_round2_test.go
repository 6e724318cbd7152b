package integration

// The second round of attacks (the security issue's rows F1 to F9), each
// run as an unprivileged user against a real mount in both modes: a
// request of any kind reaches exactly the inode the kernel checked, with
// exactly the access the user has, and the daemon's rights never serve
// it.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// team is the group of the shared team directory of the rename races.
const team = 2000

// runInGroups runs a command as uid with the supplementary groups given
// and returns its combined output and error.
func runInGroups(t *testing.T, uid int, groups []uint32, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: groups}}
	cmd.Dir = "/"
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// teamDir makes the team directory: root's, group team, mode 2775 (set-
// group-ID, no sticky bit), as a research group's shared directory is;
// userB keeps a 0600 secret in it, userA a file of its own.
func teamDir(t *testing.T, m *mount) (dir, secret, mine string) {
	t.Helper()
	dir = m.path("team")
	if err := os.Mkdir(dir, 0o775); err != nil {
		t.Fatal(err)
	}
	os.Chown(dir, 0, team)
	unix.Chmod(dir, 0o2775)
	secret, mine = filepath.Join(dir, "secret"), filepath.Join(dir, "mine")
	for _, f := range []struct {
		uid  int
		path string
		data string
		mode string
	}{{userB, secret, "B's secret, not A's", "600"}, {userA, mine, "A's own bytes here!", "644"}} {
		script := fmt.Sprintf("umask 077; printf %%s %q > %s && chmod %s %s", f.data, f.path, f.mode, f.path)
		if out, err := runInGroups(t, f.uid, []uint32{team}, "sh", "-c", script); err != nil {
			t.Fatalf("uid %d writes %s: %v\n%s", f.uid, f.path, err, out)
		}
	}
	return dir, secret, mine
}

// raceExchangeScript (argv: a, b, seconds, what) exchanges a and b with
// renameat2(RENAME_EXCHANGE) in one thread while, in the main thread, it
// opens a read-write and reads it, or truncates a to 4 bytes; it prints
// how many opens or truncates reached a file, and every distinct
// content it read.
const raceExchangeScript = `
import ctypes, json, os, sys, threading, time
a, b, secs, what = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
libc = ctypes.CDLL("libc.so.6", use_errno=True)
stop = time.time() + secs
def flip():
    while time.time() < stop:
        libc.renameat2(-100, a.encode(), -100, b.encode(), 2)  # RENAME_EXCHANGE
threading.Thread(target=flip, daemon=True).start()
n, seen = 0, set()
while time.time() < stop:
    try:
        if what == "open":
            fd = os.open(a, os.O_RDWR)
            seen.add(os.pread(fd, 64, 0).decode(errors="replace"))
            os.pwrite(fd, b"A", 0)
            os.close(fd)
        else:
            os.truncate(a, 4)
        n += 1
    except OSError:
        pass
print(json.dumps({"n": n, "seen": sorted(seen)}))
`

// TestAttackRenameExchangeOpen (F4): in a team directory, a user who
// exchanges its own file with another's 0600 file in a loop, while it
// opens its own read-write, never holds the other's file: every open
// reaches the inode the kernel checked (or is refused ESTALE and looked
// up again), in both modes.
func TestAttackRenameExchangeOpen(t *testing.T) {
	// Serial: the race keeps both CPUs busy for its seconds.
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		_, secret, mine := teamDir(t, m)
		out, err := runInGroups(t, userA, []uint32{team}, systemPython, "-c", raceExchangeScript, mine, secret, "4", "open")
		if err != nil {
			t.Fatalf("race: %v\n%s", err, out)
		}
		var res struct {
			N    int
			Seen []string
		}
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("race said %q: %v", out, err)
		}
		t.Logf("%d opens reached a file; contents seen: %q", res.N, res.Seen)
		if res.N == 0 {
			t.Errorf("no open reached a file: the race tested nothing")
		}
		for _, s := range res.Seen {
			if strings.Contains(s, "B's secret") {
				t.Errorf("uid %d read uid %d's 0600 file through its own name: %q", userA, userB, s)
			}
		}
		for _, p := range []string{secret, mine} { // the names may be swapped; the contents are what count
			b, _ := os.ReadFile(p)
			if strings.HasPrefix(string(b), "A") && strings.Contains(string(b), "secret") {
				t.Errorf("uid %d wrote into uid %d's file: %q", userA, userB, b)
			}
		}
		if got := readBOf(t, secret, mine); got != "B's secret, not A's" {
			t.Errorf("uid %d's secret reads %q after the race", userB, got)
		}
	})
}

// readBOf returns the content of whichever of the two files is userB's.
func readBOf(t *testing.T, paths ...string) string {
	t.Helper()
	for _, p := range paths {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil && st.Uid == userB {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			return string(b)
		}
	}
	t.Fatalf("neither of %v is uid %d's any more", paths, userB)
	return ""
}

// TestAttackRenameExchangeTruncate (F4, truncate): the same race with
// truncate(2) of its own name never shrinks the other user's file.
func TestAttackRenameExchangeTruncate(t *testing.T) {
	// Serial, as TestAttackRenameExchangeOpen.
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		_, secret, mine := teamDir(t, m)
		out, err := runInGroups(t, userA, []uint32{team}, systemPython, "-c", raceExchangeScript, mine, secret, "3", "truncate")
		if err != nil {
			t.Fatalf("race: %v\n%s", err, out)
		}
		t.Logf("race: %s", strings.TrimSpace(out))
		if got := readBOf(t, secret, mine); got != "B's secret, not A's" {
			t.Errorf("uid %d's secret reads %q after uid %d's truncate race", userB, got, userA)
		}
	})
}

// TestAttackExchangeIntoNoCreate (F7): a NOCREATE directory takes no new
// names from an exchange either: the user's file does not get in, and
// the sealed segment stays.
func TestAttackExchangeIntoNoCreate(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sealed := m.path("sealed")
		if err := os.Mkdir(sealed, 0o1777); err != nil {
			t.Fatal(err)
		}
		unix.Chmod(sealed, 0o1777)
		if out, err := runAs(t, userA, "/", "sh", "-c", "printf sealed > "+sealed+"/x && printf mine > "+m.path("shared/mine")); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "NOCREATE", sealed)
		// Either way round: the sealed name as the source or the target.
		for _, pair := range [][2]string{{m.path("shared/mine"), sealed + "/x"}, {sealed + "/x", m.path("shared/mine")}} {
			out, _ := runAs(t, userA, "/", systemPython, "-c", `
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
r = libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2)
print(r, ctypes.get_errno())`, pair[0], pair[1])
			if f := strings.Fields(out); len(f) != 2 || f[0] != "-1" || f[1] != strconv.Itoa(int(syscall.EPERM)) {
				t.Errorf("RENAME_EXCHANGE of %s and %s, into a NOCREATE directory: %q, want -1 EPERM", pair[0], pair[1], out)
			}
		}
		if b, _ := os.ReadFile(sealed + "/x"); string(b) != "sealed" {
			t.Errorf("the sealed directory's segment reads %q", b)
		}
	})
}

// TestAttackIoctl (F9): no ioctl reaches a backing file or directory: on
// a segment of a SHARED directory (its bytes on an ext4 --disk), FITRIM
// and FS_IOC_GETVERSION answer ENOTTY, and so do FS_IOC_GETFLAGS and
// FS_IOC_SETFLAGS (the immutable flag) on a directory.
func TestAttackIoctl(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		disk := filepath.Join(t.TempDir(), "disk")
		m := mountFS(t, mode, "--allow-other", "--disk", disk)
		reachable(t, m.dir)
		dir := m.path("shared")
		os.Mkdir(dir, 0o1777)
		unix.Chmod(dir, 0o1777)
		out, err := runAs(t, userA, "/", systemPython, "-c", `
import fcntl, os, struct, sys
d = sys.argv[1] + "/mine"
os.mkdir(d)
os.setxattr(d, "user.tensorfs.flags", b"SHARED")
fd = os.open(d + "/seg", os.O_CREAT | os.O_RDWR, 0o600)
os.write(fd, b"x" * 4096)
dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
res = []
for name, f, req, buf in (("FITRIM", fd, 0xc0185879, struct.pack("QQQ", 0, 2**64 - 1, 0)),
                          ("FS_IOC_GETVERSION", fd, 0x80087601, b"\0" * 8),
                          ("FS_IOC_GETFLAGS dir", dfd, 0x80086601, b"\0" * 8),
                          ("FS_IOC_SETFLAGS dir", dfd, 0x40086602, struct.pack("l", 0x10))):
    try:
        fcntl.ioctl(f, req, buf)
        res.append(name + " ran")
    except OSError as e:
        res.append(name + " " + str(e.errno))
print(",".join(res))`, dir)
		if err != nil {
			t.Fatalf("ioctl script: %v\n%s", err, out)
		}
		for _, r := range strings.Split(strings.TrimSpace(out), ",") {
			if !strings.HasSuffix(r, " "+strconv.Itoa(int(syscall.ENOTTY))) {
				t.Errorf("ioctl as uid %d: %s, want ENOTTY", userA, r)
			}
		}
		// The backing directory did not become immutable.
		if err := os.WriteFile(m.path("shared/mine/after"), []byte("ok"), 0o644); err != nil {
			t.Errorf("a file in the directory after the ioctls: %v", err)
		}
	})
}

// exportScript (argv: socket, path, write) asks export and prints the
// descriptor's access mode, whether a write through it worked, and the
// first bytes.
const exportScript = `
import array, json, os, socket, sys
sock, path, write = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sock)
s.send(json.dumps({"v": 1, "op": "export", "path": path, "write": write}).encode())
fds = array.array("i")
msg, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(4 * fds.itemsize))
for level, kind, data in anc:
    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
reply = json.loads(msg)
if not fds:
    print(json.dumps({"ok": False, "errno": reply.get("errno")}))
    sys.exit()
fd = fds[0]
acc = os.O_ACCMODE & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
try:
    os.pwrite(fd, b"HACKED", 0)
    wrote = True
except OSError:
    wrote = False
print(json.dumps({"ok": True, "rdonly": acc == os.O_RDONLY, "wrote": wrote, "head": os.pread(fd, 8, 0).decode()}))
`

// keepFDDir makes rel, a KEEPFD directory of uid's that everyone may
// search and list, as uid, and returns its path.
func keepFDDir(t *testing.T, m *mount, uid int, rel string) string {
	t.Helper()
	p := m.path(rel)
	if out, err := runAs(t, uid, "/", "sh", "-c", "mkdir "+p+" && chmod 755 "+p+" && setfattr -n user.tensorfs.flags -v KEEPFD "+p); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return p
}

// TestAttackExportImported (F1): another user's export of a KEEPFD
// segment that its publisher imported (0444) is a new read-only open of
// the publisher's memfd: no write through it reaches the publisher's
// tensor, and asking for write is refused.
func TestAttackExportImported(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		keepFDDir(t, m, userB, "shared/pub")
		// userB publishes a memfd and keeps it, to check its bytes later.
		b := startPythonAs(t, userB, "publisher", `
import array, json, os, socket, sys
fd = os.memfd_create("weights")
os.write(fd, b"WEIGHTS!" * 4)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.sendmsg([json.dumps({"v": 1, "op": "import", "path": "shared/pub/w"}).encode()],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
print(s.recv(65536).decode(), flush=True)
sys.stdin.readline()
print(os.pread(fd, 8, 0).decode(), flush=True)
`, sock)
		if r := b.next(t); !strings.Contains(r, `"ok": true`) && !strings.Contains(r, `"ok":true`) {
			t.Fatalf("publish: %s", r)
		}
		var got struct {
			OK     bool
			Errno  int
			Rdonly bool
			Wrote  bool
			Head   string
		}
		out := pythonAs(t, userA, "/", exportScript, sock, "shared/pub/w", "0")
		if err := json.Unmarshal([]byte(out), &got); err != nil || !got.OK {
			t.Fatalf("read-only export by uid %d: %q (%v)", userA, out, err)
		}
		if !got.Rdonly || got.Wrote || got.Head != "WEIGHTS!" {
			t.Errorf("export of another user's import: %+v; want a read-only descriptor that reads WEIGHTS! and takes no write", got)
		}
		out = pythonAs(t, userA, "/", exportScript, sock, "shared/pub/w", "1")
		if json.Unmarshal([]byte(out), &got) != nil || got.OK || got.Errno != int(syscall.EACCES) && got.Errno != int(syscall.EPERM) {
			t.Errorf("export with write of a 0444 import: %s, want EACCES or EPERM", out)
		}
		b.send(t, "")
		if head := b.next(t); head != "WEIGHTS!" {
			t.Errorf("the publisher's memfd reads %q after the exports, want WEIGHTS!", head)
		}
	})
}

// TestAttackDirectoryFlood (F2): a user who makes the daemon look up
// thousands of directories cannot make it hold a descriptor for each: the
// daemon's descriptors stay bounded, and root's cat, create and ls on the
// mount keep working.
func TestAttackDirectoryFlood(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		os.WriteFile(m.path("plain"), []byte("still here"), 0o644)
		out, err := runAs(t, userA, "/", systemPython, "-c", `
import os, sys
d = sys.argv[1] + "/flood"
os.mkdir(d)
for i in range(3000):
    p = "%s/%d" % (d, i)
    os.mkdir(p)
    try:
        os.stat(p + "/x")
    except FileNotFoundError:
        pass
print("done")`, m.path("shared"))
		if err != nil {
			t.Fatalf("flood: %v\n%s", err, out)
		}
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("the daemon holds %d descriptors", fds)
		if fds > 1024+256 {
			t.Errorf("after 3000 directories the daemon holds %d descriptors; the directory cache bounds them to 1024 idle", fds)
		}
		if b, err := os.ReadFile(m.path("plain")); err != nil || string(b) != "still here" {
			t.Errorf("root's cat after the flood: %q, %v", b, err)
		}
		if err := os.WriteFile(m.path("new"), []byte("x"), 0o644); err != nil {
			t.Errorf("root's create after the flood: %v", err)
		}
		if _, err := os.ReadDir(m.path("shared/flood")); err != nil {
			t.Errorf("root's ls after the flood: %v", err)
		}
	})
}

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

// TestAttackSubtreeUsage (F8): rbytes and rsegments of a directory count
// nothing of a subdirectory the asker may not list.
func TestAttackSubtreeUsage(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		private := m.path("shared/private")
		os.Mkdir(private, 0o700)
		if err := os.WriteFile(private+"/w", make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.path("shared/open"), make([]byte, 1000), 0o644); err != nil {
			t.Fatal(err)
		}
		get := func(uid int, attr string) string {
			out, err := runAs(t, uid, "/", "getfattr", "--absolute-names", "--only-values", "-n", attr, m.path("shared"))
			if err != nil {
				t.Fatalf("getfattr %s as %d: %v\n%s", attr, uid, err, out)
			}
			return out
		}
		if b, s := get(0, "user.tensorfs.rbytes"), get(0, "user.tensorfs.rsegments"); b != strconv.Itoa(1<<20+1000) || s != "2" {
			t.Errorf("root: rbytes %s, rsegments %s; want %d and 2", b, s, 1<<20+1000)
		}
		if b, s := get(userA, "user.tensorfs.rbytes"), get(userA, "user.tensorfs.rsegments"); b != "1000" || s != "1" {
			t.Errorf("uid %d: rbytes %s, rsegments %s; want 1000 and 1 (nothing of root's 0700 directory)", userA, b, s)
		}
	})
}
