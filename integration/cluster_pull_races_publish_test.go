package integration

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// clusterPullRacesPublish (TestClusterLifecycle's bed): node3 pulls a
// directory while node1 publishes a new version of it that replaces its
// large segment (the old content then held by no node). The pull ends
// with the new version complete on node3, byte for byte, well before a
// pull would give up on the old content (30 s): it stops pulling the
// replaced segment and pulls the new one. It failed with EHOSTUNREACH
// ("no node holds the piece") after 30 s before.
func clusterPullRacesPublish(t *testing.T, tb *testbed) {
	n1, n3 := tb.node(1), tb.node(3)
	for try := 1; ; try++ {
		name := fmt.Sprintf("race%d", try)
		src, dir := filepath.Join(n1, name), filepath.Join(n3, name)
		want := writeModel(t, src, 0, modelFile{"w", 64 << 20, uint64(50 + try)}, modelFile{"v", 1 << 20, 60})
		waitVersion(t, dir, versionOf(t, tb.must("publish", src)))
		cmd := exec.Command(tb.env["TESTBED_TENSORFS"], "pull", dir)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		eventually(t, "node3's pull under way", func() (bool, string) {
			a, err := readClusterAttr(dir)
			return err == nil && a.Pull != nil, fmt.Sprintf("%+v %v", a, err)
		})
		if err := os.Remove(filepath.Join(src, "w")); err != nil {
			t.Fatal(err)
		}
		maps.Copy(want, writeModel(t, src, 0, modelFile{"w", 64 << 20, uint64(70 + try)}))
		v2 := versionOf(t, tb.must("publish", src))
		err := cmd.Wait()
		took := time.Since(start)
		if err != nil {
			t.Fatalf("node3's pull that raced a publish: %v\n%s", err, out.String())
		}
		if !strings.Contains(tb.log(3), "a new version was made here during a pull") {
			if try == 3 {
				t.Fatalf("node3's pull ended before the new version came, 3 times:\n%s", out.String())
			}
			continue // the race was missed: the pull ended first
		}
		t.Logf("node3's pull that raced a publish: %s (%.1fs)", strings.TrimSpace(out.String()), took.Seconds())
		if a, err := readClusterAttr(dir); err != nil || a.Version != v2 || a.Complete != a.Segments {
			t.Errorf("node3's %s once its pull ended: %+v %v; want version %s complete", name, a, err, v2)
		}
		if took > 20*time.Second {
			t.Errorf("node3's pull took %.1fs: it waited for the replaced segment's content, which no node holds", took.Seconds())
		}
		sameFiles(t, dir, want)
		return
	}
}
