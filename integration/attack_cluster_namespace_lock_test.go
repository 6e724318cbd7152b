package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestAttackClusterPullWalk: "tensorfs pull DIR" walks DIR, any directory
// its asker may read, her own local ones too, for the pulled segments to
// fill. The walk held the lock of the node's cluster namespace, which
// every publish, version made and unpublish of the node takes: alice
// pulled her own directory of 20000 empty segments from 16 connections,
// and root's publish of one segment took 3 s instead of 15 ms (as many
// walks as she queued; a connection each, hundreds of them). Now a pull
// walks without that lock, and a uid's walks run one at a time.
func TestAttackClusterPullWalk(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 1)
	big := aliceSegments(t, tb.node(1), 10000)
	walk := fastest(t, 3, func(int) { tb.tensorfs(userA, "pull", big) }) // refused: nothing published below
	rootPublishWhile(t, tb, walk, func() { tb.tensorfs(userA, "pull", big) })
}

// TestAttackClusterPublishWalk: a publish walks and freezes the whole
// directory holding the node's cluster namespace lock, and only then
// checks its publisher's bounds on this node: alice's publishes of her
// 10000 empty segments, each refused past --cluster-node-inodes 100, from
// 16 connections, made root's publish of one segment wait 10 s for them
// (0.8 s each alone). Skipped unless TENSORFS_UNFIXED=1: the walk, and
// the hashing of a publish that succeeds (as long as its bytes), want to
// move out of the lock, leaving the freeze, the charge (before the
// freeze) and the swap under it, with the publish kept consistent with a
// version of the same directory being made meanwhile.
func TestAttackClusterPublishWalk(t *testing.T) {
	if os.Getenv("TENSORFS_UNFIXED") != "1" {
		t.Skip("known, unfixed: set TENSORFS_UNFIXED=1 (see the comment)")
	}
	t.Parallel()
	tb := upCluster(t, 1)
	joins := strings.Count(tb.log(1), "cluster: joined")
	tb.must("unmount", tb.node(1))
	tb.mount(1, "--cluster-node-inodes", "100")
	eventually(t, "node1 joins the cluster again", func() (bool, string) {
		return strings.Count(tb.log(1), "cluster: joined") > joins, "no new \"cluster: joined\" in its log"
	})
	big := aliceSegments(t, tb.node(1), 10000)
	refused := func(int) {
		if out, err := tb.tensorfs(userA, "publish", big); err == nil || !strings.Contains(out, "quota") {
			t.Errorf("alice's publish of 10000 segments past --cluster-node-inodes 100: %v\n%s", err, out)
		}
	}
	walk := fastest(t, 3, refused)
	rootPublishWhile(t, tb, walk, func() { refused(0) })
}

// aliceSegments makes a directory of n empty segments of alice's in mnt.
func aliceSegments(t *testing.T, mnt string, n int) string {
	t.Helper()
	dir := filepath.Join(mnt, "alice-big")
	userTree(t, dir, userA, 0)
	if out, err := runAs(t, userA, dir, "/usr/bin/python3", "-c", fmt.Sprintf("for i in range(%d): open('f%%d' %% i, 'w').close()", n)); err != nil {
		t.Fatalf("alice's segments: %v\n%s", err, out)
	}
	return dir
}

// fastest runs fn n times and returns the shortest run.
func fastest(t *testing.T, n int, fn func(i int)) time.Duration {
	t.Helper()
	best := time.Duration(1 << 62)
	for i := range n {
		start := time.Now()
		fn(i)
		best = min(best, time.Since(start))
	}
	return best
}

// rootPublishWhile runs alice's request from 16 connections, over and
// over, and fails if root's publish of one segment meanwhile takes more
// than three of her requests alone (walk): it waited for hers.
func rootPublishWhile(t *testing.T, tb *testbed, walk time.Duration, request func()) {
	t.Helper()
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop.Store(true)
	var done atomic.Int64
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				request()
				done.Add(1)
			}
		}()
	}
	eventually(t, "alice's requests run", func() (bool, string) { return done.Load() >= 16, fmt.Sprint(done.Load()) })
	publish := fastest(t, 3, func(i int) {
		d := filepath.Join(tb.node(1), fmt.Sprint("root-pub", i))
		userTree(t, d, 0, 1)
		if out, err := tb.tensorfs(0, "publish", d); err != nil {
			t.Fatalf("root's publish: %v\n%s", err, out)
		}
	})
	t.Logf("alice's request alone: %v; root's publish while 16 of them run: %v", walk, publish)
	if publish > 3*walk {
		t.Errorf("root's publish took %v while alice's requests ran from 16 connections (%v each alone): it waited for hers", publish, walk)
	}
}
