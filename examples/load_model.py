"""Save a GPT-style model with tied weights once; four workers load it without a copy.

    PYTHONPATH=python /usr/bin/python3 examples/load_model.py MOUNT

The model's lm_head is tied to its token embedding, as in GPT-2.
Its causal mask is a non-persistent buffer, as in Hugging Face's GPT-2: no
checkpoint holds it. tensorfs.save_state_dict stores the tie once: one
segment under both names. Each worker builds the model with
tensorfs.empty_model (parameters on the meta device, no memory for weights;
buffers real, the mask included) and calls tensorfs.load_into, which puts
every parameter and persistent buffer on its segment's pages: no weight is
copied, the tie comes back as one Parameter, a forward pass runs, and the
four workers together hold one copy of the weights, which their
proportional set size (PSS) shows.
"""

import os
import sys
import time

import torch
import torch.multiprocessing as mp

import tensorfs


class GPT(torch.nn.Module):
    def __init__(self, vocab=32000, dim=512, layers=6, ctx=1024):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(ctx, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.register_buffer("position_ids", torch.arange(ctx))
        self.register_buffer("bias", torch.ones(ctx, ctx, dtype=torch.bool).tril(), persistent=False)

    def forward(self, ids):
        n = ids.shape[-1]
        x = self.wte(ids) + self.wpe(self.position_ids[:n])
        for block in self.blocks:  # a stand-in for attention: mix the past only
            x = x + torch.relu(block(self.bias[:n, :n].float() @ x / n))
        return self.lm_head(self.ln_f(x))


def pss(pid):
    with open("/proc/%d/smaps_rollup" % pid) as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def worker(path, load, ready, done):
    model = tensorfs.empty_model(GPT)
    t = time.perf_counter()
    if load:
        tensorfs.load_into(model, path)
        for p in model.state_dict().values():  # read every page
            float(p.reshape(-1)[::1024].float().sum())
    secs = time.perf_counter() - t
    if load:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))  # nothing is left on the meta device
    ready.put((os.getpid(), secs, model.lm_head.weight is model.wte.weight))
    done.wait()


def run(path, load):
    ctx = mp.get_context("fork")
    ready, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(path, load, ready, done)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [ready.get(timeout=120) for _ in procs]
    total = sum(pss(pid) for pid, _, _ in got)
    done.set()
    for p in procs:
        p.join()
    return got, total


def main():
    path = os.path.join(sys.argv[1], "models", "gpt")
    torch.manual_seed(0)
    model = GPT()
    tensorfs.save_state_dict(path, model.state_dict(), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    tied = os.stat(os.path.join(path, "lm_head.weight")).st_ino == os.stat(os.path.join(path, "wte.weight")).st_ino
    print("saved %s: %d names, %.1f MiB; lm_head.weight and wte.weight are one segment: %s"
          % (path, len(model.state_dict()), size / 2**20, tied))
    _, base = run(path, False)
    got, total = run(path, True)
    for pid, secs, tie in sorted(got):
        print("worker %d: load_into and a read of every page in %.0f ms; lm_head tied to wte: %s; forward pass ran"
              % (pid, secs * 1e3, tie))
    print("4 workers: PSS %.1f MiB above 4 that load nothing, for %.1f MiB of weights"
          % ((total - base) / 2**20, size / 2**20))


if __name__ == "__main__":
    main()
