"""Time to a ready state dict: tensorfs against views of one /dev/shm file.

    PYTHONPATH=python /usr/bin/python3 python/bench/state_dict.py MOUNT [N ...]

For each N (default 100 and 1000) it saves N float32 tensors of 16 KiB
under MOUNT/bench-N, writes the same tensors as one safetensors file in
/dev/shm, and times, best and median of 7 runs, how long each way takes to
return a dict of zero-copy tensors:

  load_state_dict   tensorfs.load_state_dict: the control socket's load
                    (one request per 253 segments), then each segment
                    mapped into one range, a view of it per tensor
  packed            the same of a directory saved with pack_below=1 MiB:
                    one segment, packed.safetensors, mapped once, a view
                    of it per tensor
  open_torch        tensorfs.open_torch on each segment's path (xattrs,
                    open and mmap through the mount: FUSE requests each)
  shm views         safetensors-style: parse the header, mmap the file
                    once, a torch.frombuffer view per tensor

"touch" adds reading the first element of each tensor (one page fault
each), so that the mappings are known to work.
"""

import json
import os
import shutil
import statistics
import sys
import time

import torch

import tensorfs
from tensorfs import safetensors as st


def shm_views(path):
    import mmap
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(mm, dtype=torch.float32, count=(end - begin) // 4,
                                     offset=8 + n + begin).view(info["shape"])
    return out


def by_path(d, names):
    return {name: tensorfs.open_torch(os.path.join(d, name), "r") for name in names}


def timed(fn, touch):
    t0 = time.perf_counter()
    sd = fn()
    if touch:
        for t in sd.values():
            t.view(-1)[0].item()
    return time.perf_counter() - t0, len(sd)


def main():
    mount = sys.argv[1]
    sizes = [int(a) for a in sys.argv[2:]] or [100, 1000]
    print("%-6s %-16s %-6s %12s %12s" % ("N", "way", "touch", "best ms", "median ms"))
    for n in sizes:
        sd = {"layer.%d.weight" % i: torch.randn(64, 64) for i in range(n)}
        d = os.path.join(mount, "bench-%d" % n)
        shutil.rmtree(d, ignore_errors=True)
        tensorfs.save_state_dict(d, sd)
        dp = d + "-packed"
        shutil.rmtree(dp, ignore_errors=True)
        tensorfs.save_state_dict(dp, sd, pack_below=1 << 20)
        shm = "/dev/shm/tensorfs-bench-%d.safetensors" % n
        st.export_safetensors(d, shm)
        ways = [("load_state_dict", lambda: tensorfs.load_state_dict(d)),
                ("packed", lambda: tensorfs.load_state_dict(dp)),
                ("open_torch", lambda: by_path(d, sd)),
                ("shm views", lambda: shm_views(shm))]
        try:
            for name, fn in ways:
                for touch in (False, True):
                    runs = []
                    for _ in range(7):
                        dt, got = timed(fn, touch)
                        assert got == n, (name, got)
                        runs.append(dt * 1e3)
                    print("%-6d %-16s %-6s %12.2f %12.2f" % (n, name, "yes" if touch else "no",
                                                            min(runs), statistics.median(runs)))
        finally:
            os.unlink(shm)
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(dp, ignore_errors=True)


if __name__ == "__main__":
    main()
