"""Subgroups: communicators over some of the job's ranks.

``torch.distributed.new_group``, ``new_subgroups`` and DeviceMesh create a group of some
ranks on those ranks only (like ``MPI_Comm_create_group``). Each group gets communicators of
its own (so its traffic never mixes with the parent's) and, one level up, an engine of its
own (so its own sequence numbers, deadlines and stall reports).

How each backend makes a subgroup:

- a communicator with a ``subgroup(ranks, ctx)`` method makes its own (``mpi``:
  ``MPI_Comm_create_group`` over the member ranks of ``MPI_COMM_WORLD``);
- ``nccl``: its ``subgroup`` makes a new NCCL communicator (at the group's first collective),
  whose unique id member rank 0 puts in the group's own store (torch gives every group a
  store prefix of its own, so the key cannot collide);
- any other CPU communicator (``gloo``): torch's gloo over the group's store
  (:data:`smddp.comm.backends.cpu.OVER_A_STORE`);
- a group of one: the ``local`` communicator (nothing to exchange, :data:`~smddp.comm.backends.cpu.ALONE`).

A delegating backend's device tensors (``torch-nccl``, ``xccl``) go to a torch backend object of the
subgroup's own, made by :func:`smddp.comm.create_delegate`; only its CPU communicator is made here.

Ranks: ``ranks`` are *global* ranks, in group-rank order (group rank ``i`` is global rank
``ranks[i]``), as torch passes them (``global_ranks_in_group``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from smddp.comm.backends import cpu
from smddp.comm.base import Communicator, Context
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.job.topology import Topology


def group_topology(world: Topology, ranks: Sequence[int]) -> Topology:
    """This process's topology within the group of global ``ranks``.

    Local ranks count the members on this host (hosts are taken from the world's
    ``node_rank``, which assumes ``local_size`` ranks per host, as SageMaker and every
    launcher here do).

    Raises:
        InvalidArgumentError: this process is not one of ``ranks``.
    """
    if world.rank not in ranks:
        raise InvalidArgumentError(f"rank {world.rank} is not a member of the group of ranks {list(ranks)}")
    per_host = max(world.local_size, 1)
    here = [r for r in ranks if r // per_host == world.rank // per_host]
    return dataclasses.replace(
        world, rank=list(ranks).index(world.rank), size=len(ranks),
        local_rank=here.index(world.rank), local_size=len(here),
        node_rank=len({r // per_host for r in ranks if r // per_host < world.rank // per_host}),
        # A subgroup never meets over MPI_COMM_WORLD: its members exchange through the
        # group's own store (or, for MPI, a communicator of their own).
        launcher="explicit" if world.mpi else world.launcher,
    )


def subgroup_communicators(parent: Dict[str, Communicator], ranks: Sequence[int],
                           ctx: Context) -> Dict[str, Communicator]:
    """Communicators for the group of global ``ranks``, one per device type the parent serves.

    Called by the group's members only, in the same order on each of them.

    Args:
        parent: the world group's communicators (device type to communicator).
        ranks: the members' global ranks, in group-rank order.
        ctx: the group's context: its topology (:func:`group_topology`), timeout and store.

    Returns:
        device type to communicator, the parent's primary device first.

    Raises:
        BackendUnavailableError: a device backend that cannot make subgroups (the message
            names it and says what works instead).
    """
    made: Dict[int, Communicator] = {}
    out: Dict[str, Communicator] = {}
    try:
        for device, comm in parent.items():
            if id(comm) not in made:
                made[id(comm)] = _one(comm, ranks, ctx)
            out[device] = made[id(comm)]
    except BaseException:
        for comm in made.values():
            comm.close()
        raise
    return out


def _one(comm: Communicator, ranks: Sequence[int], ctx: Context) -> Communicator:
    if len(ranks) == 1:
        return cpu.load(cpu.ALONE)(ctx)
    found = getattr(comm, "plane_settings", None)
    if found is not None:
        # A CPU communicator of the world's kind: the members' own flat one, then the best
        # plane for where they are (a subgroup on one host gets shared memory).
        from smddp.comm.planes import choose

        # the members' layout (their hosts, their settings): the world's, restricted to them
        ctx = choose.meet_within(ctx, found, getattr(comm, "layout", None), list(ranks))
        flat = _flat(getattr(comm, "flat", comm), ranks, ctx)
        try:
            return choose.compose(flat, ctx, found, f"g{len(ranks)}")
        except BaseException:
            flat.close()
            raise
    return _flat(comm, ranks, ctx)


def _flat(comm: Communicator, ranks: Sequence[int], ctx: Context) -> Communicator:
    """``comm``'s kind of communicator over ``ranks``, with no plane."""
    make = getattr(comm, "subgroup", None)
    if make is not None:
        return make(ranks, ctx)
    if comm.device_types == ("cpu",):
        if ctx.store is None:
            raise BackendUnavailableError(
                f"a subgroup of the {comm.name!r} backend needs the group's store; create it with "
                f"torch.distributed.new_group, which provides one"
            )
        return cpu.load(cpu.OVER_A_STORE)(ctx)
    raise BackendUnavailableError(
        f"the {comm.name!r} backend cannot make subgroups; use the default on GPUs (torch-nccl, xccl) or a "
        f"CPU backend (mpi, gloo) for torch.distributed.new_group and DeviceMesh"
    )


def members(ranks: Sequence[int]) -> List[int]:
    """``ranks`` as a list of ints, checked: no duplicates, none negative.

    Raises:
        InvalidArgumentError: a duplicate or negative rank.
    """
    out = [int(r) for r in ranks]
    if len(set(out)) != len(out) or any(r < 0 for r in out):
        raise InvalidArgumentError(f"a group's ranks must be distinct and non-negative, got {out}")
    return out
