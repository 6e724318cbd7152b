package integration

// Mappings are references (DESIGN.md §4): a mapping of a segment's pages
// counts in refcount and names its process in holders until munmap or
// exit, whether or not a descriptor is still open, in both modes; an
// UNLINK segment keeps its name until its last mapping goes. Each way of
// mapping runs in a mapping child (mapChildScript) on two segments at
// once, one in a plain directory and one in an UNLINK directory. The
// test process itself never maps a file of the mount.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// mapChildScript maps segments on command, one command a line, answering
// "ok [VALUE]" or "err ...". argv[1] is the directory of the tensorfs
// Python package.
//
//	create PATH PAGES   open O_CREAT, ftruncate to PAGES pages, keep the fd
//	close               close every kept fd
//	libc PATH PAGES     open, mmap(MAP_SHARED) with libc through ctypes, close
//	munmap I FIRST N    munmap N pages of libc mapping I from page FIRST
//	unmapall            munmap every libc mapping
//	torch PATH          torch.from_file(PATH, shared=True) of every byte
//	open_torch PATH     tensorfs.open_torch(PATH, mode="r+")
//	memmap PATH         numpy.memmap(PATH, mode="r+")
//	drop                drop every tensor and memmap (their mappings go)
//	fork                fork a child that keeps the mappings; answers its pid
//	reap                the last forked child exits
//	leaderexit          the main thread exits alone (SYS_exit); another
//	                    thread serves the commands that follow
const mapChildScript = `
import ctypes, gc, mmap, os, platform, sys, threading
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PAGE = mmap.PAGESIZE
fds, maps, held, kids = [], [], [], []
def check(r, what):
    if r == ctypes.c_void_p(-1).value or r == -1:
        e = ctypes.get_errno()
        raise OSError(e, what + ": " + os.strerror(e))
def serve():
    for line in sys.stdin:
        a = line.split()
        try:
            op, out = a[0], ""
            if op == "create":
                fd = os.open(a[1], os.O_RDWR | os.O_CREAT, 0o644)
                os.ftruncate(fd, int(a[2]) * PAGE)
                fds.append(fd)
            elif op == "close":
                for fd in fds:
                    os.close(fd)
                fds.clear()
            elif op == "libc":
                size = int(a[2]) * PAGE
                fd = os.open(a[1], os.O_RDWR)
                addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
                os.close(fd)
                check(addr, "mmap")
                ctypes.memmove(addr, b"mapped", 6)
                maps.append((addr, size))
            elif op == "munmap":
                addr, _ = maps[int(a[1])]
                check(libc.munmap(addr + int(a[2]) * PAGE, int(a[3]) * PAGE), "munmap")
            elif op == "unmapall":
                for addr, size in maps:
                    check(libc.munmap(addr, size), "munmap")
                maps.clear()
            elif op == "torch":
                import torch
                held.append(torch.from_file(a[1], shared=True, size=os.path.getsize(a[1]), dtype=torch.uint8))
            elif op == "open_torch":
                import tensorfs
                held.append(tensorfs.open_torch(a[1], mode="r+"))
            elif op == "memmap":
                import numpy
                held.append(numpy.memmap(a[1], dtype=numpy.uint8, mode="r+"))
            elif op == "drop":
                held.clear()
                gc.collect()
            elif op == "fork":
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(w)
                    os.read(r, 1)
                    os._exit(0)
                os.close(r)
                kids.append((pid, w))
                out = " %d" % pid
            elif op == "reap":
                pid, w = kids.pop()
                os.close(w)
                os.waitpid(pid, 0)
            elif op == "leaderexit":
                threading.Thread(target=serve).start()
                print("ok", flush=True)
                libc.syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
            else:
                raise ValueError("unknown command " + op)
            print("ok" + out, flush=True)
        except Exception as e:
            print("err %r" % (e,), flush=True)
serve()
`

// mapChild is a python process that maps segments on command.
type mapChild struct {
	*pyChild
	pid int
}

func startMapChild(t *testing.T) *mapChild {
	t.Helper()
	c := startPython(t, "mapping child", mapChildScript, filepath.Join(repoRoot, "python"))
	return &mapChild{c, c.cmd.Process.Pid}
}

// run sends one command that must succeed and returns what follows "ok".
func (c *mapChild) run(t *testing.T, format string, args ...any) string {
	t.Helper()
	line := fmt.Sprintf(format, args...)
	ans := c.do(t, line)
	if ans != "ok" && !strings.HasPrefix(ans, "ok ") {
		t.Fatalf("mapping child %d: %q: %s\nstderr:\n%s", c.pid, line, ans, c.stderr.String())
	}
	return strings.TrimPrefix(ans, "ok ")
}

// kill9 SIGKILLs the child and waits for it.
func (c *mapChild) kill9(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-c.done
}

// holderLine is the holders line of a process with n references.
func holderLine(t *testing.T, pid, n int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%d %s %d", pid, strings.TrimSpace(string(b)), n)
}

// wantRefs fails unless refcount and holders of path read the sum and
// the lines of want, now.
func wantRefs(t *testing.T, path string, want ...string) {
	t.Helper()
	if ok, why := refsAre(t, path, want); !ok {
		t.Error(why)
	}
}

// waitRefs waits until refcount and holders of path read want.
func waitRefs(t *testing.T, path string, want ...string) {
	t.Helper()
	eventually(t, "references of "+path, func() (bool, string) { return refsAre(t, path, want) })
}

func refsAre(t *testing.T, path string, want []string) (bool, string) {
	t.Helper()
	sum := 0
	for _, l := range want {
		var pid, n int
		var comm string
		fmt.Sscanf(l, "%d %s %d", &pid, &comm, &n)
		sum += n
	}
	got, holders := xaGet(t, path, xaRefcount), xaHolderLines(t, path)
	slices.Sort(holders)
	want = slices.Sorted(slices.Values(want))
	if got != fmt.Sprint(sum) || !slices.Equal(holders, want) {
		return false, fmt.Sprintf("%s: refcount %s, holders %q; want %d, %q", path, got, holders, sum, want)
	}
	return true, ""
}

// mapPair is a segment in a plain directory and one in an UNLINK
// directory, made by a mapping child that holds their fds until close.
type mapPair struct {
	plain   string
	unlink  string
	backing string // the UNLINK segment's backing file
}

// newMapPair makes the two segments, PAGES pages each, held open by c.
func newMapPair(t *testing.T, m *mount, c *mapChild, pages int) *mapPair {
	t.Helper()
	run(t, "mkdir", m.path("plain"), m.path("u"))
	xaSet(t, m.path("u"), xaFlags, "UNLINK")
	p := &mapPair{plain: m.path("plain/seg"), unlink: m.path("u/seg")}
	for _, path := range p.both() {
		c.run(t, "create %s %d", path, pages)
	}
	p.backing = xaGet(t, p.unlink, xaHandle)
	return p
}

func (p *mapPair) both() []string { return []string{p.plain, p.unlink} }

// mapped checks both segments while mapped: the references want, now,
// and the UNLINK segment's name.
func (p *mapPair) mapped(t *testing.T, want ...string) {
	t.Helper()
	for _, path := range p.both() {
		wantRefs(t, path, want...)
	}
	if !xaExists(t, p.unlink) {
		t.Fatalf("%s removed while mapped", p.unlink)
	}
}

// ended waits for both segments to be free once the mappings ended: no
// references on the plain one; the UNLINK one gone, backing file and all.
func (p *mapPair) ended(t *testing.T) {
	t.Helper()
	waitRefs(t, p.plain)
	xaWaitGone(t, p.unlink)
	if _, err := os.Lstat(p.backing); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("backing %s of the removed UNLINK segment: %v, want it gone", p.backing, err)
	}
}

// libcMapped maps both segments of a new pair with libc mmap in a new
// child, closes every descriptor, checks the child's one reference and
// returns the child, the pair and the child's holders line.
func libcMapped(t *testing.T, m *mount) (*mapChild, *mapPair, string) {
	t.Helper()
	c := startMapChild(t)
	p := newMapPair(t, m, c, 4)
	for _, path := range p.both() {
		c.run(t, "libc %s 4", path)
	}
	c.run(t, "close")
	me := holderLine(t, c.pid, 1)
	p.mapped(t, me)
	return c, p, me
}

// testMapping maps both segments of a pair with mapIt, closes every
// descriptor, checks one reference of the child, ends the mappings with
// end and checks that the segments are free.
func testMapping(t *testing.T, setup func(t *testing.T, path string), mapIt, end string) {
	forEachModeParallel(t, func(t *testing.T, m *mount) {
		c := startMapChild(t)
		p := newMapPair(t, m, c, 4)
		for _, path := range p.both() {
			if setup != nil {
				setup(t, path)
			}
			c.run(t, mapIt, path)
		}
		c.run(t, "close")
		p.mapped(t, holderLine(t, c.pid, 1))
		c.run(t, "%s", end)
		p.ended(t)
	})
}

// TestMappingLibcClose: mmap(2) through libc, then close(2): the mapping
// alone holds the segments.
func TestMappingLibcClose(t *testing.T) {
	t.Parallel()
	testMapping(t, nil, "libc %s 4", "unmapall")
}

// TestMappingTorchFromFile: torch.from_file(shared=True) opens, maps and
// closes; the tensor holds the segments until it is freed.
func TestMappingTorchFromFile(t *testing.T) {
	t.Parallel()
	testMapping(t, nil, "torch %s", "drop")
}

// TestMappingOpenTorch: tensorfs.open_torch(mode="r+") maps through
// torch.from_file.
func TestMappingOpenTorch(t *testing.T) {
	t.Parallel()
	testMapping(t, func(t *testing.T, path string) {
		xaSet(t, path, xaDtype, "uint8")
		xaSet(t, path, xaShape, "[16384]")
	}, "open_torch %s", "drop")
}

// TestMappingNumpyMemmap: numpy.memmap keeps a duplicate of its
// descriptor beside the mapping; the process counts once.
func TestMappingNumpyMemmap(t *testing.T) {
	t.Parallel()
	testMapping(t, nil, "memmap %s", "drop")
}

// TestMappingHandlePath: a mapping of the backing file through
// user.tensorfs.handle, outside the mount, counts too.
func TestMappingHandlePath(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c := startMapChild(t)
		p := newMapPair(t, m, c, 4)
		for _, path := range p.both() {
			c.run(t, "libc %s 4", xaGet(t, path, xaHandle))
		}
		c.run(t, "close")
		p.mapped(t, holderLine(t, c.pid, 1))
		c.run(t, "unmapall")
		p.ended(t)
	})
}

// TestMappingPartialMunmap: unmapping part of a range leaves the rest
// mapped, and a process with two regions still counts once.
func TestMappingPartialMunmap(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, p, me := libcMapped(t, m)
		for i := range p.both() {
			c.run(t, "munmap %d 1 2", i) // pages 0 and 3 stay mapped
		}
		p.mapped(t, me)
		for i := range p.both() {
			c.run(t, "munmap %d 0 1", i)
		}
		p.mapped(t, me)
		for i := range p.both() {
			c.run(t, "munmap %d 3 1", i)
		}
		p.ended(t)
	})
}

// TestMappingFork: a child forked after mapping holds the mappings too,
// until it exits.
func TestMappingFork(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, p, me := libcMapped(t, m)
		var kid int
		fmt.Sscan(c.run(t, "fork"), &kid)
		for _, path := range p.both() {
			waitRefs(t, path, me, holderLine(t, kid, 1))
		}
		c.run(t, "reap")
		for _, path := range p.both() {
			waitRefs(t, path, me)
		}
		p.mapped(t, me)
		c.run(t, "unmapall")
		p.ended(t)
	})
}

// TestMappingSIGKILL: a mapping process killed with SIGKILL frees the
// segments.
func TestMappingSIGKILL(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, p, _ := libcMapped(t, m)
		c.kill9(t)
		p.ended(t)
	})
}

// TestMappingReopen: opening a mapped UNLINK segment again and closing it
// changes nothing: the name stays while the mapping lives.
func TestMappingReopen(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, p, me := libcMapped(t, m)
		run(t, "cat", p.unlink) // another process opens and closes it
		p.mapped(t, me)
		c.run(t, "unmapall")
		p.ended(t)
	})
}

// TestMappingDaemonCrash: a passthrough mapping is the backing file's own
// and outlives the daemon; the next mount keeps an UNLINK segment that a
// live process still maps and removes it when the mapping goes. (In
// classic mode the mapping is of the dead mount's page cache, so the
// segment goes at the remount.)
func TestMappingDaemonCrash(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c, p, me := libcMapped(t, m)

		m.kill9(t)
		ccWaitENOTCONN(t, m.dir)
		m.remount(t)
		if m.mode == "classic" {
			if xaExists(t, p.unlink) {
				t.Errorf("%s kept at remount although only the dead mount's pages are mapped", p.unlink)
			}
			wantRefs(t, p.plain)
			return
		}
		p.mapped(t, me)
		c.run(t, "unmapall")
		p.ended(t)
	})
}
