"""bench's PyTorch case: 4 worker processes each need the same weight tensor.

usage: torch_case.py MODE PATH NUMEL [STORE]

MODE is how the workers get the NUMEL float32 weights stored at PATH:
  from_file     each worker maps the tensorfs segment, torch.from_file(shared=True)
  share_memory  the launcher loads the file, calls share_memory_() and forks
                the workers with the tensor (torch.multiprocessing)
  copy          each worker loads its own copy of the file
  none          no weights: the baseline for the memory figure

STORE is the file that keeps the stored copy of the weights: PATH itself,
or for a tensorfs segment its backing file.

A worker is ready once it has read one value of every 4 KiB page of its
tensor, so the weights are resident and mapped. The launcher prints one
JSON line: ready_s, from just after `import torch` until all workers are
ready; pss_bytes, the proportional set size of the launcher and the
workers, all ready, from /proc/PID/smaps_rollup; store_bytes, the bytes in
STORE's pages, and store_unmapped_bytes, those in pages that no tensor of
the launcher or the workers maps (page frame numbers from /proc/PID/pagemap
compared, once the PSS is read).
"""

import array
import json
import mmap
import os
import sys
import time

import numpy as np

import torch
import torch.multiprocessing as mp

WORKERS = 4
PAGE = 4096
PAGE_ELEMS = PAGE // 4
PFN_MASK = (1 << 55) - 1


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
    span = (0, 0)
    if t is not None:
        float(t[::PAGE_ELEMS].sum())
        span = (t.data_ptr(), t.numel() * t.element_size())
    ready.put((os.getpid(), span))
    done.wait()


def frames(pid, addr, size):
    """The page frame numbers of the present pages of [addr, addr+size)."""
    first, n = addr // PAGE, (addr + size + PAGE - 1) // PAGE - addr // PAGE
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        entries = array.array("Q", os.pread(fd, n * 8, first * 8))
    finally:
        os.close(fd)
    return {e & PFN_MASK for e in entries if e >> 63}


def store_frames(store):
    """The page frame numbers of STORE, mapped here and read page by page."""
    with open(store, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    view = np.frombuffer(m, dtype=np.uint8)
    int(view[::PAGE].sum())
    got = frames(os.getpid(), view.ctypes.data, len(view))
    del view
    m.close()
    return got


def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no Pss for {pid}")


def main():
    mode, path, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = sys.argv[4] if len(sys.argv) > 4 else None
    ctx = mp.get_context("fork")
    ready, done = ctx.Queue(), ctx.Event()
    start = time.perf_counter()
    t = load(path, numel).share_memory_() if mode == "share_memory" else None
    procs = [ctx.Process(target=worker, args=(mode, path, numel, t, ready, done)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    spans = [ready.get() for _ in procs]
    ready_s = time.perf_counter() - start
    total = sum(pss(pid) for pid in [os.getpid()] + [p.pid for p in procs])
    if t is not None:
        spans.append((os.getpid(), (t.data_ptr(), t.numel() * t.element_size())))
    stored = unmapped = 0
    if store:
        mapped = set()
        for pid, (addr, size) in spans:
            if size:
                mapped |= frames(pid, addr, size)
        own = store_frames(store)
        stored, unmapped = len(own) * PAGE, len(own - mapped) * PAGE
    done.set()
    for p in procs:
        p.join()
    print(json.dumps({"ready_s": ready_s, "pss_bytes": total, "store_bytes": stored,
                      "store_unmapped_bytes": unmapped, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
