package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/ctl"
	"tensorfs/fdpass"
)

// Control requests come from these peers: root, the owner of the shared
// directory, and another user.
var (
	rootPeer  = ctl.Cred{Pid: int32(os.Getpid()), Uid: 0, Gid: 0}
	ownerPeer = ctl.Cred{Pid: int32(os.Getpid()), Uid: 1000, Gid: 1000}
	otherPeer = ctl.Cred{Pid: int32(os.Getpid()), Uid: 1001, Gid: 1001}
)

// controlFS is testFS shared with other users (--allow-other), with a
// directory "pub" of ownerPeer's at mode 0755 holding a KEEPFD segment
// "pub/w" of 8 bytes at mode 0644, made on the backing as the handlers
// would have.
func controlFS(t *testing.T) (controlBackend, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("control permission tests set owners: they need root")
	}
	fsys := testFS(t)
	fsys.allowOther = true
	pub := filepath.Join(fsys.store.Dir, "pub")
	if err := os.Mkdir(pub, 0o755); err != nil {
		t.Fatal(err)
	}
	seg := filepath.Join(pub, "w")
	if err := os.WriteFile(seg, []byte("weights!"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(seg, alloc.StoredName(alloc.AttrFlags), []byte("KEEPFD"), 0); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{pub, seg} {
		if err := os.Chown(p, int(ownerPeer.Uid), int(ownerPeer.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	return controlBackend{fsys}, fsys.store.Dir
}

// memfd returns a readable and writable memfd holding data, ownerPeer's
// where the test is root (as when it imports a memfd of its own: the
// daemon makes no other user's memfd owner-only), 0777 as memfd_create
// leaves it.
func memfd(t *testing.T, data string) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("control-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := unix.Fchown(fd, int(ownerPeer.Uid), int(ownerPeer.Gid)); err != nil {
			unix.Close(fd)
			t.Fatal(err)
		}
	}
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { f.Close() })
	if _, err := f.WriteString(data); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestControlExportPermissions: export hands out a descriptor only with
// the access the segment's mode grants the peer, and only of KEEPFD
// segments.
func TestControlExportPermissions(t *testing.T) {
	b, backing := controlFS(t)
	for _, c := range []struct {
		who   string
		cred  ctl.Cred
		write bool
		want  error
	}{
		{"owner, read", ownerPeer, false, nil},
		{"owner, write", ownerPeer, true, nil},
		{"other, read (0644)", otherPeer, false, nil},
		{"other, write (0644)", otherPeer, true, syscall.EACCES},
		{"root, write", rootPeer, true, nil},
	} {
		f, err := b.Export(c.cred, "pub/w", c.write)
		if !errors.Is(err, c.want) || (err == nil) != (c.want == nil) {
			t.Errorf("export by %s: got %v, want %v", c.who, err, c.want)
		}
		if f != nil {
			buf := make([]byte, 8)
			if n, _ := f.ReadAt(buf, 0); string(buf[:n]) != "weights!" {
				t.Errorf("export by %s reads %q", c.who, buf[:n])
			}
			f.Close()
		}
	}

	if err := os.Chmod(filepath.Join(backing, "pub"), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Export(otherPeer, "pub/w", false); !errors.Is(err, syscall.EACCES) {
		t.Errorf("export through a directory the peer cannot search: got %v, want EACCES", err)
	}
	if err := unix.Removexattr(filepath.Join(backing, "pub", "w"), alloc.StoredName(alloc.AttrFlags)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Export(ownerPeer, "pub/w", false); !errors.Is(err, alloc.ErrReadOnly) {
		t.Errorf("export of a segment without KEEPFD: got %v, want ErrReadOnly", err)
	}
}

// TestControlLeaseNeverWaits: a lease the owner holds on a segment's
// backing file (through a descriptor export gave it) makes a conflicting
// export or load answer EAGAIN at once, naming the segment, instead of
// waiting for lease-break-time; a descriptor handed out never carries the
// O_NONBLOCK the daemon opens with.
func TestControlLeaseNeverWaits(t *testing.T) {
	b, _ := controlFS(t)
	nonblock := func(f *os.File) bool {
		t.Helper()
		fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fl&unix.O_NONBLOCK != 0
	}
	held, err := b.Export(ownerPeer, "pub/w", false)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if nonblock(held) {
		t.Error("an exported descriptor has O_NONBLOCK")
	}
	if _, err := unix.FcntlInt(held.Fd(), unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		t.Skipf("no lease: %v", err)
	}
	start := time.Now()
	f, err := b.Export(rootPeer, "pub/w", true)
	if took := time.Since(start); toErrno(err) != syscall.EAGAIN || !strings.Contains(fmt.Sprint(err), "pub/w") || took > 2*time.Second {
		t.Errorf("write export of a leased segment: %v after %v, want EAGAIN at once naming pub/w", err, took)
	}
	if f != nil {
		f.Close()
	}
	start = time.Now()
	_, files, _, err := b.Load(rootPeer, "pub", true, "", 10, new(any))
	if took := time.Since(start); toErrno(err) != syscall.EAGAIN || !strings.Contains(fmt.Sprint(err), "w") || took > 2*time.Second {
		t.Errorf("write load of a directory with a leased segment: %v after %v, want EAGAIN at once", err, took)
	}
	fdpass.Close(files)
	unix.FcntlInt(held.Fd(), unix.F_SETLEASE, unix.F_UNLCK)
	if f, err = b.Export(rootPeer, "pub/w", true); err != nil {
		t.Fatalf("write export once the lease is gone: %v", err)
	}
	defer f.Close()
	if nonblock(f) {
		t.Error("a writable exported descriptor has O_NONBLOCK")
	}
}

// TestControlImportPermissions: import needs write and search permission
// on the directory, takes only a readable regular file, makes a segment
// owned by the peer, and never replaces a name; a private mount refuses
// other users outright.
func TestControlImportPermissions(t *testing.T) {
	b, backing := controlFS(t)
	if err := b.Import(otherPeer, "pub/mine", memfd(t, "x"), "", ""); !errors.Is(err, syscall.EACCES) {
		t.Errorf("import into a directory the peer may not write: got %v, want EACCES", err)
	}
	if err := b.Import(ownerPeer, "pub/mine", memfd(t, "abcd"), "uint8", "[4]"); err != nil {
		t.Fatalf("import by the directory's owner: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(backing, "pub", "mine"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != ownerPeer.Uid {
		t.Errorf("imported segment is owned by uid %d, want the peer's %d", st.Uid, ownerPeer.Uid)
	}
	if err := b.Import(ownerPeer, "pub/w", memfd(t, "y"), "", ""); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("import over an existing segment: got %v, want EEXIST", err)
	}
	if err := b.Import(ownerPeer, "pub/big", memfd(t, "abcd"), "float32", "[4]"); !errors.Is(err, alloc.ErrInvalid) {
		t.Errorf("import whose shape lays out more than the file: got %v, want ErrInvalid", err)
	}
	if _, err := os.Lstat(filepath.Join(backing, "pub", "big")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused import left pub/big behind (%v)", err)
	}

	opath, err := unix.Open(filepath.Join(backing, "pub", "w"), unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	opathFile := os.NewFile(uintptr(opath), "opath")
	defer opathFile.Close()
	if err := b.Import(ownerPeer, "pub/o", opathFile, "", ""); !errors.Is(err, syscall.EBADF) {
		t.Errorf("import of an O_PATH descriptor: got %v, want EBADF", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if err := b.Import(ownerPeer, "pub/p", r, "", ""); !errors.Is(err, alloc.ErrInvalid) {
		t.Errorf("import of a pipe: got %v, want ErrInvalid", err)
	}

	b.fsys.allowOther = false
	if err := b.Import(ownerPeer, "pub/private", memfd(t, "z"), "", ""); !errors.Is(err, syscall.EACCES) {
		t.Errorf("import by another user on a private mount: got %v, want EACCES", err)
	}
}

// TestImportsShareDescriptorBudget: each import keeps a descriptor from
// the budget open segments draw on: a user past its share gets EMFILE and
// no name, and root still imports.
func TestImportsShareDescriptorBudget(t *testing.T) {
	b, backing := controlFS(t)
	held := newBudget("segment descriptors", 2, 16)
	b.fsys.handles, b.fsys.imports.held = held, held
	for _, name := range []string{"pub/a", "pub/b"} {
		if err := b.Import(ownerPeer, name, memfd(t, "x"), "", ""); err != nil {
			t.Fatalf("import %s: %v", name, err)
		}
	}
	if err := b.Import(ownerPeer, "pub/c", memfd(t, "x"), "", ""); !errors.Is(err, syscall.EMFILE) {
		t.Errorf("a third import of a user whose share is two: %v, want EMFILE", err)
	}
	if _, err := os.Lstat(filepath.Join(backing, "pub", "c")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused import left a name: %v", err)
	}
	if err := b.Import(rootPeer, "pub/r", memfd(t, "x"), "", ""); err != nil {
		t.Errorf("root's import once the user holds its share: %v", err)
	}
	if held.Held(ownerPeer.Uid) != 2 || held.Held(0) != 1 {
		t.Errorf("the budget counts %d for the user, %d for root; want 2 and 1", held.Held(ownerPeer.Uid), held.Held(0))
	}
}

// TestControlLoadCountsDirectories: a load keeps a descriptor open for
// each directory on its way down, each one of the requester's: a walk
// deeper than the user's share is EMFILE (root's goes on), and every one
// is given back when the walk ends.
func TestControlLoadCountsDirectories(t *testing.T) {
	b, backing := controlFS(t)
	b.fsys.handles = newBudget("descriptors", 3, 16)
	deep := filepath.Join(backing, "pub", "a", "b", "c", "d")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(deep, "w"), []byte("deep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := b.Load(ownerPeer, "pub", false, "", 10, new(any)); !errors.Is(err, syscall.EMFILE) {
		t.Errorf("a load 5 directories deep with a share of 3 descriptors: %v, want EMFILE", err)
	}
	_, files, _, err := b.Load(rootPeer, "pub", false, "", 10, new(any))
	if err != nil || len(files) != 2 {
		t.Errorf("root's load of the same directory: %d files, %v", len(files), err)
	}
	fdpass.Close(files)
	if b.fsys.handles.Used() != 0 {
		t.Errorf("after the loads the daemon counts %d descriptors, want 0", b.fsys.handles.Used())
	}
}
