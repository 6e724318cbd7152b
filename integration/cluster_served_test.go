package integration

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"tensorfs/alloc"
)

// servedFdsBound is what publishing or pulling may leave a daemon holding
// in descriptors, however many segments: the 64 files it keeps open to
// serve from (fs.maxServedFds), and room for its connections to etcd and
// its peers.
const servedFdsBound = 64 + 32

// TestClusterServedByPath: a node serves what it published, pulled or
// recovered from where each segment lies, reopened by path and checked to
// be its inode, not from a descriptor held per segment (DESIGN.md §9,
// §10). Publishing and pulling hundreds of segments leaves the daemons
// holding about as many descriptors as before; a restarted node serves
// every segment it recovered, alone; a segment renamed behind it is
// served no more (its pull fails, nothing is written, the daemon says
// why), and is served from its new name once the node restarts. (Only
// root can move it, in the backing: through the mount a pulled segment
// is not renamed, EXDEV.)
func TestClusterServedByPath(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 3)
	n1, n2, n3 := tb.node(1), tb.node(2), tb.node(3)
	const count = 300 // well past the files a daemon keeps open
	var many []modelFile
	for i := range count {
		many = append(many, modelFile{fmt.Sprintf("s%03d", i), 4096 + i, uint64(i + 1)})
	}
	dir := func(n string, sub ...string) string { return filepath.Join(append([]string{n, "served"}, sub...)...) }
	if err := os.Mkdir(dir(n1), 0o755); err != nil {
		t.Fatal(err)
	}
	wantMany := writeModel(t, dir(n1, "many"), userA, many...)
	wantOne := writeModel(t, dir(n1, "one"), userA, modelFile{"x", 1 << 20, 1000})

	fdsDuring := func(mnt, what string, fn func()) {
		t.Helper()
		pid := daemonPid(t, mnt)
		was, _ := daemonFDs(t, pid)
		fn()
		if now, _ := daemonFDs(t, pid); now-was > servedFdsBound {
			t.Errorf("%s of %d segments left %s's daemon holding %d more descriptors (%d, was %d); want at most %d", what, count+1, mnt, now-was, now, was, servedFdsBound)
		}
	}
	var v string
	fdsDuring(n1, "a publish", func() { v = versionOf(t, tb.must("publish", dir(n1))) })
	waitVersion(t, dir(n2), v)
	fdsDuring(n2, "a pull", func() { t.Logf("node2, from node1: %s", tb.must("pull", dir(n2))) })
	sameFiles(t, dir(n2, "many"), wantMany)
	sameFiles(t, dir(n2, "one"), wantOne)

	// node2 restarts, its x is renamed behind it, and node1 leaves: node3
	// can have every segment from node2 but x's content.
	tb.must("unmount", n2)
	tb.mount(2)
	// Through the mount the cluster's segments stay where it put them
	// (EXDEV); root moves x in node2's backing, behind its daemon.
	if err := os.Rename(dir(n2, "one/x"), filepath.Join(n2, "moved-x")); !errors.Is(err, syscall.EXDEV) {
		t.Errorf("rename of a pulled segment out of its directory: %v, want EXDEV", err)
	}
	backing := alloc.PrivateBacking(n2)
	if err := os.Rename(filepath.Join(backing, "served/one/x"), filepath.Join(backing, "moved-x")); err != nil {
		t.Fatal(err)
	}
	tb.must("unmount", "--purge", n1) // gone for good: its backing too (the test bed takes down mounted nodes only)
	// node3's pull of x's content finds no holder: it fails after 5 s,
	// not the default 30.
	tb.must("unmount", n3)
	tb.mount(3, "--cluster-holder-wait", "5s")
	waitVersion(t, dir(n3), v)
	t.Logf("node3, from node2 restarted: %s", tb.must("pull", dir(n3, "many")))
	sameFiles(t, dir(n3, "many"), wantMany)
	if last := lastLine(tb.log(3), "cluster: pull complete"); !strings.Contains(last, "from=map[node2:") {
		t.Errorf("node3 pulled from someone else than node2: %s", last)
	}
	if out, err := tb.tensorfs(0, "pull", dir(n3, "one")); err == nil {
		t.Errorf("node3 pulled x's content from node2, where it was renamed: %s", out)
	} else if !strings.Contains(out, "no node holds the piece") || !strings.Contains(out, "pull again once a node that holds it") {
		t.Errorf("node3's pull that no node can serve: %s; want it to say so and what to do", out)
	}
	if fi, err := os.Stat(dir(n3, "one/x")); err != nil || fi.Size() != 1<<20 {
		t.Errorf("node3's unpulled x: %v %v; want its published size", fi, err)
	}
	if !strings.Contains(tb.log(2), "left the path it was published or pulled at") {
		t.Errorf("node2's log does not say why it serves x's content no more:\n%s", tb.log(2))
	}

	// Restarted again, node2 recovers the segment at its new name (out of
	// the published directory, where the version made again at mount
	// leaves it alone) and serves it from there.
	tb.must("unmount", n2)
	tb.mount(2)
	tb.must("pull", dir(n3, "one"))
	sameFiles(t, dir(n3, "one"), wantOne)
}
