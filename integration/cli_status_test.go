package integration

import (
	"debug/buildinfo"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// statusRow returns the fields of the row of tensorfs status's table for
// the mount at dir, nil if there is none.
func statusRow(out, dir string) []string {
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[0] == dir {
			return f
		}
	}
	return nil
}

// TestCLIStatus: tensorfs status shows a mount's mode, use, segments and
// daemon to root and to another user (who sees no daemon version: its
// binary is root's to read), as a table and as JSON; with no argument it
// lists every tensorfs mount, this one included; a hung daemon does not
// hang it; --version names this binary's version.
func TestCLIStatus(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		run(t, "dd", "if=/dev/zero", "of="+m.path("w"), "bs=1M", "count=2", "status=none")
		out := stOK(t, "status", m.dir)
		if !strings.HasPrefix(out, "MOUNTPOINT") {
			t.Errorf("status has no header:\n%s", out)
		}
		row := statusRow(out, m.dir)
		// MOUNTPOINT MODE USED CAPACITY SEGMENTS LIMBO REQUESTS DAEMON RSS VERSION... CLUSTER
		if len(row) < 11 || row[1] != m.mode || row[3] != "256.0M" || row[4] != "1" || row[7] != strconv.Itoa(m.pid) || row[len(row)-1] != "-" {
			t.Errorf("status row for %s: %q (mode %s, daemon %d)\n%s", m.dir, row, m.mode, m.pid, out)
		}
		// Every mount on the machine: another test's may be crashing or
		// hung meanwhile, which makes the status 1, never this row go.
		if all, errs, code := stTensorfs(t, "status"); code < 0 || code > 1 || statusRow(all, m.dir) == nil {
			t.Errorf("status without a mount point (exit %d) does not list %s:\n%s\n%s", code, m.dir, all, errs)
		}

		var reports []struct {
			Mountpoint string `json:"mountpoint"`
			Version    string `json:"daemon_version"`
			Stats      struct {
				Mode     string `json:"mode"`
				Segments int64  `json:"segments"`
				Bytes    int64  `json:"bytes"`
				Daemon   struct {
					Pid int `json:"pid"`
				} `json:"daemon"`
			} `json:"stats"`
		}
		out = stOK(t, "status", "--json", m.dir)
		if err := json.Unmarshal([]byte(out), &reports); err != nil || len(reports) != 1 {
			t.Fatalf("status --json: %v\n%s", err, out)
		}
		r := reports[0]
		if r.Mountpoint != m.dir || r.Stats.Mode != m.mode || r.Stats.Segments != 1 || r.Stats.Bytes != 2<<20 ||
			r.Stats.Daemon.Pid != m.pid || !strings.HasPrefix(r.Version, binaryVersion(t)) {
			t.Errorf("status --json: %+v", r)
		}

		reachable(t, m.dir)
		reachable(t, tensorfs)
		out, err := runAs(t, userA, "/", tensorfs, "status", m.dir)
		if row := statusRow(out, m.dir); err != nil || len(row) != 11 || row[4] != "1" || row[9] != "-" {
			t.Errorf("status as uid %d: %v, row %q (want 1 segment, version -)\n%s", userA, err, row, out)
		}
	}, "--allow-other")

	// A hung daemon (stopped here) is reported within statusWait (5 s),
	// and the other mounts are shown all the same.
	live, hung := mountFS(t, "passthrough"), mountFS(t, "passthrough")
	if err := syscall.Kill(hung.pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, errs, code := stTensorfs(t, "status", live.dir, hung.dir)
	took := time.Since(start)
	syscall.Kill(hung.pid, syscall.SIGCONT)
	if code != 1 || statusRow(out, live.dir) == nil || !strings.Contains(errs, hung.dir+": its daemon did not answer within 5s") || took > 30*time.Second {
		t.Errorf("status of a live mount and a hung one: exit %d after %v\n%s\n%s", code, took, out, errs)
	}

	out = stOK(t, "--version")
	if !strings.HasPrefix(out, "tensorfs "+binaryVersion(t)+", commit ") || strings.Count(out, "\n") != 1 {
		t.Errorf("--version: %q", out)
	}
}

// TestCLIOutsideMount: ls, show and set refuse a path that is not in a
// tensorfs mount, saying where it is, and change nothing; --allow-outside
// lets them, and status of such a path says it is no mount.
func TestCLIOutsideMount(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	p := filepath.Join(dir, "w")
	if err := os.WriteFile(p, make([]byte, 32), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"set", "F32", "[8]", p}, {"show", p}, {"ls", dir}, {"ls", "-R", dir}, {"status", dir}} {
		stdout, stderr, code := stTensorfs(t, args...)
		if code != 1 || stdout != "" || !strings.Contains(stderr, " is not in a tensorfs mount: it is on ") || strings.Count(stderr, "\n") != 1 {
			t.Errorf("tensorfs %q: exit %d, stdout %q, stderr %q; want 1 and one line saying where it is", args, code, stdout, stderr)
		}
	}
	if v, err := getxattr(p, "user.tensor.dtype"); err == nil {
		t.Errorf("a refused set left user.tensor.dtype=%q", v)
	}
	if out := stOK(t, "set", "--allow-outside", "F32", "[8]", p); out != p+": float32 [8]\n" {
		t.Errorf("set --allow-outside: %q", out)
	}
}

// TestCLILsRecursiveShowDir: ls -R lists each subdirectory in a block of
// its own; show of a directory shows every segment under it; set and the
// daemon take safetensors' dtype spellings, and a refused one is quoted
// as given.
func TestCLILsRecursiveShowDir(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("model")
		if err := os.MkdirAll(m.path("model/sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{"model/w", "model/sub/x"} {
			if err := os.WriteFile(m.path(p), make([]byte, 64), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if out := stOK(t, "set", "BF16", "[4, 8]", m.path("model/w")); out != m.path("model/w")+": bfloat16 [4, 8]\n" {
			t.Errorf("set BF16: %q", out)
		}
		xaSet(t, m.path("model/sub/x"), "user.tensor.dtype", "I64") // the daemon's own check
		xaWant(t, m.path("model/sub/x"), "user.tensor.dtype", "int64")
		xaSet(t, m.path("model/sub/x"), "user.tensor.shape", "[8]")

		out := stOK(t, "ls", "-R", dir)
		blocks := strings.Split(strings.TrimSpace(out), "\n\n")
		if len(blocks) != 2 || !strings.HasPrefix(blocks[0], dir+"  128  2 segments\n") ||
			!strings.HasPrefix(blocks[1], m.path("model/sub")+"  64  1 segment\n") {
			t.Fatalf("ls -R: want a block for model and one for model/sub:\n%s", out)
		}
		lsWantRow(t, blocks[1], "x", "64", "cpu", "SHAREDMEM", "0", "int64", "[8]")

		want := m.path("model/sub/x") + ": int64 [8] (64 bytes; contiguous)\n" +
			m.path("model/w") + ": bfloat16 [4, 8] (64 bytes; contiguous)\n"
		if out := stOK(t, "show", dir); out != want {
			t.Errorf("show of a directory:\n%s\nwant\n%s", out, want)
		}

		stdout, stderr, code := stTensorfs(t, "set", "f32", "[8]", m.path("model/w"))
		if code != 2 || stdout != "" || !strings.Contains(stderr, `unknown dtype "f32"`) {
			t.Errorf("set f32: exit %d, stdout %q, stderr %q; want 2 and the spelling quoted as given", code, stdout, stderr)
		}
	})
}

// binaryVersion is the module version go build stamped into the binary
// under test: "(devel)", or a pseudo-version from the commit it was built
// at.
func binaryVersion(t *testing.T) string {
	t.Helper()
	bi, err := buildinfo.ReadFile(tensorfs)
	if err != nil {
		t.Fatal(err)
	}
	return bi.Main.Version
}
