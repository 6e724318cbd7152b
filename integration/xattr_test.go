package integration

// Extended attributes, segment flags and reference counts (DESIGN.md §3
// and §4), driven through the real tools: getfattr/setfattr, dd, sh, mv,
// ln, and a /usr/bin/python3 child that holds descriptors and mappings on
// command (xaChild), so that every wait is on an answer, not a sleep.
// Mappings are only ever made by children: the test process must never
// mmap a file of the mount.

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	xaFlags     = "user.tensorfs.flags"
	xaDevice    = "user.tensorfs.device"
	xaRefcount  = "user.tensorfs.refcount"
	xaHolders   = "user.tensorfs.holders"
	xaHandle    = "user.tensorfs.handle"
	xaRbytes    = "user.tensorfs.rbytes"
	xaRsegments = "user.tensorfs.rsegments"
	xaDtype     = "user.tensor.dtype"
	xaShape     = "user.tensor.shape"
	xaStride    = "user.tensor.stride"
	xaOffset    = "user.tensor.storage_offset"

	// What setfattr and the shell print for each errno.
	xaEINVAL     = "Invalid argument"
	xaEPERM      = "Operation not permitted"
	xaEBUSY      = "Device or resource busy"
	xaEOPNOTSUPP = "Operation not supported"
	xaEEXIST     = "File exists"

	// xaDeadline bounds every wait for something asynchronous: a child's
	// answer, a RELEASE reaching the daemon, an UNLINK segment going.
	xaDeadline = 15 * time.Second
)

// xaChildScript is the holder process: it reads one command a line on
// stdin and answers one line on stdout, "ok", a value, or "err ERRNO".
//
//	open PATH        open O_RDWR|O_CREAT and keep the fd
//	topen PATH       the same, from a new thread
//	write HEX        pwrite the bytes at offset 0 of the last fd
//	mmap PATH SIZE   open, grow to SIZE if smaller, map MAP_SHARED, close the fd
//	peek OFF N       hex of N bytes at OFF of the last mapping
//	poke OFF HEX     store the bytes at OFF of the last mapping
//	close            close every kept fd (mappings stay)
const xaChildScript = `
import errno, mmap, os, sys, threading
fds, maps = [], []
def reply(s):
    sys.stdout.write(s + "\n")
    sys.stdout.flush()
def do_open(p):
    fds.append(os.open(p, os.O_RDWR | os.O_CREAT, 0o644))
for line in sys.stdin:
    a = line.split()
    if not a:
        continue
    try:
        op = a[0]
        if op == "open":
            do_open(a[1])
            reply("ok")
        elif op == "topen":
            errs = []
            def run():
                try:
                    do_open(a[1])
                except OSError as e:
                    errs.append(e)
            th = threading.Thread(target=run)
            th.start()
            th.join()
            if errs:
                raise errs[0]
            reply("ok")
        elif op == "write":
            os.pwrite(fds[-1], bytes.fromhex(a[1]), 0)
            reply("ok")
        elif op == "mmap":
            size = int(a[2])
            fd = os.open(a[1], os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            maps.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            os.close(fd)
            reply("ok")
        elif op == "peek":
            off, n = int(a[1]), int(a[2])
            reply(maps[-1][off:off + n].hex())
        elif op == "poke":
            off, b = int(a[1]), bytes.fromhex(a[2])
            maps[-1][off:off + len(b)] = b
            reply("ok")
        elif op == "close":
            for fd in fds:
                os.close(fd)
            fds.clear()
            reply("ok")
        else:
            reply("err unknown command " + op)
    except OSError as e:
        reply("err " + errno.errorcode.get(e.errno, str(e.errno)))
`

// xaChild is a python3 process that holds fds and mappings on command.
type xaChild struct {
	cmd    *exec.Cmd
	pid    int
	stdin  io.WriteCloser
	out    *xaLines
	stderr *lockedBuffer
	exited chan struct{}
}

// xaLines turns what the child prints into lines on a channel.
type xaLines struct {
	mu    sync.Mutex
	buf   []byte
	lines chan string
}

func (w *xaLines) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.lines <- string(w.buf[:i])
		w.buf = w.buf[i+1:]
	}
}

// startXaChild starts a holder; its cleanup (which runs before the
// mount's) ends it.
func startXaChild(t *testing.T) *xaChild {
	t.Helper()
	c := &xaChild{
		out:    &xaLines{lines: make(chan string, 256)},
		stderr: &lockedBuffer{},
		exited: make(chan struct{}),
	}
	c.cmd = exec.Command(systemPython, "-c", xaChildScript)
	c.cmd.Stdout = c.out
	c.cmd.Stderr = c.stderr
	c.cmd.WaitDelay = 5 * time.Second
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		skipOrFail(t, "starting %s: %v", systemPython, err)
	}
	c.pid = c.cmd.Process.Pid
	go func() {
		c.cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		c.stdin.Close()
		select {
		case <-c.exited:
		case <-time.After(xaDeadline):
			c.cmd.Process.Kill()
			<-c.exited
		}
	})
	return c
}

// try sends one command and returns the answer, "err ..." included.
func (c *xaChild) try(t *testing.T, format string, args ...any) string {
	t.Helper()
	line := fmt.Sprintf(format, args...)
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		t.Fatalf("holder %d: sending %q: %v\nstderr:\n%s", c.pid, line, err, c.stderr.String())
	}
	select {
	case ans := <-c.out.lines:
		return ans
	case <-c.exited:
		t.Fatalf("holder %d exited before answering %q\nstderr:\n%s", c.pid, line, c.stderr.String())
	case <-time.After(xaDeadline):
		t.Fatalf("holder %d did not answer %q within %v\nstderr:\n%s", c.pid, line, xaDeadline, c.stderr.String())
	}
	return ""
}

// do sends one command that must succeed and returns its answer.
func (c *xaChild) do(t *testing.T, format string, args ...any) string {
	t.Helper()
	ans := c.try(t, format, args...)
	if strings.HasPrefix(ans, "err") {
		t.Fatalf("holder %d: %q: %s", c.pid, fmt.Sprintf(format, args...), ans)
	}
	return ans
}

// exit closes the child's stdin and waits for it to exit.
func (c *xaChild) exit(t *testing.T) {
	t.Helper()
	c.stdin.Close()
	select {
	case <-c.exited:
	case <-time.After(xaDeadline):
		t.Fatalf("holder %d did not exit within %v", c.pid, xaDeadline)
	}
}

// kill9 SIGKILLs the child and waits for it.
func (c *xaChild) kill9(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", c.pid, err)
	}
	select {
	case <-c.exited:
	case <-time.After(xaDeadline):
		t.Fatalf("holder %d did not die of SIGKILL within %v", c.pid, xaDeadline)
	}
}

// comm is the child's command name as /proc shows it.
func (c *xaChild) comm(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", c.pid))
	if err != nil {
		t.Fatalf("holder %d: %v", c.pid, err)
	}
	return strings.TrimSpace(string(b))
}

// xaGet reads one attribute with getfattr.
func xaGet(t *testing.T, path, name string) string {
	t.Helper()
	return run(t, "getfattr", "--absolute-names", "--only-values", "-n", name, path)
}

// xaSet writes one attribute with setfattr.
func xaSet(t *testing.T, path, name, value string) {
	t.Helper()
	run(t, "setfattr", "-n", name, "-v", value, path)
}

// xaSetFail writes one attribute with setfattr, which must fail with the
// message of the wanted errno.
func xaSetFail(t *testing.T, path, name, value, want string) {
	t.Helper()
	out := runExpectFail(t, "setfattr", "-n", name, "-v", value, path)
	if !strings.Contains(out, want) {
		t.Errorf("setfattr -n %s -v %q %s: %q, want %q", name, value, path, strings.TrimSpace(out), want)
	}
}

// xaWant fails unless attribute name of path reads want.
func xaWant(t *testing.T, path, name, want string) {
	t.Helper()
	if got := xaGet(t, path, name); got != want {
		t.Errorf("%s of %s = %q, want %q", name, path, got, want)
	}
}

// xaDump returns every attribute getfattr -d -m - lists, decoded.
func xaDump(t *testing.T, path string) map[string]string {
	t.Helper()
	out := run(t, "getfattr", "--absolute-names", "-d", "-m", "-", path)
	attrs := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, val, ok := strings.Cut(line, "=")
		if !ok {
			attrs[name] = ""
			continue
		}
		v, err := xaUnquote(val)
		if err != nil {
			t.Fatalf("getfattr -d %s: line %q: %v", path, line, err)
		}
		attrs[name] = v
	}
	return attrs
}

// xaUnquote decodes a getfattr text value: "..." with \\, \" and \ooo.
func xaUnquote(s string) (string, error) {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return "", fmt.Errorf("value %q is not quoted", s)
	}
	s = s[1 : len(s)-1]
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			b.WriteByte(s[i])
			continue
		}
		if i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		if i+1 < len(s) {
			b.WriteByte(s[i+1])
			i++
			continue
		}
		return "", errors.New("trailing backslash")
	}
	return b.String(), nil
}

// xaExists reports whether path exists (lstat), failing on odd errors.
func xaExists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Lstat(path)
	if err == nil {
		return true
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("lstat %s: %v", path, err)
	}
	return false
}

// xaWaitGone waits until path no longer exists.
func xaWaitGone(t *testing.T, path string) {
	t.Helper()
	eventually(t, path+" removed", func() (bool, string) {
		return !xaExists(t, path), "it still exists"
	})
}

// xaWaitRefcount waits until path's refcount reads want.
func xaWaitRefcount(t *testing.T, path, want string) {
	t.Helper()
	eventually(t, fmt.Sprintf("refcount of %s = %s", path, want), func() (bool, string) {
		got := xaGet(t, path, xaRefcount)
		return got == want, fmt.Sprintf("refcount %q, holders %q", got, xaGet(t, path, xaHolders))
	})
}

// xaHolderLines returns the non-empty lines of holders.
func xaHolderLines(t *testing.T, path string) []string {
	t.Helper()
	var out []string
	for _, l := range strings.Split(xaGet(t, path, xaHolders), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// xaWantHolders fails unless holders is exactly one line "PID COMM N" for c.
func xaWantHolders(t *testing.T, path string, c *xaChild, n int) {
	t.Helper()
	want := fmt.Sprintf("%d %s %d", c.pid, c.comm(t), n)
	if got := xaHolderLines(t, path); !slices.Equal(got, []string{want}) {
		t.Errorf("holders of %s = %q, want one line %q", path, got, want)
	}
}

// xaFlagSet splits a flags value into its names.
func xaFlagSet(v string) []string {
	f := strings.Split(v, "|")
	slices.Sort(f)
	return f
}

// xaRandomFile writes n random bytes to a new file outside the mount.
func xaRandomFile(t *testing.T, n int) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "src.bin")
	run(t, "dd", "if=/dev/urandom", "of="+p, "bs="+strconv.Itoa(n), "count=1", "iflag=fullblock", "status=none")
	return p
}

// xaStats reads the root's stats with getfattr and decodes them.
func xaStats(t *testing.T, m *mount) map[string]any {
	t.Helper()
	raw := xaGet(t, m.dir, statsXattr)
	var st map[string]any
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		t.Fatalf("%s is not JSON: %v\n%s", statsXattr, err, raw)
	}
	return st
}

// xaWantLog waits for a daemon log line with "refused", every one of must
// and at least one of anyOf.
func xaWantLog(t *testing.T, m *mount, must []string, anyOf ...string) {
	t.Helper()
	find := func() bool {
		for _, l := range strings.Split(m.stderr.String(), "\n") {
			if !strings.Contains(l, "refused") {
				continue
			}
			ok := true
			for _, s := range must {
				ok = ok && strings.Contains(l, s)
			}
			if !ok {
				continue
			}
			if len(anyOf) == 0 || slices.ContainsFunc(anyOf, func(s string) bool { return strings.Contains(l, s) }) {
				return true
			}
		}
		return false
	}
	// The daemon logs before it answers; only the copy from its stderr
	// pipe into m.stderr can lag.
	deadline := time.Now().Add(5 * time.Second)
	for !find() {
		if time.Now().After(deadline) {
			t.Errorf("daemon log has no line with \"refused\", %q and one of %q:\n%s",
				must, anyOf, tail(m.stderr.String()))
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestXattrListSegment: getfattr -d on a segment shows the virtual names
// and the stored user.tensor.* ones; a directory shows its own.
func TestXattrListSegment(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("seg")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		xaWaitRefcount(t, p, "0") // dd's RELEASE reaches the daemon after dd exits

		d := xaDump(t, p)
		for _, name := range []string{xaFlags, xaDevice, xaRefcount, xaHolders, xaHandle} {
			if _, ok := d[name]; !ok {
				t.Errorf("getfattr -d -m - %s does not list %s: %q", p, name, d)
			}
		}
		if d[xaFlags] != "SHAREDMEM" || d[xaDevice] != "cpu" || d[xaRefcount] != "0" || d[xaHolders] != "" {
			t.Errorf("getfattr -d of an idle segment: flags %q device %q refcount %q holders %q, want SHAREDMEM cpu 0 \"\"",
				d[xaFlags], d[xaDevice], d[xaRefcount], d[xaHolders])
		}
		if !filepath.IsAbs(d[xaHandle]) {
			t.Errorf("handle %q is not an absolute path", d[xaHandle])
		}
		for name := range d {
			if strings.HasPrefix(name, "user.tensor.") {
				t.Errorf("fresh segment lists %s=%q", name, d[name])
			}
		}

		xaSet(t, p, xaDtype, "float32")
		xaSet(t, p, xaShape, "[32, 32]")
		xaSet(t, p, "user.foo", "bar")
		d = xaDump(t, p)
		for name, want := range map[string]string{xaDtype: "float32", xaShape: "[32, 32]", "user.foo": "bar", xaFlags: "SHAREDMEM"} {
			if got, ok := d[name]; !ok || got != want {
				t.Errorf("getfattr -d after setfattr: %s = %q (listed %v), want %q", name, got, ok, want)
			}
		}

		run(t, "mkdir", m.path("dir"))
		d = xaDump(t, m.path("dir"))
		for _, name := range []string{xaFlags, xaDevice, xaRbytes, xaRsegments} {
			if _, ok := d[name]; !ok {
				t.Errorf("getfattr -d -m - of a directory does not list %s: %q", name, d)
			}
		}
		for _, name := range []string{xaRefcount, xaHolders, xaHandle} {
			if _, ok := d[name]; ok {
				t.Errorf("getfattr -d -m - of a directory lists the segment attribute %s", name)
			}
		}
	})
}

// TestXattrRootStats: the root's user.tensorfs.stats is JSON with mode,
// segments, bytes, capacity and requests, and getfattr -d lists it.
func TestXattrRootStats(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if=/dev/zero", "of="+m.path("a"), "bs=4096", "count=1", "status=none")
		run(t, "mkdir", m.path("sub"))
		run(t, "dd", "if=/dev/zero", "of="+m.path("sub/b"), "bs=8192", "count=1", "status=none")

		if _, ok := xaDump(t, m.dir)[statsXattr]; !ok {
			t.Errorf("getfattr -d -m - %s does not list %s", m.dir, statsXattr)
		}
		st := xaStats(t, m)
		if st["mode"] != m.mode {
			t.Errorf("stats mode = %v, want %s", st["mode"], m.mode)
		}
		for key, want := range map[string]float64{"segments": 2, "bytes": 4096 + 8192, "capacity": 256 << 20} {
			if got, ok := st[key].(float64); !ok || got != want {
				t.Errorf("stats %s = %v, want %v", key, st[key], want)
			}
		}
		reqs, ok := st["requests"].(map[string]any)
		if !ok {
			t.Fatalf("stats requests = %v, want an object", st["requests"])
		}
		if n, _ := reqs["GETXATTR"].(float64); n < 1 {
			t.Errorf("stats requests GETXATTR = %v after getfattr, want >= 1", reqs["GETXATTR"])
		}
		if n, _ := reqs["CREATE"].(float64); n < 2 {
			t.Errorf("stats requests CREATE = %v after two files were made, want >= 2", reqs["CREATE"])
		}
	})
}

// TestFlagsSegment: a segment's flags default to SHAREDMEM, are set while
// it is empty (by name or number, read back canonical), are EBUSY once it
// has bytes, and bad or forbidden values are refused and change nothing.
func TestFlagsSegment(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		// A producer holds the empty segment while it sets its flags.
		p := m.path("empty")
		c := startXaChild(t)
		c.do(t, "open %s", p)
		xaWant(t, p, xaFlags, "SHAREDMEM")
		xaSet(t, p, xaFlags, "SHAREDMEM|UNLINK")
		xaWant(t, p, xaFlags, "SHAREDMEM|UNLINK")
		xaSet(t, p, xaFlags, "SHAREDMEM")
		xaWant(t, p, xaFlags, "SHAREDMEM")
		xaSet(t, p, xaFlags, "66")
		xaWant(t, p, xaFlags, "SHAREDMEM|UNLINK")

		// Bad values, on an empty segment: refused, nothing changes.
		for _, bad := range []struct{ value, want string }{
			{"SHAREDMEM|BOGUS", xaEINVAL},
			{"BOGUS", xaEINVAL},
			{"SHAREDMEM|", xaEINVAL},
			{"1024", xaEINVAL}, // no such bit
			{"SHARED|SHAREDMEM", xaEINVAL},
			{"3", xaEINVAL}, // SHARED|SHAREDMEM by number
			{"SHARED", xaEOPNOTSUPP},
			{"1", xaEOPNOTSUPP},
			{"FROMFD", xaEPERM},
			{"SHAREDMEM|FROMFD|UNLINK", xaEPERM},
			{"98", xaEPERM}, // SHAREDMEM|FROMFD|UNLINK by number
		} {
			xaSetFail(t, p, xaFlags, bad.value, bad.want)
			xaWant(t, p, xaFlags, "SHAREDMEM|UNLINK")
		}

		// The holder goes, and with it the UNLINK segment.
		c.exit(t)
		xaWaitGone(t, p)

		// A segment with bytes keeps its flags.
		full := m.path("full")
		run(t, "dd", "if=/dev/zero", "of="+full, "bs=4096", "count=1", "status=none")
		xaSetFail(t, full, xaFlags, "SHAREDMEM|UNLINK", xaEBUSY)
		xaSetFail(t, full, xaFlags, "66", xaEBUSY)
		xaWant(t, full, xaFlags, "SHAREDMEM")
		if !xaExists(t, full) {
			t.Errorf("%s vanished after a refused flags change", full)
		}

		// SHARED and FROMFD on a directory are refused too.
		dir := m.path("dir")
		run(t, "mkdir", dir)
		xaSetFail(t, dir, xaFlags, "SHARED", xaEOPNOTSUPP)
		xaSetFail(t, dir, xaFlags, "FROMFD", xaEPERM)
		xaSetFail(t, dir, xaFlags, "SHARED|SHAREDMEM", xaEINVAL)
		xaSetFail(t, dir, xaFlags, "NOPE", xaEINVAL)
		xaWant(t, dir, xaFlags, "SHAREDMEM")
	})
}

// TestFlagsDirInherit: flags set on a directory are inherited by the
// segments and directories created in it, and theirs in turn.
func TestFlagsDirInherit(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("d")
		run(t, "mkdir", dir)
		xaSet(t, dir, xaFlags, "SHAREDMEM|EXCLUSIVE|KEEPFD")
		xaWant(t, dir, xaFlags, "SHAREDMEM|EXCLUSIVE|KEEPFD")

		run(t, "touch", filepath.Join(dir, "f"))
		run(t, "mkdir", filepath.Join(dir, "sub"))
		run(t, "touch", filepath.Join(dir, "sub", "g"))

		xaWant(t, filepath.Join(dir, "sub"), xaFlags, "SHAREDMEM|EXCLUSIVE|KEEPFD")
		for _, f := range []string{filepath.Join(dir, "f"), filepath.Join(dir, "sub", "g")} {
			got := xaFlagSet(xaGet(t, f, xaFlags))
			if !slices.Contains(got, "KEEPFD") || !slices.Contains(got, "SHAREDMEM") {
				t.Errorf("flags of %s = %q, want the directory's KEEPFD and SHAREDMEM inherited", f, got)
			}
		}
		// A sibling outside the directory inherits nothing.
		run(t, "touch", m.path("outside"))
		xaWant(t, m.path("outside"), xaFlags, "SHAREDMEM")
	})
}

// xaTryOpens is a python script: for each "MODE PATH" argument it tries an
// open and prints ok or the errno name. MODE: excl (O_CREAT|O_EXCL),
// wb (open(p, 'wb')), trunc (O_WRONLY|O_TRUNC), rename:DST (os.rename).
const xaTryOpens = `
import errno, os, sys
for arg in sys.argv[1:]:
    mode, p = arg.split(" ", 1)
    try:
        if mode == "excl":
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        elif mode == "wb":
            open(p, "wb").close()
        elif mode == "trunc":
            os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
        elif mode.startswith("rename:"):
            os.rename(p, mode[len("rename:"):])
        else:
            raise SystemExit("bad mode " + mode)
        print("ok")
    except OSError as e:
        print(errno.errorcode.get(e.errno, str(e.errno)))
`

// xaWantFail runs a tool that must fail with the message want; unlike
// runExpectFail it lets the test go on, so one refusal the product gets
// wrong does not hide the others.
func xaWantFail(t *testing.T, want string, name string, args ...string) {
	t.Helper()
	out, err := runTimeout(commandTimeout, name, args...)
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		t.Errorf("%s %s succeeded, want %q", name, strings.Join(args, " "), want)
	case !errors.As(err, &exitErr):
		t.Fatalf("%s %s did not run: %v\n%s", name, strings.Join(args, " "), err, out)
	case !strings.Contains(out, want):
		t.Errorf("%s %s: %q, want %q", name, strings.Join(args, " "), strings.TrimSpace(out), want)
	}
}

// xaSame reports (without stopping the test) whether path still has
// the bytes of src.
func xaSame(t *testing.T, src, path, after string) {
	t.Helper()
	if out, err := runTimeout(commandTimeout, "cmp", src, path); err != nil {
		t.Errorf("after %s, %s lost its bytes: cmp: %v %s", after, path, err, strings.TrimSpace(out))
	}
}

// TestExclusiveDir: in an EXCLUSIVE directory names are created
// exclusively and a segment with bytes is never truncated or replaced.
func TestExclusiveDir(t *testing.T) {
	t.Parallel()
	src := xaRandomFile(t, 64<<10)
	forEachMode(t, func(t *testing.T, m *mount) {
		ex := m.path("ex")
		run(t, "mkdir", ex)
		xaSet(t, ex, xaFlags, "EXCLUSIVE")
		xaWant(t, ex, xaFlags, "SHAREDMEM|EXCLUSIVE")

		seg := func(name string) string {
			p := filepath.Join(ex, name)
			run(t, "dd", "if="+src, "of="+p, "bs=64k", "status=none")
			run(t, "cmp", src, p)
			return p
		}

		// O_CREAT|O_EXCL: a new name is made, an existing one is EEXIST.
		f := seg("f")
		n := filepath.Join(ex, "new")
		out := python(t, xaTryOpens, "excl "+n, "excl "+n, "excl "+f)
		if got := strings.Fields(out); !slices.Equal(got, []string{"ok", "EEXIST", "EEXIST"}) {
			t.Errorf("O_CREAT|O_EXCL of a new name twice, then of %s: %q, want ok EEXIST EEXIST", f, got)
		}
		xaSame(t, src, f, "O_CREAT|O_EXCL")

		// Truncating an existing segment with bytes: EEXIST, bytes intact.
		sh := seg("sh")
		xaWantFail(t, xaEEXIST, "sh", "-c", "echo clobbered > "+sh)
		xaSame(t, src, sh, "sh -c 'echo clobbered > "+sh+"'")
		wb := seg("wb")
		if got := strings.TrimSpace(python(t, xaTryOpens, "wb "+wb)); got != "EEXIST" {
			t.Errorf("python open(%s, 'wb'): %s, want EEXIST", wb, got)
		}
		xaSame(t, src, wb, "open(p, 'wb')")
		tr := seg("trunc")
		if got := strings.TrimSpace(python(t, xaTryOpens, "trunc "+tr)); got != "EEXIST" {
			t.Errorf("open(%s, O_WRONLY|O_TRUNC): %s, want EEXIST", tr, got)
		}
		xaSame(t, src, tr, "O_WRONLY|O_TRUNC")

		// Rename onto an existing name, from inside or outside: EEXIST,
		// both names intact.
		g := filepath.Join(ex, "g")
		run(t, "dd", "if=/dev/zero", "of="+g, "bs=4096", "count=1", "status=none")
		xaWantFail(t, xaEEXIST, "mv", "-T", g, f)
		outside := m.path("outside")
		run(t, "dd", "if=/dev/zero", "of="+outside, "bs=4096", "count=1", "status=none")
		out = python(t, xaTryOpens, "rename:"+f+" "+g, "rename:"+f+" "+outside)
		if got := strings.Fields(out); !slices.Equal(got, []string{"EEXIST", "EEXIST"}) {
			t.Errorf("rename onto %s from inside and outside the directory: %q, want EEXIST EEXIST", f, got)
		}
		xaSame(t, src, f, "renames onto it")
		for _, p := range []string{g, outside} {
			if !xaExists(t, p) {
				t.Errorf("%s vanished after a refused rename", p)
			}
		}
		// Rename to a free name still works.
		run(t, "mv", outside, filepath.Join(ex, "moved"))
		if !xaExists(t, filepath.Join(ex, "moved")) {
			t.Errorf("mv to a free name in an EXCLUSIVE directory did not happen")
		}
	})
}

// TestNoCreateDir: nothing new comes into a NOCREATE directory, by any
// call; what is there is read and written as usual.
func TestNoCreateDir(t *testing.T) {
	t.Parallel()
	src := xaRandomFile(t, 16<<10)
	src2 := xaRandomFile(t, 16<<10)
	forEachMode(t, func(t *testing.T, m *mount) {
		nc := m.path("nc")
		run(t, "mkdir", nc)
		old := filepath.Join(nc, "old")
		run(t, "dd", "if="+src, "of="+old, "bs=16k", "status=none")
		other := m.path("other")
		run(t, "dd", "if=/dev/zero", "of="+other, "bs=4096", "count=1", "status=none")
		xaSet(t, nc, xaFlags, "NOCREATE")
		xaWant(t, nc, xaFlags, "SHAREDMEM|NOCREATE")

		for _, c := range []struct {
			name string
			argv []string
		}{
			{"new", []string{"touch", filepath.Join(nc, "new")}},
			{"dir", []string{"mkdir", filepath.Join(nc, "dir")}},
			{"fifo", []string{"mknod", filepath.Join(nc, "fifo"), "p"}},
			{"sym", []string{"ln", "-s", "old", filepath.Join(nc, "sym")}},
			{"hard", []string{"ln", other, filepath.Join(nc, "hard")}},
			{"moved", []string{"mv", "-T", other, filepath.Join(nc, "moved")}},
			{"shell", []string{"sh", "-c", "echo x > " + filepath.Join(nc, "shell")}},
		} {
			out := runExpectFail(t, c.argv[0], c.argv[1:]...)
			if !strings.Contains(out, xaEPERM) {
				t.Errorf("%s in a NOCREATE directory: %q, want %q", strings.Join(c.argv, " "), strings.TrimSpace(out), xaEPERM)
			}
			if xaExists(t, filepath.Join(nc, c.name)) {
				t.Errorf("%s: %s exists after the refusal", strings.Join(c.argv, " "), c.name)
			}
		}
		if !xaExists(t, other) {
			t.Errorf("%s vanished after a refused move", other)
		}
		if out := run(t, "ls", "-A", nc); strings.TrimSpace(out) != "old" {
			t.Errorf("ls -A %s = %q, want only old", nc, out)
		}

		// Existing segments are read and written as usual.
		run(t, "cmp", src, old)
		run(t, "dd", "if="+src2, "of="+old, "bs=16k", "conv=notrunc", "status=none")
		run(t, "cmp", src2, old)
	})
}

// TestUnlinkLastHolder: a segment in an UNLINK directory lives while any
// process holds it and its name goes with the last holder; nothing is
// left in the backing.
func TestUnlinkLastHolder(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		u := m.path("u")
		run(t, "mkdir", u)
		xaSet(t, u, xaFlags, "UNLINK")
		xaWant(t, u, xaFlags, "SHAREDMEM|UNLINK")

		p := filepath.Join(u, "seg")
		a := startXaChild(t)
		a.do(t, "open %s", p)
		a.do(t, "write %s", hex.EncodeToString([]byte("tensor bytes")))
		if got := xaFlagSet(xaGet(t, p, xaFlags)); !slices.Contains(got, "UNLINK") {
			t.Errorf("flags of %s = %q, want UNLINK inherited", p, got)
		}
		handle := xaGet(t, p, xaHandle)
		b := startXaChild(t)
		b.do(t, "open %s", p)
		xaWant(t, p, xaRefcount, "2")

		// The first holder goes: one is left, the name stays.
		a.exit(t)
		xaWaitRefcount(t, p, "1")
		b.do(t, "write %s", hex.EncodeToString([]byte("still here")))
		if !xaExists(t, p) {
			t.Fatalf("%s removed while a holder has it open", p)
		}
		if got, err := os.ReadFile(handle); err != nil || !strings.HasPrefix(string(got), "still here") {
			t.Errorf("backing %s = %q, %v; want the holder's bytes", handle, got, err)
		}

		// The last holder closes: the name goes, and the backing file.
		b.do(t, "close")
		xaWaitGone(t, p)
		if _, err := os.Lstat(handle); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("backing file %s of the removed UNLINK segment: %v, want it gone", handle, err)
		}
		if st := xaStats(t, m); st["segments"] != float64(0) || st["bytes"] != float64(0) {
			t.Errorf("stats after the UNLINK segment went: segments %v bytes %v, want 0 0", st["segments"], st["bytes"])
		}
		b.exit(t)

		// A segment given UNLINK itself (not by its directory) goes too.
		q := m.path("own")
		c := startXaChild(t)
		c.do(t, "open %s", q)
		xaSet(t, q, xaFlags, "SHAREDMEM|UNLINK")
		c.do(t, "write %s", hex.EncodeToString([]byte("x")))
		if !xaExists(t, q) {
			t.Fatalf("%s removed while held", q)
		}
		c.exit(t)
		xaWaitGone(t, q)
	})
}

// TestUnlinkProducerKilled: a producer that dies of SIGKILL while holding
// an UNLINK segment leaks nothing.
func TestUnlinkProducerKilled(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		u := m.path("u")
		run(t, "mkdir", u)
		xaSet(t, u, xaFlags, "UNLINK")
		p := filepath.Join(u, "seg")
		c := startXaChild(t)
		c.do(t, "open %s", p)
		c.do(t, "write %s", strings.Repeat("ab", 64<<10))
		handle := xaGet(t, p, xaHandle)
		xaWant(t, p, xaRefcount, "1")
		if st := xaStats(t, m); st["segments"] != float64(1) {
			t.Fatalf("stats segments = %v with the producer's segment, want 1", st["segments"])
		}

		c.kill9(t)
		xaWaitGone(t, p)
		if _, err := os.Lstat(handle); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("backing file %s after the producer's kill -9: %v, want it gone", handle, err)
		}
		if st := xaStats(t, m); st["segments"] != float64(0) || st["bytes"] != float64(0) {
			t.Errorf("stats after the producer's kill -9: segments %v bytes %v, want 0 0", st["segments"], st["bytes"])
		}
		if out := run(t, "ls", "-A", u); strings.TrimSpace(out) != "" {
			t.Errorf("ls -A %s after the producer's kill -9 = %q, want empty", u, out)
		}
	})
}

// TestUnlinkMmapOutlivesClose: a mapping that outlives close() keeps an
// UNLINK segment alive (it holds a reference); when its process exits the
// segment goes.
func TestUnlinkMmapOutlivesClose(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		u := m.path("u")
		run(t, "mkdir", u)
		xaSet(t, u, xaFlags, "UNLINK")
		p := filepath.Join(u, "seg")

		c := startXaChild(t)
		c.do(t, "mmap %s 8192", p) // the fd is closed once mapped
		xaWaitRefcount(t, p, "1")
		xaWantHolders(t, p, c, 1)
		c.do(t, "poke 0 %s", hex.EncodeToString([]byte("mapped")))
		if got := c.do(t, "peek 0 6"); got != hex.EncodeToString([]byte("mapped")) {
			t.Errorf("mapping reads %s, want %x", got, "mapped")
		}
		if !xaExists(t, p) {
			t.Fatalf("%s removed while a process maps it", p)
		}
		xaWant(t, p, xaRefcount, "1")

		c.exit(t)
		xaWaitGone(t, p)
	})
}

// TestRefcountHolders: refcount counts open handles across processes and
// holders names each process with its handles.
func TestRefcountHolders(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("r")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		xaWaitRefcount(t, p, "0") // dd's RELEASE reaches the daemon after dd exits
		xaWant(t, p, xaHolders, "")

		c := startXaChild(t)
		c.do(t, "open %s", p)
		c.do(t, "open %s", p)
		xaWant(t, p, xaRefcount, "2")
		xaWantHolders(t, p, c, 2)

		d := startXaChild(t)
		d.do(t, "open %s", p)
		xaWant(t, p, xaRefcount, "3")
		want := []string{
			fmt.Sprintf("%d %s 2", c.pid, c.comm(t)),
			fmt.Sprintf("%d %s 1", d.pid, d.comm(t)),
		}
		slices.Sort(want)
		got := xaHolderLines(t, p)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("holders with two processes = %q, want %q", got, want)
		}

		c.exit(t)
		xaWaitRefcount(t, p, "1")
		xaWantHolders(t, p, d, 1)
		d.exit(t)
		xaWaitRefcount(t, p, "0")
		xaWant(t, p, xaHolders, "")
	})
}

// TestRefcountThreads: holders has one line per process, however many of
// its threads opened the segment.
func TestRefcountThreads(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("r")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		xaWaitRefcount(t, p, "0")
		c := startXaChild(t)
		c.do(t, "topen %s", p)
		c.do(t, "topen %s", p)
		xaWant(t, p, xaRefcount, "2")
		xaWantHolders(t, p, c, 2)
		c.exit(t)
		xaWaitRefcount(t, p, "0")
	})
}

// TestRefcountMmapOutlivesClose: a mapping that outlives close() still
// counts as a handle of its process.
func TestRefcountMmapOutlivesClose(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("r")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		xaWaitRefcount(t, p, "0")
		c := startXaChild(t)
		c.do(t, "mmap %s 4096", p)
		xaWaitRefcount(t, p, "1")
		xaWantHolders(t, p, c, 1)

		c.do(t, "open %s", p)
		xaWant(t, p, xaRefcount, "2")
		xaWantHolders(t, p, c, 2)
		c.do(t, "close")
		xaWaitRefcount(t, p, "1")
		xaWantHolders(t, p, c, 1)

		c.exit(t)
		xaWaitRefcount(t, p, "0")
		xaWant(t, p, xaHolders, "")
	})
}

// TestHandleSameBytes: the backing path in user.tensorfs.handle, opened
// outside the mount, has the segment's bytes.
func TestHandleSameBytes(t *testing.T) {
	t.Parallel()
	src := xaRandomFile(t, 1<<20)
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "mkdir", m.path("dir"))
		p := m.path("dir/h")
		run(t, "dd", "if="+src, "of="+p, "bs=64k", "status=none")
		handle := xaGet(t, p, xaHandle)
		if !filepath.IsAbs(handle) || handle == m.dir || strings.HasPrefix(handle, m.dir+"/") {
			t.Fatalf("handle %q: want an absolute path outside the mount %s", handle, m.dir)
		}
		if filepath.Base(handle) != "h" {
			t.Errorf("handle %q does not name the backing file of h", handle)
		}
		run(t, "cmp", src, handle)
		fi, err := os.Stat(handle)
		if err != nil || fi.Size() != 1<<20 {
			t.Errorf("stat %s: %v, %v; want 1 MiB", handle, fi, err)
		}
	})
}

// TestHandleMmapCoherent: in passthrough mode a mapping of the mount path
// and the backing file share pages: writes through either side are seen
// by the other with no sync.
func TestHandleMmapCoherent(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough")
	p := m.path("seg")
	run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
	handle := xaGet(t, p, xaHandle)

	c := startXaChild(t)
	c.do(t, "mmap %s 4096", p)

	msg := filepath.Join(t.TempDir(), "msg")
	if err := os.WriteFile(msg, []byte("written via the handle"), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "dd", "if="+msg, "of="+handle, "bs=512", "seek=1", "conv=notrunc", "status=none")
	if got := c.do(t, "peek 512 22"); got != hex.EncodeToString([]byte("written via the handle")) {
		t.Errorf("the mapping of %s reads %q at 512, want the bytes written to %s", p, got, handle)
	}

	c.do(t, "poke 100 %s", hex.EncodeToString([]byte("from the mapping")))
	got, err := os.ReadFile(handle)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) < 116 || string(got[100:116]) != "from the mapping" {
		t.Errorf("backing %s at 100 = %q, want the bytes the mapping stored", handle, got[100:min(116, len(got))])
	}
}

// TestTensorDtype: PyTorch and NumPy spellings are accepted and one
// canonical spelling is stored; an unknown dtype is EINVAL.
func TestTensorDtype(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("t")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		for _, c := range []struct{ in, want string }{
			{"float32", "float32"},
			{"torch.float32", "float32"},
			{"<f4", "float32"},
			{"torch.bfloat16", "bfloat16"},
			{"<i8", "int64"},
			{"torch.bool", "bool"},
			{"float16", "float16"},
		} {
			xaSet(t, p, xaDtype, c.in)
			xaWant(t, p, xaDtype, c.want)
		}
		for _, bad := range []string{"float33", "torch.tensor", "", ">f4x"} {
			xaSetFail(t, p, xaDtype, bad, xaEINVAL)
			xaWant(t, p, xaDtype, "float16")
		}
	})
}

// TestTensorShape: a shape is stored canonically; one that is not a list
// of non-negative integers, or whose extent exceeds the segment's bytes,
// is EINVAL and the old value is kept.
func TestTensorShape(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("t")
		run(t, "truncate", "-s", strconv.Itoa(1024*768*4), p)
		xaSet(t, p, xaDtype, "float32")
		xaSet(t, p, xaShape, "[1024, 768]")
		xaWant(t, p, xaShape, "[1024, 768]")

		for _, bad := range []string{"[1024, 769]", "[2048, 768]", "[1024, -1]", "[1024, x]", "1024 by 768", "[1024, 768"} {
			xaSetFail(t, p, xaShape, bad, xaEINVAL)
			xaWant(t, p, xaShape, "[1024, 768]")
		}
		// A dtype that makes the same shape too big is refused too.
		xaSetFail(t, p, xaDtype, "float64", xaEINVAL)
		xaWant(t, p, xaDtype, "float32")
		// A smaller one fits.
		xaSet(t, p, xaShape, "[512, 768]")
		xaWant(t, p, xaShape, "[512, 768]")
	})
}

// TestTensorStrideOffset: stride and storage_offset are checked against
// the segment's bytes like the shape.
func TestTensorStrideOffset(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("t")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		xaSet(t, p, xaDtype, "float32") // 1024 elements
		xaSet(t, p, xaShape, "[32, 32]")
		xaSet(t, p, xaStride, "[32, 1]")
		xaWant(t, p, xaStride, "[32, 1]")
		xaSet(t, p, xaStride, "[1, 32]") // transposed: same extent
		xaWant(t, p, xaStride, "[1, 32]")
		xaSetFail(t, p, xaStride, "[64, 1]", xaEINVAL)
		xaSetFail(t, p, xaStride, "[32, -1]", xaEINVAL)
		xaWant(t, p, xaStride, "[1, 32]")

		xaSet(t, p, xaOffset, "0")
		xaWant(t, p, xaOffset, "0")
		xaSetFail(t, p, xaOffset, "1", xaEINVAL)
		xaSetFail(t, p, xaOffset, "-1", xaEINVAL)
		xaSetFail(t, p, xaOffset, "one", xaEINVAL)
		xaWant(t, p, xaOffset, "0")

		// A smaller view may start further in, up to the last byte.
		xaSet(t, p, xaShape, "[16, 16]")
		xaSet(t, p, xaStride, "[16, 1]")
		xaSet(t, p, xaOffset, "768")
		xaWant(t, p, xaOffset, "768")
		xaSetFail(t, p, xaOffset, "769", xaEINVAL)
		xaWant(t, p, xaOffset, "768")
		// With that offset the old shape no longer fits.
		xaSetFail(t, p, xaShape, "[32, 32]", xaEINVAL)
		xaWant(t, p, xaShape, "[16, 16]")
	})
}

// TestXattrUserSurvivesRemount: any user.* is stored verbatim, and it,
// the tensor metadata and directory flags survive unmount and mount.
func TestXattrUserSurvivesRemount(t *testing.T) {
	t.Parallel()
	src := xaRandomFile(t, 4096)
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("d")
		run(t, "mkdir", dir)
		xaSet(t, dir, xaFlags, "EXCLUSIVE")
		xaSet(t, dir, "user.note", "a directory note")
		p := filepath.Join(dir, "seg")
		run(t, "dd", "if="+src, "of="+p, "bs=4096", "status=none")
		xaSet(t, p, "user.foo", "  Hello, [tensors] = {1: 'x'}  ")
		run(t, "setfattr", "-n", "user.bin", "-v", "0x00ff10800a", p)
		xaSet(t, p, xaDtype, "<f4")
		xaSet(t, p, xaShape, "[32, 32]")

		check := func(m *mount) {
			t.Helper()
			xaWant(t, p, "user.foo", "  Hello, [tensors] = {1: 'x'}  ")
			if out := run(t, "getfattr", "--absolute-names", "-e", "hex", "-n", "user.bin", p); !strings.Contains(out, "\nuser.bin=0x00ff10800a\n") {
				t.Errorf("user.bin of %s = %q, want 0x00ff10800a", p, out)
			}
			xaWant(t, p, xaDtype, "float32")
			xaWant(t, p, xaShape, "[32, 32]")
			xaWant(t, dir, xaFlags, "SHAREDMEM|EXCLUSIVE")
			xaWant(t, dir, "user.note", "a directory note")
			run(t, "cmp", src, p)
		}
		check(m)
		m.unmount(t, false)
		m2 := m.remount(t)
		check(m2)
	})
}

// TestXattrReadOnly: tensorfs's computed names are EPERM to write or
// remove, and keep their values.
func TestXattrReadOnly(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("seg")
		run(t, "dd", "if=/dev/zero", "of="+p, "bs=4096", "count=1", "status=none")
		handle := xaGet(t, p, xaHandle)
		xaWaitRefcount(t, p, "0")
		for _, name := range []string{xaRefcount, xaHolders, xaHandle} {
			xaSetFail(t, p, name, "7", xaEPERM)
			if out := runExpectFail(t, "setfattr", "-x", name, p); !strings.Contains(out, xaEPERM) {
				t.Errorf("setfattr -x %s %s: %q, want %q", name, p, strings.TrimSpace(out), xaEPERM)
			}
		}
		xaWant(t, p, xaRefcount, "0")
		xaWant(t, p, xaHolders, "")
		xaWant(t, p, xaHandle, handle)

		xaSetFail(t, m.dir, statsXattr, `{"segments":0}`, xaEPERM)
		if out := runExpectFail(t, "setfattr", "-x", statsXattr, m.dir); !strings.Contains(out, xaEPERM) {
			t.Errorf("setfattr -x %s %s: %q, want %q", statsXattr, m.dir, strings.TrimSpace(out), xaEPERM)
		}
		for _, name := range []string{xaRbytes, xaRsegments} {
			xaSetFail(t, m.dir, name, "0", xaEPERM)
		}
		if st := xaStats(t, m); st["segments"] != float64(1) {
			t.Errorf("stats segments = %v after the refused writes, want 1", st["segments"])
		}
	})
}

// TestXattrDevice: a segment's device is cpu; cuda:N is EOPNOTSUPP on a
// mount without a GPU, and an unknown device is EINVAL.
func TestXattrDevice(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		p := m.path("seg")
		run(t, "touch", p)
		xaWant(t, p, xaDevice, "cpu")
		xaSetFail(t, p, xaDevice, "cuda:0", xaEOPNOTSUPP)
		xaWant(t, p, xaDevice, "cpu")
		xaSet(t, p, xaDevice, "cpu")
		xaWant(t, p, xaDevice, "cpu")
		xaSetFail(t, p, xaDevice, "tpu:0", xaEINVAL)
		xaWant(t, p, xaDevice, "cpu")

		dir := m.path("dir")
		run(t, "mkdir", dir)
		xaSetFail(t, dir, xaDevice, "cuda:0", xaEOPNOTSUPP)
		xaSet(t, dir, xaDevice, "cpu")
		xaWant(t, dir, xaDevice, "cpu")
	})
}

// TestXattrRefusalsLogged: every refused setfattr leaves a "refused" line
// with its reason in the daemon's log.
func TestXattrRefusalsLogged(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		empty := m.path("empty")
		run(t, "touch", empty)
		full := m.path("full")
		run(t, "dd", "if=/dev/zero", "of="+full, "bs=4096", "count=1", "status=none")

		xaSetFail(t, full, xaDtype, "xabogusdtype", xaEINVAL)
		xaWantLog(t, m, []string{xaDtype, "xabogusdtype"})

		xaSetFail(t, empty, xaFlags, "XABOGUSFLAG", xaEINVAL)
		xaWantLog(t, m, []string{xaFlags, "XABOGUSFLAG"})

		xaSetFail(t, empty, xaFlags, "SHARED", xaEOPNOTSUPP)
		xaWantLog(t, m, []string{xaFlags}, "disk", "SHARED")

		xaSetFail(t, empty, xaFlags, "FROMFD", xaEPERM)
		xaWantLog(t, m, []string{xaFlags, "FROMFD"})

		xaSetFail(t, full, xaFlags, "SHAREDMEM|UNLINK", xaEBUSY)
		xaWantLog(t, m, []string{xaFlags, "full"}, "empty", "bytes", "busy")

		xaSetFail(t, full, xaShape, "[4097]", xaEINVAL)
		xaWantLog(t, m, []string{xaShape, "4097"})

		xaSetFail(t, full, xaRefcount, "5", xaEPERM)
		xaWantLog(t, m, []string{xaRefcount}, "read-only", "read only", "computed")

		xaSetFail(t, empty, xaDevice, "cuda:3", xaEOPNOTSUPP)
		xaWantLog(t, m, []string{xaDevice, "cuda:3"})
	})
}
