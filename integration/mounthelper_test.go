package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMountHelper drives tensorfs the way mount(8) does for
// "mount -t fuse.tensorfs" and fstab entries: through a link named
// mount.fuse.tensorfs, called as "SPEC DIR -o OPTIONS".
func TestMountHelper(t *testing.T) {
	t.Parallel()
	requireEnvironment(t)
	dir := t.TempDir()
	helper := filepath.Join(dir, "mount.fuse.tensorfs")
	if err := os.Symlink(tensorfs, helper); err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}

	out, err := exec.Command(helper, "tensorfs", mp, "-o", "rw,capacity=64M,no_passthrough,nofail,x-systemd.automount").CombinedOutput()
	if err != nil {
		t.Fatalf("mount helper: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if isMounted(mp) {
			exec.Command(tensorfs, "unmount", "--purge", mp).Run()
		}
	})
	var st unix.Statfs_t
	if err := unix.Statfs(mp, &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(st.Blocks) * st.Bsize; size != 64<<20 {
		t.Errorf("capacity=64M gave a %d-byte mount", size)
	}
	raw, err := getxattr(mp, statsXattr)
	if err != nil {
		t.Fatal(err)
	}
	var stats map[string]any
	if err := json.Unmarshal(raw, &stats); err != nil {
		t.Fatal(err)
	}
	if stats["mode"] != "classic" {
		t.Errorf("no_passthrough gave mode %v", stats["mode"])
	}
	if out, err := exec.Command(tensorfs, "unmount", "--purge", mp).CombinedOutput(); err != nil {
		t.Fatalf("unmount: %v: %s", err, out)
	}
	if isMounted(mp) {
		t.Fatal("still mounted after unmount")
	}

	out, err = exec.Command(helper, "tensorfs", mp, "-o", "capacity=64M,bogus").CombinedOutput()
	if err == nil || isMounted(mp) {
		t.Fatalf("an unknown option mounted anyway: %s", out)
	}
	if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); len(lines) != 1 || !strings.Contains(lines[0], `unknown option "bogus"`) {
		t.Errorf("unknown option: want one line naming it, got %q", out)
	}
}
