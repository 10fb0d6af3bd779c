"""A collective call's fingerprint, and a mismatch between ranks' fingerprints in words.

A fingerprint is a fixed-size row of integers -- operation, reduction op, dtype, shape or
element count, root rank, sequence number -- that ranks compare before they use each
other's data; an all-to-all's split sizes, which differ from rank to rank, are compared by
whether they pair up (:func:`unpaired`). Three places compare them: ``SMDDP_DEBUG=1`` before every collective
(:mod:`smddp.comm.engine.debug`, which all-gathers the rows), the shared-memory plane on
every collective, from fingerprints that each rank writes next to its epoch word
(:mod:`smddp.comm.planes.shm`), and the flat communicators (gloo; MPI's all-to-all and the
hierarchical plane's all-reduces), whose collectives start with an exchange that carries them
(:mod:`smddp.comm.mismatch.checked`). The planes pack a fingerprint
into two integers (:func:`signature`, :data:`Print`); all describe a difference with
:func:`describe`.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from smddp.comm.reduction import Op
from smddp.errors import CollectiveMismatchError

KINDS = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "barrier", "reduce_scatter")
#: Codes of reductions: :class:`~smddp.comm.reduction.Op`'s order (the bitwise ones after the five of
#: numbers), also the shared-memory core's op codes (``R_*`` in ``_shm_fold.h``).
OPS = tuple(Op)
#: Codes of dtypes; the first ten (bool the last) are also the shared-memory core's dtype codes.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)

#: A fingerprint as the planes carry it: (element count, or -1 where none is compared; :func:`signature`).
Print = Tuple[int, int]

_DTYPE_CODES = {dtype: i for i, dtype in enumerate(DTYPES)}

MAGIC_VALUE = 0x534D44445044  # "SMDDPD"
_MAX_DIMS = 7
# Row layout. NDIM is -1 where only the element count is known (the shared-memory plane).
MAGIC, SEQ, KIND, OP, DTYPE, SRC, LABEL, NDIM, NUMEL, DIMS = range(10)
WIDTH = DIMS + _MAX_DIMS
_FIELD_NAMES = {MAGIC: "SMDDP_DEBUG setting", SEQ: "sequence number", KIND: "operation",
                OP: "reduction op", DTYPE: "dtype", SRC: "source rank", NDIM: "shape", NUMEL: "shape"}
# The caller's label (the engine's ``labels``: 1 + its index there, 0 for none) is reported,
# never compared: matching calls may carry different labels (a label says where the caller
# started it, and one rank may stand in for another's call from elsewhere).
COMPARED = [i for i in range(WIDTH) if i != LABEL]


def code(table: Sequence, value) -> int:
    """``value``'s index in ``table``; ``len(table)`` if it is not there."""
    try:
        return table.index(value)
    except ValueError:
        return len(table)


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s code: its index in :data:`DTYPES`, ``len(DTYPES)`` for any other."""
    return _DTYPE_CODES.get(dtype, len(DTYPES))


def fingerprint(seq: int, kind: str, op: Optional[Op], tensor: Optional[torch.Tensor],
                src: Optional[int] = None, label: int = 0, rows: bool = False) -> List[int]:
    """The row of integers that describes one collective call.

    Args:
        seq: its sequence number.
        kind: one of :data:`KINDS`.
        op: the reduction, if any.
        tensor: the tensor whose dtype and shape must match across ranks, if any.
        src: the root rank, if any.
        label: the code of the caller's label (reported, not compared; see :data:`LABEL`).
        rows: compare only the shape of one row (dim 0 may differ across ranks).
    """
    row = [MAGIC_VALUE, seq, code(KINDS, kind), -1 if op is None else code(OPS, op), -1, -1 if src is None else src,
           label, -1, -1] + [-1] * _MAX_DIMS
    if tensor is not None:
        shape = list(tensor.shape[1:] if rows else tensor.shape)
        row[DTYPE] = dtype_code(tensor.dtype)
        row[NDIM] = len(shape)
        row[NUMEL] = int(torch.Size(shape).numel())
        if len(shape) > _MAX_DIMS:
            shape = shape[:_MAX_DIMS - 1] + [hash(tuple(shape[_MAX_DIMS - 1:])) & 0x7FFFFFFFFFFF]
        row[DIMS:DIMS + len(shape)] = shape
    return row


def counted(seq: int, kind: int, op: int, dtype: int, src: int, numel: int) -> List[int]:
    """A row from codes, with an element count instead of a shape (-1: a field the call has not)."""
    return [MAGIC_VALUE, seq, kind, op, dtype, src, 0, -1, numel] + [-1] * _MAX_DIMS


def explain(row: Sequence[int], labels: Sequence[str] = ()) -> str:
    """A fingerprint row in words: ``all_reduce(op=sum, dtype=float32, shape=(4, 2))``.

    ``labels``: the engine's labels, by which a row's :data:`LABEL` code is named.
    """
    if row[MAGIC] != MAGIC_VALUE:
        return "not a smddp collective (is SMDDP_DEBUG=1 set on every rank?)"
    kind = KINDS[row[KIND]] if 0 <= row[KIND] < len(KINDS) else "unknown"
    args = []
    if row[OP] >= 0:
        args.append(f"op={OPS[row[OP]].name if row[OP] < len(OPS) else '?'}")
    if row[SRC] >= 0:
        args.append(f"src={row[SRC]}")
    if row[DTYPE] >= 0:
        args.append(f"dtype={str(DTYPES[row[DTYPE]]).replace('torch.', '') if row[DTYPE] < len(DTYPES) else '?'}")
    if row[NDIM] >= 0:
        dims = [str(d) for d in row[DIMS:DIMS + min(row[NDIM], _MAX_DIMS)]]
        if row[NDIM] > _MAX_DIMS:
            dims[-1] = "..."
        shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        args.append(f"rows of shape {shape}" if kind == "all_to_all_single" else f"shape={shape}")
    elif row[NUMEL] >= 0:
        args.append(f"numel={row[NUMEL]}")
    text = f"{kind}({', '.join(args)}) as sequence {row[SEQ]}"
    if row[LABEL] > 0:
        text += f" ({labels[row[LABEL] - 1] if row[LABEL] <= len(labels) else 'a labelled call'})"
    return text


def differing(rows: Sequence[Sequence[int]]) -> List[int]:
    """The compared fields (row indices) in which some rank's row differs from the first rank's."""
    return [i for i in COMPARED if any(row[i] != rows[0][i] for row in rows)]


def describe(rows: Sequence[Sequence[int]], names: Sequence[int], labels: Sequence[str] = ()) -> str:
    """How the ranks' rows differ: ``(they differ in dtype): rank 0: ...; rank 1: .... Ranks
    that differ from rank 0: 1.``

    Args:
        rows: each rank's fingerprint, in rank order.
        names: the rank each row is named by in the text (global ranks, for a subgroup).
        labels: the engine's labels, by which the rows' :data:`LABEL` codes are named.
    """

    groups: Dict[Tuple[int, ...], List[int]] = {}
    for row, name in zip(rows, names):
        groups.setdefault(tuple(row), []).append(name)
    reference = tuple(rows[0])
    odd = sorted(r for key, ranks in groups.items() if key != reference for r in ranks)
    counted_only = all(row[NDIM] < 0 for row in rows)
    fields = sorted({"element count" if i == NUMEL and counted_only else _FIELD_NAMES.get(i, "shape")
                     for i in differing(rows)})
    calls = "; ".join(f"rank {ranks_text(ranks)}: {explain(key, labels)}" for key, ranks in groups.items())
    return (f"(they differ in {', '.join(fields)}): {calls}. "
            f"Ranks that differ from rank {names[0]}: {ranks_text(odd)}.")


def signature(seq: int, kind: str, dtype: Optional[torch.dtype] = None, op: Optional[Op] = None,
              root: int = -1) -> int:
    """The second word of a plane's fingerprint, packed as the shared-memory core's ``FP_SIG``.

    Args:
        seq: the collective's sequence number (its low 31 bits are kept).
        kind: one of :data:`KINDS`.
        dtype: the data's dtype, if it is compared.
        op: the reduction, if any.
        root: the root rank, if any.
    """
    dtype_number = -1 if dtype is None else dtype_code(dtype)
    op_code = -1 if op is None else code(OPS, op)
    return ((seq & 0x7FFFFFFF) << 32) | (code(KINDS, kind) << 24) | ((dtype_number + 1) << 16) | (
        (op_code + 1) << 8) | (root + 1)


def mismatch_error(prints: Sequence[Print], names: Sequence[int], plane: str, group: str = "world"
                   ) -> CollectiveMismatchError:
    """The error every rank of a plane raises when its ranks' fingerprints of one collective differ.

    Args:
        prints: every rank's fingerprint, in the plane's rank order.
        names: the group rank of each of the plane's ranks.
        plane: the plane, in words (``"the shared-memory plane"``).
        group: the group's name.
    """
    rows = [counted(sig >> 32, (sig >> 24) & 0xFF, ((sig >> 8) & 0xFF) - 1, ((sig >> 16) & 0xFF) - 1,
                    (sig & 0xFF) - 1, count) for count, sig in prints]
    where = "" if group == "world" else f"in group {group!r} "
    text = (f"the ranks called different collectives at sequence {rows[0][SEQ]} {where}on {plane} "
            f"{describe(rows, list(names))} The collective was not run on any rank, and the plane stays "
            f"in step: later collectives run.")
    if SEQ in differing(rows):
        text += " Different sequence numbers mean some ranks ran collectives the others did not."
    return CollectiveMismatchError(text)


def unpaired(sends: Sequence[Sequence[int]], expects: Sequence[Sequence[int]]) -> List[Tuple[int, int, int, int]]:
    """The pairs of ranks whose all-to-all split sizes disagree.

    Args:
        sends: ``sends[r][q]``: what rank r sends to rank q.
        expects: ``expects[q][r]``: what rank q expects from rank r.

    Returns:
        ``(r, q, sent, expected)`` for every r and q where ``sends[r][q] != expects[q][r]``, in
        rank order; empty when every part pairs up.
    """
    n = len(sends)
    return [(r, q, sends[r][q], expects[q][r]) for r in range(n) for q in range(n) if sends[r][q] != expects[q][r]]


def unpaired_error(pairs: Sequence[Tuple[int, int, int, int]], names: Sequence[int], plane: str, seq: int,
                   group: str = "world", unit: str = "elements") -> CollectiveMismatchError:
    """The error every rank raises when an all-to-all's split sizes do not pair up.

    Args:
        pairs: :func:`unpaired`'s list (plane ranks).
        names: the group rank of each of the plane's ranks.
        plane: the plane, in words (``"the gloo plane"``).
        seq: the collective's sequence number.
        group: the group's name.
        unit: what the sizes count.
    """
    where = "" if group == "world" else f" in group {group!r}"
    shown = "; ".join(f"rank {names[r]} sends {sent} {unit} to rank {names[q]}, which expects {expected}"
                      for r, q, sent, expected in pairs[:4])
    more = f" (and {len(pairs) - 4} more pairs)" if len(pairs) > 4 else ""
    return CollectiveMismatchError(
        f"the ranks' all_to_all_single split sizes do not pair up at sequence {seq}{where} on {plane}: "
        f"{shown}{more}. Each rank's input_split_sizes[q] must equal rank q's output_split_sizes for it. "
        f"The collective was not run on any rank, and the plane stays in step: later collectives run.")


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: List[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)
