package fs

import (
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAttackBackingNodesMemory: after a crash, the successor lists every
// object of the backing (backingNodes). A user's tree of long names
// (a chain of 255-byte names, many directories at its bottom) must not
// make it hold every directory's whole path: that is up to MaxDepth*256
// bytes per directory the user made, gigabytes for a user's share of
// inodes, in the daemon that recovers the mount (it held 1500*200*256
// bytes, 77 MB, here).
func TestAttackBackingNodesMemory(t *testing.T) {
	const depth, leaves = 200, 1500
	root := t.TempDir()
	rootFd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rootFd)
	long := strings.Repeat("d", 250)
	fd, err := unix.Dup(rootFd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < depth; i++ {
		name := fmt.Sprintf("%s%05d", long, i)
		if err := unix.Mkdirat(fd, name, 0o755); err != nil {
			t.Fatal(err)
		}
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = next
	}
	for i := 0; i < leaves; i++ {
		if err := unix.Mkdirat(fd, fmt.Sprintf("leaf%d", i), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A sibling of the chain, after it in the walk or before: its parent
	// is the root either way.
	if err := unix.Mkdirat(rootFd, "side", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkdirat(rootFd, "side/in", 0o755); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)

	defer debug.SetGCPercent(debug.SetGCPercent(5))
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			if m.HeapAlloc > base && m.HeapAlloc-base > peak.Load() {
				peak.Store(m.HeapAlloc - base)
			}
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	nodes := backingNodes(rootFd, slog.Default())
	close(done)
	<-stopped

	if len(nodes) != depth+leaves+2 {
		t.Fatalf("%d nodes, want %d", len(nodes), depth+leaves+2)
	}
	ids := map[uint64]Node{}
	for _, n := range nodes {
		ids[n.ID] = n
	}
	var st unix.Stat_t
	if err := unix.Fstatat(rootFd, "side/in", &st, 0); err != nil {
		t.Fatal(err)
	}
	var side unix.Stat_t
	unix.Fstatat(rootFd, "side", &side, 0)
	if n := ids[st.Ino]; n.Parent != side.Ino || n.Name != "in" {
		t.Errorf("side/in: %+v, want parent %d", n, side.Ino)
	}
	if n := ids[side.Ino]; n.Parent != 1 {
		t.Errorf("side: %+v, want parent 1 (the root)", n)
	}
	for _, n := range nodes {
		if strings.HasPrefix(n.Name, "leaf") && !strings.HasSuffix(ids[n.Parent].Name, fmt.Sprintf("%05d", depth-1)) {
			t.Fatalf("%s: parent %+v, want the chain's bottom", n.Name, ids[n.Parent])
		}
	}
	t.Logf("peak heap growth in backingNodes: %.1f MB", float64(peak.Load())/1e6)
	if p := peak.Load(); p > 32<<20 {
		t.Errorf("backingNodes grew the heap by %.1f MB for %d directories: it holds every directory's path", float64(p)/1e6, depth+leaves)
	}
}
