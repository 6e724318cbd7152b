package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAttackClusterPathDirs: a node makes the missing directories on a
// published directory's path (in its root, or in directories the
// cluster made) and charged a version its entries alone: alice published
// an empty directory 40 levels down a path of her own on node1, and
// node2 made 40 directories for it (past her --cluster-node-inodes 8)
// charged to no row; each of her published directories can take a path
// as long as a path may be, on every node. Now a version is charged the
// directories on its path as well (refused here past her bound), and a
// refused one makes none of them, nor does a pull try it again.
func TestAttackClusterPathDirs(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, map[int][]string{2: {"--cluster-node-inodes", "8"}}, func(t *testing.T, mode string) {
		top := mode + "-chain"
		userTree(t, filepath.Join(n1, top), userA, 0)
		deep := filepath.Join(n1, top, strings.Repeat("d/", 39)+"pub")
		asUserOK(t, userA, "mkdir -p "+deep)
		charged0 := inodesCharged(t, n2, userA)
		out, err := tb.tensorfs(userA, "publish", deep)
		if err != nil {
			t.Fatalf("alice's publish: %v\n%s", err, out)
		}
		eventually(t, "node2 makes or refuses "+top, func() (bool, string) {
			for _, l := range strings.Split(tb.log(2), "\n") {
				if strings.Contains(l, top) && (strings.Contains(l, "version made here") || strings.Contains(l, "is not made")) {
					return true, ""
				}
			}
			return false, "neither in its log"
		})
		refusals := func() int { return strings.Count(tb.log(2), "past its publisher's bounds on this node is not made") }
		before := refusals()
		for range 3 { // a pull does not make again what node2 would not
			if out, err := tb.tensorfs(userB, "pull", filepath.Join(n2, strings.TrimPrefix(deep, n1))); err == nil {
				t.Errorf("bob pulled a version node2 did not make: %s", out)
			}
		}
		if n := refusals() - before; n > 0 {
			t.Errorf("bob's 3 pulls made node2 refuse alice's version %d more times", n)
		}
		dirs := 0
		filepath.WalkDir(filepath.Join(n2, top), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs++
			}
			return nil
		})
		charged := inodesCharged(t, n2, userA) - charged0
		t.Logf("node2 holds %d directories for alice's version; it charges her %d inodes", dirs, charged)
		if int64(dirs) > charged {
			t.Errorf("node2 made %d directories for alice's version (past her 8 of --cluster-node-inodes), and charges her %d inodes", dirs, charged)
		}
	})
}
