package fs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
	"tensorfs/internal/tmpfstest"
)

// Per-user cluster bounds (cluster_bounds.go): what a user's published
// directories hold in etcd, and what their versions make on each node.

// ownedTree makes directory name at the root of fsys holding n segments
// of size bytes each, all of it owned by who.
func ownedTree(t *testing.T, fsys *filesystem, name string, who ctl.Cred, n, size int) {
	t.Helper()
	d := mkdir(t, &fsys.root.dirNode, name)
	for i := range n {
		writeSeg(t, fsys, d, fmt.Sprintf("%s/s%d", name, i), make([]byte, size))
	}
	filepath.Walk(filepath.Join(fsys.store.Dir, name), func(p string, _ os.FileInfo, err error) error {
		if err == nil {
			err = os.Lchown(p, int(who.Uid), int(who.Gid))
		}
		if err != nil {
			t.Fatal(err)
		}
		return nil
	})
}

// etcdState is what the published namespace holds in etcd: its keys
// (holder and node keys apart, which are tied to leases), the bytes of
// their keys and values, and how many of them are version headers.
type etcdState struct {
	keys, versions int
	bytes          int64
}

func readEtcd(t *testing.T, cli *clientv3.Client) etcdState {
	t.Helper()
	resp, err := cli.Get(context.Background(), cluster.DefaultPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var st etcdState
	for _, kv := range resp.Kvs {
		k := strings.TrimPrefix(string(kv.Key), cluster.DefaultPrefix)
		if strings.HasPrefix(k, "holders/") || strings.HasPrefix(k, "nodes/") {
			continue
		}
		st.keys++
		st.bytes += int64(len(kv.Key) + len(kv.Value))
		if strings.HasPrefix(k, "versions/") {
			st.versions++
		}
	}
	return st
}

// refused fails unless err is errno and names the bound, the uid and
// the number the bound allows.
func refused(t *testing.T, what string, err error, errno syscall.Errno, words ...string) {
	t.Helper()
	if toErrno(err) != errno {
		t.Fatalf("%s: %v, want %v", what, err, errno)
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %q does not say %q", what, err, w)
		}
	}
}

// awaitDir waits until fsys has made version v of the published dir.
func awaitDir(t *testing.T, fsys *filesystem, dir, v string) {
	t.Helper()
	eventually(t, dir+" version "+v+" made", func() bool {
		rec, err := alloc.ReadPublished(filepath.Join(fsys.store.Dir, dir))
		return err == nil && strings.Contains(string(rec), v)
	})
}

// TestClusterBoundsEtcd: a user's publish past the entries or the
// directories it may hold in etcd fails with EDQUOT naming the bound, the
// uid and the numbers, and leaves nothing: no key in etcd, no name on a
// peer, its segments writable again. Another user and root publish on.
func TestClusterBoundsEtcd(t *testing.T) {
	tc := newTestCluster(t)
	tc.bounds = ClusterBounds{Entries: 10, Dirs: 3}
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	cli := tc.client()
	ab := controlBackend{a}

	ownedTree(t, a, "u1", ownerPeer, 5, 10) // 6 entries
	if _, err := ab.Publish(ownerPeer, "u1"); err != nil {
		t.Fatal(err)
	}
	before := readEtcd(t, cli)
	ownedTree(t, a, "u2", ownerPeer, 5, 10)
	_, err := ab.Publish(ownerPeer, "u2")
	refused(t, "a publish past the user's entries", err, syscall.EDQUOT, "uid 1000", "--cluster-user-entries", "limit of 10", "holds 6 and needs 6 more")
	if after := readEtcd(t, cli); after != before {
		t.Errorf("a refused publish changed etcd: %+v, before %+v", after, before)
	}
	s0 := lookupPath(t, a, "u2/s0").Operations().(*segmentNode)
	if fh, _, errno := s0.Open(callerCtx(ownerPeer.Uid), unix.O_RDWR); errno != 0 {
		t.Errorf("a segment of a refused publish, opened for writing: %v", errno)
	} else {
		fh.(interface {
			Release(context.Context) syscall.Errno
		}).Release(callerCtx(ownerPeer.Uid))
	}

	// Another user, and root, publish on.
	ownedTree(t, a, "o1", otherPeer, 5, 10)
	if _, err := ab.Publish(otherPeer, "o1"); err != nil {
		t.Errorf("another user's publish: %v", err)
	}
	ownedTree(t, a, "r1", rootPeer, 20, 10)
	v, err := ab.Publish(rootPeer, "r1")
	if err != nil {
		t.Fatalf("root's publish: %v", err)
	}
	// Versions are made in the order of their publishes: once r1 is made
	// on node-b, u2 would have been.
	awaitDir(t, b, "r1", v)
	if _, err := os.Lstat(filepath.Join(b.store.Dir, "u2")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused directory on node-b: %v, want none", err)
	}

	// Directories: two more of one entry each fit the entries (8 of 10),
	// not the directories (3).
	for _, d := range []string{"e1", "e2", "e3"} {
		ownedTree(t, a, d, ownerPeer, 0, 0)
	}
	for _, d := range []string{"e1", "e2"} {
		if _, err := ab.Publish(ownerPeer, d); err != nil {
			t.Fatalf("publish %s: %v", d, err)
		}
	}
	_, err = ab.Publish(ownerPeer, "e3")
	refused(t, "a publish past the user's directories", err, syscall.EDQUOT, "uid 1000", "limit of 3 published directories (--cluster-user-dirs)", "holds 3 and needs 1 more")
}

// TestClusterBoundsEtcdBytes: the bytes a user's manifests hold in etcd
// are bounded too (EDQUOT, nothing written); another user and root
// publish on.
func TestClusterBoundsEtcdBytes(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	cli := tc.client()
	ab := controlBackend{a}
	ownedTree(t, a, "u1", ownerPeer, 5, 10)
	if _, err := ab.Publish(ownerPeer, "u1"); err != nil {
		t.Fatal(err)
	}
	before := readEtcd(t, cli)
	bound := &a.cl.bounds.etcd[2].spec
	if !strings.Contains(bound.Name, "--cluster-user-bytes") {
		t.Fatalf("the third etcd bound is %q", bound.Name)
	}
	bound.PerUID = before.bytes * 3 / 2 // room for half of u1 again
	ownedTree(t, a, "u2", ownerPeer, 5, 10)
	_, err := ab.Publish(ownerPeer, "u2")
	refused(t, "a publish past the user's bytes in etcd", err, syscall.EDQUOT, "uid 1000", "--cluster-user-bytes", fmt.Sprint("limit of ", bound.PerUID))
	if after := readEtcd(t, cli); after != before {
		t.Errorf("a refused publish changed etcd: %+v, before %+v", after, before)
	}
	for _, who := range []ctl.Cred{otherPeer, rootPeer} {
		name := fmt.Sprintf("o%d", who.Uid)
		ownedTree(t, a, name, who, 5, 10)
		if _, err := ab.Publish(who, name); err != nil {
			t.Errorf("uid %d's publish: %v", who.Uid, err)
		}
	}
}

// TestClusterRepublishCollects: republishing a directory keeps the
// versions it is told to keep and deletes the older ones' keys with the
// swap, and the contents no version refers to after, so etcd holds as
// much after the tenth republish as after the second; an unpublish
// deletes the rest.
func TestClusterRepublishCollects(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	cli := tc.client()
	ab := controlBackend{a}
	const n = 200
	ownedTree(t, a, "m", ownerPeer, n, 0)
	d := lookupPath(t, a, "m").Operations().(*dirNode)
	var sizes []int64
	var keys []int
	for i := range 10 {
		if i > 0 { // a new version: one segment replaced by one of other bytes
			if i > 1 {
				if errno := d.Unlink(callerCtx(0), fmt.Sprint("new", i-1)); errno != 0 {
					t.Fatal(errno)
				}
				d.RmChild(fmt.Sprint("new", i-1))
			}
			rel := fmt.Sprint("m/new", i)
			writeSeg(t, a, d, rel, []byte(rel))
			os.Lchown(filepath.Join(a.store.Dir, rel), int(ownerPeer.Uid), int(ownerPeer.Gid))
		}
		v, err := ab.Publish(ownerPeer, "m")
		if err != nil {
			t.Fatal(err)
		}
		// The watch makes it here too; the next change waits for it.
		eventually(t, "version "+v+" made on node-a", func() bool {
			return tc.logs.contains(`msg="cluster: version made here" fs=node-a dir=m version=` + v)
		})
		st := readEtcd(t, cli)
		if want := min(i+1, cluster.DefaultKeep); st.versions != want {
			t.Errorf("after publish %d: %d versions in etcd, want %d", i+1, st.versions, want)
		}
		sizes, keys = append(sizes, st.bytes), append(keys, st.keys)
	}
	t.Logf("keys and bytes in etcd after each publish of %d entries: %v, %v", n+1, keys, sizes)
	for i := 3; i < 10; i++ {
		if keys[i] != keys[2] || sizes[i] > sizes[2]+64 {
			t.Errorf("publish %d: %d keys, %d bytes in etcd; the third left %d, %d: old versions or contents are kept", i+1, keys[i], sizes[i], keys[2], sizes[2])
		}
	}
	if err := a.cl.node.Unpublish(context.Background(), "m", 0); err != nil {
		t.Fatal(err)
	}
	if st := readEtcd(t, cli); st != (etcdState{}) {
		t.Errorf("after unpublish etcd holds %+v, want nothing", st)
	}
}

// TestClusterBoundsNode: a version past its publisher's inodes on a node
// is not made there: logged, and shown in user.tensorfs.cluster of its
// directory; another user's and root's are made. What a node made is
// recounted from its backing when it restarts.
func TestClusterBoundsNode(t *testing.T) {
	tc := newTestCluster(t)
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backing := map[string]string{}
	for _, n := range []string{"a", "b"} {
		backing[n] = filepath.Join(top, n)
		os.Mkdir(backing[n], 0o755)
	}
	a := tc.openNode("node-a", backing["a"])
	a.fsys.allowOther = true // users publish through the socket
	tc.bounds = ClusterBounds{NodeInodes: 10}
	b := tc.openNode("node-b", backing["b"])
	ab := controlBackend{a.fsys}

	ownedTree(t, a.fsys, "z1", ownerPeer, 5, 10) // 6 inodes
	v1, err := ab.Publish(ownerPeer, "z1")
	if err != nil {
		t.Fatal(err)
	}
	awaitDir(t, b.fsys, "z1", v1)

	// While node-b is down, uid 1000 publishes u2, which node-a's bounds
	// let through. node-b restarts, finds z1's 6 inodes charged to uid
	// 1000 in its backing, and refuses u2, though the namespace sends u2
	// first.
	b.stop()
	ownedTree(t, a.fsys, "u2", ownerPeer, 5, 10)
	v2, err := ab.Publish(ownerPeer, "u2")
	if err != nil {
		t.Fatalf("publish within node-a's bounds: %v", err)
	}
	b = tc.openNode("node-b", backing["b"])
	eventually(t, "u2 refused on node-b", func() bool {
		rec, _ := alloc.ReadPublished(filepath.Join(b.fsys.store.Dir, "u2"))
		return strings.Contains(string(rec), "refused")
	})
	var st struct {
		Version string          `json:"version"`
		Refused *refusedVersion `json:"refused"`
	}
	v, errno := dirAttr(t, b.fsys, "u2", alloc.AttrCluster)
	if errno != 0 || json.Unmarshal(v, &st) != nil || st.Refused == nil {
		t.Fatalf("user.tensorfs.cluster of the refused directory: %q, %v", v, errno)
	}
	if st.Version != "" || st.Refused.Version != v2 || st.Refused.UID != ownerPeer.Uid ||
		!strings.Contains(st.Refused.Reason, "uid 1000 reached the limit of 10 inodes") || !strings.Contains(st.Refused.Reason, "--cluster-node-inodes") ||
		!strings.Contains(st.Refused.Reason, "holds 6 and needs 6 more") {
		t.Errorf("user.tensorfs.cluster of the refused directory: %+v", st)
	}
	names, _ := os.ReadDir(filepath.Join(b.fsys.store.Dir, "u2"))
	if len(names) != 0 {
		t.Errorf("the refused version made %d names on node-b", len(names))
	}
	if !tc.logs.contains("past its publisher's bounds on this node is not made") {
		t.Error("the refusal is not logged")
	}

	// Another user's and root's versions are made.
	ownedTree(t, a.fsys, "o1", otherPeer, 5, 10)
	ownedTree(t, a.fsys, "r1", rootPeer, 20, 10)
	for _, p := range []struct {
		who ctl.Cred
		dir string
	}{{otherPeer, "o1"}, {rootPeer, "r1"}} {
		v, err := ab.Publish(p.who, p.dir)
		if err != nil {
			t.Fatal(err)
		}
		awaitDir(t, b.fsys, p.dir, v)
	}
	awaitDir(t, b.fsys, "z1", v1)
	if got := b.fsys.cl.bounds.inodes.Held(ownerPeer.Uid); got != 6 {
		t.Errorf("node-b charges uid 1000 %d inodes, want 6", got)
	}
}

// TestClusterBoundsNodeBytes: a version whose bytes pass its publisher's
// share on a node is not made there; another user's within hers is, and
// root's whatever its size (its pulls are bounded by the backing's
// capacity).
func TestClusterBoundsNodeBytes(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	tc.bounds = ClusterBounds{NodeBytes: 100}
	b := tc.node("node-b", nil)
	ab := controlBackend{a}
	ownedTree(t, a, "u1", ownerPeer, 2, 60)
	if _, err := ab.Publish(ownerPeer, "u1"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "u1 refused on node-b", func() bool {
		rec, _ := alloc.ReadPublished(filepath.Join(b.store.Dir, "u1"))
		return strings.Contains(string(rec), "refused") && strings.Contains(string(rec), "--cluster-node-bytes")
	})
	for _, c := range []struct {
		name string
		who  ctl.Cred
		size int
	}{{"o1", otherPeer, 30}, {"r1", rootPeer, 60}} {
		ownedTree(t, a, c.name, c.who, 2, c.size)
		v, err := ab.Publish(c.who, c.name)
		if err != nil {
			t.Fatal(err)
		}
		awaitDir(t, b, c.name, v)
	}
	if names, _ := os.ReadDir(filepath.Join(b.store.Dir, "u1")); len(names) != 0 {
		t.Errorf("the refused version made %d names on node-b", len(names))
	}
}
