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
	if code, out, errOut := runCLI("set", "float", "3,4", p); code != 0 || out != p+": float32 [3, 4]\n" {
		t.Fatalf("set: %d %q %q", code, out, errOut)
	}
	if _, ok, _ := alloc.GetXattr(p, alloc.AttrStride); ok {
		t.Errorf("set left the old stride")
	}
	if code, out, _ := runCLI("show", p); code != 0 || out != p+": float32 [3, 4] (48 bytes; contiguous)\n" {
		t.Errorf("show: %d %q", code, out)
	}
	for _, c := range []struct {
		args    []string
		code    int
		mention string
	}{
		{[]string{"set", "float64", "[3, 4]", p}, 1, p + ": float64 [3, 4] needs 96 bytes, the segment has 48"},
		{[]string{"set", "float32", "3x4", p}, 2, `"3x4" is not a non-negative integer`},
		{[]string{"set", "nope", "[1]", p}, 2, `unknown dtype "nope"`},
		{[]string{"set", "float32", "[1]", dir}, 1, dir + " is not a segment"},
		{[]string{"show", filepath.Join(dir, "missing")}, 1, "no such file"},
	} {
		code, _, errOut := runCLI(c.args...)
		if code != c.code || !strings.Contains(errOut, c.mention) {
			t.Errorf("%q: exit %d, stderr %q; want %d mentioning %q", c.args, code, errOut, c.code, c.mention)
		}
	}
	if code, out, _ := runCLI("show", p); code != 0 || !strings.Contains(out, "float32 [3, 4]") {
		t.Errorf("a refused set changed the layout: %q", out)
	}
	empty := filepath.Join(dir, "raw")
	if err := os.WriteFile(empty, []byte{1}, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, out, _ := runCLI("show", empty); !strings.Contains(out, "no dtype or shape (1 bytes;") {
		t.Errorf("show of a segment without layout: %q", out)
	}
}
