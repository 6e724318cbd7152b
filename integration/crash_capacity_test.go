package integration

// Crash safety, capacity, shutdown and command-line error tests
// (DESIGN.md §2, §5, §8). Every mmap happens in a child process, never in
// the test process (go-fuse's deadlock). Nothing waits on a fixed sleep:
// tests wait for a ready line, a process exit or poll with a deadline.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

const (
	ccMiB = int64(1) << 20
)

// ccWriteRandom writes n pseudo-random bytes (seeded) to a fresh file
// outside any mount and returns its path and sha256.
func ccWriteRandom(t *testing.T, name string, n int64, seed uint64) (string, string) {
	t.Helper()
	var s [32]byte
	for i := range s {
		s[i] = byte(seed >> (8 * (i % 8)))
	}
	s[31] ^= 0x5a
	r := rand.NewChaCha8(s)
	data := make([]byte, n)
	r.Read(data)
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	return p, hex.EncodeToString(sum[:])
}

// ccSha256 reads a whole file (through the mount: read(2), never mmap).
func ccSha256(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", n, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// ccListxattr lists the extended attribute names of path.
func ccListxattr(path string) ([]string, error) {
	for {
		n, err := unix.Llistxattr(path, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n+256)
		n, err = unix.Llistxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var out []string
		for _, name := range strings.Split(string(buf[:n]), "\x00") {
			if name != "" {
				out = append(out, name)
			}
		}
		slices.Sort(out)
		return out, nil
	}
}

// ccVolatileXattrs change without anything being lost: reference counts,
// holders, subtree totals and the root's stats.
var ccVolatileXattrs = map[string]bool{
	"user.tensorfs.refcount":  true,
	"user.tensorfs.holders":   true,
	"user.tensorfs.rbytes":    true,
	"user.tensorfs.rsegments": true,
	"user.tensorfs.stats":     true,
	"user.tensorfs.socket":    true,
}

// ccEntry is what a crash or a restart must not change about one path.
type ccEntry struct {
	dir    bool
	perm   os.FileMode
	size   int64
	sha    string
	xattrs map[string]string // hex of each stable attribute's value
}

func (e ccEntry) String() string {
	keys := make([]string, 0, len(e.xattrs))
	for k := range e.xattrs {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "dir=%v perm=%v size=%d sha=%.12s xattrs={", e.dir, e.perm, e.size, e.sha)
	for _, k := range keys {
		v, _ := hex.DecodeString(e.xattrs[k])
		fmt.Fprintf(&b, "%s=%q ", k, v)
	}
	b.WriteString("}")
	return b.String()
}

// ccSnapshot records every directory and segment under root (root
// included as "."), except the relative paths in skip.
func ccSnapshot(t *testing.T, root string, skip map[string]bool) map[string]ccEntry {
	t.Helper()
	out := map[string]ccEntry{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if skip[rel] {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		e := ccEntry{dir: d.IsDir(), perm: info.Mode().Perm(), xattrs: map[string]string{}}
		if !e.dir {
			e.sha, e.size, err = ccSha256(p)
			if err != nil {
				return err
			}
		}
		names, err := ccListxattr(p)
		if err != nil {
			return fmt.Errorf("listxattr %s: %w", p, err)
		}
		for _, name := range names {
			if ccVolatileXattrs[name] {
				continue
			}
			v, err := getxattr(p, name)
			if err != nil {
				return fmt.Errorf("getxattr %s %s: %w", p, name, err)
			}
			e.xattrs[name] = hex.EncodeToString(v)
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatalf("snapshot of %s: %v", root, err)
	}
	return out
}

// ccCompare fails for every difference between two snapshots.
func ccCompare(t *testing.T, what string, want, got map[string]ccEntry) {
	t.Helper()
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		w, wok := want[k]
		g, gok := got[k]
		switch {
		case !gok:
			t.Errorf("%s: %s is gone (was %v)", what, k, w)
		case !wok:
			t.Errorf("%s: %s appeared (%v)", what, k, g)
		case w.String() != g.String() || w.sha != g.sha:
			t.Errorf("%s: %s changed\n  was %v\n  now %v", what, k, w, g)
		}
	}
}

// ccHolder is a child process that wrote segments and keeps them open
// (and maybe mapped) until released. It is started without os/exec and
// the test keeps no descriptor of it once it is ready (no pipe, no
// pidfd), so mounts started meanwhile see the same open fds at their
// start and at their unmount.
type ccHolder struct {
	pid     int
	stdout  *os.File // read end of the holder's stdout, until ready
	errPath string   // the holder's stderr
	done    chan struct{}
	status  syscall.WaitStatus
	waitErr error
}

// ccHolderScript writes the segments described by a JSON spec, prints
// "ready PID" and holds every fd (and mapping) it did not close until it
// gets SIGUSR1; then it reads back the segments it must verify through
// the fds it held and exits 0 if they match.
const ccHolderScript = `
import hashlib, json, mmap, os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
spec = json.loads(sys.argv[1])
keep = []
verify = []
for s in spec:
    p = s["path"]
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o640)
    if s.get("flags"):
        os.setxattr(p, "user.tensorfs.flags", s["flags"].encode())
    data = b""
    if s.get("src"):
        with open(s["src"], "rb") as f:
            data = f.read()
    if s.get("mmap"):
        os.ftruncate(fd, len(data))
        m = mmap.mmap(fd, len(data))
        m[:] = data
        m.flush()
        keep.append(m)
    elif data:
        mv = memoryview(data)
        off = 0
        while off < len(data):
            off += os.write(fd, mv[off:off + (1 << 20)])
        os.fsync(fd)
    for k, v in s.get("xattrs", {}).items():
        os.setxattr(p, k, bytes.fromhex(v))
    if s.get("close"):
        os.close(fd)
    else:
        keep.append(fd)
        if s.get("verify"):
            verify.append((p, fd, s["verify"]))
print("ready", os.getpid(), flush=True)
signal.sigwait({signal.SIGUSR1})
for p, fd, want in verify:
    h = hashlib.sha256()
    off = 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            break
        h.update(b)
        off += len(b)
    if h.hexdigest() != want:
        print(p, "read back through the held fd: sha256", h.hexdigest(), "want", want, file=sys.stderr)
        sys.exit(3)
`

// ccSeg is one entry of a holder's spec.
type ccSeg struct {
	Path  string `json:"path"`
	Src   string `json:"src,omitempty"`
	Flags string `json:"flags,omitempty"`
	Mmap  bool   `json:"mmap,omitempty"`
	Close bool   `json:"close,omitempty"`
	// Verify is the sha256 the held fd must read back on release.
	Verify string            `json:"verify,omitempty"`
	Xattrs map[string]string `json:"xattrs,omitempty"`
}

// ccStartHolder starts a holder for segs; waitReady waits until it has
// written everything.
func ccStartHolder(t *testing.T, segs []ccSeg) *ccHolder {
	t.Helper()
	python(t, "pass") // skips without numpy, like every python test
	spec, err := json.Marshal(segs)
	if err != nil {
		t.Fatal(err)
	}
	h := &ccHolder{errPath: filepath.Join(t.TempDir(), "holder.stderr"), done: make(chan struct{})}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	ef, err := os.Create(h.errPath)
	if err != nil {
		t.Fatal(err)
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	h.pid, err = syscall.ForkExec(systemPython, []string{systemPython, "-c", ccHolderScript, string(spec)}, &syscall.ProcAttr{
		Env:   os.Environ(),
		Files: []uintptr{devnull.Fd(), w.Fd(), ef.Fd()},
		// The holder dies with the test process.
		Sys: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	})
	devnull.Close()
	w.Close()
	ef.Close()
	if err != nil {
		r.Close()
		t.Fatalf("starting %s: %v", systemPython, err)
	}
	h.stdout = r
	go func() {
		var ws syscall.WaitStatus
		var err error
		for {
			_, err = syscall.Wait4(h.pid, &ws, 0, nil)
			if err != syscall.EINTR {
				break
			}
		}
		h.status, h.waitErr = ws, err
		close(h.done)
	}()
	t.Cleanup(func() {
		h.stdout.Close()
		select {
		case <-h.done:
		default:
			syscall.Kill(h.pid, syscall.SIGKILL)
			<-h.done
		}
	})
	return h
}

// stderr returns what the holder wrote on stderr.
func (h *ccHolder) stderr() string {
	b, _ := os.ReadFile(h.errPath)
	return string(b)
}

// waitReady waits for the holder's ready line.
func (h *ccHolder) waitReady(t *testing.T) {
	t.Helper()
	h.stdout.SetReadDeadline(time.Now().Add(commandTimeout))
	line, err := bufio.NewReader(h.stdout).ReadString('\n')
	h.stdout.Close()
	if err != nil || !strings.HasPrefix(line, "ready ") {
		syscall.Kill(h.pid, syscall.SIGKILL)
		<-h.done
		t.Fatalf("holder %d failed (%v, status %v): stdout %q\nstderr:\n%s", h.pid, err, h.status, line, h.stderr())
	}
}

// release lets the holder close everything and exit; it must exit 0.
func (h *ccHolder) release(t *testing.T) {
	t.Helper()
	if err := syscall.Kill(h.pid, syscall.SIGUSR1); err != nil {
		t.Fatalf("kill -USR1 %d: %v", h.pid, err)
	}
	select {
	case <-h.done:
	case <-time.After(exitTimeout):
		t.Fatalf("holder %d did not exit within %v after release", h.pid, exitTimeout)
	}
	if h.waitErr != nil || !h.status.Exited() || h.status.ExitStatus() != 0 {
		t.Errorf("holder %d: wait %v, status %v, want exit 0\nstderr:\n%s", h.pid, h.waitErr, h.status, h.stderr())
	}
}

// ccStartCmd starts a real tool in the background; wait returns its
// combined output and error.
func ccStartCmd(t *testing.T, name string, args ...string) func() (string, error) {
	t.Helper()
	var out lockedBuffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return func() (string, error) {
		select {
		case err := <-done:
			return out.String(), err
		case <-time.After(commandTimeout):
			cmd.Process.Kill()
			<-done
			return out.String(), fmt.Errorf("%s timed out after %v", name, commandTimeout)
		}
	}
}

// ccXattr reads an attribute as a string, failing the test on error.
func ccXattr(t *testing.T, path, name string) string {
	t.Helper()
	v, err := getxattr(path, name)
	if err != nil {
		t.Fatalf("getxattr %s %s: %v", path, name, err)
	}
	return string(v)
}

// ccHex is the hex of a string, as ccSeg.Xattrs wants it.
func ccHex(s string) string { return hex.EncodeToString([]byte(s)) }

// ccWaitENOTCONN waits until path answers ENOTCONN to stat: a crashed
// daemon's mount answers it once the kernel's cached attributes expire.
func ccWaitENOTCONN(t *testing.T, path string) {
	t.Helper()
	eventually(t, "stat "+path+" answers ENOTCONN", func() (bool, string) {
		_, err := os.Stat(path)
		return errors.Is(err, syscall.ENOTCONN), fmt.Sprintf("stat: %v", err)
	})
}

// ccExpectENOTCONN checks that uncached requests to a crashed mount fail
// with ENOTCONN right away.
func ccExpectENOTCONN(t *testing.T, m *mount, file string) {
	t.Helper()
	if _, err := os.ReadDir(m.dir); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("readdir %s after kill -9: %v, want ENOTCONN", m.dir, err)
	}
	if _, err := getxattr(m.dir, statsXattr); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("getxattr %s %s after kill -9: %v, want ENOTCONN", m.dir, statsXattr, err)
	}
	if _, _, err := ccSha256(m.path(file)); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("reading %s after kill -9: %v, want ENOTCONN", file, err)
	}
}

// TestCrashRecovery: writers in child processes fill segments, xattrs,
// flags and a directory tree; some still hold their fds (and mappings)
// when the daemon is killed with SIGKILL. The mountpoint answers ENOTCONN;
// tensorfs mount on the same mountpoint cleans the stale mount up and
// restores every segment byte for byte, every xattr and the tree.
// Handle counts restart at zero, and UNLINK segments that were alive at
// the crash are removed (DESIGN.md §2, §3, §8), except that a passthrough
// mapping maps the backing file's pages and outlives the daemon: it still
// counts, and an UNLINK segment it maps stays until it goes (§4).
func TestCrashRecovery(t *testing.T) {
	t.Parallel()
	type src struct {
		path, sha string
	}
	srcs := map[string]src{}
	for i, s := range []struct {
		name string
		size int64
	}{
		{"w0", 4 * ccMiB}, {"small", 7}, {"weight", 3*ccMiB + 5}, {"bias", 1000},
		{"emb", 2 * ccMiB}, {"scratch", 64 << 10}, {"u1", 100 << 10}, {"u2", 1 * ccMiB}, {"late", 12345},
	} {
		p, sha := ccWriteRandom(t, s.name, s.size, uint64(i+1)*7919)
		srcs[s.name] = src{p, sha}
	}
	fooValue := "bar\x00\xff baz"

	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "mkdir", "-p", m.path("models/layer1"), m.path("models/layer2"), m.path("d/e/f"), m.path("tmp"))
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "UNLINK", m.path("tmp"))
		run(t, "setfattr", "-n", "user.foo", "-v", "0x"+ccHex("directory value"), m.path("models"))

		// Writers run at the same time: two dd processes that finish and
		// close, and three python processes that keep fds and mappings.
		waitDD1 := ccStartCmd(t, "dd", "if="+srcs["w0"].path, "of="+m.path("w0.bin"), "bs=64k", "conv=fsync", "status=none")
		waitDD2 := ccStartCmd(t, "dd", "if="+srcs["small"].path, "of="+m.path("d/e/small"), "bs=1", "conv=fsync", "status=none")
		h1 := ccStartHolder(t, []ccSeg{
			{Path: m.path("models/layer1/weight"), Src: srcs["weight"].path, Xattrs: map[string]string{
				"user.tensor.dtype": ccHex("bfloat16"), "user.tensor.shape": ccHex("[1024, 1536]"), "user.foo": ccHex(fooValue),
			}},
			{Path: m.path("models/layer1/bias"), Src: srcs["bias"].path, Close: true, Xattrs: map[string]string{
				"user.tensor.dtype": ccHex("float16"), "user.tensor.shape": ccHex("[500]"),
			}},
			{Path: m.path("tmp/scratch"), Src: srcs["scratch"].path},
		})
		h2 := ccStartHolder(t, []ccSeg{
			{Path: m.path("models/layer2/emb"), Src: srcs["emb"].path, Mmap: true, Flags: "KEEPFD", Xattrs: map[string]string{
				"user.tensor.dtype": ccHex("float32"), "user.tensor.shape": ccHex("[512, 1024]"),
			}},
			{Path: m.path("u1"), Src: srcs["u1"].path, Flags: "SHAREDMEM|UNLINK"},
		})
		h3 := ccStartHolder(t, []ccSeg{
			// Mapped, fd closed: the mapping alone holds it.
			{Path: m.path("u2"), Src: srcs["u2"].path, Mmap: true, Close: true, Flags: "UNLINK"},
			{Path: m.path("empty"), Close: true, Xattrs: map[string]string{"user.foo": ccHex("only attributes")}},
		})
		for _, w := range []func() (string, error){waitDD1, waitDD2} {
			if out, err := w(); err != nil {
				t.Fatalf("dd writer: %v\n%s", err, out)
			}
		}
		h1.waitReady(t)
		h2.waitReady(t)
		h3.waitReady(t)
		run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "float32", m.path("w0.bin"))
		run(t, "setfattr", "-n", "user.tensor.shape", "-v", "[1024, 1024]", m.path("w0.bin"))
		run(t, "setfattr", "-n", "user.foo", "-v", "0x"+ccHex(fooValue), m.path("w0.bin"))
		run(t, "setfattr", "-n", "user.tensorfs.flags", "-v", "EXCLUSIVE", m.path("models"))

		// What the writers wrote is there before the crash.
		contents := map[string]string{
			"w0.bin": "w0", "d/e/small": "small", "models/layer1/weight": "weight",
			"models/layer1/bias": "bias", "models/layer2/emb": "emb",
		}
		for rel, name := range contents {
			sha, _, err := ccSha256(m.path(rel))
			if err != nil || sha != srcs[name].sha {
				t.Fatalf("before the crash %s: sha256 %s %v, want %s", rel, sha, err, srcs[name].sha)
			}
		}
		for _, rel := range []string{"u1", "u2", "tmp/scratch"} {
			if got := ccXattr(t, m.path(rel), "user.tensorfs.flags"); !strings.Contains(got, "UNLINK") {
				t.Errorf("flags of %s = %q, want UNLINK in it", rel, got)
			}
		}
		if got := ccXattr(t, m.path("models/layer2/emb"), "user.tensorfs.flags"); !strings.Contains(got, "KEEPFD") {
			t.Errorf("flags of models/layer2/emb = %q, want KEEPFD in it", got)
		}
		for _, rel := range []string{"models/layer1/weight", "models/layer2/emb", "u1", "tmp/scratch"} {
			if rc := ccXattr(t, m.path(rel), "user.tensorfs.refcount"); rc == "0" {
				t.Errorf("before the crash %s has refcount 0 while a child holds it open", rel)
			}
		}
		unlinked := []string{"u1", "u2", "tmp/scratch"}
		handles := map[string]string{}
		for _, rel := range unlinked {
			if _, err := os.Lstat(m.path(rel)); err != nil {
				t.Fatalf("UNLINK segment %s held by a child is gone before the crash: %v", rel, err)
			}
			handles[rel] = ccXattr(t, m.path(rel), "user.tensorfs.handle")
		}
		skip := map[string]bool{}
		for _, rel := range unlinked {
			skip[rel] = true
		}
		before := ccSnapshot(t, m.dir, skip)
		if got := before["w0.bin"].xattrs["user.tensor.dtype"]; got != ccHex("float32") {
			t.Errorf("w0.bin dtype before the crash = %q, want float32", got)
		}
		if got := before["models/layer1/weight"].xattrs["user.foo"]; got != ccHex(fooValue) {
			t.Errorf("weight user.foo before the crash = %q, want %q", got, fooValue)
		}

		m.kill9(t)
		ccExpectENOTCONN(t, m, "w0.bin")
		ccWaitENOTCONN(t, m.dir)

		m2 := m.remount(t)
		if !isMounted(m.dir) {
			t.Fatalf("%s is not mounted after the remount", m.dir)
		}
		// h3 still maps u2 and h2 emb: in passthrough mode their pages
		// are the backing's; in classic mode the dead mount's page cache.
		pt := m.mode == "passthrough"
		mapped := map[string]*ccHolder{}
		if pt {
			mapped = map[string]*ccHolder{"u2": h3, "models/layer2/emb": h2}
		}
		after := ccSnapshot(t, m2.dir, map[string]bool{"u2": pt})
		ccCompare(t, "after kill -9 and remount", before, after)
		for _, rel := range unlinked {
			if mapped[rel] != nil {
				if _, err := os.Lstat(m2.path(rel)); err != nil {
					t.Errorf("UNLINK segment %s still mapped at the remount: lstat = %v, want it kept", rel, err)
				}
				continue
			}
			if _, err := os.Lstat(m2.path(rel)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("UNLINK segment %s alive at the crash: lstat after remount = %v, want ENOENT", rel, err)
			}
			if _, err := os.Lstat(handles[rel]); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("UNLINK segment %s: backing %s still there after remount (%v)", rel, handles[rel], err)
			}
		}
		if fi, err := os.Stat(m2.path("tmp")); err != nil || !fi.IsDir() {
			t.Errorf("directory tmp (flags UNLINK) must survive: %v", err)
		}
		// checkRefcounts: no references but the mappings of mapped, once
		// the RELEASEs of the test's own reads have reached the daemon.
		checkRefcounts := func(when string, mapped map[string]*ccHolder) {
			t.Helper()
			files := map[string]bool{}
			for rel, e := range after {
				files[rel] = !e.dir
			}
			for rel := range mapped {
				files[rel] = true
			}
			for rel, file := range files {
				if !file {
					continue
				}
				rc, hs := "0", ""
				if h := mapped[rel]; h != nil {
					rc, hs = "1", holderLine(t, h.pid, 1)
				}
				eventually(t, when+": references to "+rel, func() (bool, string) {
					got := ccXattr(t, m2.path(rel), "user.tensorfs.refcount")
					gotHs := strings.TrimSpace(ccXattr(t, m2.path(rel), "user.tensorfs.holders"))
					return got == rc && gotHs == hs, fmt.Sprintf("refcount %q, holders %q; want %s, %q", got, gotHs, rc, hs)
				})
			}
		}
		checkRefcounts("after remount", mapped)
		want := 6 // w0.bin, small, weight, bias, emb, empty
		if pt {
			want++ // u2
		}
		st := m2.stats(t)
		if segs, _ := st["segments"].(float64); int(segs) != want {
			t.Errorf("stats segments after remount = %v, want %d", st["segments"], want)
		}

		// The recovered mount works: new segments, and the old holders
		// letting go of the dead mount change nothing.
		run(t, "dd", "if="+srcs["late"].path, "of="+m2.path("models/layer2/late"), "status=none")
		run(t, "cmp", srcs["late"].path, m2.path("models/layer2/late"))
		h1.release(t)
		h2.release(t)
		h3.release(t)
		run(t, "rm", m2.path("models/layer2/late"))
		xaWaitGone(t, m2.path("u2"))
		if _, err := os.Lstat(handles["u2"]); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("UNLINK segment u2: backing %s still there after its last mapping (%v)", handles["u2"], err)
		}
		ccCompare(t, "after the holders of the dead mount exited", before, ccSnapshot(t, m2.dir, nil))
		checkRefcounts("after the holders exited", nil)
	})
}

// TestCrashRemountImmediately: a restart right after the crash (a
// supervisor restarting the daemon) must recover too, even while the
// kernel still has the dead mount's root attributes cached and a stat of
// the mountpoint succeeds (DESIGN.md §8: mounting over a stale mount left
// by a crashed daemon cleans it up and recovers).
func TestCrashRemountImmediately(t *testing.T) {
	t.Parallel()
	src, sha := ccWriteRandom(t, "seg", 1*ccMiB+17, 42)
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if="+src, "of="+m.path("seg"), "bs=64k", "status=none")
		run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "uint8", m.path("seg"))
		if _, err := os.Stat(m.dir); err != nil {
			t.Fatal(err)
		}
		m.kill9(t)
		ccExpectENOTCONN(t, m, "seg")

		m2 := m.remount(t)
		if got, _, err := ccSha256(m2.path("seg")); err != nil || got != sha {
			t.Errorf("seg after immediate remount: sha256 %s %v, want %s", got, err, sha)
		}
		if got := ccXattr(t, m2.path("seg"), "user.tensor.dtype"); got != "uint8" {
			t.Errorf("dtype after immediate remount = %q, want uint8", got)
		}
	})
}

// TestCrashPurge: tensorfs unmount --purge cleans a crashed daemon's stale
// mount and releases its backing; the next mount is empty.
func TestCrashPurge(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if=/dev/zero", "of="+m.path("seg"), "bs=1M", "count=2", "status=none")
		handle := ccXattr(t, m.path("seg"), "user.tensorfs.handle")
		m.kill9(t)
		ccExpectENOTCONN(t, m, "seg")
		run(t, tensorfs, "unmount", "--purge", m.dir)
		if isMounted(m.dir) {
			t.Fatalf("%s still mounted after tensorfs unmount --purge of a crashed mount", m.dir)
		}
		if _, err := os.Lstat(handle); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("backing file %s survives --purge: %v", handle, err)
		}
		m2 := m.remount(t)
		if ents, err := os.ReadDir(m2.dir); err != nil || len(ents) != 0 {
			t.Errorf("mount after --purge: readdir = %v %v, want empty", ents, err)
		}
	})
}

// TestCrashUnmountThenRemount: tensorfs unmount (no --purge) cleans a
// crashed daemon's stale mount and keeps the data; the next mount has it.
func TestCrashUnmountThenRemount(t *testing.T) {
	t.Parallel()
	src, sha := ccWriteRandom(t, "seg", 1*ccMiB+99, 13)
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if="+src, "of="+m.path("seg"), "bs=64k", "status=none")
		run(t, "setfattr", "-n", "user.foo", "-v", "after-crash", m.path("seg"))
		m.kill9(t)
		ccExpectENOTCONN(t, m, "seg")
		run(t, tensorfs, "unmount", m.dir)
		if isMounted(m.dir) {
			t.Fatalf("%s still mounted after tensorfs unmount of a crashed mount", m.dir)
		}
		m2 := m.remount(t)
		if got, _, err := ccSha256(m2.path("seg")); err != nil || got != sha {
			t.Errorf("seg after unmount and remount: sha256 %s %v, want %s", got, err, sha)
		}
		if got := ccXattr(t, m2.path("seg"), "user.foo"); got != "after-crash" {
			t.Errorf("user.foo = %q, want after-crash", got)
		}
	})
}

// ccStatfs returns the total and available bytes statfs reports.
func ccStatfs(t *testing.T, dir string) (total, avail int64) {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatalf("statfs %s: %v", dir, err)
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize
}

// ccSize stats path and returns its size.
func ccSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	return fi.Size()
}

// ccPyFtruncate runs os.ftruncate(path, size) in a child and returns the
// errno name it failed with, or "ok".
const ccPyFtruncate = `
import errno, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    os.ftruncate(fd, int(sys.argv[2]))
    print("ok")
except OSError as e:
    print(errno.errorcode.get(e.errno, str(e.errno)))
`

// ccPyTouch maps a segment in a child, writes one byte to every page (a
// SIGBUS would kill it), and prints the sha256 of the whole mapping.
const ccPyTouch = `
import hashlib, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size)
ps = mmap.PAGESIZE
for off in range(0, size, ps):
    m[off] = (off // ps) % 251 + 1
m.flush()
print(hashlib.sha256(m).hexdigest())
m.close()
os.close(fd)
`

// TestCapacityENOSPC: with --capacity 64M, df shows 64M; growing a
// segment past what is free fails with ENOSPC at truncate time and leaves
// the size as it was; a segment that grew is reserved, so a child mapping
// it touches every page without SIGBUS and a second one that big does not
// fit; a full mount keeps serving reads, xattrs and unlinks, after which
// the space is free again (DESIGN.md §5).
func TestCapacityENOSPC(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		total, avail := ccStatfs(t, m.dir)
		if total < 63*ccMiB || total > 65*ccMiB {
			t.Errorf("statfs total = %d bytes, want about 64 MiB", total)
		}
		if avail < 60*ccMiB {
			t.Errorf("statfs available on an empty 64M mount = %d bytes", avail)
		}
		df := strings.Fields(run(t, "df", "-B1", "--output=size", m.dir))
		if len(df) != 2 {
			t.Fatalf("df -B1 --output=size %s: %q", m.dir, df)
		}
		if size, err := strconv.ParseInt(df[1], 10, 64); err != nil || size < 63*ccMiB || size > 65*ccMiB {
			t.Errorf("df size = %q, want about 64 MiB", df[1])
		}
		if c, _ := m.stats(t)["capacity"].(float64); int64(c) < 63*ccMiB || int64(c) > 65*ccMiB {
			t.Errorf("stats capacity = %v, want about 64 MiB", m.stats(t)["capacity"])
		}

		seg, other := m.path("seg"), m.path("other")
		src, _ := ccWriteRandom(t, "first", 1*ccMiB, 7)
		run(t, "dd", "if="+src, "of="+seg, "bs=64k", "status=none")

		out := runExpectFail(t, "truncate", "-s", "100M", seg)
		if !strings.Contains(out, "No space left on device") {
			t.Errorf("truncate -s 100M: %q, want ENOSPC (No space left on device)", out)
		}
		if got := ccSize(t, seg); got != 1*ccMiB {
			t.Errorf("size after the refused truncate = %d, want %d", got, 1*ccMiB)
		}
		if got := strings.TrimSpace(python(t, ccPyFtruncate, seg, strconv.FormatInt(100*ccMiB, 10))); got != "ENOSPC" {
			t.Errorf("os.ftruncate(100M) = %s, want ENOSPC", got)
		}
		if got := ccSize(t, seg); got != 1*ccMiB {
			t.Errorf("size after the refused ftruncate = %d, want %d", got, 1*ccMiB)
		}
		run(t, "cmp", src, seg) // and the bytes are untouched

		run(t, "truncate", "-s", "40M", seg)
		if got := ccSize(t, seg); got != 40*ccMiB {
			t.Fatalf("size after truncate -s 40M = %d", got)
		}
		if _, avail := ccStatfs(t, m.dir); avail > 25*ccMiB {
			t.Errorf("after growing a segment to 40M, %d bytes still free of 64M: pages not reserved", avail)
		}
		touched := strings.TrimSpace(python(t, ccPyTouch, seg))
		if sha, n, err := ccSha256(seg); err != nil || sha != touched || n != 40*ccMiB {
			t.Errorf("read back after the child's mmap writes: sha256 %s (%d bytes) %v, child saw %s", sha, n, err, touched)
		}
		copyOut := filepath.Join(t.TempDir(), "seg.copy")
		run(t, "cp", seg, copyOut)

		out = runExpectFail(t, "truncate", "-s", "40M", other)
		if !strings.Contains(out, "No space left on device") {
			t.Errorf("second truncate -s 40M: %q, want ENOSPC (the first reserved its pages)", out)
		}
		if got := ccSize(t, other); got != 0 {
			t.Errorf("size of %s after the refused truncate = %d, want 0", other, got)
		}
		if got := strings.TrimSpace(python(t, ccPyFtruncate, other, strconv.FormatInt(40*ccMiB, 10))); got != "ENOSPC" {
			t.Errorf("os.ftruncate(other, 40M) = %s, want ENOSPC", got)
		}

		// Fill what is left: the mount is full.
		out = runExpectFail(t, "dd", "if=/dev/zero", "of="+m.path("fill"), "bs=1M", "status=none")
		if !strings.Contains(out, "No space left on device") {
			t.Errorf("dd until full: %q, want No space left on device", out)
		}
		if _, avail := ccStatfs(t, m.dir); avail >= 1*ccMiB {
			t.Errorf("after filling, statfs still shows %d bytes available", avail)
		}

		// A full mount serves reads, stats, xattrs and unlinks.
		run(t, "cmp", copyOut, seg)
		run(t, "sh", "-c", "cat \"$1\" \"$2\" >/dev/null", "sh", m.path("fill"), seg)
		if out := run(t, "getfattr", "-d", "-m", "-", seg); !strings.Contains(out, "user.tensorfs.refcount") {
			t.Errorf("getfattr -d on a full mount:\n%s", out)
		}
		if st := m.stats(t); st["mode"] != m.mode {
			t.Errorf("stats on a full mount: %v", st)
		}
		run(t, "ls", "-l", m.dir)
		run(t, "df", m.dir)
		run(t, "rm", m.path("fill"), seg)
		if _, err := os.Lstat(seg); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after rm: %v", seg, err)
		}

		// The space comes back (releases reach the daemon asynchronously).
		eventually(t, "space freed after unlink", func() (bool, string) {
			_, avail := ccStatfs(t, m.dir)
			return avail >= 60*ccMiB, fmt.Sprintf("%d bytes available", avail)
		})
		run(t, "truncate", "-s", "40M", other)
		if got := ccSize(t, other); got != 40*ccMiB {
			t.Errorf("size after truncate -s 40M on the freed mount = %d", got)
		}
		python(t, ccPyTouch, other)
	}, "--capacity", "64M")
}

// TestEFBIG: growing a segment past alloc.MaxSegmentSize (1 TiB) is EFBIG
// and changes nothing; exactly the maximum is not EFBIG (here ENOSPC,
// as the mount is much smaller).
func TestEFBIG(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		seg := m.path("seg")
		run(t, "sh", "-c", "printf 0123456789 > "+seg)
		for _, size := range []int64{alloc.MaxSegmentSize + 1, alloc.MaxSegmentSize + 4096, 2 * alloc.MaxSegmentSize} {
			out := runExpectFail(t, "truncate", "-s", strconv.FormatInt(size, 10), seg)
			if !strings.Contains(out, "File too large") {
				t.Errorf("truncate -s %d: %q, want EFBIG (File too large)", size, out)
			}
			if got := strings.TrimSpace(python(t, ccPyFtruncate, seg, strconv.FormatInt(size, 10))); got != "EFBIG" {
				t.Errorf("os.ftruncate(%d) = %s, want EFBIG", size, got)
			}
			if got := ccSize(t, seg); got != 10 {
				t.Errorf("size after the refused truncate to %d = %d, want 10", size, got)
			}
		}
		out := runExpectFail(t, "truncate", "-s", strconv.FormatInt(alloc.MaxSegmentSize, 10), seg)
		if strings.Contains(out, "File too large") || !strings.Contains(out, "No space left on device") {
			t.Errorf("truncate -s %d (the maximum) on a 256M mount: %q, want ENOSPC, not EFBIG", int64(alloc.MaxSegmentSize), out)
		}
		if got := ccSize(t, seg); got != 10 {
			t.Errorf("size = %d, want 10", got)
		}
		if out := run(t, "cat", seg); out != "0123456789" {
			t.Errorf("contents after the refused truncates = %q", out)
		}
	})
}

// ccPopulate writes a segment with an xattr and a directory and returns
// the sha256 of the segment.
func ccPopulate(t *testing.T, m *mount) string {
	t.Helper()
	src, sha := ccWriteRandom(t, "keep", 512<<10+3, 99)
	run(t, "mkdir", "-p", m.path("dir/sub"))
	run(t, "dd", "if="+src, "of="+m.path("dir/sub/keep"), "bs=64k", "status=none")
	run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "int8", m.path("dir/sub/keep"))
	run(t, "setfattr", "-n", "user.foo", "-v", "kept", m.path("dir"))
	return sha
}

// ccCheckPopulated checks what ccPopulate wrote.
func ccCheckPopulated(t *testing.T, m *mount, sha string) {
	t.Helper()
	if got, _, err := ccSha256(m.path("dir/sub/keep")); err != nil || got != sha {
		t.Errorf("dir/sub/keep: sha256 %s %v, want %s", got, err, sha)
	}
	if got := ccXattr(t, m.path("dir/sub/keep"), "user.tensor.dtype"); got != "int8" {
		t.Errorf("dtype = %q, want int8", got)
	}
	if got := ccXattr(t, m.path("dir"), "user.foo"); got != "kept" {
		t.Errorf("user.foo of dir = %q, want kept", got)
	}
}

// TestSignalShutdown: SIGTERM and SIGINT make a foreground daemon unmount
// and exit 0, leaving no stale mount; the data stays for the next mount
// of the same mountpoint (DESIGN.md §8).
func TestSignalShutdown(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(unix.SignalName(sig), func(t *testing.T) {
			forEachMode(t, func(t *testing.T, m *mount) {
				sha := ccPopulate(t, m)
				if err := m.cmd.Process.Signal(sig); err != nil {
					t.Fatal(err)
				}
				select {
				case <-m.exited:
				case <-time.After(exitTimeout):
					t.Fatalf("daemon %d still running %v after %v", m.pid, exitTimeout, sig)
				}
				if m.exitErr != nil {
					t.Errorf("daemon exited with %v after %v, want exit 0\nstderr:\n%s", m.exitErr, sig, tail(m.stderr.String()))
				}
				if isMounted(m.dir) {
					t.Errorf("%s still mounted after the daemon exited on %v", m.dir, sig)
				}
				if _, err := os.ReadDir(m.dir); err != nil {
					t.Errorf("readdir of the bare mountpoint after %v: %v", sig, err)
				}
				m2 := m.remount(t)
				ccCheckPopulated(t, m2, sha)
			})
		})
	}
}

// TestSignalShutdownBusy: SIGTERM while a child holds a segment open
// detaches the mount at once; the child keeps reading through its fd, and
// once it lets go the daemon exits 0 with nothing left mounted.
func TestSignalShutdownBusy(t *testing.T) {
	t.Parallel()
	src, sha := ccWriteRandom(t, "held", 2*ccMiB+3, 11)
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if="+src, "of="+m.path("held"), "bs=64k", "status=none")
		h := ccStartHolder(t, []ccSeg{{Path: m.path("held"), Verify: sha}})
		h.waitReady(t)
		if err := m.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		eventually(t, "mount detached after SIGTERM", func() (bool, string) {
			return !isMounted(m.dir), m.dir + " is still in the mount table"
		})
		h.release(t) // reads the whole segment back through its fd
		select {
		case <-m.exited:
		case <-time.After(exitTimeout):
			t.Fatalf("daemon %d still running %v after SIGTERM and the last holder's exit", m.pid, exitTimeout)
		}
		if m.exitErr != nil {
			t.Errorf("daemon exited with %v after SIGTERM on a busy mount, want exit 0\nstderr:\n%s", m.exitErr, tail(m.stderr.String()))
		}
		m2 := m.remount(t)
		if got, _, err := ccSha256(m2.path("held")); err != nil || got != sha {
			t.Errorf("held after remount: sha256 %s %v, want %s", got, err, sha)
		}
	})
}

// TestShutdownUnmountKeepsData: tensorfs unmount without --purge keeps
// segments and xattrs for the next mount of the same mountpoint.
func TestShutdownUnmountKeepsData(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		sha := ccPopulate(t, m)
		m.unmount(t, false)
		if isMounted(m.dir) {
			t.Fatalf("%s still mounted after tensorfs unmount", m.dir)
		}
		m2 := m.remount(t)
		ccCheckPopulated(t, m2, sha)
		// Once the RELEASE of ccCheckPopulated's read reaches the daemon.
		xaWaitRefcount(t, m2.path("dir/sub/keep"), "0")
	})
}

// TestPurgeReleasesData: tensorfs unmount --purge releases the backing
// memory; the next mount of the same mountpoint is empty.
func TestPurgeReleasesData(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		ccPopulate(t, m)
		handle := ccXattr(t, m.path("dir/sub/keep"), "user.tensorfs.handle")
		if _, err := os.Lstat(handle); err != nil {
			t.Fatalf("backing %s of a live segment: %v", handle, err)
		}
		m.unmount(t, true)
		if _, err := os.Lstat(handle); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("backing %s survives unmount --purge: %v", handle, err)
		}
		m2 := m.remount(t)
		if ents, err := os.ReadDir(m2.dir); err != nil || len(ents) != 0 {
			t.Errorf("mount after --purge: readdir = %v %v, want empty", ents, err)
		}
		if segs, _ := m2.stats(t)["segments"].(float64); segs != 0 {
			t.Errorf("stats segments after --purge = %v, want 0", segs)
		}
	})
}

// ccMountDaemonized runs tensorfs mount without -f, checks that the
// mount serves requests as soon as the command has returned, and returns
// the daemon's pid. A cleanup removes whatever is left at the end.
func ccMountDaemonized(t *testing.T, dir, mode string, args ...string) int {
	t.Helper()
	t.Cleanup(func() {
		if isMounted(dir) {
			runTimeout(exitTimeout, tensorfs, "unmount", "--purge", dir)
		}
		if isMounted(dir) {
			lazyUnmount(dir)
		}
	})
	if mode == "classic" {
		args = append(args, "--no-passthrough")
	}
	out := run(t, tensorfs, append(append([]string{"mount"}, args...), dir)...)
	// Right after it returns: the mount is there and the daemon answers.
	if !isMounted(dir) {
		t.Fatalf("tensorfs mount returned (%q) but %s is not a fuse mount", out, dir)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatalf("stat %s right after tensorfs mount returned: %v", dir, err)
	}
	raw, err := getxattr(dir, statsXattr)
	if err != nil {
		t.Fatalf("getxattr %s right after tensorfs mount returned: %v", statsXattr, err)
	}
	var stats struct {
		Mode   string `json:"mode"`
		Daemon struct {
			Pid int `json:"pid"`
		} `json:"daemon"`
	}
	if err := json.Unmarshal(raw, &stats); err != nil || stats.Daemon.Pid <= 0 {
		t.Fatalf("stats %s: %v", raw, err)
	}
	if stats.Mode != mode {
		t.Errorf("daemonized mount runs in mode %q, want %q", stats.Mode, mode)
	}
	if !strings.Contains(out, "pid="+strconv.Itoa(stats.Daemon.Pid)) {
		t.Errorf("tensorfs mount said %q, want the daemon's pid %d in it", out, stats.Daemon.Pid)
	}
	return stats.Daemon.Pid
}

// ccUnmountPurgeDaemonized runs tensorfs unmount --purge and checks that
// the mount, its backing and its daemon are gone.
func ccUnmountPurgeDaemonized(t *testing.T, dir string, pid int, before map[mountEntry]bool) {
	t.Helper()
	run(t, tensorfs, "unmount", "--purge", dir)
	if isMounted(dir) {
		t.Errorf("%s still mounted after tensorfs unmount --purge", dir)
	}
	eventually(t, "daemon exits", func() (bool, string) {
		err := unix.Kill(pid, 0)
		return errors.Is(err, unix.ESRCH), fmt.Sprintf("kill(%d, 0) = %v", pid, err)
	})
	for _, e := range readMountinfo() {
		if !before[e] && (e.mountPoint == dir || e.mountPoint == alloc.PrivateBacking(dir)) {
			t.Errorf("mount %s (%s %s) left after unmount --purge", e.mountPoint, e.fsType, e.source)
		}
	}
}

// TestShutdownDaemonizedMount: tensorfs mount without -f returns only once
// the mount serves requests; tensorfs unmount --purge then removes it, its
// backing and its daemon.
func TestShutdownDaemonizedMount(t *testing.T) {
	t.Parallel()
	requireEnvironment(t)
	for _, mode := range []string{"passthrough", "classic"} {
		t.Run(mode, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "mnt")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			before := mountSet()
			pid := ccMountDaemonized(t, dir, mode, "--capacity", "64M")
			f := filepath.Join(dir, "f")
			run(t, "sh", "-c", "echo hello > "+f)
			if b, err := os.ReadFile(f); err != nil || string(b) != "hello\n" {
				t.Errorf("read back %q %v", b, err)
			}
			ccUnmountPurgeDaemonized(t, dir, pid, before)
		})
	}
}

// TestCrashRemountDaemonized: after kill -9, plain tensorfs mount (no -f)
// on the same mountpoint cleans the stale mount and recovers the data.
func TestCrashRemountDaemonized(t *testing.T) {
	t.Parallel()
	src, sha := ccWriteRandom(t, "seg", 3*ccMiB+1, 5)
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "mkdir", "-p", m.path("a/b"))
		run(t, "dd", "if="+src, "of="+m.path("a/b/seg"), "bs=64k", "status=none")
		run(t, "setfattr", "-n", "user.tensor.shape", "-v", "[3, 1048576]", m.path("a/b/seg"))
		want := ccXattr(t, m.path("a/b/seg"), "user.tensor.shape")
		before := mountSet()
		m.kill9(t)
		ccWaitENOTCONN(t, m.dir)

		pid := ccMountDaemonized(t, m.dir, m.mode)
		if got, _, err := ccSha256(m.path("a/b/seg")); err != nil || got != sha {
			t.Errorf("a/b/seg after the daemonized remount: sha256 %s %v, want %s", got, err, sha)
		}
		if got := ccXattr(t, m.path("a/b/seg"), "user.tensor.shape"); got != want {
			t.Errorf("shape after the daemonized remount = %q, want %q", got, want)
		}
		ccUnmountPurgeDaemonized(t, m.dir, pid, before)
	})
}

// ccRunSplit runs tensorfs with args and returns stdout, stderr and the
// exit code (-1 when it did not exit by itself within 30s).
func ccRunSplit(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, tensorfs, args...)
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		return stdout.String(), stderr.String(), -1
	}
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		return stdout.String(), stderr.String(), 0
	case errors.As(err, &exitErr):
		return stdout.String(), stderr.String(), exitErr.ExitCode()
	}
	t.Fatalf("tensorfs %s: %v", strings.Join(args, " "), err)
	return "", "", 0
}

// ccExpectOneLineError runs tensorfs with args, which must fail with one
// line on stderr that contains every string in mention.
func ccExpectOneLineError(t *testing.T, args []string, mention ...string) {
	t.Helper()
	stdout, stderr, code := ccRunSplit(t, args...)
	cmdline := "tensorfs " + strings.Join(args, " ")
	if code == 0 {
		t.Errorf("%s exited 0, want failure\nstdout: %q\nstderr: %q", cmdline, stdout, stderr)
		return
	}
	if code < 0 {
		t.Errorf("%s did not exit within 30s", cmdline)
		return
	}
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if strings.TrimSpace(stderr) == "" || len(lines) != 1 {
		t.Errorf("%s (exit %d): stderr has %d lines, want one clear line:\n%s", cmdline, code, len(lines), stderr)
	}
	for _, s := range mention {
		if !strings.Contains(stderr, s) {
			t.Errorf("%s: stderr %q does not mention %q", cmdline, stderr, s)
		}
	}
}

// TestMountErrors: mount on a missing mountpoint, on one already mounted,
// with a bad --capacity or an unknown flag, and unmount of what is not
// mounted, each exit non-zero with one line on stderr saying what failed;
// none of them mounts anything or disturbs a live mount (DESIGN.md §8).
func TestMountErrors(t *testing.T) {
	t.Parallel()
	requireEnvironment(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	before := mountSet()
	t.Cleanup(func() {
		// A command that wrongly succeeded left a mount: remove it.
		if isMounted(dir) {
			runTimeout(exitTimeout, tensorfs, "unmount", "--purge", dir)
		}
	})
	checkNothingMounted := func(t *testing.T) {
		t.Helper()
		for _, e := range readMountinfo() {
			ours := e.mountPoint == dir || e.mountPoint == missing ||
				e.mountPoint == alloc.PrivateBacking(dir) || e.mountPoint == alloc.PrivateBacking(missing)
			if !before[e] && ours {
				t.Errorf("a failed command left mount %s (%s %s)", e.mountPoint, e.fsType, e.source)
				if isFuse(e) {
					runTimeout(exitTimeout, tensorfs, "unmount", e.mountPoint)
				} else {
					lazyUnmount(e.mountPoint)
				}
			}
		}
	}

	t.Run("MissingMountpoint", func(t *testing.T) {
		ccExpectOneLineError(t, []string{"mount", missing}, missing)
		ccExpectOneLineError(t, []string{"mount", "-f", missing}, missing)
		checkNothingMounted(t)
	})
	t.Run("BadCapacity", func(t *testing.T) {
		for _, c := range []string{"nonsense", "-5M", "12Q", "M"} {
			ccExpectOneLineError(t, []string{"mount", "--capacity", c, dir}, "--capacity")
		}
		checkNothingMounted(t)
	})
	t.Run("UnknownFlag", func(t *testing.T) {
		ccExpectOneLineError(t, []string{"mount", "--bogus", dir}, "bogus")
		ccExpectOneLineError(t, []string{"unmount", "--bogus", dir}, "bogus")
		checkNothingMounted(t)
	})
	t.Run("UnmountNotMounted", func(t *testing.T) {
		ccExpectOneLineError(t, []string{"unmount", dir}, dir, "not mounted")
		ccExpectOneLineError(t, []string{"unmount", missing}, missing)
		checkNothingMounted(t)
	})
	t.Run("AlreadyMounted", func(t *testing.T) {
		m := mountFS(t, "passthrough")
		run(t, "sh", "-c", "echo live > "+m.path("live"))
		stdout, stderr, code := ccRunSplit(t, "mount", m.dir)
		if code == 0 {
			// It stacked a second daemon: take that one off again.
			runTimeout(exitTimeout, tensorfs, "unmount", m.dir)
			t.Errorf("tensorfs mount %s over a live mount exited 0\nstdout: %q", m.dir, stdout)
		} else if lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n"); len(lines) != 1 || !strings.Contains(stderr, m.dir) {
			t.Errorf("tensorfs mount %s over a live mount (exit %d): want one line naming the mountpoint, got:\n%s", m.dir, code, stderr)
		}
		ccExpectOneLineError(t, []string{"mount", "-f", m.dir}, m.dir)
		select {
		case <-m.exited:
			t.Fatalf("the live daemon exited: %v", m.exitErr)
		default:
		}
		if b, err := os.ReadFile(m.path("live")); err != nil || string(b) != "live\n" {
			t.Errorf("the live mount after the refused mounts: %q %v", b, err)
		}
		if st := m.stats(t); st["mode"] != "passthrough" {
			t.Errorf("stats of the live mount: %v", st)
		}
	})
}
