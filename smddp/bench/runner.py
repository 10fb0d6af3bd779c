"""smddp-bench's runner: buffers, timing, the check, and agreement over ranks for one case."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from smddp.bench.adapters import Impl
from smddp.bench.oracle import CHUNK, check_result, pattern
from smddp.bench.sizes import bus_factor, shape, torch_dtype


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
        """The implementation as tables show it: ``impl(backend)``."""
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
                for first in range(0, numel, CHUNK):
                    length = min(CHUNK, numel - first)
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
        dtype = torch_dtype(dtype_name)
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

