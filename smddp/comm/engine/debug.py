"""``SMDDP_DEBUG=1``: before each collective, the ranks check that they all called the same one.

Each rank encodes what it is about to run -- operation, reduction op, dtype, shape, root
rank, sequence number -- as a fixed-size row of integers (a fingerprint), and the ranks
all-gather their rows over the collective's own communicator. If the rows differ, every
rank raises the same :class:`~smddp.errors.CollectiveMismatchError`, naming the ranks and
the values that differ, and the collective is not run (so the job can go on). An
``all_to_all_single`` also exchanges its split sizes, checking that what rank ``i`` sends
to rank ``j`` is what ``j`` expects from ``i``.

It costs one small all-gather per collective, so it is off by default; when off, the
engine holds ``None`` instead of a :class:`Checker` and pays one ``is None`` test.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from smddp.comm.base import Communicator, Op
from smddp.comm.engine.handle import poll
from smddp.comm.engine.stall import UNEVEN_BATCHES_HINT, ranks_text
from smddp.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from smddp.comm.engine import Engine

ENV = "SMDDP_DEBUG"

KINDS = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "barrier", "reduce_scatter")
_OPS = tuple(Op)
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)

_MAGIC = 0x534D44445044  # "SMDDPD"
_MAX_DIMS = 7
# Row layout.
MAGIC, SEQ, KIND, OP, DTYPE, SRC, BACKWARD, NDIM, NUMEL, DIMS = range(10)
WIDTH = DIMS + _MAX_DIMS
_FIELD_NAMES = {MAGIC: "SMDDP_DEBUG setting", SEQ: "sequence number", KIND: "operation",
                OP: "reduction op", DTYPE: "dtype", SRC: "source rank", NDIM: "shape", NUMEL: "shape"}
# Where a collective was started (during backward or not) is reported, never compared:
# torch's Join shadows DDP's backward all-reduces from outside backward.
_COMPARED = [i for i in range(WIDTH) if i != BACKWARD]


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """True when ``SMDDP_DEBUG`` asks for the checks (any value but empty, 0, false, no, off)."""
    return env.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _code(table: Sequence, value) -> int:
    try:
        return table.index(value)
    except ValueError:
        return len(table)


def fingerprint(seq: int, kind: str, op: Optional[Op], tensor: Optional[torch.Tensor],
                src: Optional[int] = None, backward: bool = False, rows: bool = False) -> List[int]:
    """The row of integers that describes one collective call.

    Args:
        seq: its sequence number.
        kind: one of :data:`KINDS`.
        op: the reduction, if any.
        tensor: the tensor whose dtype and shape must match across ranks, if any.
        src: the root rank, if any.
        backward: started during backward (reported, not compared).
        rows: compare only the shape of one row (dim 0 may differ across ranks).
    """
    row = [_MAGIC, seq, _code(KINDS, kind), -1 if op is None else _code(_OPS, op), -1, -1 if src is None else src,
           int(backward), -1, -1] + [-1] * _MAX_DIMS
    if tensor is not None:
        shape = list(tensor.shape[1:] if rows else tensor.shape)
        row[DTYPE] = _code(_DTYPES, tensor.dtype)
        row[NDIM] = len(shape)
        row[NUMEL] = int(torch.Size(shape).numel())
        if len(shape) > _MAX_DIMS:
            shape = shape[:_MAX_DIMS - 1] + [hash(tuple(shape[_MAX_DIMS - 1:])) & 0x7FFFFFFFFFFF]
        row[DIMS:DIMS + len(shape)] = shape
    return row


def explain(row: Sequence[int]) -> str:
    """A fingerprint row in words: ``all_reduce(op=sum, dtype=float32, shape=(4, 2))``."""
    if row[MAGIC] != _MAGIC:
        return "not a smddp collective (is SMDDP_DEBUG=1 set on every rank?)"
    kind = KINDS[row[KIND]] if 0 <= row[KIND] < len(KINDS) else "unknown"
    args = []
    if row[OP] >= 0:
        args.append(f"op={_OPS[row[OP]].name if row[OP] < len(_OPS) else '?'}")
    if row[SRC] >= 0:
        args.append(f"src={row[SRC]}")
    if row[DTYPE] >= 0:
        args.append(f"dtype={str(_DTYPES[row[DTYPE]]).replace('torch.', '') if row[DTYPE] < len(_DTYPES) else '?'}")
    if row[NDIM] >= 0:
        dims = [str(d) for d in row[DIMS:DIMS + min(row[NDIM], _MAX_DIMS)]]
        if row[NDIM] > _MAX_DIMS:
            dims[-1] = "..."
        shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        args.append(f"rows of shape {shape}" if kind == "all_to_all_single" else f"shape={shape}")
    text = f"{kind}({', '.join(args)}) as sequence {row[SEQ]}"
    if row[BACKWARD]:
        text += ", during backward (DDP's gradient all-reduce)"
    return text


class Checker:
    """Runs the ``SMDDP_DEBUG`` comparison for one engine.

    Args:
        engine: the engine whose collectives are checked.
        comm: the communicator that carries the fingerprints (a CPU one where there is).
    """

    def __init__(self, engine: Engine, comm: Communicator):
        self.engine = engine
        self.comm = comm
        self.size = engine.size
        self.device = torch.device("cpu") if "cpu" in comm.device_types else torch.device(comm.device_types[0])

    def check(self, seq: int, op_name: str, kind: str, op: Optional[Op] = None,
              tensor: Optional[torch.Tensor] = None, src: Optional[int] = None, backward: bool = False,
              splits: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> None:
        """Compare this call with every other rank's; return if they all match.

        Raises:
            CollectiveMismatchError: the ranks called different collectives (every rank
                raises it, with the same message).
            CollectiveTimeout: some rank did not arrive within the timeout.
        """
        mine = fingerprint(seq, kind, op, tensor, src, backward, rows=splits is not None)
        rows = self._gather(mine, seq, op_name)
        compared = rows[:, _COMPARED]
        if not bool((compared == compared[0]).all()):
            raise CollectiveMismatchError(self._mismatch(rows, seq))
        if splits is not None:
            sent, expected = splits
            counts = self._gather(list(sent) + list(expected), seq, op_name)
            problems = self._split_problems(counts, tensor)
            if problems:
                raise CollectiveMismatchError(
                    f"SMDDP_DEBUG: all_to_all_single split sizes do not match across ranks at sequence {seq}: "
                    + "; ".join(problems) + ". The collective was not run."
                )

    def _gather(self, values: List[int], seq: int, op_name: str) -> torch.Tensor:
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        pending = self.comm.all_gather(out, mine, seq)
        if not poll(pending.test, time.monotonic() + self.engine.timeout):
            raise self.engine._stalled(seq, f"{op_name} (the SMDDP_DEBUG check before it)")
        return out.view(self.size, -1).cpu()

    def _where(self) -> str:
        engine = self.engine
        if engine.global_ranks is None:
            return ""
        return f"in process group {engine.group_name!r} (global ranks {ranks_text(engine.global_ranks)}) "

    def _mismatch(self, rows: torch.Tensor, seq: int) -> str:
        # Ranks are named as the job knows them: a subgroup's engine maps its ranks to global ones.
        groups: Dict[Tuple[int, ...], List[int]] = {}
        for rank in range(self.size):
            groups.setdefault(tuple(rows[rank].tolist()), []).append(self.engine.global_rank(rank))
        reference = tuple(rows[0].tolist())
        odd = sorted(r for key, ranks in groups.items() if key != reference for r in ranks)
        fields = sorted({
            _FIELD_NAMES.get(i, "shape") for key in groups for i in _COMPARED if key[i] != reference[i]
        })
        calls = "; ".join(f"rank {ranks_text(ranks)}: {explain(key)}" for key, ranks in groups.items())
        text = (
            f"SMDDP_DEBUG: the ranks called different collectives at sequence {seq} "
            f"{self._where()}(they differ in {', '.join(fields)}): {calls}. Ranks that differ from rank "
            f"{self.engine.global_rank(0)}: {ranks_text(odd)}. "
            f"The collective was not run."
        )
        if any(key[BACKWARD] for key in groups):
            text += " " + UNEVEN_BATCHES_HINT
        elif SEQ in [i for key in groups for i in _COMPARED if key[i] != reference[i]]:
            text += (" Different sequence numbers mean some ranks ran collectives the others did not "
                     "(or SMDDP_DEBUG is not set on every rank).")
        return text

    def _split_problems(self, counts: torch.Tensor, tensor: Optional[torch.Tensor]) -> List[str]:
        n = self.size
        row = 1
        if tensor is not None and tensor.dim() > 1:
            row = max(1, int(torch.Size(tensor.shape[1:]).numel()))
        unit = "rows" if row > 1 else "elements"
        problems = []
        for i in range(n):
            for j in range(n):
                sends, expects = int(counts[i, j]), int(counts[j, n + i])
                if sends != expects:
                    problems.append(
                        f"rank {i} sends {sends // row} {unit} to rank {j}, which expects {expects // row} from it"
                    )
        return problems[:10] + ([f"and {len(problems) - 10} more"] if len(problems) > 10 else [])
