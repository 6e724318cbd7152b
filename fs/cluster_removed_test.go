package fs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
	"tensorfs/internal/tmpfstest"
)

// rmTree removes rel (below the root) and everything below it through
// the handlers, as rm -r does: names first, then each directory.
func rmTree(t *testing.T, fsys *filesystem, rel string) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(fsys.store.Dir, rel))
	if err != nil {
		t.Fatal(err)
	}
	d := lookupPath(t, fsys, rel).Operations().(*dirNode)
	for _, e := range ents {
		if e.IsDir() {
			rmTree(t, fsys, rel+"/"+e.Name())
		} else if errno := d.Unlink(callerCtx(0), e.Name()); errno != 0 {
			t.Fatalf("unlink %s/%s: %v", rel, e.Name(), errno)
		}
	}
	parent := &fsys.root.dirNode
	if i := strings.LastIndexByte(rel, '/'); i >= 0 {
		parent = lookupPath(t, fsys, rel[:i]).Operations().(*dirNode)
	}
	if errno := parent.Rmdir(callerCtx(0), filepath.Base(rel)); errno != 0 {
		t.Fatalf("rmdir %s: %v", rel, errno)
	}
}

// removedHereOf returns node fsys's removed-here records and its charge
// for models/m.
func removedHereOf(fsys *filesystem) (map[string]removedRecord, charge) {
	c := fsys.cl
	c.nsMu.Lock()
	defer c.nsMu.Unlock()
	out := map[string]removedRecord{}
	for k, v := range c.removed {
		out[k] = v
	}
	return out, c.charges["models/m"]
}

// exists reports whether models/m is in fsys's backing.
func exists(fsys *filesystem) bool {
	_, err := os.Lstat(filepath.Join(fsys.store.Dir, "models", "m"))
	return err == nil
}

// TestClusterRemovedHere: rm -r of a published directory on one node
// frees what it held there at once (its contents are served no more) and
// records the removal in the backing, charged as one inode: the version
// is not made there again after a restart; a new version is, and clears
// the record. The publisher keeps serving it to other nodes.
func TestClusterRemovedHere(t *testing.T) {
	tc := newTestCluster(t)
	top := tmpfstest.Dir(t)
	a := tc.openNode("node-a", mkBacking(t, top, "a"))
	bDir := mkBacking(t, top, "b")
	b := tc.openNode("node-b", bDir)
	makeModel(t, a.fsys)
	v1 := publishModel(t, a.fsys)
	awaitVersion(t, b.fsys, v1)
	if _, err := (controlBackend{b.fsys}).Pull(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	if len(b.fsys.pulled.served()) == 0 {
		t.Fatal("the pulling node serves nothing")
	}

	rmTree(t, b.fsys, "models/m")
	eventually(t, "the removal recorded", func() bool {
		rm, _ := removedHereOf(b.fsys)
		return rm["models/m"].Version == v1
	})
	if _, ch := removedHereOf(b.fsys); ch != newCharge("models/m", 0, 1, 0) {
		t.Errorf("the removed directory is charged %+v, want one inode", ch)
	}
	if served := b.fsys.pulled.served(); len(served) != 0 {
		t.Errorf("after rm -r the node still serves %v", served)
	}
	recs, err := alloc.ReadRemoved(b.fsys.store.Dir)
	if err != nil || len(recs) != 1 {
		t.Fatalf("records in the backing: %q, %v", recs, err)
	}

	b.stop()
	b = tc.openNode("node-b", bDir)
	eventually(t, "the removed version skipped", func() bool {
		return tc.logs.contains("a version removed here is not made again")
	})
	if exists(b.fsys) {
		t.Fatal("a directory removed here came back at the next mount")
	}
	if rm, ch := removedHereOf(b.fsys); rm["models/m"].Version != v1 || ch != newCharge("models/m", 0, 1, 0) {
		t.Errorf("after a restart: records %+v, charge %+v", rm, ch)
	}
	if _, err := (controlBackend{b.fsys}).Pull(rootPeer, "models/m"); !errors.Is(err, syscall.ENOENT) || !strings.Contains(err.Error(), "removed on this node") {
		t.Errorf("pull of a directory removed here: %v, want ENOENT saying why", err)
	}
	if exists(b.fsys) {
		t.Fatal("a pull made a directory removed here again")
	}

	m := lookupPath(t, a.fsys, "models/m").Operations().(*dirNode)
	writeSeg(t, a.fsys, m, "models/m/extra", randomBytes(t, 4096))
	v2 := publishModel(t, a.fsys)
	awaitVersion(t, b.fsys, v2)
	if rm, _ := removedHereOf(b.fsys); len(rm) != 0 {
		t.Errorf("a new version left the records %+v", rm)
	}
	if recs, err := alloc.ReadRemoved(b.fsys.store.Dir); err != nil || len(recs) != 0 {
		t.Errorf("a new version left records in the backing: %q, %v", recs, err)
	}
}

// mkBacking makes the backing directory name below top (a private
// directory).
func mkBacking(t *testing.T, top, name string) string {
	t.Helper()
	os.Chmod(top, 0o700)
	p := filepath.Join(top, name)
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestClusterUnpublish: only the publisher's uid or root may unpublish
// (EPERM naming the publisher's uid); once unpublished, the directory
// leaves every node, the publisher's included, and each gives back what
// it charged and served; a node that was down meanwhile removes it when
// it joins again; a local segment a user made inside is left alone.
func TestClusterUnpublish(t *testing.T) {
	tc := newTestCluster(t)
	top := tmpfstest.Dir(t)
	a := tc.openNode("node-a", mkBacking(t, top, "a"))
	b := tc.openNode("node-b", mkBacking(t, top, "b"))
	cDir := mkBacking(t, top, "c")
	c := tc.openNode("node-c", cDir)
	makeModel(t, a.fsys)
	v := publishModel(t, a.fsys)
	for _, n := range []restartable{b, c} {
		awaitVersion(t, n.fsys, v)
		if _, err := (controlBackend{n.fsys}).Pull(rootPeer, "models/m"); err != nil {
			t.Fatal(err)
		}
	}
	// A local segment in a directory of the version on b: left alone.
	layers := lookupPath(t, b.fsys, "models/m/layers").Operations().(*dirNode)
	writeSeg(t, b.fsys, layers, "models/m/layers/mine", []byte("local"))
	c.stop()

	err := (controlBackend{b.fsys}).Unpublish(ctl.Cred{Uid: 1000, Gid: 1000}, "models/m")
	if !errors.Is(err, cluster.ErrNotPublisher) || !strings.Contains(err.Error(), "uid 0") {
		t.Fatalf("unpublish by uid 1000: %v, want ErrNotPublisher naming uid 0", err)
	}
	if !exists(a.fsys) || !exists(b.fsys) {
		t.Fatal("a refused unpublish removed something")
	}
	if err := (controlBackend{b.fsys}).Unpublish(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.fsys.cl.node.Lookup(context.Background(), "models/m"); !errors.Is(err, cluster.ErrNotPublished) {
		t.Errorf("lookup after unpublish: %v", err)
	}
	if got, err := os.ReadFile(filepath.Join(b.fsys.store.Dir, "models/m/layers/mine")); err != nil || string(got) != "local" {
		t.Errorf("the local segment: %q, %v", got, err)
	}
	if _, err := os.Lstat(modelPath(b.fsys, "config.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a pulled segment stays after unpublish: %v", err)
	}
	eventually(t, "the publisher withdraws it", func() bool { return !exists(a.fsys) })
	for name, n := range map[string]restartable{"publisher": a, "puller": b} {
		if served := n.fsys.pulled.served(); len(served) != 0 {
			t.Errorf("the %s still serves %v", name, served)
		}
		if _, ch := removedHereOf(n.fsys); ch != (charge{}) {
			t.Errorf("the %s still charges %+v", name, ch)
		}
	}

	c = tc.openNode("node-c", cDir)
	eventually(t, "the node that was down withdraws it", func() bool { return !exists(c.fsys) })
	if _, ch := removedHereOf(c.fsys); ch != (charge{}) {
		t.Errorf("the node that was down still charges %+v", ch)
	}
}

// TestClusterUnpublishMissedByPublisher: a publisher that was down when
// its directory was unpublished finds it missing from etcd when it
// joins again, and keeps it, logged (etcd may have lost it, and it may
// be the only copy); a node that pulled it removes it.
func TestClusterUnpublishMissedByPublisher(t *testing.T) {
	tc := newTestCluster(t)
	top := tmpfstest.Dir(t)
	aDir, bDir := mkBacking(t, top, "a"), mkBacking(t, top, "b")
	a, b := tc.openNode("node-a", aDir), tc.openNode("node-b", bDir)
	files := makeModel(t, a.fsys)
	v := publishModel(t, a.fsys)
	awaitVersion(t, b.fsys, v)
	a.stop()
	b.stop()
	c := tc.node("node-c", nil)
	if err := (controlBackend{c}).Unpublish(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	a, b = tc.openNode("node-a", aDir), tc.openNode("node-b", bDir)
	eventually(t, "the puller removes it", func() bool { return !exists(b.fsys) })
	eventually(t, "the publisher says why it keeps it", func() bool {
		return tc.logs.contains("a directory published from this node is missing from the cluster's namespace")
	})
	for p, data := range files {
		if got, err := os.ReadFile(modelPath(a.fsys, p)); err != nil || string(got) != string(data) {
			t.Errorf("the publisher's %s: %d bytes, %v", p, len(got), err)
		}
	}
}
