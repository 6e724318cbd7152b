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
// refused one makes none of them.
func TestAttackClusterPathDirs(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, map[int][]string{2: {"--cluster-node-inodes", "8"}}, func(t *testing.T, mode string) {
		top := mode + "-chain"
		userTree(t, filepath.Join(n1, top), userA, 0)
		deep := filepath.Join(n1, top, strings.Repeat("d/", 39)+"pub")
		asUserOK(t, userA, "mkdir -p "+deep)
		before := inodesCharged(t, n2, userA)
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
		dirs := 0
		filepath.WalkDir(filepath.Join(n2, top), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs++
			}
			return nil
		})
		charged := inodesCharged(t, n2, userA) - before
		t.Logf("node2 holds %d directories for alice's version; it charges her %d inodes", dirs, charged)
		if int64(dirs) > charged {
			t.Errorf("node2 made %d directories for alice's version (past her 8 of --cluster-node-inodes), and charges her %d inodes", dirs, charged)
		}
	})
}
