"""bench's PyTorch case: 4 worker processes each need the same weight tensor.

usage: torch_case.py MODE PATH NUMEL

MODE is how the workers get the NUMEL float32 weights stored at PATH:
  from_file     each worker maps the tensorfs segment, torch.from_file(shared=True)
  share_memory  the launcher loads the file, calls share_memory_() and forks
                the workers with the tensor (torch.multiprocessing)
  copy          each worker loads its own copy of the file
  none          no weights: the baseline for the memory figure

A worker is ready once it has read one value of every 4 KiB page of its
tensor, so the weights are resident and mapped. The launcher prints one
JSON line: ready_s, from just after `import torch` until all workers are
ready; pss_bytes, the proportional set size of the launcher and the
workers, all ready, from /proc/PID/smaps_rollup.
"""

import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

WORKERS = 4
PAGE_ELEMS = 4096 // 4


def load(path, numel):
    t = torch.empty(numel, dtype=torch.float32)
    view = memoryview(t.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise EOFError(path)
            done += n
    return t


def worker(mode, path, numel, t, ready, done):
    if mode == "from_file":
        t = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    elif mode == "copy":
        t = load(path, numel)
    if t is not None:
        float(t[::PAGE_ELEMS].sum())
    ready.put(os.getpid())
    done.wait()


def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no Pss for {pid}")


def main():
    mode, path, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = mp.get_context("fork")
    ready, done = ctx.Queue(), ctx.Event()
    start = time.perf_counter()
    t = load(path, numel).share_memory_() if mode == "share_memory" else None
    procs = [ctx.Process(target=worker, args=(mode, path, numel, t, ready, done)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    ready_s = time.perf_counter() - start
    total = sum(pss(pid) for pid in [os.getpid()] + [p.pid for p in procs])
    done.set()
    for p in procs:
        p.join()
    print(json.dumps({"ready_s": ready_s, "pss_bytes": total, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
