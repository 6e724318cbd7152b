package integration

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// fanLoadScript (the tensorfs package at argv[1], the mount argv[2]) loads
// the directory argv[3] through the control socket, as load_into does,
// and prints each segment's name and the SHA-256 of its bytes.
const fanLoadScript = `
import hashlib, os, sys
sys.path.insert(0, sys.argv[1])
import tensorfs
with tensorfs.Client(sys.argv[2]) as c:
    for s, fd in c.load(sys.argv[3]):
        with os.fdopen(fd, "rb") as f:
            print(s["name"], hashlib.sha256(f.read()).hexdigest())
`

// testClusterFanOut (a subtest of TestCluster, on its test bed): on a node
// that has pulled nothing of a directory, the first open of a segment and
// a load of the directory each fetch from every holder at once. node1
// publishes fan, node2 pulls it; then on node3, as user A, a read of the
// segment big (three pieces) and a load of the directory: node1's and
// node2's served counters both grow by part of what each step fetched, and
// the load is one pull of everything it still lacked (one "pull complete"
// in node3's log, its bytes the sum), not a pull per segment.
func testClusterFanOut(t *testing.T, tb *testbed) {
	n1, n2, n3 := tb.node(1), tb.node(2), tb.node(3)
	files := []modelFile{{"big", 16<<20 + 5, 30}}
	for i := range 6 {
		files = append(files, modelFile{fmt.Sprintf("layers/%d", i), 1<<20 + i, uint64(31 + i)})
	}
	if err := os.Mkdir(filepath.Join(n1, "fan"), 0o755); err != nil {
		t.Fatal(err)
	}
	want := writeModel(t, filepath.Join(n1, "fan"), userA, files...)
	v := versionOf(t, tb.must("publish", filepath.Join(n1, "fan")))
	waitVersion(t, filepath.Join(n2, "fan"), v)
	tb.must("pull", filepath.Join(n2, "fan"))
	waitVersion(t, filepath.Join(n3, "fan"), v)

	// step runs fn and checks that node1 and node2 each served part of
	// the bytes bytes it fetched on node3.
	step := func(what string, bytes int, fn func()) {
		t.Helper()
		s1, s2 := bytesServed(t, n1), bytesServed(t, n2)
		fn()
		d1, d2 := bytesServed(t, n1)-s1, bytesServed(t, n2)-s2
		if d1 <= 0 || d2 <= 0 || d1+d2 != int64(bytes) {
			t.Errorf("%s on node3: node1 served %d bytes, node2 %d; want both a part of the %d fetched", what, d1, d2, bytes)
		}
	}

	step("the first open of big", len(want["big"]), func() {
		out, err := runAs(t, userA, "/", "sha256sum", filepath.Join(n3, "fan/big"))
		if sum := sha256.Sum256(want["big"]); err != nil || !strings.HasPrefix(out, hex.EncodeToString(sum[:])) {
			t.Fatalf("sha256sum of node3's fan/big as user A: %v %q; want the published bytes'", err, out)
		}
	})

	rest := 0
	var lines []string
	for rel, b := range want {
		if rel != "big" {
			rest += len(b)
		}
		sum := sha256.Sum256(b)
		lines = append(lines, rel+" "+hex.EncodeToString(sum[:]))
	}
	sort.Strings(lines)
	// A pull's line is logged after the bytes it fetched were served:
	// count from the first open's, once it is there.
	eventually(t, "node3's log of the first open's pull", func() (bool, string) {
		last := lastLine(tb.log(3), "cluster: pull complete")
		return strings.Contains(last, fmt.Sprintf("bytes=%d ", len(want["big"]))), last
	})
	pulls := strings.Count(tb.log(3), "cluster: pull complete")
	step("a load of the directory", rest, func() {
		out := pythonAs(t, userA, "/", fanLoadScript, filepath.Join(repoRoot, "python"), n3, "fan")
		if got := strings.TrimSpace(out); got != strings.Join(lines, "\n") {
			t.Fatalf("load of node3's fan as user A:\n%s\nwant:\n%s", got, strings.Join(lines, "\n"))
		}
	})
	eventually(t, "node3's log of the load's pull", func() (bool, string) {
		return strings.Count(tb.log(3), "cluster: pull complete") > pulls, lastLine(tb.log(3), "cluster: pull complete")
	})
	log := tb.log(3)
	if n := strings.Count(log, "cluster: pull complete") - pulls; n != 1 {
		t.Errorf("the load on node3 made %d pulls, want one for all its segments", n)
	}
	if last := lastLine(log, "cluster: pull complete"); !strings.Contains(last, fmt.Sprintf("bytes=%d ", rest)) {
		t.Errorf("node3's last pull: %q; want %d bytes, all the load lacked", last, rest)
	}
}

// bytesServed reads the bytes the node mounted at mnt has served to its
// peers (user.tensorfs.stats).
func bytesServed(t *testing.T, mnt string) int64 {
	t.Helper()
	v, err := getxattr(mnt, statsXattr)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Cluster struct {
			BytesServed int64 `json:"bytes_served"`
		} `json:"cluster"`
	}
	if err := json.Unmarshal(v, &st); err != nil {
		t.Fatalf("%s of %s: %v", statsXattr, mnt, err)
	}
	return st.Cluster.BytesServed
}
