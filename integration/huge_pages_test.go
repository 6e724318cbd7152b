package integration

// tensorfs mount --huge-pages (DESIGN.md §2): the private backing is
// mounted huge=within_size, and a tensor user A saves and loads with the
// Python client is mapped in 2 MiB pages; without the flag, 4 KiB pages.
// The flag is refused with --backing, and for a user who is not root.

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
)

// hugeLoadScript (the tensorfs package at argv[1], a directory in a mount
// at argv[2]): user A saves a state dict of one 8 MiB tensor, loads it,
// reads every page and prints the kB of its mappings in 2 MiB pages.
const hugeLoadScript = `
import sys
sys.path.insert(0, sys.argv[1])
import torch, tensorfs
d = sys.argv[2]
tensorfs.save_state_dict(d, {"w": torch.arange(2 << 20, dtype=torch.float32)})
w = tensorfs.load_state_dict(d)["w"]
assert float(w[::1024].sum()) == float(torch.arange(2 << 20, dtype=torch.float64)[::1024].sum())
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("ShmemPmdMapped:"):
        print(line.split()[1])
`

func TestMountHugePages(t *testing.T) {
	t.Parallel()
	modes := []bool{true, false}
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage/shmem_enabled"); err != nil {
		t.Log("this kernel has no transparent huge pages for tmpfs: only the mount without them and the refusals")
		modes = modes[1:]
	}
	for _, huge := range modes {
		args := []string{"--allow-other"}
		if huge {
			args = append(args, "--huge-pages")
		}
		m := mountFS(t, "passthrough", args...)
		reachable(t, m.dir)
		run(t, "mkdir", "-m", "1777", m.path("shared"))
		dir := m.path("shared/model")
		kb := strings.TrimSpace(pythonAs(t, userA, "/", hugeLoadScript, filepath.Join(repoRoot, "python"), dir))
		backing := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.tensorfs.handle", filepath.Join(dir, "w"))
		opts := mountOptionsOf(t, strings.TrimSuffix(backing, "/shared/model/w"))
		if huge && (kb != "8192" || !strings.Contains(opts, "huge=within_size")) {
			t.Errorf("--huge-pages: user A's load maps %s kB in 2 MiB pages, want 8192; the backing's options %s, want huge=within_size", kb, opts)
		}
		if !huge && (kb != "0" || strings.Contains(opts, "huge=")) {
			t.Errorf("without --huge-pages: user A's load maps %s kB in 2 MiB pages, want 0; the backing's options %s, want no huge=", kb, opts)
		}
		if said := strings.Contains(run(t, tensorfs, "status", m.dir), "passthrough, huge pages"); said != huge {
			t.Errorf("tensorfs status of a mount with huge pages %v: says \"huge pages\" %v", huge, said)
		}
		m.unmount(t, true)
	}
	refused := map[string][]string{
		"--backing":       {"--huge-pages", "--backing", t.TempDir()},
		"a user not root": {"--huge-pages"},
	}
	for what, args := range refused {
		dir := filepath.Join(t.TempDir(), "mnt")
		run(t, "mkdir", dir)
		cmd := exec.Command(tensorfs, append(append([]string{"mount"}, args...), dir)...)
		if what == "a user not root" {
			reachable(t, dir)
			run(t, "chown", "1000", dir)
			cmd = asUser(cmd, userA)
		}
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "--huge-pages") {
			t.Errorf("tensorfs mount --huge-pages with %s: %v, %q; want exit status 2 and the reason", what, err, out)
		}
		if mountOptionsOf(t, dir) != "" {
			t.Errorf("tensorfs mount --huge-pages with %s mounted %s", what, dir)
			lazyUnmount(dir)
		}
	}
}

// mountOptionsOf returns the superblock options of the mount at dir ("" if
// dir is no mountpoint).
func mountOptionsOf(t *testing.T, dir string) string {
	t.Helper()
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) == 0 {
		return ""
	}
	return mounts[len(mounts)-1].VFSOptions
}
