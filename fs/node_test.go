package fs

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/internal/tmpfstest"
	"tensorfs/ledger"
)

// testFS makes a filesystem on a temporary backing with its node tree,
// as Mount does (newFilesystem), but mounts nothing: handlers are called
// directly, or through go-fuse's bridge (ops_test.go).
func testFS(t *testing.T) *filesystem {
	t.Helper()
	store, top, log := testStore(t)
	fsys, err := newFilesystem(Options{Store: store, Log: log, Mountpoint: filepath.Join(top, "mnt")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fsys.close)
	fusefs.NewNodeFS(fsys.root, &fusefs.Options{})
	return fsys
}

// testStore opens a store on an empty temporary backing, closed with
// the test; it returns it with the directory the backing is in and a
// logger that discards.
func testStore(t *testing.T) (*alloc.Store, string, *slog.Logger) {
	t.Helper()
	// On a tmpfs, as a backing must be: node IDs are its inode numbers.
	// (t.TempDir's ext4 gave a new file the number of a directory removed
	// a moment before, which a successor had adopted by node ID:
	// TestHandoverForgetOfRemovedNode failed so, now and then.)
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backing := filepath.Join(top, "backing")
	os.Mkdir(backing, 0o755)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	store, err := alloc.Open(alloc.Config{Backing: backing}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	return store, top, log
}

// callerCtx is the context of a FUSE request from uid.
func callerCtx(uid uint32) context.Context {
	return fuse.NewContext(context.Background(), &fuse.Caller{Owner: fuse.Owner{Uid: uid, Gid: uid}, Pid: uint32(os.Getpid())})
}

// mkdir makes the directory name through the handlers.
func mkdir(t *testing.T, parent *dirNode, name string) *dirNode {
	t.Helper()
	var out fuse.EntryOut
	ch, errno := parent.Mkdir(callerCtx(0), name, 0o755, &out)
	if errno != 0 {
		t.Fatalf("mkdir %s: %v", name, errno)
	}
	parent.AddChild(name, ch, false) // as the bridge does for the reply
	return ch.Operations().(*dirNode)
}

// mkseg makes the empty segment name through the handlers.
func mkseg(t *testing.T, parent *dirNode, name string) *segmentNode {
	t.Helper()
	var out fuse.EntryOut
	ch, fh, _, errno := parent.Create(callerCtx(0), name, unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatalf("create %s: %v", name, errno)
	}
	fh.(fusefs.FileReleaser).Release(callerCtx(0))
	parent.AddChild(name, ch, false)
	return ch.Operations().(*segmentNode)
}

// TestFlagsCacheFollowsChanges: however reads of the flags interleave with
// changes, the cached flags end as the stored ones.
func TestFlagsCacheFollowsChanges(t *testing.T) {
	fsys := testFS(t)
	d := mkdir(t, &fsys.root.dirNode, "d")
	values := []string{"UNLINK", "EXCLUSIVE", "NOCREATE", "SHAREDMEM"}
	for round := 0; round < 200; round++ {
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			for i := 0; i < 5; i++ {
				d.flags(d)
			}
		}()
		go func() {
			defer wg.Done()
			if errno := d.Setxattr(callerCtx(0), alloc.AttrFlags, []byte(values[round%len(values)]), 0); errno != 0 {
				t.Errorf("setxattr flags: %v", errno)
			}
		}()
		wg.Wait()
		cached, _ := d.flags(d)
		stored, err := alloc.ReadFlags(filepath.Join(fsys.store.Dir, "d"))
		if err != nil || cached != stored {
			t.Fatalf("round %d: cached flags %v, stored %v (%v)", round, cached, stored, err)
		}
	}
}

// TestLayoutCacheFollowsChanges: getxattr of the tensor attributes
// answers what is stored on the backing after every set, refused set,
// XATTR_CREATE of an existing name and remove, read concurrently.
func TestLayoutCacheFollowsChanges(t *testing.T) {
	fsys := testFS(t)
	seg := mkseg(t, &fsys.root.dirNode, "seg")
	backing := filepath.Join(fsys.store.Dir, "seg")
	if err := os.Truncate(backing, 64); err != nil {
		t.Fatal(err)
	}
	get := func(attr string) (string, syscall.Errno) {
		buf := make([]byte, 64)
		n, errno := seg.Getxattr(callerCtx(0), attr, buf)
		return string(buf[:n]), errno
	}
	check := func(step string) {
		t.Helper()
		for _, attr := range []string{alloc.AttrDtype, alloc.AttrShape, alloc.AttrStride, alloc.AttrOffset} {
			want, _, err := alloc.GetXattr(backing, attr)
			if err != nil {
				t.Fatal(err)
			}
			got, errno := get(attr)
			if got != string(want) || (errno == syscall.ENODATA) != (want == nil) {
				t.Fatalf("%s: getxattr %s = %q (%v), stored %q", step, attr, got, errno, want)
			}
		}
	}
	set := func(attr, v string, flags uint32) syscall.Errno {
		return seg.Setxattr(callerCtx(0), attr, []byte(v), flags)
	}

	check("before any set")
	if errno := set(alloc.AttrShape, "[4,4]", 0); errno != 0 {
		t.Fatalf("set shape: %v", errno)
	}
	check("shape set") // stored canonical: [4, 4]
	if errno := set(alloc.AttrDtype, "float64", 0); errno != syscall.EINVAL {
		t.Fatalf("float64 of [4, 4] in 64 bytes: got %v, want EINVAL", errno)
	}
	check("refused dtype")
	if errno := set(alloc.AttrDtype, "float32", 0); errno != 0 {
		t.Fatalf("set dtype: %v", errno)
	}
	if errno := set(alloc.AttrShape, "[2,8]", unix.XATTR_CREATE); errno != syscall.EEXIST {
		t.Fatalf("XATTR_CREATE of a stored shape: got %v, want EEXIST", errno)
	}
	check("create of an existing name")
	if errno := seg.Removexattr(callerCtx(0), alloc.AttrDtype); errno != 0 {
		t.Fatalf("remove dtype: %v", errno)
	}
	check("dtype removed")

	shapes := []string{"[2, 8]", "[8, 2]", "[16]"}
	var wg sync.WaitGroup
	for round := 0; round < 100; round++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			get(alloc.AttrShape)
		}()
		go func() {
			defer wg.Done()
			if errno := set(alloc.AttrShape, shapes[round%len(shapes)], 0); errno != 0 {
				t.Errorf("set shape: %v", errno)
			}
		}()
		wg.Wait()
		check("concurrent reads and sets")
	}
}

// TestWithDirNestsAcrossForget: a directory's descriptor may be used
// again inside its own use while the kernel forgets the node (Link and
// Create of an existing name do so); it is closed after the last use.
func TestWithDirNestsAcrossForget(t *testing.T) {
	fsys := testFS(t)
	d := mkdir(t, &fsys.root.dirNode, "d")
	done := make(chan error, 1)
	go func() {
		done <- d.withDir(func(outer int) error {
			forgot := make(chan struct{})
			go func() { d.OnForget(); close(forgot) }()
			<-forgot
			return d.withDir(func(inner int) error {
				if inner != outer {
					t.Errorf("nested use got fd %d, outer %d", inner, outer)
				}
				return unix.Fstat(inner, new(unix.Stat_t))
			})
		})
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nested withDir across OnForget deadlocked")
	}
	if d.fd != -1 {
		t.Errorf("the forgotten directory's descriptor is still open (%d)", d.fd)
	}
}

// TestCreateOfExistingName: CREATE of a name that appeared meanwhile
// (made outside the kernel's view, as an import does) opens it.
func TestCreateOfExistingName(t *testing.T) {
	fsys := testFS(t)
	if err := os.WriteFile(filepath.Join(fsys.store.Dir, "x"), []byte("there"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out fuse.EntryOut
	ch, fh, _, errno := fsys.root.Create(callerCtx(0), "x", unix.O_RDWR, 0o644, &out)
	if errno != 0 {
		t.Fatalf("create of an existing name: %v", errno)
	}
	h := fh.(*fileHandle)
	buf := make([]byte, 5)
	if n, err := unix.Pread(h.fd, buf, 0); err != nil || string(buf[:n]) != "there" {
		t.Errorf("the handle reads %q, %v", buf[:n], err)
	}
	if got, err := ch.Operations().(*segmentNode).refcount(); err != nil || string(got) != "1" {
		t.Errorf("refcount %s, %v; want 1", got, err)
	}
	h.Release(callerCtx(0))
}

// TestFlagRules: NOCREATE refuses every way of making a name, EXCLUSIVE
// every way of replacing a segment's bytes by name, and a segment's flags
// change only while it is empty.
func TestFlagRules(t *testing.T) {
	fsys := testFS(t)
	root := &fsys.root.dirNode
	sealed := mkdir(t, root, "sealed")
	excl := mkdir(t, root, "excl")
	full := mkseg(t, excl, "full")
	mkseg(t, excl, "other")
	if err := os.WriteFile(filepath.Join(fsys.store.Dir, "excl", "full"), []byte("bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	for d, f := range map[*dirNode]string{sealed: "NOCREATE", excl: "EXCLUSIVE"} {
		if errno := d.Setxattr(callerCtx(0), alloc.AttrFlags, []byte(f), 0); errno != 0 {
			t.Fatalf("set %s: %v", f, errno)
		}
	}
	ctx := callerCtx(0)
	var out fuse.EntryOut
	expect := func(what string, got, want syscall.Errno) {
		t.Helper()
		if got != want {
			t.Errorf("%s: got %v, want %v", what, got, want)
		}
	}

	_, _, _, errno := sealed.Create(ctx, "new", unix.O_RDWR, 0o644, &out)
	expect("create in NOCREATE", errno, syscall.EPERM)
	_, errno = sealed.Mkdir(ctx, "sub", 0o755, &out)
	expect("mkdir in NOCREATE", errno, syscall.EPERM)
	expect("rename into NOCREATE", excl.Rename(ctx, "other", sealed, "moved", 0), syscall.EPERM)

	_, _, _, errno = excl.Create(ctx, "full", unix.O_RDWR, 0o644, &out)
	expect("create of an existing name in EXCLUSIVE", errno, syscall.EEXIST)
	expect("rename over a segment in EXCLUSIVE", excl.Rename(ctx, "other", excl, "full", 0), syscall.EEXIST)
	_, _, errno = full.Open(ctx, unix.O_RDWR|unix.O_TRUNC)
	expect("O_TRUNC of a segment with bytes in EXCLUSIVE", errno, syscall.EEXIST)
	if b, err := os.ReadFile(filepath.Join(fsys.store.Dir, "excl", "full")); err != nil || string(b) != "bytes" {
		t.Errorf("after the refusals the segment holds %q (%v), want its bytes", b, err)
	}

	expect("flags of a segment with bytes", full.Setxattr(ctx, alloc.AttrFlags, []byte("UNLINK"), 0), syscall.EBUSY)
	if f, _ := full.flags(full); f != 0 {
		t.Errorf("a refused flag change left flags %v", f)
	}
	empty := mkseg(t, root, "empty")
	expect("flags of an empty segment", empty.Setxattr(ctx, alloc.AttrFlags, []byte("UNLINK"), 0), 0)
}

// TestHandleBudgetShare: the descriptors' row of the ledger (whose
// bounds package ledger tests) gives one user a sixteenth of its total.
func TestHandleBudgetShare(t *testing.T) {
	s := newHandleBudget(ledger.New()).Spec()
	if s.PerUID != s.Total/16 || s.Over != syscall.EMFILE || s.Full != syscall.ENFILE {
		t.Errorf("descriptors: %d per user of %d, refused with %v and %v", s.PerUID, s.Total, s.Over, s.Full)
	}
}

// TestCloseClosesDirectoryDescriptors: close closes the descriptors of
// the directories the kernel never forgot (it forgets none at unmount),
// not only the root's. It counts the process's descriptors of the
// backing only: tests running beside it open and close others.
func TestCloseClosesDirectoryDescriptors(t *testing.T) {
	top := tmpfstest.Dir(t)
	os.Chmod(top, 0o700)
	backing := filepath.Join(top, "backing")
	os.Mkdir(backing, 0o755)
	openFds := func() int {
		fds, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, fd := range fds {
			if p, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil && (p == backing || strings.HasPrefix(p, backing+"/")) {
				n++
			}
		}
		return n
	}
	store, err := alloc.Open(alloc.Config{Backing: backing}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	before := openFds()
	fsys, err := newFilesystem(Options{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	fusefs.NewNodeFS(fsys.root, &fusefs.Options{})
	d := mkdir(t, &fsys.root.dirNode, "a")
	for _, name := range []string{"b", "c"} {
		mkdir(t, d, name).withDir(func(int) error { return nil })
	}
	if got := fsys.dirs.stats()["open"]; got < 3 {
		t.Fatalf("%d directory descriptors open, want the root's and two more at least", got)
	}
	if n := openFds(); n < before+3 {
		t.Fatalf("%d descriptors of the backing open with three directories known, %d before", n, before)
	}
	fsys.close()
	if after := openFds(); after != before {
		t.Errorf("%d descriptors of the backing open before the filesystem, %d after its close", before, after)
	}
}
