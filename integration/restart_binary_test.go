package integration

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRestartBinaryRefused: tensorfs restart --binary refuses, before
// running anything, a binary a user could change: one in a directory
// anyone may write (0777), one owned by uid 65534, one in a directory
// uid 65534 owns; the refusal says which and why, the keeper's log says
// so, and the daemon serves on. A symbolic link to a good binary is
// followed by the command (root's word) and the binary it names runs,
// which does not keep the descriptor it was run from.
func TestRestartBinaryRefused(t *testing.T) {
	t.Parallel()
	const nobody = 65534
	m := mountFS(t, "passthrough")
	dir := t.TempDir()
	ran := filepath.Join(dir, "ran")
	// bad is a binary that says it ran, which no refused one may.
	bad := []byte("#!/bin/sh\ntouch " + ran + "\nexit 1\n")
	place := func(rel string, dirMode os.FileMode, dirUID, fileUID int) string {
		t.Helper()
		d := filepath.Join(dir, rel)
		p := filepath.Join(d, "tensorfs")
		err := os.Mkdir(d, dirMode)
		if err == nil {
			err = os.Chmod(d, dirMode)
		}
		if err == nil {
			err = os.Chown(d, dirUID, dirUID)
		}
		if err == nil {
			err = writeExecutable(p, bad)
		}
		if err == nil {
			err = os.Chown(p, fileUID, fileUID)
		}
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	pid := m.daemonPid(t)
	for _, c := range []struct{ path, why string }{
		{place("open", 0o777, 0, 0), "open is writable by group or others (mode 0777)"},
		{place("file", 0o755, 0, nobody), "file/tensorfs belongs to uid 65534"},
		{place("theirs", 0o755, nobody, 0), "theirs belongs to uid 65534"},
	} {
		out := runExpectFail(t, tensorfs, "restart", "--binary", c.path, m.dir)
		if !strings.Contains(out, "refused to run "+c.path) || !strings.Contains(out, c.why) {
			t.Errorf("restart --binary %s: %q; want it refused, saying %q", c.path, out, c.why)
		}
		wantLog(t, m, "restart refused", c.why) // the keeper's log says why, a moment after the reply maybe
	}
	if _, err := os.Stat(ran); err == nil {
		t.Error("a refused binary ran")
	}
	if m.daemonPid(t) != pid || unix.Kill(pid, 0) != nil {
		t.Fatalf("the daemon %d no longer serves after refused restarts", pid)
	}
	self, err := os.ReadFile(tensorfs)
	good := filepath.Join(dir, "tensorfs-good")
	if err == nil {
		err = writeExecutable(good, self)
	}
	if err == nil {
		err = os.Symlink(good, filepath.Join(dir, "link"))
	}
	if err != nil {
		t.Fatal(err)
	}
	m.restart(t, filepath.Join(dir, "link"))
	proc := "/proc/" + strconv.Itoa(m.daemonPid(t))
	if exe, err := os.Readlink(proc + "/exe"); err != nil || exe != good {
		t.Errorf("the daemon restarted through a link runs %q (%v), want %s", exe, err, good)
	}
	fds, _ := os.ReadDir(proc + "/fd")
	for _, fd := range fds {
		if p, _ := os.Readlink(proc + "/fd/" + fd.Name()); p == good {
			t.Errorf("the daemon holds its own binary open on descriptor %s, which its children would inherit", fd.Name())
		}
	}
}
