package integration

// Attacks on the descriptors the control socket's export and load hand
// out (A4, A8, F1): each is a new open file description with exactly the
// access asked for and permitted. A read-only descriptor of a memfd,
// an imported one or the simulated GPU's device memory, cannot be opened
// again for writing through /proc/self/fd by another user; a writable
// export of device memory is a description of the peer's own, not the
// daemon's (or its GPU helper's), and cannot change the memory's size;
// another user's export of an imported segment is read-only.

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// descAttackScript connects to the socket argv[1] and sends the request
// argv[2] (JSON) argv[3] times, each on a connection of its own, keeping
// every descriptor received. For each it tries to open /proc/self/fd/N
// again for reading and writing (and writes HACKED at offset 0 through
// what it got), reads the file's seals, and, when argv[4] is "1", tries to
// grow it and then to shrink it to 4 KiB. It then seeks the first
// descriptor to 4242, reports where the others stand, and prints one JSON
// object.
const descAttackScript = `
import array, fcntl, json, os, socket, sys
sock, req, times, resize = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
out = {"replies": [], "fds": []}
fds = []
for _ in range(times):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sock)
    s.send(req.encode())
    data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(253 * 4), socket.MSG_CMSG_CLOEXEC)
    out["replies"].append(json.loads(data))
    fds += [fd for level, typ, d in anc if (level, typ) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
            for fd in array.array("i", d[:len(d) - len(d) % 4])]
    s.close()
def err(fn):
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno
for fd in fds:
    r = {"acc": fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE, "size": os.fstat(fd).st_size,
         "mode": os.fstat(fd).st_mode & 0o7777, "link": os.readlink("/proc/self/fd/%d" % fd)}
    try:
        up = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)
        r["upgrade"] = 0
        r["hacked"] = err(lambda: os.pwrite(up, b"HACKED", 0))
        os.close(up)
    except OSError as e:
        r["upgrade"] = e.errno
    try:
        r["seals"] = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        r["seals"] = -e.errno
    if resize:
        size = os.fstat(fd).st_size
        r["grow"] = err(lambda: os.ftruncate(fd, size + (4 << 20)))
        r["shrink"] = err(lambda: os.ftruncate(fd, 4096))
        r["size_after"] = os.fstat(fd).st_size
    out["fds"].append(r)
if len(fds) > 1:
    os.lseek(fds[0], 4242, os.SEEK_SET)
    out["others_at"] = [os.lseek(fd, 0, os.SEEK_CUR) for fd in fds[1:]]
print(json.dumps(out))
`

// descResult is what descAttackScript prints.
type descResult struct {
	Replies []struct {
		OK    bool `json:"ok"`
		Errno int  `json:"errno"`
	} `json:"replies"`
	FDs []struct {
		Acc       int    `json:"acc"`
		Size      int64  `json:"size"`
		Mode      int    `json:"mode"`
		Link      string `json:"link"`
		Upgrade   int    `json:"upgrade"`
		Hacked    int    `json:"hacked"`
		Seals     int    `json:"seals"`
		Shrink    int    `json:"shrink"`
		Grow      int    `json:"grow"`
		SizeAfter int64  `json:"size_after"`
	} `json:"fds"`
	OthersAt []int64 `json:"others_at"`
}

// descAttack runs descAttackScript as uid with the control request req,
// sent times times, and returns what it found.
func descAttack(t *testing.T, uid int, sock string, req map[string]any, times int, resize bool) descResult {
	t.Helper()
	b, _ := json.Marshal(req)
	r := "0"
	if resize {
		r = "1"
	}
	out := pythonAs(t, uid, "/", descAttackScript, sock, string(b), strconv.Itoa(times), r)
	var got descResult
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("attacker printed %q: %v", out, err)
	}
	for i, rep := range got.Replies {
		if !rep.OK {
			t.Fatalf("uid %d request %s (%d): errno %d", uid, b, i, rep.Errno)
		}
	}
	if len(got.FDs) == 0 {
		t.Fatalf("uid %d request %s: no descriptor", uid, b)
	}
	return got
}

// TestAttackUpgradeImportedMemfd (A8): userB imports a memfd (0444 in a
// KEEPFD directory); userA's read-only export and load of it are
// read-only descriptors that cannot be reopened for writing through
// /proc/self/fd, so the publisher's tensor keeps its bytes. The import
// makes the memfd owner-only: the publisher keeps its own access. A file
// of /dev/shm, reachable by its path anyway, keeps the mode its owner
// gave it.
func TestAttackUpgradeImportedMemfd(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m := attackMount(t, mode, true)
		sock := controlSocket(t, m)
		keepFDDir(t, m, userB, "shared/pub")
		shm := filepath.Join("/dev/shm", "tensorfs-desc-"+mode+"-"+strconv.Itoa(os.Getpid()))
		os.Remove(shm)
		t.Cleanup(func() { os.Remove(shm) })
		b := startPythonAs(t, userB, "publisher", `
import array, json, os, socket, sys
def publish(fd, path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.sendmsg([json.dumps({"v": 1, "op": "import", "path": path}).encode()],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    return json.loads(s.recv(65536).decode())["ok"]
fd = os.memfd_create("weights")
os.write(fd, b"WEIGHTS!" * 512)
shm = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
os.fchmod(shm, 0o644)
os.write(shm, b"SHMFILE!")
print(publish(fd, "shared/pub/w"), publish(shm, "shared/pub/shm"), oct(os.fstat(fd).st_mode & 0o777), oct(os.fstat(shm).st_mode & 0o777), flush=True)
sys.stdin.readline()
# The publisher still writes its tensor and can open it again.
os.pwrite(fd, b"OWNER", 8)
again = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)
print(os.pread(fd, 16, 0).decode(), os.pread(again, 5, 8).decode(), flush=True)
`, sock, shm)
		r := b.next(t)
		if !strings.HasPrefix(r, "True True ") {
			t.Fatalf("publish: %q, want both imported", r)
		}
		if r != "True True 0o700 0o644" {
			t.Errorf("after the imports the memfd and the /dev/shm file are %q, want 0o700 (owner-only) and 0o644 (as their owner made them)", r[len("True True "):])
		}
		for _, req := range []map[string]any{
			{"v": 1, "op": "export", "path": "shared/pub/w", "write": false},
			{"v": 1, "op": "load", "path": "shared/pub"},
		} {
			got := descAttack(t, userA, sock, req, 1, false)
			for _, f := range got.FDs {
				if !strings.HasPrefix(f.Link, "/memfd:") {
					continue
				}
				if f.Acc != syscall.O_RDONLY || f.Upgrade != int(syscall.EACCES) || f.Mode&0o077 != 0 {
					t.Errorf("%v: uid %d got %+v; want a read-only descriptor of an owner-only memfd that /proc/self/fd does not open for writing (EACCES)", req["op"], userA, f)
				}
			}
		}
		b.send(t, "")
		if r := b.next(t); r != "WEIGHTS!OWNERTS! OWNER" {
			t.Errorf("the publisher's memfd reads %q after the attacks, want WEIGHTS!OWNERTS! OWNER (its own writes only)", r)
		}
	})
}

// descDeviceMount mounts m's mode with --gpu sim --allow-other, with a
// KEEPFD directory "keep" on cuda:0 holding, on the device, "ro" (root's,
// 0644) and "rw" (0666), both the bytes of one random file, which it
// returns.
func descDeviceMount(t *testing.T, mode string) (*mount, string) {
	t.Helper()
	m := mountFS(t, mode, append(gtSim, "--allow-other")...)
	reachable(t, m.dir)
	if err := os.Chmod(m.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := m.path("keep")
	run(t, "mkdir", dir)
	run(t, "setfattr", "-n", gtFlags, "-v", "KEEPFD", dir)
	gtSetDevice(t, dir, "cuda:0")
	src := gtRandom(t, "src", 3*gtMiB+11)
	for name, perm := range map[string]os.FileMode{"ro": 0o644, "rw": 0o666} {
		seg := filepath.Join(dir, name)
		run(t, "cp", src, seg)
		gtWantDevice(t, seg, "cuda:0")
		if err := os.Chmod(seg, perm); err != nil {
			t.Fatal(err)
		}
	}
	return m, src
}

// TestAttackUpgradeDeviceExport (A4): userA's read-only export of a
// device segment of the sim (its memory a memfd of the GPU helper) cannot
// be opened again for writing through /proc/self/fd; the segment keeps
// its bytes.
func TestAttackUpgradeDeviceExport(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m, src := descDeviceMount(t, mode)
		sock := controlSocket(t, m)
		got := descAttack(t, userA, sock, map[string]any{"v": 1, "op": "export", "path": "keep/ro", "write": false}, 1, false)
		f := got.FDs[0]
		if f.Acc != syscall.O_RDONLY || f.Upgrade != int(syscall.EACCES) || f.Mode&0o077 != 0 {
			t.Errorf("read-only export of a device segment: %+v; want a read-only descriptor of an owner-only memfd that /proc/self/fd does not open for writing (EACCES)", f)
		}
		run(t, "cmp", src, m.path("keep/ro"))
	})
}

// TestAttackDeviceExportWritable (A4): userA's writable exports of a
// device segment (0666) are descriptions of userA's own, none shared
// with another export or with the GPU helper (a seek on one moves no
// other), of memory sealed against any change of size: a shrink and a
// grow fail with EPERM. The daemon and its GPU helper survive, the
// segment keeps its bytes, and host segments keep serving.
func TestAttackDeviceExportWritable(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		m, src := descDeviceMount(t, mode)
		sock := controlSocket(t, m)
		got := descAttack(t, userA, sock, map[string]any{"v": 1, "op": "export", "path": "keep/rw", "write": true}, 2, true)
		const want = unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_SEAL
		for _, f := range got.FDs {
			if f.Acc != syscall.O_RDWR || f.Seals&want != want || f.Shrink != int(syscall.EPERM) || f.Grow != int(syscall.EPERM) || f.SizeAfter != f.Size {
				t.Errorf("writable export of a device segment: %+v; want read-write, sealed (seals %#x), shrink and grow EPERM, the size kept", f, want)
			}
		}
		if len(got.OthersAt) != 1 || got.OthersAt[0] != 0 {
			t.Errorf("a seek on one writable export moved the other to %v: they share one open file description, want one each", got.OthersAt)
		}
		// The daemon and its helper survived: the device segment reads
		// back through the mount, and a host segment serves.
		run(t, "cmp", src, m.path("keep/rw"))
		gtWantDevice(t, m.path("keep/rw"), "cuda:0")
		host := m.path("host")
		if err := os.WriteFile(host, []byte("still serving"), 0o644); err != nil {
			t.Fatalf("host segment after the attack: %v", err)
		}
		if b, err := os.ReadFile(host); err != nil || string(b) != "still serving" {
			t.Errorf("host segment after the attack reads %q %v", b, err)
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
