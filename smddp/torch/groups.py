"""Creating smddp's process groups, and the live ones: the world and its subgroups.

torch calls :func:`create` (registered as the ``"smddp"`` backend by :func:`register`) for
the world group at ``init_process_group`` and for every ``new_group``, ``new_subgroups``
and DeviceMesh group after it, on the member ranks only. Every group is built the same
way: a :class:`~smddp.comm.base.Context` (the group's topology, timeout and store), its
communicators, an :class:`~smddp.comm.engine.Engine` over them, the
:class:`~smddp.torch.process_group.SmddpProcessGroup`, and torch-native backends for
torch's functional collectives (:mod:`smddp.torch._functional_backends`).

A subgroup gets communicators of its own (:mod:`smddp.comm.subgroups`) and an engine of its
own (its own sequence numbers, deadlines and stall reports, which name global ranks and the
group). smddp's own v1 functions (``smddp.torch.distributed.all_reduce`` ...) keep the
reference's rule: they take only ``group.WORLD``; ``torch.distributed`` calls take any group.

This module keeps the live groups: :func:`current` (the world) and the subgroups, which
:func:`destroy` closes with it.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as tdist

from smddp import _compat, comm, knobs
from smddp.comm import subgroups
from smddp.comm.base import Context
from smddp.comm.engine import Engine, debug
from smddp.comm.store import world_namespace
from smddp.errors import InvalidGroupError
from smddp.job import limits, placement, run_delay
from smddp.job.topology import Topology, discover
from smddp.torch import _functional_backends, _init_methods, _labels
from smddp.torch.delegating_group import DelegatingProcessGroup
from smddp.torch.process_group import BACKEND_NAME, SmddpProcessGroup

__all__ = ["current", "create", "destroy", "register", "request_backend", "resolve_timeout"]

_requested_backend: Optional[str] = None
_world: Optional[SmddpProcessGroup] = None
_world_topology: Optional[Topology] = None
#: The live world's key namespace (:func:`smddp.comm.store.world_namespace`): its subgroups' too.
_world_keys = ""
_lock = threading.Lock()
_subgroups: List[SmddpProcessGroup] = []
#: Under ``SMDDP_DEBUG``, the main thread's run delay since the world was asked for.
_world_meter: Optional[run_delay.Meter] = None

#: torch destroys the world group through its shutdown() (see _compat): then ``_world``
#: alone says whether it is live, and current() costs no call into torch (it is on the path
#: of every smdistributed-API call).
_DESTROY_CALLS_SHUTDOWN = _compat.DESTROY_CALLS_SHUTDOWN


def current() -> Optional[SmddpProcessGroup]:
    """The active smddp world group, if torch's default group is still it."""
    if _world is None or not (_DESTROY_CALLS_SHUTDOWN or tdist.is_initialized()):
        return None
    return _world


def request_backend(name: Optional[str]) -> None:
    """The backend the next world group should use (None: ``SMDDP_BACKEND`` or automatic)."""
    global _requested_backend
    _requested_backend = name


def resolve_timeout(torch_timeout: timedelta) -> timedelta:
    """The collective timeout: ``SMDDP_TIMEOUT`` seconds when torch's is its default.

    Args:
        torch_timeout: the timeout torch passes (``init_process_group(timeout=...)``).

    Returns:
        ``torch_timeout``, or ``SMDDP_TIMEOUT`` seconds when it is set and
        ``torch_timeout`` is torch's default.

    Raises:
        InvalidArgumentError: ``SMDDP_TIMEOUT`` is not a number of seconds above 0 (``none``: no
            deadline, :data:`smddp.knobs.NO_DEADLINE_S`); 0 and negative numbers are refused, as
            torch's stores would give up at once.
    """
    seconds = knobs.value("SMDDP_TIMEOUT")
    if seconds is not None and torch_timeout == _compat.default_timeout():
        return timedelta(seconds=seconds)
    return torch_timeout


def register() -> None:
    """Register the ``"smddp"`` backend with ``torch.distributed`` (idempotent).

    Also teaches torch's ``env://``, ``tcp://`` and ``file://`` rendezvous to read the job
    from the launcher (:mod:`smddp.torch._init_methods`): under ``mpirun`` or ``srun`` no
    ``MASTER_ADDR``/``MASTER_PORT`` is needed, and a plain ``python train.py`` is a world of one.
    """
    _compat.register_backend(BACKEND_NAME, create, ("cpu", "cuda", "xpu"))
    _init_methods.install()


# ---------------------------------------------------------------------------- creation
def create(options, backend_options=None) -> SmddpProcessGroup:
    """The smddp process group torch asks for: the world, or a subgroup once the world exists.

    Args:
        options: torch's backend options (``store``, ``group_rank``, ``group_size``,
            ``timeout``, and for a subgroup ``global_ranks_in_group`` and ``group_id``).
        backend_options: unused (torch's extended API passes it).

    Raises:
        InvalidGroupError: a subgroup was asked for while the default group is not smddp's.
        BackendUnavailableError: no backend can serve the group (the error says what can).
    """
    global _world, _world_topology, _world_keys, _world_meter
    timeout = resolve_timeout(options.timeout)
    name = getattr(options, "group_id", "") or ""
    if not tdist.is_initialized():
        _world_keys = world_namespace()
    # Every key a group writes is its own by construction: torch's store for the group is
    # already under the group's own prefix (the world's, or the name torch gave the subgroup,
    # the same on every member), and the world's namespace sets apart an earlier world that
    # shared the store (a torchrun restart attempt, a destroy and a new init).
    store = tdist.PrefixStore(_world_keys, options.store)
    device = _compat.requested_device_id()  # init_process_group's or new_group's device_id
    if tdist.is_initialized():
        topology, ranks = _subgroup_topology(options)
        # Its gloo connections (one per peer) and its segment's mapping: said now, with the limit
        # named, rather than by gloo's threads aborting the process when it runs out.
        limits.check_open_files(topology.size, f"process group {name!r}", len(_subgroups) + 1)
        parent = _world.delegate
        if device is None and parent is not None:
            device = parent.device  # a subgroup's device tensors live on its members' device
        ctx = Context(topology, timeout, store, device)
        communicators = subgroups.subgroup_communicators(_world.engine.comms, ranks, ctx)
        backend = parent.name if parent is not None else None
        # torch's rule: a subgroup's NCCL communicator is split from the world's where the world is
        # bound to its device (torch then makes the non-members' side of the split itself).
        split = parent if getattr(_world, "bound_device_id", None) is not None else None
    else:
        # A world group torch destroyed without calling its shutdown() (older torch calls it
        # only on NCCL's groups): close it before its successor opens, or its threads and
        # shared memory would stay until exit, one set per init_process_group().
        destroy()
        _tear_down_at_exit()
        topology, ranks = _world_topology_for(options.group_rank, options.group_size), None
        # Before any thread of the world's: they inherit the rank's share of the host's CPUs (issue 55).
        placed = placement.place(topology)
        if placed is not None and debug.enabled():
            print(placed, file=sys.stderr, flush=True)
        meter = run_delay.Meter() if debug.enabled() else None
        # smddp's init_process_group has chosen the backend already (and probed the machine for it).
        backend = _requested_backend or comm.choose_backend(None, os.environ, topology, comm.probe())
        ctx = Context(topology, timeout, store, device)
        communicators = comm.create_communicators(backend, ctx)
        split = None
    try:
        delegate = None if backend is None else comm.create_delegate(
            backend, ctx, communicators["cpu"], name, ranks, split)
    except BaseException:
        for made in {id(c): c for c in communicators.values()}.values():
            made.close()
        raise
    # The world's engine opens the process's stall channel on the world's store; each subgroup's
    # asks and answers through it (no store connection or thread of a group's own).
    engine = Engine(communicators, timeout.total_seconds(), store if ranks is None else None, _labels.ADVICE)
    if ranks is not None:
        engine.describe_group(name, ranks, _world.engine.stall_channel)
    if delegate is None:
        group = SmddpProcessGroup(engine, topology.rank, topology.size, on_shutdown=_shut_down)
    else:
        group = DelegatingProcessGroup(engine, topology.rank, topology.size, delegate, on_shutdown=_shut_down)
        if ranks is None and device is not None:
            # As torch binds its own group to init_process_group's device_id: its subgroups then split.
            group.bound_device_id = delegate.device
    _compat.set_group_name(group, name)
    group.native_backends = _functional_backends.attach(
        group, store, topology.rank, topology.size, timeout, name, delegate, ranks)
    if ranks is None:
        _world, _world_topology, _world_meter = group, topology, meter
    else:
        with _lock:
            _subgroups.append(group)
    return group


def _world_topology_for(rank: int, size: int) -> Topology:
    found = discover(os.environ)
    if (found.rank, found.size) == (rank, size):
        return found
    launcher = "explicit" if found.launcher == "none" else found.launcher
    # Ranks given as arguments (Lightning's launcher, mp.spawn) where the environment counts another
    # world: nothing here says which ranks share this host, so none is claimed; the group's agreed
    # layout finds the host-mates (smddp.comm.planes.layout) and gives the local rank.
    local_size = found.local_size if found.size == size else 1
    return dataclasses.replace(
        found, rank=rank, size=size, local_size=local_size, local_rank=rank % local_size,
        node_rank=rank // local_size, launcher=launcher,
    )


def _subgroup_topology(options):
    """This process's topology in the subgroup torch asked for, and the members' global ranks."""
    if _world is None or _world_topology is None:
        raise InvalidGroupError(
            "new_group(backend='smddp') needs smddp's default group: call "
            "torch.distributed.init_process_group(backend='smddp') first"
        )
    ranks = subgroups.members(getattr(options, "global_ranks_in_group", None) or range(options.group_size))
    if len(ranks) != options.group_size:
        raise InvalidGroupError(f"torch asked for a group of {options.group_size} ranks but named {ranks}")
    return subgroups.group_topology(_world_topology, ranks), ranks


# ---------------------------------------------------------------------------- ending
def _shut_down(group: SmddpProcessGroup) -> None:
    """``destroy_process_group(group)`` (torch calls the group's ``shutdown()``): close it now."""
    if group.engine.global_ranks is None:
        if group is _world:
            destroy()
        return
    with _lock:
        live = any(g is group for g in _subgroups)
        _subgroups[:] = [g for g in _subgroups if g is not group]
    if live:
        _close(group)


def destroy() -> None:
    """Close the world group and every subgroup, and forget them (torch's own groups are
    destroyed by the caller)."""
    global _world, _world_meter
    with _lock:
        closing, _subgroups[:] = list(_subgroups), []
    if _world is not None:
        closing.append(_world)
        said = _world_meter.report(_world_topology.rank) if _world_meter is not None else None
        if said is not None:  # SMDDP_DEBUG: whether the job's CPUs were taken (issue 55)
            print(said, file=sys.stderr, flush=True)
        _world, _world_meter = None, None
    for group in closing:
        _close(group)


def _close(group: SmddpProcessGroup) -> None:
    """Close ``group``'s engine, then stop its torch-native backends' threads now.

    A script may keep the group object alive (``pg = dist.group.WORLD``) past
    ``destroy_process_group()``; its gloo backend would then be torn down during interpreter
    shutdown, where its threads abort the process after the script has succeeded.
    """
    group.engine.close()
    devices = list(group.native_backends)
    if group.delegate is not None:
        devices.append(group.delegate.device_type)
    for device in devices:
        try:
            _compat.device_backend(group, torch.device(device)).shutdown()
        except Exception:  # noqa: BLE001 - a backend without shutdown, or already gone
            pass


_exit_hook_registered = False


def _tear_down_at_exit() -> None:
    """Destroy the groups when the interpreter exits, before it stops its threads.

    Registered before the engine exists, so it runs after the engine's own exit handling
    (``atexit`` runs handlers last-in first-out). Left to interpreter shutdown, gloo's and
    the engine's threads can wake while Python is finalizing and abort the process
    ("terminate called without an active exception") after the script has succeeded.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True

    def tear_down() -> None:
        if current() is None:
            return
        try:
            destroy()
            tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; nothing to report to
            pass

    atexit.register(tear_down)
