"""The shared-memory CPU planes as communicators: one host, and several hosts.

Each composes communicators it is given; neither knows which library is beneath them:

- :class:`ShmCommunicator`: every rank of the group on one host. all_reduce,
  reduce_scatter, all_gather, broadcast, barrier and (compiled core) all-to-all go through
  shared memory (:mod:`smddp.comm.planes.shm`); point-to-point, and all-to-all without the
  compiled core, through ``flat`` (the group's MPI or gloo communicator). The plane compares
  every collective's fingerprint; after a mismatch (raised on every rank) it goes on. Its
  segment is made at the group's first collective, not as the group is made (jobs make hundreds
  of groups, most of which move no CPU tensor), and where none can be had (the process's bound,
  a small ``/dev/shm``) every collective takes ``flat``, on every rank of the group alike.
- :class:`HierarchicalCommunicator`: several hosts with the same number of ranks each.
  all_reduce of the group's agreed threshold or more is a reduce-scatter within the host
  (shared memory), an all-reduce of each rank's part with the same local rank of the other
  hosts (``across``: MPI under an MPI launcher, gloo otherwise) and an all-gather within the
  host; everything else goes through ``flat``. Every all-reduce starts with the flat
  communicator's exchange of its fingerprint, whichever path it takes: a mismatch raises on
  every rank before any step, and the group goes on.

:mod:`smddp.comm.planes.choose` chooses and builds them. :attr:`planes_used` records which plane each
collective took; with ``debug`` set, the first use of each is printed.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence, Set, Tuple

import torch

from smddp.comm.base import Communicator, Context, Pending, then
from smddp.comm.mismatch.fingerprint import signature
from smddp.comm.planes.shm import Plane
from smddp.comm.reduction import Op, check_reduction


class _Composed(Communicator):
    """What both planes share: the flat communicator beneath, and the record of planes used.

    ``name`` and ``dtypes`` are the flat communicator's: the backend a job runs is ``mpi`` or
    ``gloo``; the plane is how its bytes move.
    """

    plane: str
    progresses_in_caller = True  # the intra-host step is the ranks' own memory copies

    def __init__(self, ctx: Context, shm: Plane, flat: Communicator, debug: bool = False):
        super().__init__(ctx)
        self.name = flat.name
        self.dtypes = flat.dtypes
        self.rank, self.size = flat.rank, flat.size
        self.local_rank, self.local_size = flat.local_rank, flat.local_size
        self.flat = flat
        self.planes_used: Set[Tuple[str, str]] = set()
        self._shm: Optional[Plane] = shm
        self._debug = debug

    def _used(self, collective: str, plane: str) -> None:
        key = (collective, plane)
        if key in self.planes_used:  # every call but the first: one lookup
            return
        self.planes_used.add(key)
        if self._debug:
            print(f"smddp: rank {self.rank}: {collective} on the {plane} plane", file=sys.stderr, flush=True)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        return self.flat.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        return self.flat.recv(tensor, src, tag)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self.flat.close()


class ShmCommunicator(_Composed):
    """Collectives of a group whose ranks all share one host, through shared memory.

    Args:
        ctx: the group's context.
        shm: the host's plane, or None: ``opener`` makes it at the group's first collective.
        flat: the group's communicator for point-to-point (and all-to-all without the core), and for
            every collective where no plane can be had.
        debug: print the first use of each collective's plane.
        opener: makes the plane (:func:`smddp.comm.planes.shm.open_plane`; the same outcome on every
            rank of the host), or returns None where it cannot be had.
    """

    _first_all_reduce = True

    def __init__(self, ctx: Context, shm: Optional[Plane], flat: Communicator, debug: bool = False,
                 opener: Optional[Callable[[], Optional[Plane]]] = None):
        super().__init__(ctx, shm, flat, debug)
        self._opener = opener if shm is None else None
        #: The path of every small all-reduce: the plane's own, once it is open.
        self._all_reduce = shm.all_reduce if shm is not None else self._first_all_reduce_opens

    @property
    def plane(self) -> str:
        """``"shm"``, or the flat communicator's where no segment could be had."""
        return "shm" if self._shm is not None or self._opener is not None else self.flat.plane

    @property
    def native_reduce_scatter(self) -> bool:
        return self._shm is not None or self._opener is not None or self.flat.native_reduce_scatter

    def open(self) -> Optional[Plane]:
        """The plane, made now if it has not been (every rank of the host calls this alike: in the
        same collective, or as the group is made with ``SMDDP_CPU_PLANE=shm``); None where none can be had."""
        return self._open()

    def _open(self) -> Optional[Plane]:
        """The plane, made now if it has not been: every rank of the host is in this collective too."""
        opener, self._opener = self._opener, None
        if opener is not None:
            self._shm = opener()
            self._all_reduce = self._shm.all_reduce if self._shm is not None else self._flat_all_reduce
        return self._shm

    def _first_all_reduce_opens(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        self._open()
        return self._all_reduce(tensor, op, tag)

    def _flat_all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        self._used("all_reduce", self.flat.name)
        return self.flat.all_reduce(tensor, op, tag)

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        if self._first_all_reduce:
            self._first_all_reduce = False
            if self._open() is not None:
                self._used("all_reduce", "shm")
        return self._all_reduce(tensor, op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        """Rank r receives the reduction of slice r of flat ``input`` (``size * output.numel()`` elements)."""
        plane = self._shm if self._opener is None else self._open()
        if plane is None:
            self._used("reduce_scatter", self.flat.name)
            if self.flat.native_reduce_scatter:
                return self.flat.reduce_scatter(output, input, op, tag)
            # reduced in full on the flat path, then this rank's slice: the same on every rank
            whole = input.clone()
            return then(self.flat.all_reduce(whole, op, tag),
                        lambda: output.copy_(whole.view(self.size, -1)[self.rank]))
        self._used("reduce_scatter", "shm")
        return plane.reduce_scatter(output, input, op, tag)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        plane = self._shm if self._opener is None else self._open()
        if plane is None:
            self._used("broadcast", self.flat.name)
            return self.flat.broadcast(tensor, src, tag)
        self._used("broadcast", "shm")
        return plane.broadcast(tensor, src, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        plane = self._shm if self._opener is None else self._open()
        if plane is None:
            self._used("all_gather", self.flat.name)
            return self.flat.all_gather(output, input, tag)
        self._used("all_gather", "shm")
        return plane.all_gather(output, input, tag)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_counts: Sequence[int],
                          input_counts: Sequence[int], tag: int) -> Pending:
        plane = self._shm if self._opener is None else self._open()
        if plane is not None and plane.native:  # every rank of the plane voted the same way
            self._used("all_to_all_single", "shm")
            return plane.all_to_all(output, input, output_counts, input_counts, tag)
        self._used("all_to_all_single", self.flat.name)
        return self.flat.all_to_all_single(output, input, output_counts, input_counts, tag)

    def barrier(self, tag: int) -> Pending:
        plane = self._shm if self._opener is None else self._open()
        if plane is None:
            self._used("barrier", self.flat.name)
            return self.flat.barrier(tag)
        self._used("barrier", "shm")
        return plane.barrier(tag)


class HierarchicalCommunicator(_Composed):
    """Collectives of a group over several hosts with the same number of ranks on each.

    Every all-reduce is checked across the whole group before it takes a path: its fingerprint
    (element count and dtype, hence its bytes and so its path; op; sequence number) travels in
    the flat communicator's first exchange, on the flat path as on the hierarchical one, so ranks
    whose calls differ (byte counts on either side of ``SMDDP_HIERARCHICAL_MIN_BYTES`` included)
    raise :class:`~smddp.errors.CollectiveMismatchError` on every rank, before any step, and the
    group stays in step.

    Args:
        ctx: the group's context; its agreed layout (``ctx.layout``) gives the threshold.
        shm: this host's plane.
        across: a communicator of the ranks with this rank's local index, one per host.
        flat: the group's communicator, for everything but large all-reduces.
        debug: print the first use of each collective's plane.
    """

    plane = "hierarchical"

    def __init__(self, ctx: Context, shm: Plane, across: Communicator, flat: Communicator, debug: bool = False):
        super().__init__(ctx, shm, flat, debug)
        self.across = across
        #: All-reduces smaller than this go through ``flat`` (the group's agreed threshold).
        self.min_bytes = ctx.layout.hierarchical_min_bytes
        if hasattr(across, "check_large"):
            # gloo between hosts: the group has compared the call already (see all_reduce).
            across.check_large = False
        if hasattr(flat, "check_all_reduce"):
            flat.check_all_reduce = True  # MPI: its all-reduces start with the fingerprint exchange

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            self._used("all_reduce", self.flat.name)
            return self.flat.all_reduce(tensor, op, tag)  # checked: its first exchange has the fingerprint
        self._used("all_reduce", "hierarchical")
        check_reduction(tensor.dtype, op)  # before the exchange below goes out
        # The same fingerprint in the same exchange: a rank on the flat path meets it there.
        agreed = self.flat.agree((tensor.numel(), signature(tag, "all_reduce", tensor.dtype, op)))
        return self._shm.all_reduce_across(tensor, op, self.across, self.size, tag, agreed)

    @property
    def native_reduce_scatter(self) -> bool:
        return self.flat.native_reduce_scatter

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        self._used("reduce_scatter", self.flat.name)
        return self.flat.reduce_scatter(output, input, op, tag)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        self._used("broadcast", self.flat.name)
        return self.flat.broadcast(tensor, src, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        self._used("all_gather", self.flat.name)
        return self.flat.all_gather(output, input, tag)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_counts: Sequence[int],
                          input_counts: Sequence[int], tag: int) -> Pending:
        self._used("all_to_all_single", self.flat.name)
        return self.flat.all_to_all_single(output, input, output_counts, input_counts, tag)

    def barrier(self, tag: int) -> Pending:
        self._used("barrier", self.flat.name)
        return self.flat.barrier(tag)

    def close(self) -> None:
        self.across.close()
        super().close()
