"""A group's CPU communicator: the fastest plane its layout allows, over MPI or gloo.

The registry (:mod:`smddp.comm`) calls :func:`build` for every group's CPU tensors, whatever
launched the job. First, through the group's store, the ranks agree on one layout
(:func:`meet`, :mod:`smddp.comm.planes.layout`): which of them share a host, what each host can run,
and the settings every rank then uses. The *flat* communicator is the backend's own (``mpi``
under an MPI launcher, ``gloo`` otherwise, ``local`` for one rank); over it this module composes:

============== ================================================== ===============================
plane          when (automatic)                                    communicator
============== ================================================== ===============================
``shm``        every rank of the group on one host                 :class:`ShmCommunicator`
``hierarchical`` several hosts, the same number (2 or more) on each :class:`HierarchicalCommunicator`
flat           one rank per host, uneven hosts, no usable /dev/shm the flat one (``mpi``/``gloo``)
============== ================================================== ===============================

``SMDDP_CPU_PLANE`` pins the choice (``auto``, ``shm``, ``hierarchical``, ``mpi``, ``gloo``): a
pinned plane the job cannot have is an error, ``mpi`` and ``gloo`` name the flat communicator.
The environment is read once, by :func:`settings`, when the world group is made; subgroups
use the same settings. What a rank's settings propose, the group's layout decides: the pinned
plane, the shared-memory sizes and the thresholds are the same on every rank. The chosen plane
and the reason are the communicator's ``plane`` and ``plane_reason``; ``SMDDP_DEBUG=1`` prints
them on the group's rank 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

import torch.distributed as tdist

from smddp import knobs
from smddp.comm.backends import cpu
from smddp.comm.base import Communicator, Context
from smddp.comm.planes import hostmates, layout
from smddp.errors import BackendUnavailableError

ENV = "SMDDP_CPU_PLANE"
PLANES = ("auto", "shm", "hierarchical", "mpi", "gloo")


@dataclass(frozen=True)
class PlaneSettings:
    """This rank's environment's say on CPU planes, read once per world group: what it proposes
    to the group's agreed layout (:mod:`smddp.comm.planes.layout`), which has the last word.

    Attributes:
        plane: ``SMDDP_CPU_PLANE`` (``auto`` when unset).
        native: ``SMDDP_SHM_NATIVE`` is not off (the compiled core may run the plane).
        hierarchical_min_bytes: ``SMDDP_HIERARCHICAL_MIN_BYTES``: smaller all-reduces stay
            flat on the hierarchical plane (the extra steps cost more than the bytes they save).
        debug: ``SMDDP_DEBUG`` is set: print the plane chosen and each collective's first plane.
        slot: ``SMDDP_SHM_SLOT_BYTES``: bytes of each shared-memory buffer.
        chunk_bytes: ``SMDDP_SHM_CHUNK_BYTES``: bytes per step of the compiled core's larger collectives.
        one_shot_max: ``SMDDP_SHM_ONE_SHOT_MAX``: the compiled core's one-step all-reduce limit.
        cma: ``SMDDP_SHM_CMA`` is on (this rank offers the single-copy all-reduce).
        cma_min_bytes: ``SMDDP_SHM_CMA_MIN_BYTES``: the single-copy all-reduce's threshold.
    """

    plane: str = "auto"
    native: bool = True
    hierarchical_min_bytes: int = 256 * 1024
    debug: bool = False
    slot: int = 4 << 20
    chunk_bytes: int = 1 << 20
    one_shot_max: int = 32 << 10
    cma: bool = False
    cma_min_bytes: int = 64 << 20


def settings(env: Mapping[str, str] = os.environ) -> PlaneSettings:
    """Read the CPU-plane settings from ``env``.

    Raises:
        BackendUnavailableError: ``SMDDP_CPU_PLANE`` is not one of :data:`PLANES`.
        InvalidArgumentError: a byte count that does not parse (the error names the variable).
    """
    plane = knobs.value(ENV, env).lower()
    if plane not in PLANES:
        raise BackendUnavailableError(f"{ENV}={plane!r} is not a CPU plane; use one of: {', '.join(PLANES)}")
    return PlaneSettings(
        plane=plane,
        native=knobs.value("SMDDP_SHM_NATIVE", env),
        hierarchical_min_bytes=knobs.value("SMDDP_HIERARCHICAL_MIN_BYTES", env),
        debug=knobs.value("SMDDP_DEBUG", env),
        slot=knobs.value("SMDDP_SHM_SLOT_BYTES", env),
        chunk_bytes=knobs.value("SMDDP_SHM_CHUNK_BYTES", env),
        one_shot_max=knobs.value("SMDDP_SHM_ONE_SHOT_MAX", env),
        cma=knobs.value("SMDDP_SHM_CMA", env),
        cma_min_bytes=knobs.value("SMDDP_SHM_CMA_MIN_BYTES", env),
    )


def flat_backend(name: str, plane: str) -> str:
    """The flat backend for CPU tensors: ``name`` (``mpi``, ``gloo``, ``local``), unless ``plane``
    (the group's ``SMDDP_CPU_PLANE``) pins ``gloo`` under MPI."""
    return "gloo" if name == "mpi" and plane == "gloo" else name


def flat_class(name: str):
    """The communicator class of flat backend ``name`` (imported on demand: mpi4py starts MPI).

    Raises:
        BackendUnavailableError: ``name`` is not a CPU backend (:mod:`smddp.comm.backends.cpu`).
    """
    return cpu.load(name)


def meet(ctx: Context, found: PlaneSettings) -> Context:
    """``ctx`` with the group's agreed layout (:mod:`smddp.comm.planes.layout`), found through its store.

    Called by every rank of the group, in the same order on each, before its communicators are
    made (gloo binds its sockets by the layout). Where rank and size came as arguments (the
    ``explicit`` launcher: Lightning's, ``mp.spawn``), the local rank, local size and host index
    are the layout's too. A group of one, or one without a store, has no layout (``ctx.layout``
    stays None).

    Raises:
        BackendUnavailableError: a rank published something that is not a layout proposal.
    """
    if ctx.topology.size == 1 or ctx.store is None:
        return ctx
    from smddp.comm.planes import shm, shm_cma
    from smddp.comm.planes.shm_segment import missing_dir, supported

    tuning = {"slot": found.slot, "chunk": found.chunk_bytes, "one_shot": found.one_shot_max,
              "cma_min": found.cma_min_bytes, "hier_min": found.hierarchical_min_bytes}
    core = found.native and shm.native is not None
    offer = shm_cma.offer() if core and found.cma else None
    mine = layout.proposal(found.plane, supported(), core, core and bool(shm.native.HAVE_FLOAT16), tuning,
                           cma=offer)
    agreed = layout.agree(_plane_store(ctx), ctx.topology.rank, ctx.topology.size, mine, shm_cma.refusal)
    missing = missing_dir() if ctx.topology.rank == 0 else None
    if missing is not None:
        warnings.warn(f"smddp: {missing}", RuntimeWarning, stacklevel=2)
    return _with_layout(ctx, agreed)


def meet_within(ctx: Context, found: PlaneSettings, world: Optional[layout.Layout], ranks: List[int]) -> Context:
    """``ctx`` with a subgroup's layout: the world's restricted to the global ``ranks``
    (:func:`smddp.comm.planes.layout.restrict`), with no exchange; :func:`meet` where the world has
    no layout (a world of one, or made without a store)."""
    if ctx.topology.size == 1 or world is None:
        return meet(ctx, found)
    return _with_layout(ctx, layout.restrict(world, ranks, ctx.topology.rank))


def _with_layout(ctx: Context, agreed: layout.Layout) -> Context:
    topology = ctx.topology
    if topology.launcher == "explicit":
        # Rank and size came as arguments: no launcher counted this host's ranks; the group did.
        mates = agreed.mates
        topology = dataclasses.replace(topology, local_rank=mates.local_rank, local_size=mates.local_size,
                                       node_rank=mates.host)
    return dataclasses.replace(ctx, layout=agreed, topology=topology)


def build(name: str, ctx: Context, found: PlaneSettings, group: str = "world") -> Communicator:
    """The CPU communicator of a group: flat backend ``name``, composed with its best plane.

    Args:
        name: ``mpi``, ``gloo`` or ``local``.
        ctx: the group's context (its store is how the ranks meet).
        found: :func:`settings`.
        group: a name for the group, part of the shared-memory segment's name.

    Raises:
        BackendUnavailableError: the backend cannot start, or a pinned plane cannot be had.
    """
    ctx = meet(ctx, found)
    plane = ctx.layout.plane if ctx.layout is not None else found.plane
    flat = flat_class(flat_backend(name, plane))(ctx)
    try:
        return compose(flat, ctx, found, group)
    except BaseException:
        flat.close()
        raise


def compose(flat: Communicator, ctx: Context, found: PlaneSettings, group: str = "world") -> Communicator:
    """``flat`` itself, or a plane over it: see the module's table.

    Called by every rank of the group, in the same order on each (it meets the others
    through ``ctx.store``), with ``ctx`` from :func:`meet`. On failure ``flat`` is left open
    for the caller to close.
    """
    agreed = ctx.layout
    pinned = agreed.plane if agreed is not None else found.plane
    comm, why = _choose(flat, ctx, pinned, found.debug, group)
    if pinned == "shm" and comm is not flat:
        comm.open()  # asked for by name: had now, or refused now, not at the first collective
    if pinned in ("shm", "hierarchical") and comm.plane != pinned:
        if comm is not flat:
            comm.close()
        raise BackendUnavailableError(f"{ENV}={pinned} cannot be used in this job: {why}")
    comm.plane_reason = why
    comm.plane_settings = found
    comm.layout = agreed
    if comm.rank == 0 and agreed is not None and agreed.differs:
        warnings.warn(
            f"smddp: the ranks of this group set {', '.join(agreed.differs)} differently; every rank uses "
            f"the group's rank 0's values (SMDDP_SHM_SLOT_BYTES: the smallest asked for)",
            RuntimeWarning, stacklevel=2)
    if found.debug and comm.rank == 0:
        where = "" if group == "world" else f" of group {group!r}"
        print(f"smddp: CPU plane{where}: {comm.plane} ({why})", file=sys.stderr, flush=True)
        if comm.plane == "shm":
            host = agreed.mates.host
            single = (f"from {agreed.cma_min_bytes} bytes" if agreed.cma[host] and agreed.native[host]
                      else f"off ({agreed.cma_why[host] or 'the Python path'})")
            print(f"smddp: single-copy all-reduce{where}: {single}", file=sys.stderr, flush=True)
    return comm


def _plane_store(ctx: Context):
    return tdist.PrefixStore("smddp/cpu-plane/", ctx.store)


def _choose(flat: Communicator, ctx: Context, pinned: str, debug: bool, group: str
            ) -> Tuple[Communicator, str]:
    from smddp.comm.planes import shm
    from smddp.comm.planes.communicators import HierarchicalCommunicator, ShmCommunicator

    if flat.size == 1:
        return flat, "a group of one rank"
    if pinned in ("mpi", "gloo"):
        return flat, f"{ENV}={pinned}"
    agreed = ctx.layout
    if agreed is None:
        return flat, "no store to meet through"
    if not agreed.same_protocol:
        return flat, "the ranks run smddp versions whose shared-memory protocols differ"
    mates = agreed.mates
    sizes = sorted({len(members) for members in mates.hosts})
    nhosts = len(mates.hosts)
    if nhosts > 1 and (len(sizes) > 1 or sizes[0] == 1):
        return flat, (f"ranks per host {sizes}: the hierarchical plane needs the same number of ranks, "
                      f"2 or more, on every host")
    store = _plane_store(ctx)
    channel = hostmates.HostChannel(store, mates, ctx.timeout)
    if nhosts == 1:
        # The segment is made at the group's first collective, within the process's bound
        # (smddp.comm.planes.shm_segment); where there is none, the group's collectives go flat.
        comm = ShmCommunicator(ctx, None, flat, debug, opener=lambda: shm.open_plane(channel, agreed, group))
        return comm, f"all {flat.size} ranks share one host"
    plane = shm.open_plane(channel, agreed, group)
    # Every host must have its plane, or none uses one.
    if mates.local_rank == 0:
        store.set(f"plane/{mates.host}", "1" if plane is not None else "0")
    if not all(store.get(f"plane/{h}") == b"1" for h in range(nhosts)):
        if plane is not None:
            plane.close()
        return flat, "a host has no usable shared memory"
    try:
        across = _across(flat, ctx, mates)
    except BaseException:
        plane.close()
        raise
    comm = HierarchicalCommunicator(ctx, plane, across, flat, debug)
    return comm, f"{nhosts} hosts of {mates.local_size} ranks"


def _across(flat: Communicator, ctx: Context, mates: hostmates.Hostmates) -> Communicator:
    """A communicator of the ranks with this rank's local index, one per host (host order)."""
    split = getattr(flat, "split", None)
    if split is not None:  # MPI: MPI_Comm_split of the group's own communicator
        return split(color=mates.local_rank, key=mates.host)
    topology = dataclasses.replace(
        ctx.topology, rank=mates.host, size=len(mates.hosts), local_rank=0, local_size=1, node_rank=mates.host)
    store = tdist.PrefixStore(f"smddp/across/{mates.local_rank}/", ctx.store)
    return type(flat)(dataclasses.replace(ctx, topology=topology, store=store))


def companion(topology, mpi4py: bool, found: Optional[PlaneSettings] = None) -> str:
    """The flat CPU backend that serves CPU tensors next to a device backend.

    Returns:
        ``"local"`` for a world of one started without a launcher, ``"mpi"`` under an MPI
        launcher with mpi4py (unless ``SMDDP_CPU_PLANE=gloo``), else ``"gloo"``.
    """
    if not topology.distributed and topology.size == 1:
        return "local"
    if topology.mpi and mpi4py:
        return flat_backend("mpi", (found or PlaneSettings()).plane)
    return "gloo"
