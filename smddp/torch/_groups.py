"""Subgroups of the smddp backend: ``new_group``, ``new_subgroups``, DeviceMesh.

torch creates a group's backend on the group's members only, with the members' global
ranks (``global_ranks_in_group``) and a store prefix of the group's own. The group gets its
own communicators (:mod:`smddp.comm.groups`), its own engine (its own sequence numbers,
deadlines and stall reports, which name global ranks and the group) and, like the world,
torch-native backends for torch's functional collectives.

smddp's own v1 functions (``smddp.torch.distributed.all_reduce`` ...) keep the reference's
rule: they take only ``group.WORLD``. ``torch.distributed`` calls take any group.
"""

from __future__ import annotations

import threading
from typing import List

from smddp._topology import Topology
from smddp.comm import groups as _comm_groups
from smddp.comm.base import Context
from smddp.comm.engine import Engine
from smddp.errors import InvalidGroupError
from smddp.torch import _native

_lock = threading.Lock()
_live: List = []


def create_subgroup(options, world, world_topology: Topology, timeout):
    """The smddp process group torch asked for with ``new_group`` (on a member rank).

    Args:
        options: torch's backend options (``store``, ``group_rank``, ``group_size``,
            ``global_ranks_in_group``, ``group_id``).
        world: the world's :class:`~smddp.torch.process_group.SmddpProcessGroup`.
        world_topology: this process's topology in the world.
        timeout: the group's timeout (a ``datetime.timedelta``).

    Returns:
        A new :class:`~smddp.torch.process_group.SmddpProcessGroup` over the members.

    Raises:
        InvalidGroupError: the default group is not smddp's (a subgroup needs smddp's world).
        BackendUnavailableError: the world's backend cannot make subgroups (says what can).
    """
    from smddp.torch.process_group import SmddpProcessGroup

    if world is None or world_topology is None:
        raise InvalidGroupError(
            "new_group(backend='smddp') needs smddp's default group: call "
            "torch.distributed.init_process_group(backend='smddp') first"
        )
    ranks = _comm_groups.members(getattr(options, "global_ranks_in_group", None) or range(options.group_size))
    if len(ranks) != options.group_size:
        raise InvalidGroupError(f"torch asked for a group of {options.group_size} ranks but named {ranks}")
    topology = _comm_groups.group_topology(world_topology, ranks)
    name = getattr(options, "group_id", "") or ""
    ctx = Context(topology, timeout, options.store)
    communicators = _comm_groups.subgroup_communicators(world.engine.comms, ranks, ctx)
    engine = Engine(communicators, timeout.total_seconds(), options.store)
    engine.describe_group(name, ranks)
    group = SmddpProcessGroup(engine, topology.rank, topology.size)
    group._set_group_name(name)
    group.native_backends = _native.attach(group, options.store, topology.rank, topology.size, timeout, name)
    with _lock:
        _live.append(group)
    return group


def forget(group) -> bool:
    """Forget one subgroup; True if it was still live (the caller closes it)."""
    with _lock:
        for i, live in enumerate(_live):
            if live is group:
                del _live[i]
                return True
    return False


def forget_all() -> List:
    """The subgroups created so far, forgotten here (the caller closes them)."""
    with _lock:
        out, _live[:] = list(_live), []
    return out
