package integration

// Attacks on GPU segments by unprivileged users (DESIGN.md §9) on a
// --gpu sim --allow-other mount: consumer reference counters that only a
// segment's readers can change, one file per segment, following chmod and
// chown and removed with the segment; and IPC handles that reach their own
// segment's memory alone.

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
