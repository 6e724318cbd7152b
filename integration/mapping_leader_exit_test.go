package integration

// A process whose main thread exits alone (SYS_exit) while another thread
// keeps its mappings is a zombie leader in /proc, with empty maps: the
// daemon reads its mappings through the live thread (DESIGN.md §9), so
// they keep counting in refcount and holders, keep an UNLINK segment's
// name, and keep it through recovery after a crash, until munmap (fresh
// attack L6).

import (
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
