package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"tensorfs/alloc"
)

// TestMountFailureReleasesAll: a mount that fails after the FUSE mount
// and the GPU helper are up (its control socket's path is taken by a
// file) leaves no mount, no helper process and no counters behind, and
// the next mount serves.
func TestMountFailureReleasesAll(t *testing.T) {
	// Serial: it counts every tensorfs process, other tests' daemons included.
	requireEnvironment(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := alloc.StatePath(dir, ".sock")
	if err := alloc.MakeStateDir(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sock, []byte("not a socket"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(sock) })
	before := processesOf(tensorfs)
	out, err := runTimeout(commandTimeout, tensorfs, "mount", "-f", "--gpu", "sim", dir)
	if err == nil {
		runTimeout(commandTimeout, tensorfs, "unmount", "--purge", dir)
		t.Fatalf("mount with its socket path taken succeeded:\n%s", out)
	}
	if !strings.Contains(out, "control socket") {
		t.Errorf("the failure does not say what failed:\n%s", out)
	}
	if isMounted(dir) {
		t.Errorf("the failed mount left %s mounted", dir)
		lazyUnmount(dir)
	}
	if after := processesOf(tensorfs); after > before {
		t.Errorf("%d processes of %s run after the failed mount, %d before (the GPU helper?)", after, tensorfs, before)
	}
	if _, err := os.Stat(alloc.StatePath(dir, ".refcounters")); err == nil {
		t.Errorf("the failed mount left its counters directory")
	}
	os.Remove(sock)
	m := startMount(t, dir, "passthrough", []string{"--gpu", "sim"}, false)
	if err := os.WriteFile(m.path("x"), []byte("served"), 0o644); err != nil {
		t.Errorf("the next mount does not serve: %v", err)
	}
}

// processesOf counts the live processes running the executable exe.
func processesOf(exe string) int {
	n := 0
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if p, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe")); err == nil && p == exe {
			n++
		}
	}
	return n
}
