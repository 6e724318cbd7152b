package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Per-user cluster bounds (DESIGN.md §10, README "Cluster"): what one
// user's published directories hold in etcd, checked by the publishing
// node, and what their versions make on each node.

// boundsFlags are the test's bounds: node1 (where users publish) bounds
// what a user holds in etcd, node2 what a user's versions make on it.
var boundsFlags = map[int][]string{
	1: {"--cluster-user-entries", "12", "--cluster-user-dirs", "3"},
	2: {"--cluster-node-inodes", "8"},
}

// TestClusterBounds: as unprivileged users, in both modes. A publish past
// the user's entries or directories in etcd fails with EDQUOT and a
// message naming the bound, the uid and the numbers, and changes nothing
// (no key in etcd, no name on node2, its segments writable again); one
// past the user's inodes on node2 is published, not made on node2, logged
// there and shown in user.tensorfs.cluster of its directory; another user
// and root publish on; republishing does not grow etcd.
func TestClusterBounds(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	users := map[string][2]int{"passthrough": {userA, userB}, "classic": {userA + 2, userB + 2}}
	for _, mode := range []string{"passthrough", "classic"} {
		t.Run(mode, func(t *testing.T) {
			for k := 1; k <= 2; k++ {
				flags := slices.Clone(boundsFlags[k])
				if mode == "classic" {
					flags = append(flags, "--no-passthrough")
				}
				tb.remount(k, flags...)
				if got := mountMode(t, tb.node(k)); got != mode {
					t.Fatalf("node%d serves in mode %q, want %q", k, got, mode)
				}
			}
			heavy, other := users[mode][0], users[mode][1]
			dir := func(n, name string) string { return filepath.Join(n, mode+"-"+name) }
			publish := func(uid int, name string) (string, error) {
				return tb.tensorfs(uid, "publish", dir(n1, name))
			}

			userTree(t, dir(n1, "u1"), heavy, 5) // 6 entries
			out, err := publish(heavy, "u1")
			if err != nil {
				t.Fatalf("publish within the bounds: %v\n%s", err, out)
			}
			waitVersion(t, dir(n2, "u1"), versionOf(t, out))

			// Past the entries a user may hold in etcd (6 + 8 > 12).
			before := tb.etcdKeys()
			userTree(t, dir(n1, "u2"), heavy, 7)
			out, err = publish(heavy, "u2")
			refusedPublish(t, out, err, heavy, "limit of 12 published entries", "--cluster-user-entries", "holds 6 and needs 8 more")
			if after := tb.etcdKeys(); after != before {
				t.Errorf("a refused publish changed etcd: %+v, before %+v", after, before)
			}
			if out, err := runAs(t, heavy, "/", "sh", "-c", "echo x >> "+dir(n1, "u2")+"/f1"); err != nil {
				t.Errorf("a segment of a refused publish stays read-only: %v %s", err, out)
			}
			if !strings.Contains(tb.log(1), "--cluster-user-entries") {
				t.Error("node1's log does not say why it refused the publish")
			}

			// Another user and root publish on; once root's is made on
			// node2, the refused one would have been.
			userTree(t, dir(n1, "o1"), other, 5)
			if out, err := publish(other, "o1"); err != nil {
				t.Errorf("another user's publish: %v\n%s", err, out)
			}
			userTree(t, dir(n1, "r1"), 0, 20)
			out, err = publish(0, "r1")
			if err != nil {
				t.Fatalf("root's publish: %v\n%s", err, out)
			}
			waitVersion(t, dir(n2, "r1"), versionOf(t, out))
			if _, err := os.Lstat(dir(n2, "u2")); !os.IsNotExist(err) {
				t.Errorf("the refused publish made %s: %v", dir(n2, "u2"), err)
			}

			// Within the user's bounds in etcd (9 entries, 2 directories),
			// past its inodes on node2 (6 + 3 > 8).
			userTree(t, dir(n1, "u3"), heavy, 2)
			out, err = publish(heavy, "u3")
			if err != nil {
				t.Fatalf("publish within node1's bounds: %v\n%s", err, out)
			}
			v3 := versionOf(t, out)
			var st struct {
				Version string
				Refused *struct {
					Version string
					UID     int
					Reason  string
				}
			}
			eventually(t, "node2 refuses "+v3, func() (bool, string) {
				raw, err := getxattr(dir(n2, "u3"), "user.tensorfs.cluster")
				if err == nil {
					err = json.Unmarshal(raw, &st)
				}
				return err == nil && st.Refused != nil, fmt.Sprintf("%s %v", raw, err)
			})
			if st.Refused.Version != v3 || st.Refused.UID != heavy || st.Version != "" ||
				!strings.Contains(st.Refused.Reason, fmt.Sprintf("uid %d reached the limit of 8 inodes", heavy)) ||
				!strings.Contains(st.Refused.Reason, "--cluster-node-inodes") || !strings.Contains(st.Refused.Reason, "holds 6 and needs 3 more") {
				t.Errorf("user.tensorfs.cluster of the refused version on node2: %+v", st)
			}
			if names, _ := os.ReadDir(dir(n2, "u3")); len(names) != 0 {
				t.Errorf("the refused version made %d names on node2", len(names))
			}
			if !strings.Contains(tb.log(2), "past its publisher's bounds on this node is not made") {
				t.Error("node2's log does not say why it made no version")
			}

			// Past the directories a user may publish (3).
			userTree(t, dir(n1, "u4"), heavy, 0)
			userTree(t, dir(n1, "u5"), heavy, 0)
			if out, err := publish(heavy, "u4"); err != nil {
				t.Fatalf("a third directory: %v\n%s", err, out)
			}
			out, err = publish(heavy, "u5")
			refusedPublish(t, out, err, heavy, "limit of 3 published directories (--cluster-user-dirs)", "holds 3 and needs 1 more")

			// Republishing keeps etcd's size: root's r1 gets one more
			// segment a version, and etcd holds two versions of it.
			var sizes []int64
			for i := range 5 {
				if err := os.WriteFile(filepath.Join(dir(n1, "r1"), "new"+strconv.Itoa(i)), []byte("x"), 0o644); err != nil {
					t.Fatal(err)
				}
				if out, err := publish(0, "r1"); err != nil {
					t.Fatalf("republish %d: %v\n%s", i, err, out)
				}
				sizes = append(sizes, tb.etcdKeys().bytes)
			}
			t.Logf("bytes in etcd after each republish of %s: %v", dir(n1, "r1"), sizes)
			if grew := sizes[4] - sizes[0]; grew > 4*2*1024 {
				t.Errorf("etcd grew %d bytes over four republishes: old versions are kept", grew)
			}
		})
	}
}

// mountMode is the mode user.tensorfs.stats of mountpoint says.
func mountMode(t *testing.T, mountpoint string) string {
	t.Helper()
	var st struct{ Mode string }
	raw, err := getxattr(mountpoint, statsXattr)
	if err == nil {
		err = json.Unmarshal(raw, &st)
	}
	if err != nil {
		t.Fatalf("%s of %s: %v", statsXattr, mountpoint, err)
	}
	return st.Mode
}

// userTree makes dir, owned by uid, and n empty segments in it made by
// uid.
func userTree(t *testing.T, dir string, uid, n int) {
	t.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(dir, uid, uid); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		return
	}
	args := []string{}
	for i := 1; i <= n; i++ {
		args = append(args, "f"+strconv.Itoa(i))
	}
	if out, err := runAs(t, uid, dir, "touch", args...); err != nil {
		t.Fatalf("touch as uid %d: %v\n%s", uid, err, out)
	}
}

// refusedPublish fails unless a publish failed with EDQUOT, naming the
// uid and the bound in words.
func refusedPublish(t *testing.T, out string, err error, uid int, words ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("a publish past a bound succeeded: %s", out)
	}
	for _, w := range append([]string{"disk quota exceeded", fmt.Sprintf("uid %d", uid)}, words...) {
		if !strings.Contains(out, w) {
			t.Errorf("the refused publish says %q, not %q", out, w)
		}
	}
}

// etcdState is what the published namespace holds in etcd: its keys and
// their bytes (holder and node keys apart, which leases tie to nodes).
type etcdState struct {
	keys  int
	bytes int64
}

// etcdKeys reads the test bed's etcd, as a member of the cluster.
func (tb *testbed) etcdKeys() etcdState {
	tb.t.Helper()
	member := []string{"-etcd", tb.env["TESTBED_ETCD"], "-ca", tb.env["TESTBED_CA"],
		"-cert", tb.env["TESTBED_CERTS"] + "/node1.pem", "-key", tb.env["TESTBED_CERTS"] + "/node1-key.pem"}
	out, err := tb.testbedBin(1, append(append([]string{"keys"}, member...), "/tensorfs/")...)
	if err != nil {
		tb.t.Fatalf("keys: %v\n%s", err, out)
	}
	var st etcdState
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		size, key, _ := strings.Cut(line, " ")
		if strings.HasPrefix(key, "/tensorfs/holders/") || strings.HasPrefix(key, "/tensorfs/nodes/") {
			continue
		}
		n, err := strconv.ParseInt(size, 10, 64)
		if err != nil {
			tb.t.Fatalf("keys printed %q", line)
		}
		st.keys++
		st.bytes += n
	}
	return st
}
