"""``SMDDP_DEBUG=1``: before each collective, the ranks check that they all called the same one.

Each rank encodes what it is about to run -- operation, reduction op, dtype, shape, root
rank, sequence number -- as a fixed-size row of integers (a fingerprint), and the ranks
all-gather their rows over the collective's own communicator. If the rows differ, every
rank raises the same :class:`~smddp.errors.CollectiveMismatchError`, naming the ranks and
the values that differ, and the collective is not run (so the job can go on). An
``all_to_all_single`` also exchanges its split sizes, checking that what rank ``i`` sends
to rank ``j`` is what ``j`` expects from ``i``.

It costs one small all-gather per collective, so it is off by default; when off, the
engine holds ``None`` instead of a :class:`DebugComparison` and pays one ``is None`` test. The rows
and their description are :mod:`smddp.comm.mismatch.fingerprint`'s, shared with the shared-memory
plane, which compares a fingerprint of every collective whatever this setting.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence, Tuple

import torch

from smddp import knobs
from smddp.comm.base import Communicator
from smddp.comm.mismatch.fingerprint import (
    COMPARED,
    LABEL,
    SEQ,
    WIDTH,
    describe,
    differing,
    explain,
    fingerprint,
    ranks_text,
)
from smddp.comm.reduction import Op
from smddp.comm.waiting import poll
from smddp.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from smddp.comm.engine import Engine

ENV = "SMDDP_DEBUG"
__all__ = ["ENV", "WIDTH", "DebugComparison", "enabled", "explain", "fingerprint"]


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """True when ``SMDDP_DEBUG`` asks for the checks (any value but empty, 0, false, no, off)."""
    return knobs.value(ENV, env)


class DebugComparison:
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
              tensor: Optional[torch.Tensor] = None, src: Optional[int] = None, label: Optional[str] = None,
              splits: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> None:
        """Compare this call with every other rank's; return if they all match.

        Raises:
            CollectiveMismatchError: the ranks called different collectives (every rank
                raises it, with the same message).
            CollectiveTimeout: some rank did not arrive within the timeout.
        """
        mine = fingerprint(seq, kind, op, tensor, src, self._label_code(label), rows=splits is not None)
        rows = self._gather(mine, seq, op_name)
        compared = rows[:, COMPARED]
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
            raise self.engine.stalled(seq, f"{op_name} (the SMDDP_DEBUG check before it)")
        return out.view(self.size, -1).cpu()

    def _label_code(self, label: Optional[str]) -> int:
        labels = self.engine.labels
        return labels.index(label) + 1 if label in labels else 0

    def _where(self) -> str:
        engine = self.engine
        if engine.global_ranks is None:
            return ""
        return f"in process group {engine.group_name!r} (global ranks {ranks_text(engine.global_ranks)}) "

    def _mismatch(self, rows: torch.Tensor, seq: int) -> str:
        # Ranks are named as the job knows them: a subgroup's engine maps its ranks to global ones.
        table = rows.tolist()
        text = (
            f"SMDDP_DEBUG: the ranks called different collectives at sequence {seq} {self._where()}"
            f"{describe(table, [self.engine.global_rank(r) for r in range(self.size)], self.engine.labels)} "
            f"The collective was not run."
        )
        labels = self.engine.labels
        advice = [self.engine.advice[labels[row[LABEL] - 1]] for row in table if 0 < row[LABEL] <= len(labels)]
        if advice:
            text += " " + " ".join(dict.fromkeys(advice))
        elif SEQ in differing(table):
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
