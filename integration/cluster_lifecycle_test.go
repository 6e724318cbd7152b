package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestClusterLifecycle: a published directory removed with rm -r on its
// publisher leaves that node only (its daemon holds no descriptor of a
// removed segment, its backing's use drops), the other nodes keep it and
// one pulls it from another, and it stays removed on the publisher after
// a remount and etcd's restart; so does one moved before its rm -r, whose
// removal is recorded by its published name, not the one it had; a directory unpublished from another
// node, by its publisher's uid (another uid gets EPERM), leaves every
// node, its memory freed, and comes back on none after a remount and
// etcd's restart.
func TestClusterLifecycle(t *testing.T) {
	t.Parallel()
	tb := upCluster(t, 3)
	nodes := []string{tb.node(1), tb.node(2), tb.node(3)}
	n1, n2, n3 := nodes[0], nodes[1], nodes[2]
	publishAs := func(name string, seed uint64) (map[string][]byte, string) {
		t.Helper()
		dir := filepath.Join(n1, name)
		want := writeModel(t, dir, userA, modelFile{"w1", 2<<20 + 1, seed}, modelFile{"sub/w2", 1 << 20, seed + 1})
		for _, d := range []string{dir, filepath.Join(dir, "sub")} {
			if err := os.Chown(d, userA, userA); err != nil {
				t.Fatal(err)
			}
		}
		out, err := tb.tensorfs(userA, "publish", dir)
		if err != nil {
			t.Fatalf("publish %s as uid %d: %v\n%s", name, userA, err, out)
		}
		v := versionOf(t, out)
		for _, n := range nodes[1:] {
			waitVersion(t, filepath.Join(n, name), v)
		}
		return want, v
	}
	// syncNodes publishes a small directory from node2 and waits until every
	// node made it: their watches run, with etcd as it is now.
	syncs := 0
	syncNodes := func() {
		t.Helper()
		syncs++
		name := fmt.Sprintf("sync%d", syncs)
		writeModel(t, filepath.Join(n2, name), 0, modelFile{"x", 1, uint64(100 + syncs)})
		v := versionOf(t, tb.must("publish", filepath.Join(n2, name)))
		for _, n := range []string{n1, n3} {
			waitVersion(t, filepath.Join(n, name), v)
		}
	}
	restartAll := func(k int) {
		t.Helper()
		tb.must("unmount", tb.node(k))
		tb.mount(k)
		tb.etcd("stop")
		tb.etcd("start")
		syncNodes()
	}

	t.Run("rm -r on the publisher", func(t *testing.T) {
		want, _ := publishAs("rmd", 1)
		t.Logf("node2: %s", tb.must("pull", filepath.Join(n2, "rmd")))
		sameFiles(t, filepath.Join(n3, "rmd"), map[string][]byte{"w1": want["w1"]}) // opened: pulled
		pid := daemonPid(t, n1)
		was := usedBytes(t, n1)
		if out, err := exec.Command("rm", "-r", filepath.Join(n1, "rmd")).CombinedOutput(); err != nil {
			t.Fatalf("rm -r: %v\n%s", err, out)
		}
		eventually(t, "node1 frees the removed directory", func() (bool, string) {
			held, used := deletedSegments(t, pid, "/rmd/"), usedBytes(t, n1)
			return len(held) == 0 && used <= was-3<<20, fmt.Sprintf("descriptors of removed segments %q; backing use %d, was %d", held, used, was)
		})
		t.Logf("node1's backing: %d KiB in use before rm -r, %d KiB after", was>>10, usedBytes(t, n1)>>10)
		sameFiles(t, filepath.Join(n2, "rmd"), want)
		t.Logf("node3: %s", tb.must("pull", filepath.Join(n3, "rmd")))
		sameFiles(t, filepath.Join(n3, "rmd"), want)
		if last := lastLine(tb.log(3), "cluster: pull complete"); !strings.Contains(last, "node2:") || strings.Contains(last, "node1:") {
			t.Errorf("node3 did not pull from node2 alone: %s", last)
		}
		moved, _ := publishAs("mvd", 20)
		tb.must("pull", filepath.Join(n2, "mvd")) // node1 alone holds it until then
		if out, err := exec.Command("sh", "-c", `mv "$1/mvd" "$1/mvx" && rm -r "$1/mvx"`, "sh", n1).CombinedOutput(); err != nil {
			t.Fatalf("mv mvd mvx; rm -r mvx: %v\n%s", err, out)
		}
		eventually(t, "node1 records the moved directory's removal", func() (bool, string) {
			l := lastLine(tb.log(1), "published directory removed here")
			return strings.Contains(l, "dir=mvd "), l
		})
		restartAll(1)
		for _, name := range []string{"rmd", "mvd", "mvx"} {
			if _, err := os.Lstat(filepath.Join(n1, name)); err == nil {
				t.Errorf("%s, removed on node1, came back after a remount and etcd's restart", name)
			}
		}
		if strings.Contains(tb.log(1), "dir=mvx") {
			t.Errorf("node1 recorded a removal of mvx, a name never published:\n%s", tail(tb.log(1)))
		}
		sameFiles(t, filepath.Join(n2, "mvd"), moved)
		if !strings.Contains(tb.log(1), "a version removed here is not made again") {
			t.Errorf("node1's log does not say why it did not make the version again:\n%s", tail(tb.log(1)))
		}
		sameFiles(t, filepath.Join(n2, "rmd"), want)
	})

	t.Run("unpublish from another node", func(t *testing.T) {
		want, _ := publishAs("unp", 10)
		tb.must("pull", filepath.Join(n2, "unp"))
		sameFiles(t, filepath.Join(n3, "unp"), want)
		pids, used := map[string]int{}, map[string]int64{}
		for _, n := range nodes {
			pids[n], used[n] = daemonPid(t, n), usedBytes(t, n)
		}
		out, err := tb.tensorfs(userB, "unpublish", filepath.Join(n3, "unp"))
		if err == nil || !strings.Contains(out, "operation not permitted") || !strings.Contains(out, fmt.Sprintf("uid %d", userA)) {
			t.Fatalf("unpublish as uid %d: %v %q; want EPERM naming uid %d", userB, err, out, userA)
		}
		if out, err := tb.tensorfs(userA, "unpublish", filepath.Join(n3, "unp")); err != nil {
			t.Fatalf("unpublish as the publisher's uid: %v\n%s", err, out)
		}
		for _, n := range nodes {
			eventually(t, n+" removes the unpublished directory", func() (bool, string) {
				_, err := os.Lstat(filepath.Join(n, "unp"))
				held, now := deletedSegments(t, pids[n], "/unp/"), usedBytes(t, n)
				return os.IsNotExist(err) && len(held) == 0 && now <= used[n]-3<<20,
					fmt.Sprintf("%v; descriptors of removed segments %q; backing use %d, was %d", err, held, now, used[n])
			})
		}
		restartAll(2)
		for _, n := range nodes {
			if _, err := os.Lstat(filepath.Join(n, "unp")); err == nil {
				t.Errorf("%s: an unpublished directory came back after a remount and etcd's restart", n)
			}
		}
	})

	t.Run("pull that races a publish", func(t *testing.T) { clusterPullRacesPublish(t, tb) })

	// A pull whose daemon goes on with the daemon that serves the mount
	// now (tensorfs restart: the successor), and says so; if none does
	// (its daemon and keeper killed) it says to mount it again first,
	// and the pull run again completes.
	t.Run("pull whose daemon goes", func(t *testing.T) {
		for i, how := range []string{"restart", "kill"} {
			name := fmt.Sprintf("big-%s", how)
			want := writeModel(t, filepath.Join(n1, name), 0, modelFile{"w", 48 << 20, uint64(30 + i)})
			v := versionOf(t, tb.must("publish", filepath.Join(n1, name)))
			dir := filepath.Join(n3, name)
			waitVersion(t, dir, v)
			cmd := exec.Command(tb.env["TESTBED_TENSORFS"], "pull", dir)
			var out strings.Builder
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			eventually(t, "node3's pull under way", func() (bool, string) {
				a, err := readClusterAttr(dir)
				return err == nil && a.Pull != nil, fmt.Sprintf("%+v %v", a, err)
			})
			var says []string
			if how == "restart" {
				tb.must("restart", n3)
				says = []string{fmt.Sprintf("daemon %d serves it now: pulling the rest", daemonPid(t, n3))}
			} else {
				tb.kill(3)
				says = []string{"run `tensorfs pull " + dir + "` again", "the daemon of " + n3 + " is gone", "tensorfs mount --cluster"}
			}
			err := cmd.Wait()
			if how == "kill" {
				tb.mount(3)
			}
			if (err == nil) != (how == "restart") {
				t.Errorf("pull whose daemon went (%s): %v %q", how, err, out.String())
			}
			for _, s := range says {
				if !strings.Contains(out.String(), s) {
					t.Errorf("pull whose daemon went (%s): %v %q; want it to say %q", how, err, out.String(), s)
				}
			}
			if how == "kill" {
				tb.must("pull", dir)
			}
			sameFiles(t, dir, want)
		}
	})
}

// usedBytes returns the bytes in use in the backing of the mount at mnt.
func usedBytes(t *testing.T, mnt string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// deletedSegments returns the targets of pid's descriptors that name a
// removed file whose path contains part.
func deletedSegments(t *testing.T, pid int, part string) []string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var held []string
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err == nil && strings.HasSuffix(target, " (deleted)") && strings.Contains(target, part) {
			held = append(held, target)
		}
	}
	return held
}
