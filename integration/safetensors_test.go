package integration

// tensorfs import and export (DESIGN.md §8) with real safetensors files
// written by /usr/bin/python3 (struct + json, the format by hand), read back
// with getfattr, numpy's memmap and cmp.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// stWriteScript writes the test tensors to argv[1] as a safetensors file.
// argv[2] is the layout:
//
//	reference  what the reference writer (huggingface/safetensors) writes:
//	           compact JSON, "__metadata__" first, keys in data order,
//	           largest elements first, padded with spaces to 8 bytes
//	pretty     indented ASCII JSON, keys sorted, "__metadata__" last with
//	           two entries, data in reverse key order, no padding
//	big        two 24 MiB tensors, for the capacity test
//	many       3000 one-byte tensors with long names, in the pretty layout:
//	           a header and a name list over the 64 KiB an attribute holds
const stWriteScript = `
import json, struct, sys
import numpy as np
path, layout = sys.argv[1], sys.argv[2]
tensors = {
    "embed.weight": ("F32", np.arange(12, dtype="<f4").reshape(4, 3)),
    "layers/0/attn.bias": ("F16", np.linspace(0, 1, 5).astype("<f2")),
    "layers/0/mask": ("BOOL", np.array([[True, False], [False, True]])),
    "layers/1/\u00e4": ("I16", np.array([-3, 4], dtype="<i2")),
    "ids": ("I64", np.array([7, -8, 9], dtype="<i8")),
    "scalar": ("F64", np.array(3.5, dtype="<f8")),
    "bf": ("BF16", np.array([0x3f80, 0x4000], dtype="<u2")),
    "u8": ("U8", np.frombuffer(b"abc", dtype=np.uint8)),
    "fp8": ("F8_E4M3", np.array([1, 2, 3, 4, 5], dtype=np.uint8)),
    "u32": ("U32", np.array([1, 2**32 - 1], dtype="<u4")),
    "c": ("C64", np.array([1 + 2j, 3 - 4j], dtype="<c8")),
    "empty": ("I32", np.zeros((0, 4), dtype="<i4")),
}
meta = {"format": "pt"}
if layout == "big":
    tensors = {"a": ("U8", np.full(24 << 20, 1, np.uint8)), "b": ("U8", np.full(24 << 20, 2, np.uint8))}
if layout == "many":
    # Long names, as sharded checkpoints have: 800 of them pass one
    # attribute's 64 KiB in the tensor list as well as in the header.
    tensors = {"model.layers.%04d.self_attention.query_key_value.weight.tensor_parallel_shard_of_eight" % i:
               ("U8", np.array([i % 256], np.uint8)) for i in range(800)}
    layout = "pretty"
if layout == "pretty":
    meta["note"] = "<written by hand>"
    keys = sorted(tensors)
    data_order = list(reversed(keys))
else:
    keys = data_order = sorted(tensors, key=lambda k: (-tensors[k][1].itemsize, k))
offsets, off = {}, 0
for k in data_order:
    n = tensors[k][1].nbytes
    offsets[k] = [off, off + n]
    off += n
def entry(k):
    dt, a = tensors[k]
    return {"dtype": dt, "shape": list(a.shape), "data_offsets": offsets[k]}
if layout == "pretty":
    hdr = {k: entry(k) for k in keys}
    hdr["__metadata__"] = meta
    h = json.dumps(hdr, indent=2).encode()
else:
    hdr = {"__metadata__": meta}
    hdr.update((k, entry(k)) for k in keys)
    h = json.dumps(hdr, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * (-len(h) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for k in data_order:
        f.write(tensors[k][1].tobytes())
`

// stReadScript reads argv[1], a safetensors file, checks that its offsets
// tile the byte buffer, and prints its header (metadata and, per tensor,
// dtype, shape and the data's hex) as one JSON object with sorted keys.
const stReadScript = `
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
hdr = json.loads(data[8:8 + n])
buf = data[8 + n:]
out = {"__metadata__": hdr.pop("__metadata__", None)}
at = 0
for k, v in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"]):
    b, e = v["data_offsets"]
    assert b == at, (k, b, at)
    at = e
    out[k] = [v["dtype"], v["shape"], buf[b:e].hex()]
assert at == len(buf), (at, len(buf))
print(json.dumps(out, sort_keys=True))
`

// stMemmapScript maps segments of an imported directory argv[1] with
// numpy and checks their values.
const stMemmapScript = `
import sys
import numpy as np
d = sys.argv[1]
w = np.memmap(d + "/embed.weight", dtype="<f4", mode="r", shape=(4, 3))
assert (w == np.arange(12, dtype="<f4").reshape(4, 3)).all(), w
b = np.memmap(d + "/layers/0/attn.bias", dtype="<f2", mode="r")
assert (b == np.linspace(0, 1, 5).astype("<f2")).all(), b
m = np.memmap(d + "/layers/0/mask", dtype=np.bool_, mode="r", shape=(2, 2))
assert m.tolist() == [[True, False], [False, True]], m
i = np.memmap(d + "/ids", dtype="<i8", mode="r")
assert i.tolist() == [7, -8, 9], i
s = np.memmap(d + "/scalar", dtype="<f8", mode="r")
assert s.tolist() == [3.5], s
c = np.memmap(d + "/c", dtype="<c8", mode="r")
assert c.tolist() == [1 + 2j, 3 - 4j], c
a = np.memmap(d + "/layers/1/\u00e4", dtype="<i2", mode="r")
assert a.tolist() == [-3, 4], a
print("ok")
`

// stTensors are the tensors stWriteScript writes (but "big"), with the
// dtype and shape tensorfs must show.
var stTensors = map[string][2]string{
	"embed.weight":       {"float32", "[4, 3]"},
	"layers/0/attn.bias": {"float16", "[5]"},
	"layers/0/mask":      {"bool", "[2, 2]"},
	"layers/1/ä":         {"int16", "[2]"},
	"ids":                {"int64", "[3]"},
	"scalar":             {"float64", "[]"},
	"bf":                 {"bfloat16", "[2]"},
	"u8":                 {"uint8", "[3]"},
	"fp8":                {"float8_e4m3fn", "[5]"},
	"u32":                {"uint32", "[2]"},
	"c":                  {"complex64", "[2]"},
	"empty":              {"int32", "[0, 4]"},
}

// stWrite writes a test file in layout into a fresh directory outside the
// mount and returns its path.
func stWrite(t *testing.T, layout string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), layout+".safetensors")
	python(t, stWriteScript, path, layout)
	return path
}

// stTensorfs runs the tensorfs binary and returns its stdout, stderr and
// exit status (-1 if it timed out).
func stTensorfs(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, tensorfs, args...)
	cmd.WaitDelay = 5 * time.Second
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var exitErr *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return out.String(), errb.String(), -1
	case err == nil:
		return out.String(), errb.String(), 0
	case errors.As(err, &exitErr):
		return out.String(), errb.String(), exitErr.ExitCode()
	}
	t.Fatalf("tensorfs %s: %v", strings.Join(args, " "), err)
	return "", "", 0
}

// stOK runs tensorfs, which must exit 0 with nothing on stderr, and
// returns its stdout.
func stOK(t *testing.T, args ...string) string {
	t.Helper()
	stdout, stderr, code := stTensorfs(t, args...)
	if code != 0 || stderr != "" {
		t.Fatalf("tensorfs %s: exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, stdout, stderr)
	}
	return stdout
}

// stAttr reads one attribute with getfattr.
func stAttr(t *testing.T, path, name string) string {
	t.Helper()
	return run(t, "getfattr", "--absolute-names", "--only-values", "-n", name, path)
}

// stAttrNames lists the attribute names getfattr shows on path.
func stAttrNames(t *testing.T, path string) []string {
	t.Helper()
	out := run(t, "getfattr", "--absolute-names", "-m", "-", path)
	var names []string
	for _, line := range strings.Split(out, "\n") {
		if line != "" && !strings.HasPrefix(line, "#") {
			names = append(names, line)
		}
	}
	return names
}

// stTree lists every path under dir, relative, with '/' after directories.
func stTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
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

// TestSafetensorsImportExport: a file in the reference layout imports as
// one segment per tensor with dtype and shape set, numpy maps the right
// values, and export gives back the same bytes; a file in another layout
// exports byte-identical too (its header is kept); after a tensor is
// removed and one added, export writes a valid file with the others.
func TestSafetensorsImportExport(t *testing.T) {
	t.Parallel()
	ref := stWrite(t, "reference")
	pretty := stWrite(t, "pretty")
	forEachMode(t, func(t *testing.T, m *mount) {
		dir := m.path("model")
		out := stOK(t, "import", ref, dir)
		if !strings.Contains(out, "imported 12 tensors") {
			t.Errorf("import said %q, want \"imported 12 tensors ...\"", out)
		}
		for name, want := range stTensors {
			p := filepath.Join(dir, name)
			if got := stAttr(t, p, "user.tensor.dtype"); got != want[0] {
				t.Errorf("%s: user.tensor.dtype = %q, want %q", name, got, want[0])
			}
			if got := stAttr(t, p, "user.tensor.shape"); got != want[1] {
				t.Errorf("%s: user.tensor.shape = %q, want %q", name, got, want[1])
			}
		}
		if got := stAttr(t, dir, "user.safetensors.meta.format"); got != "pt" {
			t.Errorf("user.safetensors.meta.format = %q, want pt", got)
		}
		var order []string
		if err := json.Unmarshal([]byte(stAttr(t, dir, "user.safetensors.order")), &order); err != nil {
			t.Errorf("user.safetensors.order is not a JSON list: %v", err)
		}
		if len(order) != len(stTensors) || order[0] != "c" {
			t.Errorf("user.safetensors.order = %q, want the %d names in header order, c first", order, len(stTensors))
		}
		if slices.Contains(stAttrNames(t, dir), "user.safetensors.header") {
			t.Errorf("a reference-layout import kept user.safetensors.header; export rebuilds that header")
		}
		for _, p := range stTree(t, dir) {
			if strings.HasPrefix(p, ".import-") {
				t.Errorf("import left %s behind", p)
			}
		}
		if got := python(t, stMemmapScript, dir); strings.TrimSpace(got) != "ok" {
			t.Errorf("numpy check printed %q", got)
		}

		back := filepath.Join(t.TempDir(), "back.safetensors")
		stOK(t, "export", dir, back)
		run(t, "cmp", ref, back)

		// Packed: every tensor is under 64 bytes, so DIR holds the pack
		// alone, with no dtype or shape, and exports the same bytes.
		kdir := m.path("packed")
		stOK(t, "import", "--pack-below", "64", ref, kdir)
		if got := stTree(t, kdir); !slices.Equal(got, []string{"packed.safetensors"}) {
			t.Errorf("import --pack-below 64 made %q, want just packed.safetensors", got)
		}
		if names := stAttrNames(t, filepath.Join(kdir, "packed.safetensors")); slices.Contains(names, "user.tensor.dtype") || slices.Contains(names, "user.tensor.shape") {
			t.Errorf("the pack has attributes %q, want no dtype or shape", names)
		}
		kback := filepath.Join(t.TempDir(), "packed-back.safetensors")
		stOK(t, "export", kdir, kback)
		run(t, "cmp", ref, kback)

		// Another layout: the original header is kept and reused.
		pdir := m.path("pretty")
		stOK(t, "import", pretty, pdir)
		if !slices.Contains(stAttrNames(t, pdir), "user.safetensors.header") {
			t.Errorf("pretty-layout import did not keep user.safetensors.header")
		}
		if got := stAttr(t, pdir, "user.safetensors.meta.note"); got != "<written by hand>" {
			t.Errorf("user.safetensors.meta.note = %q", got)
		}
		pback := filepath.Join(t.TempDir(), "pretty-back.safetensors")
		stOK(t, "export", pdir, pback)
		run(t, "cmp", pretty, pback)

		// Changed: one tensor gone, one added by hand. The header is
		// rebuilt, the rest keeps its bytes and the metadata.
		if err := os.Remove(filepath.Join(pdir, "u8")); err != nil {
			t.Fatal(err)
		}
		added := filepath.Join(pdir, "added")
		if err := os.WriteFile(added, []byte{1, 0, 2, 0}, 0o644); err != nil {
			t.Fatal(err)
		}
		run(t, "setfattr", "-n", "user.tensor.dtype", "-v", "int16", added)
		run(t, "setfattr", "-n", "user.tensor.shape", "-v", "[2]", added)
		changed := filepath.Join(t.TempDir(), "changed.safetensors")
		stOK(t, "export", pdir, changed)
		var want, got map[string]any
		if err := json.Unmarshal([]byte(python(t, stReadScript, pretty)), &want); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(python(t, stReadScript, changed)), &got); err != nil {
			t.Fatal(err)
		}
		delete(want, "u8")
		want["added"] = []any{"I16", []any{2.0}, "01000200"}
		wantJSON, _ := json.Marshal(want)
		gotJSON, _ := json.Marshal(got)
		if !bytes.Equal(wantJSON, gotJSON) {
			t.Errorf("changed export:\n got %s\nwant %s", gotJSON, wantJSON)
		}
		if ents, _ := os.ReadDir(filepath.Dir(changed)); len(ents) != 1 {
			t.Errorf("export left %d files beside its output, want only it", len(ents)-1)
		}
	})
}

// TestSafetensorsRefused: malformed and truncated files, bad tensor names
// and a non-empty directory are refused with exit 1 and one line on
// stderr, and leave no segment, directory or temporary directory behind;
// so does an import that fills the mount halfway through.
func TestSafetensorsRefused(t *testing.T) {
	t.Parallel()
	ref := stWrite(t, "reference")
	big := stWrite(t, "big")
	data, err := os.ReadFile(ref)
	if err != nil {
		t.Fatal(err)
	}
	hlen := int(binary.LittleEndian.Uint64(data))
	header := string(data[8 : 8+hlen])
	tmp := t.TempDir()
	bad := func(name string, b []byte) string {
		p := filepath.Join(tmp, name+".safetensors")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// withHeader is the reference file with another header.
	withHeader := func(h string) []byte {
		b := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
		return append(append(b, h...), data[8+hlen:]...)
	}
	cases := []struct {
		file    string
		mention string
	}{
		{bad("short", data[:5]), "shorter than the 8-byte"},
		{bad("truncated-header", data[:8+hlen/2]), "runs past the end"},
		{bad("truncated-data", data[:len(data)-3]), "truncated"},
		{bad("trailing-bytes", append(slices.Clone(data), 0)), "cover"},
		{bad("corrupt-header", withHeader(strings.Replace(header, `":`, `"=`, 1))), "bad JSON"},
		{bad("unknown-dtype", withHeader(strings.Replace(header, `"F16"`, `"F17"`, 1))), "unknown dtype"},
		// c is [0,16] and ids [16,40]: ids moves 8 bytes back.
		{bad("overlap", withHeader(strings.Replace(header, `"data_offsets":[16,40]`, `"data_offsets":[8,32]`, 1))), "overlap"},
		{bad("out-of-range", withHeader(strings.Replace(header, `"data_offsets":[16,40]`, `"data_offsets":[16,4000]`, 1))), "run past"},
		{bad("dotdot", withHeader(strings.Replace(header, `"ids"`, `"../x"`, 1))), `".."`},
		{bad("empty-component", withHeader(strings.Replace(header, `"ids"`, `"a//"`, 1))), "empty path component"},
	}
	m := mountFS(t, "passthrough", "--capacity", "32M")
	if err := os.Mkdir(m.path("empty"), 0o755); err != nil {
		t.Fatal(err)
	}
	check := func(t *testing.T, file, target, mention string, flags ...string) {
		t.Helper()
		stdout, stderr, code := stTensorfs(t, slices.Concat([]string{"import"}, flags, []string{file, target})...)
		if code != 1 {
			t.Errorf("import %s: exit %d, want 1\nstdout: %q\nstderr: %q", filepath.Base(file), code, stdout, stderr)
		}
		if lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n"); len(lines) != 1 || !strings.HasPrefix(stderr, "tensorfs import: ") {
			t.Errorf("import %s: stderr is not one \"tensorfs import: ...\" line: %q", filepath.Base(file), stderr)
		}
		if !strings.Contains(stderr, mention) {
			t.Errorf("import %s: stderr %q does not mention %q", filepath.Base(file), stderr, mention)
		}
		if got, want := stTree(t, m.dir), []string{"empty/"}; !slices.Equal(got, want) {
			t.Errorf("after import %s the mount holds %q, want %q", filepath.Base(file), got, want)
		}
	}
	for _, c := range cases {
		name := strings.TrimSuffix(filepath.Base(c.file), ".safetensors")
		t.Run(name, func(t *testing.T) {
			check(t, c.file, m.path("new/model"), c.mention)
			check(t, c.file, m.path("empty"), c.mention)
		})
	}
	t.Run("not-empty", func(t *testing.T) {
		if err := os.WriteFile(m.path("empty/x"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(m.path("empty/x"))
		stdout, stderr, code := stTensorfs(t, "import", ref, m.path("empty"))
		if code != 1 || !strings.Contains(stderr, "not empty") {
			t.Errorf("import into a non-empty directory: exit %d, stderr %q, stdout %q", code, stderr, stdout)
		}
		if got := stTree(t, m.path("empty")); !slices.Equal(got, []string{"x"}) {
			t.Errorf("the directory now holds %q, want just x", got)
		}
	})
	t.Run("mount-full", func(t *testing.T) {
		// 48 MiB of tensors into a 32 MiB mount: the second one fails,
		// saying what it needed and what was free, and naming a directory
		// to look at that the cleanup left in place. So does the pack of
		// both (each 24 MiB is under 26 MB).
		for target, hint := range map[string]string{m.path("new/model"): m.dir, m.path("empty"): m.path("empty")} {
			check(t, big, target, "the import needs 48.0 MiB and the mount had ")
			check(t, big, target, "free when it began: see df -h "+hint+"; ")
			check(t, big, target, " in packed.safetensors: the tensorfs mount is full: the import needs 48.0 MiB", "--pack-below", "26MB")
			if _, err := os.Stat(hint); err != nil {
				t.Errorf("the hint's directory: %v", err)
			}
		}
		if got := stAttr(t, m.dir, "user.tensorfs.rsegments"); got != "0" {
			t.Errorf("user.tensorfs.rsegments = %s after failed imports, want 0", got)
		}
	})
}

// TestSafetensorsLargeHeader: a header and a tensor list too large for one
// extended attribute are split over several, and export still gives back
// the same bytes.
func TestSafetensorsLargeHeader(t *testing.T) {
	t.Parallel()
	many := stWrite(t, "many")
	m := mountFS(t, "passthrough")
	dir := m.path("many")
	stOK(t, "import", many, dir)
	names := stAttrNames(t, dir)
	for _, want := range []string{"user.safetensors.header", "user.safetensors.header.1", "user.safetensors.order.1"} {
		if !slices.Contains(names, want) {
			t.Errorf("no %s on %s; it has %q", want, dir, names)
		}
	}
	back := filepath.Join(t.TempDir(), "back.safetensors")
	stOK(t, "export", dir, back)
	run(t, "cmp", many, back)
}
