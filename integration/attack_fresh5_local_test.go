package integration

// Attacks of the fifth fresh round on the local daemon (L*), each run as an
// unprivileged user against a real mount, in both modes. Each fails on the
// code it was found in; the daemon is the lead's to fix.

import (
	"os"
	"strings"
	"testing"
	"time"
)

// l1XattrFillScript sets user.* attributes of 4000 bytes on the file
// argv[1] (creating it) until one is refused, and prints how many it set
// and the refusal's errno name.
const l1XattrFillScript = `
import errno, os, sys
p, n = sys.argv[1], 0
os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
try:
    while n < 100000:
        os.setxattr(p, "user.fill%d" % n, b"x" * 4000)
        n += 1
    print(n, "none")
except OSError as e:
    print(n, errno.errorcode[e.errno])
`

// TestL1XattrsTakeEveryInode (ledger row "inodes"): tmpfs charges a user.*
// attribute's bytes to the room of its inodes (free_ispace, 1 KiB an
// inode), so one user who owns a single segment, well within her
// sixteenth of the inodes, fills the whole backing's inode room with
// attributes on it. The ledger charges her one inode; root and every other
// user then get ENOSPC from every create and mkdir. Her attributes must
// stop at her share, as her objects do.
func TestL1XattrsTakeEveryInode(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		out := strings.Fields(pythonAs(t, userA, "/", l1XattrFillScript, m.path("a/f")))
		t.Logf("user A set %v attributes of 4000 bytes on one segment", out)
		if out, err := runAs(t, userB, "/", "mkdir", m.path("b/mine")); err != nil {
			t.Errorf("user B cannot make a directory once A filled one segment's attributes: %v\n%s", err, out)
		}
		if err := os.Mkdir(m.path("roots"), 0o755); err != nil {
			t.Errorf("root cannot make a directory once A filled one segment's attributes: %v", err)
		}
	}, "--allow-other", "--inodes", "512")
}

// linkFillScript makes one segment argv[1]/f and hard links to it in
// argv[1] until a link is refused, and prints how many it made and the
// refusal's errno name.
const linkFillScript = `
import errno, os, sys
d, n = sys.argv[1], 0
os.close(os.open(d + "/f", os.O_CREAT | os.O_WRONLY, 0o644))
try:
    while n < 100000:
        os.link(d + "/f", "%s/l%d" % (d, n))
        n += 1
    print(n, "none")
except OSError as e:
    print(n, errno.errorcode[e.errno])
`

// TestL2LinksTakeEveryInode (ledger row "inodes"): tmpfs takes an inode
// of its nr_inodes for every hard link past a file's first name
// (shmem_link: tmpfs dentries pin memory until unlinked), but LINK
// charges nobody in the ledger. One user who owns one segment links it
// until the backing has no inode left: root and every other user get
// ENOSPC from every create and mkdir.
func TestL2LinksTakeEveryInode(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		out := strings.Fields(pythonAs(t, userA, "/", linkFillScript, m.path("a")))
		t.Logf("user A made %v hard links to one segment", out)
		if out, err := runAs(t, userB, "/", "mkdir", m.path("b/mine")); err != nil {
			t.Errorf("user B cannot make a directory once A linked one segment over and over: %v\n%s", err, out)
		}
		if err := os.Mkdir(m.path("roots"), 0o755); err != nil {
			t.Errorf("root cannot make a directory once A linked one segment over and over: %v", err)
		}
	}, "--allow-other", "--inodes", "512")
}

// unlinkedFillScript creates segments in argv[1], keeps each open and
// removes its name, until a create is refused; it prints how many it
// holds and the refusal's errno name, and holds them until its stdin
// closes.
const unlinkedFillScript = `
import errno, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
d, fds, why = sys.argv[1], [], "none"
try:
    while len(fds) < 4000:
        p = "%s/u%d" % (d, len(fds))
        fds.append(os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        os.unlink(p)
except OSError as e:
    why = errno.errorcode[e.errno]
print(len(fds), why, flush=True)
sys.stdin.read()
`

// TestL3UnlinkedOpenInodes (ledger row "inodes"): an unlink gives the
// inode's charge back when its last name goes, but tmpfs keeps the inode
// while it is open. A user who keeps each segment she makes open and
// removes its name is charged nothing in the inodes row and holds as many
// inodes as her descriptor share (a sixteenth of half the open-file
// limit, far above her sixteenth of the inodes; in passthrough a mapping
// kept after close holds one with no descriptor at all): the backing runs
// out and root's mkdir is ENOSPC.
func TestL3UnlinkedOpenInodes(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		got := h4Background(t, userA, unlinkedFillScript, m.path("a"))
		t.Logf("user A holds %s open segments without names", got)
		if err := os.Mkdir(m.path("roots"), 0o755); err != nil {
			t.Errorf("root cannot make a directory while A holds open segments she removed: %v", err)
		}
	}, "--allow-other", "--inodes", "512")
}

// statsByUIDScript prints, from the mount root argv[1]'s
// user.tensorfs.stats, what each ledger row says uid argv[2] holds.
const statsByUIDScript = `
import json, os, sys
s = json.loads(os.getxattr(sys.argv[1], "user.tensorfs.stats"))
for r in s.get("ledger", []):
    n = (r.get("by_uid") or {}).get(sys.argv[2])
    if n:
        print(r["name"].split(" ")[0], n)
`

// TestL4StatsNameUsers (no information beyond tmpfs): user.tensorfs.stats
// is everyone's to read ("it names no segment, directory or user", as df
// and df -i), but its ledger rows list what each uid holds: user A learns
// how many objects user B keeps in a directory only B may list or
// search (0700), and how many segments B has open right now, which no
// tmpfs tells another user.
func TestL4StatsNameUsers(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		if out, err := runAs(t, userB, "/", "sh", "-c",
			"umask 077 && mkdir "+m.path("b/private")+" && cd "+m.path("b/private")+" && touch s1 s2 s3 s4 s5 s6 s7"); err != nil {
			t.Fatalf("user B: %v\n%s", err, out)
		}
		out := strings.TrimSpace(pythonAs(t, userA, "/", statsByUIDScript, m.dir, "1001"))
		if out != "" {
			t.Errorf("user A reads from user.tensorfs.stats what uid %d holds (objects in its 0700 directory among them):\n%s", userB, out)
		}
	}, "--allow-other")
}

// TestL5LimboCountsAskedNotAllocated (GPU limbo against --capacity): a
// device allocation is rounded up to the device's granularity (2 MiB for
// the simulated device, as cuMemAlloc's), but a block in limbo is counted
// against the capacity by the bytes its segment asked for. User A holds
// one handle of her GPU segment and grows it to one page, reads its IPC
// handle and empties it, again and again: each round leaves 2 MiB of
// device memory in limbo and is charged 4 KiB, so a 64 MiB mount lets her
// take 32 GiB of device memory: the whole device. Root's new GPU segment
// then cannot get a page.
func TestL5LimboCountsAskedNotAllocated(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		atk := gtDeviceSegment(t, m.path("a/leak"))
		if err := os.Chown(atk, userA, userA); err != nil {
			t.Fatal(err)
		}
		line := h4Background(t, userA, limboFillScript, atk, "4096")
		_, limbo := gtLimbo(t, m)
		t.Logf("uid %d: %s; limbo %d bytes as counted", userA, line, limbo)
		root := gtDeviceSegment(t, m.path("rootgpu"))
		if err := os.Truncate(root, 4096); err != nil {
			t.Errorf("root's one-page GPU segment while uid %d holds %d bytes (as counted) in limbo on a 64 MiB mount: %v", userA, limbo, err)
		}
	}, append(gtSim, "--allow-other", "--capacity", "64M")...)
}

// hiddenMapScript makes the UNLINK segment argv[1], maps it, closes it,
// and ends its main thread alone (SYS_exit) while another thread keeps
// the mapping until stdin closes: /proc/PID, which the daemon scans, is
// then a zombie leader whose maps are empty, and the mapping lives on in
// a thread that /proc lists only under /proc/PID/task.
const hiddenMapScript = `
import ctypes, mmap, os, sys, threading, time
p = sys.argv[1]
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
os.setxattr(p, "user.tensorfs.flags", b"UNLINK")
os.ftruncate(fd, 4096)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
ctypes.memmove(addr, b"alive", 5)
os.close(fd)  # Python's mmap would keep a dup of fd open: libc's keeps none
def hold():
    time.sleep(0.3)
    print("mapped", flush=True)
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=hold).start()
libc.syscall(60, 0)
`

// TestL6ZombieLeaderHidesMapping (mapping scan: "unmapped" when it could
// not see): the scan reads /proc/PID/maps of each process listed in
// /proc, and a process whose leader thread exited alone has an empty one
// there (its mm is its other threads'), which the scan takes for a
// process that maps nothing. User A maps her UNLINK segment, closes it
// and lets only her main thread exit: the watch finds no mapping and
// removes the name while her process still maps the segment, and
// refcount and holders say nobody holds it. Passthrough fails; classic
// holds here only because a mapping through the mount keeps its FUSE
// handle (a mapping of a descriptor from load or export, or recovery's
// check after kill -9, would read the same empty maps).
func TestL6ZombieLeaderHidesMapping(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		seg := m.path("a/tmp")
		if got := h4Background(t, userA, hiddenMapScript, seg); got != "mapped" {
			t.Fatalf("holder: %q", got)
		}
		time.Sleep(3 * time.Second) // the watch backs off to 1 s
		if _, err := os.Lstat(seg); err != nil {
			t.Errorf("the UNLINK segment lost its name while uid %d's process still maps it (its leader thread exited): %v", userA, err)
			return
		}
		if v, err := getxattr(seg, "user.tensorfs.refcount"); err != nil || string(v) == "0" {
			t.Errorf("refcount of a segment uid %d's process maps: %q %v", userA, v, err)
		}
	}, "--allow-other")
}
