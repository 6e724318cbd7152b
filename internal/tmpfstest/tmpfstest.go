// Package tmpfstest gives tests a directory on a tmpfs, where a backing
// must be (alloc.Open refuses one elsewhere: node IDs are its inode
// numbers, which only a tmpfs never reuses).
package tmpfstest

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// Dir returns a new directory of mode 0700 on the tmpfs at /dev/shm,
// removed at cleanup; it fails t when /dev/shm is not a tmpfs.
func Dir(t testing.TB) string {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Fatalf("no tmpfs at /dev/shm (%v), where the tests put their backings: a backing must be on a tmpfs", err)
	}
	dir, err := os.MkdirTemp("/dev/shm", "tensorfs-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
