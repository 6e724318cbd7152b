package fs

import (
	"os"
	"path/filepath"
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
		if err := memfdOwnerOnly(fd); err != nil {
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
	if err := memfdOwnerOnly(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	if fi, err := f.Stat(); err != nil || fi.Mode().Perm() != 0o666 {
		t.Errorf("a named /dev/shm file after import: %v %v, want its mode 0666 kept", fi.Mode(), err)
	}
}
