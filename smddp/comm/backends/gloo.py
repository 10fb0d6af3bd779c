"""The ``gloo`` backend: torch's own gloo process group on CPU tensors.

The default under torchrun, or where mpi4py is missing. Each call starts a gloo
operation (gloo runs it on its own threads) and completes through its Work.

reduce_scatter stays the engine's derived one (all_to_all_single, then a local reduction):
torch's gloo ``_reduce_scatter_base`` stalled on 2 ranks under mpirun (torch 2.13).

Every collective starts with one exchange of the same length on every rank whatever the
call: an all-gather of each rank's row, its fingerprint (:mod:`smddp.comm.fingerprint`:
kind, dtype, element count, root, reduction op, sequence number) and up to
:data:`SMALL_BYTES` of its data. gloo aborts the process (``gloo::EnforceNotMet`` in its own
thread, SIGABRT) when ranks post messages of different lengths, so the fingerprints must
travel before data of a length that may differ. Each rank compares every row's fingerprint
with its own: if they differ, every rank raises the same
:class:`~smddp.errors.CollectiveMismatchError` after that one exchange, and the plane stays
in step. A collective whose data fit in the row is then done (an all-reduce folds the rows
in rank order, half types in float32: the same bits on every rank); a larger one runs
gloo's own collective next, unless :attr:`GlooCommunicator.check_large` is off (the
hierarchical plane's exchange between hosts, where a check may not add a round trip): then
it goes out at once, unchecked. all_to_all_single's counts differ from rank to rank: its
fingerprint has the dtype, not the counts, and gloo may still abort on counts that do not
pair up (``SMDDP_DEBUG=1`` checks them first).
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta
from typing import Deque, Optional, Sequence

import torch
import torch.distributed as tdist

from smddp.comm.backends.gloo_group import gloo_group
from smddp.comm.base import Communicator, Context, Op, Pending, average, reduce_rows, widened
from smddp.comm.fingerprint import Print, mismatch_error, signature
from smddp.errors import BackendUnavailableError

#: Bytes of data that travel in the fingerprint exchange: collectives up to this size take no
#: other exchange.
SMALL_BYTES = 4096
_HEAD = 16  # bytes of a row before its data: the fingerprint's two int64 words
_ROW = _HEAD + SMALL_BYTES
_NOTHING = torch.empty(0, dtype=torch.uint8)

_GLOO_OPS = {
    Op.SUM: tdist.ReduceOp.SUM,
    Op.AVERAGE: tdist.ReduceOp.SUM,
    Op.MIN: tdist.ReduceOp.MIN,
    Op.MAX: tdist.ReduceOp.MAX,
    Op.PRODUCT: tdist.ReduceOp.PRODUCT,
}


class _Work(Pending):
    """A gloo Work, then what must follow it on this rank (divide, copy back)."""

    __slots__ = ("_work", "_after", "_finished")

    def __init__(self, work, after=None):
        self._work, self._after = work, after
        self._finished: Optional[threading.Event] = None

    def block(self, seconds: float) -> None:
        """Sleep until gloo's thread completes the work or ``seconds`` pass."""
        # Read once: the progress thread's test() may clear self._work meanwhile.
        work = self._work
        if work is None:
            return
        finished = self._finished
        if finished is None:
            finished = self._finished = threading.Event()
            work.get_future().add_done_callback(lambda _: finished.set())
        finished.wait(seconds)

    def test(self) -> bool:
        if self._work is not None:
            if not self._work.is_completed():
                return False
            self._work.wait()  # raises the error of a failed operation
            self._work = None
            if self._after is not None:
                self._after()
        return True


class _Checked(Pending):
    """A collective that starts with the fingerprint exchange (see the module's docstring).

    The communicator issues the collectives' gloo operations in issue order, the same on
    every rank (gloo pairs them by that order): a collective's exchange goes out once the
    collective before it has put out all of its own, and a larger collective's own
    operation goes out once its exchange is in and agrees (:meth:`GlooCommunicator._pump`).

    Args:
        comm: the communicator.
        fp: this rank's fingerprint; None: no exchange, ``large`` goes out at once (in order).
        data: this rank's bytes that travel in its row (empty if none, or too large).
        small: the collective is complete once the rows are in: ``small(rows)`` finishes it
            (``rows``: every rank's data bytes, one row each), or None.
        large: starts the collective's own gloo operation once the fingerprints agree (when
            ``small`` is None).
    """

    __slots__ = ("_comm", "_fp", "_data", "_rows", "_first", "_small", "_large", "_second", "_done", "_error")

    def __init__(self, comm: GlooCommunicator, fp: Optional[Print], data: torch.Tensor, small, large=None):
        self._comm, self._fp, self._data, self._small, self._large = comm, fp, data, small, large
        self._rows: Optional[torch.Tensor] = None
        self._first: Optional[_Work] = None
        self._second: Optional[Pending] = None
        self._done = False
        self._error: Optional[BaseException] = None
        comm._issue(self)

    def _exchange(self) -> None:
        """Put out this collective's exchange (or, without a fingerprint, its operation)."""
        comm = self._comm
        if self._fp is None:
            self._second = self._large()
            return
        row = torch.zeros(_ROW, dtype=torch.uint8)
        row[:_HEAD].view(torch.int64).copy_(torch.tensor(self._fp, dtype=torch.int64))
        row[_HEAD:_HEAD + self._data.numel()].copy_(self._data)
        self._rows = torch.empty(comm.size * _ROW, dtype=torch.uint8)
        self._first = _Work(comm.pg.allgather([list(self._rows.chunk(comm.size))], [row]))
        self._data = None

    def _exchanged(self) -> bool:
        """Once the rows are in: compare them; finish a small collective, start a large one's
        operation. False while they are not in."""
        if self._first is None:  # no exchange: the operation is out
            return True
        if not self._first.test():
            return False
        rows = self._rows.view(self._comm.size, _ROW)
        prints = [tuple(p) for p in rows[:, :_HEAD].contiguous().view(torch.int64).tolist()]
        if any(p != self._fp for p in prints):
            raise mismatch_error(prints, range(self._comm.size), "the gloo plane")
        if self._small is not None:
            self._small(rows[:, _HEAD:])
            self._done = True
        else:
            self._second = self._large()
        self._rows = None
        return True

    def block(self, seconds: float) -> None:
        """Sleep until gloo's thread completes the current exchange or ``seconds`` pass."""
        current = self._second or self._first
        if current is not None:
            current.block(seconds)

    def test(self) -> bool:
        if not self._done and self._second is None and self._error is None:
            self._comm._pump()
        if self._error is not None:
            raise self._error
        if self._second is not None and not self._done:
            self._done = self._second.test()
        return self._done


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat contiguous ``tensor``'s memory as uint8 (a view)."""
    return tensor.view(-1).view(torch.uint8)


def _typed(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first ``like.numel()`` elements of each of ``rows`` (uint8), as ``like``'s dtype."""
    return rows[:, :like.numel() * like.element_size()].contiguous().view(like.dtype)


class _Message(Pending):
    """A gloo send or receive; ``source`` is the peer (known once a receive completes).

    gloo's point-to-point Work never reports completion to ``is_completed()``; only
    ``wait()`` finishes it, so ``test()`` waits (gloo's own timeout bounds it).
    """

    __slots__ = ("_work", "source")

    def __init__(self, work, peer: Optional[int]):
        self._work = work
        self.source = peer

    def test(self) -> bool:
        if self._work is not None:
            self._work.wait()
            if self.source is None:
                self.source = self._work._source_rank()
            self._work = None
        return True


class GlooCommunicator(Communicator):
    """Collectives through ``torch.distributed.ProcessGroupGloo`` over the job's store."""

    name = "gloo"
    device_types = ("cpu",)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.store is None:
            raise BackendUnavailableError("the 'gloo' backend needs a rendezvous store (MASTER_ADDR/MASTER_PORT)")
        if not tdist.is_gloo_available():
            raise BackendUnavailableError("this torch build has no gloo; use the 'mpi' backend")
        store = tdist.PrefixStore("smddp/gloo", ctx.store)
        # gloo's own limit comes a little after the engine's, so that the engine's timeout,
        # which names the stalled ranks, is the one users see.
        self.pg = gloo_group(store, self.rank, self.size, ctx.timeout + timedelta(seconds=10))
        #: Check collectives larger than :data:`SMALL_BYTES` too, at the cost of one exchange
        #: before gloo's own operation. The hierarchical plane's exchange between hosts turns it
        #: off: a check there may not add a round trip (``SMDDP_DEBUG=1`` checks everything).
        self.check_large = True
        self._issuing: Deque[_Checked] = collections.deque()  # collectives not yet wholly put out
        self._lock = threading.Lock()

    def _issue(self, op: _Checked) -> None:
        with self._lock:
            self._issuing.append(op)
            if len(self._issuing) == 1:
                op._exchange()
                self._put_out()

    def _pump(self) -> None:
        """Put out the waiting collectives' gloo operations, in issue order, as far as their
        exchanges allow."""
        with self._lock:
            self._put_out()

    def _put_out(self) -> None:
        issuing = self._issuing
        while issuing:
            op = issuing[0]
            try:
                if not op._exchanged():
                    return
            except Exception as exc:  # noqa: BLE001 - a mismatch, or gloo's error: that collective's
                op._error = exc
            issuing.popleft()
            if issuing:
                issuing[0]._exchange()

    def _checked(self, fp: Print, large) -> _Checked:
        """A collective too large for the exchange's row: checked first where :attr:`check_large`."""
        return _Checked(self, fp if self.check_large else None, _NOTHING, None, large)

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        fp = (tensor.numel(), signature(tag, "all_reduce", tensor.dtype, op))
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            return _Checked(self, fp, _bytes(tensor), lambda rows: reduce_rows(_typed(rows, tensor), op, tensor))

        def large() -> Pending:
            work = widened(tensor)
            opts = tdist.AllreduceOptions()
            opts.reduceOp = _GLOO_OPS[op]

            def after() -> None:
                if op is Op.AVERAGE:
                    average(work, self.size)
                if work is not tensor:
                    tensor.copy_(work)

            return _Work(self.pg.allreduce([work], opts), after)

        return self._checked(fp, large)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        fp = (tensor.numel(), signature(tag, "broadcast", tensor.dtype, root=src))
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            def small(rows: torch.Tensor) -> None:
                if self.rank != src:
                    tensor.view(-1).copy_(_typed(rows, tensor)[src])

            return _Checked(self, fp, _bytes(tensor) if self.rank == src else _NOTHING, small)

        def large() -> Pending:
            opts = tdist.BroadcastOptions()
            opts.rootRank = src
            return _Work(self.pg.broadcast([tensor], opts))

        return self._checked(fp, large)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        fp = (input.numel(), signature(tag, "all_gather", input.dtype))
        if input.numel() * input.element_size() <= SMALL_BYTES:
            return _Checked(self, fp, _bytes(input),
                            lambda rows: output.view(self.size, -1).copy_(_typed(rows, input)))
        return self._checked(fp, lambda: _Work(self.pg.allgather([list(output.chunk(self.size))], [input])))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        fp = (-1, signature(tag, "all_to_all_single", input.dtype))

        def large() -> Pending:
            opts = tdist.AllToAllOptions()
            return _Work(self.pg.alltoall_base(output, input, list(output_counts), list(input_counts), opts))

        return self._checked(fp, large)

    def barrier(self, tag: int) -> Pending:
        return _Checked(self, (-1, signature(tag, "barrier")), _NOTHING, lambda rows: None)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        return _Message(self.pg.send([tensor], dst, tag), dst)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        if src is None:
            return _Message(self.pg.recv_anysource([tensor], tag), None)
        return _Message(self.pg.recv([tensor], src, tag), src)
