package fs

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMemfdOwnerOnly: an imported memfd keeps its owner's mode bits and
// loses the group's and others', so that no reader's read-only reopen of
// it opens again for writing through /proc/self/fd; a named file on
// tmpfs keeps the mode its owner gave it.
func TestMemfdOwnerOnly(t *testing.T) {
	for _, c := range []struct{ mode, want uint32 }{{0o777, 0o700}, {0o640, 0o600}, {0o604, 0o600}, {0o600, 0o600}, {0o400, 0o400}} {
		fd, err := unix.MemfdCreate("weights", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Fchmod(fd, c.mode); err != nil {
			t.Fatal(err)
		}
		if err := memfdOwnerOnly(fd, uint32(os.Geteuid())); err != nil {
			t.Errorf("memfd %#o: %v", c.mode, err)
		}
		var st unix.Stat_t
		unix.Fstat(fd, &st)
		if st.Mode&0o7777 != c.want {
			t.Errorf("memfd %#o after import: %#o, want %#o", c.mode, st.Mode&0o7777, c.want)
		}
		unix.Close(fd)
	}

	dir, err := os.MkdirTemp("/dev/shm", "tensorfs-owner-only-")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	defer os.RemoveAll(dir)
	f, err := os.Create(filepath.Join(dir, "memfd:named"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fchmod(int(f.Fd()), 0o666); err != nil {
		t.Fatal(err)
	}
	if err := memfdOwnerOnly(int(f.Fd()), uint32(os.Geteuid())); err != nil {
		t.Fatal(err)
	}
	if fi, err := f.Stat(); err != nil || fi.Mode().Perm() != 0o666 {
		t.Errorf("a named /dev/shm file after import: %v %v, want its mode 0666 kept", fi.Mode(), err)
	}
}

// TestMemfdOwnerOnlyOthers: the daemon changes the mode of no memfd its
// importer could not: another user's memfd that group or others may open
// is refused (EPERM) and keeps its mode, an owner-only one is imported as
// it is, and root's import of any makes it owner-only, as root could.
func TestMemfdOwnerOnlyOthers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the memfds belong to uid 1001")
	}
	for _, c := range []struct {
		mode, importer, want uint32
		errno                error
	}{
		{0o777, 1000, 0o777, unix.EPERM},
		{0o644, 1000, 0o644, unix.EPERM},
		{0o700, 1000, 0o700, nil},
		{0o777, 1001, 0o700, nil},
		{0o777, 0, 0o700, nil},
	} {
		fd, err := unix.MemfdCreate("weights", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Fchown(fd, 1001, 1001); err != nil {
			t.Fatal(err)
		}
		if err := unix.Fchmod(fd, c.mode); err != nil {
			t.Fatal(err)
		}
		err = memfdOwnerOnly(fd, c.importer)
		if c.errno == nil && err != nil || c.errno != nil && !errors.Is(err, c.errno) {
			t.Errorf("uid %d's import of uid 1001's memfd %#o: %v, want %v", c.importer, c.mode, err, c.errno)
		}
		var st unix.Stat_t
		unix.Fstat(fd, &st)
		if st.Mode&0o7777 != c.want {
			t.Errorf("uid 1001's memfd %#o after uid %d's import: %#o, want %#o", c.mode, c.importer, st.Mode&0o7777, c.want)
		}
		unix.Close(fd)
	}
}

// TestImportableThreads (ledger row "threads that may block in the
// kernel"): a descriptor whose filesystem the mount table does not give
// (a memfd) is asked with fstatfs on a goroutine counted against its
// sender's threads, given back once it returns; a sender at her bound is
// refused (EMFILE) and holds no duplicate, while another user's and
// root's imports go on.
func TestImportableThreads(t *testing.T) {
	fsys := testFS(t)
	mfd, err := unix.MemfdCreate("seg", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(mfd), "memfd")
	defer f.Close()
	fsys.threads = newBudget("threads", 1, 8)
	fd, err := fsys.importable(f, 1000)
	if err != nil {
		t.Fatalf("a memfd with a thread to spare: %v", err)
	}
	unix.Close(fd)
	if !waitFor(func() bool { return fsys.threads.Used() == 0 }) {
		t.Error("the fstatfs goroutine's thread was not given back")
	}
	fsys.threads.Add(1000, 1) // her share, held by an fstatfs that blocks
	if fd, err := fsys.importable(f, 1000); !errors.Is(err, syscall.EMFILE) {
		unix.Close(fd)
		t.Errorf("a memfd from a user at her bound of threads: %v, want EMFILE", err)
	}
	for _, uid := range []uint32{1001, 0} {
		fd, err := fsys.importable(f, uid)
		if err != nil {
			t.Errorf("uid %d's memfd while uid 1000 is at her bound of threads: %v", uid, err)
			continue
		}
		unix.Close(fd)
	}
}
