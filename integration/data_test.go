package integration

// Data path tests: bytes in and out through real tools, the passthrough
// claim (the daemon serves no READ or WRITE), shared mappings between
// processes and with the backing file, fio verification, truncation.
//
// Mappings are made only by child processes (python): the test process
// must never mmap a file of a FUSE mount.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// dtCheckRequests asserts the core claim: a passthrough mount serves no
// READ or WRITE; a classic one serves both (when both happened).
func dtCheckRequests(t *testing.T, m *mount, what string, wantReads, wantWrites bool) {
	t.Helper()
	reads, writes := m.requests(t, "READ"), m.requests(t, "WRITE")
	switch m.mode {
	case "passthrough":
		if reads != 0 || writes != 0 {
			t.Errorf("passthrough: after %s the daemon served %d READ and %d WRITE requests, want 0 and 0", what, reads, writes)
		}
	case "classic":
		if wantReads && reads == 0 {
			t.Errorf("classic: after %s the daemon served no READ request", what)
		}
		if wantWrites && writes == 0 {
			t.Errorf("classic: after %s the daemon served no WRITE request", what)
		}
	}
}

// dtDaemonHWM returns the peak resident set of process pid, in bytes,
// from /proc/PID/status (VmHWM is reset by exec; getrusage's maxrss is not).
func dtDaemonHWM(t *testing.T, pid int) int64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("daemon status: %v", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb); err != nil {
				t.Fatalf("VmHWM line %q: %v", line, err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no VmHWM in /proc/%d/status", pid)
	return 0
}

func dtSHA(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// TestDataLargeCopyNoDaemonIO writes 64 MiB of random data with dd, reads
// it back with cp, cat, cmp and a child's mmap; in passthrough mode the
// daemon serves none of it. Its daemons collect at their own GC target
// (daemonOwnGC): it measures their memory.
func TestDataLargeCopyNoDaemonIO(t *testing.T) {
	t.Parallel()
	src := filepath.Join(t.TempDir(), "random.bin")
	run(t, "dd", "if=/dev/urandom", "of="+src, "bs=1M", "count=64", "status=none")
	srcBytes, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	const mmapScript = `
import hashlib, mmap, os, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
print("sha", hashlib.sha256(m).hexdigest())
m[1 << 20:(1 << 20) + 11] = b"mmap-marker"
m.flush()
m.close()
os.close(fd)
`
	eachMode(t, true, func(t *testing.T, m *mount) {
		out := t.TempDir()
		dst := m.path("big.bin")
		run(t, "dd", "if="+src, "of="+dst, "bs=1M", "conv=fsync", "status=none")
		if fi, err := os.Stat(dst); err != nil || fi.Size() != 64<<20 {
			t.Fatalf("stat %s: %v %v, want 64 MiB", dst, fi, err)
		}
		run(t, "cp", dst, filepath.Join(out, "cp.bin"))
		run(t, "cmp", src, filepath.Join(out, "cp.bin"))
		run(t, "sh", "-c", `cat "$1" > "$2"`, "sh", dst, filepath.Join(out, "cat.bin"))
		run(t, "cmp", src, filepath.Join(out, "cat.bin"))
		run(t, "cmp", src, dst)
		// dd reading with a large block and with O_DIRECT.
		run(t, "dd", "if="+dst, "of="+filepath.Join(out, "dd.bin"), "bs=4M", "status=none")
		run(t, "cmp", src, filepath.Join(out, "dd.bin"))
		run(t, "dd", "if="+dst, "of="+filepath.Join(out, "direct.bin"), "bs=1M", "iflag=direct", "status=none")
		run(t, "cmp", src, filepath.Join(out, "direct.bin"))
		// cp into the mount, too, and a second segment by cat.
		run(t, "cp", src, m.path("cp-in.bin"))
		run(t, "sh", "-c", `cat "$1" > "$2"`, "sh", src, m.path("cat-in.bin"))
		run(t, "cmp", src, m.path("cp-in.bin"))
		run(t, "cmp", src, m.path("cat-in.bin"))

		// A child maps the segment, checks every byte, writes a marker.
		sum := python(t, mmapScript, dst)
		if want := "sha " + dtSHA(srcBytes); strings.TrimSpace(sum) != want {
			t.Errorf("child's mmap of %s: %q, want %q", dst, strings.TrimSpace(sum), want)
		}
		got, err := os.ReadFile(dst)
		if err != nil {
			t.Fatal(err)
		}
		want := bytes.Clone(srcBytes)
		copy(want[1<<20:], "mmap-marker")
		if !bytes.Equal(got, want) {
			t.Errorf("after the child's mmap write, the segment is not the source plus the marker")
		}

		dtCheckRequests(t, m, "dd, cp, cat, cmp and an mmap of 64 MiB", true, true)
		// Classic mode serves 1 MiB reads with splice, as go-fuse offers
		// it; a request too big for a pipe falls back to copying and
		// go-fuse logs each such fallback.
		if out := m.stderr.String(); strings.Contains(out, "trySplice") {
			n := strings.Count(out, "trySplice")
			first := out[strings.Index(out, "trySplice"):]
			first, _, _ = strings.Cut(first, "\n")
			t.Errorf("%s: the daemon logged %d splice fallbacks while serving reads, e.g. %q", m.mode, n, first)
		}

		// The daemon's memory does not grow with the bytes it stores: its
		// peak RSS stays below one copy of the data (192 MiB are stored).
		hwm := dtDaemonHWM(t, m.pid)
		if m.mode == "passthrough" && hwm >= 64<<20 {
			t.Errorf("passthrough daemon's peak RSS (VmHWM) is %d MiB after storing 192 MiB", hwm>>20)
		}
		// And stats says so: its daemon.max_rss_bytes is the daemon's own
		// peak, not one inherited from whoever started it.
		daemon, _ := m.stats(t)["daemon"].(map[string]any)
		if rss, ok := daemon["max_rss_bytes"].(float64); !ok {
			t.Errorf("stats has no daemon.max_rss_bytes: %v", daemon)
		} else if hwm2 := dtDaemonHWM(t, m.pid); int64(rss) > hwm2+hwm2/2+(8<<20) {
			t.Errorf("stats daemon.max_rss_bytes = %d MiB, but the daemon's VmHWM in /proc/%d/status is %d MiB",
				int64(rss)>>20, m.pid, hwm2>>20)
		}
	}, daemonOwnGC, nil)
}

// TestMmapSharedTwoProcesses: two children map the same segment
// MAP_SHARED at once and each sees the other's stores, without msync.
func TestMmapSharedTwoProcesses(t *testing.T) {
	t.Parallel()
	const a = `
import mmap, os, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)  # the mapping outlives the descriptor
m[0:10] = b"A-was-here"
m[(1 << 20) - 5:] = b"A-end"
print("mapped")
sys.stdin.readline()
print("saw", m[4096:4106].decode("ascii", "replace"))
m[8192:8200] = b"A-second"
print("wrote")
sys.stdin.readline()
m.close()
`
	const b = `
import mmap, os, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
print("saw", m[0:10].decode("ascii", "replace"), m[-5:].decode("ascii", "replace"))
m[4096:4106] = b"B-was-here"
print("wrote")
sys.stdin.readline()
print("saw", m[8192:8200].decode("ascii", "replace"))
m.close()
os.close(fd)
`
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("shared.seg")
		ca := startPython(t, "child A", a, p)
		ca.expect(t, "mapped")
		cb := startPython(t, "child B", b, p)
		if got := cb.expect(t, "saw"); got != "A-was-here A-end" {
			t.Errorf("B saw %q in its mapping, want A's stores \"A-was-here A-end\"", got)
		}
		cb.expect(t, "wrote")
		ca.send(t, "go")
		if got := ca.expect(t, "saw"); got != "B-was-here" {
			t.Errorf("A saw %q in its mapping, want B's store \"B-was-here\"", got)
		}
		ca.expect(t, "wrote")
		cb.send(t, "go")
		if got := cb.expect(t, "saw"); got != "A-second" {
			t.Errorf("B saw %q, want A's second store \"A-second\"", got)
		}
		cb.wait(t)
		ca.send(t, "done")
		ca.wait(t)

		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if len(data) != 1<<20 {
			t.Fatalf("segment is %d bytes, want 1 MiB", len(data))
		}
		for off, want := range map[int]string{0: "A-was-here", 4096: "B-was-here", 8192: "A-second", 1<<20 - 5: "A-end"} {
			if got := string(data[off : off+len(want)]); got != want {
				t.Errorf("read through the mount at %d: %q, want %q", off, got, want)
			}
		}
		if m.mode == "passthrough" {
			dtCheckRequests(t, m, "two shared mappings", true, true)
		}
	})
}

// TestMmapHandleSamePages: a process that opens the backing path from
// user.tensorfs.handle sees what a mapping of the mount stored — in
// passthrough mode the same pages, without msync; in classic mode once
// the mapping is synced. In passthrough mode stores through the backing
// show in the mount's mapping as well.
func TestMmapHandleSamePages(t *testing.T) {
	t.Parallel()
	const mapper = `
import mmap, os, sys
path, sync = sys.argv[1], sys.argv[2] == "sync"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 65536)
m = mmap.mmap(fd, 65536, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[0:16] = b"mount-mapping-01"
m[40000:40016] = b"mount-mapping-02"
if sync:
    m.flush()
print("stored")
sys.stdin.readline()
print("saw", m[8192:8208].decode("ascii", "replace"))
sys.stdin.readline()
m.close()
os.close(fd)
`
	const backingWriter = `
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
print("saw", m[0:16].decode("ascii", "replace"))
m[8192:8208] = b"backing-mapping!"
m.close()
os.close(fd)
`
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("handle.seg")
		sync := "nosync"
		if m.mode == "classic" {
			sync = "sync"
		}
		c := startPython(t, "mapper", mapper, p, sync)
		c.expect(t, "stored")

		h, err := getxattr(p, "user.tensorfs.handle")
		if err != nil {
			t.Fatalf("getxattr %s user.tensorfs.handle: %v", p, err)
		}
		backing := string(h)
		if !filepath.IsAbs(backing) || strings.HasPrefix(backing, m.dir+"/") {
			t.Fatalf("user.tensorfs.handle = %q, want an absolute path outside the mount", backing)
		}
		data, err := os.ReadFile(backing)
		if err != nil {
			t.Fatalf("read the backing %s: %v", backing, err)
		}
		if len(data) != 65536 {
			t.Fatalf("backing %s is %d bytes, want 65536", backing, len(data))
		}
		if got := string(data[0:16]); got != "mount-mapping-01" {
			t.Errorf("%s: backing read at 0 = %q while the mount's mapping holds \"mount-mapping-01\"", m.mode, got)
		}
		if got := string(data[40000:40016]); got != "mount-mapping-02" {
			t.Errorf("%s: backing read at 40000 = %q while the mount's mapping holds \"mount-mapping-02\"", m.mode, got)
		}

		if m.mode == "passthrough" {
			// The other way round: a mapping of the backing file stores,
			// the mount's mapping sees it — one set of pages.
			out := python(t, backingWriter, backing)
			if got := strings.TrimSpace(out); got != "saw mount-mapping-01" {
				t.Errorf("mapping of the backing saw %q, want \"saw mount-mapping-01\"", got)
			}
			c.send(t, "check")
			if got := c.expect(t, "saw"); got != "backing-mapping!" {
				t.Errorf("the mount's mapping saw %q after a store through the backing, want \"backing-mapping!\"", got)
			}
		} else {
			c.send(t, "check")
			c.expect(t, "saw")
		}
		c.send(t, "done")
		c.wait(t)

		// After close, the mount and the backing agree byte for byte.
		viaMount, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		viaBacking, err := os.ReadFile(backing)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(viaMount, viaBacking) {
			t.Errorf("after close the mount and the backing %s differ", backing)
		}
		if m.mode == "passthrough" {
			if got := string(viaMount[8192:8208]); got != "backing-mapping!" {
				t.Errorf("read through the mount at 8192: %q, want \"backing-mapping!\"", got)
			}
			dtCheckRequests(t, m, "mappings of a segment and its backing", true, true)
		}
	})
}

// TestDataFioVerify runs a short fio 4k random read/write job with crc32c
// verification against a segment.
func TestDataFioVerify(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("fio"); err != nil {
		skipOrFail(t, "fio not installed: %v", err)
	}
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		seg := m.path("fio.seg")
		out := run(t, "fio", "--name=v", "--filename="+seg, "--size=8M", "--rw=randrw", "--bs=4k",
			"--verify=crc32c", "--do_verify=1", "--ioengine=psync", "--randseed=1234", "--verify_state_save=0")
		if !strings.Contains(out, "err= 0") {
			t.Errorf("fio output has no \"err= 0\":\n%s", out)
		}
		if strings.Contains(out, "verify:") && strings.Contains(out, "bad") {
			t.Errorf("fio reports verification errors:\n%s", out)
		}
		if fi, err := os.Stat(seg); err != nil || fi.Size() != 8<<20 {
			t.Errorf("fio segment: %v %v, want 8 MiB", fi, err)
		}
		// A second pass in a mapping (mmap engine), verified as well.
		run(t, "fio", "--name=m", "--filename="+seg, "--size=8M", "--rw=randwrite", "--bs=4k",
			"--verify=crc32c", "--do_verify=1", "--ioengine=mmap", "--randseed=99", "--verify_state_save=0")
		dtCheckRequests(t, m, "fio", true, true)
	})
}

// TestDataTruncateKeepsLeadingBytes grows and shrinks segments with
// truncate(2), ftruncate(2) and truncate(1): leading bytes stay, new
// bytes read as zeros, shrunk bytes do not come back.
func TestDataTruncateKeepsLeadingBytes(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("trunc.seg")
		pattern := make([]byte, 10000)
		for i := range pattern {
			pattern[i] = byte(i*7 + 1)
		}
		if err := os.WriteFile(p, pattern, 0o644); err != nil {
			t.Fatal(err)
		}
		check := func(what string, size int, prefix []byte) {
			t.Helper()
			got, err := os.ReadFile(p)
			if err != nil {
				t.Fatalf("%s: read: %v", what, err)
			}
			if len(got) != size {
				t.Fatalf("%s: %d bytes, want %d", what, len(got), size)
			}
			if !bytes.Equal(got[:len(prefix)], prefix) {
				t.Errorf("%s: the leading %d bytes changed", what, len(prefix))
			}
			if i := bytes.IndexFunc(got[len(prefix):], func(r rune) bool { return r != 0 }); i >= 0 {
				t.Errorf("%s: byte %d past the kept %d is not zero", what, len(prefix)+i, len(prefix))
			}
			if fi, err := os.Stat(p); err != nil || fi.Size() != int64(size) {
				t.Errorf("%s: stat %v %v, want size %d", what, fi, err, size)
			}
		}

		if err := os.Truncate(p, 4<<20); err != nil {
			t.Fatalf("truncate to 4 MiB: %v", err)
		}
		check("truncate(2) grow to 4 MiB", 4<<20, pattern)
		if err := os.Truncate(p, 3000); err != nil {
			t.Fatalf("truncate to 3000: %v", err)
		}
		check("truncate(2) shrink to 3000", 3000, pattern[:3000])
		if err := os.Truncate(p, 12000); err != nil {
			t.Fatal(err)
		}
		check("grow back to 12000 (shrunk bytes must not return)", 12000, pattern[:3000])

		f, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(pattern, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(1 << 20); err != nil {
			t.Fatalf("ftruncate grow: %v", err)
		}
		if fi, err := f.Stat(); err != nil || fi.Size() != 1<<20 {
			t.Errorf("fstat after ftruncate grow: %v %v", fi, err)
		}
		if err := f.Truncate(5000); err != nil {
			t.Fatalf("ftruncate shrink: %v", err)
		}
		// Writing past the end of a shrunk file leaves a zero hole.
		if _, err := f.WriteAt([]byte("tail"), 7000); err != nil {
			t.Fatal(err)
		}
		f.Close()
		got, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		want := append(append(bytes.Clone(pattern[:5000]), make([]byte, 2000)...), "tail"...)
		if !bytes.Equal(got, want) {
			t.Errorf("ftruncate shrink to 5000 then write at 7000: got %d bytes, not the pattern, zeros, \"tail\"", len(got))
		}

		run(t, "truncate", "-s", "64K", p)
		check("truncate -s 64K", 64<<10, want)
		run(t, "truncate", "-s", "100", p)
		check("truncate -s 100", 100, pattern[:100])
		run(t, "truncate", "-s", "0", p)
		check("truncate -s 0", 0, nil)
		run(t, "truncate", "-s", "1M", p)
		check("truncate -s 1M after 0", 1<<20, nil)

		// O_TRUNC on open empties the segment.
		if err := os.WriteFile(p, []byte("short"), 0o644); err != nil {
			t.Fatal(err)
		}
		check("O_TRUNC rewrite", 5, []byte("short"))
	})
}
