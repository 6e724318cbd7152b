package integration

// tensorfs ls [-l] (DESIGN.md §8): the table of segments, the directory
// summary line, and the holders column with a child holding a segment.

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// lsHolderScript opens argv[1] read-only, says "ok", and keeps it open
// until its stdin closes.
const lsHolderScript = `
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("ok", flush=True)
sys.stdin.read()
`

// lsHold starts a python3 child holding path open and returns its pid and
// command name once it does; its cleanup (which runs before the mount's)
// ends it.
func lsHold(t *testing.T, path string) (int, string) {
	t.Helper()
	c := startPython(t, "holder of "+path, lsHolderScript, path)
	c.expect(t, "ok")
	pid := c.cmd.Process.Pid
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		t.Fatal(err)
	}
	return pid, strings.TrimSpace(string(comm))
}

// lsRow returns the whitespace-separated fields of the line of out whose
// first field is name, nil if there is none.
func lsRow(out, name string) []string {
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[0] == name {
			return f
		}
	}
	return nil
}

// lsWantRow fails unless out has a row for name with exactly these fields
// (a shape such as "[512, 512]" is two fields).
func lsWantRow(t *testing.T, out, name string, want ...string) {
	t.Helper()
	got := lsRow(out, name)
	if strings.Join(got, " ") != strings.Join(append([]string{name}, want...), " ") {
		t.Errorf("row %s = %q, want %q\n%s", name, got, append([]string{name}, want...), out)
	}
}

// TestLs: a directory lists its segments (with and without dtype/shape)
// and subdirectories under a header, after a summary line of the whole
// subtree; -l adds the holders, which show a child holding a segment; a
// missing path is an error that does not stop the others.
func TestLs(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("model")
		if err := os.MkdirAll(m.path("model/sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		run(t, "dd", "if=/dev/zero", "of="+m.path("model/w"), "bs=1M", "count=1", "status=none")
		run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "float32", m.path("model/w"))
		run(t, "setfattr", "-n", "user.tensor.shape", "-v", "[512, 512]", m.path("model/w"))
		run(t, "dd", "if=/dev/zero", "of="+m.path("model/sub/x"), "bs=4k", "count=1", "status=none")
		if err := os.WriteFile(m.path("model/plain"), make([]byte, 100), 0o644); err != nil {
			t.Fatal(err)
		}
		pid, comm := lsHold(t, m.path("model/w"))

		out := stOK(t, "ls", dir)
		lines := strings.Split(out, "\n")
		if want := dir + "  1.0M  3 segments"; lines[0] != want {
			t.Errorf("summary line %q, want %q\n%s", lines[0], want, out)
		}
		if got := strings.Join(strings.Fields(lines[1]), " "); got != "NAME SIZE DEVICE FLAGS REFS DTYPE SHAPE" {
			t.Errorf("header line %q\n%s", lines[1], out)
		}
		lsWantRow(t, out, "w", "1.0M", "cpu", "SHAREDMEM", "1", "float32", "[512,", "512]")
		lsWantRow(t, out, "plain", "100", "cpu", "SHAREDMEM", "0", "-", "-")
		lsWantRow(t, out, "sub/", "4.0K", "cpu", "SHAREDMEM", "-", "-", "-")
		if len(strings.Split(strings.TrimSpace(out), "\n")) != 5 {
			t.Errorf("want a summary, a header and 3 rows:\n%s", out)
		}

		out = stOK(t, "ls", "-l", m.path("model/w"), m.path("model/plain"))
		if got := strings.Join(strings.Fields(strings.Split(out, "\n")[0]), " "); got != "NAME SIZE DEVICE FLAGS REFS DTYPE SHAPE HOLDERS" {
			t.Errorf("ls -l has no HOLDERS column:\n%s", out)
		}
		holder := fmt.Sprintf("%d:%s(1)", pid, comm)
		lsWantRow(t, out, m.path("model/w"), "1.0M", "cpu", "SHAREDMEM", "1", "float32", "[512,", "512]", holder)
		lsWantRow(t, out, m.path("model/plain"), "100", "cpu", "SHAREDMEM", "0", "-", "-", "-")

		stdout, stderr, code := stTensorfs(t, "ls", m.path("missing"), m.path("model/sub"))
		if code != 1 || !strings.Contains(stderr, "missing") || strings.Count(stderr, "\n") != 1 {
			t.Errorf("ls of a missing path: exit %d, stderr %q; want 1 and one line naming it", code, stderr)
		}
		if !strings.Contains(stdout, m.path("model/sub")+"  4.0K  1 segment") {
			t.Errorf("ls of a missing path and a directory did not list the directory:\n%s", stdout)
		}
		lsWantRow(t, stdout, "x", "4.0K", "cpu", "SHAREDMEM", "0", "-", "-")
	})
}
