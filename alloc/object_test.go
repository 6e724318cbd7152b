package alloc

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/internal/tmpfstest"
)

func openDir(t testing.TB, dir string) int {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// TestAtNeverFollows: At names the object itself, refuses a symbolic link
// planted at the name, and refuses another object than the one meant.
func TestAtNeverFollows(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	target := filepath.Join(outside, "target")
	os.WriteFile(target, nil, 0o600)
	os.WriteFile(filepath.Join(dir, "file"), nil, 0o600)
	os.Symlink(target, filepath.Join(dir, "link"))
	fd := openDir(t, dir)

	set := func(p string) error { return unix.Setxattr(p, "user.test", []byte("x"), 0) }
	if err := At(fd, "link", 0, set); !errors.Is(err, syscall.ELOOP) {
		t.Errorf("At on a symbolic link: %v, want ELOOP", err)
	}
	if _, err := unix.Getxattr(target, "user.test", nil); !errors.Is(err, unix.ENODATA) {
		t.Errorf("the link's target got an attribute: %v", err)
	}
	var st unix.Stat_t
	unix.Stat(filepath.Join(dir, "file"), &st)
	if err := At(fd, "file", st.Ino+1, set); !errors.Is(err, syscall.ESTALE) {
		t.Errorf("At with another inode: %v, want ESTALE", err)
	}
	if err := At(fd, "file", st.Ino, set); err != nil {
		t.Errorf("At on the file itself: %v", err)
	}
}

// TestWalkStaysBelow: Walk reports every object below the directory and
// enters no symbolic link.
func TestWalkStaysBelow(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(outside, "secret"), nil, 0o600)
	os.MkdirAll(filepath.Join(dir, "a", "b"), 0o755)
	os.WriteFile(filepath.Join(dir, "a", "b", "f"), []byte("12"), 0o600)
	os.Symlink(outside, filepath.Join(dir, "a", "out"))
	var seen []string
	err := Walk(openDir(t, dir), func(_ int, _, rel string, _ *unix.Stat_t) error {
		seen = append(seen, rel)
		return nil
	})
	slices.Sort(seen)
	if want := []string{"a", "a/b", "a/b/f", "a/out"}; err != nil || !slices.Equal(seen, want) {
		t.Errorf("Walk saw %v, %v; want %v", seen, err, want)
	}
}

// FuzzRecover: whatever a backing and a disk directory hold (files, links
// to outside, directories, any internal attribute values), recovery
// touches nothing outside them.
func FuzzRecover(f *testing.F) {
	f.Add([]byte("f\x00seg\x00import\x000123456789abcdef\x00"))
	f.Add([]byte("l\x00seg\x00f\x00seg\x00disk\x00../../../outside/secret\x00"))
	f.Add([]byte("D\x000123456789abcdef\x00path\x00../../outside/x\x00"))
	f.Add([]byte("d\x00a\x00l\x00a/b\x00D\x00fedcba9876543210\x00path\x00a/b/c\x00"))
	f.Add([]byte("f\x00u\x00flags\x00UNLINK\x00l\x00v\x00D\x00aaaaaaaaaaaaaaaa\x00path\x00/v\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		top := tmpfstest.Dir(t)
		os.Chmod(top, 0o700)
		backing, disk, outside := filepath.Join(top, "backing"), filepath.Join(top, "disk"), filepath.Join(top, "outside")
		for _, d := range []string{backing, disk, outside} {
			os.Mkdir(d, 0o700)
		}
		secret := filepath.Join(outside, "secret")
		os.WriteFile(secret, []byte("secret"), 0o600)
		buildTree(string(data), backing, disk, outside)
		before := snapshot(t, outside) + topNames(top)

		s, err := Open(Config{Backing: backing, Disk: disk}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		s.Recover(nil, false)
		if after := snapshot(t, outside) + topNames(top); after != before {
			t.Errorf("recovery changed what is outside the backing:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})
}

// buildTree reads NUL-separated words and makes, below backing and disk:
// "f NAME" a file, "d NAME" a directory, "l NAME" a link to outside, and
// after a file, "KEY VALUE" pairs that set an attribute on it (import,
// disk, path, devsize, spilled as the internal names; flags, device as
// the names they are stored as); "D ID" a disk file. Names may hold "/" and "..": they
// are joined as they come, which is how a planted tree could look.
func buildTree(data, backing, disk, outside string) {
	words := strings.Split(data, "\x00")
	var last string
	for i := 0; i+1 < len(words); i += 2 {
		kind, name := words[i], words[i+1]
		switch kind {
		case "f":
			last = filepath.Join(backing, name)
			os.WriteFile(last, nil, 0o600)
		case "d":
			os.MkdirAll(filepath.Join(backing, name), 0o755)
		case "l":
			os.Symlink(outside, filepath.Join(backing, name))
			os.Symlink(filepath.Join(outside, "secret"), filepath.Join(backing, name+"f"))
		case "D":
			last = filepath.Join(disk, name)
			os.WriteFile(last, nil, 0o600)
		case "import", "disk", "path", "devsize", "spilled":
			unix.Lsetxattr(last, internalAttr(kind), []byte(name), 0)
		case "flags", "device":
			unix.Lsetxattr(last, StoredName("user.tensorfs."+kind), []byte(name), 0)
		}
	}
}

// topNames lists the names in dir.
func topNames(dir string) string {
	entries, _ := os.ReadDir(dir)
	var b strings.Builder
	for _, e := range entries {
		b.WriteString(e.Name() + "\n")
	}
	return b.String()
}

// snapshot lists everything below dir with its mode, size and attributes.
func snapshot(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		info, _ := d.Info()
		fmt.Fprintf(&b, "%s %v %d ", p, info.Mode(), info.Size())
		names := make([]byte, 4096)
		if n, err := unix.Llistxattr(p, names); err == nil {
			b.Write(names[:n])
		}
		b.WriteByte('\n')
		return nil
	})
	return b.String()
}

// TestWalkDepthBound: Walk enters MaxDepth levels, no more, and says so
// (ErrTooDeep, ELOOP) once it has walked the rest.
func TestWalkDepthBound(t *testing.T) {
	dir := t.TempDir()
	deep := dir + strings.Repeat("/d", MaxDepth+5)
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "top"), nil, 0o600)
	levels, sawTop := 0, false
	err := Walk(openDir(t, dir), func(_ int, name, rel string, _ *unix.Stat_t) error {
		if name == "d" {
			levels = max(levels, strings.Count(rel, "/")+1)
		}
		sawTop = sawTop || name == "top"
		return nil
	})
	if !errors.Is(err, ErrTooDeep) || !errors.Is(err, syscall.ELOOP) {
		t.Errorf("Walk of a chain %d deep: %v, want ErrTooDeep", MaxDepth+5, err)
	}
	if levels != MaxDepth+1 || !sawTop {
		t.Errorf("Walk saw %d levels (want %d: the last unentered) and top %v", levels, MaxDepth+1, sawTop)
	}
}

// TestRemoveTreeDeep: RemoveTree removes a chain of directories far
// deeper than a recursion could go on a small stack, with files, links
// and other directories on the way, holding no descriptor per level; it
// removes a symbolic link without entering what it points to.
func TestRemoveTreeDeep(t *testing.T) {
	const depth = 5000
	top := t.TempDir()
	outside := filepath.Join(top, "outside")
	os.Mkdir(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "keep"), []byte("kept"), 0o600)
	tree := filepath.Join(top, "tree")
	os.Mkdir(tree, 0o755)
	fd, err := unix.Open(tree, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range depth {
		if i%1000 == 0 {
			unix.Symlinkat(outside, fd, "link")
			unix.Mkdirat(fd, "side", 0o755)
			for _, name := range []string{"f", "side/g"} {
				f, err := unix.Openat(fd, name, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
				if err != nil {
					t.Fatal(err)
				}
				unix.Close(f)
			}
		}
		if err := unix.Mkdirat(fd, "d", 0o755); err != nil {
			t.Fatal(err)
		}
		sub, err := unix.Openat(fd, "d", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = sub
	}
	unix.Close(fd)

	fds := func() int { e, _ := os.ReadDir("/proc/self/fd"); return len(e) }
	before := fds()
	old := debug.SetMaxStack(64 << 10)
	err = RemoveTree(tree)
	debug.SetMaxStack(old)
	if err != nil {
		t.Fatalf("RemoveTree of a %d-deep chain: %v", depth, err)
	}
	if _, err := os.Lstat(tree); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the tree is still there: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(outside, "keep")); err != nil || string(b) != "kept" {
		t.Errorf("a file a removed link pointed to: %q, %v", b, err)
	}
	if after := fds(); after != before {
		t.Errorf("%d descriptors open after RemoveTree, %d before", after, before)
	}
	if err := RemoveTree(tree); err != nil {
		t.Errorf("RemoveTree of what is not there: %v", err)
	}
	if err := RemoveTree(filepath.Join(outside, "keep")); err != nil {
		t.Errorf("RemoveTree of a file: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(outside, "keep")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RemoveTree left the file: %v", err)
	}
}

// TestOpenNeverWaitsForLease: a lease on a backing file (its owner's, taken
// through an exported descriptor) makes a conflicting Open answer
// ErrLeased (EAGAIN) at once instead of sleeping for lease-break-time; an
// open the lease allows, and any open once it is gone, succeeds, and no
// descriptor keeps an O_NONBLOCK its caller did not ask for.
func TestOpenNeverWaitsForLease(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "file")
	os.WriteFile(p, []byte("x"), 0o600)
	holder, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(holder)
	if _, err := unix.FcntlInt(uintptr(holder), unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		t.Skipf("no lease on %s: %v", dir, err)
	}
	r, err := OpenRef(openDir(t, dir), "file", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	nonblock := func(fd int) bool {
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fl&unix.O_NONBLOCK != 0
	}

	fd, err := r.Open(unix.O_RDONLY)
	if err != nil {
		t.Fatalf("read-only open beside a read lease: %v", err)
	}
	if nonblock(fd) {
		t.Error("read-only open kept O_NONBLOCK")
	}
	unix.Close(fd)

	start := time.Now()
	fd, err = r.Open(unix.O_RDWR)
	if took := time.Since(start); !errors.Is(err, ErrLeased) || took > 2*time.Second {
		if err == nil {
			unix.Close(fd)
		}
		t.Fatalf("read-write open against a read lease: %v after %v, want ErrLeased at once", err, took)
	}
	unix.FcntlInt(uintptr(holder), unix.F_SETLEASE, unix.F_UNLCK)
	if fd, err = r.Open(unix.O_RDWR); err != nil {
		t.Fatalf("read-write open once the lease is gone: %v", err)
	}
	if nonblock(fd) {
		t.Error("read-write open kept O_NONBLOCK")
	}
	unix.Close(fd)
	if fd, err = r.Open(unix.O_RDWR | unix.O_NONBLOCK); err != nil || !nonblock(fd) {
		t.Errorf("open asking for O_NONBLOCK: %v, O_NONBLOCK kept: %v", err, err == nil && nonblock(fd))
	}
	unix.Close(fd)
}

// TestOpenAtReachesOnlyTheObject: OpenAt opens the object by its name,
// without O_NONBLOCK, and only the object: another file, a FIFO (at once,
// with no writer) or a symbolic link put at the name is refused.
func TestOpenAtReachesOnlyTheObject(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	os.WriteFile(p, []byte("x"), 0o600)
	dirfd := openDir(t, dir)
	r, err := OpenRef(dirfd, "f", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fd, err := r.OpenAt(dirfd, "f", unix.O_RDWR)
	if err != nil {
		t.Fatalf("OpenAt of the object: %v", err)
	}
	var st unix.Stat_t
	unix.Fstat(fd, &st)
	fl, _ := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	unix.Close(fd)
	if st.Ino != r.Stat().Ino || fl&unix.O_ACCMODE != unix.O_RDWR || fl&unix.O_NONBLOCK != 0 {
		t.Errorf("OpenAt opened inode %d with flags %#o; want inode %d, O_RDWR, no O_NONBLOCK", st.Ino, fl, r.Stat().Ino)
	}
	os.Link(p, filepath.Join(dir, "kept"))
	planted := map[string]func() error{
		"another file": func() error { return os.WriteFile(filepath.Join(dir, "other"), nil, 0o600) },
		"a FIFO":       func() error { return unix.Mkfifo(filepath.Join(dir, "other"), 0o600) },
		"a symlink":    func() error { return os.Symlink("kept", filepath.Join(dir, "other")) },
	}
	for what, plant := range planted {
		if err := plant(); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "other"), p); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		fd, err := r.OpenAt(dirfd, "f", unix.O_RDONLY)
		if err == nil {
			unix.Close(fd)
		}
		if took := time.Since(start); !errors.Is(err, syscall.ESTALE) && !errors.Is(err, syscall.ELOOP) || took > 2*time.Second {
			t.Errorf("OpenAt with %s at the name: %v after %v, want ESTALE or ELOOP at once", what, err, took)
		}
	}
}
