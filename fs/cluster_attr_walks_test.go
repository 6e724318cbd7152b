package fs

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"tensorfs/ctl"
)

// TestClusterAttrOneAtATime: user.tensorfs.cluster of a published
// directory walks its whole subtree, as rbytes does, so a uid's reads of
// it run one at a time with her other whole-subtree walks (usageWalks):
// any user who could look a published directory up read it from as many
// threads as she liked, each walking whatever its owner had put in it,
// beside the others. Another uid's read is served meanwhile.
func TestClusterAttrOneAtATime(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	makeModel(t, a)
	publishModel(t, a)
	d := lookupPath(t, a, "models/m").Operations().(*dirNode)
	read := func(uid uint32) <-chan error {
		done := make(chan error, 1)
		go func() {
			_, err := a.clusterAttr(ctl.Cred{Uid: uid, Gid: uid}, d)
			done <- err
		}()
		return done
	}
	unlock := a.usageWalks.lock(1000) // uid 1000's walk in progress
	second := read(1000)
	select {
	case err := <-read(1001):
		if err != nil {
			t.Fatalf("uid 1001's user.tensorfs.cluster: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("uid 1001 waited for uid 1000's walk")
	}
	select {
	case <-second:
		t.Fatal("uid 1000's user.tensorfs.cluster walked beside her other walk")
	case <-time.After(50 * time.Millisecond):
	}
	unlock()
	select {
	case err := <-second:
		if err != nil {
			t.Fatalf("uid 1000's user.tensorfs.cluster: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("uid 1000's user.tensorfs.cluster did not run after her walk")
	}
}

// TestClusterAttrCountsListable: user.tensorfs.cluster counts the
// segments of the directories its reader may list, as rbytes does (du
// would): it counted those of a subdirectory closed to her too.
func TestClusterAttrCountsListable(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	makeModel(t, a)
	if err := os.Chmod(filepath.Join(a.store.Dir, "models", "m", "layers"), 0o700); err != nil { // root's
		t.Fatal(err)
	}
	publishModel(t, a)
	d := lookupPath(t, a, "models/m").Operations().(*dirNode)
	for _, c := range []struct {
		who  ctl.Cred
		want int64
	}{{ctl.Cred{Uid: 1001, Gid: 1001}, 2}, {rootPeer, 4}} {
		v, err := a.clusterAttr(c.who, d)
		var st clusterState
		if err == nil {
			err = json.Unmarshal(v, &st)
		}
		if err != nil || st.Segments != c.want {
			t.Errorf("uid %d's user.tensorfs.cluster: %s %v; want %d segments", c.who.Uid, v, err, c.want)
		}
	}
}

// TestClusterPullWalkOneAtATime: a pull walks the directory it is asked
// for, any its asker may read, her own local ones too: it walked holding
// nsMu, so that every publish, version made and unpublish of the node
// waited for one user's walk (and for each she queued from her
// connections); and her pulls walked beside each other. Now a uid's pull
// walks one at a time with her other walks (usageWalks), and no walk
// holds nsMu.
func TestClusterPullWalkOneAtATime(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	makeModel(t, a)
	v := publishModel(t, a)
	awaitVersion(t, b, v)
	unlock := b.usageWalks.lock(1000) // uid 1000's walk in progress
	pulled := make(chan error, 1)
	go func() {
		_, err := controlBackend{b}.Pull(ctl.Cred{Uid: 1000, Gid: 1000}, "models/m")
		pulled <- err
	}()
	select {
	case err := <-pulled:
		t.Fatalf("uid 1000's pull walked beside her other walk: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if !b.cl.nsMu.TryLock() {
		t.Fatal("a pull waiting for its walk holds nsMu: the node's publishes and versions wait for it")
	}
	b.cl.nsMu.Unlock()
	unlock()
	select {
	case err := <-pulled:
		if err != nil {
			t.Fatalf("uid 1000's pull: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("uid 1000's pull did not run after her walk")
	}
}
