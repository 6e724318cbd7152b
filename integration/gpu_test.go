package integration

// GPU segments (DESIGN.md §6) on the simulated device (--gpu sim), with
// real tools: a segment whose user.tensorfs.device is cuda:0 lives in the
// device helper's memory, is read and written through the daemon (direct
// I/O, shared mmap refused with ENODEV), copied host<->device with
// copy_file_range, described by the user.tensorfs.cuda.* attributes, kept
// in limbo while referenced, spilled on unmount and restored on mount,
// lost (zeros, same size) in a crash. And the mounts that serve no GPU:
// --gpu cuda without the helper binary or a GPU, and no --gpu at all.
//
// Mappings are made only by python children: the test process never maps
// a file of a FUSE mount.

import (
	"bytes"
	"cmp"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/ctl"
)

const (
	gtDevice      = "user.tensorfs.device"
	gtFlags       = "user.tensorfs.flags"
	gtIPCHandle   = "user.tensorfs.cuda.ipc_handle"
	gtOffset      = "user.tensorfs.cuda.offset"
	gtEventHandle = "user.tensorfs.cuda.event_handle"
	gtRefCounter  = "user.tensorfs.cuda.ref_counter"
	gtRefcount    = "user.tensorfs.refcount"

	// gtCollections is how many limbo collections a referenced block must
	// survive in gtStaysInLimbo.
	gtCollections = 2

	gtMiB = 1 << 20
)

// gtSim is the mount option of every test here but the no-GPU ones:
// --gpu sim, or the backend TENSORFS_TEST_GPU names (cuda, for
// scripts/gpu-device-check.sh on a machine with a GPU; the daemon finds
// tensorfs-gpu beside TENSORFS_BIN).
var gtSim = []string{"--gpu", cmp.Or(os.Getenv("TENSORFS_TEST_GPU"), "sim")}

// gtSimAlways is the mount option of the tests of what only the sim
// shows whatever TENSORFS_TEST_GPU says: a helper told to stall
// (gpu.SimStallEnv), a helper found by its pid in the sim's IPC handle
// (the test kills it), and an export read as bytes (the sim exports a
// memfd; CUDA exports a shareable handle, a /dev/nvidiactl descriptor a
// consumer imports with cuMemImportFromShareableHandle and cannot read,
// as an H100 run showed).
var gtSimAlways = []string{"--gpu", "sim"}

// gtStaysInLimbo checks that the limbo holds exactly blocks blocks of
// bytes bytes at every poll until the daemon's collections have found
// them still referenced gtCollections times (stats limbo "kept"), so that
// they are known to survive collection, not merely to wait for the next.
func gtStaysInLimbo(t *testing.T, m *mount, what string, blocks, bytes int64) {
	t.Helper()
	held := gtLimboIs(t, m, blocks, bytes)
	start := gtKept(t, m)
	eventually(t, fmt.Sprintf("%s: %d collections", what, gtCollections), func() (bool, string) {
		if ok, why := held(); !ok {
			t.Fatalf("%s: stopped being so: %s", what, why)
		}
		kept := gtKept(t, m)
		return kept >= start+gtCollections*blocks, fmt.Sprintf("collections kept a block %d times, %d before", kept, start)
	})
	if ok, why := held(); !ok {
		t.Fatalf("%s: stopped being so: %s", what, why)
	}
}

// gtSetDevice runs setfattr -n user.tensorfs.device -v dev path.
func gtSetDevice(t *testing.T, path, dev string) {
	t.Helper()
	run(t, "setfattr", "-n", gtDevice, "-v", dev, path)
}

// gtGetfattr returns the raw value of name on path, read by getfattr -e hex.
func gtGetfattr(t *testing.T, path, name string) []byte {
	t.Helper()
	v, err := gtTryGetfattr(path, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func gtTryGetfattr(path, name string) ([]byte, error) {
	out, err := runTimeout(commandTimeout, "getfattr", "--absolute-names", "-e", "hex", "-n", name, path)
	if err != nil {
		return nil, fmt.Errorf("getfattr -n %s %s: %v\n%s", name, path, err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		v, ok := strings.CutPrefix(line, name+"=")
		if !ok {
			continue
		}
		if v == "" {
			return []byte{}, nil
		}
		b, err := hex.DecodeString(strings.TrimPrefix(v, "0x"))
		if err != nil {
			return nil, fmt.Errorf("getfattr -n %s %s: value %q is not hex: %v", name, path, v, err)
		}
		return b, nil
	}
	return nil, fmt.Errorf("getfattr -n %s %s printed no value:\n%s", name, path, out)
}

// gtWantDevice checks user.tensorfs.device of path.
func gtWantDevice(t *testing.T, path, want string) {
	t.Helper()
	if got := string(gtGetfattr(t, path, gtDevice)); got != want {
		t.Errorf("%s of %s = %q, want %q", gtDevice, path, got, want)
	}
}

// gtSetDeviceFails checks that setfattr cuda:N on path fails with errno,
// both from setfattr(1) (its message) and from setxattr(2) itself.
func gtSetDeviceFails(t *testing.T, path, dev string, errno syscall.Errno) {
	t.Helper()
	out := runExpectFail(t, "setfattr", "-n", gtDevice, "-v", dev, path)
	if !strings.Contains(strings.ToLower(out), strings.ToLower(errno.Error())) {
		t.Errorf("setfattr %s=%s %s: %q, want %q", gtDevice, dev, path, strings.TrimSpace(out), errno.Error())
	}
	if err := unix.Setxattr(path, gtDevice, []byte(dev), 0); !errors.Is(err, errno) {
		t.Errorf("setxattr %s=%s %s: %v, want %v", gtDevice, dev, path, err, errno)
	}
}

// gtRandom writes n random bytes to a file outside the mount (dd from
// /dev/urandom) and returns its path.
func gtRandom(t *testing.T, name string, n int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	run(t, "dd", "if=/dev/urandom", "of="+p, "bs="+strconv.FormatInt(n, 10), "count=1", "iflag=fullblock", "status=none")
	return p
}

// gtZeros writes n zero bytes to a file outside the mount and returns it.
func gtZeros(t *testing.T, name string, n int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	run(t, "truncate", "-s", strconv.FormatInt(n, 10), p)
	return p
}

// gtSha256 returns sha256sum's digest of path (read(2) through the mount).
func gtSha256(t *testing.T, path string) string {
	t.Helper()
	out := run(t, "sha256sum", path)
	f := strings.Fields(out)
	if len(f) == 0 || len(f[0]) != 64 {
		t.Fatalf("sha256sum %s: %q", path, out)
	}
	return f[0]
}

// gtSize returns stat -c %s of path.
func gtSize(t *testing.T, path string) int64 {
	t.Helper()
	out := strings.TrimSpace(run(t, "stat", "-c", "%s", path))
	n, err := strconv.ParseInt(out, 10, 64)
	if err != nil {
		t.Fatalf("stat -c %%s %s: %q", path, out)
	}
	return n
}

// gtDeviceSegment makes an empty segment at path, moves it to cuda:0 and
// returns path. The device of a segment changes only while no handle is
// open, and touch's handle is released asynchronously (TestGPUSetDevice-
// AfterTouch checks that this does not show), so it first waits for the
// segment's refcount to read 0.
func gtDeviceSegment(t *testing.T, path string) string {
	t.Helper()
	run(t, "touch", path)
	gtWaitRefcount0(t, path)
	gtSetDevice(t, path, "cuda:0")
	return path
}

// gtWaitRefcount0 waits until the daemon has released every handle of
// path (user.tensorfs.refcount reads 0): close(2) returns before the
// kernel's release reaches the daemon.
func gtWaitRefcount0(t *testing.T, path string) {
	t.Helper()
	eventually(t, "refcount of "+path, func() (bool, string) {
		v, err := gtTryGetfattr(path, gtRefcount)
		return err == nil && string(v) == "0", fmt.Sprintf("%s = %q %v", gtRefcount, v, err)
	})
}

// gtOpen opens path in the mount; the cleanup closes it before the unmount
// if the test did not (a failed test must not add an fd leak).
func gtOpen(t *testing.T, path string, flag int) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// gtBacking returns the backing file of the segment rel (stats "backing").
func gtBacking(t *testing.T, m *mount, rel string) string {
	t.Helper()
	b, ok := m.stats(t)["backing"].(string)
	if !ok || b == "" {
		t.Fatalf("stats has no \"backing\": %v", m.stats(t))
	}
	return filepath.Join(b, rel)
}

// gtGranularity is what the simulated device rounds allocations up to.
const gtGranularity = 2 << 20

// gtWantBackingReserved checks that the device segment rel's backing file
// is empty while mounted, whatever the segment holds, with what its device
// allocation takes set aside beyond its end for the spill: its size
// rounded up to the device's granularity, or up to twice its size so
// rounded where writes grew it (capacity doubles).
func gtWantBackingReserved(t *testing.T, m *mount, rel string) {
	t.Helper()
	var st unix.Stat_t
	p := gtBacking(t, m, rel)
	size := gtSize(t, m.path(rel))
	least := (size + gtGranularity - 1) / gtGranularity * gtGranularity
	most := (2*size + gtGranularity - 1) / gtGranularity * gtGranularity
	if err := unix.Stat(p, &st); err != nil {
		t.Errorf("stat backing %s: %v", p, err)
	} else if st.Size != 0 || st.Blocks*512 < least || st.Blocks*512 > most {
		t.Errorf("backing file %s of device segment %s has %d bytes and %d set aside while mounted, want 0 and %d to %d", p, rel, st.Size, st.Blocks*512, least, most)
	}
}

// gtLimbo returns the stats' limbo blocks and bytes.
func gtLimbo(t *testing.T, m *mount) (blocks, bytes int64) {
	t.Helper()
	l := gtLimboStats(t, m)
	return l["blocks"], l["bytes"]
}

// gtKept returns the stats' limbo "kept": how many times collections found
// a block still referenced.
func gtKept(t *testing.T, m *mount) int64 {
	t.Helper()
	return gtLimboStats(t, m)["kept"]
}

// gtLimboStats returns the stats' limbo object, {"blocks", "bytes", "kept"}.
func gtLimboStats(t *testing.T, m *mount) map[string]int64 {
	t.Helper()
	st := m.stats(t)
	l, ok := st["limbo"].(map[string]any)
	if !ok {
		t.Fatalf("stats has no \"limbo\" object: %v", st)
	}
	out := map[string]int64{}
	for _, k := range []string{"blocks", "bytes", "kept"} {
		v, ok := l[k].(float64)
		if !ok {
			t.Fatalf("stats limbo = %v, want {\"blocks\":N,\"bytes\":N,\"kept\":N}", l)
		}
		out[k] = int64(v)
	}
	return out
}

// gtLimboIs is a condition for eventually: the limbo holds exactly blocks
// blocks and bytes bytes (bytes < 0: at least -bytes).
func gtLimboIs(t *testing.T, m *mount, blocks, bytes int64) func() (bool, string) {
	return func() (bool, string) {
		b, n := gtLimbo(t, m)
		ok := b == blocks && (bytes >= 0 && n == bytes || bytes < 0 && n >= -bytes)
		return ok, fmt.Sprintf("limbo has %d blocks of %d bytes, want %d blocks of %d bytes (negative: at least)", b, n, blocks, bytes)
	}
}

// gtWantLimboEmpty waits until nothing is in limbo.
func gtWantLimboEmpty(t *testing.T, m *mount, what string) {
	t.Helper()
	eventually(t, what+": limbo empty", gtLimboIs(t, m, 0, 0))
}

// gtGPUBackend returns stats "gpu"."backend".
func gtGPUBackend(t *testing.T, m *mount) string {
	t.Helper()
	st := m.stats(t)
	g, ok := st["gpu"].(map[string]any)
	if !ok {
		t.Fatalf("stats has no \"gpu\" object: %v", st)
	}
	b, _ := g["backend"].(string)
	return b
}

// gtHelperPIDs returns the daemon's device helper processes (children
// whose command line says gpu-helper, or the tensorfs-gpu binary).
func gtHelperPIDs(m *mount) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so cut at ")".
		s := string(stat)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) < 2 || f[1] != strconv.Itoa(m.pid) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if bytes.Contains(cmdline, []byte("gpu-helper")) || bytes.Contains(cmdline, []byte("tensorfs-gpu")) {
			out = append(out, pid)
		}
	}
	return out
}

// gtWantGone waits until none of pids is alive any more (zombies count as
// gone: their parent, the daemon, may be dead too).
func gtWantGone(t *testing.T, what string, pids []int) {
	t.Helper()
	eventually(t, what, func() (bool, string) {
		for _, pid := range pids {
			stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			if err != nil {
				continue
			}
			s := string(stat)
			if f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]); len(f) > 0 && f[0] != "Z" {
				return false, fmt.Sprintf("device helper %d still running: %s", pid, s)
			}
		}
		return true, ""
	})
}

// TestGPUDeviceXattr: user.tensorfs.device cuda:0 on an empty segment, or
// on a directory whose new segments (and directories) inherit it; the
// bytes then live on the device and the backing file stays empty. A
// segment with bytes cannot move; stats name the sim backend.
func TestGPUDeviceXattr(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		if got := gtGPUBackend(t, m); got != gtSim[1] {
			t.Errorf("stats gpu backend = %q with --gpu sim, want sim", got)
		}
		src := gtRandom(t, "src", 3*gtMiB+17)
		want := gtSha256(t, src)

		seg := gtDeviceSegment(t, m.path("seg"))
		gtWantDevice(t, seg, "cuda:0")
		run(t, "cp", src, seg)
		run(t, "cmp", src, seg)
		if n := gtSize(t, seg); n != 3*gtMiB+17 {
			t.Errorf("stat size of %s = %d, want %d", seg, n, 3*gtMiB+17)
		}
		gtWantBackingReserved(t, m, "seg")
		gtWantDevice(t, seg, "cuda:0")
		// Removing the device of a segment with bytes is moving it: refused.
		if out := runExpectFail(t, "setfattr", "-x", gtDevice, seg); strings.TrimSpace(out) == "" {
			t.Errorf("setfattr -x %s on a device segment with bytes failed silently", gtDevice)
		}
		gtWantDevice(t, seg, "cuda:0")
		run(t, "cmp", src, seg)

		// A host segment with bytes keeps them and its device.
		host := m.path("host")
		run(t, "cp", src, host)
		gtWantDevice(t, host, "cpu")
		if _, err := gtTryGetfattr(host, gtIPCHandle); err == nil {
			t.Errorf("getfattr %s on a host segment succeeded, want no such attribute", gtIPCHandle)
		}
		out := runExpectFail(t, "setfattr", "-n", gtDevice, "-v", "cuda:0", host)
		if strings.TrimSpace(out) == "" {
			t.Errorf("setfattr cuda:0 on a segment with bytes failed silently")
		}
		gtWantDevice(t, host, "cpu")
		run(t, "cmp", src, host)

		// Directory inheritance: files made every way, and subdirectories.
		dir := m.path("gd")
		run(t, "mkdir", dir)
		gtSetDevice(t, dir, "cuda:0")
		gtWantDevice(t, dir, "cuda:0")
		run(t, "cp", src, filepath.Join(dir, "cp"))
		run(t, "dd", "if="+src, "of="+filepath.Join(dir, "dd"), "bs=1M", "status=none")
		run(t, "touch", filepath.Join(dir, "touch"))
		run(t, "mkdir", filepath.Join(dir, "sub"))
		gtWantDevice(t, filepath.Join(dir, "sub"), "cuda:0")
		run(t, "cp", src, filepath.Join(dir, "sub", "deep"))
		for _, rel := range []string{"gd/cp", "gd/dd", "gd/sub/deep"} {
			p := m.path(rel)
			gtWantDevice(t, p, "cuda:0")
			if got := gtSha256(t, p); got != want {
				t.Errorf("sha256 of %s = %s, want %s", rel, got, want)
			}
			gtWantBackingReserved(t, m, rel)
			if h := gtGetfattr(t, p, gtIPCHandle); len(h) != 64 {
				t.Errorf("%s of %s has %d bytes, want 64", gtIPCHandle, rel, len(h))
			}
		}
		gtWantDevice(t, m.path("gd/touch"), "cuda:0")
		if n := gtSize(t, m.path("gd/touch")); n != 0 {
			t.Errorf("touched device segment has %d bytes", n)
		}
		// Removing an empty segment's device moves it to the CPU.
		run(t, "setfattr", "-x", gtDevice, m.path("gd/touch"))
		gtWantDevice(t, m.path("gd/touch"), "cpu")
		run(t, "cp", src, m.path("gd/touch"))
		if got := gtSha256(t, gtBacking(t, m, "gd/touch")); got != want {
			t.Errorf("backing file of gd/touch, moved to the CPU by setfattr -x and written: sha256 %s, want %s", got, want)
		}
		// Back to cpu: a directory's new segments are host segments again.
		gtSetDevice(t, dir, "cpu")
		run(t, "cp", src, filepath.Join(dir, "after"))
		gtWantDevice(t, filepath.Join(dir, "after"), "cpu")
		run(t, "cmp", src, filepath.Join(dir, "after"))
	}, gtSim...)
}

// TestGPUSetDeviceAfterTouch: "touch f && setfattr -n user.tensorfs.device
// -v cuda:0 f" works every time: touch has closed f when setfattr runs,
// although the kernel sends the release asynchronously.
func TestGPUSetDeviceAfterTouch(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		var failed []string
		for i := range 100 {
			p := m.path(fmt.Sprintf("t%d", i))
			run(t, "touch", p)
			if out, err := runTimeout(commandTimeout, "setfattr", "-n", gtDevice, "-v", "cuda:0", p); err != nil {
				failed = append(failed, strings.TrimSpace(out))
			}
		}
		if len(failed) > 0 {
			t.Errorf("%d of 100 setfattr cuda:0 straight after touch failed, e.g. %q", len(failed), failed[0])
		}
		// The same in one process, close(2) then setxattr(2) at once.
		out := python(t, `
import errno, os, sys
failed = []
for i in range(300):
    p = os.path.join(sys.argv[1], "p%d" % i)
    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
    try:
        os.setxattr(p, "user.tensorfs.device", b"cuda:0")
    except OSError as e:
        failed.append(errno.errorcode.get(e.errno, str(e.errno)))
print(len(failed), " ".join(sorted(set(failed))) or "-")
`, m.dir)
		if f := strings.Fields(out); len(f) != 2 {
			t.Errorf("the close-then-setxattr child printed %q", out)
		} else if f[0] != "0" {
			t.Errorf("close(2) then setxattr(2) cuda:0 at once: %s of 300 failed, with %s", f[0], f[1])
		}
	}, gtSim...)
}

// TestGPUReadWrite: read(2) and write(2) of a device segment go through
// the daemon in both modes (direct I/O): writes at offsets, holes, reads
// at offsets, all byte-exact.
func TestGPUReadWrite(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		seg := gtDeviceSegment(t, m.path("rw"))
		ref := gtZeros(t, "ref", 0)
		a := gtRandom(t, "a", 1*gtMiB+3)
		b := gtRandom(t, "b", 70000)

		reads0, writes0 := m.requests(t, "READ"), m.requests(t, "WRITE")
		// dd into the segment and into a host file at the same offsets.
		for _, f := range []string{seg, ref} {
			run(t, "dd", "if="+a, "of="+f, "bs=64k", "conv=notrunc", "status=none")
			run(t, "dd", "if="+b, "of="+f, "bs=70000", "seek=5000000", "oflag=seek_bytes", "conv=notrunc", "status=none")
			run(t, "dd", "if="+b, "of="+f, "bs=4096", "seek=10", "conv=notrunc", "status=none")
		}
		if n, w := gtSize(t, seg), gtSize(t, ref); n != w {
			t.Fatalf("device segment has %d bytes after the writes, want %d", n, w)
		}
		run(t, "cmp", ref, seg)
		if got, want := gtSha256(t, seg), gtSha256(t, ref); got != want {
			t.Errorf("sha256 %s, want %s", got, want)
		}
		// Reads at an offset, unaligned.
		part1, part2 := filepath.Join(t.TempDir(), "p1"), filepath.Join(t.TempDir(), "p2")
		run(t, "dd", "if="+seg, "of="+part1, "bs=1", "skip=4999990", "count=100", "status=none")
		run(t, "dd", "if="+ref, "of="+part2, "bs=1", "skip=4999990", "count=100", "status=none")
		run(t, "cmp", part1, part2)
		// Reading past the end gives nothing.
		if out := run(t, "dd", "if="+seg, "bs=4096", "skip=100000", "status=none"); out != "" {
			t.Errorf("dd past the end of the device segment read %d bytes", len(out))
		}
		reads, writes := m.requests(t, "READ")-reads0, m.requests(t, "WRITE")-writes0
		if reads == 0 || writes == 0 {
			t.Errorf("%s: the daemon served %d READ and %d WRITE requests for the device segment, want both > 0 (direct I/O through the daemon)", m.mode, reads, writes)
		}
		gtWantBackingReserved(t, m, "rw")

		// A write(2) straight after a read sees no stale cache: the bytes
		// are on the device only.
		f := gtOpen(t, seg, os.O_RDWR)
		buf := make([]byte, 8)
		if _, err := f.ReadAt(buf, 100); err != nil {
			t.Error(err)
		}
		if _, err := f.WriteAt([]byte("DEVICE!!"), 100); err != nil {
			t.Error(err)
		}
		f.Close()
		got := run(t, "dd", "if="+seg, "bs=1", "skip=100", "count=8", "status=none")
		if got != "DEVICE!!" {
			t.Errorf("dd after a write at 100 reads %q, want DEVICE!!", got)
		}
	}, gtSim...)
}

// TestGPUWriteGrowth: a plain cp of a 32 MiB file from outside the mount
// into a device segment (write(2) in cp's chunks, each growing the
// segment) works on a device of gigabytes (that growth is geometric is
// fs's TestDeviceWriteGrowthGeometric); and once the writer is gone
// nothing stays in limbo.
func TestGPUWriteGrowth(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		const size = 32 * gtMiB
		src := gtRandom(t, "src", size)
		seg := gtDeviceSegment(t, m.path("grow"))
		out, err := runTimeout(commandTimeout, "cp", src, seg)
		if err != nil {
			b, n := gtLimbo(t, m)
			t.Errorf("cp of %d MiB into a device segment: %v\n%s\n(limbo now %d blocks, %d bytes; gpu %v)",
				size>>20, err, out, b, n, m.stats(t)["gpu"])
		} else {
			run(t, "cmp", src, seg)
		}
		gtWantLimboEmpty(t, m, "the writer closed")

		// Appending in small pieces through one descriptor.
		app := gtDeviceSegment(t, m.path("append"))
		piece := bytes.Repeat([]byte("0123456789abcdef"), 256) // 4 KiB
		f := gtOpen(t, app, os.O_WRONLY|os.O_APPEND)
		err = nil
		for i := 0; i < 2048 && err == nil; i++ { // 8 MiB
			_, err = f.Write(piece)
		}
		if err != nil {
			b, n := gtLimbo(t, m)
			f.Close()
			t.Fatalf("appending 4 KiB pieces to a device segment: %v (limbo %d blocks, %d bytes)", err, b, n)
		}
		f.Close()
		if n := gtSize(t, app); n != 8*gtMiB {
			t.Errorf("after 2048 appends of 4 KiB: %d bytes, want %d", n, 8*gtMiB)
		}
		gtWantLimboEmpty(t, m, "the appender closed")
	}, gtSim...)
}

// gtMmapScript maps argv[1] every way a consumer might and prints one
// line per attempt: "NAME ERRNO" or "NAME mapped SHA256".
const gtMmapScript = `
import errno, hashlib, mmap, os, sys
import numpy as np
path = sys.argv[1]
def attempt(name, f):
    try:
        m = f()
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
        return
    data = bytes(m[:]) if not isinstance(m, np.ndarray) else m.tobytes()
    print(name, "mapped", hashlib.sha256(data).hexdigest())
rw = os.open(path, os.O_RDWR)
ro = os.open(path, os.O_RDONLY)
attempt("shared-rw", lambda: mmap.mmap(rw, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE))
attempt("shared-ro", lambda: mmap.mmap(ro, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
attempt("numpy-r+", lambda: np.memmap(path, dtype=np.uint8, mode="r+"))
attempt("numpy-r", lambda: np.memmap(path, dtype=np.uint8, mode="r"))
attempt("private", lambda: mmap.mmap(ro, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
`

// TestGPUMmapENODEV: a device segment cannot be mapped shared (ENODEV),
// from python's mmap and numpy.memmap alike; the segment is untouched.
func TestGPUMmapENODEV(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		src := gtRandom(t, "src", 2*gtMiB+5)
		seg := gtDeviceSegment(t, m.path("nomap"))
		run(t, "cp", src, seg)
		want := gtSha256(t, seg)

		out := python(t, gtMmapScript, seg)
		got := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			name, rest, _ := strings.Cut(line, " ")
			got[name] = rest
		}
		for _, name := range []string{"shared-rw", "shared-ro", "numpy-r+", "numpy-r"} {
			if got[name] != "ENODEV" {
				t.Errorf("%s mmap of a device segment: %q, want ENODEV", name, got[name])
			}
		}
		// DESIGN.md §6 says mmap fails with ENODEV. The kernel serves a
		// private mapping of a direct-I/O file through READ requests and
		// gives the daemon no say, so it may work: then it must show the
		// segment's bytes, never the empty backing file.
		switch p := got["private"]; {
		case p == "ENODEV":
		case p == "mapped "+want:
			t.Logf("a MAP_PRIVATE mapping of a device segment works (reads through the daemon), DESIGN.md §6 says ENODEV")
		default:
			t.Errorf("MAP_PRIVATE mmap of a device segment: %q, want ENODEV or the segment's bytes (sha256 %s)", p, want)
		}
		if got := gtSha256(t, seg); got != want {
			t.Errorf("after the mapping attempts sha256 %s, want %s", got, want)
		}
		gtWantBackingReserved(t, m, "nomap")
	}, gtSim...)
}

// TestGPUTruncate: truncate(1) resizes a device segment keeping its
// prefix; growth reads as zeros; an empty device segment sized by truncate
// holds zeros.
func TestGPUTruncate(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		src := gtRandom(t, "src", 3*gtMiB)
		seg := gtDeviceSegment(t, m.path("tr"))
		run(t, "cp", src, seg)

		// Grow: the prefix stays, the rest is zeros.
		run(t, "truncate", "-s", "5M", seg)
		if n := gtSize(t, seg); n != 5*gtMiB {
			t.Fatalf("size after truncate -s 5M = %d", n)
		}
		run(t, "cmp", "-n", strconv.Itoa(3*gtMiB), src, seg)
		tailZeros := gtZeros(t, "z2", 2*gtMiB)
		run(t, "cmp", "-i", strconv.Itoa(3*gtMiB)+":0", seg, tailZeros)

		// Shrink below the pool threshold, to an odd size.
		run(t, "truncate", "-s", "1000", seg)
		if n := gtSize(t, seg); n != 1000 {
			t.Fatalf("size after truncate -s 1000 = %d", n)
		}
		run(t, "cmp", "-n", "1000", src, seg)
		if out := run(t, "dd", "if="+seg, "bs=1", "skip=1000", "status=none"); out != "" {
			t.Errorf("read %d bytes past the shrunk end", len(out))
		}
		// Grow again: the bytes cut off do not come back.
		run(t, "truncate", "-s", "4096", seg)
		run(t, "cmp", "-n", "1000", src, seg)
		run(t, "cmp", "-i", "1000:0", "-n", "3096", seg, tailZeros)

		// To zero and back: zeros.
		run(t, "truncate", "-s", "0", seg)
		if n := gtSize(t, seg); n != 0 {
			t.Fatalf("size after truncate -s 0 = %d", n)
		}
		run(t, "truncate", "-s", "3M", seg)
		run(t, "cmp", seg, gtZeros(t, "z3", 3*gtMiB))

		// An empty device segment sized by truncate: zeros, and device memory.
		fresh := gtDeviceSegment(t, m.path("fresh"))
		run(t, "truncate", "-s", "100000", fresh)
		run(t, "cmp", fresh, gtZeros(t, "z4", 100000))
		if h := gtGetfattr(t, fresh, gtIPCHandle); len(h) != 64 {
			t.Errorf("%s after truncate has %d bytes, want 64", gtIPCHandle, len(h))
		}
		// ftruncate through an open descriptor, then write past the end.
		f := gtOpen(t, fresh, os.O_RDWR)
		if err := f.Truncate(10); err != nil {
			t.Errorf("ftruncate 10: %v", err)
		}
		if _, err := f.WriteAt([]byte("end"), 20); err != nil {
			t.Errorf("write at 20: %v", err)
		}
		f.Close()
		if got := run(t, "cat", fresh); got != strings.Repeat("\x00", 20)+"end" {
			t.Errorf("after ftruncate 10 and a write at 20: %q", got)
		}
		gtWantBackingReserved(t, m, "tr")
		gtWantBackingReserved(t, m, "fresh")
		gtWantLimboEmpty(t, m, "after the resizes, nothing referenced")
	}, gtSim...)
}

// TestGPUCopyFileRange: cp between a host segment and a device segment of
// the mount is copy_file_range served inside the daemon (the device
// process does the copy): COPY_FILE_RANGE requests, no WRITE requests.
func TestGPUCopyFileRange(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		src := gtRandom(t, "src", 9*gtMiB+4097)
		host := m.path("host")
		run(t, "cp", src, host)
		dev := gtDeviceSegment(t, m.path("dev"))

		cfr0, w0 := m.requests(t, "COPY_FILE_RANGE"), m.requests(t, "WRITE")
		run(t, "cp", host, dev)
		cfr1, w1 := m.requests(t, "COPY_FILE_RANGE"), m.requests(t, "WRITE")
		if cfr1 == cfr0 {
			t.Errorf("cp host dev: no COPY_FILE_RANGE request reached the daemon")
		}
		if w1 != w0 {
			t.Errorf("cp host dev: %d WRITE requests, want 0 (copy_file_range in the device process)", w1-w0)
		}
		run(t, "cmp", src, dev)
		gtWantBackingReserved(t, m, "dev")

		back := m.path("back")
		run(t, "cp", dev, back)
		cfr2, w2 := m.requests(t, "COPY_FILE_RANGE"), m.requests(t, "WRITE")
		if cfr2 == cfr1 {
			t.Errorf("cp dev host: no COPY_FILE_RANGE request reached the daemon")
		}
		if w2 != w1 {
			t.Errorf("cp dev host: %d WRITE requests, want 0", w2-w1)
		}
		gtWantDevice(t, back, "cpu")
		run(t, "cmp", src, back)
		if got := gtSize(t, gtBacking(t, m, "back")); got != 9*gtMiB+4097 {
			t.Errorf("the host copy's backing file has %d bytes, want %d", got, 9*gtMiB+4097)
		}

		// Device to device, and onto a longer device segment (the tail of
		// the destination is cut by cp's truncate).
		dev2 := gtDeviceSegment(t, m.path("dev2"))
		run(t, "truncate", "-s", "20M", dev2)
		run(t, "cp", dev, dev2)
		run(t, "cmp", src, dev2)
		// And a partial range with an offset: dd skip/seek uses read/write,
		// copy_file_range with offsets comes from python.
		out := python(t, `
import os, sys
src, dst = sys.argv[1], sys.argv[2]
i = os.open(src, os.O_RDONLY); o = os.open(dst, os.O_RDWR)
n = os.copy_file_range(i, o, 5000, 123, 777)
print(n)
`, host, dev2)
		if strings.TrimSpace(out) != "5000" {
			t.Errorf("copy_file_range 5000 bytes host@123 -> dev@777 copied %q", strings.TrimSpace(out))
		}
		want := run(t, "dd", "if="+src, "bs=1", "skip=123", "count=5000", "status=none")
		got := run(t, "dd", "if="+dev2, "bs=1", "skip=777", "count=5000", "status=none")
		if got != want {
			t.Errorf("copy_file_range with offsets: the device segment's bytes differ")
		}
		if n := gtSize(t, dev2); n != 9*gtMiB+4097 {
			t.Errorf("size after a copy inside the segment = %d, want %d", n, 9*gtMiB+4097)
		}
	}, gtSim...)
}

// TestGPUCudaXattrs: the CUDA IPC attributes of a device segment: 64-byte
// memory and event handles, offset 0 (every segment, small ones too, has a
// device allocation of its own: no two share a handle), and a consumer
// counter PATH:0 in a host file of its own, stable.
func TestGPUCudaXattrs(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		big := gtDeviceSegment(t, m.path("big"))
		run(t, "truncate", "-s", "20M", big)
		var small []string
		for i := range 3 {
			p := gtDeviceSegment(t, m.path(fmt.Sprintf("small%d", i)))
			run(t, "dd", "if=/dev/urandom", "of="+p, "bs=4096", "count=1", "status=none")
			small = append(small, p)
		}
		seen := map[string]string{}
		for _, p := range append([]string{big}, small...) {
			h := gtGetfattr(t, p, gtIPCHandle)
			if len(h) != 64 {
				t.Errorf("%s of %s has %d bytes, want 64", gtIPCHandle, p, len(h))
			}
			e := gtGetfattr(t, p, gtEventHandle)
			if len(e) != 64 {
				t.Errorf("%s of %s has %d bytes, want 64", gtEventHandle, p, len(e))
			}
			if bytes.Equal(h, make([]byte, 64)) {
				t.Errorf("%s of %s is all zeros", gtIPCHandle, p)
			}
			if ov := string(gtGetfattr(t, p, gtOffset)); ov != "0" {
				t.Errorf("%s of %s = %q, want 0", gtOffset, p, ov)
			}
			if other, dup := seen[string(h)]; dup {
				t.Errorf("%s and %s have the same IPC handle", p, other)
			}
			seen[string(h)] = p
			// Stable while the segment keeps its memory.
			if h2 := gtGetfattr(t, p, gtIPCHandle); !bytes.Equal(h, h2) {
				t.Errorf("%s of %s changed between two reads", gtIPCHandle, p)
			}
		}
		// Consumer counters: PATH:0 of an int64 in a host file, one file
		// per segment.
		counters := map[string]string{}
		for _, p := range append([]string{big}, small...) {
			v := string(gtGetfattr(t, p, gtRefCounter))
			path, off, ok := strings.Cut(v, ":")
			if !ok || off != "0" || !filepath.IsAbs(path) {
				t.Errorf("%s of %s = %q, want ABSPATH:0", gtRefCounter, p, v)
				continue
			}
			if strings.HasPrefix(path, m.dir+"/") {
				t.Errorf("%s of %s names %s inside the mount, want a host file", gtRefCounter, p, path)
			}
			fi, err := os.Stat(path)
			if err != nil || !fi.Mode().IsRegular() || fi.Size() != 8 {
				t.Errorf("%s of %s: %s is not a file of 8 bytes: %v %v", gtRefCounter, p, path, fi, err)
			}
			if other, dup := counters[path]; dup {
				t.Errorf("%s and %s share the counter file %s", p, other, path)
			}
			counters[path] = p
			if again := string(gtGetfattr(t, p, gtRefCounter)); again != v {
				t.Errorf("%s of %s changed: %q then %q", gtRefCounter, p, v, again)
			}
		}

		// The attributes name a segment's memory, not its path: a rename
		// keeps them.
		h, o := gtGetfattr(t, small[2], gtIPCHandle), gtGetfattr(t, small[2], gtOffset)
		rc := gtGetfattr(t, small[2], gtRefCounter)
		moved := m.path("moved")
		run(t, "mv", small[2], moved)
		if !bytes.Equal(gtGetfattr(t, moved, gtIPCHandle), h) || !bytes.Equal(gtGetfattr(t, moved, gtOffset), o) ||
			!bytes.Equal(gtGetfattr(t, moved, gtRefCounter), rc) {
			t.Errorf("rename changed the CUDA attributes of a device segment")
		}
		gtWantDevice(t, moved, "cuda:0")
	}, gtSim...)
}

// gtCounterScript is a consumer: it maps the counter file argv[1] and
// atomically adds to the int64 at argv[2] (libatomic's fetch_add, or a
// plain store where libatomic is missing: this consumer is the only
// writer of its counter). Commands: "add N" answers "value V".
const gtCounterScript = `
import ctypes, mmap, os, sys
path, off = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0)
os.close(fd)
cell = ctypes.c_int64.from_buffer(m, off)
try:
    fetch_add = ctypes.CDLL("libatomic.so.1")["__atomic_fetch_add_8"]
    fetch_add.restype = ctypes.c_int64
    fetch_add.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    def add(n):
        return fetch_add(ctypes.addressof(cell), n, 5) + n  # __ATOMIC_SEQ_CST
except OSError:
    def add(n):
        cell.value += n
        return cell.value
print("ready", cell.value)
for line in sys.stdin:
    cmd, n = line.split()
    print("value", add(int(n)))
del cell
m.close()
`

// gtStartConsumer starts a consumer of the counter of seg.
func gtStartConsumer(t *testing.T, seg string) *pyChild {
	t.Helper()
	gtGetfattr(t, seg, gtIPCHandle) // what it would map
	rc := string(gtGetfattr(t, seg, gtRefCounter))
	path, off, ok := strings.Cut(rc, ":")
	if !ok {
		t.Fatalf("%s of %s = %q", gtRefCounter, seg, rc)
	}
	c := startPython(t, "consumer of "+filepath.Base(seg), gtCounterScript, path, off)
	if line := c.next(t); line != "ready 0" {
		t.Fatalf("consumer of %s: %q, want \"ready 0\" (a fresh counter)\nstderr:\n%s", seg, line, c.stderr.String())
	}
	return c
}

// gtTriggerCollect opens and closes a device segment, whose release
// collects the limbo, and waits for the daemon to have seen the release.
func gtTriggerCollect(t *testing.T, m *mount, seg string) {
	t.Helper()
	gtReleasing(t, m, "the release of "+seg, func() { run(t, "cat", seg) })
}

// gtReleasing calls release, which drops a handle of a device segment,
// and waits until the daemon has served one more RELEASE.
func gtReleasing(t *testing.T, m *mount, what string, release func()) {
	t.Helper()
	before := m.requests(t, "RELEASE")
	release()
	eventually(t, what, func() (bool, string) {
		n := m.requests(t, "RELEASE")
		return n > before, fmt.Sprintf("RELEASE requests %d, %d before", n, before)
	})
}

// TestGPULimboRefCounter: a segment unlinked or shrunk while a consumer's
// counter is above zero keeps its old memory in limbo, across releases
// and periodic collections, until the consumer drops to zero.
func TestGPULimboRefCounter(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		other := gtDeviceSegment(t, m.path("other"))
		run(t, "truncate", "-s", "4096", other)
		gtWantLimboEmpty(t, m, "at start")

		// Unlink while referenced.
		seg := gtDeviceSegment(t, m.path("held"))
		run(t, "truncate", "-s", "3M", seg)
		c := gtStartConsumer(t, seg)
		if got := c.do(t, "add 1"); got != "value 1" {
			t.Fatalf("consumer add 1: %q", got)
		}
		run(t, "rm", seg)
		if _, err := os.Stat(seg); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("stat %s after rm: %v", seg, err)
		}
		eventually(t, "unlinked while counted", gtLimboIs(t, m, 1, 3*gtMiB))
		gtTriggerCollect(t, m, other)
		gtStaysInLimbo(t, m, "limbo while the counter is 1", 1, 3*gtMiB)
		if got := c.do(t, "add -1"); got != "value 0" {
			t.Fatalf("consumer add -1: %q", got)
		}
		gtWantLimboEmpty(t, m, "counter back to 0")

		// Shrink while referenced: the old memory waits, the prefix stays.
		src := gtRandom(t, "src", 4*gtMiB)
		seg2 := gtDeviceSegment(t, m.path("shrunk"))
		run(t, "cp", src, seg2)
		// cp's writes grew the segment block by block and its handle is
		// released asynchronously: let that settle, so that the consumer
		// below refers to the 4 MiB block alone.
		gtWaitRefcount0(t, seg2)
		gtWantLimboEmpty(t, m, "after cp into the segment")
		c2 := gtStartConsumer(t, seg2)
		if got := c2.do(t, "add 2"); got != "value 2" {
			t.Fatalf("consumer add 2: %q", got)
		}
		run(t, "truncate", "-s", "1M", seg2)
		eventually(t, "shrunk while counted", gtLimboIs(t, m, 1, 4*gtMiB))
		run(t, "cmp", "-n", strconv.Itoa(gtMiB), src, seg2)
		if n := gtSize(t, seg2); n != gtMiB {
			t.Errorf("size after truncate -s 1M = %d", n)
		}
		gtTriggerCollect(t, m, other)
		if got := c2.do(t, "add -1"); got != "value 1" {
			t.Fatalf("consumer add -1: %q", got)
		}
		gtStaysInLimbo(t, m, "limbo while the counter is still 1", 1, 4*gtMiB)
		if got := c2.do(t, "add -1"); got != "value 0" {
			t.Fatalf("consumer add -1: %q", got)
		}
		gtWantLimboEmpty(t, m, "shrunk segment's counter back to 0")
		c.wait(t)
		c2.wait(t)
		run(t, "cmp", "-n", strconv.Itoa(gtMiB), src, seg2)

		// A counter still held by a consumer that exits without a decrement
		// keeps the memory: the counter is the contract.
		seg3 := gtDeviceSegment(t, m.path("leaky"))
		run(t, "truncate", "-s", "2M", seg3)
		c3 := gtStartConsumer(t, seg3)
		c3.do(t, "add 1")
		c3.wait(t)
		run(t, "rm", seg3)
		gtTriggerCollect(t, m, other)
		gtStaysInLimbo(t, m, "limbo after the consumer exited with its counter at 1", 1, 2*gtMiB)
	}, gtSim...)
}

// TestGPULimboOpenHandle: a segment unlinked or shrunk while a handle is
// open keeps its old memory in limbo until the last handle is released,
// once its IPC handle has left the daemon (before, a shrink frees it).
func TestGPULimboOpenHandle(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		gtWantLimboEmpty(t, m, "at start")
		seg := gtDeviceSegment(t, m.path("open"))
		run(t, "truncate", "-s", "3M", seg)
		// Two handles: the memory waits for the last.
		f1, f2 := gtOpen(t, seg, os.O_RDONLY), gtOpen(t, seg, os.O_RDONLY)
		run(t, "rm", seg)
		eventually(t, "unlinked while open", gtLimboIs(t, m, 1, 3*gtMiB))
		gtReleasing(t, m, "the release of the first handle", func() { f1.Close() })
		gtStaysInLimbo(t, m, "limbo while one handle is left", 1, 3*gtMiB)
		f2.Close()
		gtWantLimboEmpty(t, m, "last handle released")

		// Shrink while open, by another process (truncate(1)). While the
		// segment's IPC handle never left the daemon, no consumer can map
		// its memory: the old block is freed at once.
		seg2 := gtDeviceSegment(t, m.path("shrink"))
		run(t, "truncate", "-s", "6M", seg2)
		f3 := gtOpen(t, seg2, os.O_RDWR)
		run(t, "truncate", "-s", "5M", seg2)
		gtWantLimboEmpty(t, m, "shrunk while open, its handle never handed out")
		gtGetfattr(t, seg2, gtIPCHandle)
		run(t, "truncate", "-s", "1M", seg2)
		eventually(t, "shrunk while open", gtLimboIs(t, m, 1, 5*gtMiB))
		if fi, err := f3.Stat(); err != nil || fi.Size() != gtMiB {
			t.Errorf("fstat of the open handle after the shrink: %v %v, want %d bytes", fi, err, gtMiB)
		}
		if _, err := f3.WriteAt([]byte("still"), 10); err != nil {
			t.Errorf("write through the handle open across the shrink: %v", err)
		}
		f3.Close()
		gtWantLimboEmpty(t, m, "the handle across the shrink released")
		if got := run(t, "dd", "if="+seg2, "bs=1", "skip=10", "count=5", "status=none"); got != "still" {
			t.Errorf("read back %q, want still", got)
		}

		// Many handles of one process (a python child), released at its exit.
		seg3 := gtDeviceSegment(t, m.path("child"))
		run(t, "truncate", "-s", "1M", seg3)
		c := startPython(t, "holder", `
import os, sys
fds = [os.open(sys.argv[1], os.O_RDONLY) for _ in range(4)]
print("open")
sys.stdin.readline()
`, seg3)
		if got := c.next(t); got != "open" {
			t.Fatalf("holder: %q\n%s", got, c.stderr.String())
		}
		run(t, "rm", seg3)
		eventually(t, "unlinked while a child holds it", gtLimboIs(t, m, 1, gtMiB))
		c.wait(t)
		gtWantLimboEmpty(t, m, "the holding child exited")
	}, gtSim...)
}

// TestGPULimboStats: the stats' limbo blocks and bytes agree with each
// other at every read, also while the daemon frees a few hundred blocks
// (600 MiB of device bytes, which set aside as much backing space).
func TestGPULimboStats(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		const n, size = 200, 3 * gtMiB
		dir := m.path("many")
		run(t, "mkdir", dir)
		gtSetDevice(t, dir, "cuda:0")
		gtWantLimboEmpty(t, m, "at start")
		c := startPython(t, "holder", `
import os, sys
d, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fds = []
for i in range(n):
    fd = os.open(os.path.join(d, "s%d" % i), os.O_CREAT | os.O_RDWR, 0o644)
    os.ftruncate(fd, size)
    fds.append(fd)
print("open")
sys.stdin.readline()
`, dir, strconv.Itoa(n), strconv.Itoa(size))
		if got := c.next(t); got != "open" {
			t.Fatalf("holder: %q\n%s", got, c.stderr.String())
		}
		run(t, "rm", "-r", dir)
		eventually(t, "all unlinked while held", gtLimboIs(t, m, n, n*size))
		c.stdin.Close()
		var bad []string
		reads := 0
		eventually(t, "holder gone, limbo empty", func() (bool, string) {
			b, by := gtLimbo(t, m)
			reads++
			if by != b*size && len(bad) < 5 {
				bad = append(bad, fmt.Sprintf("{blocks %d, bytes %d}", b, by))
			}
			return b == 0 && by == 0, fmt.Sprintf("limbo has %d blocks of %d bytes", b, by)
		})
		c.wait(t)
		if len(bad) > 0 {
			t.Errorf("while the limbo emptied, stats limbo disagreed with itself (every block is %d bytes) at some of %d reads: %s",
				size, reads, strings.Join(bad, " "))
		}
	}, append(gtSim, "--capacity", "1G")...)
}

// TestGPUUnlinkedOpenFD: as for any file, an unlinked device segment
// stays readable and writable through the descriptors still open on it
// (its memory is in limbo for them).
func TestGPUUnlinkedOpenFD(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		seg := gtDeviceSegment(t, m.path("ghost"))
		if err := os.WriteFile(seg, []byte("hello device"), 0o644); err != nil {
			t.Fatal(err)
		}
		f := gtOpen(t, seg, os.O_RDWR)
		run(t, "rm", seg)
		buf := make([]byte, 64)
		n, err := f.ReadAt(buf, 0)
		if string(buf[:n]) != "hello device" {
			t.Errorf("read of the unlinked device segment through its open fd: %q %v, want \"hello device\"", buf[:n], err)
		}
		if _, err := f.WriteAt([]byte("HELLO"), 0); err != nil {
			t.Errorf("write to the unlinked device segment through its open fd: %v", err)
		}
		n, err = f.ReadAt(buf, 0)
		if string(buf[:n]) != "HELLO device" {
			t.Errorf("read after the write: %q %v, want \"HELLO device\"", buf[:n], err)
		}
		f.Close()
		gtWantLimboEmpty(t, m, "unlinked segment closed")
	}, gtSim...)
}

// gtPopulate makes device segments of several kinds and a host segment,
// and returns their sha256 and sizes by name.
func gtPopulate(t *testing.T, m *mount) (shas map[string]string, sizes map[string]int64) {
	t.Helper()
	shas, sizes = map[string]string{}, map[string]int64{}
	big := gtDeviceSegment(t, m.path("big"))
	run(t, "cp", gtRandom(t, "big", 7*gtMiB+3), big)
	small := gtDeviceSegment(t, m.path("small"))
	run(t, "cp", gtRandom(t, "small", 1234), small)
	grown := gtDeviceSegment(t, m.path("grown"))
	run(t, "cp", gtRandom(t, "grown", 5000), grown)
	run(t, "truncate", "-s", "3M", grown)
	gtDeviceSegment(t, m.path("empty"))
	run(t, "mkdir", m.path("dir"))
	gtSetDevice(t, m.path("dir"), "cuda:0")
	run(t, "cp", gtRandom(t, "inner", 300000), m.path("dir/inner"))
	run(t, "cp", gtRandom(t, "host", 2*gtMiB+1), m.path("host"))
	for _, rel := range []string{"big", "small", "grown", "empty", "dir/inner", "host"} {
		shas[rel] = gtSha256(t, m.path(rel))
		sizes[rel] = gtSize(t, m.path(rel))
	}
	return shas, sizes
}

// gtDeviceRels are the device segments gtPopulate makes.
var gtDeviceRels = []string{"big", "small", "grown", "empty", "dir/inner"}

// TestGPUSpillRestore: a clean unmount spills the device bytes into the
// backing files; the next mount with --gpu restores them to the device
// (backing files empty again) with their attributes.
func TestGPUSpillRestore(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		shas, sizes := gtPopulate(t, m)
		backing := map[string]string{}
		for rel := range shas {
			backing[rel] = gtBacking(t, m, rel)
		}
		helpers := gtHelperPIDs(m)
		if len(helpers) != 1 {
			t.Errorf("the daemon has %d device helper processes (%v), want 1", len(helpers), helpers)
		}
		m.unmount(t, false)
		gtWantGone(t, "device helper after unmount", helpers)

		for rel, sha := range shas {
			if got := gtSha256(t, backing[rel]); got != sha {
				t.Errorf("backing file of %s after unmount: sha256 %s, want %s (the spilled bytes)", rel, got, sha)
			}
		}

		m2 := m.remount(t)
		for rel, sha := range shas {
			p := m2.path(rel)
			if got := gtSha256(t, p); got != sha {
				t.Errorf("%s after unmount and remount: sha256 %s, want %s", rel, got, sha)
			}
			if got := gtSize(t, p); got != sizes[rel] {
				t.Errorf("%s after remount: %d bytes, want %d", rel, got, sizes[rel])
			}
		}
		for _, rel := range gtDeviceRels {
			gtWantDevice(t, m2.path(rel), "cuda:0")
			gtWantBackingReserved(t, m2, rel)
		}
		gtWantDevice(t, m2.path("host"), "cpu")
		gtWantDevice(t, m2.path("dir"), "cuda:0")
		if h := gtGetfattr(t, m2.path("big"), gtIPCHandle); len(h) != 64 {
			t.Errorf("%s after restore has %d bytes", gtIPCHandle, len(h))
		}
		// Restored segments are live device segments: write, grow, inherit.
		run(t, "dd", "if=/dev/zero", "of="+m2.path("small"), "bs=1", "count=10", "seek=2000", "conv=notrunc", "status=none")
		if n := gtSize(t, m2.path("small")); n != 2010 {
			t.Errorf("small after a write at 2000: %d bytes, want 2010", n)
		}
		run(t, "cp", m2.path("host"), m2.path("dir/new"))
		gtWantDevice(t, m2.path("dir/new"), "cuda:0")
		run(t, "cmp", m2.path("host"), m2.path("dir/new"))
		if strings.Contains(m2.stderr.String(), "lost its contents") {
			t.Errorf("a clean remount warned of lost contents:\n%s", m2.stderr.String())
		}

		// A second round trip: what the restored mount wrote survives too.
		want := gtSha256(t, m2.path("dir/new"))
		m2.unmount(t, false)
		m3 := m.remount(t)
		if got := gtSha256(t, m3.path("dir/new")); got != want {
			t.Errorf("dir/new after a second remount: sha256 %s, want %s", got, want)
		}
		if got := gtSha256(t, m3.path("big")); got != shas["big"] {
			t.Errorf("big after a second remount: sha256 %s, want %s", got, shas["big"])
		}
	}, gtSim...)
}

// TestGPUCrash: after kill -9 of the keeper (and so of its daemon) the
// device contents are lost: each device segment reads as zeros of its old
// size and the new daemon logs a warning naming it; host segments keep
// their bytes. The helper dies with them (restart_gpu_test.go: a daemon
// killed under its keeper keeps them).
func TestGPUCrash(t *testing.T) {
	t.Parallel()
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		shas, sizes := gtPopulate(t, m)
		helpers := gtHelperPIDs(m)
		if len(helpers) != 1 {
			t.Errorf("the daemon has %d device helper processes (%v), want 1", len(helpers), helpers)
		}
		m.kill9(t)
		gtWantGone(t, "device helper after the daemon's kill -9", helpers)

		m2 := m.remount(t)
		if got := gtSha256(t, m2.path("host")); got != shas["host"] {
			t.Errorf("host segment after kill -9: sha256 %s, want %s", got, shas["host"])
		}
		log := m2.stderr.String()
		for _, rel := range gtDeviceRels {
			p := m2.path(rel)
			if got := gtSize(t, p); got != sizes[rel] {
				t.Errorf("%s after kill -9: %d bytes, want %d", rel, got, sizes[rel])
			}
			if got, want := gtSha256(t, p), gtSha256(t, gtZeros(t, "zeros", sizes[rel])); got != want {
				t.Errorf("%s after kill -9: sha256 %s, want %s (zeros)", rel, got, want)
			}
			gtWantDevice(t, p, "cuda:0")
			gtWantBackingReserved(t, m2, rel)
			if sizes[rel] == 0 {
				continue
			}
			named := false
			for _, line := range strings.Split(log, "\n") {
				if strings.Contains(line, "level=WARN") && (strings.Contains(line, "/"+rel+" ") || strings.HasSuffix(line, "/"+rel)) {
					named = true
				}
			}
			if !named {
				t.Errorf("the daemon after kill -9 logged no warning naming %s:\n%s", rel, log)
			}
		}
		// The device works again.
		run(t, "cp", m2.path("host"), m2.path("big"))
		run(t, "cmp", m2.path("host"), m2.path("big"))
		if h := gtGetfattr(t, m2.path("big"), gtIPCHandle); len(h) != 64 {
			t.Errorf("%s after the crash has %d bytes", gtIPCHandle, len(h))
		}
	}, gtSim...)
}

// TestGPUExportKeepFD: over the control socket, a KEEPFD device segment
// exports a POSIX descriptor of its device memory (sim: a memfd) holding
// the segment's bytes.
func TestGPUExportKeepFD(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("keep")
		run(t, "mkdir", dir)
		run(t, "setfattr", "-n", gtFlags, "-v", "KEEPFD", dir)
		gtSetDevice(t, dir, "cuda:0")
		src := gtRandom(t, "src", 3*gtMiB+11)
		seg := filepath.Join(dir, "w")
		run(t, "cp", src, seg)
		gtWantDevice(t, seg, "cuda:0")
		if f := string(gtGetfattr(t, seg, gtFlags)); !strings.Contains(f, "KEEPFD") {
			t.Fatalf("%s of %s = %q, want KEEPFD", gtFlags, seg, f)
		}
		want, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}

		sock, err := getxattr(m.dir, "user.tensorfs.socket")
		if err != nil {
			t.Fatalf("getxattr user.tensorfs.socket: %v", err)
		}
		c, err := ctl.Dial(string(sock))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()

		f, err := c.Export("keep/w", false)
		if err != nil {
			t.Fatalf("export keep/w: %v", err)
		}
		defer f.Close()
		target, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
		if !strings.HasPrefix(target, "/memfd:") {
			t.Errorf("the exported descriptor is %q, want a memfd (sim device memory)", target)
		}
		if fi, err := f.Stat(); err != nil || fi.Size() < int64(len(want)) {
			t.Errorf("exported descriptor: %v %v, want at least %d bytes", fi, err, len(want))
		}
		got := make([]byte, len(want))
		if n, err := f.ReadAt(got, 0); n != len(want) || !bytes.Equal(got, want) {
			t.Errorf("exported descriptor reads %d bytes (%v), different from the segment's %d", n, err, len(want))
		}
		// A read-only export carries read-only access: no write reaches
		// the device memory through it.
		if _, err := f.WriteAt([]byte("NOPE"), 0); err == nil {
			t.Errorf("a write through the read-only export succeeded")
		}
		// Exporting moved nothing: the segment reads the same, stays on the
		// device, and its backing file stays empty.
		run(t, "cmp", src, seg)
		gtWantBackingReserved(t, m, "keep/w")

		// It is the device memory: a write through a read-write export
		// shows through the mount.
		rw, err := c.Export("keep/w", true)
		if err != nil {
			t.Fatalf("export keep/w write=true: %v", err)
		}
		defer rw.Close()
		if _, err := rw.WriteAt([]byte("EXPORTED"), 4096); err != nil {
			t.Fatalf("write through the read-write export: %v", err)
		}
		if got := run(t, "dd", "if="+seg, "bs=1", "skip=4096", "count=8", "status=none"); got != "EXPORTED" {
			t.Errorf("after a write through the exported device memory the mount reads %q, want EXPORTED", got)
		}
		// And a write through the mount shows in the export.
		run(t, "dd", "of="+seg, "bs=1", "seek=100", "conv=notrunc", "status=none", "if="+gtText(t, "MOUNTED"))
		buf := make([]byte, 7)
		if _, err := f.ReadAt(buf, 100); err != nil || string(buf) != "MOUNTED" {
			t.Errorf("after a write through the mount the export reads %q %v, want MOUNTED", buf, err)
		}
		f.Close()
		rw.Close()
		c.Close()

		// A host KEEPFD segment still exports its backing file, not a memfd.
		run(t, "setfattr", "-n", gtDevice, "-v", "cpu", dir)
		run(t, "cp", src, filepath.Join(dir, "host"))
		c2, err := ctl.Dial(string(sock))
		if err != nil {
			t.Fatal(err)
		}
		defer c2.Close()
		h, err := c2.Export("keep/host", false)
		if err != nil {
			t.Fatalf("export keep/host: %v", err)
		}
		defer h.Close()
		if target, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", h.Fd())); strings.HasPrefix(target, "/memfd:") {
			t.Errorf("a host KEEPFD segment exported %q", target)
		}
	}, gtSimAlways...)
}

// gtText writes s to a file outside the mount and returns its path.
func gtText(t *testing.T, s string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "text")
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// gtPathWithout returns $PATH without the directories holding a
// tensorfs-gpu, so that the daemon finds no CUDA helper.
func gtPathWithout() string {
	var keep []string
	for _, d := range filepath.SplitList(os.Getenv("PATH")) {
		if _, err := os.Stat(filepath.Join(d, "tensorfs-gpu")); err == nil {
			continue
		}
		keep = append(keep, d)
	}
	return strings.Join(keep, string(filepath.ListSeparator))
}

// gtWantNoGPU checks a mount that serves no GPU: host segments work, the
// stats say backend none, cuda:0 is EOPNOTSUPP on files and directories.
func gtWantNoGPU(t *testing.T, m *mount) {
	t.Helper()
	if got := gtGPUBackend(t, m); got != "none" {
		t.Errorf("stats gpu backend = %q, want none", got)
	}
	src := gtRandom(t, "src", 3*gtMiB+1)
	p := m.path("host")
	run(t, "cp", src, p)
	run(t, "cmp", src, p)
	gtWantDevice(t, p, "cpu")
	empty := m.path("empty")
	run(t, "touch", empty)
	gtSetDeviceFails(t, empty, "cuda:0", syscall.EOPNOTSUPP)
	gtWantDevice(t, empty, "cpu")
	dir := m.path("dir")
	run(t, "mkdir", dir)
	gtSetDeviceFails(t, dir, "cuda:0", syscall.EOPNOTSUPP)
	gtWantDevice(t, dir, "cpu")
	run(t, "cp", src, filepath.Join(dir, "f"))
	gtWantDevice(t, filepath.Join(dir, "f"), "cpu")
	run(t, "cmp", src, filepath.Join(dir, "f"))
	if h := gtHelperPIDs(m); len(h) != 0 {
		t.Errorf("a mount without GPU segments has device helpers %v", h)
	}
}

// gtOffLines returns the daemon's log lines saying "GPU segments off".
func gtOffLines(m *mount) []string {
	var out []string
	for _, line := range strings.Split(m.stderr.String(), "\n") {
		if strings.Contains(line, "GPU segments off") {
			out = append(out, line)
		}
	}
	return out
}

// TestGPUCudaNoHelper: --gpu cuda where no tensorfs-gpu helper is beside
// the binary or on PATH still mounts and serves host segments; the log
// says "GPU segments off" once, with the reason.
func TestGPUCudaNoHelper(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(filepath.Join(filepath.Dir(tensorfs), "tensorfs-gpu")); err == nil {
		t.Skipf("a tensorfs-gpu lies beside %s (TENSORFS_BIN); this test needs none", tensorfs)
	}
	forEachModeEnv(t, []string{"PATH=" + gtPathWithout()}, func(t *testing.T, m *mount) {
		gtWantNoGPU(t, m)
		lines := gtOffLines(m)
		if len(lines) != 1 || !strings.Contains(lines[0], "tensorfs-gpu") {
			t.Errorf("log lines with \"GPU segments off\": %q, want one that names the missing tensorfs-gpu\nlog:\n%s", lines, m.stderr.String())
		}
	}, "--gpu", "cuda")
}

// TestGPUCudaNoDevice: --gpu cuda with a helper that cannot initialise
// CUDA (no GPU: here a stand-in tensorfs-gpu on PATH that fails the way
// cuInit does) still mounts; the log line gives the helper's reason.
func TestGPUCudaNoDevice(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(filepath.Join(filepath.Dir(tensorfs), "tensorfs-gpu")); err == nil {
		t.Skipf("a tensorfs-gpu lies beside %s (TENSORFS_BIN); this test needs the one on PATH", tensorfs)
	}
	bin := t.TempDir()
	const reason = "cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"
	script := "#!/bin/sh\necho '" + reason + "'\nexit 1\n"
	if err := writeExecutable(filepath.Join(bin, "tensorfs-gpu"), []byte(script)); err != nil {
		t.Fatal(err)
	}
	path := "PATH=" + bin + string(filepath.ListSeparator) + gtPathWithout()
	forEachModeEnv(t, []string{path}, func(t *testing.T, m *mount) {
		gtWantNoGPU(t, m)
		lines := gtOffLines(m)
		if len(lines) != 1 || !strings.Contains(lines[0], "CUDA_ERROR_NO_DEVICE") {
			t.Errorf("log lines with \"GPU segments off\": %q, want one with the helper's reason %q\nlog:\n%s", lines, reason, m.stderr.String())
		}
	}, "--gpu", "cuda")
}

// TestGPUNone: without --gpu (and with --gpu none) cuda:0 is EOPNOTSUPP
// and nothing says GPU segments are off: none were asked for.
func TestGPUNone(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		gtWantNoGPU(t, m)
		if lines := gtOffLines(m); len(lines) != 0 {
			t.Errorf("a mount without --gpu logged %q", lines)
		}
	})
	t.Run("explicit", func(t *testing.T) {
		gtWantNoGPU(t, mountFS(t, "passthrough", "--gpu", "none"))
	})
}
