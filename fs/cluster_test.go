package fs

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/cluster"
	"tensorfs/cluster/transport"
	"tensorfs/internal/etcdtest"
	"tensorfs/internal/testcerts"
	"tensorfs/internal/tmpfstest"
)

// The mount's side of a cluster (cluster.go, cluster_publish.go,
// cluster_pull.go, storage_pulled.go), on filesystems made as testFS
// makes them, each joined to one etcd as Mount joins it
// (joinCluster, then start), their piece servers on 127.0.0.1.

// testCluster is an etcd (internal/etcdtest) and the CA of a cluster's
// certificates.
type testCluster struct {
	t    *testing.T
	etcd *etcdtest.Server
	ca   *testcerts.CA
	logs *logLines
	// bounds are the cluster bounds of the nodes it starts from now on.
	bounds ClusterBounds
}

// newTestCluster starts etcd with a fresh CA; it stops at the end of t,
// after the nodes have left.
func newTestCluster(t *testing.T) *testCluster {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("published segments keep their owners: cluster tests need root")
	}
	e, ca, err := etcdtest.StartWithCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Stop)
	return &testCluster{t: t, etcd: e, ca: ca, logs: &logLines{t: t}}
}

// config is node name's configuration: small pieces, short timeouts.
func (tc *testCluster) config(name string) cluster.Config {
	f, err := tc.ca.Issue(name, net.IPv4(127, 0, 0, 1))
	if err != nil {
		tc.t.Fatal(err)
	}
	creds, err := transport.LoadCredentials(f.CA, f.Cert, f.Key)
	if err != nil {
		tc.t.Fatal(err)
	}
	return cluster.Config{
		Endpoints:    []string{tc.etcd.ClientURL},
		Node:         name,
		Listen:       "127.0.0.1:0",
		Credentials:  creds,
		LeaseTTL:     2 * time.Second,
		Timeout:      2 * time.Second,
		PieceSize:    64 << 10,
		NoHolderWait: 2 * time.Second,
		Log:          slog.New(slog.NewTextHandler(tc.logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", name),
	}
}

// node makes a filesystem that joined the cluster as name (edit, if
// set, changes its configuration first), shared with other users, and
// started as Mount starts it once the kernel serves the mount. It leaves
// the cluster at the end of t.
func (tc *testCluster) node(name string, edit func(*cluster.Config)) *filesystem {
	tc.t.Helper()
	fsys := testFS(tc.t)
	fsys.allowOther = true
	fsys.log = slog.New(slog.NewTextHandler(tc.logs, nil)).With("fs", name)
	cfg := tc.config(name)
	if edit != nil {
		edit(&cfg)
	}
	if err := fsys.joinCluster(cfg, tc.bounds); err != nil {
		tc.t.Fatal(err)
	}
	tc.t.Cleanup(fsys.cl.close)
	fsys.cl.start()
	return fsys
}

// logLines collects the nodes' logs and passes them to the test log.
type logLines struct {
	t  *testing.T
	mu sync.Mutex
	b  strings.Builder
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Write(p)
	l.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func (l *logLines) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Contains(l.b.String(), s)
}

// randomBytes returns n random bytes.
func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// modelFiles are the segments of the model makeModel makes, by path below
// models/m.
type modelFiles map[string][]byte

// makeModel makes models/m on fsys through the handlers: a directory
// with an attribute, a subdirectory, segments of a few pieces (one with
// tensor and user attributes, one of another owner), a small one and an
// empty one, their bytes written on the backing.
func makeModel(t *testing.T, fsys *filesystem) modelFiles {
	t.Helper()
	root := &fsys.root.dirNode
	m := mkdir(t, mkdir(t, root, "models"), "m")
	layers := mkdir(t, m, "layers")
	files := modelFiles{
		"config.json":     []byte(`{"layers": 2}`),
		"empty":           nil,
		"layers/0.weight": randomBytes(t, 300<<10+17),
		"layers/1.weight": randomBytes(t, 128<<10),
	}
	segs := map[string]*segmentNode{}
	for p := range files {
		d, name := m, p
		if rest, ok := strings.CutPrefix(p, "layers/"); ok {
			d, name = layers, rest
		}
		segs[p] = mkseg(t, d, name)
		if err := os.WriteFile(modelPath(fsys, p), files[p], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	set := func(n interface {
		Setxattr(context.Context, string, []byte, uint32) syscall.Errno
	}, attr, v string) {
		t.Helper()
		if errno := n.Setxattr(callerCtx(0), attr, []byte(v), 0); errno != 0 {
			t.Fatalf("setxattr %s: %v", attr, errno)
		}
	}
	set(m, "user.origin", "test")
	set(segs["layers/1.weight"], alloc.AttrDtype, "float32")
	set(segs["layers/1.weight"], alloc.AttrShape, "[256, 128]")
	set(segs["layers/1.weight"], "user.note", "\x00\x01\x02")
	if err := os.Chown(modelPath(fsys, "layers/0.weight"), 1000, 1000); err != nil {
		t.Fatal(err)
	}
	return files
}

// modelPath is the backing path of p below models/m.
func modelPath(fsys *filesystem, p string) string {
	return filepath.Join(fsys.store.Dir, "models", "m", p)
}

// publishModel publishes models/m of fsys as root and returns the version.
func publishModel(t *testing.T, fsys *filesystem) string {
	t.Helper()
	v, err := controlBackend{fsys}.Publish(rootPeer, "models/m")
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	return v
}

// awaitVersion waits until fsys has made version v of models/m.
func awaitVersion(t *testing.T, fsys *filesystem, v string) {
	t.Helper()
	eventually(t, "version "+v+" made", func() bool {
		rec, err := alloc.ReadPublished(filepath.Join(fsys.store.Dir, "models", "m"))
		return err == nil && strings.Contains(string(rec), v)
	})
}

// sameObject fails unless the backing objects at p on a and b have the
// same owner, mode, modification time and user attributes (tensorfs's
// own apart), and, if bytes is set, the same bytes.
func sameObject(t *testing.T, a, b *filesystem, p string, bytes bool) {
	t.Helper()
	pa, pb := modelPath(a, p), modelPath(b, p)
	var sa, sb unix.Stat_t
	if err := unix.Lstat(pa, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Lstat(pb, &sb); err != nil {
		t.Fatalf("%s on the second node: %v", p, err)
	}
	if sa.Mode != sb.Mode || sa.Uid != sb.Uid || sa.Gid != sb.Gid || sa.Mtim != sb.Mtim {
		t.Errorf("%s: mode %o uid %d gid %d mtime %v here, %o %d %d %v there", p, sa.Mode, sa.Uid, sa.Gid, sa.Mtim, sb.Mode, sb.Uid, sb.Gid, sb.Mtim)
	}
	if xa, xb := userAttrs(t, pa), userAttrs(t, pb); !maps.EqualFunc(xa, xb, bytesEqual) {
		t.Errorf("%s: attributes %q here, %q there", p, xa, xb)
	}
	if bytes {
		ba, _ := os.ReadFile(pa)
		bb, err := os.ReadFile(pb)
		if err != nil || !bytesEqual(ba, bb) {
			t.Errorf("%s: %d bytes here, %d there (%v), or they differ", p, len(ba), len(bb), err)
		}
	}
}

func bytesEqual(a, b []byte) bool { return bytes.Equal(a, b) }

// userAttrs reads the user.* attributes of p but tensorfs's own.
func userAttrs(t *testing.T, p string) map[string][]byte {
	t.Helper()
	names, err := alloc.Listxattr(p)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, name := range names {
		if strings.HasPrefix(name, "user.tensorfs.") {
			continue
		}
		v, _, err := alloc.GetXattr(p, name)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = v
	}
	return out
}

// child returns the node of name in d: the one the tree has, else one
// looked up through the handlers (as the kernel's lookup adds it).
func child(t *testing.T, d *dirNode, name string) *fusefs.Inode {
	t.Helper()
	if ch := d.GetChild(name); ch != nil {
		return ch
	}
	var out fuse.EntryOut
	ch, errno := d.Lookup(callerCtx(0), name, &out)
	if errno != 0 {
		t.Fatalf("lookup %s: %v", name, errno)
	}
	d.AddChild(name, ch, false)
	return ch
}

// lookupPath returns the node of rel (below the root), looked up through
// the handlers where the tree has none.
func lookupPath(t *testing.T, fsys *filesystem, rel string) *fusefs.Inode {
	t.Helper()
	d, parts := &fsys.root.dirNode, strings.Split(rel, "/")
	for _, part := range parts[:len(parts)-1] {
		d = child(t, d, part).Operations().(*dirNode)
	}
	return child(t, d, parts[len(parts)-1])
}

// readAll opens segment n read-only through the handlers, reads it whole
// and closes it.
func readAll(t *testing.T, n *segmentNode) []byte {
	t.Helper()
	fh, _, errno := n.Open(callerCtx(0), unix.O_RDONLY)
	if errno != 0 {
		t.Fatalf("open: %v", errno)
	}
	defer fh.(fusefs.FileReleaser).Release(callerCtx(0))
	return readHandle(t, fh)
}

// readHandle reads an open segment handle whole.
func readHandle(t *testing.T, fh fusefs.FileHandle) []byte {
	t.Helper()
	h := fh.(*fileHandle)
	var st unix.Stat_t
	if err := unix.Fstat(h.fd, &st); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, st.Size)
	res, errno := h.Read(callerCtx(0), buf, 0)
	if errno != 0 {
		t.Fatalf("read: %v", errno)
	}
	b, _ := res.Bytes(buf)
	return b
}

// dirAttr reads directory attribute attr of rel through the handlers.
func dirAttr(t *testing.T, fsys *filesystem, rel, attr string) ([]byte, syscall.Errno) {
	t.Helper()
	d := lookupPath(t, fsys, rel).Operations().(*dirNode)
	buf := make([]byte, 4096)
	n, errno := d.Getxattr(callerCtx(0), attr, buf)
	return buf[:n], errno
}

// clusterState is user.tensorfs.cluster of a published directory.
type clusterState struct {
	Version   string            `json:"version"`
	Publisher string            `json:"publisher"`
	Segments  int64             `json:"segments"`
	Complete  int64             `json:"complete"`
	Bytes     int64             `json:"bytes"`
	Local     int64             `json:"local_bytes"`
	Pull      *cluster.Progress `json:"pull"`
}

func readClusterState(t *testing.T, fsys *filesystem) clusterState {
	t.Helper()
	v, errno := dirAttr(t, fsys, "models/m", alloc.AttrCluster)
	var st clusterState
	if errno != 0 || json.Unmarshal(v, &st) != nil {
		t.Fatalf("user.tensorfs.cluster: %q, %v", v, errno)
	}
	return st
}

func (m modelFiles) bytes() (n int64) {
	for _, b := range m {
		n += int64(len(b))
	}
	return n
}

// TestClusterPublishMaterializePull publishes a directory on one node:
// its segments become read-only there; a second node makes it from the
// namespace (names, owners, modes, times, attributes, sizes, no bytes)
// and fills a segment when it is first opened; a third pulls it whole.
// Bytes and attributes are the published ones everywhere, and changes to
// a published segment are refused with EPERM.
func TestClusterPublishMaterializePull(t *testing.T) {
	tc := newTestCluster(t)
	a, b, c := tc.node("node-a", nil), tc.node("node-b", nil), tc.node("node-c", nil)
	files := makeModel(t, a)
	v := publishModel(t, a)

	// On the publisher, the segments are published ones now.
	w := lookupPath(t, a, "models/m/layers/1.weight").Operations().(*segmentNode)
	if _, _, errno := w.Open(callerCtx(0), unix.O_RDWR); errno != syscall.EPERM {
		t.Errorf("open for writing of a published segment: %v, want EPERM", errno)
	}
	if got := readAll(t, w); !bytes.Equal(got, files["layers/1.weight"]) {
		t.Error("the publisher reads other bytes than it published")
	}
	if st := readClusterState(t, a); st.Version != v || st.Publisher != "node-a" || st.Segments != 4 || st.Complete != 4 || st.Bytes != files.bytes() || st.Local != st.Bytes {
		t.Errorf("publisher's user.tensorfs.cluster %+v", st)
	}

	// The second node makes the version, without its bytes.
	awaitVersion(t, b, v)
	for p := range files {
		sameObject(t, a, b, p, false)
	}
	sameObject(t, a, b, ".", false)
	sameObject(t, a, b, "layers", false)
	if st := readClusterState(t, b); st.Version != v || st.Segments != 4 || st.Complete != 1 || st.Local != 0 {
		t.Errorf("before any pull, user.tensorfs.cluster %+v: want 4 segments, the empty one complete", st)
	}
	n := lookupPath(t, b, "models/m/layers/1.weight").Operations().(*segmentNode)
	var out fuse.AttrOut
	if errno := n.Getattr(callerCtx(0), nil, &out); errno != 0 || out.Size != uint64(len(files["layers/1.weight"])) {
		t.Errorf("stat of a segment still to pull: size %d (%v), want the published %d", out.Size, errno, len(files["layers/1.weight"]))
	}
	buf := make([]byte, 64)
	if sz, errno := n.Getxattr(callerCtx(0), alloc.AttrShape, buf); errno != 0 || string(buf[:sz]) != "[256, 128]" {
		t.Errorf("shape of the made segment %q (%v)", buf[:sz], errno)
	}
	if sz, errno := n.Getxattr(callerCtx(0), "user.note", buf); errno != 0 || string(buf[:sz]) != "\x00\x01\x02" {
		t.Errorf("user.note of the made segment %q (%v)", buf[:sz], errno)
	}
	for what, errno := range map[string]syscall.Errno{
		"setxattr":    n.Setxattr(callerCtx(0), "user.x", []byte("1"), 0),
		"removexattr": n.Removexattr(callerCtx(0), "user.note"),
		"chmod":       n.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_MODE, Mode: 0o666}}, &out),
		"truncate":    n.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_SIZE, Size: 0}}, &out),
	} {
		if errno != syscall.EPERM {
			t.Errorf("%s of a published segment: %v, want EPERM", what, errno)
		}
	}
	for _, flags := range []uint32{unix.O_WRONLY, unix.O_RDWR, unix.O_RDONLY | unix.O_TRUNC} {
		if _, _, errno := n.Open(callerCtx(0), flags); errno != syscall.EPERM {
			t.Errorf("open %#o of a published segment: %v, want EPERM", flags, errno)
		}
	}
	if fi, _ := os.Stat(modelPath(b, "layers/1.weight")); fi.Size() != 0 {
		t.Errorf("a refused open filled the segment: %d bytes", fi.Size())
	}
	// First open pulls it, then reads the published bytes.
	if got := readAll(t, n); !bytes.Equal(got, files["layers/1.weight"]) {
		t.Errorf("first open reads %d bytes, not the published %d", len(got), len(files["layers/1.weight"]))
	}
	sameObject(t, a, b, "layers/1.weight", true)
	if st := readClusterState(t, b); st.Complete != 2 || st.Local != int64(len(files["layers/1.weight"])) {
		t.Errorf("after one open, user.tensorfs.cluster %+v", st)
	}

	// The third node pulls the whole directory.
	awaitVersion(t, c, v)
	got, err := controlBackend{c}.Pull(rootPeer, "models/m")
	if err != nil || got != files.bytes() {
		t.Fatalf("pull: %d bytes, %v; want %d", got, err, files.bytes())
	}
	for p := range files {
		sameObject(t, a, c, p, true)
	}
	if st := readClusterState(t, c); st.Complete != 4 || st.Local != files.bytes() {
		t.Errorf("after the pull, user.tensorfs.cluster %+v", st)
	}
	if got, err := (controlBackend{c}).Pull(rootPeer, "models/m"); err != nil || got != 0 {
		t.Errorf("pulling a complete directory again: %d bytes, %v; want 0", got, err)
	}
	stats := c.clusterStats()
	if stats["node"] != "node-c" || stats["pieces_fetched"].(int64) == 0 || stats["pulled_segments"].(int64) != 4 {
		t.Errorf("cluster stats %v", stats)
	}
	st, err := c.stats(0)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := st["cluster"].(map[string]any); !ok {
		t.Error("user.tensorfs.stats has no cluster member")
	}
	buf = make([]byte, 4096)
	d := lookupPath(t, c, "models/m").Operations().(*dirNode)
	if sz, errno := d.Listxattr(callerCtx(0), buf); errno != 0 || !slices.Contains(strings.Split(string(buf[:sz]), "\x00"), alloc.AttrCluster) {
		t.Errorf("listxattr of a published directory %q (%v): no %s", buf[:sz], errno, alloc.AttrCluster)
	}
	if _, errno := dirAttr(t, c, "models", alloc.AttrCluster); errno != syscall.ENODATA {
		t.Errorf("user.tensorfs.cluster of a directory not published: %v, want ENODATA", errno)
	}
}

// writeSeg makes segment name in d through the handlers, holding data.
func writeSeg(t *testing.T, fsys *filesystem, d *dirNode, rel string, data []byte) *segmentNode {
	t.Helper()
	n := mkseg(t, d, filepath.Base(rel))
	if err := os.WriteFile(filepath.Join(fsys.store.Dir, rel), data, 0o644); err != nil {
		t.Fatal(err)
	}
	return n
}

// inode returns the inode of the backing object at p.
func inode(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestClusterRepublish publishes a second version over a first that
// another node has made, pulled in part and holds open: new readers get
// the new bytes, an open handle keeps the old ones, an unchanged name
// keeps its segment, names and directories the new version has not go,
// objects that are not pulled segments stay, and a content the node has
// complete is copied locally rather than fetched. Two names with one
// content are fetched once.
func TestClusterRepublish(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	files := makeModel(t, a)
	m := lookupPath(t, a, "models/m").Operations().(*dirNode)
	writeSeg(t, a, m, "models/m/tied", files["layers/0.weight"])
	writeSeg(t, a, m, "models/m/gone", []byte("gone in v2"))
	old := mkdir(t, m, "old")
	writeSeg(t, a, old, "models/m/old/x", []byte("x"))
	v1 := publishModel(t, a)
	awaitVersion(t, b, v1)

	// node-b pulls v1 (two names of one content among it), and keeps
	// layers/1.weight open.
	before := b.clusterStats()["bytes_fetched"].(int64)
	if n, err := (controlBackend{b}).Pull(rootPeer, "models/m"); err != nil || n != files.bytes()+int64(len(files["layers/0.weight"]))+11 {
		t.Fatalf("pull of v1: %d bytes, %v", n, err)
	}
	if got := b.clusterStats()["bytes_fetched"].(int64) - before; got != files.bytes()+11 {
		t.Errorf("v1's pull fetched %d bytes, want %d: the tied copy is copied, not fetched", got, files.bytes()+11)
	}
	sameObject(t, a, b, "tied", true)
	w1 := lookupPath(t, b, "models/m/layers/1.weight").Operations().(*segmentNode)
	lb := lookupPath(t, b, "models/m/layers")
	fh, _, errno := w1.Open(callerCtx(0), unix.O_RDONLY)
	if errno != 0 {
		t.Fatal(errno)
	}
	defer fh.(fusefs.FileReleaser).Release(callerCtx(0))
	configIno := inode(t, modelPath(b, "config.json"))
	// Objects of node-b's own: a host segment at a name v2 does not
	// publish, one at a name it does, and a directory at a file's name.
	mb := lookupPath(t, b, "models/m").Operations().(*dirNode)
	writeSeg(t, b, mb, "models/m/local", []byte("node-b's"))
	writeSeg(t, b, mb, "models/m/new", []byte("node-b's"))
	mkdir(t, mb, "clash")

	// v2 on node-a: layers/1.weight changes, gone and old go, new and
	// clash come, copy has the bytes of layers/0.weight.
	for _, name := range []string{"gone", "layers/1.weight", "old/x", "old"} {
		d, base := m, name
		if dir, file, ok := strings.Cut(name, "/"); ok {
			d, base = lookupPath(t, a, "models/m/"+dir).Operations().(*dirNode), file
		}
		var errno syscall.Errno
		if name == "old" {
			errno = d.Rmdir(callerCtx(0), base)
		} else {
			errno = d.Unlink(callerCtx(0), base)
		}
		if errno != 0 {
			t.Fatalf("remove %s: %v", name, errno)
		}
		d.RmChild(base) // as the bridge does for the reply
	}
	w2 := randomBytes(t, 200<<10)
	layers := lookupPath(t, a, "models/m/layers").Operations().(*dirNode)
	seg := writeSeg(t, a, layers, "models/m/layers/1.weight", w2)
	if errno := seg.Setxattr(callerCtx(0), "user.note", []byte("v2"), 0); errno != 0 {
		t.Fatal(errno)
	}
	writeSeg(t, a, m, "models/m/new", []byte("node-a's"))
	writeSeg(t, a, m, "models/m/clash", []byte("a file"))
	writeSeg(t, a, m, "models/m/copy", files["layers/0.weight"])
	v2 := publishModel(t, a)
	if v2 == v1 {
		t.Fatal("a changed directory published the same version")
	}
	awaitVersion(t, b, v2)

	if got := readHandle(t, fh); !bytes.Equal(got, files["layers/1.weight"]) {
		t.Error("a handle open on v1's segment no longer reads v1's bytes")
	}
	if lb.GetChild("1.weight") != nil {
		t.Error("the replaced segment's node is still in the tree")
	}
	w := lookupPath(t, b, "models/m/layers/1.weight").Operations().(*segmentNode)
	if got := readAll(t, w); !bytes.Equal(got, w2) {
		t.Error("a new open of a replaced segment does not read v2's bytes")
	}
	sameObject(t, a, b, "layers/1.weight", true)
	if inode(t, modelPath(b, "config.json")) != configIno {
		t.Error("an unchanged segment was made again")
	}
	for _, gone := range []string{"gone", "old"} {
		if _, err := os.Lstat(modelPath(b, gone)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s, which v2 has not, is still there: %v", gone, err)
		}
	}
	for _, p := range []string{"local", "new"} {
		if got, err := os.ReadFile(modelPath(b, p)); err != nil || string(got) != "node-b's" {
			t.Errorf("node-b's own segment %s: %q, %v", p, got, err)
		}
	}
	if fi, err := os.Lstat(modelPath(b, "clash")); err != nil || !fi.IsDir() {
		t.Errorf("node-b's directory at a published file's name: %v, %v", fi, err)
	}
	before = b.clusterStats()["bytes_fetched"].(int64)
	if _, err := (controlBackend{b}).Pull(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	if got := b.clusterStats()["bytes_fetched"].(int64) - before; got != 0 {
		t.Errorf("v2's pull fetched %d bytes; its one new content was read already, copy is held locally", got)
	}
	sameObject(t, a, b, "copy", true)
	if st := readClusterState(t, b); st.Version != v2 {
		t.Errorf("user.tensorfs.cluster names version %s, want %s", st.Version, v2)
	}
}

// client is an etcd client of the cluster, closed at the end of the test.
func (tc *testCluster) client() *clientv3.Client {
	tc.t.Helper()
	cfg := tc.config("observer")
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: 2 * time.Second, TLS: cfg.Credentials.ClientConfig(""), Logger: zap.NewNop()})
	if err != nil {
		tc.t.Fatal(err)
	}
	tc.t.Cleanup(func() { cli.Close() })
	return cli
}

// waitHolders waits until etcd names every one of nodes as a holder of
// content cid.
func waitHolders(t *testing.T, tc *testCluster, cid string, nodes ...string) {
	t.Helper()
	cli := tc.client()
	eventually(t, "holders "+strings.Join(nodes, ", "), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for _, n := range nodes {
			resp, err := cli.Get(ctx, cluster.DefaultPrefix+"holders/"+cid+"/"+n)
			if err != nil || len(resp.Kvs) == 0 {
				return false
			}
		}
		return true
	})
}

// TestClusterCorruptHolderRefetched: a node whose copy went bad on its
// backing verifies each piece before it serves it, serves none that
// fails (and logs it); the puller fetches them from the other holder,
// and its segment holds the published bytes.
func TestClusterCorruptHolderRefetched(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	c := tc.node("node-c", func(cfg *cluster.Config) { cfg.Parallel, cfg.PerPeer = 2, 1 }) // both holders asked from the start
	data := randomBytes(t, 2<<20)
	writeSeg(t, a, mkdir(t, mkdir(t, &a.root.dirNode, "models"), "m"), "models/m/w", data)
	v := publishModel(t, a)
	awaitVersion(t, b, v)
	if _, err := (controlBackend{b}).Pull(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	seg := b.pulled.get(inode(t, modelPath(b, "w")))
	if seg == nil || !seg.isComplete() {
		t.Fatal("node-b's segment is not a complete pulled one")
	}
	bad := bytes.Clone(data)
	for i := range bad {
		bad[i] ^= 0x5a
	}
	if err := os.WriteFile(modelPath(b, "w"), bad, 0); err != nil { // the file node-b serves from
		t.Fatal(err)
	}
	waitHolders(t, tc, seg.content(), "node-a", "node-b")
	awaitVersion(t, c, v)
	n := lookupPath(t, c, "models/m/w").Operations().(*segmentNode)
	if got := readAll(t, n); !bytes.Equal(got, data) {
		t.Fatal("the pulled segment does not hold the published bytes")
	}
	st := c.clusterStats()
	if st["bad_pieces"].(int64) != 0 || st["bytes_fetched"].(int64) != int64(len(data)) {
		t.Errorf("stats %v: want no bad piece received, the content fetched once", st)
	}
	if st := b.clusterStats(); st["bad_pieces"].(int64) == 0 || !tc.logs.contains("a piece held here fails verification; it is not served") {
		t.Errorf("node-b's stats %v: want the bad pieces it was asked for found and logged", st)
	}
}

// TestClusterEtcdUnavailable stops etcd: a publish fails with ETIMEDOUT
// within the timeout and leaves its segments writable host segments, a
// first open or a pull of a segment to fetch fails with ETIMEDOUT and
// leaves it empty, and once etcd is back the pull completes.
func TestClusterEtcdUnavailable(t *testing.T) {
	tc := newTestCluster(t)
	fast := func(cfg *cluster.Config) { cfg.Timeout = time.Second }
	a, b := tc.node("node-a", fast), tc.node("node-b", fast)
	files := makeModel(t, a)
	v := publishModel(t, a)
	awaitVersion(t, b, v)

	stopped := make(chan struct{})
	go func() {
		tc.etcd.Stop()
		close(stopped)
	}()
	eventually(t, "etcd refuses connections", func() bool {
		c, err := net.Dial("tcp", strings.TrimPrefix(tc.etcd.ClientURL, "https://"))
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	m := lookupPath(t, a, "models/m").Operations().(*dirNode)
	more := writeSeg(t, a, m, "models/m/more", []byte("more bytes"))
	start := time.Now()
	_, err := controlBackend{a}.Publish(rootPeer, "models/m")
	if toErrno(err) != syscall.ETIMEDOUT || time.Since(start) > 3*time.Second {
		t.Errorf("publish with etcd down: %v after %v; want ETIMEDOUT within 3s", err, time.Since(start))
	}
	if a.pulled.has(inode(t, modelPath(a, "more"))) {
		t.Error("a segment of a failed publish stays published")
	}
	fh, _, errno := more.Open(callerCtx(0), unix.O_RDWR)
	if errno != 0 {
		t.Errorf("open for writing after a failed publish: %v", errno)
	} else {
		fh.(fusefs.FileReleaser).Release(callerCtx(0))
	}

	n := lookupPath(t, b, "models/m/layers/0.weight").Operations().(*segmentNode)
	if _, _, errno := n.Open(callerCtx(0), unix.O_RDONLY); errno != syscall.ETIMEDOUT {
		t.Errorf("first open with etcd down: %v, want ETIMEDOUT", errno)
	}
	if _, err := (controlBackend{b}).Pull(rootPeer, "models/m"); toErrno(err) != syscall.ETIMEDOUT {
		t.Errorf("pull with etcd down: %v, want ETIMEDOUT", err)
	}
	if fi, err := os.Stat(modelPath(b, "layers/0.weight")); err != nil || fi.Size() != 0 {
		t.Errorf("a failed pull left %v bytes (%v)", fi.Size(), err)
	}
	sameObject(t, a, b, "layers/0.weight", false) // its published times too

	<-stopped
	if err := tc.etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a pull once etcd is back", func() bool {
		got, err := controlBackend{b}.Pull(rootPeer, "models/m")
		return err == nil && got == files.bytes()
	})
	for p := range files {
		sameObject(t, a, b, p, true)
	}
}

// TestClusterRefusals: what publish and pull refuse, with their errnos,
// and what a mount without a cluster answers.
func TestClusterRefusals(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	makeModel(t, a)
	ab := controlBackend{a}
	root := &a.root.dirNode
	expect := func(what string, err error, want syscall.Errno) {
		t.Helper()
		if got := toErrno(err); got != want {
			t.Errorf("%s: %v (%v), want %v", what, got, err, want)
		}
	}

	// A directory each refusal is made in, with one segment.
	dir := func(name string) (*dirNode, *segmentNode) {
		d := mkdir(t, root, name)
		return d, writeSeg(t, a, d, name+"/w", []byte("weights!"))
	}
	_, err := ab.Publish(rootPeer, "../x")
	expect("publish of ../x", err, syscall.EINVAL)
	_, err = ab.Publish(rootPeer, "nothere")
	expect("publish of a missing directory", err, syscall.ENOENT)
	_, err = ab.Publish(otherPeer, "models/m")
	expect("publish by a user who neither owns nor may write it", err, syscall.EACCES)

	_, w := dir("open")
	fh, _, errno := w.Open(callerCtx(0), unix.O_RDWR)
	if errno != 0 {
		t.Fatal(errno)
	}
	_, err = ab.Publish(rootPeer, "open")
	expect("publish of a segment open for writing", err, syscall.EBUSY)
	if errno := fh.(fusefs.FileReleaser).Release(callerCtx(0)); errno != 0 {
		t.Fatal(errno)
	}
	if fh, _, errno := w.Open(callerCtx(0), unix.O_RDWR); errno != 0 {
		t.Errorf("after a refused publish, open for writing: %v", errno)
	} else {
		fh.(fusefs.FileReleaser).Release(callerCtx(0))
	}

	dir("linked")
	if err := os.Link(filepath.Join(a.store.Dir, "linked/w"), filepath.Join(a.store.Dir, "linked/w2")); err != nil {
		t.Fatal(err)
	}
	_, err = ab.Publish(rootPeer, "linked")
	expect("publish of a segment with two names", err, syscall.EINVAL)

	dir("fifo")
	if err := unix.Mkfifo(filepath.Join(a.store.Dir, "fifo/p"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = ab.Publish(rootPeer, "fifo")
	expect("publish of a FIFO", err, syscall.EINVAL)

	d, _ := dir("private")
	sub := mkdir(t, d, "sub")
	if errno := sub.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_MODE, Mode: 0o700}}, new(fuse.AttrOut)); errno != 0 {
		t.Fatal(errno)
	}
	if err := os.Chown(filepath.Join(a.store.Dir, "private"), int(ownerPeer.Uid), int(ownerPeer.Gid)); err != nil {
		t.Fatal(err)
	}
	_, err = ab.Publish(ownerPeer, "private")
	expect("publish of a directory with one its publisher may not read", err, syscall.EACCES)
	if err := os.Chown(filepath.Join(a.store.Dir, "private/sub"), int(ownerPeer.Uid), int(ownerPeer.Gid)); err != nil {
		t.Fatal(err)
	}
	_, err = ab.Publish(ownerPeer, "private")
	expect("publish of a segment its publisher may not write", err, syscall.EACCES)

	// On node-b, the version is made but not pulled.
	v := publishModel(t, a)
	awaitVersion(t, b, v)
	_, err = controlBackend{b}.Publish(rootPeer, "models/m")
	expect("publish of segments not pulled yet", err, syscall.EINVAL)
	plain := mkdir(t, &b.root.dirNode, "plain")
	writeSeg(t, b, plain, "plain/w", []byte("weights!"))
	_, err = controlBackend{b}.Pull(rootPeer, "plain")
	expect("pull of a directory not published", err, syscall.ENOENT)
	if err := os.Chmod(modelPath(b, "layers"), 0o700); err != nil {
		t.Fatal(err)
	}
	_, err = controlBackend{b}.Pull(otherPeer, "models/m")
	expect("pull through a directory its user may not read", err, syscall.EACCES)
	_, err = controlBackend{b}.Pull(rootPeer, "models/m/nothere")
	expect("pull of a missing directory", err, syscall.ENOENT)

	// Unpublished, the names go (TestClusterUnpublish has the rest).
	if err := a.cl.node.Unpublish(context.Background(), "models/m", 0); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the unpublished names removed", func() bool {
		_, err := os.Stat(modelPath(b, "config.json"))
		return errors.Is(err, os.ErrNotExist)
	})

	// A mount without a cluster.
	none := testFS(t)
	_, err = controlBackend{none}.Publish(rootPeer, "models/m")
	expect("publish without a cluster", err, syscall.EOPNOTSUPP)
	_, err = controlBackend{none}.Pull(rootPeer, "models/m")
	expect("pull without a cluster", err, syscall.EOPNOTSUPP)
	p := filepath.Join(none.store.Dir, "p")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	mk := alloc.Marker{Kind: alloc.Pulled, Content: strings.Repeat("ab", 32), Size: 8}
	if err := alloc.MarkPulled(p, mk); err != nil {
		t.Fatal(err)
	}
	none.pulled.add(inode(t, p), mk)
	if none.clusterStats() != nil {
		t.Error("cluster stats without a cluster")
	}
	if _, _, errno := lookupPath(t, none, "p").Operations().(*segmentNode).Open(callerCtx(0), unix.O_RDONLY); errno != syscall.EOPNOTSUPP {
		t.Errorf("open of a segment to pull without a cluster: %v, want EOPNOTSUPP", errno)
	}
}

// restartable is a node whose filesystem is made on a given backing, as
// the daemon makes it at start (Recover, then newFilesystem with the
// cluster), so that it can leave and come back.
type restartable struct {
	fsys *filesystem
	stop func() // leaves the cluster and closes the filesystem, once
}

// openNode starts node name on backing, recovering what it holds.
func (tc *testCluster) openNode(name, backing string) restartable {
	t := tc.t
	t.Helper()
	store, err := alloc.Open(alloc.Config{Backing: backing}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	_, _, rec, err := Recover(store, 0)
	if err != nil {
		store.Close()
		t.Fatal(err)
	}
	cfg := tc.config(name)
	log := slog.New(slog.NewTextHandler(tc.logs, nil)).With("fs", name)
	fsys, err := newFilesystem(Options{Store: store, Log: log, Recovered: rec, Cluster: &cfg})
	if err != nil {
		store.Close()
		t.Fatal(err)
	}
	fusefs.NewNodeFS(fsys.root, &fusefs.Options{})
	if err := fsys.joinCluster(cfg, tc.bounds); err != nil {
		fsys.close()
		store.Close()
		t.Fatal(err)
	}
	fsys.cl.start()
	stop := sync.OnceFunc(func() {
		fsys.cl.close()
		fsys.close()
		store.Close()
	})
	t.Cleanup(stop)
	return restartable{fsys, stop}
}

// TestClusterRestartServes: a node that pulled a version and restarts
// finds its pulled segments complete, and serves them to a third node
// once the publisher has left.
func TestClusterRestartServes(t *testing.T) {
	tc := newTestCluster(t)
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backings := map[string]string{}
	for _, n := range []string{"a", "b", "c"} {
		backings[n] = filepath.Join(top, n)
		os.Mkdir(backings[n], 0o755)
	}
	a, b := tc.openNode("node-a", backings["a"]), tc.openNode("node-b", backings["b"])
	files := makeModel(t, a.fsys)
	v := publishModel(t, a.fsys)
	awaitVersion(t, b.fsys, v)
	if _, err := (controlBackend{b.fsys}).Pull(rootPeer, "models/m"); err != nil {
		t.Fatal(err)
	}
	b.stop()
	a.stop()
	b = tc.openNode("node-b", backings["b"])
	if st := readClusterState(t, b.fsys); st.Version != v || st.Complete != 4 || st.Local != files.bytes() {
		t.Errorf("after a restart, user.tensorfs.cluster %+v: want every segment complete", st)
	}
	c := tc.openNode("node-c", backings["c"])
	awaitVersion(t, c.fsys, v)
	if got, err := (controlBackend{c.fsys}).Pull(rootPeer, "models/m"); err != nil || got != files.bytes() {
		t.Fatalf("pull from the restarted node alone: %d bytes, %v", got, err)
	}
	for p, data := range files {
		if got, err := os.ReadFile(modelPath(c.fsys, p)); err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s pulled from the restarted node differs (%v)", p, err)
		}
	}
	if served := b.fsys.clusterStats()["bytes_served"].(int64); served != files.bytes() {
		t.Errorf("the restarted node served %d bytes, want %d", served, files.bytes())
	}
}

// TestClusterStaleVersionEvent: the watch reports a node's own publish
// after the publish has made it here, so an event of the version before
// can arrive once a newer one is made. Making it then would undo the
// newer one: on its publisher, remove a file only the newer version has,
// and with it the one copy of its bytes. A replaced version is not made;
// the newer one's file stays and reaches a peer.
func TestClusterStaleVersionEvent(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	makeModel(t, a)
	v1 := publishModel(t, a)
	info1, err := a.cl.node.Lookup(context.Background(), "models/m")
	if err != nil || info1.Version != v1 {
		t.Fatalf("lookup of v1: %+v, %v", info1, err)
	}
	ver1, err := a.cl.node.Version(context.Background(), v1)
	if err != nil {
		t.Fatal(err)
	}
	m := lookupPath(t, a, "models/m").Operations().(*dirNode)
	extra := randomBytes(t, 64<<10)
	writeSeg(t, a, m, "models/m/extra", extra)
	v2 := publishModel(t, a)

	// v1's event, late: nothing changes.
	if err := a.cl.materialize(info1, ver1); err != nil {
		t.Fatalf("making v1 after v2: %v", err)
	}
	if got, err := os.ReadFile(modelPath(a, "extra")); err != nil || !bytes.Equal(got, extra) {
		t.Fatalf("the publisher's file of v2 after v1's late event: %d bytes, %v", len(got), err)
	}
	awaitVersion(t, b, v2)
	if _, err := (controlBackend{b}).Pull(rootPeer, "models/m"); err != nil {
		t.Fatalf("pull of v2: %v", err)
	}
	if got := readAll(t, lookupPath(t, b, "models/m/extra").Operations().(*segmentNode)); !bytes.Equal(got, extra) {
		t.Errorf("v2's file pulled by a peer: %d bytes, want its %d", len(got), len(extra))
	}
}

// TestClusterPullRightAfterPublish: a pull on another node right after a
// publish, before that node's watch may have made the version, makes it
// and pulls it instead of failing with ENOENT.
func TestClusterPullRightAfterPublish(t *testing.T) {
	tc := newTestCluster(t)
	a, b := tc.node("node-a", nil), tc.node("node-b", nil)
	files := makeModel(t, a)
	publishModel(t, a)
	if got, err := (controlBackend{b}).Pull(rootPeer, "models/m"); err != nil || got != files.bytes() {
		t.Fatalf("pull right after the publish: %d bytes, %v; want %d", got, err, files.bytes())
	}
	for p, data := range files {
		if got, err := os.ReadFile(modelPath(b, p)); err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s: %d bytes, %v", p, len(got), err)
		}
	}
}
