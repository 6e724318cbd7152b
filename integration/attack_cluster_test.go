package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Attacks on the cluster by unprivileged publishers (fresh round 5): alice
// (userA) and bob (userB), on the test bed of scripts/cluster.sh, in both
// modes. Each test fails on the code it was written against.

// clusterModes remounts every node of tb in each mode in turn (flags
// added to node k's) and runs fn with a prefix for the mode's names.
func clusterModes(t *testing.T, tb *testbed, nodes int, flags map[int][]string, fn func(t *testing.T, mode string)) {
	for _, mode := range []string{"passthrough", "classic"} {
		t.Run(mode, func(t *testing.T) {
			for k := 1; k <= nodes; k++ {
				f := append([]string{}, flags[k]...)
				if mode == "classic" {
					f = append(f, "--no-passthrough")
				}
				tb.remount(k, f...)
				if got := mountMode(t, tb.node(k)); got != mode {
					t.Fatalf("node%d serves in mode %q, want %q", k, got, mode)
				}
			}
			fn(t, mode)
		})
	}
}

// stickyScratch makes DIR/name, root's, mode 1777 (as /tmp), on each node.
func stickyScratch(t *testing.T, tb *testbed, nodes int, name string) {
	t.Helper()
	for k := 1; k <= nodes; k++ {
		p := filepath.Join(tb.node(k), name)
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, 0o777|os.ModeSticky); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAttackClusterRepublishOthersDir (C5-1): nothing ties a published
// directory to its publisher. bob keeps a directory of his own on node2
// at the path alice will publish from node1 (node2 leaves hers alone, a
// conflict); then he publishes his, from node2, as a new version of
// alice's directory. Every other node, alice's own node1 included,
// replaces her segments with his (his bytes at her names), removes those
// he has not, and gives her directory his owner and mode: bob changes and
// removes, through the daemons, what he could not touch on a tmpfs
// (alice's 0755 directory), and node1 serves his bytes as the directory
// alice published.
func TestAttackClusterRepublishOthersDir(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 2)
	n1, n2 := tb.node(1), tb.node(2)
	clusterModes(t, tb, 2, nil, func(t *testing.T, mode string) {
		scratch := mode + "-scratch"
		stickyScratch(t, tb, 2, scratch)
		asUserOK(t, userB, fmt.Sprintf("mkdir -m 0755 %[1]s/%[2]s/model && printf EVIL > %[1]s/%[2]s/model/w", n2, scratch))
		asUserOK(t, userA, fmt.Sprintf("mkdir -m 0755 %[1]s/%[2]s/model && printf alice-weights > %[1]s/%[2]s/model/w && printf alice-norm > %[1]s/%[2]s/model/norm", n1, scratch))
		out, err := tb.tensorfs(userA, "publish", filepath.Join(n1, scratch, "model"))
		if err != nil {
			t.Fatalf("alice's publish: %v\n%s", err, out)
		}
		mine := filepath.Join(n1, scratch, "model")
		before := objectState(t, mine) + " | " + objectState(t, mine+"/w")

		out, err = tb.tensorfs(userB, "publish", filepath.Join(n2, scratch, "model"))
		if err == nil {
			t.Errorf("bob publishes a new version of alice's published directory %s/model from node2: %s", scratch, strings.TrimSpace(out))
		}
		// What node1 makes of it, if anything: give its watch a moment.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			if st := objectState(t, mine); strings.Contains(st, fmt.Sprintf("uid %d", userB)) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		after := objectState(t, mine)
		w, _ := os.ReadFile(mine + "/w")
		if after+" | "+objectState(t, mine+"/w") != before {
			t.Errorf("alice's published directory on node1 changed under bob's publish: now %s, w holds %q (was %s)", after, w, before)
		}
		if string(w) == "EVIL" {
			t.Errorf("node1 serves bob's bytes at alice's published name %s/model/w", scratch)
		}
	})
}

// TestAttackClusterFailedPublishLeavesKeys (C5-2): a publish whose
// manifest etcd refuses part way (one entry larger than etcd's request
// limit: 40 user.* attributes of 64 KiB, which a segment takes and a
// manifest allows, 256 of them) fails after the keys before it were
// written (the version's header, references, contents, the entries
// before it), and nothing deletes them: no directory key names the
// version, so they count against no one's bounds and no collection finds
// them. Each attempt (a byte changed: a new version) leaves megabytes
// more in etcd, whose quota stops the whole cluster once full.
func TestAttackClusterFailedPublishLeavesKeys(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 1)
	n1 := tb.node(1)
	clusterModes(t, tb, 1, nil, func(t *testing.T, mode string) {
		dir := filepath.Join(n1, mode+"-big")
		userTree(t, dir, userA, 0)
		pythonAs(t, userA, dir, `
import os
for f, n in (("b", 15), ("c", 15), ("z", 40)):
    open(f, "w").write(f)
    for i in range(n):
        os.setxattr(f, "user.x%d" % i, os.urandom(65536))
`)
		before := tb.etcdKeys()
		for i := range 3 {
			out, err := tb.tensorfs(userA, "publish", dir)
			if err == nil {
				t.Fatalf("the publish succeeded: %s", out)
			}
			asUserOK(t, userA, fmt.Sprintf("printf %d >> %s/b", i, dir))
		}
		after := tb.etcdKeys()
		t.Logf("etcd before: %+v, after three failed publishes: %+v", before, after)
		if after.bytes-before.bytes > 64<<10 {
			t.Errorf("three failed publishes by uid %d left %d keys and %d bytes in etcd, charged to no one and never collected", userA, after.keys-before.keys, after.bytes-before.bytes)
		}
	})
}

// TestAttackClusterServedDescriptors (C5-3): every content a node serves
// keeps a descriptor of its backing file open in the daemon
// (pulledSet.serveFrom) for as long as a segment has it, and a publish
// holds one per segment while it runs (collect): neither is charged to the
// ledger's descriptors row. alice publishes more distinct segments than
// her share of descriptors and the daemon holds that many more, for good;
// with about RLIMIT_NOFILE of them (19500 on a 20000 limit) bob's opens,
// within his share, and root's fail with EMFILE.
func TestAttackClusterServedDescriptors(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 1)
	n1 := tb.node(1)
	clusterModes(t, tb, 1, nil, func(t *testing.T, mode string) {
		var st struct {
			Daemon struct{ Pid int }
			Ledger []struct {
				Name   string
				PerUID int64 `json:"per_uid"`
			}
		}
		raw, err := getxattr(n1, statsXattr)
		if err == nil {
			err = json.Unmarshal(raw, &st)
		}
		if err != nil || st.Daemon.Pid == 0 {
			t.Fatalf("stats: %v %s", err, raw)
		}
		var share int64
		for _, r := range st.Ledger {
			if strings.HasPrefix(r.Name, "descriptors") {
				share = r.PerUID
			}
		}
		if share == 0 {
			t.Fatalf("no descriptors row in %s", raw)
		}
		n := int(share) + 150
		dir := filepath.Join(n1, mode+"-many")
		userTree(t, dir, userA, 0)
		pythonAs(t, userA, dir, `
import os, sys
for i in range(int(sys.argv[1])):
    fd = os.open("f%05d" % i, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"%d" % i)
    os.close(fd)
`, strconv.Itoa(n))
		was := openFDCount(t, st.Daemon.Pid)
		if out, err := tb.tensorfs(userA, "publish", dir); err != nil {
			t.Fatalf("alice's publish: %v\n%s", err, out)
		}
		now := openFDCount(t, st.Daemon.Pid)
		if now-was > int(share) {
			t.Errorf("alice's publish of %d segments left node1's daemon holding %d more descriptors (%d, was %d), past her share of %d, charged to no one", n, now-was, now, was, share)
		}
	})
}
