package integration

import (
	"fmt"
	"path/filepath"
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
	n1 := tb.node(1)
	big := filepath.Join(n1, "alice-big")
	userTree(t, big, userA, 0)
	if out, err := runAs(t, userA, big, "/usr/bin/python3", "-c", "import os\nfor i in range(10000): open('f%d' % i, 'w').close()"); err != nil {
		t.Fatalf("alice's segments: %v\n%s", err, out)
	}
	fastest := func(n int, fn func(i int)) time.Duration {
		best := time.Duration(1 << 62)
		for i := range n {
			start := time.Now()
			fn(i)
			best = min(best, time.Since(start))
		}
		return best
	}
	walk := fastest(3, func(int) { tb.tensorfs(userA, "pull", big) }) // refused: nothing published below
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop.Store(true)
	var pulls atomic.Int64
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				tb.tensorfs(userA, "pull", big)
				pulls.Add(1)
			}
		}()
	}
	eventually(t, "alice's pulls run", func() (bool, string) { return pulls.Load() >= 16, fmt.Sprint(pulls.Load()) })
	publish := fastest(3, func(i int) {
		d := filepath.Join(n1, fmt.Sprint("root-pub", i))
		userTree(t, d, 0, 1)
		if out, err := tb.tensorfs(0, "publish", d); err != nil {
			t.Fatalf("root's publish: %v\n%s", err, out)
		}
	})
	t.Logf("one pull's walk of alice's 10000 segments: %v; root's publish while 16 of them run: %v", walk, publish)
	if publish > 3*walk {
		t.Errorf("root's publish took %v while alice pulled her own directory from 16 connections (%v a walk): it waited for her walks", publish, walk)
	}
}
