"""bench's model case: 4 worker processes each load the same GPT-style model.

usage: model_case.py setup LAYERS VOCAB DIR FILE.safetensors FILE.pt
       model_case.py run MODE PATH LAYERS VOCAB

setup builds the model (GPT-2 small's shape with LAYERS layers and a
VOCAB-token embedding tied to lm_head, an int64 and a bool buffer per the
original, a scalar) and stores it three ways: tensorfs.save_state_dict into
DIR (a directory of a tensorfs mount: the tie is one segment), a
safetensors file as safetensors' save_model writes it (tensorfs export of
DIR), and torch.save of the state dict. It prints the parameter count,
entries and bytes as JSON.

run starts 4 workers (fork); each builds the model on the meta device
(no memory for weights) and loads it by MODE:
  load_into   tensorfs.load_into(model, PATH): the segments' pages, copy-on-write
  mmap        PATH is the safetensors file: one copy-on-write mmap, a view per
              tensor (what safetensors' safe_open does), put on the module
  torch_load  torch.load(PATH), put on the module
  none        nothing: the baseline for memory
A worker is ready once it has read one value of every 4 KiB page of every
tensor. The launcher prints one JSON line: ready_s, from the first fork
until all workers are ready, and pss_bytes, the proportional set size of
the launcher and the workers, all ready (/proc/PID/smaps_rollup).
"""

import json
import mmap
import os
import struct
import sys
import time

import torch
import torch.multiprocessing as mp

import tensorfs

WORKERS = 4
PAGE = 4096


class GPT(torch.nn.Module):
    """GPT-2 small's layout (nn.Linear for its Conv1D), on any device."""

    def __init__(self, layers, vocab, dim=768, ctx=1024, device=None):
        super().__init__()
        d = dict(device=device)
        self.transformer = torch.nn.Module()
        t = self.transformer
        t.wte = torch.nn.Embedding(vocab, dim, **d)
        t.wpe = torch.nn.Embedding(ctx, dim, **d)
        t.h = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.ln_1, b.ln_2 = torch.nn.LayerNorm(dim, **d), torch.nn.LayerNorm(dim, **d)
            b.attn = torch.nn.Module()
            b.attn.c_attn = torch.nn.Linear(dim, 3 * dim, **d)
            b.attn.c_proj = torch.nn.Linear(dim, dim, **d)
            b.attn.register_buffer("bias", torch.ones(1, 1, ctx, ctx, dtype=torch.bool, **d).tril())
            b.mlp = torch.nn.Module()
            b.mlp.c_fc = torch.nn.Linear(dim, 4 * dim, **d)
            b.mlp.c_proj = torch.nn.Linear(4 * dim, dim, **d)
            t.h.append(b)
        t.ln_f = torch.nn.LayerNorm(dim, **d)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False, **d)
        self.lm_head.weight = t.wte.weight
        self.register_buffer("position_ids", torch.arange(ctx, **d))
        self.register_buffer("logit_scale", torch.tensor(1.0, **d))


def setup(layers, vocab, d, st, pt):
    torch.manual_seed(0)
    m = GPT(layers, vocab)
    sd = m.state_dict()
    tensorfs.save_state_dict(d, sd, metadata={"format": "pt"})
    tensorfs.export_safetensors(d, st)
    torch.save(sd, pt)
    unique = {t.data_ptr(): t for t in sd.values()}
    print(json.dumps({"params": sum(p.numel() for p in m.parameters()), "entries": len(sd),
                      "bytes": sum(t.numel() * t.element_size() for t in unique.values())}))


def assign(model, tensors):
    """Put tensors on model by name, keeping ties, as tensorfs.load_into does."""
    new = {}
    own = model.state_dict(keep_vars=True)
    for name, old in own.items():
        if name in tensors and id(old) not in new:
            t = tensors[name]
            new[id(old)] = torch.nn.Parameter(t, requires_grad=old.requires_grad) \
                if isinstance(old, torch.nn.Parameter) else t
    for name, old in own.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, new[id(old)])


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "BOOL": torch.bool}


def mmap_views(path):
    """safe_open's way: one mapping of the file, a tensor view per entry."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = base[8 + n + b:8 + n + e].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    for name, kept in (header.get("__metadata__") or {}).items():
        if kept in out and name not in out:  # a tie save_model dropped
            out[name] = out[kept]
    return out


def worker(mode, path, layers, vocab, ready, done):
    m = GPT(layers, vocab, device="meta")
    if mode == "load_into":
        tensorfs.load_into(m, path)
    elif mode == "mmap":
        assign(m, mmap_views(path))
    elif mode == "torch_load":
        assign(m, torch.load(path))
    if mode != "none":
        for t in m.state_dict().values():
            flat = t.reshape(-1)
            float(flat[::max(1, PAGE // t.element_size())].float().sum())
    ready.put(os.getpid())
    done.wait()


def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no Pss for {pid}")


def run(mode, path, layers, vocab):
    ctx = mp.get_context("fork")
    ready, done = ctx.Queue(), ctx.Event()
    start = time.perf_counter()
    procs = [ctx.Process(target=worker, args=(mode, path, layers, vocab, ready, done)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    pids = [ready.get(timeout=600) for _ in procs]
    ready_s = time.perf_counter() - start
    total = pss(os.getpid()) + sum(pss(pid) for pid in pids)
    done.set()
    for p in procs:
        p.join()
    print(json.dumps({"ready_s": ready_s, "pss_bytes": total, "torch": torch.__version__}))


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
    else:
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
