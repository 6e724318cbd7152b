package fs

import (
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestDeepChainReopens: a lookup at the bottom of a chain of directories
// whose descriptors the cache has all closed reopens the chain without
// recursion: it works with a stack far smaller than a recursion through
// each level would need, and the cache keeps the deepest descriptors of
// the chain, within its bound.
func TestDeepChainReopens(t *testing.T) {
	const depth = 4000
	fsys := testFS(t)
	fsys.dirs = newDirFds(64)
	fsys.dirs.pin(&fsys.root.dirNode, fsys.root.fd) // the root's stays
	chain := []*dirNode{&fsys.root.dirNode}
	for range depth {
		chain = append(chain, mkdir(t, chain[len(chain)-1], "d"))
	}
	bottom := chain[depth]
	mkseg(t, bottom, "s")
	fsys.dirs.closeIdle()
	for _, d := range chain[1:] {
		if d.fd >= 0 {
			t.Fatal("a directory of the chain kept its descriptor after closeIdle")
		}
	}
	want := backingIno(t, fsys, strings.Repeat("d/", depth)+"s")
	// A recursion through each level took some 400 bytes of stack a
	// level: over 1 MB here. Restored before the test's cleanup, whose
	// os.RemoveAll recurses.
	old := debug.SetMaxStack(128 << 10)
	var out fuse.EntryOut
	t0 := time.Now()
	_, errno := bottom.Lookup(callerCtx(0), "s", &out)
	t.Logf("reopen took %v", time.Since(t0))
	debug.SetMaxStack(old)
	if errno != 0 {
		t.Fatalf("lookup at the bottom of a %d-deep chain: %v", depth, errno)
	}
	if out.Ino != want {
		t.Errorf("lookup at the bottom found inode %d, the backing holds %d", out.Ino, want)
	}
	st := fsys.dirs.stats()
	if st["open"] > 64 {
		t.Errorf("the cache holds %v after the reopen, past its bound", st)
	}
	for _, d := range chain[depth-32:] {
		if d.fd < 0 {
			t.Fatal("a directory near the bottom of the chain lost its descriptor: the next request there reopens the chain again")
		}
	}
	if chain[1].fd >= 0 {
		t.Error("the top of the chain kept its descriptor: the cache keeps the deepest")
	}
}

// TestDeepChainLogPath: a node's path in log lines names at most the last
// alloc.LogDepth components of a deep chain, after ".../", and a shallow node's
// whole path.
func TestDeepChainLogPath(t *testing.T) {
	fsys := testFS(t)
	d := &fsys.root.dirNode
	for range alloc.LogDepth + 10 {
		d = mkdir(t, d, "d")
	}
	want := ".../" + strings.TrimSuffix(strings.Repeat("d/", alloc.LogDepth), "/")
	if got := d.path(); got != want {
		t.Errorf("log path of a %d-deep directory: %q, want %q", alloc.LogDepth+10, got, want)
	}
	s := mkseg(t, mkdir(t, &fsys.root.dirNode, "a"), "s")
	if got := s.path(); got != "a/s" {
		t.Errorf("log path of a/s: %q", got)
	}
}

// backingIno returns the inode of rel in fsys's backing, found one level
// at a time (rel may be longer than a path the kernel takes).
func backingIno(t *testing.T, fsys *filesystem, rel string) uint64 {
	t.Helper()
	fd, err := unix.Dup(fsys.store.RootFd)
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(rel, "/")
	for _, part := range parts[:len(parts)-1] {
		next, err := unix.Openat(fd, part, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = next
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstatat(fd, parts[len(parts)-1], &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}
