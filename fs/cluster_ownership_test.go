package fs

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/ctl"
)

// The cluster never takes what it did not publish (issue 24, K3): a
// published version materialises on a node only at names that are free
// or the cluster's own.

var (
	alice = ctl.Cred{Pid: int32(os.Getpid()), Uid: 1000, Gid: 1000}
	bob   = ctl.Cred{Pid: int32(os.Getpid()), Uid: 1001, Gid: 1001}
)

// localDir makes the directory rel in fsys's backing, as its owner would
// through the mount: owned by who, with mode and the attribute
// user.mine, and returns its backing path.
func localDir(t *testing.T, fsys *filesystem, rel string, who ctl.Cred, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(fsys.store.Dir, rel)
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, int(who.Uid), int(who.Gid)); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(p, "user.mine", []byte(rel), 0); err != nil {
		t.Fatal(err)
	}
	return p
}

// localFile writes a segment of who at rel in fsys's backing.
func localFile(t *testing.T, fsys *filesystem, rel string, who ctl.Cred, data []byte) {
	t.Helper()
	p := filepath.Join(fsys.store.Dir, rel)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, int(who.Uid), int(who.Gid)); err != nil {
		t.Fatal(err)
	}
}

// snapshot is what a local object is: owner, mode, attribute, and the
// names in it (a directory) or its bytes (a file).
type snapshot struct {
	uid, mode uint32
	attr      string
	names     []string
	data      string
}

func snap(t *testing.T, p string) snapshot {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	s := snapshot{uid: st.Uid, mode: st.Mode}
	if v, ok, err := alloc.GetXattr(p, "user.mine"); err == nil && ok {
		s.attr = string(v)
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		ents, err := os.ReadDir(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			s.names = append(s.names, e.Name())
		}
	} else {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		s.data = string(b)
	}
	return s
}

// conflictsFor reads user.tensorfs.cluster of dir on fsys as who and
// returns its conflicts.
func conflictsFor(t *testing.T, fsys *filesystem, dir string, who ctl.Cred) []string {
	t.Helper()
	d := lookupPath(t, fsys, dir).Operations().(*dirNode)
	v, err := fsys.clusterAttr(who, d)
	if err != nil {
		t.Fatalf("user.tensorfs.cluster of %s: %v", dir, err)
	}
	var out struct{ Conflicts []string }
	if err := json.Unmarshal(v, &out); err != nil {
		t.Fatal(err)
	}
	return out.Conflicts
}

// TestClusterLeavesLocalObjects reproduces K3 on two nodes: on node-a
// alice publishes directories whose paths, on node-b, hold bob's private
// directories (the published directory itself, and an intermediate one
// of its path), root's directory, and, in a version of a directory
// node-b made, bob's local segment and subdirectory. node-b changes
// none of them (owner, mode, attributes, names, bytes), logs each, and
// lists each in user.tensorfs.cluster's conflicts, to those who may see
// it; the names that are free are made as published, in a local
// directory only if the published directory's owner may write it.
func TestClusterLeavesLocalObjects(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	publish := func(dir string) string {
		t.Helper()
		v, err := controlBackend{a}.Publish(alice, dir)
		if err != nil {
			t.Fatalf("publish %s: %v", dir, err)
		}
		return v
	}
	made := func(fsys *filesystem, dir, v string) {
		t.Helper()
		eventually(t, dir+" "+v+" made on node-b", func() bool {
			fsys.cl.mu.Lock()
			defer fsys.cl.mu.Unlock()
			m := fsys.cl.made[dir]
			return m != nil && m.ID == v || fsys.cl.conflicts[dir].Version == v
		})
	}

	// The leaf: scratch/work is alice's, 0777, on node-a; bob's, 0700, on
	// node-b. An intermediate: priv is bob's 0700 directory on node-b.
	// Root's own: rootdir.
	localDir(t, a, "scratch", ctl.Cred{}, 0o755)
	localDir(t, b, "scratch", ctl.Cred{}, 0o755)
	localDir(t, a, "scratch/work", alice, 0o777)
	localFile(t, a, "scratch/work/w", alice, []byte("alice's weights"))
	bobWork := localDir(t, b, "scratch/work", bob, 0o700)
	localFile(t, b, "scratch/work/w", bob, []byte("bob's weights"))
	localDir(t, a, "priv/x", alice, 0o777)
	localFile(t, a, "priv/x/w", alice, []byte("alice's"))
	bobPriv := localDir(t, b, "priv", bob, 0o700)
	localDir(t, a, "rootdir", alice, 0o777)
	rootDir := localDir(t, b, "rootdir", ctl.Cred{}, 0o755)
	before := map[string]snapshot{}
	for _, p := range []string{bobWork, bobWork + "/w", bobPriv, rootDir} {
		before[p] = snap(t, p)
	}
	for _, dir := range []string{"scratch/work", "priv/x", "rootdir"} {
		made(b, dir, publish(dir))
	}
	for _, want := range []struct{ dir, conflict string }{{"scratch/work", "scratch/work"}, {"priv/x", "priv"}, {"rootdir", "rootdir"}} {
		b.cl.mu.Lock()
		got := b.cl.conflicts[want.dir].paths
		b.cl.mu.Unlock()
		if !slices.Equal(got, []string{want.conflict}) {
			t.Errorf("%s on node-b: conflicts %q, want %q", want.dir, got, want.conflict)
		}
	}
	if got := conflictsFor(t, b, "scratch/work", bob); !slices.Equal(got, []string{"scratch/work"}) {
		t.Errorf("user.tensorfs.cluster of bob's scratch/work, for bob: conflicts %q", got)
	}

	// A local directory that alice may write, as /tmp: her published
	// directory is made in it, hers; one in root's 0755 directory is not.
	localDir(t, a, "tmp/a/work", alice, 0o777)
	localFile(t, a, "tmp/a/work/w", alice, []byte("alice's"))
	localDir(t, b, "tmp", ctl.Cred{}, 0o777|os.ModeSticky)
	made(b, "tmp/a/work", publish("tmp/a/work"))
	if got := snap(t, filepath.Join(b.store.Dir, "tmp/a/work")); got.uid != alice.Uid || got.mode&07777 != 0o777 {
		t.Errorf("tmp/a/work on node-b: uid %d mode %o, want alice's 0777", got.uid, got.mode&07777)
	}
	localDir(t, a, "root755/work", alice, 0o777)
	localDir(t, b, "root755", ctl.Cred{}, 0o755)
	made(b, "root755/work", publish("root755/work"))
	if _, err := os.Lstat(filepath.Join(b.store.Dir, "root755/work")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a published directory made in root's 0755 local directory: %v", err)
	}

	// A directory node-b makes, 0777: bob makes a segment and a private
	// directory in it there; the next version has both names.
	localDir(t, a, "shared", alice, 0o777)
	localFile(t, a, "shared/f", alice, []byte("v1"))
	made(b, "shared", publish("shared"))
	if c := conflictsFor(t, b, "shared", alice); c != nil {
		t.Errorf("a version made at free names: conflicts %q", c)
	}
	if got := snap(t, filepath.Join(b.store.Dir, "shared")); got.uid != alice.Uid || got.mode&07777 != 0o777 {
		t.Errorf("shared made on node-b: uid %d mode %o, want alice's 0777", got.uid, got.mode&07777)
	}
	localFile(t, b, "shared/w", bob, []byte("bob's"))
	bobSub := localDir(t, b, "shared/sub", bob, 0o700)
	before[bobSub] = snap(t, bobSub)
	before[filepath.Join(b.store.Dir, "shared/w")] = snap(t, filepath.Join(b.store.Dir, "shared/w"))
	localFile(t, a, "shared/w", alice, []byte("alice's w"))
	localDir(t, a, "shared/sub", alice, 0o777)
	localFile(t, a, "shared/sub/g", alice, []byte("alice's g"))
	made(b, "shared", publish("shared"))
	want := []string{"shared/sub", "shared/w"}
	if got := conflictsFor(t, b, "shared", ctl.Cred{}); !slices.Equal(got, want) {
		t.Errorf("shared on node-b, for root: conflicts %q, want %q", got, want)
	}
	if got := conflictsFor(t, b, "shared", alice); !slices.Equal(got, want) {
		t.Errorf("shared on node-b, for alice (who may search shared): conflicts %q, want %q", got, want)
	}

	for p, s := range before {
		if got := snap(t, p); !equalSnap(got, s) {
			t.Errorf("%s on node-b changed: %+v, was %+v", p, got, s)
		}
	}
	if !tc.logs.contains("a published name is left alone") {
		t.Error("no log line for the names left alone")
	}
	// The published directory's own names are made where they are free.
	if _, err := os.Stat(filepath.Join(b.store.Dir, "shared/f")); err != nil {
		t.Errorf("shared/f on node-b: %v", err)
	}
}

func equalSnap(a, b snapshot) bool {
	return a.uid == b.uid && a.mode == b.mode && a.attr == b.attr && a.data == b.data && slices.Equal(a.names, b.names)
}

// TestClusterFreezeRefusesWriters reproduces K4's first half: a process
// that maps a segment's bytes writable after closing its descriptor, and
// a descriptor export handed out for writing, keep a publish of it from
// freezing it (EBUSY, naming the process that maps it); once unmapped and
// closed, the publish freezes it and nothing may write it again.
func TestClusterFreezeRefusesWriters(t *testing.T) {
	tc := newTestCluster(t)
	a := tc.node("node-a", nil)
	d := mkdir(t, &a.root.dirNode, "k4")
	seg := mkseg(t, d, "w")
	if errno := seg.Setxattr(callerCtx(0), alloc.AttrFlags, []byte("KEEPFD"), 0); errno != 0 {
		t.Fatal(errno)
	}
	backing := filepath.Join(a.store.Dir, "k4/w")
	if err := os.WriteFile(backing, randomBytes(t, 4096), 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(backing, 0o666); err != nil {
		t.Fatal(err)
	}
	publish := func() error {
		_, err := controlBackend{a}.Publish(rootPeer, "k4")
		return err
	}

	m := startMapper(t, backing)
	err := publish()
	if toErrno(err) != syscall.EBUSY || !strings.Contains(err.Error(), fmt.Sprintf("pid %d (", m.cmd.Process.Pid)) || !strings.Contains(err.Error(), "maps it writable") {
		t.Fatalf("publish of a segment a process maps writable: %v, want EBUSY naming pid %d", err, m.cmd.Process.Pid)
	}
	m.unmap(t)

	f, err := controlBackend{a}.Export(ownerPeer, "k4/w", true)
	if err != nil {
		t.Fatalf("export for writing: %v", err)
	}
	if err := publish(); toErrno(err) != syscall.EBUSY {
		t.Fatalf("publish of a segment export handed out for writing: %v, want EBUSY", err)
	}
	// Refused, the segment is a host one again: writable.
	if fh, _, errno := seg.Open(callerCtx(0), unix.O_RDWR); errno != 0 {
		t.Errorf("after a refused publish, open for writing: %v", errno)
	} else {
		fh.(fusefs.FileReleaser).Release(callerCtx(0))
	}
	f.Close()

	if err := publish(); err != nil {
		t.Fatalf("publish once unmapped and closed: %v", err)
	}
	if _, err := (controlBackend{a}).Export(ownerPeer, "k4/w", true); toErrno(err) != syscall.EPERM {
		t.Errorf("export for writing of a published segment: %v, want EPERM", err)
	}
	if _, _, errno := lookupPath(t, a, "k4/w").Operations().(*segmentNode).Open(callerCtx(0), unix.O_RDWR); errno != syscall.EPERM {
		t.Errorf("open for writing of a published segment: %v, want EPERM", errno)
	}
}

// corrupt writes MALLORY-WAS-HERE into each piece of the backing file p,
// as root may through the backing.
func corrupt(t *testing.T, p string, size int) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for off := 100; off < size; off += 64 << 10 {
		if _, err := f.WriteAt([]byte("MALLORY-WAS-HERE"), int64(off)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestClusterLocalCorruptionNotServed reproduces K4's second half: bytes
// of a published segment changed under a node (root writing its backing
// file) are found by their hashes. The publisher serves none of them;
// a puller gets the published bytes from the other holder; and a node
// whose complete copy was changed does not copy it into another segment
// of that content, but pulls it from its peers.
func TestClusterLocalCorruptionNotServed(t *testing.T) {
	tc := newTestCluster(t)
	both := func(cfg *cluster.Config) { cfg.Parallel, cfg.PerPeer = 2, 1 } // every holder asked from the start
	a, b, c := tc.node("node-a", nil), tc.node("node-b", both), tc.node("node-c", nil)
	data := randomBytes(t, 300<<10)
	writeSeg(t, a, mkdir(t, &a.root.dirNode, "k4"), "k4/w", data)
	v, err := controlBackend{a}.Publish(rootPeer, "k4")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []*filesystem{b, c} {
		eventually(t, "k4 made", func() bool {
			rec, err := alloc.ReadPublished(filepath.Join(n.store.Dir, "k4"))
			return err == nil && strings.Contains(string(rec), v)
		})
	}
	if _, err := (controlBackend{c}).Pull(rootPeer, "k4"); err != nil {
		t.Fatal(err)
	}
	cid := c.pulled.get(inode(t, filepath.Join(c.store.Dir, "k4/w"))).content()
	waitHolders(t, tc, cid, "node-a", "node-c")

	served := a.clusterStats()["pieces_served"].(int64)
	corrupt(t, filepath.Join(a.store.Dir, "k4/w"), len(data))
	if _, err := (controlBackend{b}).Pull(rootPeer, "k4"); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(b.store.Dir, "k4/w")); !bytes.Equal(got, data) {
		t.Fatal("node-b's pulled segment does not hold the published bytes")
	}
	if st := b.clusterStats(); st["bad_pieces"].(int64) != 0 {
		t.Errorf("node-b received bad pieces: %v", st)
	}
	if st := a.clusterStats(); st["bad_pieces"].(int64) == 0 || st["pieces_served"].(int64) != served {
		t.Errorf("node-a's stats %v: want the pieces asked of it found bad, none served", st)
	}

	// node-c's complete copy is changed; a segment of the same content
	// published elsewhere is pulled from node-b, not copied from it.
	corrupt(t, filepath.Join(c.store.Dir, "k4/w"), len(data))
	writeSeg(t, b, mkdir(t, &b.root.dirNode, "dup"), "dup/w", data)
	v2, err := controlBackend{b}.Publish(rootPeer, "dup")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "dup made on node-c", func() bool {
		rec, err := alloc.ReadPublished(filepath.Join(c.store.Dir, "dup"))
		return err == nil && strings.Contains(string(rec), v2)
	})
	if got := readAll(t, lookupPath(t, c, "dup/w").Operations().(*segmentNode)); !bytes.Equal(got, data) {
		t.Fatal("node-c's copy of a content it held does not hold the published bytes")
	}
	if !tc.logs.contains("a copy held here fails verification") {
		t.Error("node-c did not log the copy that failed verification")
	}
}
