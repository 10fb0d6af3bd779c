"""The check contract of the flat communicators (gloo, MPI): each collective's row, compared on every rank.

A checked collective starts with one exchange whose length is the same on every rank whatever
the call: an all-gather of each rank's *row*, which holds its fingerprint
(:mod:`smddp.comm.mismatch.fingerprint`: kind, dtype, element count, root, reduction op, sequence
number), what must pair up across ranks (an all-to-all's split sizes: what each rank sends to
and expects from every other) and, when they fit, its data. Each rank compares every row with
its own before it uses anything: if the calls differ, every rank raises the same
:class:`~smddp.errors.CollectiveMismatchError` after that one exchange, and the communicator
stays in step. A collective whose data rode in the rows is then done; a larger one puts out its
own operation once the rows agree.

A :class:`CheckedSequence` puts a communicator's checked collectives out in issue order, the same on
every rank: a collective's exchange goes out once the collective before it has put out all of
its own operations, and its own operation once its exchange is in and agrees. (gloo pairs every
operation by that order; MPI pairs collectives by their order on a communicator, so its checked
collectives run on a communicator of their own.)
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, Optional, Sequence

import torch

from smddp.comm.base import Pending
from smddp.comm.mismatch.fingerprint import Print, mismatch_error, unpaired, unpaired_error

#: Bytes of a row before its data: the fingerprint's two int64 words.
HEAD = 16
EMPTY = torch.empty(0, dtype=torch.uint8)

#: ``gather(row, rows)``: start an all-gather of every rank's ``row`` into ``rows`` (one row each).
Gather = Callable[[torch.Tensor, torch.Tensor], Pending]


def split_words(sends: Sequence[int], expects: Sequence[int]) -> torch.Tensor:
    """An all-to-all's row data: what this rank sends to each rank, then what it expects from each."""
    return torch.tensor(list(sends) + list(expects), dtype=torch.int64).view(torch.uint8)


class CheckedSequence:
    """A communicator's checked collectives, put out in issue order.

    Args:
        size: the communicator's size.
        small_bytes: bytes of data a row carries: collectives up to this size take no other exchange.
        gather: all-gathers rows on the communicator (see :data:`Gather`).
        plane: the plane in words, for errors (``"the gloo plane"``).
        kind: the :class:`CheckedCollective` class to make (a communicator's may add ``block``).

    Attributes:
        row_bytes: bytes of every row: :data:`HEAD` and room for the data, or for an all-to-all's
            split sizes (two int64 per rank), whichever is larger. The same on every rank.
    """

    def __init__(self, size: int, small_bytes: int, gather: Gather, plane: str, kind: Optional[type] = None):
        self.size = size
        self.small_bytes = small_bytes
        self.row_bytes = HEAD + max(small_bytes, 16 * size)
        self.plane = plane
        self._gather = gather
        self._kind = kind or CheckedCollective
        self._issuing: Deque[CheckedCollective] = collections.deque()  # collectives not yet wholly put out
        self._lock = threading.Lock()

    def start(self, fp: Optional[Print], data: torch.Tensor = EMPTY, small=None, large=None,
              paired: bool = False) -> CheckedCollective:
        """Start a checked collective (in issue order).

        Args:
            fp: this rank's fingerprint; None: no exchange, ``large`` goes out at once (in order).
            data: this rank's bytes that travel in its row (uint8, at most ``row_bytes - HEAD``).
            small: finishes the collective once the rows are in and agree: ``small(rows)``, with
                ``rows`` every rank's data bytes, one row each; or None.
            large: starts the collective's own operation once the rows agree (when ``small`` is None).
            paired: ``data`` is :func:`split_words`: raise on every rank unless every rank's sends
                are what their receivers expect.
        """
        return self._kind(self, fp, data, small, large, paired)

    def _issue(self, op: CheckedCollective) -> None:
        with self._lock:
            self._issuing.append(op)
            if len(self._issuing) == 1:
                op._exchange()
                self._put_out()

    def pump(self) -> None:
        """Put out the waiting collectives' operations, in issue order, as far as their exchanges allow."""
        with self._lock:
            self._put_out()

    def _put_out(self) -> None:
        issuing = self._issuing
        while issuing:
            op = issuing[0]
            try:
                if not op._exchanged():
                    return
            except Exception as exc:  # noqa: BLE001 - a mismatch, or the library's error: that collective's
                op.failed(exc)
            issuing.popleft()
            if issuing:
                issuing[0]._exchange()


class CheckedCollective(Pending):
    """One checked collective (see the module's docstring and :meth:`CheckedSequence.start`)."""

    __slots__ = ("_checker", "_fp", "_data", "_rows", "_first", "_small", "_large", "_paired", "_second",
                 "_done", "_error")

    def __init__(self, checker: CheckedSequence, fp: Optional[Print], data: torch.Tensor, small, large, paired: bool):
        self._checker, self._fp, self._data, self._small, self._large = checker, fp, data, small, large
        self._paired = paired
        self._rows: Optional[torch.Tensor] = None
        self._first: Optional[Pending] = None
        self._second: Optional[Pending] = None
        self._done = False
        self._error: Optional[BaseException] = None
        checker._issue(self)

    def _exchange(self) -> None:
        """Put out this collective's exchange (or, without a fingerprint, its operation)."""
        checker = self._checker
        if self._fp is None:
            self._second = self._large()
            return
        row = torch.zeros(checker.row_bytes, dtype=torch.uint8)
        row[:HEAD].view(torch.int64).copy_(torch.tensor(self._fp, dtype=torch.int64))
        row[HEAD:HEAD + self._data.numel()].copy_(self._data)
        self._rows = torch.empty(checker.size * checker.row_bytes, dtype=torch.uint8)
        self._first = checker._gather(row, self._rows)
        self._data = None

    def _exchanged(self) -> bool:
        """Once the rows are in: compare them; finish a small collective, start a large one's
        operation. False while they are not in."""
        if self._first is None:  # no exchange: the operation is out
            return True
        if not self._first.test():
            return False
        checker = self._checker
        rows = self._rows.view(checker.size, checker.row_bytes)
        self._rows = None
        prints = [tuple(p) for p in rows[:, :HEAD].contiguous().view(torch.int64).tolist()]
        if any(p != self._fp for p in prints):
            raise mismatch_error(prints, range(checker.size), checker.plane)
        if self._paired:
            words = rows[:, HEAD:HEAD + 16 * checker.size].contiguous().view(torch.int64)
            pairs = unpaired(words[:, :checker.size].tolist(), words[:, checker.size:].tolist())
            if pairs:
                raise unpaired_error(pairs, range(checker.size), checker.plane, self._fp[1] >> 32)
        if self._small is not None:
            self._small(rows[:, HEAD:])
            self._done = True
        else:
            self._second = self._large()
        return True

    def test(self) -> bool:
        if not self._done and self._second is None and self._error is None:
            self._checker.pump()
        if self._error is not None:
            raise self._error
        if self._second is not None and not self._done:
            self._done = self._second.test()
        return self._done

    def failed(self, error: BaseException) -> None:
        """Its exchange failed (the ranks' calls differ, or the library's error): testing it raises ``error``."""
        self._error = error

    def current(self) -> Optional[Pending]:
        """The library operation this collective waits on now (its exchange's, then its own), if any."""
        return self._second or self._first


def rows_of(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first ``like.numel()`` elements of each of ``rows`` (uint8), as ``like``'s dtype."""
    return rows[:, :like.numel() * like.element_size()].contiguous().view(like.dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat contiguous ``tensor``'s memory as uint8 (a view)."""
    return tensor.view(-1).view(torch.uint8)
