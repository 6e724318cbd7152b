package integration

// Hugging Face model directories through a real mount: a GPT-style model
// built in torch (tied lm_head and embedding, int64 and bool buffers, a
// scalar), written as a sharded checkpoint the way transformers'
// save_pretrained writes one, imported into one directory, exported back
// byte-identical, and loaded into a module with its tie.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// hfPrelude defines the model and the reference writers, for the scripts
// below. argv[1] is the directory of the tensorfs Python package.
const hfPrelude = `
import hashlib, json, struct, sys
sys.path.insert(0, sys.argv[1])
import torch, tensorfs

class GPT(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        d = dict(device=device)
        self.transformer = torch.nn.Module()
        self.transformer.wte = torch.nn.Embedding(512, 64, **d)
        self.transformer.wpe = torch.nn.Embedding(32, 64, **d)
        self.transformer.h = torch.nn.ModuleList()
        for _ in range(3):
            b = torch.nn.Module()
            b.ln_1 = torch.nn.LayerNorm(64, **d)
            b.attn = torch.nn.Linear(64, 192, **d)
            b.register_buffer("bias", torch.ones(1, 1, 32, 32, dtype=torch.bool, **d).tril())
            b.mlp = torch.nn.Linear(64, 256, **d)
            b.proj = torch.nn.Linear(256, 64, **d).half()
            self.transformer.h.append(b)
        self.transformer.ln_f = torch.nn.LayerNorm(64, **d)
        self.lm_head = torch.nn.Linear(64, 512, bias=False, **d)
        self.lm_head.weight = self.transformer.wte.weight
        self.register_buffer("position_ids", torch.arange(32, **d))
        self.register_buffer("logit_scale", torch.tensor(0.5, **d))

    def forward(self, x):
        h = self.transformer.wte(x) + self.transformer.wpe(self.position_ids[:x.shape[1]])
        for b in self.transformer.h:
            p = b.proj  # float16 weights; CPU matmuls want float32
            h = h + torch.nn.functional.linear(torch.relu(b.mlp(b.ln_1(h))), p.weight.float(), p.bias.float())
        return self.lm_head(self.transformer.ln_f(h)) * self.logit_scale

def model():
    torch.manual_seed(7)
    return GPT()

def logits(m):
    with torch.no_grad():
        out = m(torch.tensor([[1, 5, 9, 400, 3]]))
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()

ORDER = json.load(open(sys.argv[1] + "/tensorfs/dtypes.json"))["safetensors_order"]
ST = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64", torch.bool: "BOOL"}

def save_file(tensors, path, metadata):
    """huggingface/safetensors serialize: dtype descending in its enum, then name; compact JSON."""
    names = sorted(tensors, key=lambda k: (-ORDER.index(ST[tensors[k].dtype]), k))
    hdr, off, data = {}, 0, []
    if metadata is not None:
        hdr["__metadata__"] = metadata
    for k in names:
        b = tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        hdr[k] = {"dtype": ST[tensors[k].dtype], "shape": list(tensors[k].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        data.append(b)
    h = json.dumps(hdr, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(data))

def save_pretrained(sd, out, max_shard_size):
    """transformers' save_pretrained: tied copies dropped, huggingface_hub's split in
    state-dict order, {"format": "pt"} in each shard, the index sorted and indented."""
    shards, cur, size, total = [], {}, 0, 0
    for k, t in sd.items():
        n = t.untyped_storage().nbytes() if hasattr(t, "untyped_storage") else t.storage().nbytes()
        if n > max_shard_size:
            total += n
            shards.append({k: t})
            continue
        if size + n > max_shard_size:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += n
        total += n
    if cur:
        shards.append(cur)
    wm = {}
    for i, s in enumerate(shards):
        name = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        save_file(s, out + "/" + name, {"format": "pt"})
        wm.update((k, name) for k in s)
    with open(out + "/model.safetensors.index.json", "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2, sort_keys=True) + "\n")
    return len(shards)
`

// TestHFShardedRoundTrip: a sharded checkpoint as save_pretrained writes
// it goes into one directory (dotted names, metadata kept), comes back
// byte-identical as shards and index, re-imports with every name, dtype,
// shape and metadata, and load_into puts it on a module with its tie,
// whose outputs are the original's.
func TestHFShardedRoundTrip(t *testing.T) {
	t.Parallel()
	requireTorch(t)
	pydir, err := filepath.Abs("../python")
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	out := python(t, hfPrelude+`
m = model()
sd = m.state_dict()
del sd["lm_head.weight"]  # transformers drops the tied copy (_tied_weights_keys)
print(save_pretrained(sd, sys.argv[2], 120000), logits(m), json.dumps(sorted(sd)))
`, pydir, src)
	var names []string
	fields := strings.SplitN(strings.TrimSpace(out), " ", 3)
	if len(fields) != 3 || json.Unmarshal([]byte(fields[2]), &names) != nil || fields[0] != "6" {
		t.Fatalf("writer said %q, want 6 shards, a hash and the names", out)
	}
	want := fields[1]
	files, _ := filepath.Glob(filepath.Join(src, "*"))
	if len(files) != 7 {
		t.Fatalf("the fixture has %d files, want 6 shards and an index", len(files))
	}

	forEachModeParallel(t, func(t *testing.T, m *mount) {
		dir := m.path("gpt")
		if got := stOK(t, "import", filepath.Join(src, "model.safetensors.index.json"), dir); !strings.Contains(got, fmt.Sprintf("imported %d tensors", len(names))) || !strings.Contains(got, "6 files") {
			t.Errorf("import said %q", got)
		}
		if got := stTree(t, dir); !slices.Equal(got, names) {
			t.Errorf("imported %q, want one segment per tensor under its dotted name: %q", got, names)
		}
		if got := stAttr(t, dir, "user.safetensors.meta.format"); got != "pt" {
			t.Errorf("user.safetensors.meta.format = %q", got)
		}
		if got := stAttr(t, filepath.Join(dir, "transformer.h.0.attn.bias"), "user.tensor.shape"); got != "[192]" {
			t.Errorf("transformer.h.0.attn.bias shape %q", got)
		}
		back := filepath.Join(t.TempDir(), "back")
		stOK(t, "export", dir, back)
		for _, f := range files {
			run(t, "cmp", f, filepath.Join(back, filepath.Base(f)))
		}
		if ents, _ := os.ReadDir(back); len(ents) != len(files) {
			t.Errorf("export wrote %d files, want %d", len(ents), len(files))
		}

		// Re-imported from the exported directory: the same names, dtypes,
		// shapes and metadata.
		again := m.path("again")
		stOK(t, "import", back, again)
		for _, n := range names {
			for _, a := range []string{"user.tensor.dtype", "user.tensor.shape"} {
				if x, y := stAttr(t, filepath.Join(dir, n), a), stAttr(t, filepath.Join(again, n), a); x != y {
					t.Errorf("%s: %s %q, after export and import %q", n, a, x, y)
				}
			}
			run(t, "cmp", filepath.Join(dir, n), filepath.Join(again, n))
		}
		if got := stAttr(t, again, "user.safetensors.meta.format"); got != "pt" {
			t.Errorf("re-import: user.safetensors.meta.format = %q", got)
		}

		// load_into: the tie comes back (lm_head.weight is not missing),
		// no weight is copied, the outputs are the original's.
		got := strings.TrimSpace(python(t, hfPrelude+`
m = GPT(device="meta")
keys = tensorfs.load_into(m, sys.argv[2])
assert m.lm_head.weight is m.transformer.wte.weight
print(keys.missing_keys, keys.unexpected_keys, logits(m))
`, pydir, dir))
		if got != "[] [] "+want {
			t.Errorf("load_into then forward said %q, want no missing or unexpected keys and logits %s", got, want)
		}
	})
}

// TestStateDictExportAsSaveModel: save_state_dict of a tied model stores
// the tie once (a hard link); export writes exactly what safetensors'
// save_model writes for the module, and a split export what
// save_pretrained writes when given the same state dict.
func TestStateDictExportAsSaveModel(t *testing.T) {
	t.Parallel()
	requireTorch(t)
	pydir, err := filepath.Abs("../python")
	if err != nil {
		t.Fatal(err)
	}
	m := mountFS(t, "passthrough")
	ref := t.TempDir()
	dir := m.path("sd")
	python(t, hfPrelude+`
import os
m = model()
tensorfs.save_state_dict(sys.argv[2], m.state_dict(), metadata={"format": "pt"})
sd = m.state_dict()
# save_model: of the names of one storage, keep the first in sorted order,
# record each other as metadata, then save_file.
del sd["transformer.wte.weight"]
save_file(sd, sys.argv[3] + "/model.safetensors", {"format": "pt", "transformer.wte.weight": "lm_head.weight"})
`, pydir, dir, ref)
	a, err1 := os.Stat(filepath.Join(dir, "lm_head.weight"))
	b, err2 := os.Stat(filepath.Join(dir, "transformer.wte.weight"))
	if err1 != nil || err2 != nil || !os.SameFile(a, b) {
		t.Fatalf("the tied names are not one segment: %v %v", err1, err2)
	}
	out := filepath.Join(t.TempDir(), "model.safetensors")
	if got := stOK(t, "export", dir, out); !strings.Contains(got, "1 tied") {
		t.Errorf("export said %q", got)
	}
	run(t, "cmp", filepath.Join(ref, "model.safetensors"), out)
}

// TestSetShow: tensorfs set gives a segment of a real mount a layout the
// daemon accepts, tensorfs show prints it, and what does not fit is
// refused with the reason, leaving the layout as it was.
func TestSetShow(t *testing.T) {
	t.Parallel()
	m := mountFS(t, "passthrough")
	p := m.path("w")
	if err := os.WriteFile(p, make([]byte, 64), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := stOK(t, "set", "torch.half", "[4, 8]", p); got != p+": float16 [4, 8]\n" {
		t.Errorf("set said %q", got)
	}
	if got := stAttr(t, p, "user.tensor.dtype") + " " + stAttr(t, p, "user.tensor.shape"); got != "float16 [4, 8]" {
		t.Errorf("after set the attributes say %q", got)
	}
	run(t, "setfattr", "-n", "user.tensor.stride", "-v", "[1, 4]", p)
	if got := stOK(t, "show", p); got != p+": float16 [4, 8] (64 bytes; stride [1, 4])\n" {
		t.Errorf("show said %q", got)
	}
	// float64 [4, 8] is 256 bytes; the old stride would not do either.
	stdout, stderr, code := stTensorfs(t, "set", "float64", "4,8", p)
	if code != 1 || !strings.Contains(stderr, "needs 256 bytes, the segment has 64") {
		t.Errorf("set of a layout too large: exit %d, %q %q", code, stdout, stderr)
	}
	if got := stOK(t, "set", "int64", "8", p); got != p+": int64 [8]\n" {
		t.Errorf("set said %q", got)
	}
	if got := stOK(t, "show", p); got != p+": int64 [8] (64 bytes; contiguous)\n" {
		t.Errorf("show after set said %q (the stride should be gone)", got)
	}
}
