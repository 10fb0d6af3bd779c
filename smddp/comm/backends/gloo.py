"""The ``gloo`` backend: torch's own gloo process group on CPU tensors.

The default under torchrun, or where mpi4py is missing. Each call starts a gloo
operation (gloo runs it on its own threads) and completes through its Work.

reduce_scatter stays the engine's derived one (all_to_all_single, then a local reduction):
torch's gloo ``_reduce_scatter_base`` stalled on 2 ranks under mpirun (torch 2.13).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as tdist

from smddp.comm.backends.gloo_group import gloo_group
from smddp.comm.base import Communicator, Context, Op, Pending, average, widened
from smddp.errors import BackendUnavailableError

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

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        work = widened(tensor)
        opts = tdist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[op]

        def after() -> None:
            if op is Op.AVERAGE:
                average(work, self.size)
            if work is not tensor:
                tensor.copy_(work)

        return _Work(self.pg.allreduce([work], opts), after)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        opts = tdist.BroadcastOptions()
        opts.rootRank = src
        return _Work(self.pg.broadcast([tensor], opts))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        return _Work(self.pg.allgather([list(output.chunk(self.size))], [input]))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        opts = tdist.AllToAllOptions()
        return _Work(self.pg.alltoall_base(output, input, list(output_counts), list(input_counts), opts))

    def barrier(self, tag: int) -> Pending:
        return _Work(self.pg.barrier())

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        return _Message(self.pg.send([tensor], dst, tag), dst)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        if src is None:
            return _Message(self.pg.recv_anysource([tensor], tag), None)
        return _Message(self.pg.recv([tensor], src, tag), src)
