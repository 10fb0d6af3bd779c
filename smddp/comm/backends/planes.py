"""The MPI backend's CPU data planes: shared memory within a host, hierarchical across hosts.

:class:`PlaneCommunicator` is the ``mpi`` backend's communicator for CPU tensors. It owns an
:class:`~smddp.comm.backends.mpi.MPICommunicator` and picks, once at start-up, how collectives move:

- ``shm``: every rank of the job is on one host (MPI's ``COMM_TYPE_SHARED`` split says so):
  all_reduce, reduce_scatter, all_gather, broadcast and barrier go through shared memory
  (:mod:`smddp.comm.backends.shm`);
- ``hierarchical``: several hosts with the same number of ranks each: all_reduce is a
  reduce-scatter within the host (shared memory), an all-reduce of each rank's part between
  hosts (MPI) and an all-gather within the host; the other collectives go through MPI;
- ``mpi``: MPI for everything (one rank per host, uneven hosts, no usable /dev/shm).

All-to-all goes through shared memory on the ``shm`` plane when the compiled core is built,
else through MPI; point-to-point always goes through MPI. ``SMDDP_CPU_PLANE`` pins the choice
(``auto``, ``shm``, ``hierarchical``, ``mpi``; ``gloo`` is handled by backend selection).
:attr:`PlaneCommunicator.planes_used` records which plane each collective took; with
``SMDDP_DEBUG`` set, the first use of each collective on each plane is printed.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, Set, Tuple

import torch

from smddp.comm.backends.mpi import _MPI_OPS, _MPI_TYPES, MPI, MPICommunicator
from smddp.comm.backends.shm import Plane, open_plane
from smddp.comm.base import Context, Op, Pending
from smddp.comm.engine import debug
from smddp.errors import BackendUnavailableError

ENV = "SMDDP_CPU_PLANE"
PLANES = ("auto", "shm", "hierarchical", "mpi", "gloo")

#: All-reduces smaller than this stay on flat MPI in the hierarchical plane: below it the
#: extra steps cost more than the bytes they save between hosts.
HIERARCHICAL_MIN_BYTES = int(os.environ.get("SMDDP_HIERARCHICAL_MIN_BYTES", 256 * 1024))


def requested_plane(env=os.environ) -> str:
    """The plane ``SMDDP_CPU_PLANE`` asks for (``auto`` when unset).

    Raises:
        BackendUnavailableError: the value is not one of :data:`PLANES`.
    """
    value = env.get(ENV, "").strip().lower() or "auto"
    if value not in PLANES:
        raise BackendUnavailableError(f"{ENV}={value!r} is not a CPU plane; use one of: {', '.join(PLANES)}")
    return value


def _mpi_type(dtype: torch.dtype):
    return _MPI_TYPES[dtype]


class PlaneCommunicator(MPICommunicator):
    """The ``mpi`` backend's CPU communicator, with the fastest plane this job's layout allows.

    Attributes:
        plane: ``"shm"``, ``"hierarchical"`` or ``"mpi"``.
        planes_used: the ``(collective, plane)`` pairs this rank has run.
    """

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        wanted = requested_plane()
        self.plane = "mpi"
        self.planes_used: Set[Tuple[str, str]] = set()
        self._shm: Optional[Plane] = None
        self._across = None
        self._debug = debug.enabled()
        if wanted in ("mpi", "gloo") or self.size == 1:
            return
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            self.plane, why = self._choose(wanted, local)
        finally:
            local.Free()
        if wanted != "auto" and self.plane != wanted:
            self.close()
            raise BackendUnavailableError(f"{ENV}={wanted} cannot be used in this job: {why}")
        if self._debug and self.rank == 0:
            print(f"smddp: CPU plane: {self.plane} ({why})", file=sys.stderr, flush=True)

    def _choose(self, wanted: str, local) -> Tuple[str, str]:
        local_size = local.Get_size()
        sizes = self.comm.allgather(local_size)
        if local_size == self.size:
            self._shm = open_plane(local, "world")
            if self._shm is None:
                return "mpi", "no usable shared memory on this host"
            return "shm", f"all {self.size} ranks share one host"
        if min(sizes) != max(sizes) or local_size == 1:
            return "mpi", (f"ranks per host {sorted(set(sizes))}: the hierarchical plane needs the same "
                           f"number of ranks, 2 or more, on every host")
        shm = open_plane(local, "host")
        # Every host must have its plane, or none does.
        if self.comm.allreduce(0 if shm is None else 1, op=MPI.MIN) == 0:
            if shm is not None:
                shm.close()
            return "mpi", "a host has no usable shared memory"
        self._shm = shm
        self._across = self.comm.Split(color=local.Get_rank(), key=self.rank)
        return "hierarchical", f"{self.size // local_size} hosts of {local_size} ranks"

    def _used(self, collective: str, plane: str) -> None:
        key = (collective, plane)
        if key in self.planes_used:  # every call but the first: one lookup
            return
        self.planes_used.add(key)
        if self._debug:
            print(f"smddp: rank {self.rank}: {collective} on the {plane} plane", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        if self.plane == "shm":
            # The first call: from now on the plane's own all_reduce is this communicator's,
            # one Python call less on the path of small all-reduces.
            self._used("all_reduce", "shm")
            self.all_reduce = self._shm.all_reduce
            return self._shm.all_reduce(tensor, op)
        nbytes = tensor.numel() * tensor.element_size()
        if self.plane == "hierarchical" and nbytes >= HIERARCHICAL_MIN_BYTES:
            self._used("all_reduce", "hierarchical")
            return self._shm.all_reduce_across(tensor, op, self._across, _MPI_OPS[op], _mpi_type, self.size)
        self._used("all_reduce", "mpi")
        return super().all_reduce(tensor, op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        """Rank r receives the reduction of slice r of flat ``input`` (``size * output.numel()`` elements)."""
        if self.plane == "shm":
            self._used("reduce_scatter", "shm")
            return self._shm.reduce_scatter(output, input, op)
        self._used("reduce_scatter", "mpi")
        return super().reduce_scatter(output, input, op, tag)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        if self.plane == "shm":
            self._used("broadcast", "shm")
            return self._shm.broadcast(tensor, src)
        self._used("broadcast", "mpi")
        return super().broadcast(tensor, src, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        if self.plane == "shm":
            self._used("all_gather", "shm")
            return self._shm.all_gather(output, input)
        self._used("all_gather", "mpi")
        return super().all_gather(output, input, tag)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_counts: Sequence[int],
                          input_counts: Sequence[int], tag: int) -> Pending:
        if self.plane == "shm" and self._shm.native:  # every rank of the plane voted the same way
            self._used("all_to_all_single", "shm")
            return self._shm.all_to_all(output, input, output_counts, input_counts)
        self._used("all_to_all_single", "mpi")
        return super().all_to_all_single(output, input, output_counts, input_counts, tag)

    def barrier(self, tag: int) -> Pending:
        if self.plane == "shm":
            self._used("barrier", "shm")
            return self._shm.barrier()
        self._used("barrier", "mpi")
        return super().barrier(tag)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._across is not None and not MPI.Is_finalized():
            self._across.Free()
            self._across = None
        super().close()
