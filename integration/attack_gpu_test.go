package integration

// Attacks on GPU segments by unprivileged users (DESIGN.md §9) on a
// --gpu sim --allow-other mount: consumer reference counters that only a
// segment's readers can change, one file per segment, following chmod and
// chown and removed with the segment; IPC handles that reach their own
// segment's memory alone; device memory in limbo counted against
// --capacity; GPU segments' descriptors in their owner's budget; and a
// reader's export racing the owner's truncate.

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// agCounterAdd is a consumer of a counter file: it maps argv[1] and
// atomically adds argv[3] to the int64 at offset argv[2] (libatomic, or a
// plain add where it is missing), then prints the new value.
const agCounterAdd = `
import ctypes, mmap, os, sys
path, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, off + 8)
os.close(fd)
cell = ctypes.c_int64.from_buffer(m, off)
try:
    fetch_add = ctypes.CDLL("libatomic.so.1")["__atomic_fetch_add_8"]
    fetch_add.restype = ctypes.c_int64
    fetch_add.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    print(fetch_add(ctypes.addressof(cell), n, 5) + n)
except OSError:
    cell.value += n
    print(cell.value)
del cell
m.close()
`

// agAccess tries, for each path argv[2:], to open it with the flags argv[1]
// names ("r" or "rw"), and prints ok or denied for each in one line.
const agAccess = `
import os, sys
flags = {"r": os.O_RDONLY, "rw": os.O_RDWR}[sys.argv[1]]
out = []
for p in sys.argv[2:]:
    try:
        os.close(os.open(p, flags))
        out.append("ok")
    except PermissionError:
        out.append("denied")
print(" ".join(out))
`

// agXattrs prints, for the segment argv[1], the hex of its IPC handle,
// its offset and its ref_counter, one a line, read by the calling user.
const agXattrs = `
import os, sys
p = sys.argv[1]
print(os.getxattr(p, "user.tensorfs.cuda.ipc_handle").hex())
print(os.getxattr(p, "user.tensorfs.cuda.offset").decode())
print(os.getxattr(p, "user.tensorfs.cuda.ref_counter").decode())
`

// agMount mounts --gpu sim --allow-other where unprivileged users reach it.
func agMount(t *testing.T) *mount {
	t.Helper()
	m := mountFS(t, "passthrough", append(gtSim, "--allow-other")...)
	reachable(t, m.dir)
	if err := os.Chmod(m.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return m
}

// agSegment makes a device segment of size bytes at rel, owned by
// uid:gid with mode, and returns its path.
func agSegment(t *testing.T, m *mount, rel string, size int64, uid, gid int, mode os.FileMode) string {
	t.Helper()
	p := gtDeviceSegment(t, m.path(rel))
	run(t, "truncate", "-s", strconv.FormatInt(size, 10), p)
	if err := os.Chown(p, uid, gid); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

// agCounter returns the counter file of seg, read by root, checking the
// PATH:0 form.
func agCounter(t *testing.T, seg string) string {
	t.Helper()
	v := string(gtGetfattr(t, seg, gtRefCounter))
	path, off, ok := strings.Cut(v, ":")
	if !ok || off != "0" || !filepath.IsAbs(path) {
		t.Fatalf("%s of %s = %q, want ABSPATH:0", gtRefCounter, seg, v)
	}
	return path
}

// agAdd adds n to the counter file path as uid and returns the new value.
func agAdd(t *testing.T, uid int, path string, n int) string {
	t.Helper()
	return strings.TrimSpace(pythonAs(t, uid, "/", agCounterAdd, path, "0", strconv.Itoa(n)))
}

// agCanOpen reports, as uid, for each path whether open with flags ("r"
// or "rw") succeeds: "ok" or "denied", space-separated.
func agCanOpen(t *testing.T, uid int, flags string, paths ...string) string {
	t.Helper()
	return strings.TrimSpace(pythonAs(t, uid, "/", agAccess, append([]string{flags}, paths...)...))
}

// agValue reads the counter file path as root.
func agValue(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil || len(b) < 8 {
		t.Fatalf("counter %s: %d bytes, %v", path, len(b), err)
	}
	return int64(binary.LittleEndian.Uint64(b))
}

// agGone waits until path no longer exists.
func agGone(t *testing.T, what, path string) {
	t.Helper()
	eventually(t, what, func() (bool, string) {
		_, err := os.Stat(path)
		return os.IsNotExist(err), fmt.Sprintf("stat %s: %v", path, err)
	})
}

// TestAttackGPUCounterReader: a reader of a segment (uid 1000, the segment
// 0644 of root) finds its counter in ref_counter and increments and
// decrements it through the file; the daemon honours the count (the memory
// of the segment, unlinked, waits in limbo until the count drops to zero)
// and removes the counter file once the limbo drains. The directory of
// counters can be traversed, not listed or written.
func TestAttackGPUCounterReader(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "a", 3*gtMiB, 0, 0, 0o644)
	rc := string(gtGetfattr(t, seg, gtRefCounter))
	lines := strings.Split(strings.TrimSpace(pythonAs(t, userA, "/", agXattrs, seg)), "\n")
	if len(lines) != 3 || lines[1] != "0" || lines[2] != rc {
		t.Fatalf("cuda attributes read by uid %d: %q; want handle, 0, %q", userA, lines, rc)
	}
	counter := agCounter(t, seg)

	var st syscall.Stat_t
	if err := syscall.Stat(counter, &st); err != nil || st.Uid != 0 || st.Mode&0o7777 != 0o666 {
		t.Errorf("counter of a 0644 segment of root: uid %d mode %#o (%v); want 0 and 0666", st.Uid, st.Mode&0o7777, err)
	}
	dir := filepath.Dir(counter)
	if err := syscall.Stat(dir, &st); err != nil || st.Uid != 0 || st.Mode&0o7777 != 0o711 {
		t.Errorf("counter directory %s: uid %d mode %#o (%v); want 0 and 0711", dir, st.Uid, st.Mode&0o7777, err)
	}
	out, err := runAs(t, userB, "/", systemPython, "-c", `
import os, sys
d = sys.argv[1]
for f in (lambda: os.listdir(d), lambda: open(os.path.join(d, "planted"), "w"), lambda: os.unlink(sys.argv[2])):
    try:
        f()
        print("allowed")
    except PermissionError:
        print("denied")
`, dir, counter)
	if err != nil || strings.Join(strings.Fields(out), " ") != "denied denied denied" {
		t.Errorf("uid %d listing, writing and unlinking in the counter directory: %q %v; want denied thrice", userB, out, err)
	}

	if got := agAdd(t, userA, counter, 1); got != "1" {
		t.Fatalf("uid %d increments the counter: %q, want 1", userA, got)
	}
	if v := agValue(t, counter); v != 1 {
		t.Errorf("counter after the increment = %d", v)
	}
	run(t, "rm", seg)
	eventually(t, "unlinked while counted", gtLimboIs(t, m, 1, 3*gtMiB))
	gtStaysInLimbo(t, m, "limbo while uid 1000's count is 1", 1, 3*gtMiB)
	if _, err := os.Stat(counter); err != nil {
		t.Errorf("counter file gone while the limbo holds the segment's memory: %v", err)
	}
	if got := agAdd(t, userA, counter, -1); got != "0" {
		t.Fatalf("uid %d decrements the counter: %q, want 0", userA, got)
	}
	gtWantLimboEmpty(t, m, "uid 1000's count back to 0")
	agGone(t, "the counter file of the unlinked segment, limbo drained", counter)

	// With no count and nothing in limbo, unlink removes the file at once.
	seg2 := agSegment(t, m, "b", gtMiB, 0, 0, 0o644)
	counter2 := agCounter(t, seg2)
	run(t, "rm", seg2)
	agGone(t, "the counter file of a segment unlinked at count 0", counter2)
}

// TestAttackGPUCounterOtherUser: uid 1001 cannot open, read or write the
// counter of a 0600 segment of uid 1000, nor read its attributes; and
// trashing the counter file of another segment, which it may write, does
// not touch that count.
func TestAttackGPUCounterOtherUser(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	private := agSegment(t, m, "private", 2*gtMiB, userA, userA, 0o600)
	public := agSegment(t, m, "public", gtMiB, 0, 0, 0o644)
	pc, pub := agCounter(t, private), agCounter(t, public)

	var st syscall.Stat_t
	if err := syscall.Stat(pc, &st); err != nil || st.Uid != 0 || st.Gid != userA || st.Mode&0o7777 != 0o660 {
		t.Errorf("counter of a 0600 segment of uid %d: %d:%d mode %#o (%v); want 0:%d 0660 (root's, an ACL grants uid %d)",
			userA, st.Uid, st.Gid, st.Mode&0o7777, err, userA, userA)
	}
	if got := agCanOpen(t, userB, "rw", pc); got != "denied" {
		t.Errorf("uid %d opens the counter of uid %d's 0600 segment read-write: %s", userB, userA, got)
	}
	if got := agCanOpen(t, userB, "r", pc, private); got != "denied denied" {
		t.Errorf("uid %d opens the counter and the 0600 segment of uid %d read-only: %s", userB, userA, got)
	}
	if out, err := runAs(t, userB, "/", "getfattr", "-n", gtRefCounter, private); err == nil {
		t.Errorf("uid %d reads %s of uid %d's 0600 segment: %q", userB, gtRefCounter, userA, out)
	}
	if got := agAdd(t, userA, pc, 1); got != "1" {
		t.Fatalf("the owner increments its counter: %q", got)
	}

	// uid 1001 may write the public segment's counter: it trashes the file
	// (garbage, then longer); the private count does not move.
	out, err := runAs(t, userB, "/", systemPython, "-c", `
import sys
with open(sys.argv[1], "r+b") as f:
    f.write(b"\xff" * 4096)
print("written")
`, pub)
	if err != nil || strings.TrimSpace(out) != "written" {
		t.Fatalf("uid %d writing the public counter: %q %v", userB, out, err)
	}
	run(t, "rm", private)
	eventually(t, "private segment unlinked while counted", gtLimboIs(t, m, 1, 2*gtMiB))
	gtStaysInLimbo(t, m, "limbo while uid 1000's count is 1", 1, 2*gtMiB)
	if v := agValue(t, pc); v != 1 {
		t.Errorf("private counter = %d after another file was trashed, want 1", v)
	}
	if got := agAdd(t, userA, pc, -1); got != "0" {
		t.Fatalf("the owner decrements its counter: %q", got)
	}
	gtWantLimboEmpty(t, m, "private count back to 0")
	agGone(t, "the private counter, limbo drained", pc)
}

// TestAttackGPUSeparateSegments: two segments of two users never share a
// counter file or a device allocation: distinct IPC handles, offset 0, and
// each simulated allocation holds its own segment's bytes, then zeros.
func TestAttackGPUSeparateSegments(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	const size = 4096
	segs := []string{
		agSegment(t, m, "mine", 0, userA, userA, 0o644),
		agSegment(t, m, "theirs", 0, userB, userB, 0o644),
	}
	var want [][]byte
	for _, p := range segs {
		src := gtRandom(t, filepath.Base(p), size)
		run(t, "cp", src, p)
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, b)
	}
	var handles, counters []string
	for i, p := range segs {
		lines := strings.Split(strings.TrimSpace(pythonAs(t, userA, "/", agXattrs, p)), "\n")
		if len(lines) != 3 || lines[1] != "0" || !strings.HasSuffix(lines[2], ":0") {
			t.Fatalf("cuda attributes of %s read by uid %d: %q; want handle, 0, PATH:0", p, userA, lines)
		}
		handles, counters = append(handles, lines[0]), append(counters, lines[2])

		h, err := hex.DecodeString(lines[0])
		if err != nil || len(h) != 64 || string(h[:16]) != "tensorfs-sim-mem" {
			t.Fatalf("sim IPC handle of %s: %x %v", p, h, err)
		}
		pid, fd := binary.LittleEndian.Uint32(h[32:]), binary.LittleEndian.Uint32(h[36:])
		mem, err := os.ReadFile(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
		if err != nil {
			t.Fatal(err)
		}
		if len(mem) < size || !bytes.Equal(mem[:size], want[i]) || !bytes.Equal(mem[size:], make([]byte, len(mem)-size)) {
			t.Errorf("the allocation the IPC handle of %s maps (%d bytes) holds more than its %d bytes", p, len(mem), size)
		}
	}
	if handles[0] == handles[1] {
		t.Error("two segments share an IPC handle")
	}
	if counters[0] == counters[1] {
		t.Errorf("two segments share the counter file %s", counters[0])
	}
}

// TestAttackGPUCounterFollowsChmod: chmod and chown of a segment change who
// can open its counter file, which is always exactly who can read the
// segment (POSIX classes included: a group member is refused what others
// get).
func TestAttackGPUCounterFollowsChmod(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "s", gtMiB, 0, 0, 0o644)
	counter := agCounter(t, seg)
	for _, c := range []struct {
		uid, gid int
		mode     os.FileMode
		a, b     string // whether userA and userB may read it
	}{
		{0, 0, 0o644, "ok", "ok"},
		{0, 0, 0o600, "denied", "denied"},
		{0, userB, 0o640, "denied", "ok"},
		{0, userB, 0o604, "ok", "denied"},
		{userA, userB, 0o400, "ok", "denied"},
		{userA, userA, 0o044, "denied", "ok"},
		{0, 0, 0o222, "denied", "denied"},
	} {
		if err := os.Chown(seg, c.uid, c.gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(seg, c.mode); err != nil {
			t.Fatal(err)
		}
		for _, u := range []struct {
			uid  int
			want string
		}{{userA, c.a}, {userB, c.b}} {
			seg := agCanOpen(t, u.uid, "r", seg)
			cnt := agCanOpen(t, u.uid, "rw", counter)
			if seg != u.want || cnt != u.want {
				t.Errorf("segment %d:%d %#o: uid %d opens the segment: %s, its counter read-write: %s; want %s for both",
					c.uid, c.gid, c.mode, u.uid, seg, cnt, u.want)
			}
		}
	}
}

// TestAttackGPUSpillReserved (second fresh attack, F2): on a --capacity
// 32M mount, user B keeps 8 MiB in a GPU segment; user A fills the
// backing with a host segment and tries to grow a GPU segment of its own.
// B's device bytes have their backing space set aside, so A's writes stop
// short of it with ENOSPC, and a clean unmount and remount give B its
// bytes back.
func TestAttackGPUSpillReserved(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		victim := gtRandom(t, "victim", 8<<20)
		want := gtSha256(t, victim)
		seg := gtDeviceSegment(t, m.path("b/w"))
		if err := os.Chown(seg, userB, userB); err != nil {
			t.Fatal(err)
		}
		if out, err := runAs(t, userB, "/", "dd", "if="+victim, "of="+seg, "bs=1M", "conv=notrunc", "status=none"); err != nil {
			t.Fatalf("user B's write into its GPU segment: %v\n%s", err, out)
		}

		out, err := runAs(t, userA, "/", "dd", "if=/dev/zero", "of="+m.path("a/fill"), "bs=1M", "status=none")
		if err == nil || !strings.Contains(out, "No space left on device") {
			t.Errorf("user A filling the backing: %v %q, want ENOSPC", err, out)
		}
		if n := gtSize(t, m.path("a/fill")); n > 24<<20 {
			t.Errorf("user A wrote %d bytes into a 32 MiB backing holding 8 MiB of GPU bytes", n)
		}
		grow := gtDeviceSegment(t, m.path("a/g"))
		if err := os.Chown(grow, userA, userA); err != nil {
			t.Fatal(err)
		}
		if out, err := runAs(t, userA, "/", "truncate", "-s", "16M", grow); err == nil || !strings.Contains(out, "No space left on device") {
			t.Errorf("user A growing a GPU segment on a full backing: %v %q, want ENOSPC", err, out)
		}

		m.unmount(t, false)
		if strings.Contains(m.stderr.String(), "not spilled") {
			t.Errorf("a clean unmount did not spill a segment:\n%s", m.stderr.String())
		}
		m2 := m.remount(t)
		if got := gtSha256(t, m2.path("b/w")); got != want {
			t.Errorf("user B's GPU segment after user A filled the backing, unmount and remount: sha256 %s, want %s", got, want)
		}
		gtWantDevice(t, m2.path("b/w"), "cuda:0")
	}, append(gtSim, "--allow-other", "--capacity", "32M")...)
}

// limboFillScript opens the GPU segment argv[1] once and, holding that
// handle, grows it to argv[2] bytes, reads its IPC handle (as a consumer
// would before mapping it) and truncates it to 0 again and again, halving
// the size on each refusal down to one page: every truncate moves the
// segment to a new block, and the open handle keeps each old one, whose
// IPC handle left the daemon, in limbo. It prints how many rounds it
// made, and holds the handle until its stdin closes.
const limboFillScript = `
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size, rounds = int(sys.argv[2]), 0
while size >= 4096 and rounds < 100000:
    try:
        os.ftruncate(fd, size)
        os.getxattr(sys.argv[1], "user.tensorfs.cuda.ipc_handle")
        os.ftruncate(fd, 0)
        rounds += 1
    except OSError:
        size //= 2
print("rounds", rounds, flush=True)
sys.stdin.read()
`

// TestAttackGPULimboFill (H1): the device memory that a truncate replaces
// waits in limbo while any handle of the segment is open (devSeg.retire).
// User A, on a 32 MiB mount, holds one handle of its own GPU segment and
// grows it to a MiB and truncates it again and again: before, limbo took the whole
// device (the simulated device's 16 GiB; with CUDA, the GPU's memory)
// while df said the mount was empty. Device memory in limbo now counts
// against --capacity like the segments' own (a growth must leave the
// backing room for it), and df counts it as used; each user's limbo stops
// at a sixteenth of the capacity (ledger row "GPU device memory in
// limbo"): while A holds her share, user B's write into its own GPU
// segment and root's new one work, and once A lets her handle go limbo
// is empty.
func TestAttackGPULimboFill(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		atk := gtDeviceSegment(t, m.path("a/leak"))
		if err := os.Chown(atk, userA, userA); err != nil {
			t.Fatal(err)
		}
		vic := gtDeviceSegment(t, m.path("b/w"))
		if err := os.Chown(vic, userB, userB); err != nil {
			t.Fatal(err)
		}
		a := startPythonAs(t, userA, "limbo filler", limboFillScript, atk, "1048576")
		line := a.next(t)
		_, limbo := gtLimbo(t, m)
		t.Logf("uid %d: %s; limbo %d bytes", userA, line, limbo)
		if held := ledgerHeld(t, m, "GPU device memory in limbo", userA); held != 32<<20/16 {
			t.Errorf("uid %d's one handle keeps %d bytes of device memory in limbo on a 32 MiB mount (%d charged to her), want her sixteenth, %d", userA, limbo, held, 32<<20/16)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(m.dir, &st); err != nil {
			t.Fatal(err)
		}
		if used := int64(st.Blocks-st.Bfree) * st.Bsize; used < limbo {
			t.Errorf("df says %d bytes used while %d wait in limbo", used, limbo)
		}
		if out, err := runAs(t, userB, "/", "dd", "if=/dev/zero", "of="+vic, "bs=1M", "count=1", "conv=notrunc", "status=none"); err != nil {
			t.Errorf("uid %d's 1 MiB write into its GPU segment while uid %d holds her limbo: %v\n%s", userB, userA, err, out)
		}
		root := gtDeviceSegment(t, m.path("rootgpu"))
		if err := os.Truncate(root, 1<<20); err != nil {
			t.Errorf("root's 1 MiB GPU segment while uid %d holds her limbo: %v", userA, err)
		}
		a.stdin.Close()
		a.wait(t)
		gtWantLimboEmpty(t, m, "uid "+strconv.Itoa(userA)+" let its handle go")
	}, append(gtSim, "--allow-other", "--capacity", "32M")...)
}

// gpuFdFloodScript makes empty segments in the cuda:0 directory argv[1]
// until 50 in a row fail (the daemon's descriptors freed meanwhile go to
// the next) or it has tried argv[2], and prints how many it made and the
// last error; then it opens the directory up to 64 times (well within
// its budget of handles) to take the few descriptors left, and holds them
// until its stdin closes.
const gpuFdFloodScript = `
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
made, fails, err = 0, 0, "none"
for i in range(n):
    try:
        os.close(os.open("%s/s%d" % (d, i), os.O_CREAT | os.O_WRONLY, 0o600))
        made += 1
        fails = 0
    except OSError as e:
        err = "errno %d" % e.errno
        fails += 1
        if fails == 50:
            break
held = []
try:
    while len(held) < 64:
        held.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
except OSError:
    pass
print("made", made, err, "then held", len(held), "directory handles", flush=True)
sys.stdin.read()
`

// TestAttackGPUSegmentFdFlood (H2): every GPU segment keeps its backing
// file open in the daemon for as long as it exists (devices.segment
// opens it for the spill), and no per-uid budget counts those
// descriptors: only open handles, directories, imports and watches do.
// User A makes empty segments in a cuda:0 directory of its own (no
// device memory, no backing space: each is an inode) until the daemon's
// descriptor table is full; root's and user B's creates then fail with
// EMFILE, and a remount restores every segment, so the daemon starts
// full. Per-uid bounds must hold for these descriptors too.
func TestAttackGPUSegmentFdFlood(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		if err := os.Mkdir(m.path("a/gpu"), 0o755); err != nil {
			t.Fatal(err)
		}
		gtSetDevice(t, m.path("a/gpu"), "cuda:0")
		if err := os.Chown(m.path("a/gpu"), userA, userA); err != nil {
			t.Fatal(err)
		}
		_, limit := daemonFDs(t, m.pid)
		out := h4Background(t, userA, gpuFdFloodScript, m.path("a/gpu"), strconv.Itoa(limit+100))
		fds, _ := daemonFDs(t, m.pid)
		t.Logf("uid %d: %s; the daemon holds %d descriptors of %d", userA, strings.TrimSpace(out), fds, limit)
		if err := os.WriteFile(m.path("rootfile"), []byte("root"), 0o644); err != nil {
			t.Errorf("root's create after uid %d made empty GPU segments: %v", userA, err)
		}
		if out, err := runAs(t, userB, "/", "sh", "-c", "echo b > "+m.path("b/f")+" && cat "+m.path("b/f")); err != nil || out != "b\n" {
			t.Errorf("uid %d's create after uid %d made empty GPU segments: %q, %v", userB, userA, out, err)
		}
	}, append(gtSim, "--allow-other")...)
}

// exportSpamScript asks the control socket of the mount argv[2] (the
// tensorfs package at argv[1]) for a read-only descriptor of the segment
// argv[3] (relative to the mount) again and again for argv[4] seconds, and
// prints how many it got.
const exportSpamScript = `
import os, sys, time
sys.path.insert(0, sys.argv[1])
import tensorfs
c = tensorfs.Client(sys.argv[2])
stop, n = time.time() + float(sys.argv[4]), 0
while time.time() < stop:
    try:
        os.close(c.export(sys.argv[3]))
        n += 1
    except OSError:
        pass
print("exports", n, flush=True)
`

// truncateLoopScript, the owner's ordinary work on its GPU segment
// argv[1] for argv[2] seconds: grow it to 24 MiB, write its last page,
// read its last byte, shrink it to 8 MiB, and so on. It stops at the first
// error and prints it.
const truncateLoopScript = `
import os, sys, time
p, stop = sys.argv[1], time.time() + float(sys.argv[2])
fd, i = os.open(p, os.O_RDWR), 0
try:
    while time.time() < stop:
        size = (8 << 20) if i % 2 else (24 << 20)
        i += 1
        os.ftruncate(fd, size)
        os.pwrite(fd, b"v" * 4096, size - 4096)
        os.pread(fd, 1, size - 1)
    print("clean", i)
except OSError as e:
    print("error after", i, "truncates:", e)
`

// TestAttackGPUExportResizeRace (H3): devSeg.resize (a truncate through
// the mount) changes a GPU segment's block and size without devSeg.mu,
// while the control socket's export of a KEEPFD GPU segment moves it to a
// new exportable block of the size it read, under devSeg.mu. User A, who
// may only read user B's KEEPFD GPU segment, asks for its descriptor again
// and again while B grows and shrinks it: an export that read 8 MiB
// installs an 8 MiB block after B's truncate set 24 MiB. B's reads and
// writes past 8 MiB then fail with EINVAL, and a clean unmount cannot
// spill the segment ("not spilled; its contents are lost"): after the
// remount B's bytes are zeros. A reader must not be able to corrupt or
// empty an owner's segment. (The blocks the exports handed out wait in
// limbo while B's handle is open, against --capacity: B's loop may end
// with ENOSPC, never with another error.)
func TestAttackGPUExportResizeRace(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		seg := gtDeviceSegment(t, m.path("b/w"))
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "KEEPFD", seg)
		run(t, "truncate", "-s", "1M", seg)
		if err := os.Chown(seg, userB, userB); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(seg, 0o644); err != nil {
			t.Fatal(err)
		}
		const secs = "8"
		spam := asUser(pyCommand(exportSpamScript, filepath.Join(repoRoot, "python"), m.dir, "b/w", secs), userA)
		var spamOut strings.Builder
		spam.Stdout, spam.Stderr = &spamOut, &spamOut
		if err := spam.Start(); err != nil {
			t.Fatal(err)
		}
		out := strings.TrimSpace(pythonAs(t, userB, "/", truncateLoopScript, seg, secs))
		spam.Process.Kill()
		spam.Wait()
		t.Logf("uid %d: %s; uid %d: %s", userB, out, userA, strings.TrimSpace(spamOut.String()))
		if !strings.HasPrefix(out, "clean") && !strings.Contains(out, "No space left on device") {
			t.Errorf("uid %d's truncates and I/O on its own GPU segment while uid %d (a reader) exports it: %s", userB, userA, out)
		}
		m.unmount(t, false)
		if strings.Contains(m.stderr.String(), "not spilled") {
			t.Errorf("a clean unmount lost uid %d's GPU segment:\n%s", userB, m.stderr.String())
		}
		m2 := m.remount(t)
		size := gtSize(t, m2.path("b/w"))
		tail := run(t, "dd", "if="+m2.path("b/w"), "bs=4096", "skip="+strconv.FormatInt(size/4096-1, 10), "count=1", "status=none")
		if tail != strings.Repeat("v", 4096) {
			t.Errorf("uid %d's GPU segment after the remount: its last page (of %d bytes) is not what it wrote last", userB, size)
		}
	}, append(gtSim, "--allow-other", "--capacity", "64M")...)
}

// TestAttackGPULimboAllocated (GPU limbo against --capacity): a
// device allocation is rounded up to the device's granularity (2 MiB for
// the simulated device, as cuMemAlloc's), but a block in limbo is counted
// against the capacity by the bytes its segment asked for. User A holds
// one handle of her GPU segment and grows it to one page, reads its IPC
// handle and empties it, again and again: each round leaves 2 MiB of
// device memory in limbo and is charged 4 KiB, so a 64 MiB mount lets her
// take 32 GiB of device memory: the whole device. Root's new GPU segment
// then cannot get a page.
func TestAttackGPULimboAllocated(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		atk := gtDeviceSegment(t, m.path("a/leak"))
		if err := os.Chown(atk, userA, userA); err != nil {
			t.Fatal(err)
		}
		line := h4Background(t, userA, limboFillScript, atk, "4096")
		_, limbo := gtLimbo(t, m)
		t.Logf("uid %d: %s; limbo %d bytes as counted", userA, line, limbo)
		root := gtDeviceSegment(t, m.path("rootgpu"))
		if err := os.Truncate(root, 4096); err != nil {
			t.Errorf("root's one-page GPU segment while uid %d holds %d bytes (as counted) in limbo on a 64 MiB mount: %v", userA, limbo, err)
		}
	}, append(gtSim, "--allow-other", "--capacity", "64M")...)
}
