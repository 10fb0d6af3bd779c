"""The shared-memory all-reduce on four buffers of the same size that lie in different places.

::

    mpirun -np 2 -x SMDDP_SHM_CHUNK_BYTES=262144 python benchmarks/buffer_placement.py 64M
    mpirun -np 2 python benchmarks/buffer_placement.py 64M     # the default step (1 MiB)

Buffers, allocated in this order on every rank: ``torch64`` (``torch.ones``, on a cache line),
``torch+16`` (a view 16 bytes into a larger torch tensor), ``numpy+16`` (``np.ones`` as numpy
allocates it: 16 bytes off a cache line), ``numpy64`` (a view of a numpy array moved onto a cache
line). Each is all-reduced 12 times in turn (a barrier before each call); rank 0 prints the median
of the last 10 calls, each buffer's offset from a cache line, and how much of each is backed by
transparent huge pages (``/proc/self/smaps``). docs/performance.md ("Step size") reports it: with
256 KiB steps one of the four was 1.5x slower in every job, with 1 MiB none was.
"""

from __future__ import annotations

import re
import statistics
import sys
import time

import numpy as np
import torch

import smddp.torch.distributed as dist
from smddp.bench import parse_size


def huge_pages_kib(address: int) -> int:
    """``AnonHugePages`` of the mapping that holds ``address`` (kB), from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def main() -> int:
    dist.init_process_group()
    n = parse_size(sys.argv[1] if len(sys.argv) > 1 else "64M") // 4
    base = torch.ones(n + 64)
    aligned = np.ones(n + 64, dtype=np.float32)
    shift = (-(aligned.ctypes.data % 64) // 4) % 16
    buffers = {"torch64": torch.ones(n), "torch+16": base[4:4 + n],
               "numpy+16": torch.from_numpy(np.ones(n, dtype=np.float32)),
               "numpy64": torch.from_numpy(aligned[shift:shift + n])}
    times = {name: [] for name in buffers}
    for _ in range(12):
        for name, t in buffers.items():
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        for name, t in buffers.items():
            print(f"{name:9s} {statistics.median(times[name][2:]) * 1e3:7.2f} ms  "
                  f"{t.data_ptr() % 64:2d} bytes off a cache line  {huge_pages_kib(t.data_ptr())} kB huge pages")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
