package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
)

// fakeMount returns a new directory that Import takes for one inside a
// tensorfs mount: it has user.tensorfs.flags, which every directory of a
// mount answers. Segments in it are plain files with user attributes, so
// the tests need a filesystem with user xattrs (ext4, tmpfs), or skip.
func fakeMount(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	err := unix.Setxattr(dir, alloc.AttrFlags, []byte("SHAREDMEM"), 0)
	if errors.Is(err, unix.ENOTSUP) {
		t.Skipf("no user xattrs on %s", dir)
	}
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// testTensors are the tensors of testFile: names, dtypes and shapes.
var testTensors = []safetensors.Tensor{
	{Name: "embed.weight", Dtype: "F32", Shape: []int64{4, 3}},
	{Name: "layers/0/bias", Dtype: "F16", Shape: []int64{5}},
	{Name: "layers/1/ids", Dtype: "I64", Shape: []int64{3}},
	{Name: "scalar", Dtype: "F64", Shape: []int64{}},
	{Name: "empty", Dtype: "I32", Shape: []int64{0, 4}},
	{Name: "big", Dtype: "U8", Shape: []int64{2*chunkSize + 5}}, // several chunks
}

// testFile writes a safetensors file in the reference writer's layout and
// returns its path and contents.
func testFile(t *testing.T, meta map[string]string) (string, []byte) {
	t.Helper()
	h := &safetensors.Header{Tensors: slices.Clone(testTensors), Metadata: meta}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	b := append(safetensors.AppendPrefix(nil, header), header...)
	b = append(b, pattern(int(h.DataSize()))...)
	path := filepath.Join(t.TempDir(), "model.safetensors")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path, b
}

// readHeader reads the header of the safetensors file path.
func readHeader(t *testing.T, path string) *safetensors.Header {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	h, _, err := safetensors.ReadHeader(f, fi.Size())
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// pattern returns n bytes that repeat every 251, so that a chunk in the
// wrong place shows.
func pattern(n int) []byte {
	period := make([]byte, 251)
	for i := range period {
		period[i] = byte(i)
	}
	return bytes.Repeat(period, n/len(period)+1)[:n]
}

// tree lists what is under dir, directories with a trailing slash.
func tree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		if d.IsDir() {
			rel += "/"
		}
		out = append(out, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestImportExport(t *testing.T) {
	src, content := testFile(t, map[string]string{"format": "pt"})
	dir := filepath.Join(fakeMount(t), "model")
	var last, total int64
	sum, err := Import(context.Background(), src, dir, Options{Progress: func(done, n int64) { last, total = done, n }})
	if err != nil {
		t.Fatal(err)
	}
	h := readHeader(t, src)
	if sum.Tensors != len(testTensors) || sum.Files != 1 || last != h.DataSize() || total != h.DataSize() {
		t.Errorf("Import: %+v, progress %d of %d; want %d tensors, %d of %d",
			sum, last, total, len(testTensors), h.DataSize(), h.DataSize())
	}
	want := []string{"big", "embed.weight", "empty", "layers/", "layers/0/", "layers/0/bias", "layers/1/", "layers/1/ids", "scalar"}
	if got := tree(t, dir); !slices.Equal(got, want) {
		t.Errorf("imported tree %q, want %q", got, want)
	}
	dataAt := int64(len(content)) - h.DataSize()
	for _, tn := range h.Tensors {
		p := filepath.Join(dir, tn.Name)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, content[dataAt+tn.Begin:dataAt+tn.End]) {
			t.Errorf("%s: %d bytes differ from the tensor's", tn.Name, len(b))
		}
		dt, _ := safetensors.TensorfsDtype(tn.Dtype)
		for name, v := range map[string]string{alloc.AttrDtype: dt, alloc.AttrShape: alloc.FormatShape(tn.Shape)} {
			if got, _, _ := alloc.GetXattr(p, name); string(got) != v {
				t.Errorf("%s: %s = %q, want %q", tn.Name, name, got, v)
			}
		}
	}
	if v, _, _ := alloc.GetXattr(dir, attrSTMeta+"format"); string(v) != "pt" {
		t.Errorf("%sformat = %q, want pt", attrSTMeta, v)
	}
	if _, ok, _ := alloc.GetXattr(dir, attrSTHeader); ok {
		t.Errorf("a reference-layout import kept %s", attrSTHeader)
	}

	var warnings []string
	warn := func(msg string) { warnings = append(warnings, msg) }
	half := filepath.Join(dir, "half")
	if err := os.WriteFile(half, []byte{1}, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(half, alloc.AttrDtype, []byte("uint8"), 0); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "back.safetensors")
	if _, err := Export(context.Background(), dir, out, Options{Warn: warn}); err != nil {
		t.Fatal(err)
	}
	if back, err := os.ReadFile(out); err != nil || !bytes.Equal(back, content) {
		t.Errorf("export differs from the imported file (%v)", err)
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "skipping "+half) {
		t.Errorf("warnings %q, want one skipping %s", warnings, half)
	}
}

// TestImportKeepsHeader: a header not in the reference layout is kept, and
// export gives back the same bytes.
func TestImportKeepsHeader(t *testing.T) {
	raw := `{"b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]}}`
	content := append(append(safetensors.AppendPrefix(nil, []byte(raw)), raw...), 1, 2, 3)
	src := filepath.Join(t.TempDir(), "pretty.safetensors")
	if err := os.WriteFile(src, content, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := fakeMount(t)
	if _, err := Import(context.Background(), src, dir, Options{}); err != nil {
		t.Fatal(err)
	}
	if v, _, _ := alloc.GetXattr(dir, attrSTHeader); string(v) != raw {
		t.Errorf("%s = %q, want the original header", attrSTHeader, v)
	}
	out := filepath.Join(t.TempDir(), "back.safetensors")
	if _, err := Export(context.Background(), dir, out, Options{}); err != nil {
		t.Fatal(err)
	}
	if back, _ := os.ReadFile(out); !bytes.Equal(back, content) {
		t.Errorf("export = %q, want %q", back, content)
	}
}

// TestImportRefused: a malformed file, a directory outside a mount, a
// non-empty directory and an interrupted import, packing or not, leave
// nothing behind.
func TestImportRefused(t *testing.T) {
	src, content := testFile(t, nil)
	truncated := filepath.Join(t.TempDir(), "truncated.safetensors")
	if err := os.WriteFile(truncated, content[:len(content)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	mnt := fakeMount(t)
	if err := os.WriteFile(filepath.Join(mnt, "x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		name, src, dir string
		ctx            context.Context
		packBelow      int64
		want           string
	}{
		{"truncated", truncated, filepath.Join(mnt, "new/model"), context.Background(), 0, "truncated"},
		{"not a mount", src, filepath.Join(t.TempDir(), "model"), context.Background(), 0, "not inside a tensorfs mount"},
		{"not empty", src, mnt, context.Background(), 0, "not empty"},
		{"interrupted", src, filepath.Join(mnt, "new/model"), canceled, 0, "interrupted"},
		{"interrupted packing", src, filepath.Join(mnt, "new/model"), canceled, 1024, "interrupted"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Import(c.ctx, c.src, c.dir, Options{PackBelow: c.packBelow})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Import = %v, want an error saying %q", err, c.want)
			}
			if got := tree(t, mnt); !slices.Equal(got, []string{"x"}) {
				t.Errorf("after the refused import the mount holds %q, want just x", got)
			}
			if names, _ := listxattr(mnt); slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(n, attrSTPrefix) }) {
				t.Errorf("the refused import left attributes on the mount: %q", names)
			}
		})
	}
}

// TestExportInterrupted: an interrupted export leaves no file, temporary or
// not.
func TestExportInterrupted(t *testing.T) {
	src, _ := testFile(t, nil)
	dir := fakeMount(t)
	if _, err := Import(context.Background(), src, dir, Options{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	outDir := t.TempDir()
	_, err := Export(ctx, dir, filepath.Join(outDir, "out.safetensors"), Options{Progress: func(done, total int64) { cancel() }})
	if !errors.Is(err, errInterrupted) {
		t.Errorf("Export = %v, want interrupted", err)
	}
	if got := tree(t, outDir); len(got) != 0 {
		t.Errorf("interrupted export left %q", got)
	}
}

// TestOpenRegular: a FIFO is refused without blocking, as are directories;
// a regular file opens.
func TestOpenRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{fifo, dir} {
		f, err := openRegular(p)
		if err == nil {
			f.Close()
		}
		if err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("openRegular(%s) = %v, want not a regular file", p, err)
		}
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := openRegular(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 2)
	if n, err := f.Read(b); err != nil || string(b[:n]) != "x" {
		t.Errorf("read %s: %q, %v; want \"x\"", file, b[:n], err)
	}
}

func TestCheckTensorName(t *testing.T) {
	for _, name := range []string{"a", "a.b/c", "layers/0/attn", "ä", ".hidden", "a/.import-x"} {
		if err := checkTensorName(name); err != nil {
			t.Errorf("checkTensorName(%q) = %v", name, err)
		}
	}
	for _, name := range []string{"", "/a", "a/", "a//b", "..", "a/../b", ".", "a\x00b", ".import-1/x", ".save-1", ".save-w-1/x", strings.Repeat("x", 256)} {
		if err := checkTensorName(name); err == nil {
			t.Errorf("checkTensorName(%q) accepted", name)
		}
	}
}

func TestContiguous(t *testing.T) {
	for _, c := range []struct {
		shape, stride []int64
		want          bool
	}{
		{[]int64{2, 3}, []int64{3, 1}, true},
		{[]int64{2, 3}, []int64{1, 2}, false},
		{[]int64{1, 3}, []int64{99, 1}, true}, // extent 1: any stride
		{[]int64{2, 0}, []int64{5, 7}, true},  // empty
		{[]int64{}, []int64{}, true},
		{[]int64{2}, []int64{1, 1}, false},
	} {
		if got := contiguous(c.shape, c.stride); got != c.want {
			t.Errorf("contiguous(%v, %v) = %v, want %v", c.shape, c.stride, got, c.want)
		}
	}
}

func TestChunks(t *testing.T) {
	attrs := map[string][]byte{}
	value := bytes.Repeat([]byte("x"), 2*xattrSizeMax+1)
	setChunks(attrs, "user.v", value)
	if len(attrs) != 3 || len(attrs["user.v"]) != xattrSizeMax || len(attrs["user.v.2"]) != 1 {
		t.Errorf("setChunks made %d attributes", len(attrs))
	}
	setChunks(attrs, "user.empty", nil)
	if v, ok := attrs["user.empty"]; !ok || len(v) != 0 {
		t.Errorf("setChunks of an empty value: %q, %v", v, ok)
	}
}

// TestCopier: chunks spread over the workers land where they belong, with
// copy_file_range and without; a source that ends early fails the piece
// and the copier.
func TestCopier(t *testing.T) {
	dir := t.TempDir()
	data := pattern(2*chunkSize + 100)
	if err := os.WriteFile(filepath.Join(dir, "src"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(filepath.Join(dir, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	n := int64(len(data))
	for _, noCFR := range []bool{false, true} {
		dst, err := os.Create(filepath.Join(dir, fmt.Sprint("dst-", noCFR)))
		if err != nil {
			t.Fatal(err)
		}
		defer dst.Close()
		var mu sync.Mutex
		var finished []error
		finish := func(err error) error {
			mu.Lock()
			defer mu.Unlock()
			finished = append(finished, err)
			return err
		}
		c := newCopier(context.Background(), n, nil)
		c.noCFR.Store(noCFR)
		c.add(dst, 10, src, 0, n-20, finish)
		c.add(dst, 0, src, n-20, 10, finish)
		c.add(dst, n-10, src, n-10, 10, finish)
		c.add(dst, 3, src, 0, 0, finish)
		if err := c.wait(); err != nil || len(finished) != 4 || slices.ContainsFunc(finished, func(err error) bool { return err != nil }) {
			t.Fatalf("noCFR %v: copy: %v, pieces finished with %v", noCFR, err, finished)
		}
		got, _ := os.ReadFile(dst.Name())
		want := slices.Concat(data[n-20:n-10], data[:n-20], data[n-10:])
		if !bytes.Equal(got, want) {
			t.Errorf("noCFR %v: copied %d bytes, not where they belong", noCFR, len(got))
		}

		finished = nil
		c = newCopier(context.Background(), 10, nil)
		c.noCFR.Store(noCFR)
		c.add(dst, 0, src, n-5, 10, finish)
		if err := c.wait(); err == nil || !strings.Contains(err.Error(), "early") || len(finished) != 1 {
			t.Errorf("noCFR %v: copy past the end: %v, pieces finished with %v", noCFR, err, finished)
		}
	}
}

// TestExportOrderAsReferenceWriter: segments that no import recorded an
// order for are laid out as the reference writer does, by dtype in its
// enum order, descending, then by name; two dtypes of one element size
// (BF16 after F16 in the enum) are not tied.
func TestExportOrderAsReferenceWriter(t *testing.T) {
	segs := map[string]*segment{}
	for _, s := range [][2]string{{"a", "F16"}, {"b", "BF16"}, {"c", "F32"}, {"d", "F16"}, {"e", "U8"}} {
		segs[s[0]] = &segment{tensor: safetensors.Tensor{Name: s[0], Dtype: s[1]}}
	}
	var got []string
	for _, tensor := range orderTensors(segs, []string{"e"}) {
		got = append(got, tensor.Name)
	}
	if want := []string{"e", "c", "b", "a", "d"}; !slices.Equal(got, want) {
		t.Errorf("export order %v, want %v (recorded first, then the reference writer's)", got, want)
	}
}

// TestUntieTied: a name listed as tied is left out, with no entry, and
// another name of its segment kept, recorded or not; a listed name that
// is no tie, is missing, or is every name of its segment is refused.
func TestUntieTied(t *testing.T) {
	wte, other := &segment{id: fileID{dev: 1, ino: 1}}, &segment{id: fileID{dev: 1, ino: 2}}
	segs := map[string]*segment{"lm_head.weight": wte, "transformer.wte.weight": wte, "transformer.h.0.w": other}
	kept, ties, err := untie(segs, nil, nil)
	if err != nil || kept["lm_head.weight"] != wte || ties["transformer.wte.weight"] != "lm_head.weight" {
		t.Errorf("untie without tied = %v, %v, %v; want lm_head.weight kept (first in byte order)", kept, ties, err)
	}
	recorded := map[string]bool{"lm_head.weight": true}
	kept, ties, err = untie(segs, recorded, []string{"lm_head.weight"})
	if err != nil || len(kept) != 2 || kept["transformer.wte.weight"] != wte || len(ties) != 0 {
		t.Errorf("untie with tied lm_head.weight = %v, %v, %v; want transformer.wte.weight kept and no entry", kept, ties, err)
	}
	for _, c := range []struct {
		tied []string
		want string
	}{
		{[]string{"transformer.h.0.w"}, "shares its segment with no other name"},
		{[]string{"nope"}, "no segment of that name"},
		{[]string{"lm_head.weight", "transformer.wte.weight"}, "every name of one segment"},
	} {
		if _, _, err := untie(segs, nil, c.tied); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("untie with tied %q: %v, want an error saying %q", c.tied, err, c.want)
		}
	}
}

// TestUntieEmptyName: the empty name is a name like any other, not "none
// chosen yet": first in byte order, it is kept.
func TestUntieEmptyName(t *testing.T) {
	s := &segment{id: fileID{dev: 1, ino: 1}}
	segs := map[string]*segment{"": s, "a": s}
	kept, ties, err := untie(segs, nil, nil)
	if err != nil || len(kept) != 1 || kept[""] != s || len(ties) != 1 || ties["a"] != "" {
		t.Errorf("untie = %v, %v, %v; want \"\" kept and a tied to it", kept, ties, err)
	}
	kept, ties, err = untie(segs, nil, []string{"a"})
	if err != nil || len(kept) != 1 || kept[""] != s || len(ties) != 0 {
		t.Errorf("untie with tied a = %v, %v, %v; want \"\" kept and no entry", kept, ties, err)
	}
	kept, ties, err = untie(segs, map[string]bool{"a": true}, nil)
	if err != nil || len(kept) != 1 || kept["a"] != s || ties[""] != "a" {
		t.Errorf("untie with a recorded = %v, %v, %v; want a kept", kept, ties, err)
	}
}

// TestReadPackNames: a pack holding a name that no writer gives a tensor
// and that would mislead as a path is an error naming the pack and the
// name, from ReadPack and from Export; names that merely look alike are
// read.
func TestReadPackNames(t *testing.T) {
	for _, name := range []string{
		"", "/a", "a/", "a//b", ".", "..", "a/../b", "a/./b", "a\x00b", strings.Repeat("x", 256) + "/a",
		".import-1", ".import-1/x", ".save-1", ".save-w-1234/x", PackName, PackName + "/x",
	} {
		dir := fakeMount(t)
		writePack(t, dir, []safetensors.Tensor{{Name: "ok", Dtype: "U8", Shape: []int64{2}}, {Name: name, Dtype: "F32", Shape: []int64{1}}})
		pack := filepath.Join(dir, PackName)
		quoted := fmt.Sprintf("%q", name)
		if len(name) > nameMax {
			quoted = fmt.Sprintf("%.40q", name)
		}
		if _, _, err := ReadPack(pack); err == nil || !strings.HasPrefix(err.Error(), "pack "+pack+": ") || !strings.Contains(err.Error(), quoted) {
			t.Errorf("ReadPack of a pack holding %q = %v, want an error naming %s and the name", name, err, pack)
		}
		outDir := t.TempDir()
		_, err := Export(context.Background(), dir, filepath.Join(outDir, "out.safetensors"), Options{})
		if err == nil || !strings.Contains(err.Error(), "pack "+pack+": ") || !strings.Contains(err.Error(), quoted) {
			t.Errorf("Export of a pack holding %q = %v, want an error naming %s and the name", name, err, pack)
		}
		if got := tree(t, outDir); len(got) != 0 {
			t.Errorf("Export of a pack holding %q wrote %q", name, got)
		}
	}

	good := []string{"a/.save-x", "a/.import-x", "a/" + PackName, PackName + ".x", "x" + PackName, ".savex", ".hidden", "ä/b", strings.Repeat("x", 255)}
	dir := fakeMount(t)
	var tensors []safetensors.Tensor
	for _, name := range good {
		tensors = append(tensors, safetensors.Tensor{Name: name, Dtype: "U8", Shape: []int64{1}})
	}
	want := writePack(t, dir, tensors)
	h, _, err := ReadPack(filepath.Join(dir, PackName))
	if err != nil || len(h.Tensors) != len(good) {
		t.Fatalf("ReadPack of a pack holding %q = %v", good, err)
	}
	out := filepath.Join(t.TempDir(), "out.safetensors")
	if _, err := Export(context.Background(), dir, out, Options{}); err != nil {
		t.Fatal(err)
	}
	if got, _ := exported(t, out); !maps.EqualFunc(got, want, bytes.Equal) {
		t.Errorf("exported %q, want %q", got, want)
	}
}

// writePack writes a pack of tensors into dir, in the reference writer's
// layout, and returns each tensor's bytes by name.
func writePack(t *testing.T, dir string, tensors []safetensors.Tensor) map[string][]byte {
	t.Helper()
	h := &safetensors.Header{Tensors: sortedTensors(tensors)}
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	data := pattern(int(h.DataSize()))
	b := slices.Concat(safetensors.AppendPrefix(nil, header), header, data)
	if err := os.WriteFile(filepath.Join(dir, PackName), b, 0o644); err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{}
	for _, tn := range h.Tensors {
		want[tn.Name] = data[tn.Begin:tn.End]
	}
	return want
}

// writeSegment writes a segment file with data, dtype and shape.
func writeSegment(t *testing.T, path string, data []byte, dtype, shape string) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]string{alloc.AttrDtype: dtype, alloc.AttrShape: shape} {
		if err := unix.Setxattr(path, name, []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
}

// exported reads the safetensors file path and returns each tensor's
// bytes by name, and its header.
func exported(t *testing.T, path string) (map[string][]byte, *safetensors.Header) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := readHeader(t, path)
	dataAt := int64(len(b)) - h.DataSize()
	got := map[string][]byte{}
	for _, tn := range h.Tensors {
		got[tn.Name] = b[dataAt+tn.Begin : dataAt+tn.End]
	}
	return got, h
}

// TestExportPack: the tensors of a pack are exported with the segment
// files, each its own tensor (two empty ones at one offset are no tie);
// a segment file wins over a packed tensor of its name, with a warning;
// a packed.safetensors in a subdirectory, or with a dtype and shape, is
// an ordinary file; a pack with an invalid header is an error naming it,
// and no file is written.
func TestExportPack(t *testing.T) {
	dir := fakeMount(t)
	want := writePack(t, dir, []safetensors.Tensor{
		{Name: "ln_f.weight", Dtype: "F16", Shape: []int64{5}},
		{Name: "h/0.attn.bias", Dtype: "BOOL", Shape: []int64{1, 3}},
		{Name: "position_ids", Dtype: "I64", Shape: []int64{3}},
		{Name: "empty.a", Dtype: "F32", Shape: []int64{0}},
		{Name: "empty.b", Dtype: "F32", Shape: []int64{2, 0}},
	})
	embed := slices.Repeat([]byte{7}, 48)
	writeSegment(t, filepath.Join(dir, "embed.weight"), embed, "float32", "[4, 3]")
	want["embed.weight"] = embed
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	writePack(t, filepath.Join(dir, "sub"), []safetensors.Tensor{{Name: "x", Dtype: "U8", Shape: []int64{1}}})

	var warnings []string
	warn := func(msg string) { warnings = append(warnings, msg) }
	out := filepath.Join(t.TempDir(), "out.safetensors")
	sum, err := Export(context.Background(), dir, out, Options{Warn: warn})
	if err != nil {
		t.Fatal(err)
	}
	got, h := exported(t, out)
	if sum.Tensors != len(want) || sum.Links != 0 || len(got) != len(want) || h.Metadata != nil {
		t.Errorf("Export = %+v, tensors %q, metadata %v; want the %d tensors and no ties", sum, slices.Sorted(maps.Keys(got)), h.Metadata, len(want))
	}
	for name, b := range want {
		if !bytes.Equal(got[name], b) {
			t.Errorf("%s: exported %v, want %v", name, got[name], b)
		}
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "skipping "+filepath.Join(dir, "sub", PackName)) {
		t.Errorf("warnings %q, want one skipping sub/%s", warnings, PackName)
	}

	// A segment file of a packed tensor's name wins.
	ids := []byte{1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0}
	writeSegment(t, filepath.Join(dir, "position_ids"), ids, "int64", "[3]")
	warnings = nil
	if _, err := Export(context.Background(), dir, out, Options{Warn: warn}); err != nil {
		t.Fatal(err)
	}
	if got, _ := exported(t, out); !bytes.Equal(got["position_ids"], ids) || len(got) != len(want) {
		t.Errorf("position_ids exported as %v of %d tensors, want the segment file's %v", got["position_ids"], len(got), ids)
	}
	packPath := filepath.Join(dir, PackName)
	if len(warnings) != 2 || !strings.Contains(warnings[1], "skipping position_ids in "+packPath+": the segment "+filepath.Join(dir, "position_ids")) {
		t.Errorf("warnings %q, want the sub/%s one and one skipping position_ids in the pack", warnings, PackName)
	}

	// An invalid header: an error naming the pack, and no file.
	b, err := os.ReadFile(packPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(packPath, b[:len(b)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	outDir := t.TempDir()
	_, err = Export(context.Background(), dir, filepath.Join(outDir, "bad.safetensors"), Options{Warn: warn})
	if err == nil || !strings.Contains(err.Error(), "pack "+packPath+": ") || !errors.Is(err, safetensors.ErrInvalid) {
		t.Errorf("Export with a truncated pack = %v, want an error naming %s", err, packPath)
	}
	if got := tree(t, outDir); len(got) != 0 {
		t.Errorf("Export with a truncated pack wrote %q", got)
	}

	// With a dtype and a shape it is an ordinary segment.
	writeSegment(t, packPath, b[:8], "uint8", "[8]")
	if _, err := Export(context.Background(), dir, out, Options{Warn: warn}); err != nil {
		t.Fatal(err)
	}
	if got, _ := exported(t, out); !bytes.Equal(got[PackName], b[:8]) || len(got) != 3 {
		t.Errorf("with a dtype and shape, exported %q, want %s, embed.weight and position_ids", slices.Sorted(maps.Keys(got)), PackName)
	}
}

// packTensors are the tensors of TestImportPack's file; those named s.*
// or s/* are under its 64-byte PackBelow and go into the pack.
var packTensors = []safetensors.Tensor{
	{Name: "big", Dtype: "F32", Shape: []int64{8, 8}},     // 256 bytes: a segment
	{Name: "edge", Dtype: "U8", Shape: []int64{64}},       // exactly PackBelow: a segment
	{Name: "a", Dtype: "F32", Shape: []int64{4}},          // small, but "b" is tied to it
	{Name: "f4", Dtype: "F4", Shape: []int64{4}},          // small, but no whole bytes
	{Name: "s.f64", Dtype: "F64", Shape: []int64{2}},      // 16 bytes
	{Name: "s.bf16", Dtype: "BF16", Shape: []int64{3}},    // 6 bytes
	{Name: "s/bool", Dtype: "BOOL", Shape: []int64{2, 3}}, // 6 bytes, in a directory
	{Name: "s.empty", Dtype: "I32", Shape: []int64{0, 4}}, // 0 bytes
	{Name: "s.u8", Dtype: "U8", Shape: []int64{5}},        // 5 bytes
	{Name: "s.scalar", Dtype: "F32", Shape: []int64{}},    // 4 bytes
}

// TestImportPack: with PackBelow, the small untied tensors of whole-byte
// dtypes go into DIR's pack, laid out as the Python client lays one out
// (element size descending, then name; no metadata; header padded to 8),
// each starting on a whole element, with the source's bytes; the others
// are segments, the tie hard links; the pack has no dtype or shape, and
// export gives back the file byte-identical. Without PackBelow nothing is
// packed, and with a tensor named as the pack the import is refused.
func TestImportPack(t *testing.T) {
	src := filepath.Join(t.TempDir(), "model.safetensors")
	writeRefFile(t, src, packTensors, map[string]string{"format": "pt", "b": "a"})
	content, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	srcBytes, _ := exported(t, src)
	mnt := fakeMount(t)
	dir := filepath.Join(mnt, "model")
	sum, err := Import(context.Background(), src, dir, Options{PackBelow: 64})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Tensors != len(packTensors) || sum.Links != 1 {
		t.Errorf("Import = %+v, want %d tensors and 1 tie", sum, len(packTensors))
	}
	if got, want := tree(t, dir), []string{"a", "b", "big", "edge", "f4", PackName}; !slices.Equal(got, want) {
		t.Errorf("imported tree %q, want %q", got, want)
	}
	if a, b := stat(t, filepath.Join(dir, "a")), stat(t, filepath.Join(dir, "b")); !os.SameFile(a, b) {
		t.Error("the tie b is not a hard link of a")
	}
	pack := filepath.Join(dir, PackName)
	for _, attr := range []string{alloc.AttrDtype, alloc.AttrShape} {
		if v, ok, err := alloc.GetXattr(pack, attr); ok || err != nil {
			t.Errorf("the pack has %s = %q (%v)", attr, v, err)
		}
	}
	h, dataAt, err := ReadPack(pack)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tn := range h.Tensors {
		names = append(names, tn.Name)
		bits, _ := safetensors.Bits(tn.Dtype)
		if tn.Begin%(bits/8) != 0 {
			t.Errorf("packed %s (%s) starts at byte %d, not on a whole element", tn.Name, tn.Dtype, tn.Begin)
		}
	}
	if want := []string{"s.f64", "s.empty", "s.scalar", "s.bf16", "s.u8", "s/bool"}; !slices.Equal(names, want) || h.Metadata != nil {
		t.Errorf("pack holds %q, metadata %v; want %q and no metadata", names, h.Metadata, want)
	}
	// Its bytes: the header as the reference writer encodes it, then the
	// source's bytes of each tensor.
	b, err := os.ReadFile(pack)
	if err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	if !bytes.Equal(b[:dataAt], append(safetensors.AppendPrefix(nil, header), header...)) || dataAt%8 != 0 {
		t.Errorf("pack header %q, want %q", b[:dataAt], header)
	}
	packed, _ := exported(t, pack)
	for name, got := range packed {
		if !bytes.Equal(got, srcBytes[name]) {
			t.Errorf("packed %s = %v, want the source's %v", name, got, srcBytes[name])
		}
	}

	out := filepath.Join(t.TempDir(), "back.safetensors")
	if _, err := Export(context.Background(), dir, out, Options{}); err != nil {
		t.Fatal(err)
	}
	if back, err := os.ReadFile(out); err != nil || !bytes.Equal(back, content) {
		t.Errorf("export differs from the imported file (%v)", err)
	}

	// Without PackBelow: a segment per tensor.
	plain := filepath.Join(mnt, "plain")
	if _, err := Import(context.Background(), src, plain, Options{}); err != nil {
		t.Fatal(err)
	}
	if got := tree(t, plain); slices.Contains(got, PackName) || len(got) != len(packTensors)+2 { // + b and s/
		t.Errorf("import without PackBelow: %q", got)
	}

	// A tensor that would be the pack.
	clash := filepath.Join(t.TempDir(), "clash.safetensors")
	writeRefFile(t, clash, []safetensors.Tensor{{Name: PackName, Dtype: "U8", Shape: []int64{100}}, {Name: "x", Dtype: "U8", Shape: []int64{1}}}, nil)
	if _, err := Import(context.Background(), clash, filepath.Join(mnt, "clash"), Options{PackBelow: 64}); err == nil || !strings.Contains(err.Error(), "the name of the pack") {
		t.Errorf("Import of a tensor named %s with PackBelow = %v, want an error saying it is the name of the pack", PackName, err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "clash")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused import left %s (%v)", filepath.Join(mnt, "clash"), err)
	}
}

// TestImportPackKeepsHeader: a header not in the reference layout is kept
// with packed tensors too, and export gives back the same bytes.
func TestImportPackKeepsHeader(t *testing.T) {
	raw := `{"b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "a": {"dtype": "I16", "shape": [1], "data_offsets": [2, 4]}}`
	content := append(append(safetensors.AppendPrefix(nil, []byte(raw)), raw...), 1, 2, 3, 4)
	src := filepath.Join(t.TempDir(), "pretty.safetensors")
	if err := os.WriteFile(src, content, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := fakeMount(t)
	if _, err := Import(context.Background(), src, dir, Options{PackBelow: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if got := tree(t, dir); !slices.Equal(got, []string{PackName}) {
		t.Errorf("imported tree %q, want just the pack", got)
	}
	out := filepath.Join(t.TempDir(), "back.safetensors")
	if _, err := Export(context.Background(), dir, out, Options{}); err != nil {
		t.Fatal(err)
	}
	if back, _ := os.ReadFile(out); !bytes.Equal(back, content) {
		t.Errorf("export = %q, want %q", back, content)
	}
}

// stat is os.Stat, failing the test on an error.
func stat(t *testing.T, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi
}
