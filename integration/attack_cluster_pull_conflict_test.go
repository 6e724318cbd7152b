package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAttackClusterPullConflict: a published directory a node left alone
// (a local directory on its path that its publisher may not write) is
// not there, so a pull of it made the version again first: read its
// whole manifest from etcd, take the node's namespace lock, find the
// conflict and log it, for every pull by any user. bob's five pulls of
// alice's version made node2 make it five more times. Now a pull of a
// version this node left alone says so (ENOENT) at once.
func TestAttackClusterPullConflict(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	for _, n := range []string{n1, n2} {
		if err := os.Mkdir(filepath.Join(n, "roots"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	userTree(t, filepath.Join(n1, "roots", "alice"), userA, 2)
	out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, "roots", "alice"))
	if err != nil {
		t.Fatalf("alice's publish: %v\n%s", err, out)
	}
	left := func() int { return strings.Count(tb.log(2), "a published name is left alone") }
	eventually(t, "node2 leaves roots/alice alone", func() (bool, string) { return left() > 0, "not in its log" })
	before := left()
	for range 5 {
		out, err := tb.tensorfs(userB, "pull", filepath.Join(n2, "roots", "alice"))
		if err == nil {
			t.Fatalf("bob pulled a directory node2 left alone: %s", out)
		}
	}
	if n := left() - before; n > 0 {
		t.Errorf("bob's 5 pulls of a version node2 left alone made it %d more times", n)
	}
}
