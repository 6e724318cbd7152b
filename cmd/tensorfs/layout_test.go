package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// TestSetShow: set gives a segment a dtype and a contiguous shape, show
// prints it; refusals name the path and say why, and change nothing. Run
// on a directory with user attributes (the mount's checks are the
// integration tests').
func TestSetShow(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "w")
	if err := os.WriteFile(p, make([]byte, 48), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(p, alloc.AttrStride, []byte("[1, 3]"), 0); errors.Is(err, unix.ENOTSUP) {
		t.Skipf("no user xattrs on %s", dir)
	}
	if code, out, errOut := runCLI("set", "--allow-outside", "float", "3,4", p); code != 0 || out != p+": float32 [3, 4]\n" {
		t.Fatalf("set: %d %q %q", code, out, errOut)
	}
	if _, ok, _ := alloc.GetXattr(p, alloc.AttrStride); ok {
		t.Errorf("set left the old stride")
	}
	if code, out, _ := runCLI("show", "--allow-outside", p); code != 0 || out != p+": float32 [3, 4] (48 bytes; contiguous)\n" {
		t.Errorf("show: %d %q", code, out)
	}
	for _, c := range []struct {
		args    []string
		code    int
		mention string
	}{
		{[]string{"set", "--allow-outside", "float64", "[3, 4]", p}, 1, p + ": float64 [3, 4] needs 96 bytes, the segment has 48"},
		{[]string{"set", "--allow-outside", "float32", "3x4", p}, 2, `"3x4" is not a non-negative integer`},
		{[]string{"set", "--allow-outside", "Nope", "[1]", p}, 2, `unknown dtype "Nope"`},
		{[]string{"set", "--allow-outside", "float32", "[1]", dir}, 1, dir + " is not a segment"},
		{[]string{"show", "--allow-outside", filepath.Join(dir, "missing")}, 1, "no such file"},
		// Outside a mount, without --allow-outside: refused, saying where it is.
		{[]string{"set", "F32", "[3, 4]", p}, 1, p + " is not in a tensorfs mount: it is on "},
		{[]string{"show", p}, 1, "; or pass --allow-outside"},
		{[]string{"ls", dir}, 1, dir + " is not in a tensorfs mount"},
	} {
		code, _, errOut := runCLI(c.args...)
		if code != c.code || !strings.Contains(errOut, c.mention) {
			t.Errorf("%q: exit %d, stderr %q; want %d mentioning %q", c.args, code, errOut, c.code, c.mention)
		}
	}
	if code, out, _ := runCLI("show", "--allow-outside", p); code != 0 || !strings.Contains(out, "float32 [3, 4]") {
		t.Errorf("a refused set changed the layout: %q", out)
	}
	// safetensors' spelling; show of a directory shows each segment.
	if code, out, errOut := runCLI("set", "--allow-outside", "BF16", "[24]", p); code != 0 || out != p+": bfloat16 [24]\n" {
		t.Errorf("set BF16: %d %q %q", code, out, errOut)
	}
	empty := filepath.Join(dir, "raw")
	if err := os.WriteFile(empty, []byte{1}, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, out, _ := runCLI("show", "--allow-outside", empty); !strings.Contains(out, "no dtype or shape (1 bytes;") {
		t.Errorf("show of a segment without layout: %q", out)
	}
	want := empty + ": no dtype or shape (1 bytes; tensorfs set DTYPE SHAPE " + empty + " gives it one)\n" +
		p + ": bfloat16 [24] (48 bytes; contiguous)\n"
	if code, out, errOut := runCLI("show", "--allow-outside", dir); code != 0 || out != want {
		t.Errorf("show of a directory: %d\n%s%s\nwant\n%s", code, out, errOut, want)
	}
}
