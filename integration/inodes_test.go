package integration

// The ledger's inodes row (DESIGN.md section 9): what a user makes in the
// backing counts against a sixteenth of its inodes, in the units tmpfs
// takes from that pool (objects, further names, a KiB of attributes, and
// segments removed while open), as unprivileged users on a real mount.

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

// inodeFillScript makes objects of every kind in argv[1] until a make is
// refused, and prints how many it made and the refusal's errno name.
const inodeFillScript = `
import errno, os, sys
d, made = sys.argv[1], 0
makers = [lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)),
          os.mkdir, lambda p: os.symlink("x", p), os.mkfifo]
try:
    while made < 100000:
        makers[made % 4](os.path.join(d, "o%d" % made))
        made += 1
    print(made, "none")
except OSError as e:
    print(made, errno.errorcode[e.errno])
`

// TestInodesPerUser (ledger row "inodes"): a user who makes objects of
// every kind stops at its share of the backing's inodes with EDQUOT; the
// refused make leaves nothing; another user and root still make theirs;
// a removal gives a place back; the mount's statistics show the charge.
func TestInodesPerUser(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m) // a and b, made by root and given to A and B: charged to them
		const share = 512 / 16
		out := strings.Fields(pythonAs(t, userA, "/", inodeFillScript, m.path("a")))
		if len(out) != 2 || out[1] != "EDQUOT" || out[0] != fmt.Sprint(share-1) {
			t.Fatalf("user A made %v objects before a refusal, want %d and EDQUOT (its share of 512 inodes, its directory included)", out, share-1)
		}
		if _, err := os.Lstat(m.path(fmt.Sprintf("a/o%d", share-1))); !os.IsNotExist(err) {
			t.Errorf("the refused make left its name: %v", err)
		}
		if out, err := runAs(t, userB, "/", "mkdir", m.path("b/mine")); err != nil {
			t.Errorf("user B, while A holds its share: %v\n%s", err, out)
		}
		if err := os.Mkdir(m.path("roots"), 0o755); err != nil {
			t.Errorf("root, while A holds its share: %v", err)
		}
		if out, err := runAs(t, userA, "/", "rm", m.path("a/o0")); err != nil {
			t.Fatalf("rm: %v\n%s", err, out)
		}
		if out, err := runAs(t, userA, "/", "touch", m.path("a/again")); err != nil {
			t.Errorf("user A after a removal: %v\n%s", err, out)
		}
		if got := ledgerHeld(t, m, "inodes", userA); got != share {
			t.Errorf("the ledger charges user A %d inodes, want %d", got, share)
		}
		// A user sees what it holds itself, and no other uid.
		seen := pythonAs(t, userA, "/", `
import json, os, sys
for r in json.loads(os.getxattr(sys.argv[1], "user.tensorfs.stats"))["ledger"]:
    print(" ".join(sorted((r.get("by_uid") or {}).keys())))`, m.dir)
		for _, line := range strings.Split(strings.TrimSpace(seen), "\n") {
			if line != "" && line != fmt.Sprint(userA) {
				t.Errorf("user A's user.tensorfs.stats names uids %q, want only its own", line)
			}
		}
		wantLog(t, m, "refused", fmt.Sprintf("uid %d reached the limit of %d inodes", userA, share))
	}, "--allow-other", "--inodes", "512")
}

// ledgerRow is a row of the ledger in user.tensorfs.stats, as root sees it.
type ledgerRow struct {
	Name   string           `json:"name"`
	PerUID int64            `json:"per_uid"`
	ByUID  map[string]int64 `json:"by_uid"`
}

// ledgerRows reads the ledger's rows of the mount at mnt.
func ledgerRows(t *testing.T, mnt string) []ledgerRow {
	t.Helper()
	var st struct{ Ledger []ledgerRow }
	raw, err := getxattr(mnt, statsXattr)
	if err == nil {
		err = json.Unmarshal(raw, &st)
	}
	if err != nil || len(st.Ledger) == 0 {
		t.Fatalf("stats' ledger of %s: %v %s", mnt, err, raw)
	}
	return st.Ledger
}

// ledgerRowOf returns the mount's ledger row whose name starts with row.
func ledgerRowOf(t *testing.T, mnt, row string) ledgerRow {
	t.Helper()
	rows := ledgerRows(t, mnt)
	for _, r := range rows {
		if strings.HasPrefix(r.Name, row) {
			return r
		}
	}
	t.Fatalf("stats' ledger of %s has no row %q: %+v", mnt, row, rows)
	return ledgerRow{}
}

// ledgerHeld returns what uid holds in the mount's ledger row whose name
// starts with row, from user.tensorfs.stats.
func ledgerHeld(t *testing.T, m *mount, row string, uid int) int64 {
	t.Helper()
	return ledgerRowOf(t, m.dir, row).ByUID[fmt.Sprint(uid)]
}

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

// TestAttackInodesXattrs (ledger row "inodes"): tmpfs charges a user.*
// attribute's bytes to the room of its inodes (free_ispace, 1 KiB an
// inode), so one user who owns a single segment, well within her
// sixteenth of the inodes, fills the whole backing's inode room with
// attributes on it. The ledger charges her one inode; root and every other
// user then get ENOSPC from every create and mkdir. Her attributes must
// stop at her share, as her objects do.
func TestAttackInodesXattrs(t *testing.T) {
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

// TestAttackInodesLinks (ledger row "inodes"): tmpfs takes an inode
// of its nr_inodes for every hard link past a file's first name
// (shmem_link: tmpfs dentries pin memory until unlinked), but LINK
// charges nobody in the ledger. One user who owns one segment links it
// until the backing has no inode left: root and every other user get
// ENOSPC from every create and mkdir.
func TestAttackInodesLinks(t *testing.T) {
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

// TestAttackInodesUnlinkedOpen (ledger row "inodes"): an unlink gives the
// inode's charge back when its last name goes, but tmpfs keeps the inode
// while it is open. A user who keeps each segment she makes open and
// removes its name is charged nothing in the inodes row and holds as many
// inodes as her descriptor share (a sixteenth of half the open-file
// limit, far above her sixteenth of the inodes; in passthrough a mapping
// kept after close holds one with no descriptor at all): the backing runs
// out and root's mkdir is ENOSPC.
func TestAttackInodesUnlinkedOpen(t *testing.T) {
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
