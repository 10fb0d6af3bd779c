"""smddp-bench's expected values: seeded per-rank inputs and each rank's result, computed locally."""

from __future__ import annotations

from typing import Optional

#: Elements checked (and filled with the pattern) at a time, so --check works on large buffers.
CHUNK = 1 << 22


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

    from smddp.comm.reduction import average

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
    if floating:  # divided at full precision, rounded once into the dtype
        average(acc, n)
        return acc.to(dtype)
    # Integer AVERAGE: the sum wraps in the dtype, then divides rounding toward zero.
    acc = acc.to(dtype)
    average(acc, n)
    return acc


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
    chunk = chunk or CHUNK
    wrong = 0
    for start in range(0, flat.numel(), chunk):
        length = min(chunk, flat.numel() - start)
        want = expected(op, rank, world_size, count, dtype, redop, root, start, length)
        wrong += count_wrong(flat[start:start + length], want, world_size)
    return wrong

