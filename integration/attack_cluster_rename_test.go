package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAttackClusterRenameOut: what a published version makes on a node is
// charged to its publisher in that node's cluster rows, and given back
// whole at the unpublish; an object the cluster made is charged to no
// one in the inodes row. Its owner renamed the version's segments out of
// the published directory on that node (link was EXDEV, rename was not),
// and the unpublish left them there, charged to no row at all: three
// rounds left alice 15 segments on node2 (--cluster-node-inodes 8) that
// nothing counted until node2's next mount. Now a pulled segment or a
// directory the cluster made is not renamed (EXDEV, as link): mv copies
// them into segments of alice's own, charged to her as any.
func TestAttackClusterRenameOut(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, map[int][]string{2: {"--cluster-node-inodes", "8"}}, func(t *testing.T, mode string) {
		keep := filepath.Join(n2, mode+"-keep")
		userTree(t, keep, userA, 0)
		before := inodesCharged(t, n2, userA) // what a remount recounted, of the last mode's rounds too
		const rounds, segments = 3, 5
		for r := range rounds {
			name := fmt.Sprintf("%s-round%d", mode, r)
			userTree(t, filepath.Join(n1, name), userA, segments)
			if r == 0 { // and a directory, which node2 makes for the version
				userTree(t, filepath.Join(n1, name, "sub"), userA, 1)
			}
			out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, name))
			if err != nil {
				t.Fatalf("alice's publish: %v\n%s", err, out)
			}
			waitVersion(t, filepath.Join(n2, name), versionOf(t, out))
			if r == 0 {
				for _, p := range []string{filepath.Join(n2, name, "f1"), filepath.Join(n2, name, "sub")} {
					if out, err := runAs(t, userA, "/", "/usr/bin/python3", "-c", "import os, sys; os.rename(sys.argv[1], sys.argv[2])", p, filepath.Join(keep, "renamed")); err == nil || !strings.Contains(string(out), "Invalid cross-device link") {
						t.Errorf("alice renamed %s out of what the cluster made on node2: %v\n%s; want EXDEV", p, err, out)
					}
				}
			}
			asUserOK(t, userA, fmt.Sprintf("for f in %s/*; do mv \"$f\" %s/%d-$(basename \"$f\"); done", filepath.Join(n2, name), keep, r))
			if out, err := tb.tensorfs(userA, "unpublish", filepath.Join(n1, name)); err != nil {
				t.Fatalf("alice's unpublish: %v\n%s", err, out)
			}
			eventually(t, "node2 removes "+name, func() (bool, string) {
				_, err := os.Lstat(filepath.Join(n2, name))
				return os.IsNotExist(err), fmt.Sprint(err)
			})
		}
		names, err := os.ReadDir(keep)
		if err != nil {
			t.Fatal(err)
		}
		charged := inodesCharged(t, n2, userA) - before
		t.Logf("alice keeps %d segments the cluster made on node2; node2 charges her %d more inodes", len(names), charged)
		if int64(len(names)) > charged {
			t.Errorf("alice keeps %d segments the cluster made on node2 (past her 8 of --cluster-node-inodes), and node2 charges her %d more inodes for them", len(names), charged)
		}
	})
}

// inodesCharged sums what uid is charged in mnt's inodes rows (the
// backing's, and its cluster's published versions'), as root sees them.
func inodesCharged(t *testing.T, mnt string, uid int) int64 {
	t.Helper()
	var n int64
	for _, r := range ledgerRows(t, mnt) {
		if strings.HasPrefix(r.Name, "inodes") {
			n += r.ByUID[fmt.Sprint(uid)]
		}
	}
	return n
}
