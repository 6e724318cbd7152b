package integration

import (
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// TestAttackClusterPullDescriptors: a pull opens the backing files of up
// to 256 segments at once and holds them until they are filled, charged
// to no one. bob, who may only read alice's published model, runs a
// pull of each of its directories of 256 segments at once on node2, whose
// daemon then held some 1024 descriptors for him with four of them (768
// with three), past his share of the descriptors row (545 on a 20000
// limit); as many pulls as his
// connections allow take every descriptor of the daemon. Each batch's
// files are now his: past his share a pull is EMFILE.
func TestAttackClusterPullDescriptors(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, nil, func(t *testing.T, mode string) {
		const dirs, segments = 3, 256
		model := mode + "-model"
		var files []modelFile
		for d := range dirs {
			for s := range segments {
				files = append(files, modelFile{fmt.Sprintf("d%d/s%03d", d, s), 16 << 10, uint64(d*segments + s)})
			}
		}
		userTree(t, filepath.Join(n1, model), userA, 0)
		for d := range dirs {
			userTree(t, filepath.Join(n1, model, fmt.Sprintf("d%d", d)), userA, 0)
		}
		writeModel(t, filepath.Join(n1, model), userA, files...)
		out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, model))
		if err != nil {
			t.Fatalf("alice's publish: %v\n%s\n%s", err, out, lastLine(tb.log(1), "refused"))
		}
		waitVersion(t, filepath.Join(n2, model), versionOf(t, out))

		pid := daemonPid(t, n2)
		base, _ := daemonFDs(t, pid)
		share := descriptorShare(t, n2)
		said := make([]string, dirs)
		var pulls sync.WaitGroup
		for d := range dirs {
			pulls.Go(func() {
				out, err := tb.tensorfs(userB, "pull", filepath.Join(n2, model, fmt.Sprintf("d%d", d)))
				said[d] = fmt.Sprintf("d%d: %v %s", d, err, strings.TrimSpace(out))
			})
		}
		done := make(chan struct{})
		go func() { pulls.Wait(); close(done) }()
		peak := fdPeakUntil(t, pid, base, done)
		t.Logf("bob's %d pulls: the daemon held %d descriptors at most, %d before (his share %d): %s", dirs, peak, base, share, strings.Join(said, "; "))
		if peak-base > share+64 {
			t.Errorf("bob's pulls made node2's daemon hold %d more descriptors, past his share of %d", peak-base, share)
		}
	})
}
