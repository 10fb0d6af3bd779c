"""The interface every communicator implements.

A communicator moves bytes between the ranks of one job with one library (MPI, gloo,
NCCL, oneCCL). It sees only what the :class:`~smddp.comm.engine.Engine` prepared:
contiguous, detached tensors on its device, flat buffers for ``all_gather`` and
``all_to_all_single``, counts in elements. Each call *starts* the operation and returns a
:class:`Pending`; the engine owns sequence numbers, timeouts and handles, and holds every
Pending (and so every buffer it references) until it completes, whoever holds the handle.

``reduce_scatter`` is optional: a backend without its own keeps the default, and the engine
derives it from ``all_to_all_single``. What a reduction means (:class:`~smddp.comm.reduction.Op`,
half precision in float32, which dtypes have which op) is :mod:`smddp.comm.reduction`'s; how a
caller waits for a Pending is :mod:`smddp.comm.waiting`'s. Stream-ordered operations (NCCL) use
two optional hooks of :class:`Pending` (:meth:`Pending.waited`, :meth:`Pending.queue_after`), and a
communicator that watches its own deadlines reports through :attr:`Communicator.on_timeout`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from smddp.comm.reduction import Op, check_reduction
from smddp.errors import BackendUnavailableError
from smddp.job.topology import Topology


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a contiguous 1-D tensor outside autograd: ``tensor`` itself
    when it is one, a view when it is contiguous, else a copy.

    ``flatten()`` returns a 1-D tensor itself, where ``view(-1)`` and ``detach()`` make a new
    one each (about a microsecond apiece here, on the path of every small collective).
    """
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.contiguous().flatten()


class Pending(abc.ABC):
    """An operation in flight.

    ``test()`` makes progress and returns True once the result is in the caller's
    tensors. It is called from one thread at a time (the engine holds a lock).
    """

    @abc.abstractmethod
    def test(self) -> bool:
        """Advance the operation; True when it has completed."""

    def waited(self) -> None:  # noqa: B027 - optional: only stream-ordered operations act here
        """Called on every wait once the operation completed: a stream-ordered operation makes
        the caller's current stream wait for it (the caller may wait from another stream)."""

    def queue_after(self, action) -> bool:
        """Queue ``action`` (torch ops on the operation's tensors) right after the operation.

        Returns:
            True if queued: a stream-ordered operation runs it on its stream now, and every
            later wait sees its effects. False (the default): the caller runs it on completion.
        """
        return False

    # A subclass may also define ``block(seconds)``: sleep until the operation completes or
    # ``seconds`` pass, without polling. The engine then sleeps on it instead of spinning.

    #: A stream-ordered operation (done for the kernels queued after it as soon as it is
    #: enqueued) defines ``query()``: True once its device has finished it, without blocking.
    #: None: the operation completes on the host.
    query: Optional[Callable[[], bool]] = None


class Done(Pending):
    """An operation that completed when it was started."""

    def test(self) -> bool:
        return True


DONE = Done()


class Failed(Pending):
    """An operation that failed as it was started: testing it raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def test(self) -> bool:
        raise self.error


class Then(Pending):
    """``pending``, then ``action()`` once (copy back, divide, cast), keeping ``held`` alive till then.

    A stream-ordered operation queues ``action`` on its stream at once, right after itself
    (:meth:`Pending.queue_after`); any other runs it on the host once it completes.
    Libraries read and write buffers by address while an operation is in flight: ``held``
    keeps the buffers that only a start function referenced from being freed under them.
    """

    def __init__(self, pending: Pending, action=None, held: tuple = ()):
        self._pending, self._done, self._held = pending, False, held
        self._action = None if action is None or pending.queue_after(action) else action
        self.query = pending.query  # a queued action runs on the operation's stream, before its event

    def test(self) -> bool:
        if not self._done and self._pending.test():
            if self._action is not None:
                self._action()
            self._done, self._held = True, ()
        return self._done

    def waited(self) -> None:
        self._pending.waited()

    def queue_after(self, action) -> bool:
        return self._action is None and self._pending.queue_after(action)


def then(pending: Pending, action=None, *held) -> Pending:
    """``pending``, then ``action()`` (None: nothing), keeping ``held`` alive until it completes.

    A :class:`Then`, except that an operation that completed as it started (:data:`DONE`)
    runs ``action`` now and stays :data:`DONE` (so the engine completes it without a handle
    to test, and nothing need be kept), and that with nothing to add ``pending`` is returned.
    """
    if pending is DONE:
        if action is not None:
            action()
        return DONE
    if action is None and not held:
        return pending
    return Then(pending, action, held)


@dataclass
class Context:
    """What a communicator is created from: the topology and the job's rendezvous."""

    topology: Topology
    timeout: timedelta
    store: Optional[Any] = None  # a torch.distributed.Store shared by all ranks, or None
    device: Optional[torch.device] = None
    #: Makes the group's CPU communicator next to a device backend's (set by the registry).
    cpu: Optional[Callable[[Context], Communicator]] = None
    #: The group's agreed layout (:class:`smddp.comm.planes.layout.Layout`), once its ranks have met.
    layout: Optional[Any] = None


class Communicator(abc.ABC):
    """One backend's collectives over all ranks of the job.

    A communicator may also offer ``subgroup(ranks, ctx) -> Communicator``: a communicator
    over the global ``ranks`` (group rank ``i`` is global rank ``ranks[i]``), called by the
    member ranks only, in the same order on each (like ``MPI_Comm_create_group``), with the
    group's context (:func:`smddp.comm.subgroups.group_topology`, the group's own store). Without
    it, :mod:`smddp.comm.subgroups` makes a gloo communicator over the group's store for CPU
    tensors.

    Attributes:
        name: the backend's name (``"mpi"``, ``"gloo"``, ...).
        device_types: tensor device types it moves (``("cpu",)``, ``("cuda",)``).
        dtypes: dtypes it accepts for every operation.
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    dtypes: ClassVar[frozenset] = frozenset(
        {torch.float16, torch.bfloat16, torch.float32, torch.float64,
         torch.uint8, torch.int8, torch.int32, torch.int64}
    )

    #: Set by the engine that runs this communicator: ``on_timeout(seq, op_name)`` returns the
    #: :class:`~smddp.errors.CollectiveTimeout` for an operation the communicator itself found
    #: past its deadline (nccl's watchdog), naming the ranks that never arrived, and marks the
    #: job broken.
    on_timeout: Optional[Callable[[int, str], BaseException]] = None

    #: Why this communicator's plane was chosen, and the settings it was chosen with (set by
    #: :mod:`smddp.comm.planes.choose` on CPU communicators; subgroups reuse the settings).
    plane_reason: str = ""
    plane_settings: Optional[Any] = None
    #: The group's agreed layout (:class:`smddp.comm.planes.layout.Layout`; None for a group of one).
    layout: Optional[Any] = None

    #: A stream-ordered communicator's direct path, once it has one: an object whose ``start``
    #: enqueues an all-reduce, a broadcast, an all-gather or a reduce-scatter (its ``ALL_REDUCE``,
    #: ``BROADCAST``, ``ALL_GATHER``, ``REDUCE_SCATTER``) and returns a ``Work`` (asynchronous) or
    #: None, with nothing for the engine to track, or its ``REFUSED`` (``NotImplemented``) having
    #: sent nothing (:class:`smddp.comm.backends.nccl.direct.DirectPath`; the engine's
    #: :meth:`~smddp.comm.engine.Engine.start_direct`). None: every call takes the general path.
    direct: Optional[Any] = None

    #: Data moves only while a thread calls into the library (MPI, shared memory), not on
    #: threads or streams of its own (gloo, NCCL): see :meth:`Engine.finish
    #: <smddp.comm.engine.Engine.finish>`.
    progresses_in_caller: bool = False

    @property
    def plane(self) -> str:
        """How this communicator's bytes move: ``"shm"``, ``"hierarchical"``, or its backend's name."""
        return self.name

    def __init__(self, ctx: Context):
        self.rank = ctx.topology.rank
        self.size = ctx.topology.size
        self.local_rank = ctx.topology.local_rank
        self.local_size = ctx.topology.local_size

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        """Reduce ``tensor`` over all ranks in place; every rank gets the same bits."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        """Fill flat ``output`` (``size * input.numel()`` elements) with every rank's input in rank order."""

    @abc.abstractmethod
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        """Send ``input_counts[j]`` elements to rank ``j``; receive ``output_counts[j]`` from it."""

    @abc.abstractmethod
    def barrier(self, tag: int) -> Pending:
        """Complete once every rank has entered the barrier."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        """Reduce flat ``input`` (``size * output.numel()`` elements) over ranks; rank r gets slice r.

        Optional: a backend without a native reduce-scatter keeps this default, and the engine
        builds it from ``all_to_all_single`` (:func:`smddp.comm.algorithms.derived.reduce_scatter_tensor`).
        Half precision is reduced in float32 (:data:`~smddp.comm.reduction.HALF`); AVERAGE divides the
        sum by ``size``.

        Args:
            output: flat, contiguous; receives this rank's slice of the reduction.
            input: flat, contiguous, ``size * output.numel()`` elements.
            op: the reduction.
            tag: the collective's sequence number.

        Raises:
            NotImplementedError: this backend has no native reduce-scatter.
        """
        raise NotImplementedError(f"the {self.name!r} backend has no native reduce_scatter")

    def check_reduction(self, dtype: torch.dtype, op: Op, what: str = "all_reduce") -> None:
        """Refuse a reduction this communicator has not for ``dtype``, before anything is sent.

        gloo's rules by default (:func:`smddp.comm.reduction.check_reduction`); a device backend adds its
        library's (NCCL has no bitwise ops). The engine's derived collectives, which reduce
        locally what the communicator moved, ask it before they start.

        Raises:
            InvalidTypeError, InvalidArgumentError: naming the op.
        """
        check_reduction(dtype, op, what)  # smddp.comm.reduction's

    @property
    def native_reduce_scatter(self) -> bool:
        """True when :meth:`reduce_scatter` is this communicator's own (else the engine derives it)."""
        return type(self).reduce_scatter is not Communicator.reduce_scatter

    # Point-to-point is optional: a backend that cannot do it keeps these defaults.
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        """Send ``tensor`` to rank ``dst``; messages between two ranks with one tag stay in order.

        Raises:
            BackendUnavailableError: this backend has no point-to-point messages.
        """
        raise BackendUnavailableError(f"the {self.name!r} backend cannot send point-to-point messages")

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        """Receive into ``tensor`` from rank ``src`` (``None``: any rank).

        The returned Pending has a ``source`` attribute, the sender's rank, once complete.

        Raises:
            BackendUnavailableError: this backend has no point-to-point messages.
        """
        raise BackendUnavailableError(f"the {self.name!r} backend cannot receive point-to-point messages")

    def close(self) -> None:  # noqa: B027 - optional: most backends have nothing to release
        """Release the library's resources. Called once, at ``destroy_process_group()``."""
