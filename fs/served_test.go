package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestServedFdsBounded: the files the cluster reads are kept open at most
// maxServedFds when idle, each reopened by path and checked to be its
// inode; one forgotten is closed at once; one renamed, replaced, or
// reached through a symbolic link is refused as moved, never followed.
func TestServedFdsBounded(t *testing.T) {
	root := t.TempDir()
	top, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(top)
	c := &servedFds{root: top}
	defer c.closeIdle()
	if err := os.Mkdir(filepath.Join(root, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	const n = 4 * maxServedFds
	locs := make([]loc, n)
	for i := range n {
		rel := fmt.Sprintf("d/f%03d", i)
		if err := os.WriteFile(filepath.Join(root, rel), []byte(rel), 0o644); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(root, rel), &st); err != nil {
			t.Fatal(err)
		}
		locs[i] = loc{rel, st.Ino}
	}
	for round := range 2 {
		for i, l := range locs {
			b := make([]byte, len(l.rel))
			if k, err := c.readAt(l, b, 0); err != nil || string(b[:k]) != l.rel {
				t.Fatalf("round %d, %s: %q %v", round, l.rel, b[:k], err)
			}
			if len(c.open) > maxServedFds {
				t.Fatalf("%d files open after %d read, more than %d", len(c.open), i+1, maxServedFds)
			}
		}
	}
	// A file in use stays open past the bound, and closes once let go if
	// it was forgotten meanwhile.
	e, err := c.acquire(locs[0])
	if err != nil {
		t.Fatal(err)
	}
	c.forget(locs[0])
	if _, err := e.f.ReadAt(make([]byte, 1), 0); err != nil {
		t.Fatalf("a file forgotten while in use: %v", err)
	}
	c.release(e)
	if _, err := e.f.ReadAt(make([]byte, 1), 0); err == nil {
		t.Fatal("a file forgotten is still open once let go")
	}

	c.closeIdle()
	if len(c.open) != 0 {
		t.Fatalf("%d files open after closeIdle", len(c.open))
	}
	// Renamed; replaced by another file; its directory replaced by a
	// symbolic link to where it went.
	if err := os.Rename(filepath.Join(root, locs[1].rel), filepath.Join(root, "moved")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(root, locs[3].rel), filepath.Join(root, locs[2].rel)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.acquire(locs[1]); !moved(err) {
		t.Errorf("a renamed file: %v, want it moved", err)
	}
	if _, err := c.acquire(locs[2]); !moved(err) {
		t.Errorf("a file replaced by another: %v, want it moved", err)
	}
	if err := os.Rename(filepath.Join(root, "d"), filepath.Join(root, "e")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("e", filepath.Join(root, "d")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.acquire(locs[4]); !moved(err) {
		t.Errorf("a file behind a symbolic link: %v, want it moved", err)
	}
	if len(c.open) != 0 {
		t.Fatalf("%d files open after refusals", len(c.open))
	}
}
