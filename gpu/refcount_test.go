package gpu

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// consumerCounter maps the counter file at path as a consumer does and
// returns its int64, unmapped at cleanup.
func consumerCounter(t *testing.T, path string) *int64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, 8, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return (*int64)(unsafe.Pointer(&mem[0]))
}

func TestCounters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "counters")
	// What an earlier daemon left is removed.
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(path, "1"), make([]byte, 8), 0o666); err != nil {
		t.Fatal(err)
	}
	d, err := OpenCounterDir(path)
	if err != nil {
		t.Fatal(err)
	}
	d.SetLog(slog.New(slog.DiscardHandler)) // a counter is truncated below
	if fi, err := os.Stat(path); err != nil || fi.Mode() != os.ModeDir|0o711 {
		t.Errorf("counter directory: %v %v, want mode 0711", fi.Mode(), err)
	}
	if names, _ := os.ReadDir(path); len(names) != 0 {
		t.Errorf("counters of an earlier daemon left: %v", names)
	}
	// The tmpfs holds MaxCounters counters, what the daemon's ledger
	// bounds all users' counters by.
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil || st.Files != MaxCounters+1 {
		t.Errorf("the counters' tmpfs has %d inodes (%v), want MaxCounters+1 = %d", st.Files, err, MaxCounters+1)
	}

	a, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	if a.Path() == b.Path() || filepath.Dir(a.Path()) != path {
		t.Fatalf("counter paths %s, %s", a.Path(), b.Path())
	}
	for _, c := range []*Counter{a, b} {
		fi, err := os.Stat(c.Path())
		if err != nil || fi.Size() != 8 || fi.Mode() != 0o600 || c.Value() != 0 {
			t.Errorf("new counter %s: %v %v, value %d; want 8 bytes, mode 0600, zero", c.Path(), fi, err, c.Value())
		}
	}

	// A consumer counts with atomics; each file holds its own counter.
	ca, cb := consumerCounter(t, a.Path()), consumerCounter(t, b.Path())
	atomic.AddInt64(ca, 1)
	atomic.AddInt64(ca, 1)
	atomic.AddInt64(cb, 5)
	if a.Value() != 2 || b.Value() != 5 {
		t.Errorf("values %d, %d after increments; want 2, 5", a.Value(), b.Value())
	}
	atomic.AddInt64(ca, -2)
	if a.Value() != 0 || b.Value() != 5 {
		t.Errorf("values %d, %d after decrements; want 0, 5", a.Value(), b.Value())
	}

	// A counter a consumer truncated reads as zero; the daemon never maps it.
	if err := os.Truncate(b.Path(), 0); err != nil {
		t.Fatal(err)
	}
	if v := b.Value(); v != 0 {
		t.Errorf("value of a truncated counter = %d", v)
	}

	// Remove deletes the file; RemoveAll the rest and the directory.
	if err := a.Remove(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("removed counter: %v", err)
	}
	if err := d.RemoveAll(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("counter directory after RemoveAll: %v", err)
	}
	if err := b.Remove(nil); err != nil {
		t.Errorf("Remove after RemoveAll: %v", err)
	}
}

func TestCounterDirOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a directory of another user")
	}
	path := filepath.Join(t.TempDir(), "counters")
	if err := os.Mkdir(path, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenCounterDir(path); err == nil {
		t.Error("OpenCounterDir took a directory of uid 1000")
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenCounterDir(link); err == nil {
		t.Error("OpenCounterDir followed a symbolic link")
	}
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
}

// testTmpfs mounts a small tmpfs for the test and returns its path.
func testTmpfs(t *testing.T) string {
	t.Helper()
	needRoot(t)
	dir := filepath.Join(t.TempDir(), "tmpfs")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tensorfs-test", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// rawACL returns the system.posix_acl_access value of path.
func rawACL(t *testing.T, path string) []byte {
	t.Helper()
	buf := make([]byte, 256)
	n, err := unix.Getxattr(path, aclXattr, buf)
	if err != nil {
		t.Fatalf("getxattr %s %s: %v", path, aclXattr, err)
	}
	return buf[:n]
}

// getfacl returns the ACL entries of path as getfacl prints them, numeric.
func getfacl(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("getfacl", "-cnp", path).Output()
	if err != nil {
		t.Fatalf("getfacl %s: %v", path, err)
	}
	return strings.Join(strings.Fields(string(out)), " ")
}

// TestEncodeACL: the ACL encoding is what the kernel itself stores for
// the same ACL set by setfacl, byte for byte.
func TestEncodeACL(t *testing.T) {
	// By hand: version 2, then tag, perm, id of each entry.
	want, _ := hex.DecodeString("02000000" + "01000600ffffffff" + "02000600e8030000" + "04000000ffffffff" + "10000600ffffffff" + "20000600ffffffff")
	if got, _ := counterACL(0, 1000, 0o604); !bytes.Equal(got, want) {
		t.Errorf("counterACL(0, 1000, 0604) = %x, want %x", got, want)
	}
	if _, err := exec.LookPath("setfacl"); err != nil {
		t.Skip("no setfacl (package acl)")
	}
	dir := testTmpfs(t)
	for _, tc := range []struct {
		uid, mode uint32
		setfacl   string
	}{
		{1000, 0o604, "u::rw-,u:1000:rw-,g::---,m::rw-,o::rw-"},
		{1000, 0o044, "u::rw-,u:1000:---,g::rw-,m::rw-,o::rw-"},
		{4000000000, 0o400, "u::rw-,u:4000000000:rw-,g::---,m::rw-,o::---"},
		{0, 0o640, "u::rw-,g::rw-,m::rw-,o::---"},
	} {
		p := filepath.Join(dir, "f")
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("setfacl", "--set", tc.setfacl, p).CombinedOutput(); err != nil {
			t.Fatalf("setfacl --set %s: %v\n%s", tc.setfacl, err, out)
		}
		acl, mode := counterACL(0, tc.uid, tc.mode)
		if kernel := rawACL(t, p); !bytes.Equal(acl, kernel) {
			t.Errorf("counterACL(0, %d, %#o) = %x; setfacl --set %s stores %x", tc.uid, tc.mode, acl, tc.setfacl, kernel)
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil || st.Mode&0o7777 != mode {
			t.Errorf("counterACL(0, %d, %#o): mode %#o, the kernel's %#o (%v)", tc.uid, tc.mode, mode, st.Mode&0o7777, err)
		}
		os.Remove(p)
	}
}

// TestCounterFollow: Follow leaves the file the daemon's, takes the
// segment's group, and grants read and write by ACL to exactly the
// classes that may read the segment.
func TestCounterFollow(t *testing.T) {
	d, _ := counterDir(t)
	c, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Remove(nil)
	// The daemon's own user and group (root's, or those of the user who
	// runs the tests), then others, which only root may give a file.
	me, mine := uint32(os.Geteuid()), uint32(os.Getegid())
	type followCase struct {
		uid, gid, mode uint32
		wantMode       uint32
		wantACL        string
	}
	cases := []followCase{
		{me, mine, 0o644, 0o666, "user::rw- group::rw- mask::rw- other::rw-"},
		{me, mine, 0o600, 0o660, "user::rw- group::--- mask::rw- other::---"},
		{me, mine, 0o604, 0o666, "user::rw- group::--- mask::rw- other::rw-"},
	}
	if me == 0 {
		cases = append(cases, []followCase{
			{1000, 1001, 0o640, 0o660, "user::rw- user:1000:rw- group::rw- mask::rw- other::---"},
			{1000, 1001, 0o604, 0o666, "user::rw- user:1000:rw- group::--- mask::rw- other::rw-"},
			{1000, 1000, 0o044, 0o666, "user::rw- user:1000:--- group::rw- mask::rw- other::rw-"},
			{1000, 1000, 0o200, 0o660, "user::rw- user:1000:--- group::--- mask::rw- other::---"},
			{1001, 1000, 0o4755, 0o666, "user::rw- user:1001:rw- group::rw- mask::rw- other::rw-"},
			{1001, 1000, 0o6755, 0o666, "user::rw- user:1001:rw- group::rw- mask::rw- other::rw-"}, // again: nothing to do
		}...)
	}
	for _, tc := range cases {
		if err := c.Follow(tc.uid, tc.gid, tc.mode); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(c.Path(), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != me || st.Gid != tc.gid || st.Mode&0o7777 != tc.wantMode || st.Size != counterSize {
			t.Errorf("Follow(%d, %d, %#o): %d:%d mode %#o size %d; want %d:%d %#o, 8 bytes", tc.uid, tc.gid, tc.mode, st.Uid, st.Gid, st.Mode&0o7777, st.Size, me, tc.gid, tc.wantMode)
		}
		if got := getfacl(t, c.Path()); got != tc.wantACL {
			t.Errorf("Follow(%d, %d, %#o): ACL %q, want %q", tc.uid, tc.gid, tc.mode, got, tc.wantACL)
		}
	}
}

// TestCounterDirTmpfs: as root the counters live on a tmpfs of their own,
// bounded and nosuid, nodev, noexec; a new daemon replaces the one a
// crashed daemon left; RemoveAll unmounts it.
func TestCounterDirTmpfs(t *testing.T) {
	needRoot(t)
	path := filepath.Join(t.TempDir(), "counters")
	crashed, err := OpenCounterDir(path)
	if err != nil {
		t.Fatal(err)
	}
	old, err := crashed.New()
	if err != nil {
		t.Fatal(err)
	}
	defer old.Remove(nil)
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC || fs.Blocks*uint64(fs.Bsize) != 64<<20 || fs.Files != 16384 {
		t.Errorf("counter directory: type %#x, %d bytes, %d inodes (%v); want a tmpfs of 64 MiB and 16384 inodes", fs.Type, fs.Blocks*uint64(fs.Bsize), fs.Files, err)
	}
	if want := unix.ST_NOSUID | unix.ST_NODEV | unix.ST_NOEXEC; fs.Flags&int64(want) != int64(want) {
		t.Errorf("counter tmpfs flags %#x, want nosuid, nodev and noexec", fs.Flags)
	}

	// A new daemon, the old one never having removed its directory.
	d, err := OpenCounterDir(path)
	if err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, path); n != 1 {
		t.Errorf("%d mounts at %s after a second OpenCounterDir, want 1", n, path)
	}
	if _, err := os.Stat(old.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the crashed daemon's counter is still there: %v", err)
	}
	if old.Value() != 0 {
		t.Error("the crashed daemon's counter reads non-zero")
	}
	if err := d.RemoveAll(); err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, path); n != 0 {
		t.Errorf("%d mounts at %s after RemoveAll", n, path)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("counter directory after RemoveAll: %v", err)
	}

	// Something else mounted there is not taken over.
	dir := testTmpfs(t)
	if err := unix.Mount("/proc", dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	if _, err := OpenCounterDir(dir); err == nil || !strings.Contains(err.Error(), "not a tmpfs of counters") {
		t.Errorf("OpenCounterDir over a bind mount of /proc = %v", err)
	}
}

// countMounts counts the mounts at path in /proc/self/mountinfo.
func countMounts(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			n++
		}
	}
	return n
}

// TestCounterValuePutsBack: Value cuts a grown counter file back to 8
// bytes, frees pages reserved past its end, zeroes a shortened one,
// restores a changed mode, and warns once per file.
func TestCounterValuePutsBack(t *testing.T) {
	needRoot(t)
	d, logs := counterDir(t)
	c, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Remove(nil)
	if err := c.Follow(1000, 1000, 0o640); err != nil {
		t.Fatal(err)
	}
	acl := getfacl(t, c.Path())
	atomic.AddInt64(consumerCounter(t, c.Path()), 7)

	f, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size := func() int64 {
		fi, err := f.Stat()
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	blocks := func() int64 {
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks
	}
	if _, err := f.WriteAt(make([]byte, 1<<20), 8); err != nil {
		t.Fatal(err)
	}
	if v := c.Value(); v != 7 || size() != 8 {
		t.Errorf("Value of a counter grown to 1 MiB = %d, size %d after; want 7, 8", v, size())
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 || !strings.Contains(logs.String(), "changed=size") {
		t.Errorf("%d warnings, want 1 naming the size:\n%s", n, logs.String())
	}
	if err := f.Truncate(1 << 30); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(c.Path(), 0o4777); err != nil { // only root (the daemon) can
		t.Fatal(err)
	}
	if v := c.Value(); v != 7 || size() != 8 {
		t.Errorf("Value of a counter truncated to 1 GiB = %d, size %d after; want 7, 8", v, size())
	}
	var st unix.Stat_t
	if err := unix.Stat(c.Path(), &st); err != nil || st.Mode&0o7777 != 0o660 || getfacl(t, c.Path()) != acl {
		t.Errorf("after chmod 4777 and Value: mode %#o, ACL %q (%v); want 0660, %q", st.Mode&0o7777, getfacl(t, c.Path()), err, acl)
	}
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_KEEP_SIZE, 4096, 1<<20); err != nil {
		t.Fatal(err)
	}
	if v := c.Value(); v != 7 || size() != 8 || blocks() > int64(os.Getpagesize()/512) {
		t.Errorf("Value of a counter with 1 MiB reserved past its end = %d, size %d, %d blocks after; want 7, 8, one page", v, size(), blocks())
	}
	if err := f.Truncate(3); err != nil {
		t.Fatal(err)
	}
	if v := c.Value(); v != 0 || size() != 8 || c.Value() != 0 {
		t.Errorf("Value of a counter cut to 3 bytes = %d, size %d after; want 0, 8", v, size())
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Errorf("%d warnings for one file, want 1:\n%s", n, logs.String())
	}
}

// TestCounterNewWhenFull: when a reader has filled the counters' tmpfs
// through its counter file, New puts back what it took and makes its
// counter, and the reader's counter keeps its value in one page: a file
// grown past 8 bytes; pages reserved past its end by fallocate with
// FALLOC_FL_KEEP_SIZE, its size 8 bytes or cut to 0 first; user.*
// attributes, which take the room of the tmpfs's inodes (no new counter
// file then).
func TestCounterNewWhenFull(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name  string
		fill  func(t *testing.T, path string)
		value int64 // the filled counter's after New
	}{
		{"grown", func(t *testing.T, p string) {
			if n, err := fill(p); !errors.Is(err, unix.ENOSPC) || n > 64<<20 {
				t.Fatalf("filling the counters' tmpfs: %d bytes, %v; want ENOSPC within 64 MiB", n, err)
			}
		}, 7},
		{"keep-size", func(t *testing.T, p string) { keepSizeFill(t, p, false) }, 7},
		{"keep-size-empty", func(t *testing.T, p string) { keepSizeFill(t, p, true) }, 0},
		{"xattrs", fillXattrs, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, logs := counterDir(t)
			c, err := d.New()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Remove(nil)
			atomic.AddInt64(consumerCounter(t, c.Path()), 7)
			tc.fill(t, c.Path())
			c2, err := d.New()
			if err != nil {
				t.Fatalf("New on a full tmpfs: %v\n%s", err, logs.String())
			}
			defer c2.Remove(nil)
			if !strings.Contains(logs.String(), "put back") || !strings.Contains(logs.String(), "files="+filepath.Base(c.Path())) {
				t.Errorf("no warning naming %s:\n%s", filepath.Base(c.Path()), logs.String())
			}
			if v := c.Value(); v != tc.value {
				t.Errorf("the filled counter's value after New: %d, want %d", v, tc.value)
			}
			var st unix.Stat_t
			if err := unix.Stat(c.Path(), &st); err != nil || st.Size != 8 || st.Blocks*512 > int64(os.Getpagesize()) {
				t.Errorf("the filled counter after New and Value: %d bytes, %d blocks (%v); want 8 bytes in one page", st.Size, st.Blocks, err)
			}
			if n, _ := unix.Listxattr(c.Path(), make([]byte, 1<<16)); n > len("system.posix_acl_access")+1 {
				t.Errorf("the filled counter keeps %d bytes of attribute names", n)
			}
		})
	}
}

// keepSizeFill reserves every free page of the tmpfs of the counter file
// path past its end with fallocate(FALLOC_FL_KEEP_SIZE), its size kept,
// after cutting the file to 0 if empty.
func keepSizeFill(t *testing.T, path string, empty bool) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if empty {
		if err := f.Truncate(0); err != nil {
			t.Fatal(err)
		}
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_KEEP_SIZE, 4096, int64(fs.Bavail)*fs.Bsize); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || unix.Fstatfs(int(f.Fd()), &fs) != nil || fs.Bavail != 0 || st.Size > 8 {
		t.Fatalf("after fallocate(KEEP_SIZE): %d bytes, %d blocks, %d blocks free (%v); want the tmpfs full, the size kept", st.Size, st.Blocks, fs.Bavail, err)
	}
}

// fillXattrs sets user.* attributes on path, as a reader with write
// permission may, until the tmpfs has no room for another inode.
func fillXattrs(t *testing.T, path string) {
	t.Helper()
	n := 0
	for _, size := range []int{64 << 10, 4 << 10, 256, 16, 0} {
		for unix.Setxattr(path, fmt.Sprintf("user.x%d", n), make([]byte, size), 0) == nil {
			n++
		}
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil || fs.Ffree != 0 {
		t.Fatalf("after %d user.* attributes: %d inodes free (%v); want none", n, fs.Ffree, err)
	}
}

// fill writes zeros into path past its first 8 bytes until a write fails,
// at most 256 MiB, and returns the bytes written and the error.
func fill(path string) (int64, error) {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	chunk := make([]byte, 1<<20)
	var n int64
	for n < 256<<20 {
		k, err := f.WriteAt(chunk, 8+n)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// childEnv makes the test binary run counterAttack instead of the tests,
// as the unprivileged child of TestCounterAttack.
const childEnv = "TENSORFS_GPU_TEST_CHILD"

// counterAttack is what an unprivileged user tries on counter files: own
// is the counter of a segment of its own it may read, readable those of
// segments it may read by group or as other, denied those it may not
// read. It prints one line per try: what, the path's base name, result.
func counterAttack(w io.Writer, own string, readable, denied []string) {
	for _, p := range append(append([]string{own}, readable...), denied...) {
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		fmt.Fprintln(w, "open", filepath.Base(p), result(err))
		if err != nil {
			continue
		}
		mem, err := unix.Mmap(int(f.Fd()), 0, 8, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err == nil {
			fmt.Fprintln(w, "add", filepath.Base(p), atomic.AddInt64((*int64)(unsafe.Pointer(&mem[0])), 1))
			unix.Munmap(mem)
		} else {
			fmt.Fprintln(w, "add", filepath.Base(p), result(err))
		}
		f.Close()
	}
	f, err := os.OpenFile(own, os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(w, "chmod", result(unix.Chmod(own, 0o4777)))
	fmt.Fprintln(w, "fchmod", result(unix.Fchmod(int(f.Fd()), 0o4777)))
	fmt.Fprintln(w, "chown", result(os.Chown(own, os.Getuid(), os.Getgid())))
	acl, _ := counterACL(0, 1, 0o666)
	fmt.Fprintln(w, "setacl", result(unix.Setxattr(own, aclXattr, acl, 0)))
	n, err := fill(own)
	fmt.Fprintln(w, "fill", result(err), n <= 64<<20)
}

// result names err as the child's lines do: ok, an errno's name, or
// the error's text.
func result(err error) string {
	var errno syscall.Errno
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &errno):
		return unix.ErrnoName(errno)
	}
	return err.Error()
}

func runCounterAttack() int {
	args := os.Args[1:]
	if len(args) != 3 {
		fmt.Fprintln(os.Stderr, "want OWN READABLE,... DENIED,...")
		return 2
	}
	counterAttack(os.Stdout, args[0], strings.Split(args[1], ","), strings.Split(args[2], ","))
	return 0
}

// TestCounterAttack: an unprivileged user (uid 1000) opens and increments
// the counters of the segments it may read, by owner, group or other
// class, and cannot open the others; it cannot chmod, chown or re-ACL its
// own segment's counter, and filling it stops at the counters' tmpfs,
// after which Value cuts it back to 8 bytes.
func TestCounterAttack(t *testing.T) {
	needRoot(t)
	const uid, gid = 1000, 1000
	base, exe := childBase(t)
	d, err := OpenCounterDir(filepath.Join(base, "counters"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.RemoveAll()
	var logs syncBuffer
	d.SetLog(slog.New(slog.NewTextHandler(&logs, nil)))
	counters := map[string]*Counter{}
	for _, s := range []struct {
		name           string
		uid, gid, mode uint32
	}{
		{"own", uid, gid, 0o600},
		{"group", 0, gid, 0o640},
		{"other", 0, 0, 0o604},
		{"private", 1001, 1001, 0o600},
		{"notgroup", 0, gid, 0o604},   // uid 1000 is in the group, which may not read
		{"notowner", uid, gid, 0o044}, // uid 1000 owns it and may not read
	} {
		c, err := d.New()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Remove(nil)
		if err := c.Follow(s.uid, s.gid, s.mode); err != nil {
			t.Fatal(err)
		}
		counters[s.name] = c
	}
	name := map[string]string{} // counter file name -> segment
	for s, c := range counters {
		name[filepath.Base(c.Path())] = s
	}

	cmd := exec.Command(exe, counters["own"].Path(),
		counters["group"].Path()+","+counters["other"].Path(),
		counters["private"].Path()+","+counters["notgroup"].Path()+","+counters["notowner"].Path())
	cmd.Env = append(os.Environ(), childEnv+"=counter-attack")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: []uint32{}}}
	var stderr strings.Builder // apart: a binary built with -cover warns there
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child as uid %d: %v\n%s%s", uid, err, out, stderr.String())
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && (f[0] == "open" || f[0] == "add") {
			f[1] = name[f[1]]
		}
		got = append(got, strings.Join(f, " "))
	}
	want := []string{
		"open own ok", "add own 1", "open group ok", "add group 1", "open other ok", "add other 1",
		"open private EACCES", "open notgroup EACCES", "open notowner EACCES",
		"chmod EPERM", "fchmod EPERM", "chown EPERM", "setacl EPERM", "fill ENOSPC true",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("uid %d on counter files:\n%s\nwant:\n%s", uid, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	for s, c := range counters {
		want := int64(0)
		if s == "own" || s == "group" || s == "other" {
			want = 1
		}
		if v := c.Value(); v != want {
			t.Errorf("counter of %s = %d, want %d", s, v, want)
		}
		var st unix.Stat_t
		if err := unix.Stat(c.Path(), &st); err != nil || st.Uid != 0 || st.Size != 8 || st.Mode&0o7000 != 0 {
			t.Errorf("counter of %s after the attack and Value: owner %d, %d bytes, mode %#o (%v); want 0, 8, no set-id bits", s, st.Uid, st.Size, st.Mode&0o7777, err)
		}
	}
	if !strings.Contains(logs.String(), "changed=size") {
		t.Errorf("no warning for the filled counter:\n%s", logs.String())
	}
}

// childBase makes a directory that every user may pass through (0711,
// below the temporary directory, removed at cleanup), with a copy of the
// test binary in it, and returns both paths.
func childBase(t *testing.T) (base, exe string) {
	t.Helper()
	base, err := os.MkdirTemp("", "tensorfs-counter-attack")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o711); err != nil {
		t.Fatal(err)
	}
	exe = filepath.Join(base, "gpu.test")
	if err := copyFile(testExe(t), exe); err != nil {
		t.Fatal(err)
	}
	return base, exe
}

func copyFile(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, b, 0o755)
}

// fdKeepSizeFill reserves every free page of the tmpfs of the counter file
// open at fd past its end with fallocate(FALLOC_FL_KEEP_SIZE), as a reader
// holding it may after the daemon removed it.
func fdKeepSizeFill(t *testing.T, fd int) {
	t.Helper()
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, 4096, int64(fs.Bavail)*fs.Bsize); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstatfs(fd, &fs); err != nil || fs.Bavail != 0 {
		t.Fatalf("after fallocate(KEEP_SIZE): %d blocks free (%v); want the tmpfs full", fs.Bavail, err)
	}
}

// TestCounterRemoveReleased: a counter file nobody else holds, or whose
// readers closed it and unmapped it before, is let go at Remove: released
// runs before Remove returns.
func TestCounterRemoveReleased(t *testing.T) {
	needRoot(t)
	d, _ := counterDir(t)
	for _, used := range []bool{false, true} {
		c, err := d.New()
		if err != nil {
			t.Fatal(err)
		}
		if used {
			f, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			mem, err := unix.Mmap(int(f.Fd()), 0, 8, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			if err != nil {
				t.Fatal(err)
			}
			f.Close()
			unix.Munmap(mem)
		}
		released := 0
		if err := c.Remove(func() { released++ }); err != nil {
			t.Fatal(err)
		}
		if released != 1 {
			t.Errorf("counter nobody holds (used before: %v): released %d times at Remove, want 1", used, released)
		}
		d.Sweep()
		if released != 1 {
			t.Errorf("counter let go at Remove: released %d times after Sweep, want 1", released)
		}
	}
	if len(d.retired) != 0 {
		t.Errorf("%d counters kept, want none", len(d.retired))
	}
}

// TestCounterRemovedHeld: a counter file a reader holds open, or mapped,
// when the daemon removes it is kept until the reader lets it go: what
// the reader reserves through it after the removal (fallocate KEEP_SIZE
// of the whole tmpfs) New puts back, through the daemon's descriptor;
// released runs only at the first Sweep after the reader closed or
// unmapped it.
func TestCounterRemovedHeld(t *testing.T) {
	needRoot(t)
	d, logs := counterDir(t)

	// Held by a descriptor.
	c, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	name := filepath.Base(c.Path())
	var released atomic.Int32
	if err := c.Remove(func() { released.Add(1) }); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(c.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("removed counter: %v", err)
	}
	if n := released.Load(); n != 0 {
		t.Fatalf("counter held open: released %d times at Remove, want 0", n)
	}
	fdKeepSizeFill(t, int(f.Fd()))
	c2, err := d.New()
	if err != nil {
		t.Fatalf("New with the tmpfs filled through a removed counter a reader holds: %v\n%s", err, logs.String())
	}
	defer c2.Remove(nil)
	if !strings.Contains(logs.String(), "removed="+name) {
		t.Errorf("no warning naming the removed counter %s:\n%s", name, logs.String())
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Size > 8 || st.Blocks*512 > int64(os.Getpagesize()) {
		t.Errorf("the held counter after New: %d bytes, %d blocks (%v); want at most 8 bytes in one page", st.Size, st.Blocks, err)
	}
	d.Sweep()
	if n := released.Load(); n != 0 {
		t.Errorf("counter still held: released %d times after Sweep, want 0", n)
	}
	f.Close()
	if n := released.Load(); n != 0 {
		t.Errorf("released %d times before a Sweep, want 0", n)
	}
	d.Sweep()
	d.Sweep()
	if n := released.Load(); n != 1 {
		t.Errorf("counter its reader closed: released %d times after Sweep, want 1", n)
	}

	// Held by a mapping alone (its descriptor closed).
	c, err = d.New()
	if err != nil {
		t.Fatal(err)
	}
	g, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(g.Fd()), 0, 8, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	g.Close()
	if err != nil {
		t.Fatal(err)
	}
	released.Store(0)
	if err := c.Remove(func() { released.Add(1) }); err != nil {
		t.Fatal(err)
	}
	d.Sweep()
	if n := released.Load(); n != 0 {
		t.Errorf("counter held by a mapping: released %d times, want 0", n)
	}
	unix.Munmap(mem)
	d.Sweep()
	if n := released.Load(); n != 1 {
		t.Errorf("counter its reader unmapped: released %d times after Sweep, want 1", n)
	}

	// RemoveAll lets go of what is still held.
	c, err = d.New()
	if err != nil {
		t.Fatal(err)
	}
	h, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	released.Store(0)
	if err := c.Remove(func() { released.Add(1) }); err != nil {
		t.Fatal(err)
	}
	if err := d.RemoveAll(); err != nil {
		t.Fatal(err)
	}
	if n := released.Load(); n != 1 {
		t.Errorf("counter held at RemoveAll: released %d times, want 1", n)
	}
}

// runRemovedHolder is the child of TestCounterRemovedRevoked: it holds the
// counter file os.Args[1] by an O_PATH descriptor and a read-write one,
// says "held", and once a line comes on stdin (the daemon removed the
// file) tries to open it again through the O_PATH descriptor, to set a
// user.* attribute through the read-write one, and to reserve 1 MiB past
// its end; it prints each result and holds the file until stdin closes.
func runRemovedHolder() int {
	p := os.Args[1]
	opath, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open O_PATH", result(err))
		return 1
	}
	rw, err := unix.Open(p, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open O_RDWR", result(err))
		return 1
	}
	fmt.Println("held")
	in := bufio.NewReader(os.Stdin)
	in.ReadString('\n')
	_, err = unix.Open(fmt.Sprintf("/proc/self/fd/%d", opath), unix.O_RDWR|unix.O_CLOEXEC, 0)
	fmt.Println("reopen", result(err))
	fmt.Println("setxattr", result(unix.Fsetxattr(rw, "user.x", []byte("x"), 0)))
	fmt.Println("fallocate", result(unix.Fallocate(rw, unix.FALLOC_FL_KEEP_SIZE, 4096, 1<<20)))
	io.Copy(io.Discard, in)
	return 0
}

// TestCounterRemovedRevoked: a reader (uid 1000) who holds its counter
// file when the daemon removes it can neither open it again (through an
// O_PATH descriptor, which no lease sees) nor set attributes on it; it
// keeps what its read-write descriptor allows (pages past the end, which
// trim puts back), and the file is kept until it lets go.
func TestCounterRemovedRevoked(t *testing.T) {
	needRoot(t)
	base, exe := childBase(t)
	d, err := OpenCounterDir(filepath.Join(base, "counters"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.RemoveAll()
	c, err := d.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Follow(1000, 1000, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, c.Path())
	cmd.Env = append(os.Environ(), childEnv+"=removed-holder")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000, Groups: []uint32{}}}
	var stderr syncBuffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	out := bufio.NewReader(stdout)
	if line, _ := out.ReadString('\n'); line != "held\n" {
		t.Fatalf("child as uid 1000: %q\n%s", line, stderr.String())
	}
	var released atomic.Int32
	if err := c.Remove(func() { released.Add(1) }); err != nil {
		t.Fatal(err)
	}
	io.WriteString(stdin, "go\n")
	var got []string
	for range 3 {
		line, err := out.ReadString('\n')
		if err != nil {
			t.Fatalf("child: %q, %v\n%s", got, err, stderr.String())
		}
		got = append(got, strings.TrimSpace(line))
	}
	if want := []string{"reopen EACCES", "setxattr EACCES", "fallocate ok"}; strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("uid 1000 holding its removed counter: %s; want %s", strings.Join(got, ", "), strings.Join(want, ", "))
	}
	d.Sweep()
	if n := released.Load(); n != 0 {
		t.Errorf("counter uid 1000 holds: released %d times, want 0", n)
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Errorf("child: %v\n%s", err, stderr.String())
	}
	d.Sweep()
	if n := released.Load(); n != 1 {
		t.Errorf("counter uid 1000 let go: released %d times after Sweep, want 1", n)
	}
}

// counterDir opens a counter directory for the test, removed when it
// ends, whose warnings go to the buffer it returns.
func counterDir(t *testing.T) (*CounterDir, *syncBuffer) {
	t.Helper()
	d, err := OpenCounterDir(filepath.Join(t.TempDir(), "counters"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.RemoveAll() })
	logs := &syncBuffer{}
	d.SetLog(slog.New(slog.NewTextHandler(logs, nil)))
	return d, logs
}

// TestCounterRetiredKeptBySuccessor: a removed counter file a reader
// still holds stays in the directory under its retired name, and a
// successor (KeepCounterDir, RemoveUnadopted with a charge) keeps it
// retired, charged to the uid Charge recorded: what the reader reserves
// through it after the handover New puts back, the successor's new
// counters never take its name, and once the reader (and the
// predecessor) let go, Sweep gives the charge back and removes the name.
// So does an unadopted counter a reader holds. Before, a successor knew
// nothing of the predecessor's retired files (unlinked) and unlinked the
// unadopted ones: a reader filled the tmpfs through one for good.
func TestCounterRetiredKeptBySuccessor(t *testing.T) {
	needRoot(t)
	d, logs := counterDir(t)
	dir := d.dir.Name()
	var held []*os.File
	c2fd := -1
	for i, uid := range []uint32{1000, 1001} {
		c, err := d.New()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Charge(uid); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(c.Path(), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		held = append(held, f)
		if i == 0 {
			if err := c.Remove(nil); err != nil {
				t.Fatal(err)
			}
		} else {
			c2fd = c.fd // the predecessor's, until it exits
		}
	}
	if _, err := os.Stat(filepath.Join(dir, retiredPrefix+"1")); err != nil {
		t.Fatalf("the removed counter a reader holds: %v, want it under its retired name", err)
	}
	// The predecessor's descriptors go, as at its exit.
	for _, r := range d.retired {
		unix.Close(r.fd)
	}
	d.retired = nil
	succ, err := KeepCounterDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	succ.SetLog(slog.New(slog.NewTextHandler(logs, nil)))
	charged := map[uint32]int{}
	if err := succ.RemoveUnadopted(nil, func(uid uint32) func() {
		charged[uid]++
		return func() { charged[uid]-- }
	}); err != nil {
		t.Fatal(err)
	}
	if charged[1000] != 1 || charged[1001] != 1 || len(succ.retired) != 2 {
		t.Fatalf("the successor charged %v and keeps %d retired, want uids 1000 and 1001 once each, 2 kept", charged, len(succ.retired))
	}
	fdKeepSizeFill(t, int(held[0].Fd()))
	c, err := succ.New()
	if err != nil {
		t.Fatalf("the successor's New with the tmpfs filled through a counter retired by its predecessor: %v\n%s", err, logs.String())
	}
	if c.Name() != "3" {
		t.Errorf("the successor's new counter is %q, want 3, after the retired ones", c.Name())
	}
	defer c.Remove(nil)
	for _, f := range held {
		f.Close()
	}
	succ.Sweep()
	if charged[1000] != 0 || charged[1001] != 1 {
		t.Errorf("the predecessor holds 2: charged %v, want 1001's alone", charged)
	}
	unix.Close(c2fd) // the predecessor exits
	succ.Sweep()
	if charged[1000] != 0 || charged[1001] != 0 || len(succ.retired) != 0 {
		t.Errorf("after the readers let go: charged %v, %d retired, want none", charged, len(succ.retired))
	}
	names, _ := succ.names()
	if !slices.Equal(names, []string{"3"}) {
		t.Errorf("counters left: %q, want only 3", names)
	}
}
