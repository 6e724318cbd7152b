package integration

// The watches of UNLINK segments that processes still map (DESIGN.md §9,
// issue 24 K2): one pidfd per mapping process, shared by every watch and
// charged to the process's owner; past her bound a watch polls, and never
// removes a name that a process still maps.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// mapTreeScript, run as a user, creates and maps each path given after
// argv[1] (4 KiB each, with libc's mmap: Python's keeps a duplicate of
// the descriptor), closes their descriptors and says "ready". On
// stdin: "fork N" forks N children that keep the mappings until the
// parent exits ("forked PIDS"), "unmap" unmaps the parent's ("unmapped"),
// "kill" kills the children ("killed").
const mapTreeScript = `
import ctypes, mmap, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
maps = []
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap")
    maps.append(addr)
    os.close(fd)
r, w = os.pipe()
kids = []
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "fork":
        for i in range(int(cmd[1])):
            pid = os.fork()
            if pid == 0:
                os.close(w)
                os.read(r, 1)  # EOF once the parent exits
                os._exit(0)
            kids.append(pid)
        print("forked", " ".join(map(str, kids)), flush=True)
    elif cmd[0] == "unmap":
        for addr in maps:
            libc.munmap(addr, 4096)
        print("unmapped", flush=True)
    elif cmd[0] == "kill":
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        print("killed", flush=True)
`

// daemonPidfds counts the pidfds the daemon of m holds.
func daemonPidfds(t *testing.T, m *mount) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", m.pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if link, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && link == "anon_inode:[pidfd]" {
			n++
		}
	}
	return n
}

// unlinkSegments makes user A's directory a/u of m an UNLINK one and
// returns the paths of n segments in it.
func unlinkSegments(t *testing.T, m *mount, n int) []string {
	t.Helper()
	userDirs(t, m)
	if out, err := runAs(t, userA, "/", "sh", "-c", `mkdir "$1" && setfattr -n user.tensorfs.flags -v UNLINK "$1"`, "sh", m.path("a/u")); err != nil {
		t.Fatalf("user A's UNLINK directory: %v: %s", err, out)
	}
	var paths []string
	for i := range n {
		paths = append(paths, m.path(fmt.Sprintf("a/u/s%d", i)))
	}
	return paths
}

// present reports which of paths exist.
func present(paths []string) (n int, missing []string) {
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			n++
		} else {
			missing = append(missing, filepath.Base(p))
		}
	}
	return n, missing
}

// othersServed checks that user B and root still create, write and read
// segments of their own.
func othersServed(t *testing.T, m *mount) {
	t.Helper()
	if out, err := runAs(t, userB, "/", "sh", "-c", `echo b > "$1" && cat "$1"`, "sh", m.path("b/seg")); err != nil || out != "b\n" {
		t.Errorf("user B's own segment meanwhile: %q, %v", out, err)
	}
	if err := os.WriteFile(m.path("root-seg"), []byte("r"), 0o644); err != nil {
		t.Errorf("root's segment meanwhile: %v", err)
	} else if b, err := os.ReadFile(m.path("root-seg")); err != nil || string(b) != "r" {
		t.Errorf("root's segment reads %q, %v", b, err)
	}
}

// TestMappingWatchPidfds (K2): user A maps 20 UNLINK segments of her own
// from one process that forks 30 children, descriptors closed: each
// segment's watch waits for 31 processes, and the daemon holds one pidfd
// per process (31), not one per process and segment (620). The names stay
// while mapped, others are served, and once the processes exit the names
// go and so do the pidfds.
func TestMappingWatchPidfds(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	if m.mode != "passthrough" {
		skipOrFail(t, "the kernel has no FUSE passthrough: a mapping keeps its handle, and no watch runs")
	}
	const segments, children = 20, 30
	paths := unlinkSegments(t, m, segments)
	c := startPythonAs(t, userA, "mapper", mapTreeScript, paths...)
	c.expect(t, "ready")
	fmt.Fprintf(c.stdin, "fork %d\n", children)
	c.expect(t, "forked")
	eventually(t, "one pidfd per mapping process", func() (bool, string) {
		n := daemonPidfds(t, m)
		return n == children+1, fmt.Sprintf("the daemon holds %d pidfds, want %d", n, children+1)
	})
	for range 5 { // the watches go on checking: still one per process
		time.Sleep(300 * time.Millisecond)
		if n := daemonPidfds(t, m); n > children+1 {
			t.Fatalf("the daemon holds %d pidfds for %d processes", n, children+1)
		}
	}
	if n, missing := present(paths); n != segments {
		t.Fatalf("UNLINK segments that processes map lost their names: %v", missing)
	}
	othersServed(t, m)
	c.stdin.Close() // the parent exits; its children see the pipe close
	<-c.done
	eventually(t, "the names go with the last mapping", func() (bool, string) {
		n, _ := present(paths)
		return n == 0, fmt.Sprintf("%d of %d names left", n, segments)
	})
	eventually(t, "the pidfds go with the watches", func() (bool, string) {
		n := daemonPidfds(t, m)
		return n == 0, fmt.Sprintf("the daemon holds %d pidfds", n)
	})
}

// TestMappingWatchOverBound (K2): user A holds all her share of the
// daemon's descriptors (a second process opens a segment until EMFILE)
// while her processes map UNLINK segments: the children she forks then
// get no pidfd (the watches poll them, and say so in the log), yet the
// names stay while only those children map the segments, and go once
// they are killed, with the share still full. User B and root are served
// throughout.
func TestMappingWatchOverBound(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough", "--allow-other")
	if m.mode != "passthrough" {
		skipOrFail(t, "the kernel has no FUSE passthrough: a mapping keeps its handle, and no watch runs")
	}
	paths := unlinkSegments(t, m, 3)
	c := startPythonAs(t, userA, "mapper", mapTreeScript, paths...)
	c.expect(t, "ready")
	eventually(t, "the mapper's pidfd", func() (bool, string) {
		n := daemonPidfds(t, m)
		return n == 1, fmt.Sprintf("the daemon holds %d pidfds, want 1", n)
	})
	plain := m.path("a/plain")
	if out, err := runAs(t, userA, "/", "sh", "-c", `echo x > "$1"`, "sh", plain); err != nil {
		t.Fatalf("user A's plain segment: %v: %s", err, out)
	}
	flood := startPythonAs(t, userA, "flood", `
import os, sys
fds = []
try:
    while True:
        fds.append(os.open(sys.argv[1], os.O_RDONLY))
except OSError as e:
    print("errno", e.errno, len(fds), flush=True)
sys.stdin.read()
`, plain)
	if got := flood.expect(t, "errno"); !strings.HasPrefix(got, "24 ") {
		t.Fatalf("user A's flood of opens ended with errno %s, want EMFILE (24)", got)
	}
	fmt.Fprintln(c.stdin, "fork 3")
	c.expect(t, "forked")
	time.Sleep(2500 * time.Millisecond) // watches check at least every second
	if n := daemonPidfds(t, m); n != 1 {
		t.Errorf("the daemon holds %d pidfds for user A's 4 mapping processes past her share, want the one taken before", n)
	}
	wantLog(t, m, "polls for the exits of processes that map it", "uid 1000")
	fmt.Fprintln(c.stdin, "unmap") // only the children, without pidfds, map now
	c.expect(t, "unmapped")
	time.Sleep(2500 * time.Millisecond)
	if n, missing := present(paths); n != len(paths) {
		t.Fatalf("UNLINK segments mapped by processes without pidfds lost their names: %v", missing)
	}
	othersServed(t, m)
	fmt.Fprintln(c.stdin, "kill")
	c.expect(t, "killed")
	eventually(t, "the names go once the polled children exit", func() (bool, string) {
		n, _ := present(paths)
		return n == 0, fmt.Sprintf("%d of %d names left", n, len(paths))
	})
}
