package integration

// Attacks on GPU segments' reference counter files (DESIGN.md §9): a
// reader may write its segment's counter, and neither the counter file,
// its fallocate(KEEP_SIZE) or user.* attributes, nor a removed counter it
// still holds, take the counters' tmpfs from other users.

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

// keepSizeFillScript fills the tmpfs of the counter file argv[1] with
// fallocate(FALLOC_FL_KEEP_SIZE): its size stays 8 bytes, its blocks take
// every free page; it prints the file's size and 512-byte blocks.
const keepSizeFillScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
p = sys.argv[1]
fd = os.open(p, os.O_RDWR)
free = os.statvfs(p).f_bavail * os.statvfs(p).f_frsize
r = libc.fallocate(fd, 1, ctypes.c_long(4096), ctypes.c_long(free))
st = os.fstat(fd)
print(r, ctypes.get_errno(), st.st_size, st.st_blocks)
`

// TestAttackGPUCounterKeepSize (G2): a reader of a GPU segment (here its
// owner) may write its counter file, and fallocate(FALLOC_FL_KEEP_SIZE)
// on it takes every page of the counters' 64 MiB tmpfs while the file
// stays 8 bytes long. The daemon cuts back only counters longer than 8
// bytes (CounterDir.trim), so it finds nothing to cut: every other
// segment's counter, root's included, is then ENOSPC. One user must not
// take the counters of others: root's new segment gets its counter.
func TestAttackGPUCounterKeepSize(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	out := strings.Fields(pythonAs(t, userA, "/", keepSizeFillScript, counter))
	t.Logf("uid %d's fallocate(KEEP_SIZE) of its counter: rc errno size blocks = %v", userA, out)
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(counter), &fs); err == nil {
		t.Logf("counters' tmpfs: %d of %d blocks free", fs.Bfree, fs.Blocks)
	}
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters with its own: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
}

// removedHeldScript holds the counter file argv[1] by a read-write and an
// O_PATH descriptor, says "held", and at the next line on stdin (its
// segment removed) tries through them what a reader of a removed counter
// could: open it read-write again (/proc/self/fd of the O_PATH one), set
// a user.* attribute, and reserve every free page of the counters' tmpfs
// past its end with fallocate(FALLOC_FL_KEEP_SIZE). It prints "reopen" and
// "setxattr" with ok or the errno, the fallocate's result and errno, the
// file's links and the tmpfs's free blocks, and holds the file until its
// stdin closes.
const removedHeldScript = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDWR)
path_fd = os.open(sys.argv[1], os.O_PATH)
print("held")
sys.stdin.readline()
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return str(e.errno)
reopen = attempt(lambda: os.open("/proc/self/fd/%d" % path_fd, os.O_RDWR))
setx = attempt(lambda: os.setxattr(fd, "user.x", b"x" * 4096))
free = os.fstatvfs(fd).f_bavail * os.fstatvfs(fd).f_frsize
r = libc.fallocate(fd, 1, ctypes.c_long(4096), ctypes.c_long(free))
e = ctypes.get_errno()
print("reopen", reopen, "setxattr", setx, "fallocate", r, e, "links", os.fstat(fd).st_nlink, "free", os.fstatvfs(fd).f_bavail)
sys.stdin.read()
`

// TestAttackGPUCounterRemovedHeld: the daemon removes a GPU segment's
// counter file with its segment, and a reader who still holds it open
// keeps it, nameless, beyond what trim reached (the names in the
// counters' directory): uid 1000 holds the counter of a segment of its
// own, the segment is removed, and through its descriptor uid 1000 fills
// the counters' tmpfs (fallocate KEEP_SIZE), so that every new counter,
// root's included, would be ENOSPC for as long as it keeps the file. The
// daemon keeps a removed counter that someone holds, takes the readers'
// access to it away (no reopen through an O_PATH descriptor, no user.*
// attributes), and puts back what is reserved through it: root's new
// segment gets its counter.
func TestAttackGPUCounterRemovedHeld(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	holder := startPythonAs(t, userA, "holder", removedHeldScript, counter)
	holder.expect(t, "held")
	if err := os.Remove(seg); err != nil {
		t.Fatal(err)
	}
	eventually(t, "removal of the counter "+counter, func() (bool, string) {
		_, err := os.Lstat(counter)
		return os.IsNotExist(err), fmt.Sprintf("lstat: %v", err)
	})
	out := holder.do(t, "go")
	t.Logf("uid %d through its removed counter: %s", userA, out)
	f := strings.Fields(out)
	if len(f) != 11 || f[0] != "reopen" || f[2] != "setxattr" || f[4] != "fallocate" {
		t.Fatalf("holder: %q", out)
	}
	if f[5] != "0" || f[10] != "0" {
		t.Fatalf("uid %d's fallocate through its removed counter did not fill the counters' tmpfs: %s", userA, out)
	}
	if denied := fmt.Sprint(int(unix.EACCES)); f[1] != denied || f[3] != denied {
		t.Errorf("uid %d on its removed counter: reopen through O_PATH %s, setxattr %s; want both EACCES (%s)", userA, f[1], f[3], denied)
	}
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters through a removed counter it holds: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
	holder.wait(t)
}

// xattrFillScript sets user.* attributes on the counter file argv[1], as
// its write permission lets a reader, until the tmpfs refuses one at
// every size; it prints how many it set and the inodes left free.
const xattrFillScript = `
import os, sys
p, n = sys.argv[1], 0
for size in (65536, 4096, 256, 16, 0):
    try:
        while True:
            os.setxattr(p, "user.x%d" % n, b"x" * size)
            n += 1
    except OSError:
        pass
print(n, os.statvfs(p).f_ffree)
`

// TestAttackGPUCounterXattrs (G2): tmpfs charges user.* attributes to
// the room its inodes share (nr_inodes), and a reader of a GPU segment
// may set them on its counter file (write permission is all it takes):
// enough of them leave no room for another counter file, so every new
// counter, root's included, is ENOSPC. One user must not take the
// counters of others: root's new segment gets its counter.
func TestAttackGPUCounterXattrs(t *testing.T) {
	t.Parallel()
	m := agMount(t)
	seg := agSegment(t, m, "mine", 4096, userA, userA, 0o600)
	counter := agCounter(t, seg)
	out := strings.Fields(pythonAs(t, userA, "/", xattrFillScript, counter))
	t.Logf("uid %d's user.* attributes on its counter: set, inodes free = %v", userA, out)
	root := gtDeviceSegment(t, m.path("roots"))
	run(t, "truncate", "-s", "4096", root)
	if v, err := getxattr(root, gtRefCounter); err != nil {
		t.Errorf("root's segment's %s after uid %d filled the counters' inodes with attributes: %v", gtRefCounter, userA, err)
	} else {
		t.Logf("root's counter: %s", v)
	}
}
