"""The ``mpi`` backend: collectives through mpi4py on CPU tensors.

Every operation is non-blocking (``MPI_Iallreduce`` and friends) and completes through
``Pending.test()``, so the engine can wait with a deadline and a background thread can
progress it while backward runs. Large all-reduces run a ring (reduce-scatter, then
all-gather) over non-blocking point-to-point messages: Open MPI's non-blocking
collectives are about 2.5x slower than its blocking ones at 16 MB, the ring is within
about 10% of the blocking speed, and each chunk is reduced on exactly one rank, so every
rank ends with the same bits. ``SMDDP_MPI_LARGE_ALLREDUCE=blocking`` runs MPI's blocking
all-reduce on a worker thread instead (see :data:`LARGE_ALLREDUCE`).

Buffers are handed to MPI by address (``MPI.buffer.fromaddress``), not through DLPack:
that costs about 1 us instead of 7 us per call.

all_to_all_single is checked (:mod:`smddp.comm.mismatch.checked`): every rank's fingerprint and split
sizes travel first, in one all-gather, so sizes that do not pair up raise
:class:`~smddp.errors.CollectiveMismatchError` on every rank instead of an MPI error on some. So
are the all-reduces of the hierarchical plane (:attr:`MPICommunicator.check_all_reduce`), whose
ranks pick a path by the byte count. Checked collectives run on a communicator of their own, in
issue order; the others are not compared (``SMDDP_DEBUG=1`` compares every collective).
"""

from __future__ import annotations

import queue
import threading
import zlib
from typing import Iterator, List, Optional, Sequence

import torch

from smddp import knobs
from smddp.comm.base import Communicator, Context, Pending
from smddp.comm.mismatch import checked
from smddp.comm.mismatch.checked import as_bytes, rows_of
from smddp.comm.mismatch.fingerprint import Print, signature
from smddp.comm.needs import MPI_INSTALL
from smddp.comm.reduction import Op, average, bool_as_bytes, check_reduction, combine, reduce_rows, widened
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.job import excepthook, mca

mca.one_host_defaults()
try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - exercised where mpi4py is absent
    raise BackendUnavailableError(
        f"the 'mpi' backend needs mpi4py and an MPI library: {MPI_INSTALL}"
    ) from exc

#: All-reduces of at least this many bytes take the large-message path; smaller ones MPI_Iallreduce.
RING_MIN_BYTES = knobs.value("SMDDP_MPI_RING_MIN_BYTES")
#: The large-message path. "ring" (default): smddp's ring of non-blocking sends and
#: receives, progressed by whoever tests it; light on the CPU, so DDP's backward keeps its
#: core while gradients move. "blocking": MPI's own tuned MPI_Allreduce on a worker thread
#: while the caller waits with a deadline; about 10% faster for a lone synchronous 16 MB
#: all-reduce, but MPI's busy-polling takes the core from backward (DDP steps measured 1.8x
#: slower on a 2-core machine).
LARGE_ALLREDUCE = knobs.value("SMDDP_MPI_LARGE_ALLREDUCE")

_MPI_OPS = {Op.SUM: MPI.SUM, Op.AVERAGE: MPI.SUM, Op.MIN: MPI.MIN, Op.MAX: MPI.MAX, Op.PRODUCT: MPI.PROD,
            Op.BAND: MPI.BAND, Op.BOR: MPI.BOR, Op.BXOR: MPI.BXOR}

_MPI_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
}
# float16 and bfloat16 are reduced in float32 (comm.reduction.HALF): no MPI half type is needed,
# so mpi4py 4.0 (which lacks MPI.FLOAT16_T) works too. bool is reduced as its bytes
# (comm.reduction.bool_as_bytes): MPI's C_BOOL has no MIN, MAX or bitwise ops.

_TAG_SPACE = 32767  # the smallest MPI_TAG_UB the standard allows
#: Bytes of data that ride in a checked collective's row (an all-reduce this small takes no
#: other exchange). Every rank receives every rank's row: kept small.
SMALL_BYTES = 256


def _buffer(t: torch.Tensor, datatype=None):
    """An mpi4py buffer spec over ``t``'s memory (``t`` contiguous)."""
    nbytes = t.numel() * t.element_size()
    mem = MPI.buffer.fromaddress(t.data_ptr(), nbytes) if nbytes else MPI.buffer.allocate(0)
    if datatype is None:
        return [mem, nbytes, MPI.BYTE]
    return [mem, t.numel(), datatype]


_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}


def _check_thread_level() -> None:
    """Refuse an MPI initialized below ``MPI_THREAD_MULTIPLE``.

    The engine calls MPI from the caller's thread, its progress thread and the thread that
    runs backward (see the thread model in :mod:`smddp.comm.engine`). mpi4py requests
    ``MPI_THREAD_MULTIPLE`` when it initializes MPI; a lower level means another library
    initialized MPI first, or ``mpi4py.rc.thread_level`` was lowered.

    Raises:
        BackendUnavailableError: the MPI library provides less than ``MPI_THREAD_MULTIPLE``.
    """
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        name = _THREAD_LEVELS.get(level, str(level))
        raise BackendUnavailableError(
            f"the 'mpi' backend needs MPI_THREAD_MULTIPLE, but MPI was initialized with {name} "
            f"(by mpi4py.rc.thread_level, or by a library that called MPI_Init before smddp). Import "
            f"smddp before that library and leave mpi4py.rc.thread_level at 'multiple', use an MPI "
            f"built with thread support, or choose another backend (SMDDP_BACKEND=gloo)"
        )


class _Requests(Pending):
    """Drives a generator that yields lists of MPI requests, one stage at a time.

    The first stage starts at once, in the caller's thread: collectives must be started in
    the same order on every rank, whichever thread later progresses them.
    """

    __slots__ = ("_stages", "_current", "_keep")

    def __init__(self, stages: Iterator[List], *keep: torch.Tensor):
        self._stages = stages
        # MPI holds raw addresses: the tensors must outlive the requests, even temporaries.
        self._keep = keep
        self._current: Optional[List] = next(stages, None)

    def test(self) -> bool:
        while True:
            if self._current is None:
                return True
            if self._current and not MPI.Request.Testall(self._current):
                return False
            self._current = next(self._stages, None)


class _Offloaded(Pending):
    """A blocking MPI call that the communicator's worker thread runs."""

    __slots__ = ("_finished", "_error", "_after", "_keep")

    def __init__(self, after, keep):
        self._finished = threading.Event()
        self._error: Optional[BaseException] = None
        self._after = after
        self._keep = keep  # MPI holds raw addresses: keep the tensors alive

    def ran(self, error: Optional[BaseException]) -> None:
        """The worker thread has run the call (``error``: what it raised, else None)."""
        self._error = error
        self._finished.set()

    def test(self) -> bool:
        if not self._finished.is_set():
            return False
        if self._error is not None:
            raise self._error
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return True

    def block(self, seconds: float) -> None:
        self._finished.wait(seconds)


class MPICommunicator(Communicator):
    """Collectives over ``MPI_COMM_WORLD`` (a duplicate, so user MPI traffic never mixes)."""

    name = "mpi"
    device_types = ("cpu",)
    progresses_in_caller = True
    dtypes = frozenset(_MPI_TYPES) | {torch.bfloat16, torch.float16, torch.bool}

    def __init__(self, ctx: Context, base=None):
        """Join ``base`` (default ``MPI_COMM_WORLD``); a subgroup passes its own communicator."""
        super().__init__(ctx)
        _check_thread_level()
        excepthook.install()  # an uncaught exception on any rank now ends the whole job (MPI_Abort)
        self._ctx = ctx
        self._base = MPI.COMM_WORLD if base is None else base
        self.comm = self._base.Dup()
        # Users' point-to-point tags get a communicator of their own: they can never
        # match the ring's messages.
        self.p2p = self._base.Dup()
        # Checked collectives go out in the order the checker puts them out, later than they are
        # issued: a communicator of their own keeps them from crossing the others.
        self._checked_comm = self._base.Dup()
        self.max_tag = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))  # MPI sets it on the world alone
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._large_comm = None
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.checker = checked.CheckedSequence(self.size, SMALL_BYTES, self._gather, "the MPI plane")
        #: Check every all-reduce (its fingerprint first, in one small all-gather): the
        #: hierarchical plane turns it on for its flat all-reduces (see :meth:`agree`).
        self.check_all_reduce = False
        if base is None and (self.rank, self.size) != (ctx.topology.rank, ctx.topology.size):
            raise BackendUnavailableError(
                f"MPI says rank {self.rank} of {self.size}, but the job was set up as rank "
                f"{ctx.topology.rank} of {ctx.topology.size}: use the 'mpi' backend only under "
                f"an MPI launcher (mpirun, smddprun, srun --mpi)"
            )
        if base is None and not ctx.topology.mpi:
            # The launcher's local rank is what users pin devices with; ask MPI only when
            # no launcher variable said it.
            local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
            local.Free()

    def subgroup(self, ranks: Sequence[int], ctx: Context) -> MPICommunicator:
        """A communicator over the global ``ranks`` (group rank ``i`` is ``ranks[i]``).

        ``MPI_Comm_create_group``: only the members call it, in the same order on each.

        Args:
            ranks: the members' ranks in ``MPI_COMM_WORLD``, in group-rank order.
            ctx: the group's context (its topology: :func:`smddp.comm.subgroups.group_topology`).
        """
        world = MPI.COMM_WORLD
        group = world.Get_group().Incl(list(ranks))
        try:
            # The tag only has to agree among the members (each rank creates one group at a
            # time, in torch's order); a count of this process's groups would not.
            created = world.Create_group(group, tag=zlib.crc32(repr(list(ranks)).encode()) % _TAG_SPACE)
        finally:
            group.Free()
        try:
            return MPICommunicator(ctx, created)
        finally:
            created.Free()

    def split(self, color: int, key: int) -> MPICommunicator:
        """A communicator of this one's ranks with the same ``color``, ordered by ``key``
        (``MPI_Comm_split``: every rank of this communicator calls it)."""
        part = self.comm.Split(color=color, key=key)
        try:
            return MPICommunicator(self._ctx, part)
        finally:
            part.Free()

    # ---------------------------------------------------------------- all_reduce
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        check_reduction(tensor.dtype, op)
        if self.check_all_reduce:
            return self._checked_all_reduce(tensor, op, tag)
        nbytes = tensor.numel() * tensor.element_size()
        if self.size > 1 and nbytes >= RING_MIN_BYTES and LARGE_ALLREDUCE == "blocking":
            return self._all_reduce_offloaded(tensor, op)
        return _Requests(self._all_reduce(tensor, op, tag))

    def _all_reduce_offloaded(self, tensor: torch.Tensor, op: Op) -> Pending:
        tensor, op = bool_as_bytes(tensor, op)
        work = widened(tensor)

        def after() -> None:
            if op is Op.AVERAGE:
                average(work, self.size)
            if work is not tensor:
                tensor.copy_(work)

        pending = _Offloaded(after, (tensor, work))
        if self._worker is None:
            # Its own communicator: the worker's collectives never interleave with the
            # non-blocking ones started from the caller's thread.
            self._large_comm = self._base.Dup()
            self._worker = threading.Thread(target=self._work_loop, name="smddp-mpi", daemon=True)
            self._worker.start()
        self._queue.put((self._large_comm.Allreduce, (MPI.IN_PLACE, _buffer(work, _MPI_TYPES[work.dtype])),
                         {"op": _MPI_OPS[op]}, pending))
        return pending

    def _work_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, args, kwargs, pending = item
            error = None
            try:
                call(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting rank
                error = exc
            pending.ran(error)

    def _checked_all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        fp = (tensor.numel(), signature(tag, "all_reduce", tensor.dtype, op))
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            return self.checker.start(fp, as_bytes(tensor), lambda rows: reduce_rows(rows_of(rows, tensor), op, tensor))
        return self.checker.start(fp, large=lambda: _Requests(self._all_reduce(tensor, op, tag, self._checked_comm)))

    def agree(self, fp: Print) -> Pending:
        """Only the exchange of fingerprint ``fp``, as a checked collective starts: raises on every
        rank unless every rank's is the same. The hierarchical plane's all-reduce starts with it."""
        return self.checker.start(fp, small=lambda rows: None)

    def _gather(self, row: torch.Tensor, rows: torch.Tensor) -> Pending:
        recv = [_buffer(rows)[0], row.numel(), MPI.BYTE]
        return _Requests(iter([[self._checked_comm.Iallgather(_buffer(row), recv)]]), row, rows)

    def _all_reduce(self, tensor: torch.Tensor, op: Op, tag: int, comm=None):
        comm = self.comm if comm is None else comm
        tensor, op = bool_as_bytes(tensor, op)
        work = widened(tensor)
        if self.size > 1:
            nbytes = work.numel() * work.element_size()
            if nbytes >= RING_MIN_BYTES and work.numel() >= self.size:
                yield from self._ring(work.view(-1), op, tag % _TAG_SPACE, comm)
            else:
                yield [comm.Iallreduce(MPI.IN_PLACE, _buffer(work, _MPI_TYPES[work.dtype]), op=_MPI_OPS[op])]
        if op is Op.AVERAGE:
            average(work, self.size)
        if work is not tensor:
            tensor.copy_(work)

    def _ring(self, flat: torch.Tensor, op: Op, tag: int, comm):
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        chunks = list(torch.tensor_split(flat, n))
        scratch = torch.empty_like(chunks[0])
        # Reduce-scatter: after n-1 steps rank r holds the full result of chunk r+1.
        for step in range(n - 1):
            send, recv = chunks[(r - step) % n], chunks[(r - step - 1) % n]
            incoming = scratch[: recv.numel()]
            yield [comm.Irecv(_buffer(incoming), source=left, tag=tag),
                   comm.Isend(_buffer(send), dest=right, tag=tag)]
            combine(recv, incoming, op)
        # All-gather the reduced chunks around the ring.
        for step in range(n - 1):
            send, recv = chunks[(r + 1 - step) % n], chunks[(r - step) % n]
            yield [comm.Irecv(_buffer(recv), source=left, tag=tag),
                   comm.Isend(_buffer(send), dest=right, tag=tag)]

    # ---------------------------------------------------------------- reduce_scatter
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        check_reduction(input.dtype, op, "reduce_scatter")
        return _Requests(self._reduce_scatter(output, input, op))

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op):
        output, _ = bool_as_bytes(output, op)
        input, op = bool_as_bytes(input, op)
        src, out = widened(input), widened(output)
        if self.size > 1:
            datatype = _MPI_TYPES[out.dtype]
            # mpi4py counts the send buffer per block, as MPI_Reduce_scatter_block does.
            send = [_buffer(src)[0], out.numel(), datatype]
            yield [self.comm.Ireduce_scatter_block(send, _buffer(out, datatype), op=_MPI_OPS[op])]
        else:
            out.copy_(src)
        if op is Op.AVERAGE:
            average(out, self.size)
        if out is not output:
            output.copy_(out)

    # ---------------------------------------------------------------- the rest
    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        return _Requests(iter([[self.comm.Ibcast(_buffer(tensor), root=src)]]), tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        # The receive count is per rank, as MPI_Allgather counts it.
        nbytes = input.numel() * input.element_size()
        recv = [_buffer(output)[0], nbytes, MPI.BYTE]
        return _Requests(iter([[self.comm.Iallgather(_buffer(input), recv)]]), input, output)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        size = output.element_size()
        send_counts = [c * size for c in input_counts]
        recv_counts = [c * size for c in output_counts]
        send = [_buffer(input)[0], (send_counts, _displacements(send_counts)), MPI.BYTE]
        recv = [_buffer(output)[0], (recv_counts, _displacements(recv_counts)), MPI.BYTE]
        fp = (-1, signature(tag, "all_to_all_single", input.dtype))

        def large() -> Pending:
            return _Requests(iter([[self._checked_comm.Ialltoallv(send, recv)]]), input, output)

        # Checked: split sizes that do not pair up raise on every rank, not MPI_ERR_TRUNCATE on some.
        return self.checker.start(fp, checked.split_words(input_counts, output_counts), large=large, paired=True)

    def barrier(self, tag: int) -> Pending:
        return _Requests(iter([[self.comm.Ibarrier()]]))

    # ---------------------------------------------------------------- point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        self._check_tag(tag)
        return _Message(self.p2p.Isend(_buffer(tensor), dest=dst, tag=tag), dst)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        self._check_tag(tag)
        source = MPI.ANY_SOURCE if src is None else src
        return _Message(self.p2p.Irecv(_buffer(tensor), source=source, tag=tag), src)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= self.max_tag:
            raise InvalidArgumentError(f"tag={tag} is outside this MPI's tag range 0..{self.max_tag}")

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
        if not MPI.Is_finalized():
            self.comm.Free()
            self.p2p.Free()
            self._checked_comm.Free()
            if self._large_comm is not None and not self._worker.is_alive():
                self._large_comm.Free()


class _Message(Pending):
    """One point-to-point message; ``source`` is the peer (known once a receive completes)."""

    __slots__ = ("_request", "_status", "source")

    def __init__(self, request, peer: Optional[int]):
        self._request = request
        self._status = MPI.Status()
        self.source = peer

    def test(self) -> bool:
        if self._request is None:
            return True
        if not self._request.Test(self._status):
            return False
        self._request = None
        if self.source is None:
            self.source = self._status.Get_source()
        return True


def _displacements(counts: Sequence[int]) -> List[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
