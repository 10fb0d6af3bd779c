"""``smddp-bench``: collective benchmarks that read like NVIDIA's nccl-tests.

Run it under any launcher; every rank runs the same sweep and rank 0 prints::

    mpirun -np 2 smddp-bench --op all_reduce -b 1K -e 64M -f 2 --check
    torchrun --nproc-per-node 2 -m smddp.bench --op all --compare gloo --plot bw.png
    smddp-bench --op broadcast            # plain python: a world of one

For each collective and message size rank 0 prints one row::

    size(B) count type redop root time(us) algbw(GB/s) busbw(GB/s) #wrong

then ``# Avg bus bandwidth``. Sizes, counts and bandwidths follow nccl-tests' conventions:

- ``size`` is the bytes of one rank's buffer: the tensor for ``all_reduce`` and
  ``broadcast``, the whole output for ``all_gather`` and ``all_to_all``. ``count`` is the
  elements of that tensor (``all_reduce``, ``broadcast``), the elements each rank
  contributes (``all_gather``) or sends to each peer (``all_to_all``).
- ``algbw = size / time``; ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for
  ``all_reduce``, ``(n-1)/n`` for ``all_gather`` and ``all_to_all``, ``1`` for ``broadcast``:
  the bandwidth a ring would need on each link, comparable across collectives and world
  sizes. GB/s are 10^9 bytes per second.
- Timing: ``warmup`` untimed calls, then a barrier, then ``iters`` back-to-back blocking calls
  (device work synchronized once at the end); ``time`` is the elapsed time divided by
  ``iters``, averaged over ranks by default (``-a``).
- ``--check`` fills every rank's input with a seeded pattern, runs the collective once more
  and counts elements that differ from the result computed locally from all ranks' patterns.

The package, one job a module: :mod:`~smddp.bench.sizes` (sizes, sweeps, shapes, bus
factors, dtype and choice lists), :mod:`~smddp.bench.oracle` (seeded inputs and the expected
results), :mod:`~smddp.bench.adapters` (smddp's API or torch.distributed on a group),
:mod:`~smddp.bench.runner` (one case: buffers, timing, check, agreement over ranks),
:mod:`~smddp.bench.output` (table, CSV, plot, progress) and :mod:`~smddp.bench.cli` (the
command).
"""

from __future__ import annotations

from smddp.bench.adapters import Impl, SmddpImpl, TorchImpl
from smddp.bench.cli import build_parser, main
from smddp.bench.oracle import check_result, count_wrong, expected, pattern
from smddp.bench.output import CSV_FIELDS, HEADER, Progress, Report, format_row, write_csv, write_plot
from smddp.bench.runner import Row, Runner
from smddp.bench.sizes import (
    AVERAGE_MODES,
    OPS,
    REDOPS,
    bus_factor,
    choices,
    dtype_names,
    format_size,
    parse_size,
    shape,
    sweep,
)

__all__ = [
    "AVERAGE_MODES", "CSV_FIELDS", "HEADER", "OPS", "REDOPS", "Impl", "Progress", "Report", "Row", "Runner",
    "SmddpImpl", "TorchImpl", "build_parser", "bus_factor", "check_result", "choices", "count_wrong",
    "dtype_names", "expected", "format_row", "format_size", "main", "parse_size", "pattern", "shape", "sweep",
    "write_csv", "write_plot",
]
