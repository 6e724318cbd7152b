package integration

// A process whose main thread exits alone (SYS_exit) while another thread
// keeps its mappings is a zombie leader in /proc, with empty maps: the
// daemon reads its mappings through the live thread (DESIGN.md §9), so
// they keep counting in refcount and holders, keep an UNLINK segment's
// name, and keep it through recovery after a crash, until munmap (fresh
// attack L6).

import (
	"os"
	"testing"
	"time"
)

// watchRecheck outlasts the backoff of an UNLINK segment's watch (1 s):
// by then it has checked the segment again.
const watchRecheck = 2500 * time.Millisecond

// testLeaderExit maps both segments of a pair at the paths via returns,
// closes every descriptor, ends the main thread of the mapping child
// alone and checks that the mappings still count, also once the watch
// checked again, and that the segments are free after munmap.
func testLeaderExit(t *testing.T, via func(t *testing.T, path string) string) {
	forEachMode(t, func(t *testing.T, m *mount) {
		c := startMapChild(t)
		p := newMapPair(t, m, c, 4)
		for _, path := range p.both() {
			c.run(t, "libc %s 4", via(t, path))
		}
		c.run(t, "close")
		me := holderLine(t, c.pid, 1)
		p.mapped(t, me)
		c.run(t, "leaderexit")
		time.Sleep(watchRecheck)
		p.mapped(t, me)
		c.run(t, "unmapall")
		p.ended(t)
	})
}

// TestMappingLeaderExit: mappings through the mount.
func TestMappingLeaderExit(t *testing.T) {
	t.Parallel()
	testLeaderExit(t, func(t *testing.T, path string) string { return path })
}

// TestMappingLeaderExitHandlePath: mappings of the backing files through
// user.tensorfs.handle, which hold no FUSE handle in either mode (as a
// descriptor from load or export).
func TestMappingLeaderExitHandlePath(t *testing.T) {
	t.Parallel()
	testLeaderExit(t, func(t *testing.T, path string) string { return xaGet(t, path, xaHandle) })
}

// TestMappingLeaderExitDaemonCrash: recovery after kill -9 of the daemon
// keeps an UNLINK segment whose backing file a process with a zombie
// leader maps, and its watch removes it once the mapping goes.
func TestMappingLeaderExitDaemonCrash(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		c := startMapChild(t)
		p := newMapPair(t, m, c, 4)
		for _, path := range p.both() {
			c.run(t, "libc %s 4", xaGet(t, path, xaHandle))
		}
		c.run(t, "close")
		me := holderLine(t, c.pid, 1)
		c.run(t, "leaderexit")
		m.kill9(t)
		ccWaitENOTCONN(t, m.dir)
		m.remount(t)
		if !xaExists(t, p.unlink) {
			t.Fatalf("%s removed at recovery while a process whose leader exited maps it", p.unlink)
		}
		time.Sleep(watchRecheck)
		p.mapped(t, me)
		c.run(t, "unmapall")
		p.ended(t)
	})
}

// hiddenMapScript makes the UNLINK segment argv[1], maps it, closes it,
// and ends its main thread alone (SYS_exit) while another thread keeps
// the mapping until stdin closes: /proc/PID, which the daemon scans, is
// then a zombie leader whose maps are empty, and the mapping lives on in
// a thread that /proc lists only under /proc/PID/task.
const hiddenMapScript = `
import ctypes, mmap, os, sys, threading, time
p = sys.argv[1]
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
os.setxattr(p, "user.tensorfs.flags", b"UNLINK")
os.ftruncate(fd, 4096)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
ctypes.memmove(addr, b"alive", 5)
os.close(fd)  # Python's mmap would keep a dup of fd open: libc's keeps none
def hold():
    time.sleep(0.3)
    print("mapped", flush=True)
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=hold).start()
libc.syscall(60, 0)
`

// TestAttackMappingZombieLeader (mapping scan: "unmapped" when it could
// not see): the scan reads /proc/PID/maps of each process listed in
// /proc, and a process whose leader thread exited alone has an empty one
// there (its mm is its other threads'), which the scan takes for a
// process that maps nothing. User A maps her UNLINK segment, closes it
// and lets only her main thread exit: the watch finds no mapping and
// removes the name while her process still maps the segment, and
// refcount and holders say nobody holds it. Passthrough fails; classic
// holds here only because a mapping through the mount keeps its FUSE
// handle (a mapping of a descriptor from load or export, or recovery's
// check after kill -9, would read the same empty maps).
func TestAttackMappingZombieLeader(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		seg := m.path("a/tmp")
		if got := h4Background(t, userA, hiddenMapScript, seg); got != "mapped" {
			t.Fatalf("holder: %q", got)
		}
		time.Sleep(3 * time.Second) // the watch backs off to 1 s
		if _, err := os.Lstat(seg); err != nil {
			t.Errorf("the UNLINK segment lost its name while uid %d's process still maps it (its leader thread exited): %v", userA, err)
			return
		}
		if v, err := getxattr(seg, "user.tensorfs.refcount"); err != nil || string(v) == "0" {
			t.Errorf("refcount of a segment uid %d's process maps: %q %v", userA, v, err)
		}
	}, "--allow-other")
}
