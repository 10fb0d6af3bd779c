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
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

OPS = ("all_reduce", "broadcast", "all_gather", "all_to_all")
REDOPS = ("sum", "avg", "min", "max")
AVERAGE_MODES = {0: "rank 0", 1: "average over ranks", 2: "minimum over ranks", 3: "maximum over ranks"}

# dtype names accepted by -d: nccl-tests' names first, then torch's. Values: (torch attr, shown as).
_DTYPES: Dict[str, Tuple[str, str]] = {
    "int8": ("int8", "int8"), "char": ("int8", "int8"),
    "uint8": ("uint8", "uint8"),
    "int32": ("int32", "int32"), "int": ("int32", "int32"),
    "int64": ("int64", "int64"), "long": ("int64", "int64"),
    "half": ("float16", "half"), "float16": ("float16", "half"), "fp16": ("float16", "half"),
    "bfloat16": ("bfloat16", "bfloat16"), "bf16": ("bfloat16", "bfloat16"),
    "float": ("float32", "float"), "float32": ("float32", "float"), "fp32": ("float32", "float"),
    "double": ("float64", "double"), "float64": ("float64", "double"), "fp64": ("float64", "double"),
}
_ALL_DTYPES = ("int8", "uint8", "int32", "int64", "half", "bfloat16", "float", "double")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

#: Elements checked (and filled with the pattern) at a time, so --check works on large buffers.
_CHUNK = 1 << 22

CSV_FIELDS = ("op", "impl", "backend", "api", "device", "world_size", "size_bytes", "count", "dtype", "redop",
              "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong")


# ---------------------------------------------------------------------------- pure helpers
def parse_size(text: str) -> int:
    """Bytes from a size written as nccl-tests takes it: ``1024``, ``1K``, ``64M``, ``1G``.

    Suffixes are powers of 1024 (``K``, ``M``, ``G``, ``T``, any case, optionally followed by
    ``B`` or ``iB``); a fraction is allowed with a suffix (``1.5M``).

    Raises:
        ValueError: not a size, or not a whole number of bytes.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 1024, 1K, 64M, 1G)")
    number, unit = match.group(1), match.group(2).lower()
    value = float(number) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(nbytes: int) -> str:
    """``1024`` → ``"1K"``, ``1536`` → ``"1.5K"``, ``64 << 20`` → ``"64M"``, ``100`` → ``"100"``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value * 100 == int(value * 100) else f"{value:.2f}{unit}"
    return str(nbytes)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: ``busbw = algbw * bus_factor(op, n)``.

    Args:
        op: ``"all_reduce"``, ``"broadcast"``, ``"all_gather"`` or ``"all_to_all"``.
        world_size: number of ranks ``n``.

    Returns:
        ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and all_to_all, ``1`` for broadcast.

    Raises:
        ValueError: an unknown op or a world size below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def sweep(minbytes: int, maxbytes: int, stepfactor: float = 2, stepbytes: int = 0) -> List[int]:
    """Message sizes from ``minbytes`` to ``maxbytes``, as nccl-tests steps them.

    Multiplied by ``stepfactor`` when it is above 1, else increased by ``stepbytes``.

    Raises:
        ValueError: sizes or steps that cannot make a finite sweep.
    """
    if minbytes < 1 or maxbytes < minbytes:
        raise ValueError(f"need 1 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError("need a stepfactor above 1 or a positive stepbytes")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = int(size * stepfactor) if stepfactor > 1 else size + stepbytes
    return sizes


def shape(op: str, nbytes: int, element_size: int, world_size: int) -> Tuple[int, int]:
    """``(count, size_bytes)`` of a case of about ``nbytes``, rounded as nccl-tests does.

    ``all_gather`` and ``all_to_all`` round down to a multiple of ``world_size`` elements;
    every case has at least one element per rank.
    """
    if op in ("all_gather", "all_to_all"):
        count = max(1, nbytes // (element_size * world_size))
        return count, count * world_size * element_size
    count = max(1, nbytes // element_size)
    return count, count * element_size


def dtype_names(spec: str) -> List[str]:
    """The dtypes of ``-d``: one name, a comma-separated list, or ``all`` (shown names, in order).

    Raises:
        ValueError: an unknown name (the valid ones are listed).
    """
    names = []
    for part in spec.split(","):
        part = part.strip().lower()
        if part == "all":
            names.extend(_ALL_DTYPES)
            continue
        if part not in _DTYPES:
            raise ValueError(f"unknown dtype {part!r}; valid: {', '.join(_DTYPES)}, all")
        names.append(_DTYPES[part][1])
    return list(dict.fromkeys(names))


def _choices(spec: str, valid: Sequence[str], what: str) -> List[str]:
    names = []
    for part in spec.split(","):
        part = part.strip().lower()
        if part == "all":
            names.extend(valid)
        elif part in valid:
            names.append(part)
        else:
            raise ValueError(f"unknown {what} {part!r}; valid: {', '.join(valid)}, all")
    return list(dict.fromkeys(names))


def _torch_dtype(shown: str):
    import torch

    return getattr(torch, _DTYPES[shown][0])


# ---------------------------------------------------------------------------- expectations
def pattern(rank: int, start: int, length: int):
    """Rank ``rank``'s seeded input, elements ``start .. start+length`` (int64, values 1..13).

    Small integers are exact in every dtype, so sums over a few dozen ranks are exact too, in
    any order: a check needs no tolerance for them.
    """
    import torch

    return (torch.arange(start, start + length, dtype=torch.int64) + 5 * rank) % 13 + 1


def expected(op: str, rank: int, world_size: int, count: int, dtype, redop: str = "sum", root: int = 0,
             start: int = 0, length: Optional[int] = None):
    """What ``rank`` must hold after ``op`` on the :func:`pattern` inputs, computed locally.

    Args:
        op: the collective.
        rank: the rank whose result is wanted.
        world_size: number of ranks.
        count: the case's count (see :func:`shape`).
        dtype: the torch dtype of the buffers.
        redop: the reduction of ``all_reduce``.
        root: the source rank of ``broadcast``.
        start, length: the slice of the result wanted (default: all of it), so that large
            buffers are checked a slice at a time.

    Returns:
        A CPU tensor of ``dtype``: the in-place tensor (all_reduce, broadcast) or the output
        (all_gather, all_to_all), elements ``start .. start+length``.
    """
    import torch

    n = world_size
    total = count * n if op in ("all_gather", "all_to_all") else count
    length = total - start if length is None else length
    if op == "broadcast":
        return pattern(root, start, length).to(dtype)
    if op in ("all_gather", "all_to_all"):
        # Output element k comes from rank k // count: its element k % count (all_gather), or
        # its element rank * count + k % count (all_to_all).
        parts, k, end = [], start, start + length
        while k < end:
            src, offset = divmod(k, count)
            take = min(end - k, count - offset)
            first = offset if op == "all_gather" else rank * count + offset
            parts.append(pattern(src, first, take))
            k += take
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)).to(dtype)
    floating = dtype.is_floating_point
    acc = pattern(0, start, length).to(torch.float64 if floating else torch.int64)
    for r in range(1, n):
        incoming = pattern(r, start, length).to(acc.dtype)
        if redop in ("sum", "avg"):
            acc += incoming
        elif redop == "min":
            torch.minimum(acc, incoming, out=acc)
        else:
            torch.maximum(acc, incoming, out=acc)
    if redop != "avg":
        return acc.to(dtype)
    if floating:
        return (acc / n).to(dtype)
    # Integer AVERAGE: the sum wraps in the dtype, then divides rounding toward zero.
    return acc.to(dtype).div(n, rounding_mode="trunc")


def count_wrong(got, want, world_size: int) -> int:
    """Elements of ``got`` that differ from ``want`` (floats within ``n`` ulps of 1; NaN is wrong).

    Compared on ``got``'s device; ``want`` may be on the CPU.
    """
    import torch

    got = got.detach().reshape(-1)
    want = want.reshape(-1).to(got.device)
    if not want.dtype.is_floating_point:
        return int((got != want).sum())
    tol = torch.finfo(want.dtype).eps * world_size
    wide = torch.float64 if want.dtype == torch.float64 else torch.float32  # small integers: exact in float32
    g, w = got.to(wide), want.to(wide)
    ok = (g - w).abs() <= tol * w.abs()
    return int((~ok).sum())


def check_result(got, op: str, rank: int, world_size: int, count: int, dtype, redop: str = "sum", root: int = 0,
                 chunk: Optional[int] = None) -> int:
    """Wrong elements of ``got``, the result of ``op`` on this rank, checked ``chunk`` elements at a time."""
    flat = got.detach().reshape(-1)
    chunk = chunk or _CHUNK
    wrong = 0
    for start in range(0, flat.numel(), chunk):
        length = min(chunk, flat.numel() - start)
        want = expected(op, rank, world_size, count, dtype, redop, root, start, length)
        wrong += count_wrong(flat[start:start + length], want, world_size)
    return wrong


# ---------------------------------------------------------------------------- implementations
class Impl:
    """One way to run the collectives: smddp's API, or torch.distributed on some group."""

    name = ""
    backend = ""
    api = ""

    @property
    def label(self) -> str:
        return f"{self.name}({self.backend})" if self.backend and self.backend != self.name else self.name

    def all_reduce(self, tensor, redop: str) -> None:
        raise NotImplementedError

    def broadcast(self, tensor, root: int) -> None:
        raise NotImplementedError

    def all_gather(self, outputs, tensor) -> None:
        raise NotImplementedError

    def all_to_all(self, output, tensor) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class SmddpImpl(Impl):
    """``smddp.torch.distributed`` functions, as a SageMaker script calls them."""

    name = "smddp"
    api = "smddp"

    def __init__(self):
        import smddp.torch.distributed as dist

        self.dist = dist
        self.backend = dist.get_backend()
        self._ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVERAGE,
                     "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def all_reduce(self, tensor, redop):
        self.dist.all_reduce(tensor, op=self._ops[redop])

    def broadcast(self, tensor, root):
        self.dist.broadcast(tensor, src=root)

    def all_gather(self, outputs, tensor):
        self.dist.all_gather(outputs, tensor)

    def all_to_all(self, output, tensor):
        self.dist.all_to_all_single(output, tensor)

    def barrier(self):
        self.dist.barrier()


class TorchImpl(Impl):
    """``torch.distributed`` functions on a group: the default (smddp's) or one made by ``new_group``.

    Args:
        group: the group, or None for torch's default group.
        name: the implementation's name in tables and plots.
        backend: the backend's name.
        emulate_avg: the backend has no AVG (gloo): sum, then divide on each rank.
    """

    api = "torch"

    def __init__(self, group, name: str, backend: str, emulate_avg: bool = False):
        import torch.distributed as tdist

        self.tdist, self.group, self.name, self.backend = tdist, group, name, backend
        self.emulate_avg = emulate_avg
        self.size = tdist.get_world_size(group)
        self._ops = {"sum": tdist.ReduceOp.SUM, "avg": tdist.ReduceOp.AVG,
                     "min": tdist.ReduceOp.MIN, "max": tdist.ReduceOp.MAX}

    def all_reduce(self, tensor, redop):
        if redop == "avg" and self.emulate_avg:
            self.tdist.all_reduce(tensor, op=self.tdist.ReduceOp.SUM, group=self.group)
            if tensor.is_floating_point():
                tensor.div_(self.size)
            else:
                tensor.div_(self.size, rounding_mode="trunc")
            return
        self.tdist.all_reduce(tensor, op=self._ops[redop], group=self.group)

    def broadcast(self, tensor, root):
        self.tdist.broadcast(tensor, src=root, group=self.group)

    def all_gather(self, outputs, tensor):
        self.tdist.all_gather(outputs, tensor, group=self.group)

    def all_to_all(self, output, tensor):
        self.tdist.all_to_all_single(output, tensor, group=self.group)

    def barrier(self):
        self.tdist.barrier(group=self.group)


# ---------------------------------------------------------------------------- running
@dataclass
class Row:
    """One measured case: a row of the table and of the CSV."""

    op: str
    impl: str
    backend: str
    api: str
    device: str
    world_size: int
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: Optional[int]

    @property
    def label(self) -> str:
        return f"{self.impl}({self.backend})" if self.backend and self.backend != self.impl else self.impl


def _synchronizer(device) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return torch.cuda.synchronize
    if device.type == "xpu":
        return torch.xpu.synchronize
    return lambda: None


class Runner:
    """Runs cases on every rank and reduces each measurement over ranks.

    Args:
        impl: the implementation under test.
        device: where buffers live.
        rank: this process's rank; world_size: the number of ranks.
        average: nccl-tests' ``-a``: 0 rank 0, 1 average, 2 minimum, 3 maximum over ranks.
    """

    def __init__(self, impl: Impl, device, rank: int, world_size: int, average: int = 1):
        self.impl, self.device, self.rank, self.world_size = impl, device, rank, world_size
        self.average = average
        self.sync = _synchronizer(device)

    def _buffers(self, op: str, count: int, dtype, root: int, fill: bool):
        import torch

        n, me = self.world_size, self.rank

        def filled(numel, start=0):
            tensor = torch.ones(numel, dtype=dtype, device=self.device)
            if fill:  # a slice at a time: the int64 pattern of a 4 GB buffer would not fit
                for first in range(0, numel, _CHUNK):
                    length = min(_CHUNK, numel - first)
                    tensor[first:first + length].copy_(pattern(me, start + first, length).to(dtype))
            return tensor

        if op in ("all_reduce", "broadcast"):
            tensor = filled(count)
            if op == "broadcast" and me != root:
                tensor.zero_()
            return tensor, None
        if op == "all_gather":
            out = torch.zeros(n * count, dtype=dtype, device=self.device)
            return filled(count), out
        out = torch.zeros(n * count, dtype=dtype, device=self.device)
        return filled(n * count), out

    def _call(self, op: str, redop: str, root: int, tensor, out) -> Callable[[], None]:
        impl = self.impl
        if op == "all_reduce":
            return lambda: impl.all_reduce(tensor, redop)
        if op == "broadcast":
            return lambda: impl.broadcast(tensor, root)
        if op == "all_gather":
            outputs = list(out.view(self.world_size, -1).unbind(0))
            return lambda: impl.all_gather(outputs, tensor)
        return lambda: impl.all_to_all(out, tensor)

    def measure(self, op: str, nbytes: int, dtype_name: str, redop: str, root: int,
                warmup: int, iters: int, check: bool) -> Row:
        """Time one case (and check it); every rank must call this with the same arguments."""
        dtype = _torch_dtype(dtype_name)
        count, size_bytes = shape(op, nbytes, dtype.itemsize, self.world_size)
        tensor, out = self._buffers(op, count, dtype, root, fill=False)
        call = self._call(op, redop, root, tensor, out)
        for _ in range(warmup):
            call()
        self.sync()
        self.impl.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        self.sync()
        elapsed = (time.perf_counter() - start) / max(iters, 1)
        wrong = None
        if check:
            tensor, out = self._buffers(op, count, dtype, root, fill=True)
            self._call(op, redop, root, tensor, out)()
            self.sync()
            got = tensor if op in ("all_reduce", "broadcast") else out
            wrong = check_result(got, op, self.rank, self.world_size, count, dtype, redop, root)
        del tensor, out, call
        seconds, wrong = self._reduce(elapsed, wrong)
        algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
        return Row(op, self.impl.name, self.impl.backend, self.impl.api, self.device.type, self.world_size,
                   size_bytes, count, dtype_name, redop if op == "all_reduce" else "none",
                   root if op == "broadcast" else -1, seconds * 1e6, algbw,
                   algbw * bus_factor(op, self.world_size), wrong)

    def _reduce(self, seconds: float, wrong: Optional[int]) -> Tuple[float, Optional[int]]:
        """The case's time by ``-a`` and the total wrong count, agreed by every rank."""
        import torch

        import smddp.torch.distributed as dist

        if self.world_size == 1:
            return seconds, wrong
        values = torch.tensor([seconds, float(wrong or 0)], dtype=torch.float64)
        if self.average == 0:
            dist.broadcast(values, src=0)
            total = torch.tensor([float(wrong or 0)], dtype=torch.float64)
            dist.all_reduce(total)
            values[1] = total[0]
        elif self.average == 1:
            dist.all_reduce(values)
            values[0] /= self.world_size
        else:
            total = values[1:].clone()
            dist.all_reduce(total)
            time_only = values[:1].clone()
            dist.all_reduce(time_only, op=dist.ReduceOp.MIN if self.average == 2 else dist.ReduceOp.MAX)
            values = torch.cat([time_only, total])
        return float(values[0]), (None if wrong is None else int(values[1]))


# ---------------------------------------------------------------------------- output
_HEADER = ("#    size(B)        count      type   redop    root    time(us)  algbw(GB/s)  busbw(GB/s)  #wrong")


def format_row(row: Row) -> str:
    """One table row, aligned under :data:`_HEADER`."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return (f"{row.size_bytes:12d} {row.count:12d} {row.dtype:>9s} {row.redop:>7s} {row.root:7d} "
            f"{row.time_us:11.2f} {row.algbw_gbps:12.2f} {row.busbw_gbps:12.2f} {wrong:>7s}")


def write_csv(path: str, rows: Sequence[Row]) -> None:
    """Every row, with full precision, under :data:`CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            record = {name: getattr(row, name) for name in CSV_FIELDS}
            record["wrong"] = "" if row.wrong is None else row.wrong
            writer.writerow(record)


def write_plot(path: str, rows: Sequence[Row], metric: str = "busbw", title: str = "") -> None:
    """Bandwidth against size, log axes, one line per collective and implementation.

    Needs matplotlib (``pip install 'smddp[bench]'``). Points with zero bandwidth (a world
    of one has no bus traffic) cannot sit on a log axis and are left out.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'smddp[bench]'") from exc

    # One colour per collective (and dtype, redop when several), one line style per implementation.
    lines: Dict[Tuple[str, str], List[Row]] = {}
    dtypes = {r.dtype for r in rows}
    redops = {r.redop for r in rows if r.op == "all_reduce"}
    for row in rows:
        what = row.op
        if len(dtypes) > 1:
            what += f" {row.dtype}"
        if len(redops) > 1 and row.op == "all_reduce":
            what += f" {row.redop}"
        lines.setdefault((what, row.label), []).append(row)
    colours = {what: f"C{i % 10}" for i, what in enumerate(dict.fromkeys(w for w, _ in lines))}
    styles = {label: ("-", "--", ":", "-.")[i % 4] for i, label in enumerate(dict.fromkeys(lb for _, lb in lines))}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    plotted = 0
    for (what, label), group in lines.items():
        points = [(r.size_bytes, getattr(r, f"{metric}_gbps")) for r in group]
        points = [(x, y) for x, y in points if y > 0]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, color=colours[what], linestyle=styles[label],
                label=f"{what} {label}")
        plotted += 1
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(int(x)) if x >= 1 else ""))
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(f"{metric} (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no {metric} above zero to plot", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Progress:
    """Progress lines on stderr.

    Args:
        total: number of steps.
        mode: ``"auto"`` (at most one line a second, none for a sweep shorter than a
            second), ``"on"`` (every step) or ``"off"``.
    """

    def __init__(self, total: int, mode: str = "auto", stream=None):
        self.total, self.mode = total, mode
        self.stream = stream or sys.stderr
        self.start = self.last = time.monotonic()
        self.done = 0

    def step(self, what: str) -> None:
        self.done += 1
        now = time.monotonic()
        if self.mode == "off":
            return
        if self.mode == "auto" and (now - self.start < 1.0 or (now - self.last < 1.0 and self.done < self.total)):
            return
        self.last = now
        print(f"smddp-bench: [{self.done:>4d}/{self.total}] {what} ({now - self.start:.1f} s)",
              file=self.stream, flush=True)


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The ``smddp-bench`` command line."""
    parser = argparse.ArgumentParser(
        prog="smddp-bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Benchmark smddp's collectives, with nccl-tests' columns and bandwidth conventions.\n"
            "Run it under a launcher: 'mpirun -np 2 smddp-bench ...', 'torchrun --nproc-per-node 2\n"
            "-m smddp.bench ...'; plain 'smddp-bench' runs a world of one. Rank 0 prints a table per\n"
            "collective: size(B) count type redop root time(us) algbw(GB/s) busbw(GB/s) #wrong."
        ),
        epilog=(
            "sizes: bytes of one rank's buffer (all_reduce, broadcast: the tensor; all_gather,\n"
            "  all_to_all: the whole output). Suffixes K, M, G are powers of 1024.\n"
            "timing: warmup calls, a barrier, then ITERS back-to-back blocking calls; time is the\n"
            "  elapsed time / ITERS (device synchronized once at the end), averaged over ranks (-a 1).\n"
            "algbw = size / time; busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather,\n"
            "  all_to_all), 1 (broadcast). GB/s = 1e9 bytes/s.\n"
            "exit status: 0, or 1 when --check found wrong elements or a rank failed."
        ),
    )
    parser.add_argument("--op", default="all_reduce",
                        help="collective(s): all_reduce, broadcast, all_gather, all_to_all, a comma-separated "
                             "list, or all (default: all_reduce)")
    parser.add_argument("-b", "--minbytes", type=_size_arg, default=parse_size("1K"),
                        help="smallest message size (default: 1K)")
    parser.add_argument("-e", "--maxbytes", type=_size_arg, default=parse_size("64M"),
                        help="largest message size (default: 64M)")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0,
                        help="multiply the size by this factor each step (default: 2); 1 steps by --stepbytes")
    parser.add_argument("-i", "--stepbytes", type=_size_arg, default=parse_size("1M"),
                        help="add this many bytes each step when --stepfactor is 1 (default: 1M)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default: 20)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed warm-up iterations per size (default: 5)")
    parser.add_argument("-d", "--dtype", default="float",
                        help="element type: float, half, bfloat16, double, int8, uint8, int32, int64 "
                             "(torch names such as float32 too), a comma-separated list, or all (default: float)")
    parser.add_argument("--redop", default="sum",
                        help="reduction of all_reduce: sum, avg, min, max, a list, or all (default: sum)")
    parser.add_argument("--root", type=int, default=0, help="source rank of broadcast (default: 0)")
    parser.add_argument("--backend", default=None,
                        help="smddp backend, as init_process_group(backend=...): mpi, gloo, nccl, xccl, local, "
                             "... (default: SMDDP_BACKEND, else chosen from the launcher and machine)")
    parser.add_argument("--api", choices=("smddp", "torch"), default="smddp",
                        help="call smddp.torch.distributed functions (smddp, default) or torch.distributed "
                             "functions on the smddp process group (torch, the path DDP and FSDP take)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "xpu"), default="auto",
                        help="where buffers live (default: auto, the device of the backend; CUDA and XPU "
                             "use the device of the local rank)")
    parser.add_argument("-c", "--check", action="store_true",
                        help="verify every result against the value computed locally from all ranks' seeded "
                             "inputs and report the wrong elements per size in #wrong")
    parser.add_argument("--compare", action="append", default=[], metavar="BACKEND",
                        help="also run torch.distributed's BACKEND (e.g. gloo) in the same job, on a group "
                             "made with torch.distributed.new_group(backend=BACKEND); repeatable")
    parser.add_argument("-a", "--average", type=int, choices=sorted(AVERAGE_MODES), default=1,
                        help="time reported across ranks: 0 rank 0, 1 average (default), 2 minimum, 3 maximum")
    parser.add_argument("--csv", metavar="FILE", help="write every row to FILE as CSV (rank 0)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot bandwidth against size, log axes, one line per collective and "
                             "implementation (rank 0; needs matplotlib: pip install 'smddp[bench]')")
    parser.add_argument("--plot-metric", choices=("busbw", "algbw"), default="busbw",
                        help="bandwidth on the plot's y axis (default: busbw)")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress lines on stderr: auto (once a second during sweeps longer than a "
                             "second), on, off")
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        args.ops = _choices(args.op, OPS, "op")
        args.redops = _choices(args.redop, REDOPS, "redop")
        args.dtypes = dtype_names(args.dtype)
        args.sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.root < 0:
        parser.error("--root must be a rank (0 or more)")
    args.compare = list(dict.fromkeys(b.strip().lower() for b in args.compare if b.strip()))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'smddp[bench]'")


def _pick_device(requested: str, backend: str):
    import torch

    from smddp import comm

    kind = requested
    if kind == "auto":
        info = comm.BACKENDS.get(backend)
        kind = info.device if info is not None else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "xpu":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _gather_hosts(rank: int, world_size: int, device) -> List[str]:
    """``Rank  r Pid  p on host device d`` lines, one per rank, gathered to every rank."""
    import torch

    import smddp.torch.distributed as dist

    line = f"Pid {os.getpid():6d} on {socket.gethostname():>12s} device {device}"
    data = line.encode()[:200].ljust(200)
    mine = torch.tensor(list(data), dtype=torch.uint8)
    if world_size == 1:
        return [f"Rank {rank:2d} {line}"]
    outs = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(outs, mine)
    return [f"Rank {r:2d} " + bytes(o.tolist()).decode(errors="replace").rstrip() for r, o in enumerate(outs)]


def _abort(exc: BaseException) -> None:
    """A rank failed: make the whole job stop instead of leaving the others in a collective."""
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    sys.stderr.flush()
    sys.stdout.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``smddp-bench``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)

    import torch

    import smddp
    import smddp.torch.distributed as dist
    from smddp._topology import discover

    topology = discover(os.environ)
    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        # NCCL binds to the current device: pick it before the communicator is made.
        torch.cuda.set_device(topology.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=args.backend)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if args.root >= world_size:
            if rank == 0:
                print(f"smddp-bench: --root {args.root} is not a rank of this job (0..{world_size - 1})",
                      file=sys.stderr)
            return 2
        device = _pick_device(args.device, dist.get_backend())
        impls: List[Impl] = [SmddpImpl() if args.api == "smddp" else
                             TorchImpl(None, "smddp", dist.get_backend())]
        import torch.distributed as tdist

        for backend in args.compare:
            group = tdist.new_group(backend=backend)
            impls.append(TorchImpl(group, f"torch-{backend}", backend, emulate_avg=backend == "gloo"))
        hosts = _gather_hosts(rank, world_size, device)
        out = sys.stdout if rank == 0 else None
        if out:
            step = (f"{args.stepfactor:g}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)")
            print(f"# smddp-bench {smddp.__version__}: nranks {world_size} minBytes {args.minbytes} "
                  f"maxBytes {args.maxbytes} step: {step} warmup iters: {args.warmup} iters: {args.iters} "
                  f"validation: {int(args.check)}", file=out)
            print(f"# launcher: {topology.launcher}  backend: {dist.get_backend()}  api: {args.api}  "
                  f"device: {device.type}  time: {AVERAGE_MODES[args.average]}  torch: {torch.__version__}",
                  file=out)
            print("#\n# Using devices", file=out)
            for host in hosts:
                print(f"#  {host}", file=out)
            out.flush()

        sections = []
        for op in args.ops:
            for impl in impls:
                for dtype_name in args.dtypes:
                    for redop in (args.redops if op == "all_reduce" else ["none"]):
                        sections.append((op, impl, dtype_name, redop))
        progress = Progress(len(sections) * len(args.sizes), args.progress if rank == 0 else "off")
        rows: List[Row] = []
        averages = []
        for op, impl, dtype_name, redop in sections:
            runner = Runner(impl, device, rank, world_size, args.average)
            if out:
                print(f"#\n# Collective: {op}  implementation: {impl.label}  api: {impl.api}  "
                      f"type: {dtype_name}" + (f"  redop: {redop}" if op == "all_reduce" else ""), file=out)
                print("#", file=out)
                print(_HEADER, file=out, flush=True)
            section_rows, seen = [], set()
            for nbytes in args.sizes:
                _, size_bytes = shape(op, nbytes, _torch_dtype(dtype_name).itemsize, world_size)
                if size_bytes in seen:  # rounding made this size equal to an earlier one
                    progress.step(f"{op} {impl.label} {format_size(nbytes)}")
                    continue
                seen.add(size_bytes)
                row = runner.measure(op, nbytes, dtype_name, redop if op == "all_reduce" else "sum",
                                     args.root, args.warmup, args.iters, args.check)
                section_rows.append(row)
                if out:
                    print(format_row(row), file=out, flush=True)
                progress.step(f"{op} {impl.label} {format_size(row.size_bytes)}")
            rows.extend(section_rows)
            avg = sum(r.busbw_gbps for r in section_rows) / max(len(section_rows), 1)
            averages.append((op, impl.label, dtype_name, redop, avg))
            if out and len(sections) > 1:
                print(f"# Avg bus bandwidth    : {avg:.4g} GB/s", file=out, flush=True)

        wrong = sum(r.wrong or 0 for r in rows)
        if out:
            print("#", file=out)
            if args.check:
                print(f"# Wrong values         : {wrong} {'OK' if wrong == 0 else 'FAILED'}", file=out)
            if len(averages) > 1:
                print("# Avg bus bandwidth per collective (GB/s):", file=out)
                for op, label, dtype_name, redop, avg in averages:
                    extra = redop if op == "all_reduce" else ""
                    print(f"#   {op:<11s} {label:<18s} {dtype_name:<9s} {extra:<5s} {avg:10.4g}", file=out)
            overall = sum(r.busbw_gbps for r in rows) / max(len(rows), 1)
            print(f"# Avg bus bandwidth    : {overall:.4g} GB/s", file=out)
            print("#", file=out, flush=True)
            if args.csv:
                write_csv(args.csv, rows)
            if args.plot:
                title = (f"smddp-bench: {world_size} ranks, {', '.join(args.dtypes)}, {device.type}, "
                         f"{socket.gethostname()}")
                write_plot(args.plot, rows, args.plot_metric, title)
        for impl in impls[1:]:
            tdist.destroy_process_group(impl.group)
        dist.barrier()
        return 1 if wrong else 0
    except Exception as exc:  # noqa: BLE001 - one failed rank must not leave the others waiting
        if topology.size > 1:
            _abort(exc)
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
