package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
	"tensorfs/safetensors/transfer"
)

// runCLI runs the command line args in-process.
func runCLI(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestRunUsage: usage errors exit 2 with one line (or the usage) on
// stderr; help goes to stdout.
func TestRunUsage(t *testing.T) {
	for _, c := range []struct {
		args   []string
		code   int
		stdout string // a substring of stdout
		stderr string // a substring of stderr; "" for none
	}{
		{nil, 2, "", "usage:"},
		{[]string{"frobnicate"}, 2, "", `unknown command "frobnicate"`},
		{[]string{"help"}, 0, "tensorfs import [--pack-below SIZE] FILE|INDEX|DIR DIR", ""},
		{[]string{"--help"}, 0, "usage:", ""},
		{[]string{"import", "-h"}, 0, "usage: tensorfs import", ""},
		{[]string{"import", "a.safetensors"}, 2, "", "tensorfs import: want [--pack-below SIZE] FILE.safetensors|INDEX.json|CHECKPOINT-DIR DIR"},
		{[]string{"import", "--pack-below", "xy", "a", "b"}, 2, "", `tensorfs import: --pack-below: size "xy": want a number of bytes, or a number and TB, GB, MB or KB`},
		{[]string{"import", "--pack-below", "-1", "a", "b"}, 2, "", `tensorfs import: --pack-below: size "-1" is not positive`},
		{[]string{"import", "--pack-below", "1MiB", "a", "b"}, 2, "", `tensorfs import: --pack-below: size "1MiB": want a number of bytes, or a number and TB, GB, MB or KB`},
		{[]string{"export", "--max-shard-size", "0", "a", "b"}, 2, "", `tensorfs export: --max-shard-size: size "0" is not positive`},
		{[]string{"export", "a", "b", "c"}, 2, "", "tensorfs export: want [--max-shard-size SIZE] [--tied NAME]... DIR FILE.safetensors|OUT-DIR"},
		{[]string{"import", "--bogus", "a", "b"}, 2, "", "flag provided but not defined: -bogus"},
		{[]string{"mount"}, 2, "", "want exactly one MOUNTPOINT"},
		{[]string{"mount", "--gpu", "opencl", "/nonexistent"}, 2, "", "--gpu opencl"},
		{[]string{"unmount"}, 2, "", "want exactly one MOUNTPOINT"},
		{[]string{"ls", "-x"}, 2, "", "flag provided but not defined"},
	} {
		code, stdout, stderr := runCLI(c.args...)
		if code != c.code || !strings.Contains(stdout, c.stdout) || (c.stderr == "") != (stderr == "") || !strings.Contains(stderr, c.stderr) {
			t.Errorf("run(%q) = %d\nstdout %q\nstderr %q\nwant %d, stdout with %q, stderr with %q", c.args, code, stdout, stderr, c.code, c.stdout, c.stderr)
		}
		if c.code == 2 && len(c.args) > 1 && strings.Count(stderr, "\n") != 1 {
			t.Errorf("run(%q): stderr is not one line: %q", c.args, stderr)
		}
	}
}

// TestRunLs: ls --allow-outside of a plain directory lists its entries,
// "-" for what only a mount has; a missing path fails with one line and
// exit 1.
func TestRunLs(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "weights"), make([]byte, 2048), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runCLI("ls", "--allow-outside", dir)
	lines := strings.Split(strings.TrimRight(stdout, "\n"), "\n")
	if code != 0 || stderr != "" || len(lines) != 4 {
		t.Fatalf("ls %s = %d, stderr %q, stdout:\n%s", dir, code, stderr, stdout)
	}
	if lines[0] != dir+"  -  - segments" || !strings.HasPrefix(lines[1], "NAME") {
		t.Errorf("ls header lines %q", lines[:2])
	}
	if f := strings.Fields(lines[3]); len(f) != 7 || f[0] != "weights" || f[1] != "2.0K" || f[2] != "-" || f[6] != "-" {
		t.Errorf("ls row for weights: %q", lines[3])
	}
	if f := strings.Fields(lines[2]); len(f) == 0 || f[0] != "sub/" {
		t.Errorf("ls row for sub: %q", lines[2])
	}

	code, _, stderr = runCLI("ls", "--allow-outside", filepath.Join(dir, "missing"))
	if code != 1 || !strings.HasPrefix(stderr, "tensorfs ls: ") || strings.Count(stderr, "\n") != 1 {
		t.Errorf("ls of a missing path = %d, stderr %q; want 1 and one line", code, stderr)
	}
}

// TestRunImportExport: import and export round trip a file through a
// directory that passes for one in a mount (it has user.tensorfs.flags,
// which every directory of a mount answers), with --pack-below too; a
// FIFO and a directory outside a mount are refused with one line and exit
// 1.
func TestRunImportExport(t *testing.T) {
	mnt := t.TempDir()
	err := unix.Setxattr(mnt, alloc.AttrFlags, []byte("SHAREDMEM"), 0)
	if errors.Is(err, unix.ENOTSUP) {
		t.Skipf("no user xattrs on %s", mnt)
	}
	if err != nil {
		t.Fatal(err)
	}
	h := &safetensors.Header{
		Metadata: map[string]string{"format": "pt"},
		Tensors: []safetensors.Tensor{
			{Name: "w", Dtype: "F32", Shape: []int64{2, 2}},
			{Name: "layers/0/b", Dtype: "I8", Shape: []int64{3}},
		},
	}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	content := append(append(safetensors.AppendPrefix(nil, header), header...), "0123456789abcdefXYZ"...)
	tmp := t.TempDir()
	src := filepath.Join(tmp, "model.safetensors")
	if err := os.WriteFile(src, content, 0o644); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		flags  []string
		packed bool // layers/0/b, 3 bytes, goes into the pack
	}{
		{nil, false},
		{[]string{"--pack-below", "0"}, false},
		{[]string{"--pack-below", "4"}, true},
		{[]string{"--pack-below=1KB"}, true},
	} {
		dir := filepath.Join(mnt, fmt.Sprint("model", c.flags))
		code, stdout, stderr := runCLI(slices.Concat([]string{"import"}, c.flags, []string{src, dir})...)
		if code != 0 || stderr != "" || stdout != "imported 2 tensors (19 bytes) from "+src+" into "+dir+"\n" {
			t.Fatalf("import %q = %d\nstdout %q\nstderr %q", c.flags, code, stdout, stderr)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "layers/0/b")); c.packed != (err != nil) || !c.packed && string(b) != "XYZ" {
			t.Errorf("import %q: segment layers/0/b = %q, %v; want it packed: %v", c.flags, b, err, c.packed)
		}
		if _, err := os.Stat(filepath.Join(dir, transfer.PackName)); c.packed != (err == nil) {
			t.Errorf("import %q: %s: %v; want it packed: %v", c.flags, transfer.PackName, err, c.packed)
		}
		out := filepath.Join(tmp, "back.safetensors")
		code, stdout, stderr = runCLI("export", dir, out)
		if code != 0 || stderr != "" || stdout != "exported 2 tensors (19 bytes) from "+dir+" to "+out+"\n" {
			t.Fatalf("export = %d\nstdout %q\nstderr %q", code, stdout, stderr)
		}
		if back, err := os.ReadFile(out); err != nil || !bytes.Equal(back, content) {
			t.Errorf("import %q: export differs from the imported file (%v)", c.flags, err)
		}
	}

	fifo := filepath.Join(tmp, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ src, dir, want string }{
		{fifo, filepath.Join(mnt, "x"), "not a regular file"},
		{src, filepath.Join(tmp, "x"), "not inside a tensorfs mount"},
	} {
		code, stdout, stderr := runCLI("import", c.src, c.dir)
		if code != 1 || stdout != "" || !strings.HasPrefix(stderr, "tensorfs import: ") ||
			!strings.Contains(stderr, c.want) || strings.Count(stderr, "\n") != 1 {
			t.Errorf("import %s %s = %d, stdout %q, stderr %q; want 1 and one line saying %q", c.src, c.dir, code, stdout, stderr, c.want)
		}
		if _, err := os.Stat(c.dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("refused import left %s (%v)", c.dir, err)
		}
	}
}

func TestProgress(t *testing.T) {
	var b bytes.Buffer
	p := &progress{w: &b, label: "importing m", start: time.Now().Add(-time.Second)}
	p.update(1<<20, 2<<20) // too small for a line
	p.update(256<<20, 1<<30)
	p.finish()
	if got := b.String(); !strings.HasPrefix(got, "\rimporting m  256.0M/1.0G   25%  ") || !strings.Contains(got, "/s  ETA ") || !strings.HasSuffix(got, "\x1b[K\n") {
		t.Errorf("progress line %q", got)
	}
	if isTerminal(&b) {
		t.Error("a buffer is a terminal")
	}
}
