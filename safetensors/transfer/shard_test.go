package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"tensorfs/safetensors"
)

// refTensors is a small GPT-like state dict in its module order; names,
// dtypes and shapes. lm_head.weight, tied to wte.weight, is not among
// them: the reference writers drop it.
var refTensors = []safetensors.Tensor{
	{Name: "wte.weight", Dtype: "F32", Shape: []int64{64, 16}},
	{Name: "wpe.weight", Dtype: "F32", Shape: []int64{8, 16}},
	{Name: "h.0.attn.bias", Dtype: "BOOL", Shape: []int64{1, 1, 8, 8}},
	{Name: "h.0.attn.c_attn.weight", Dtype: "F32", Shape: []int64{16, 48}},
	{Name: "h.0.mlp.c_fc.weight", Dtype: "F32", Shape: []int64{16, 64}},
	{Name: "h.1.attn.bias", Dtype: "BOOL", Shape: []int64{1, 1, 8, 8}},
	{Name: "h.1.attn.c_attn.weight", Dtype: "F32", Shape: []int64{16, 48}},
	{Name: "h.1.mlp.c_fc.weight", Dtype: "F32", Shape: []int64{16, 64}},
	{Name: "ln_f.weight", Dtype: "F16", Shape: []int64{16}},
	{Name: "position_ids", Dtype: "I64", Shape: []int64{8}},
	{Name: "scale", Dtype: "F32", Shape: []int64{}},
}

// writeRefCheckpoint writes tensors (with pattern data, shifted per
// tensor) into dir as transformers' save_pretrained does with
// max_shard_size: huggingface_hub's split in state-dict order, each
// shard through the reference writer's layout with {"format": "pt"},
// and the index as json.dumps(indent=2, sort_keys=True). indexMeta adds
// to the index's metadata. It returns the files written.
func writeRefCheckpoint(t *testing.T, dir string, tensors []safetensors.Tensor, maxSize int64, indexMeta map[string]string) []string {
	t.Helper()
	sizes := make([]int64, len(tensors))
	var total int64
	for i, tn := range tensors {
		n, err := safetensors.NBytes(tn.Dtype, tn.Shape)
		if err != nil {
			t.Fatal(err)
		}
		sizes[i], total = n, total+n
	}
	groups := safetensors.Split(sizes, maxSize)
	ix := &safetensors.Index{Metadata: map[string]json.RawMessage{"total_size": json.RawMessage(strconv.FormatInt(total, 10))}, WeightMap: map[string]string{}}
	for k, v := range indexMeta {
		ix.Metadata[k], _ = json.Marshal(v)
	}
	var files []string
	for i, g := range groups {
		name := safetensors.ShardName("model", i, len(groups))
		var shard []safetensors.Tensor
		for _, k := range g {
			shard = append(shard, tensors[k])
			ix.WeightMap[tensors[k].Name] = name
		}
		writeRefFile(t, filepath.Join(dir, name), shard, map[string]string{"format": "pt"})
		files = append(files, name)
	}
	if len(groups) > 1 {
		name := "model" + safetensors.IndexSuffix
		if err := os.WriteFile(filepath.Join(dir, name), ix.Encode(), 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, name)
	}
	return files
}

// writeRefFile writes tensors as the reference writer (serialize) lays
// them out: sorted by dtype, descending, then name.
func writeRefFile(t *testing.T, path string, tensors []safetensors.Tensor, meta map[string]string) {
	t.Helper()
	h := &safetensors.Header{Tensors: slices.Clone(tensors), Metadata: meta}
	safetensors.SortTensors(h.Tensors)
	if err := h.Pack(); err != nil {
		t.Fatal(err)
	}
	header := h.Encode()
	b := append(safetensors.AppendPrefix(nil, header), header...)
	for _, tn := range h.Tensors {
		data := pattern(int(tn.Size()) + len(tn.Name))
		b = append(b, data[len(tn.Name):]...)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// sameFiles fails unless every file of want is in dir with the same
// bytes, and dir holds nothing else.
func sameFiles(t *testing.T, wantDir, gotDir string, files []string) {
	t.Helper()
	for _, f := range files {
		want, err := os.ReadFile(filepath.Join(wantDir, f))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(gotDir, f))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: exported %d bytes (%v), differs from the %d written by the reference layout", f, len(got), err, len(want))
		}
	}
	if got := tree(t, gotDir); !slices.Equal(got, files) {
		t.Errorf("export wrote %q, want %q", got, files)
	}
}

// TestShardedRoundTrip: a sharded checkpoint goes into one directory of
// dotted names and comes back byte-identical, as shards with their index,
// and as one file equal to the reference writer's.
func TestShardedRoundTrip(t *testing.T) {
	src := t.TempDir()
	files := writeRefCheckpoint(t, src, refTensors, 9000, nil)
	if len(files) != 4 {
		t.Fatalf("the fixture has %d files (%q), want 3 shards and an index", len(files), files)
	}
	mnt := fakeMount(t)
	for _, from := range []string{filepath.Join(src, "model"+safetensors.IndexSuffix), src} {
		dir := filepath.Join(mnt, filepath.Base(from))
		sum, err := Import(context.Background(), from, dir, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if sum.Tensors != len(refTensors) || sum.Files != 3 || sum.Links != 0 {
			t.Errorf("Import(%s) = %+v, want %d tensors from 3 files", from, sum, len(refTensors))
		}
		var want []string
		for _, tn := range refTensors {
			want = append(want, tn.Name)
		}
		slices.Sort(want)
		if got := tree(t, dir); !slices.Equal(got, want) {
			t.Errorf("imported %q, want one segment per tensor: %q", got, want)
		}
		if v, _, _ := getChunks(dir, attrSTMeta+"format"); string(v) != "pt" {
			t.Errorf("format metadata = %q, want pt", v)
		}
		out := filepath.Join(t.TempDir(), "out")
		sum, err = Export(context.Background(), dir, out, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if sum.Files != 3 || sum.Tensors != len(refTensors) {
			t.Errorf("Export = %+v", sum)
		}
		sameFiles(t, src, out, files)
	}

	// Merged into one file: what the reference writer makes of the whole.
	dir := filepath.Join(mnt, "model"+safetensors.IndexSuffix)
	one := t.TempDir()
	writeRefFile(t, filepath.Join(one, "want.safetensors"), refTensors, map[string]string{"format": "pt"})
	if _, err := Export(context.Background(), dir, filepath.Join(one, "model.safetensors"), Options{}); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(filepath.Join(one, "want.safetensors"))
	got, _ := os.ReadFile(filepath.Join(one, "model.safetensors"))
	if !bytes.Equal(got, want) {
		t.Errorf("export to one file: %d bytes, differ from the reference writer's %d", len(got), len(want))
	}

	// Split afresh at another size: as save_pretrained would at that size
	// (the order to split in is the shards' order, which for this
	// fixture is the state dict's up to order within a shard).
	for _, max := range []int64{5000, 1 << 20} {
		wantDir, out := t.TempDir(), filepath.Join(t.TempDir(), "resplit")
		var order []safetensors.Tensor
		for _, f := range files[:3] {
			order = append(order, readHeader(t, filepath.Join(src, f)).Tensors...)
		}
		for i := range order {
			order[i].Begin, order[i].End = 0, 0
		}
		wantFiles := writeRefCheckpoint(t, wantDir, order, max, nil)
		if _, err := Export(context.Background(), dir, out, Options{MaxShardSize: max}); err != nil {
			t.Fatal(err)
		}
		sameFiles(t, wantDir, out, wantFiles)
	}
}

// TestShardedPackRoundTrip: the small tensors of every shard go into one
// pack, and the checkpoint still comes back byte-identical.
func TestShardedPackRoundTrip(t *testing.T) {
	src := t.TempDir()
	files := writeRefCheckpoint(t, src, refTensors, 9000, nil)
	dir := filepath.Join(fakeMount(t), "model")
	sum, err := Import(context.Background(), filepath.Join(src, "model"+safetensors.IndexSuffix), dir, Options{PackBelow: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Tensors != len(refTensors) || sum.Files != 3 {
		t.Errorf("Import = %+v, want %d tensors from 3 files", sum, len(refTensors))
	}
	want := []string{"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.attn.c_attn.weight", "h.1.mlp.c_fc.weight", PackName, "wte.weight"}
	if got := tree(t, dir); !slices.Equal(got, want) {
		t.Errorf("imported %q, want %q", got, want)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := Export(context.Background(), dir, out, Options{}); err != nil {
		t.Fatal(err)
	}
	sameFiles(t, src, out, files)
}

// TestTies: a name the reference writer dropped for a shared tensor
// (save_model's metadata entry "dropped": "kept") comes back as a hard
// link, and export drops it again the same way.
func TestTies(t *testing.T) {
	src := t.TempDir()
	meta := map[string]string{"format": "pt", "lm_head.weight": "wte.weight"}
	writeRefFile(t, filepath.Join(src, "tied.safetensors"), refTensors, meta)
	mnt := fakeMount(t)
	dir := filepath.Join(mnt, "tied")
	sum, err := Import(context.Background(), filepath.Join(src, "tied.safetensors"), dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Links != 1 {
		t.Errorf("Import = %+v, want 1 tie", sum)
	}
	a, err1 := os.Stat(filepath.Join(dir, "lm_head.weight"))
	b, err2 := os.Stat(filepath.Join(dir, "wte.weight"))
	if err1 != nil || err2 != nil || !os.SameFile(a, b) {
		t.Fatalf("lm_head.weight and wte.weight are not one segment: %v %v", err1, err2)
	}
	out := t.TempDir()
	if _, err := Export(context.Background(), dir, filepath.Join(out, "tied.safetensors"), Options{}); err != nil {
		t.Fatal(err)
	}
	sameFiles(t, src, out, []string{"tied.safetensors"})

	// A tie made in tensorfs (save_state_dict links the names of one
	// storage): written as save_model writes it, the first name kept.
	plain := filepath.Join(mnt, "plain")
	if _, err := Import(context.Background(), filepath.Join(out, "tied.safetensors"), plain, Options{}); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{attrSTOrder, attrSTMeta + "lm_head.weight"} {
		if err := os.Remove(filepath.Join(plain, "lm_head.weight")); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		removeAttr(t, plain, a)
	}
	if err := os.Link(filepath.Join(plain, "wte.weight"), filepath.Join(plain, "a.weight")); err != nil {
		t.Fatal(err)
	}
	if _, err := Export(context.Background(), plain, filepath.Join(out, "made.safetensors"), Options{}); err != nil {
		t.Fatal(err)
	}
	var renamed []safetensors.Tensor
	for _, tn := range refTensors {
		if tn.Name == "wte.weight" {
			tn.Name = "a.weight"
		}
		renamed = append(renamed, tn)
	}
	h := readHeader(t, filepath.Join(out, "made.safetensors"))
	if h.Metadata["wte.weight"] != "a.weight" || h.Metadata["format"] != "pt" || len(h.Metadata) != 2 || len(h.Tensors) != len(renamed) {
		t.Errorf("tie made in tensorfs exported as %d tensors, metadata %v; want a.weight kept and wte.weight: a.weight", len(h.Tensors), h.Metadata)
	}

	// Sharded: huggingface_hub puts the entry in the index's metadata.
	shards := t.TempDir()
	files := writeRefCheckpoint(t, shards, refTensors, 9000, map[string]string{"lm_head.weight": "wte.weight"})
	sdir := filepath.Join(mnt, "sharded")
	if sum, err := Import(context.Background(), shards, sdir, Options{}); err != nil || sum.Links != 1 {
		t.Fatalf("Import of a sharded checkpoint with a tie in its index: %+v, %v", sum, err)
	}
	sout := filepath.Join(t.TempDir(), "out")
	if _, err := Export(context.Background(), sdir, sout, Options{}); err != nil {
		t.Fatal(err)
	}
	sameFiles(t, shards, sout, files)
}

func removeAttr(t *testing.T, path, name string) {
	t.Helper()
	if err := unix.Removexattr(path, name); err != nil && !errors.Is(err, unix.ENODATA) {
		t.Fatal(err)
	}
}

// TestShardedRefused: an index that does not match its shards is refused
// before anything is written.
func TestShardedRefused(t *testing.T) {
	src := t.TempDir()
	writeRefCheckpoint(t, src, refTensors, 9000, nil)
	index := filepath.Join(src, "model"+safetensors.IndexSuffix)
	good, _ := os.ReadFile(index)
	mnt := fakeMount(t)
	for _, c := range []struct{ name, index, mention string }{
		{"missing", strings.Replace(string(good), `"scale": "model-00003-of-00003.safetensors"`, `"scale": "model-00003-of-00003.safetensors",
    "zz": "model-00001-of-00003.safetensors"`, 1), `"zz"`},
		{"moved", strings.Replace(string(good), `"scale": "model-00003-of-00003.safetensors"`, `"scale": "model-00001-of-00003.safetensors"`, 1), `"scale"`},
		{"no file", strings.Replace(string(good), `"scale": "model-00003-of-00003.safetensors"`, `"scale": "model-00009-of-00009.safetensors"`, 1), "00009"},
		{"bad json", string(good[:len(good)-3]), "bad index"},
		{"empty", `{"weight_map": {}}`, "names no tensor"},
	} {
		if err := os.WriteFile(index, []byte(c.index), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Import(context.Background(), src, filepath.Join(mnt, "m"), Options{})
		if err == nil || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("%s: Import = %v, want an error mentioning %s", c.name, err, c.mention)
		}
		if got := tree(t, mnt); len(got) != 0 {
			t.Errorf("%s: the refused import left %q", c.name, got)
		}
	}
	if err := os.WriteFile(filepath.Join(src, "other"+safetensors.IndexSuffix), good, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Import(context.Background(), src, filepath.Join(mnt, "m"), Options{}); err == nil || !strings.Contains(err.Error(), "2 index files") {
		t.Errorf("Import of a directory with two indexes = %v", err)
	}
}
