package integration

// GPU segments across tensorfs restart and a crash of the daemon (issue
// 27, DESIGN.md §12), on the simulated device: the device helper outlives
// the daemon, and the successor claims its blocks. A segment written by
// an unprivileged user keeps its bytes, its IPC handle and its consumers'
// views (an open handle, and a mapping of the sim's allocation through
// its IPC stand-in, /proc/PID/fd/FD); limbo and its counter, stats'
// device memory and the ledger's charges stay as they were. A helper
// that died is replaced by a new one at the next restart.

import (
	"encoding/hex"
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

// rgConsumerScript is a consumer of the device segment argv[1]: it holds
// the segment open, maps its counter (argv[2] "counter") or also the
// sim's allocation through the IPC handle's stand-in (argv[2] "ipc", as
// root: /proc/PID/fd/FD of the helper), and answers commands: "read N"
// (sha256 of the first N bytes through the open handle), "view N" (the
// same of the mapping), "write OFF HEX" (into the mapping), "add N" (to
// the counter), "handle" (the IPC handle the segment shows now, hex).
const rgConsumerScript = `
import hashlib, mmap, os, struct, sys
seg, mode = sys.argv[1], sys.argv[2]
f = os.open(seg, os.O_RDONLY)
path, off = os.getxattr(seg, "user.tensorfs.cuda.ref_counter").decode().rsplit(":", 1)
cfd = os.open(path, os.O_RDWR)
cell = mmap.mmap(cfd, 8)
h = os.getxattr(seg, "user.tensorfs.cuda.ipc_handle")
view = None
if mode == "ipc":
    assert h[:16] == b"tensorfs-sim-mem", h[:16]
    size, pid, fd = struct.unpack("<qii", h[24:40])
    mem = os.open("/proc/%d/fd/%d" % (pid, fd), os.O_RDWR)
    view = mmap.mmap(mem, size)
print("ready", h.hex())
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "read":
        print("sha", hashlib.sha256(os.pread(f, int(args[0]), 0)).hexdigest())
    elif cmd == "view":
        print("sha", hashlib.sha256(view[:int(args[0])]).hexdigest())
    elif cmd == "write":
        b = bytes.fromhex(args[1])
        view[int(args[0]):int(args[0]) + len(b)] = b
        print("ok")
    elif cmd == "add":
        v = struct.unpack("<q", cell[:8])[0] + int(args[0])
        cell[:8] = struct.pack("<q", v)
        print("value", v)
    elif cmd == "handle":
        print("handle", os.getxattr(seg, "user.tensorfs.cuda.ipc_handle").hex())
`

// rgState is what must not change across a handover: the segment's
// sha256 and IPC handle, stats' device memory, and the ledger's charges
// of limbo and counters to the user.
type rgState struct {
	sha, handle     string
	memory          string
	limbo, counters int64
}

// rgStateOf reads rgState of seg on m.
func rgStateOf(t *testing.T, m *mount, seg string) rgState {
	t.Helper()
	mem, _ := json.Marshal(m.stats(t)["gpu"].(map[string]any)["memory"])
	return rgState{
		sha:      gtSha256(t, seg),
		handle:   hex.EncodeToString(gtGetfattr(t, seg, gtIPCHandle)),
		memory:   string(mem),
		limbo:    ledgerHeld(t, m, "GPU device memory in limbo", userA),
		counters: ledgerHeld(t, m, "GPU consumer counters", userA),
	}
}

// rgCrash SIGKILLs m's daemon (not its keeper) and waits until a new one
// serves the mount.
func rgCrash(t *testing.T, m *mount) {
	t.Helper()
	old := m.daemonPid(t)
	if err := unix.Kill(old, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a new daemon after the crash", func() (bool, string) {
		_, err := getxattr(m.dir, statsXattr)
		return err == nil && m.daemonPid(t) != old, fmt.Sprintf("stats: %v", err)
	})
	m.pid = m.daemonPid(t)
}

// usersGPUDir makes m's directory "gpu", sticky and open to every user
// (the mount reachable by them too), for cuda:0 segments.
func usersGPUDir(t *testing.T, m *mount) string {
	t.Helper()
	reachable(t, m.dir)
	dir := m.path("gpu")
	stickyDir(t, dir)
	gtSetDevice(t, dir, "cuda:0")
	return dir
}

// TestRestartGPUSegments: a GPU segment of user A, held open by A's
// consumer (with its counter) and mapped by root's through the IPC
// handle, a removed one whose memory waits in limbo for its counter, and
// a shrunk one whose old block waits for A's open handle, across tensorfs
// restart and a SIGKILL of the daemon: the bytes, the handle and both
// consumers' views stay, a write through the mapping shows in the file,
// limbo, stats' device memory and the ledger are unchanged, and the
// handle and the counter still hold the limbo until they go.
func TestRestartGPUSegments(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		dir := usersGPUDir(t, m)
		seg, gone, shrunk := filepath.Join(dir, "w"), filepath.Join(dir, "gone"), filepath.Join(dir, "shrunk")
		const n = 3*gtMiB + 11
		if out, err := runAs(t, userA, "/", "sh", "-c", fmt.Sprintf("head -c %d /dev/urandom >%s && truncate -s 2M %s %s", n, seg, gone, shrunk)); err != nil {
			t.Fatalf("user A writes GPU segments: %v\n%s", err, out)
		}
		gtWantDevice(t, seg, "cuda:0")
		holder := startPythonAs(t, userA, "user A's consumer", rgConsumerScript, seg, "counter")
		holder.expect(t, "ready")
		mapper := startPython(t, "root's IPC consumer", rgConsumerScript, seg, "ipc")
		mapper.expect(t, "ready")
		if got := holder.do(t, "add 1"); got != "value 1" {
			t.Fatalf("user A's consumer: %q", got)
		}
		goneHolder := startPythonAs(t, userA, "consumer of the removed segment", rgConsumerScript, gone, "counter")
		goneHolder.expect(t, "ready")
		if got := goneHolder.do(t, "add 1"); got != "value 1" {
			t.Fatalf("consumer of %s: %q", gone, got)
		}
		goneHolder.wait(t) // its counter stays at 1
		if out, err := runAs(t, userA, "/", "rm", gone); err != nil {
			t.Fatalf("rm %s: %v\n%s", gone, err, out)
		}
		eventually(t, "the removed segment in limbo", gtLimboIs(t, m, 1, 2*gtMiB))
		// A segment shrunk while user A holds it open, its IPC handle
		// handed out: its old block waits in limbo for that handle alone.
		opener := startPythonAs(t, userA, "user A's opener", "import os,sys\nf=os.open(sys.argv[1],os.O_RDONLY)\nprint('ready')\nsys.stdin.read()\n", shrunk)
		opener.expect(t, "ready")
		gtGetfattr(t, shrunk, gtIPCHandle)
		run(t, "truncate", "-s", "1M", shrunk)
		eventually(t, "the shrunk segment's old block in limbo", gtLimboIs(t, m, 2, 4*gtMiB))
		want := rgStateOf(t, m, seg)
		if want.limbo != 4*gtMiB || want.counters != 2 {
			t.Fatalf("the ledger charges user A %d bytes of limbo and %d counters, want %d and 2", want.limbo, want.counters, 4*gtMiB)
		}

		for i, handover := range []func(){func() { m.restart(t, "") }, func() { rgCrash(t, m) }} {
			what := []string{"after tensorfs restart", "after the daemon's SIGKILL"}[i]
			handover()
			if got := rgStateOf(t, m, seg); got != want {
				t.Errorf("%s: %+v, want %+v", what, got, want)
			}
			for _, c := range []struct {
				child *pyChild
				cmd   string
			}{{holder, "read"}, {mapper, "view"}} {
				if got := c.child.do(t, fmt.Sprintf("%s %d", c.cmd, n)); got != "sha "+want.sha {
					t.Errorf("%s: %s's %s = %q, want sha %s", what, c.child.name, c.cmd, got, want.sha)
				}
			}
			if got := mapper.do(t, "handle"); got != "handle "+want.handle {
				t.Errorf("%s: the IPC handle is %q, want %s", what, got, want.handle)
			}
			gtStaysInLimbo(t, m, what+": the counter and the open handle hold the limbo", 2, 4*gtMiB)
			// A write through the consumer's mapping shows in the file.
			mark := fmt.Sprintf("%02x%02x", 0xa0+i, 0x5b)
			if got := mapper.do(t, "write 100 "+mark); got != "ok" {
				t.Fatalf("%s: write through the mapping: %q", what, got)
			}
			b := make([]byte, 2)
			if f, err := os.Open(seg); err != nil {
				t.Fatal(err)
			} else if _, err := f.ReadAt(b, 100); err != nil || hex.EncodeToString(b) != mark {
				t.Errorf("%s: the file's bytes at 100 = %x %v, want %s from the mapping", what, b, err, mark)
				f.Close()
			} else {
				f.Close()
			}
			want = rgStateOf(t, m, seg)
		}
		// The inherited handle still holds its block: at its close it goes.
		opener.wait(t)
		eventually(t, "the shrunk segment's old block freed at its last close", gtLimboIs(t, m, 1, 2*gtMiB))
		// The adopted counter still counts: at 0 the limbo goes, and its
		// charge with it.
		goneHolder = startPythonAs(t, userA, "consumer of the removed segment", "import mmap,os,struct,sys\nf=os.open(sys.argv[1],os.O_RDWR)\nm=mmap.mmap(f,8)\nm[:8]=struct.pack('<q',0)\nprint('ok')\n", counterPath(t, m))
		goneHolder.expect(t, "ok")
		gtWantLimboEmpty(t, m, "the removed segment's counter back at 0")
		if got := ledgerHeld(t, m, "GPU device memory in limbo", userA); got != 0 {
			t.Errorf("the ledger charges user A %d bytes of limbo once it is freed", got)
		}
		holder.wait(t)
		mapper.wait(t)
	}, "--gpu", "sim", "--allow-other")
}

// counterPath returns the path of the one counter file on m that no
// segment names: the removed segment's.
func counterPath(t *testing.T, m *mount) string {
	t.Helper()
	dir := alloc.StatePath(m.dir, ".refcounters")
	names, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	named := string(gtGetfattr(t, m.path("gpu/w"), gtRefCounter))
	for _, e := range names {
		if p := filepath.Join(dir, e.Name()); !strings.HasPrefix(named, p+":") {
			return p
		}
	}
	t.Fatalf("no counter in %s but %s's", dir, named)
	return ""
}

// TestRestartGPUHelperDies: after the GPU helper died, tensorfs restart
// is the remedy: the successor starts a new helper (said in one log
// line), GPU segments serve again with their sizes kept and their device
// bytes lost (zeros, as after a crash), host segments serve on, and the
// keeper holds the new helper's door, so that the next restart keeps
// what is written meanwhile.
func TestRestartGPUHelperDies(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		seg := gtDeviceSegment(t, m.path("d"))
		run(t, "truncate", "-s", "1M", seg)
		if err := os.WriteFile(m.path("host"), []byte("host bytes"), 0o644); err != nil {
			t.Fatal(err)
		}
		h := gtGetfattr(t, seg, gtIPCHandle)
		helper := int(int32(h[32]) | int32(h[33])<<8 | int32(h[34])<<16 | int32(h[35])<<24)
		if err := unix.Kill(helper, unix.SIGKILL); err != nil {
			t.Fatalf("kill the helper %d: %v", helper, err)
		}
		gtWantGone(t, "the helper", []int{helper})
		if _, err := os.ReadFile(seg); err == nil || !strings.Contains(err.Error(), syscall.EIO.Error()) {
			t.Errorf("read of a GPU segment whose helper died: %v, want EIO", err)
		}
		m.restart(t, "")
		if b, err := os.ReadFile(seg); err != nil || len(b) != 1<<20 || strings.Trim(string(b), "\x00") != "" {
			t.Errorf("read of a GPU segment after the restart: %d bytes, %v; want 1 MiB of zeros", len(b), err)
		}
		if b, err := os.ReadFile(m.path("host")); err != nil || string(b) != "host bytes" {
			t.Errorf("host segment: %q %v", b, err)
		}
		if got := strings.Count(m.stderr.String(), "the GPU helper was lost; a new one starts"); got != 1 {
			t.Errorf("the log says %d times that a new GPU helper starts, want once:\n%s", got, tail(m.stderr.String()))
		}
		if err := os.WriteFile(seg, []byte("device bytes"), 0o644); err != nil {
			t.Fatal(err)
		}
		m.restart(t, "")
		if b, err := os.ReadFile(seg); err != nil || string(b) != "device bytes" {
			t.Errorf("a GPU segment written after the new helper started, after another restart: %q %v", b, err)
		}
	}, gtSimAlways...)
}
