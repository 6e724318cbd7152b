"""CPU per load, client and daemon: load_state_dict of small tensors and load_into of a model.

    PYTHONPATH=python /usr/bin/python3 python/bench/load_cpu.py MOUNT DAEMON_PID [LOADS]

Run from the repository's root (the model is bench/model_case.py's GPT, 12
layers, a 1,000-token vocabulary: 163 entries). It saves, once, 1,000
float32 tensors of 16 KiB under MOUNT/cpu-1000 and the model under
MOUNT/cpu-gpt12, then times LOADS (default 40) loads of each in this
process, no page read: the client's thread CPU (median and best), the
daemon's CPU per load (utime + stime of DAEMON_PID over all the loads,
from /proc: clock ticks, so a run of 40 resolves 0.25 ms) and the wall
time (best and median). Remount between saving and timing to measure a
daemon whose kernel knows no node of the segments, as for processes that
only load them; list them (ls -lR) to measure one that knows each.
"""

import os
import statistics
import sys
import time

import torch

import tensorfs

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import model_case  # noqa: E402


def daemon_cpu(pid):
    """Seconds of CPU the process pid has used, all its threads."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name, pid, loads, load):
    """Time loads calls of load(i) after 3 untimed ones; print one line."""
    for i in range(3):
        load(i)
    client, wall = [], []
    d0 = daemon_cpu(pid)
    for i in range(3, 3 + loads):
        t0, c0 = time.perf_counter(), time.thread_time()
        got = load(i)
        client.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        del got  # its unmapping is not the load's
    daemon = (daemon_cpu(pid) - d0) / loads
    print("%-34s client CPU median %6.2f ms best %6.2f; daemon CPU %6.2f ms; wall best %6.2f median %6.2f ms"
          % (name, statistics.median(client) * 1e3, min(client) * 1e3, daemon * 1e3,
             min(wall) * 1e3, statistics.median(wall) * 1e3))


def main():
    mount, pid = sys.argv[1], int(sys.argv[2])
    loads = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    small = os.path.join(mount, "cpu-1000")
    if not os.path.exists(small):
        tensorfs.save_state_dict(small, {"t%04d" % i: torch.full((4096,), float(i)) for i in range(1000)})
    gpt = os.path.join(mount, "cpu-gpt12")
    if not os.path.exists(gpt):
        torch.manual_seed(0)
        tensorfs.save_state_dict(gpt, model_case.GPT(12, 1000).state_dict(), metadata={"format": "pt"})
    measure("load_state_dict, 1,000 of 16 KiB", pid, loads, lambda i: tensorfs.load_state_dict(small))
    models = [model_case.GPT(12, 1000, device="meta") for _ in range(loads + 3)]
    measure("load_into, the model's 163", pid, loads, lambda i: tensorfs.load_into(models[i], gpt))
    print("load average %.1f" % os.getloadavg()[0])


if __name__ == "__main__":
    main()
