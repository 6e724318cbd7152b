"""bench's cluster case for load_into: a model pulled by loading it.

usage: cluster_load.py DIR LAYERS ROWS COLS NORM

Builds, on the meta device, the module whose state dict the cluster
group's model holds (LAYERS tensors layers.K.weight of ROWS x COLS
float32, and norm.weight of NORM), then times tensorfs.load_into of DIR,
a published directory this node has not pulled: the load fetches it. It
prints the seconds load_into took.
"""

import sys
import time

import torch

import tensorfs


def model(layers, rows, cols, norm):
    """The module, its parameters on the meta device."""
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.empty(rows, cols, device="meta"))
        m.layers.append(layer)
    m.norm = torch.nn.Module()
    m.norm.weight = torch.nn.Parameter(torch.empty(norm, device="meta"))
    return m


def main():
    path = sys.argv[1]
    m = model(*(int(a) for a in sys.argv[2:6]))
    start = time.perf_counter()
    tensorfs.load_into(m, path)
    print(time.perf_counter() - start)


if __name__ == "__main__":
    main()
