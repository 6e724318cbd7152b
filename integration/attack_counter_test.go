package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// acTamper is what the owner of a segment tries on its counter file
// argv[1]: chmod 4777, chown to itself, and writing 200 MiB past its
// count; one line each, "ok" or the error's name, the last with how many
// MiB went in.
const acTamper = `
import errno, os, sys
p = sys.argv[1]
def try_(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print("chmod", try_(lambda: os.chmod(p, 0o4777)))
print("chown", try_(lambda: os.chown(p, os.getuid(), os.getgid())))
written = 0
def fill():
    global written
    fd = os.open(p, os.O_WRONLY)
    try:
        chunk = b"\0" * (1 << 20)
        while written < 200 << 20:
            written += os.pwrite(fd, chunk, 8 + written)
    finally:
        os.close(fd)
print("fill", try_(fill), written >> 20)
`

// TestAttackGPUCounterFile (security finding F5): the counter file of a
// segment owned by an unprivileged user is not that user's file. On a
// --gpu sim --allow-other mount, uid 1000's 0600 segment has a counter
// that belongs to root, lies on the daemon's own bounded tmpfs (nosuid,
// nodev, noexec), and that uid 1000 can count with but not chmod 4777,
// chown, or grow past that tmpfs; the daemon cuts it back to 8 bytes when
// it reads it. uid 1001 cannot open it. The tmpfs goes with the unmount.
func TestAttackGPUCounterFile(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 2*gtMiB, userA, userA, 0o600)
	counter := agCounter(t, seg)
	dir := filepath.Dir(counter)

	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC || fs.Blocks*uint64(fs.Bsize) != 64<<20 {
		t.Errorf("counter directory %s: type %#x, %d bytes (%v); want a tmpfs of 64 MiB", dir, fs.Type, fs.Blocks*uint64(fs.Bsize), err)
	}
	if want := int64(unix.ST_NOSUID | unix.ST_NODEV | unix.ST_NOEXEC); fs.Flags&want != want {
		t.Errorf("counter tmpfs flags %#x, want nosuid, nodev, noexec", fs.Flags)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(counter, &st); err != nil || st.Uid != 0 || st.Gid != userA || st.Mode&0o7777 != 0o660 || st.Size != 8 {
		t.Errorf("counter of uid %d's 0600 segment: %d:%d mode %#o, %d bytes (%v); want 0:%d 0660 (an ACL grants uid %d), 8 bytes",
			userA, st.Uid, st.Gid, st.Mode&0o7777, st.Size, err, userA, userA)
	}

	if got := agAdd(t, userA, counter, 1); got != "1" {
		t.Fatalf("uid %d increments its counter: %q, want 1", userA, got)
	}
	if got := agCanOpen(t, userB, "rw", counter); got != "denied" {
		t.Errorf("uid %d opens the counter of uid %d's 0600 segment: %s", userB, userA, got)
	}
	out := strings.Fields(pythonAs(t, userA, "/", acTamper, counter))
	if len(out) != 7 || strings.Join(out[:6], " ") != "chmod EPERM chown EPERM fill ENOSPC" {
		t.Errorf("uid %d on its counter: %q; want chmod EPERM, chown EPERM, fill ENOSPC", userA, out)
	} else if mib, err := strconv.Atoi(out[6]); err != nil || mib > 64 {
		t.Errorf("uid %d wrote %s MiB into its counter before ENOSPC, want at most 64", userA, out[6])
	}
	if err := syscall.Stat(counter, &st); err != nil || st.Uid != 0 || st.Mode&0o7000 != 0 || st.Size > 64<<20 {
		t.Errorf("counter after the attempts: owner %d, mode %#o, %d bytes (%v)", st.Uid, st.Mode&0o7777, st.Size, err)
	}

	// The daemon reads the counter while the segment's memory waits in
	// limbo: the file goes back to 8 bytes, the count is kept.
	run(t, "rm", seg)
	eventually(t, "unlinked while counted", gtLimboIs(t, m, 1, 2*gtMiB))
	eventually(t, "the counter cut back to 8 bytes", func() (bool, string) {
		var st syscall.Stat_t
		err := syscall.Stat(counter, &st)
		return err == nil && st.Size == 8, fmt.Sprintf("counter: %d bytes (%v)", st.Size, err)
	})
	if v := agValue(t, counter); v != 1 {
		t.Errorf("count after the file was cut back = %d, want 1", v)
	}
	eventually(t, "the grown counter logged", func() (bool, string) { // written just after the cut
		return strings.Contains(m.stderr.String(), "reference counter file changed behind the daemon"), tail(m.stderr.String())
	})
	if got := agAdd(t, userA, counter, -1); got != "0" {
		t.Fatalf("uid %d decrements its counter: %q, want 0", userA, got)
	}
	gtWantLimboEmpty(t, m, "count back to 0")

	m.unmount(t, true)
	for _, e := range readMountinfo() {
		if e.mountPoint == dir {
			t.Errorf("the counters' tmpfs %s is still mounted after unmount", dir)
			lazyUnmount(dir)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("counter directory after unmount: %v", err)
	}
}
