"""The ``gloo`` backend: torch's own gloo process group on CPU tensors.

The default under torchrun, or where mpi4py is missing. Each call starts a gloo
operation (gloo runs it on its own threads) and completes through its Work.

reduce_scatter stays the engine's derived one (all_to_all_single, then a local reduction):
torch's gloo ``_reduce_scatter_base`` stalled on 2 ranks under mpirun (torch 2.13).

Every collective is checked (:mod:`smddp.comm.mismatch.checked`): it starts with one exchange of the
same length on every rank whatever the call, an all-gather of each rank's row: its
fingerprint, up to :data:`SMALL_BYTES` of its data, and an all-to-all's split sizes. gloo
aborts the process (``gloo::EnforceNotMet`` in its own thread, SIGABRT) when ranks post
messages of different lengths, so the rows must travel before data of a length that may
differ. If the calls differ (or an all-to-all's sizes do not pair up), every rank raises the
same :class:`~smddp.errors.CollectiveMismatchError` after that one exchange, and the plane
stays in step. A collective whose data fit in the row is then done (an all-reduce folds the
rows in rank order, half types in float32: the same bits on every rank); a larger one runs
gloo's own collective next, unless :attr:`GlooCommunicator.check_large` is off (the
hierarchical plane's exchange between hosts, whose calls the group has already compared):
then it goes out at once, unchecked.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as tdist

from smddp.comm.backends.c10d_work import GlooWork
from smddp.comm.backends.gloo_group import gloo_group
from smddp.comm.base import Communicator, Context, Pending
from smddp.comm.mismatch import checked
from smddp.comm.mismatch.checked import as_bytes, rows_of
from smddp.comm.mismatch.fingerprint import Print, signature
from smddp.comm.reduction import Op, average, bool_as_bytes, check_reduction, reduce_rows, widened
from smddp.errors import BackendUnavailableError
from smddp.job import sockets

#: Bytes of data that travel in the fingerprint exchange: collectives up to this size take no
#: other exchange.
SMALL_BYTES = 4096

_GLOO_OPS = {
    Op.SUM: tdist.ReduceOp.SUM,
    Op.AVERAGE: tdist.ReduceOp.SUM,
    Op.MIN: tdist.ReduceOp.MIN,
    Op.MAX: tdist.ReduceOp.MAX,
    Op.PRODUCT: tdist.ReduceOp.PRODUCT,
    Op.BAND: tdist.ReduceOp.BAND,
    Op.BOR: tdist.ReduceOp.BOR,
    Op.BXOR: tdist.ReduceOp.BXOR,
}


class _GlooCheckedCollective(checked.CheckedCollective):
    """A checked gloo collective: sleeps on gloo's own thread while it waits."""

    __slots__ = ()

    def block(self, seconds: float) -> None:
        """Sleep until gloo's thread completes the current exchange or ``seconds`` pass."""
        current = self.current()
        if current is not None:
            current.block(seconds)


def _nothing(rows: torch.Tensor) -> None:
    """A collective done once the rows agree (a barrier, an agreement)."""


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
    dtypes = Communicator.dtypes | {torch.bool}

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.store is None:
            raise BackendUnavailableError("the 'gloo' backend needs a rendezvous store (MASTER_ADDR/MASTER_PORT)")
        if not tdist.is_gloo_available():
            raise BackendUnavailableError("this torch build has no gloo; use the 'mpi' backend")
        store = tdist.PrefixStore("smddp/gloo", ctx.store)
        # gloo's own limit comes a little after the engine's, so that the engine's timeout,
        # which names the stalled ranks, is the one users see.
        # Listen on loopback only if the group's agreed layout puts every rank on this host.
        one_host = ctx.layout.one_host if ctx.layout is not None else sockets.one_host(ctx.topology)
        # Over the process's shared gloo devices; the same object serves torch's functional
        # collectives on the group's CPU tensors (smddp.torch._functional_backends): one gloo group
        # per group, as torch's own.
        self.pg = gloo_group(store, self.rank, self.size, ctx.timeout + timedelta(seconds=10), one_host)
        #: Check collectives larger than :data:`SMALL_BYTES` too, at the cost of one exchange
        #: before gloo's own operation. The hierarchical plane's exchange between hosts turns it
        #: off: a check there may not add a round trip (``SMDDP_DEBUG=1`` checks everything).
        self.check_large = True
        self.checker = checked.CheckedSequence(self.size, SMALL_BYTES, self._gather, "the gloo plane",
                                               _GlooCheckedCollective)

    def close(self) -> None:
        """Let go of the gloo group and the checker that holds this communicator's own method (a
        cycle): the group's threads and connections end once torch lets go of it too."""
        self.checker = None
        self.pg = None

    def _gather(self, row: torch.Tensor, rows: torch.Tensor) -> Pending:
        return GlooWork(self.pg.allgather([list(rows.chunk(self.size))], [row]))

    def _checked(self, fp: Print, large) -> Pending:
        """A collective too large for the exchange's row: checked first where :attr:`check_large`."""
        return self.checker.start(fp if self.check_large else None, large=large)

    def agree(self, fp: Print) -> Pending:
        """Only the exchange of fingerprint ``fp`` (a row like a collective's): raises on every rank
        unless every rank's is the same. The hierarchical plane's all-reduce starts with it."""
        return self.checker.start(fp, small=_nothing)

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        check_reduction(tensor.dtype, op)  # gloo itself would refuse it only after the exchange below
        fp = (tensor.numel(), signature(tag, "all_reduce", tensor.dtype, op))
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            return self.checker.start(fp, as_bytes(tensor), lambda rows: reduce_rows(rows_of(rows, tensor), op, tensor))

        def large() -> Pending:
            # bool as its bytes: gloo's own bool SUM adds them (two Trues make the byte 2, 256 wrap to False)
            wire, wire_op = bool_as_bytes(tensor, op)
            work = widened(wire)
            opts = tdist.AllreduceOptions()
            opts.reduceOp = _GLOO_OPS[wire_op]

            def after() -> None:
                if op is Op.AVERAGE:
                    average(work, self.size)
                if work is not wire:
                    wire.copy_(work)

            return GlooWork(self.pg.allreduce([work], opts), after)

        return self._checked(fp, large)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        fp = (tensor.numel(), signature(tag, "broadcast", tensor.dtype, root=src))
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            def small(rows: torch.Tensor) -> None:
                if self.rank != src:
                    tensor.view(-1).copy_(rows_of(rows, tensor)[src])

            return self.checker.start(fp, as_bytes(tensor) if self.rank == src else checked.EMPTY, small)

        def large() -> Pending:
            opts = tdist.BroadcastOptions()
            opts.rootRank = src
            return GlooWork(self.pg.broadcast([tensor], opts))

        return self._checked(fp, large)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        fp = (input.numel(), signature(tag, "all_gather", input.dtype))
        if input.numel() * input.element_size() <= SMALL_BYTES:
            return self.checker.start(fp, as_bytes(input),
                                      lambda rows: output.view(self.size, -1).copy_(rows_of(rows, input)))
        return self._checked(fp, lambda: GlooWork(self.pg.allgather([list(output.chunk(self.size))], [input])))

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
            return GlooWork(self.pg.alltoall_base(output, input, list(output_counts), list(input_counts), opts))

        # Always checked: split sizes that do not pair up would abort gloo (or read the wrong bytes).
        return self.checker.start(fp, checked.split_words(input_counts, output_counts), large=large, paired=True)

    def barrier(self, tag: int) -> Pending:
        return self.checker.start((-1, signature(tag, "barrier")), small=_nothing)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        return _Message(self.pg.send([tensor], dst, tag), dst)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        if src is None:
            return _Message(self.pg.recv_anysource([tensor], tag), None)
        return _Message(self.pg.recv([tensor], src, tag), src)
