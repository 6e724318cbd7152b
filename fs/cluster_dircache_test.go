package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestDirCacheBounded: the directories of a version being made are kept
// open at most maxOpenDirs at a time, each reopened by path when needed,
// and one replaced since it was made (by another directory or a symbolic
// link) is refused, never followed.
func TestDirCacheBounded(t *testing.T) {
	root := t.TempDir()
	top, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(top)
	d := newDirCache(top)
	defer d.close()
	const n = 4 * maxOpenDirs
	for i := range n {
		rel := fmt.Sprintf("d%03d", i)
		if err := os.Mkdir(filepath.Join(root, rel), 0o755); err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Open(filepath.Join(root, rel), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.put(rel, fd); err != nil {
			t.Fatal(err)
		}
		if len(d.open) > maxOpenDirs {
			t.Fatalf("%d directories open after %d made, more than %d", len(d.open), i+1, maxOpenDirs)
		}
	}
	for i := range n {
		rel := fmt.Sprintf("d%03d", i)
		fd, err := d.get(rel)
		if err != nil {
			t.Fatalf("get %s: %v", rel, err)
		}
		var st, want unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || unix.Stat(filepath.Join(root, rel), &want) != nil || st.Ino != want.Ino {
			t.Fatalf("get %s: inode %d, want %d (%v)", rel, st.Ino, want.Ino, err)
		}
	}
	if len(d.open) > maxOpenDirs {
		t.Fatalf("%d directories open, more than %d", len(d.open), maxOpenDirs)
	}
	if _, err := d.get("never"); !errors.Is(err, errNotMade) {
		t.Fatalf("a directory not made: %v, want errNotMade", err)
	}
	// Replaced since: by another directory (made while the first is
	// there, so that it has another inode), by a symbolic link to one.
	for i, replace := range []func(p string) error{
		func(p string) error { return os.Rename(filepath.Join(root, "new"), p) },
		func(p string) error { return os.Symlink(filepath.Join(root, "d001"), p) },
	} {
		rel := fmt.Sprintf("d%03d", i+2) // least recently used: closed
		if _, ok := d.open[rel]; ok {
			t.Fatalf("%s still open", rel)
		}
		p := filepath.Join(root, rel)
		if err := os.Mkdir(filepath.Join(root, "new"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := replace(p); err != nil {
			t.Fatal(err)
		}
		if _, err := d.get(rel); !errors.Is(err, syscall.ESTALE) && !errors.Is(err, syscall.ELOOP) && !errors.Is(err, syscall.ENOTDIR) {
			t.Errorf("%s replaced: %v, want ESTALE, ELOOP or ENOTDIR", rel, err)
		}
	}
}
