"""smddp-bench's arguments: sizes, sweeps, case shapes, bus factors, dtype and choice lists."""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

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


def choices(spec: str, valid: Sequence[str], what: str) -> List[str]:
    """The names of ``--op`` or ``--redop``: one, a comma-separated list, or ``all`` (in order, once each).

    Args:
        spec: what the user wrote.
        valid: the accepted names, in the order ``all`` expands to.
        what: the option's noun, for the error.

    Raises:
        ValueError: an unknown name (the valid ones are listed).
    """
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


def torch_dtype(shown: str):
    """The torch dtype of a name :func:`dtype_names` returns (``"half"`` -> ``torch.float16``)."""
    import torch

    return getattr(torch, _DTYPES[shown][0])

