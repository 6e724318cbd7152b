package integration

// Set-id bits are cleared as on tmpfs (pjdfstest chmod/12.t): a write,
// truncate, ftruncate or open(O_TRUNC) by a user who does not own the
// file leaves it without set-user-ID and set-group-ID.

import (
	"os"
	"path/filepath"
	"testing"
)

// setidOps are what a non-owner does to a 06777 file, as shell commands
// with the file in $1.
var setidOps = map[string]string{
	"write":     `echo x >> "$1"`,
	"truncate":  `truncate -s 2 "$1"`,
	"ftruncate": `/usr/bin/python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); os.ftruncate(fd, 1)' "$1"`,
	"O_TRUNC":   `echo y > "$1"`,
}

// setidModes does each of setidOps as userA to a root-owned 06777 file in
// dir and returns the mode each left.
func setidModes(t *testing.T, dir string) map[string]os.FileMode {
	t.Helper()
	got := map[string]os.FileMode{}
	for op, sh := range setidOps {
		p := filepath.Join(dir, "setid-"+op)
		if err := os.WriteFile(p, []byte("data\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, 0o777|os.ModeSetuid|os.ModeSetgid); err != nil {
			t.Fatal(err)
		}
		if out, err := runAs(t, userA, "/", "sh", "-c", sh, "sh", p); err != nil {
			t.Fatalf("%s as uid %d: %v\n%s", op, userA, err, out)
		}
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		got[op] = st.Mode() & (os.ModePerm | os.ModeSetuid | os.ModeSetgid)
	}
	return got
}

func TestSetidClearedAsOnTmpfs(t *testing.T) {
	t.Parallel()
	ref, err := os.MkdirTemp("/dev/shm", "tensorfs-setid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(ref) })
	os.Chmod(ref, 0o755)
	want := setidModes(t, ref)
	for op, mode := range want {
		if mode != 0o777 {
			t.Fatalf("on tmpfs %s left %v: the test is wrong", op, mode)
		}
	}
	forEachMode(t, func(t *testing.T, m *mount) {
		reachable(t, m.dir)
		got := setidModes(t, m.dir)
		for op, mode := range want {
			if got[op] != mode {
				t.Errorf("%s by uid %d left %v, tmpfs %v", op, userA, got[op], mode)
			}
		}
	}, "--allow-other")
}

// TestChownKeepsSymlinks: chown -h of a symbolic link changes the link's
// own owner (the kernel marks every chown FATTR_KILL_SUIDGID, which has
// nothing to clear on a link), and chown of a set-id file clears the bits.
func TestChownKeepsSymlinks(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		link := m.path("link")
		if err := os.Symlink("target", link); err != nil {
			t.Fatal(err)
		}
		run(t, "chown", "-h", "65534:65534", link)
		if st := pxStat(t, link); st.Uid != 65534 || st.Gid != 65534 {
			t.Errorf("chown -h of a link: owner %d:%d, want 65534:65534", st.Uid, st.Gid)
		}
		f := m.path("suid")
		if err := os.WriteFile(f, nil, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(f, 0o755|os.ModeSetuid|os.ModeSetgid); err != nil {
			t.Fatal(err)
		}
		run(t, "chown", "65534:65534", f)
		if st := pxStat(t, f); st.Mode&0o7777 != 0o755 {
			t.Errorf("chown of a 06755 file left mode %#o, want 0755 as on tmpfs", st.Mode&0o7777)
		}
	})
}
