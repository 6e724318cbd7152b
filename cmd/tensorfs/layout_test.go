package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
	"tensorfs/safetensors/transfer"
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

// TestShowLsPack: show prints a pack directly in the directory shown, or
// given itself, as a line for the pack and one per tensor it holds, and
// ls a row per tensor under the pack's; a packed.safetensors in a
// subdirectory is an ordinary file. A pack whose header is not valid is an
// error line naming it and exit 1, the other lines printed still.
func TestShowLsPack(t *testing.T) {
	dir := t.TempDir()
	embed := filepath.Join(dir, "embed")
	if err := os.WriteFile(embed, make([]byte, 8), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(embed, alloc.AttrDtype, []byte("float32"), 0); errors.Is(err, unix.ENOTSUP) {
		t.Skipf("no user xattrs on %s", dir)
	}
	if err := unix.Setxattr(embed, alloc.AttrShape, []byte("[2]"), 0); err != nil {
		t.Fatal(err)
	}
	h := &safetensors.Header{Tensors: []safetensors.Tensor{
		{Name: "ids", Dtype: "I64", Shape: []int64{2}},
		{Name: "w", Dtype: "F32", Shape: []int64{4, 4}},
		{Name: "h/0.bias", Dtype: "F16", Shape: []int64{3}},
	}} // the reference writer's order, as the Python client writes a pack
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	pack := filepath.Join(dir, transfer.PackName)
	content := slices.Concat(safetensors.AppendPrefix(nil, header), header, make([]byte, h.DataSize()))
	if err := os.WriteFile(pack, content, 0o644); err != nil {
		t.Fatal(err)
	}
	sub := filepath.Join(dir, "sub", transfer.PackName)
	if err := os.Mkdir(filepath.Dir(sub), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sub, content, 0o644); err != nil {
		t.Fatal(err)
	}
	at := safetensors.PrefixSize + len(header)
	packLines := fmt.Sprintf("%s: a pack of 3 tensors (%d bytes)\n", pack, len(content)) +
		fmt.Sprintf("%s/ids: int64 [2] (16 bytes; contiguous; in packed.safetensors at byte %d)\n", dir, at) +
		fmt.Sprintf("%s/w: float32 [4, 4] (64 bytes; contiguous; in packed.safetensors at byte %d)\n", dir, at+16) +
		fmt.Sprintf("%s/h/0.bias: float16 [3] (6 bytes; contiguous; in packed.safetensors at byte %d)\n", dir, at+80)
	embedLine := embed + ": float32 [2] (8 bytes; contiguous)\n"
	subLine := fmt.Sprintf("%s: no dtype or shape (%d bytes; tensorfs set DTYPE SHAPE %s gives it one)\n", sub, len(content), sub)
	if code, out, errOut := runCLI("show", "--allow-outside", dir); code != 0 || out != embedLine+packLines+subLine {
		t.Errorf("show of a directory with a pack: %d\n%s%s\nwant\n%s", code, out, errOut, embedLine+packLines+subLine)
	}
	if code, out, errOut := runCLI("show", "--allow-outside", pack); code != 0 || out != packLines {
		t.Errorf("show of a pack: %d\n%s%s\nwant\n%s", code, out, errOut, packLines)
	}
	wantRows := [][]string{
		{"embed", "8", "-", "-", "-", "float32", "[2]"},
		{transfer.PackName, strconv.Itoa(len(content)), "-", "-", "-", "-", "-"},
		{"ids", "16", "-", "-", "-", "int64", "[2]"},
		{"w", "64", "-", "-", "-", "float32", "[4,", "4]"},
		{"h/0.bias", "6", "-", "-", "-", "float16", "[3]"},
		{"sub/", "-", "-", "-", "-", "-", "-"},
	}
	code, out, errOut := runCLI("ls", "-R", "--allow-outside", dir)
	blocks := strings.Split(out, "\n\n")
	lines := strings.Split(blocks[0], "\n")[2:]
	if code != 0 || errOut != "" || len(blocks) != 2 || len(lines) != len(wantRows) {
		t.Fatalf("ls -R of a directory with a pack: %d %q\n%s", code, errOut, out)
	}
	for i, want := range wantRows {
		if got := strings.Fields(lines[i]); !slices.Equal(got, want) {
			t.Errorf("ls row %d: %q, want %q", i, lines[i], want)
		}
	}
	if strings.Count(blocks[1], "\n") != 3 {
		t.Errorf("ls -R listed the tensors of sub/%s:\n%s", transfer.PackName, blocks[1])
	}

	if err := os.WriteFile(pack, content[:len(content)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	wantErr := "tensorfs show: pack " + pack + ": "
	if code, out, errOut := runCLI("show", "--allow-outside", dir); code != 1 || out != embedLine+subLine || !strings.HasPrefix(errOut, wantErr) || strings.Count(errOut, "\n") != 1 {
		t.Errorf("show of a directory with a truncated pack: %d\n%s%s\nwant 1, the other lines, and one line on stderr starting %q", code, out, errOut, wantErr)
	}
	wantErr = "tensorfs ls: pack " + pack + ": "
	if code, out, errOut := runCLI("ls", "--allow-outside", dir); code != 1 || strings.Count(out, "\n") != 5 || !strings.HasPrefix(errOut, wantErr) || strings.Count(errOut, "\n") != 1 {
		t.Errorf("ls of a directory with a truncated pack: %d\n%s%s\nwant 1, the entries, and one line on stderr starting %q", code, out, errOut, wantErr)
	}
}

// TestShowLsPackBadName: a pack holding a name that no writer gives a
// tensor (a path that leaves the directory, a temporary entry, the
// pack's own name...) is an error line naming the pack and the name, as
// one with an invalid header is, for show of the pack, of its directory,
// and for ls.
func TestShowLsPackBadName(t *testing.T) {
	for _, name := range []string{"../x", "a//b", "a\x00b", ".save-1/w", ".import-1", transfer.PackName, transfer.PackName + "/x"} {
		dir := t.TempDir()
		h := &safetensors.Header{Tensors: []safetensors.Tensor{
			{Name: "good.tensor", Dtype: "F32", Shape: []int64{2}},
			{Name: name, Dtype: "U8", Shape: []int64{1}},
		}}
		if err := h.Pack(); err != nil {
			t.Fatal(err)
		}
		header := h.Encode()
		pack := filepath.Join(dir, transfer.PackName)
		if err := os.WriteFile(pack, slices.Concat(safetensors.AppendPrefix(nil, header), header, make([]byte, h.DataSize())), 0o644); err != nil {
			t.Fatal(err)
		}
		quoted := alloc.EscapeText(strconv.Quote(name))
		for _, args := range [][]string{{"show", "--allow-outside", pack}, {"show", "--allow-outside", dir}, {"ls", "--allow-outside", dir}} {
			wantErr := "tensorfs " + args[0] + ": pack " + pack + ": "
			code, out, errOut := runCLI(args...)
			if code != 1 || !strings.HasPrefix(errOut, wantErr) || !strings.Contains(errOut, quoted) || strings.Count(errOut, "\n") != 1 || strings.Contains(out, "good.tensor") {
				t.Errorf("%s of a pack holding %q: %d\n%s%s\nwant 1 and one line on stderr starting %q and naming %s",
					args[0], name, code, out, errOut, wantErr, quoted)
			}
		}
	}
}
