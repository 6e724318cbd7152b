package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAttackClusterRenameParent: a published directory is made on a node
// inside a local directory of its publisher's (she may write it), and a
// node finds it to remove at the unpublish by its path. Its publisher
// renamed her own directory above it on node2 (the cluster's objects
// are not renamed, EXDEV, but that directory was hers), unpublished,
// and node2 gave back what the version was charged and found nothing at
// the path to remove: two rounds left her 10 pulled segments on node2
// (--cluster-node-inodes 8) charged to no row until node2's next mount.
// Now a directory on the path of a published directory made here is not
// renamed either (EXDEV), until the version is gone.
func TestAttackClusterRenameParent(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, map[int][]string{2: {"--cluster-node-inodes", "8"}}, func(t *testing.T, mode string) {
		const rounds, segments = 2, 5
		top := mode + "-top" // alice's, on both nodes
		userTree(t, filepath.Join(n1, top), userA, 0)
		userTree(t, filepath.Join(n2, top), userA, 0)
		for r := range rounds {
			userTree(t, filepath.Join(n2, top, fmt.Sprint("home", r)), userA, 0)
		}
		before := inodesCharged(t, n2, userA)
		left := 0
		for r := range rounds {
			home := filepath.Join(top, fmt.Sprint("home", r))
			userTree(t, filepath.Join(n1, home), userA, 0)
			userTree(t, filepath.Join(n1, home, "pub"), userA, segments)
			out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, home, "pub"))
			if err != nil {
				t.Fatalf("alice's publish: %v\n%s", err, out)
			}
			waitVersion(t, filepath.Join(n2, home, "pub"), versionOf(t, out))
			moved := filepath.Join(n2, home+"-moved")
			out, err = runAs(t, userA, "/", "/usr/bin/python3", "-c", "import os, sys; os.rename(sys.argv[1], sys.argv[2])", filepath.Join(n2, home), moved)
			if err != nil && !strings.Contains(out, "Invalid cross-device link") {
				t.Fatalf("alice's rename of her directory above a published one on node2: %v\n%s; want success or EXDEV", err, out)
			}
			if out, err := tb.tensorfs(userA, "unpublish", filepath.Join(n1, home, "pub")); err != nil {
				t.Fatalf("alice's unpublish: %v\n%s", err, out)
			}
			eventually(t, "node2 withdraws "+home+"/pub", func() (bool, string) {
				_, err := os.Lstat(filepath.Join(n2, home, "pub"))
				charged := inodesCharged(t, n2, userA)
				return os.IsNotExist(err) && charged == before, fmt.Sprintf("%v; alice charged %d inodes, %d before", err, charged, before)
			})
			if err != nil { // refused while the version was here: free to move once it is gone
				if out, err := runAs(t, userA, "/", "mv", filepath.Join(n2, home), moved); err != nil {
					t.Fatalf("alice's rename of her directory once nothing published is below it: %v\n%s", err, out)
				}
			}
			names, _ := os.ReadDir(filepath.Join(moved, "pub"))
			left += len(names)
		}
		charged := inodesCharged(t, n2, userA) - before
		t.Logf("alice keeps %d segments the cluster made on node2; node2 charges her %d more inodes", left, charged)
		if int64(left) > charged {
			t.Errorf("alice keeps %d segments the cluster made on node2 (past her 8 of --cluster-node-inodes), and node2 charges her %d more inodes for them", left, charged)
		}

		// Removed here first: node2 made deep/x for deep/x/pub inside her
		// deep (root's, as what the cluster makes on a path is). Root
		// removes deep/x/pub on node2 (rm -r); deep/x stays, made for it,
		// and her deep is still not renamed, until the unpublish removes
		// deep/x too.
		deep := filepath.Join(top, "deep")
		userTree(t, filepath.Join(n2, deep), userA, 0)
		userTree(t, filepath.Join(n1, deep), userA, 0)
		userTree(t, filepath.Join(n1, deep, "x"), userA, 0)
		userTree(t, filepath.Join(n1, deep, "x", "pub"), userA, 1)
		out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, deep, "x", "pub"))
		if err != nil {
			t.Fatalf("alice's publish: %v\n%s", err, out)
		}
		waitVersion(t, filepath.Join(n2, deep, "x", "pub"), versionOf(t, out))
		if err := os.RemoveAll(filepath.Join(n2, deep, "x", "pub")); err != nil {
			t.Fatal(err)
		}
		eventually(t, "node2 records deep/x/pub removed here", func() (bool, string) {
			return strings.Contains(tb.log(2), "published directory removed here"), tail(tb.log(2))
		})
		rename := func() (string, error) {
			return runAs(t, userA, "/", "/usr/bin/python3", "-c", "import os, sys; os.rename(sys.argv[1], sys.argv[2])", filepath.Join(n2, deep), filepath.Join(n2, deep+"-moved"))
		}
		if out, err := rename(); err == nil || !strings.Contains(out, "Invalid cross-device link") {
			t.Errorf("alice renamed her directory above deep/x, made for a version removed here: %v\n%s; want EXDEV", err, out)
		}
		if out, err := tb.tensorfs(userA, "unpublish", filepath.Join(n1, deep, "x", "pub")); err != nil {
			t.Fatalf("alice's unpublish: %v\n%s", err, out)
		}
		eventually(t, "node2 removes deep/x, made for the version", func() (bool, string) {
			_, err := os.Lstat(filepath.Join(n2, deep, "x"))
			return os.IsNotExist(err), fmt.Sprint(err)
		})
		if out, err := rename(); err != nil {
			t.Errorf("alice's rename once the version is gone: %v\n%s", err, out)
		}
	})
}
