package integration

// Attacks by ioctl: no ioctl reaches a backing file or directory with
// the daemon's rights. Runs as an unprivileged user in both modes.

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestAttackIoctl (F9): no ioctl reaches a backing file or directory: on
// a segment of a SHARED directory (its bytes on an ext4 --disk), FITRIM
// and FS_IOC_GETVERSION answer ENOTTY, and so do FS_IOC_GETFLAGS and
// FS_IOC_SETFLAGS (the immutable flag) on a directory.
func TestAttackIoctl(t *testing.T) {
	t.Parallel()
	forEachModeOnce(t, func(t *testing.T, mode string) {
		disk := filepath.Join(t.TempDir(), "disk")
		m := mountFS(t, mode, "--allow-other", "--disk", disk)
		reachable(t, m.dir)
		dir := m.path("shared")
		os.Mkdir(dir, 0o1777)
		unix.Chmod(dir, 0o1777)
		out, err := runAs(t, userA, "/", systemPython, "-c", `
import fcntl, os, struct, sys
d = sys.argv[1] + "/mine"
os.mkdir(d)
os.setxattr(d, "user.tensorfs.flags", b"SHARED")
fd = os.open(d + "/seg", os.O_CREAT | os.O_RDWR, 0o600)
os.write(fd, b"x" * 4096)
dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
res = []
for name, f, req, buf in (("FITRIM", fd, 0xc0185879, struct.pack("QQQ", 0, 2**64 - 1, 0)),
                          ("FS_IOC_GETVERSION", fd, 0x80087601, b"\0" * 8),
                          ("FS_IOC_GETFLAGS dir", dfd, 0x80086601, b"\0" * 8),
                          ("FS_IOC_SETFLAGS dir", dfd, 0x40086602, struct.pack("l", 0x10))):
    try:
        fcntl.ioctl(f, req, buf)
        res.append(name + " ran")
    except OSError as e:
        res.append(name + " " + str(e.errno))
print(",".join(res))`, dir)
		if err != nil {
			t.Fatalf("ioctl script: %v\n%s", err, out)
		}
		for _, r := range strings.Split(strings.TrimSpace(out), ",") {
			if !strings.HasSuffix(r, " "+strconv.Itoa(int(syscall.ENOTTY))) {
				t.Errorf("ioctl as uid %d: %s, want ENOTTY", userA, r)
			}
		}
		// The backing directory did not become immutable.
		if err := os.WriteFile(m.path("shared/mine/after"), []byte("ok"), 0o644); err != nil {
			t.Errorf("a file in the directory after the ioctls: %v", err)
		}
	})
}
