"""Publish a model's weights once; four consumers map them zero-copy.

    sudo ./scripts/mount.sh /mnt/tensorfs
    pip install ./python   # or PYTHONPATH=python
    /usr/bin/python3 examples/share_weights.py /mnt/tensorfs

The producer moves a torch tensor into shared memory that becomes a
segment of the mount (tensorfs.publish: one copy, as share_memory_() would
make, then none); each consumer process maps the same pages with
tensorfs.open_torch (read-only: the segment is FROMFD). While they hold it, the segment's holders show who
uses it, which `tensorfs ls -l` and getfattr print too.
"""

import multiprocessing as mp
import os
import subprocess
import sys

import torch

import tensorfs


def consumer(path, ready, done):
    w = tensorfs.open_torch(path)  # maps the producer's pages: no copy
    ready.put((os.getpid(), float(w[0, :4].sum())))
    done.wait()


def main(mount):
    os.makedirs(f"{mount}/models", exist_ok=True)
    path = f"{mount}/models/weights"
    if os.path.exists(path):
        os.unlink(path)

    weights = torch.randn(4096, 4096)  # 64 MiB of float32 "weights"
    tensorfs.publish(weights, path)  # weights now lives in the segment's memory
    print(f"published {path}: {os.getxattr(path, 'user.tensor.dtype').decode()} "
          f"{os.getxattr(path, 'user.tensor.shape').decode()}")

    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=consumer, args=(path, ready, done)) for _ in range(4)]
    for w in workers:
        w.start()
    for _ in workers:
        pid, s = ready.get()
        print(f"consumer {pid} mapped it; w[0, :4].sum() = {s:.4f}")
    print(f"producer's w[0, :4].sum() = {float(weights[0, :4].sum()):.4f}")

    print("\n$ getfattr --only-values -n user.tensorfs.holders " + path)
    print(subprocess.run(["getfattr", "--only-values", "-n", "user.tensorfs.holders", path],
                         capture_output=True, text=True).stdout)
    print("$ tensorfs ls -l " + os.path.dirname(path))
    tensorfs_bin = os.environ.get("TENSORFS", "bin/tensorfs")
    print(subprocess.run([tensorfs_bin, "ls", "-l", os.path.dirname(path)],
                         capture_output=True, text=True).stdout)

    done.set()
    for w in workers:
        w.join()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/mnt/tensorfs")
