package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestAttackClusterStickyPublish: a publish is allowed to whoever owns
// the directory or may write it, and freezes every segment in it that the
// publisher may write. In a sticky directory every user may write (root's
// scratch, mode 1777, as /tmp), so alice publishes it with bob's 0666
// segment inside: bob's segment becomes read-only for bob too, and
// alice's unpublish then removes it (the node withdraws what it froze),
// although the sticky bit says only bob or root may remove or rename his
// segment there.
func TestAttackClusterStickyPublish(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 1)
	n1 := tb.node(1)
	clusterModes(t, tb, 1, nil, func(t *testing.T, mode string) {
		scratch := mode + "-scratch"
		stickyScratch(t, tb, 1, scratch)
		bobs := filepath.Join(n1, scratch, "bob")
		asUserOK(t, userB, fmt.Sprintf("umask 0; printf bob-data > %s", bobs))
		before := objectState(t, bobs)

		out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, scratch))
		if err == nil {
			t.Errorf("alice publishes root's sticky %s with bob's segment in it: %s", scratch, out)
			if out, err := runAs(t, userB, "/", "sh", "-c", "printf more >> "+bobs); err != nil {
				t.Errorf("bob may no longer write his own segment: %v %s", err, out)
			}
			if out, err := tb.tensorfs(userA, "unpublish", filepath.Join(n1, scratch)); err != nil {
				t.Logf("alice's unpublish: %v %s", err, out)
			}
			eventually(t, "node1 withdraws "+scratch, func() (bool, string) {
				_, err := os.Lstat(filepath.Join(n1, scratch))
				if os.IsNotExist(err) {
					return true, ""
				}
				rec, _ := getxattr(filepath.Join(n1, scratch), "user.tensorfs.cluster")
				return len(rec) == 0, string(rec)
			})
		} else if !strings.Contains(out, "its unpublish removes") {
			t.Errorf("alice's publish is refused for another reason: %v %s", err, out)
		}
		if fi, err := os.Lstat(filepath.Join(n1, scratch)); err != nil || fi.Mode() != os.ModeDir|os.ModeSticky|0o777 {
			t.Errorf("root's sticky %s, after alice's publish and unpublish: %v %v", scratch, fi, err)
		}
		if _, err := os.Lstat(bobs); err != nil {
			t.Fatalf("bob's segment in the sticky %s, after alice's publish and unpublish: %v", scratch, err)
		}
		if after := objectState(t, bobs); after != before {
			t.Errorf("bob's segment changed: %s, was %s", after, before)
		}
	})
}
