package fs

import (
	"errors"
	"syscall"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ledger"
)

// TestInodesCharged: every way of making an object charges its maker's
// inodes, past a user's share it is EDQUOT and makes nothing, others and
// root go on; every way an object goes gives its charge back; a chown
// moves it; a walk of the backing at mount counts what the requests did.
func TestInodesCharged(t *testing.T) {
	fsys := testFS(t)
	fsys.inodes = &inodes{of: map[uint64]*inodeCharge{}, row: ledger.New().Row(ledger.Spec{Name: "inodes", Unit: "inode",
		PerUID: 4, Total: 64, Over: syscall.EDQUOT, Full: syscall.ENOSPC})}
	root := &fsys.root.dirNode
	user, other := callerCtx(1000), callerCtx(1001)
	held := func(uid uint32) int64 { return fsys.inodes.row.Held(uid) }
	var out fuse.EntryOut

	if _, errno := root.Mkdir(user, "d", 0o755, &out); errno != 0 {
		t.Fatalf("mkdir: %v", errno)
	}
	_, fh, _, errno := root.Create(user, "f", unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatalf("create: %v", errno)
	}
	fh.(fusefs.FileReleaser).Release(user)
	if _, errno := root.Symlink(user, "f", "s", &out); errno != 0 {
		t.Fatalf("symlink: %v", errno)
	}
	if _, errno := root.Mknod(user, "p", syscall.S_IFIFO|0o644, 0, &out); errno != 0 {
		t.Fatalf("mknod: %v", errno)
	}
	if n := held(1000); n != 4 {
		t.Fatalf("uid 1000 is charged %d inodes for 4 objects", n)
	}
	if _, errno := root.Mkdir(user, "e", 0o755, &out); errno != syscall.EDQUOT {
		t.Errorf("mkdir past the share: %v, want EDQUOT", errno)
	}
	if _, _, _, errno := root.Create(user, "g", unix.O_RDWR, 0o644, &out); errno != syscall.EDQUOT {
		t.Errorf("create past the share: %v, want EDQUOT", errno)
	}
	var st unix.Stat_t
	for _, name := range []string{"e", "g"} {
		if unix.Fstatat(fsys.store.RootFd, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil {
			t.Errorf("a refused make left %s behind", name)
		}
	}
	if _, errno := root.Mkdir(other, "o", 0o755, &out); errno != 0 {
		t.Errorf("another user: %v", errno)
	}
	if _, errno := root.Mkdir(callerCtx(0), "r", 0o755, &out); errno != 0 {
		t.Errorf("root: %v", errno)
	}

	// A chown to a user at its share is refused and changes nothing.
	r := child(t, root, "r").Operations().(*dirNode)
	errno = r.Setattr(callerCtx(0), nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{Valid: fuse.FATTR_UID, Owner: fuse.Owner{Uid: 1000}}}, new(fuse.AttrOut))
	if errno != syscall.EDQUOT {
		t.Errorf("chown to a user at its share: %v, want EDQUOT", errno)
	}
	if unix.Fstatat(fsys.store.RootFd, "r", &st, 0) != nil || st.Uid != 0 || held(0) != 1 {
		t.Errorf("after a refused chown: owner %d, root charged %d", st.Uid, held(0))
	}

	// What goes gives back: unlink, rmdir, a rename over a name.
	if errno := root.Unlink(user, "p"); errno != 0 {
		t.Fatal(errno)
	}
	if errno := root.Rmdir(user, "d"); errno != 0 {
		t.Fatal(errno)
	}
	if errno := root.Rename(user, "s", root, "f", 0); errno != 0 {
		t.Fatal(errno)
	}
	if n := held(1000); n != 1 {
		t.Errorf("after unlink, rmdir and a rename over a name uid 1000 is charged %d, want 1", n)
	}

	// An O_TMPFILE segment is charged while open and unnamed.
	_, tfh, _, errno := root.Tmpfile(user, unix.O_RDWR, 0o600, &out)
	if errno != 0 {
		t.Fatal(errno)
	}
	if n := held(1000); n != 2 {
		t.Errorf("with an O_TMPFILE segment open uid 1000 is charged %d, want 2", n)
	}
	tfh.(*fileHandle).Release(user)
	if n := held(1000); n != 1 {
		t.Errorf("once the O_TMPFILE segment is closed uid 1000 is charged %d, want 1", n)
	}

	// The walk at mount counts the same.
	recount := &inodes{of: map[uint64]*inodeCharge{}, row: ledger.New().Row(ledger.Spec{Name: "inodes", Unit: "inode", PerUID: 4, Total: 64})}
	if err := recount.countBacking(fsys.store.RootFd); err != nil {
		t.Fatal(err)
	}
	for _, uid := range []uint32{0, 1000, 1001} {
		if got, want := recount.row.Held(uid), held(uid); got != want {
			t.Errorf("uid %d: the walk counts %d, the requests %d", uid, got, want)
		}
	}
}

// TestInodesNamesAttrsOrphans: as tmpfs counts its pool, a further name
// costs one, a KiB of attributes one, and a segment whose last name went
// while it is open keeps its charge until its last handle goes.
func TestInodesNamesAttrsOrphans(t *testing.T) {
	fsys := testFS(t)
	fsys.inodes = &inodes{of: map[uint64]*inodeCharge{}, row: ledger.New().Row(ledger.Spec{Name: "inodes", Unit: "inode",
		PerUID: 8, Total: 64, Over: syscall.EDQUOT, Full: syscall.ENOSPC})}
	root := &fsys.root.dirNode
	user := callerCtx(1000)
	held := func() int64 { return fsys.inodes.row.Held(1000) }
	var out fuse.EntryOut

	ch, fh, _, errno := root.Create(user, "f", unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatal(errno)
	}
	root.AddChild("f", ch, false)
	seg := ch.Operations().(*segmentNode)
	if _, errno := root.Link(user, seg, "g", &out); errno != 0 {
		t.Fatal(errno)
	}
	if n := held(); n != 2 {
		t.Errorf("a segment and a further name: charged %d, want 2", n)
	}
	if errno := seg.Setxattr(user, "user.big", make([]byte, 4000), 0); errno != 0 {
		t.Fatal(errno)
	}
	if n := held(); n != 6 {
		t.Errorf("with 4000 bytes of attribute: charged %d, want 6 (4 KiB of attributes)", n)
	}
	if errno := seg.Setxattr(user, "user.more", make([]byte, 4000), 0); errno != syscall.EDQUOT {
		t.Errorf("an attribute past the share: %v, want EDQUOT", errno)
	}
	if errno := seg.Removexattr(user, "user.big"); errno != 0 {
		t.Fatal(errno)
	}
	if errno := root.Unlink(user, "g"); errno != 0 {
		t.Fatal(errno)
	}
	if n := held(); n != 1 {
		t.Errorf("after removing the attribute and the further name: charged %d, want 1", n)
	}
	// The last name goes while f is open: tmpfs keeps the inode, and so
	// does the charge, until the handle goes.
	if errno := root.Unlink(user, "f"); errno != 0 {
		t.Fatal(errno)
	}
	if n := held(); n != 1 {
		t.Errorf("unlinked while open: charged %d, want 1", n)
	}
	fh.(fusefs.FileReleaser).Release(user)
	fsys.reclaims.Wait()
	if n := held(); n != 0 {
		t.Errorf("once its last handle went: charged %d, want 0", n)
	}
}

// TestInodesCountCut: a count at mount that cannot walk a directory never
// concludes that what it holds is free: the directory's owner is charged
// her whole share on top (here the walk cannot even start: what it was
// given is a file of uid 1000's, not a directory).
func TestInodesCountCut(t *testing.T) {
	dir := t.TempDir()
	p := dir + "/notadir"
	fd, err := unix.Open(p, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	if err := unix.Chown(p, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if fd, err = unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	c := &inodes{of: map[uint64]*inodeCharge{}, row: ledger.New().Row(ledger.Spec{Name: "inodes", Unit: "inode", PerUID: 4, Total: 64})}
	var cut *alloc.CutError
	if err := c.countBacking(fd); !errors.As(err, &cut) {
		t.Fatalf("countBacking: %v, want an *alloc.CutError", err)
	}
	if got, want := c.row.Held(1000), c.row.Spec().PerUID; got != want {
		t.Errorf("uid 1000 owns the directory the count could not walk: charged %d, want her share, %d", got, want)
	}
}
