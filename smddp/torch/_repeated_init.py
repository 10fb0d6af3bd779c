"""A repeated ``init_process_group()``: harmless when it asks for the running world, else an error.

Scripts written for SageMaker sometimes initialize twice: the script calls
``init_process_group()``, then a library it uses calls it again, usually with no arguments
(NeMo's SageMaker set-up does; smdistributed's reference says only that the function must be
called first). torch refuses every second default initialization ("trying to initialize the
default process group twice!"). smddp keeps the repeated call a script relies on and drops
no argument in silence: once initialized, a call that asks for nothing (no arguments) or only
for what the running world already is (its backend, timeout, rank, world size, and the
rendezvous and device it was made with) returns and changes nothing; a call that asks for
anything else raises :class:`~smddp.errors.InvalidArgumentError`, naming each such argument
beside the world's own value, before anything changes. ``destroy_process_group()`` first
makes the next call initialize a new world with its arguments.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional

import torch

from smddp.errors import InvalidArgumentError, InvalidTypeError
from smddp.torch import groups

#: Arguments that say how a world's ranks met and which device it binds: they can be compared
#: only with what the call that made the world was given (:func:`remember`).
_MADE_WITH = ("init_method", "store", "group_name", "pg_options", "device_id")
#: ``backend`` values that ask for nothing in particular (the automatic choice).
_ANY_BACKEND = (None, "", "auto", "smddp")


def remember(world: Any, kwargs: Mapping[str, Any]) -> None:
    """Note the rendezvous and device arguments smddp's ``init_process_group`` made ``world`` with.

    Args:
        world: the world group just made (:func:`smddp.torch.groups.current`).
        kwargs: the call's keyword arguments.
    """
    # On the group itself: a world torch's own init_process_group made has none, and the note
    # goes with its group (nothing here outlives a destroyed world).
    world.made_with = {name: kwargs.get(name) for name in _MADE_WITH}


def check(world: Any, kwargs: Mapping[str, Any]) -> None:
    """Return if a repeated ``init_process_group(**kwargs)`` asks for nothing but ``world``; else raise.

    Args:
        world: the running world group (:func:`smddp.torch.groups.current`).
        kwargs: the repeated call's keyword arguments (``backend`` included).

    Raises:
        InvalidTypeError: ``timeout`` is not a ``datetime.timedelta`` (as on a first call).
        InvalidArgumentError: an argument asks for something the running world is not; the
            message names each one with the world's value and says to call
            ``destroy_process_group()`` first.
    """
    differ = _world_differences(world, kwargs) + _made_with_differences(world, kwargs)
    if differ:
        raise InvalidArgumentError(
            f"init_process_group() was called again, but the process group is already initialized and "
            f"a second call cannot change it: {'; '.join(differ)}. Call destroy_process_group() first to "
            f"initialize a new one with these arguments (a repeated call with no arguments, or with the "
            f"running group's own, returns and changes nothing)"
        )


def _world_differences(world: Any, kwargs: Mapping[str, Any]) -> List[str]:
    """What the call asks of the running world's backend, timeout, rank and size, where that differs."""
    differ = []
    engine = world.engine
    backend = kwargs.get("backend")
    if backend not in _ANY_BACKEND and str(backend).lower().replace("_", "-") != world.backend_name:
        differ.append(f"backend={backend!r} (the group's: {world.backend_name!r})")
    timeout = kwargs.get("timeout")
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise InvalidTypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        asked = groups.resolve_timeout(timeout)
        if asked.total_seconds() != engine.timeout:
            differ.append(f"timeout={asked} (the group's: {timedelta(seconds=engine.timeout)})")
    for name, value in (("rank", world.rank()), ("world_size", world.size())):
        asked = kwargs.get(name)
        if asked not in (None, -1) and asked != value:
            differ.append(f"{name}={asked!r} (the group's: {value})")
    return differ


def _made_with_differences(world: Any, kwargs: Mapping[str, Any]) -> List[str]:
    """The rendezvous and device arguments the call gives that the world was not made with."""
    differ = []
    made_with: Optional[Dict[str, Any]] = getattr(world, "made_with", None)
    for name in _MADE_WITH:
        asked = kwargs.get(name)
        if asked is None:
            continue
        if made_with is None:
            differ.append(f"{name}={asked!r} (the group was made by torch.distributed.init_process_group, "
                          f"which does not say what it was given)")
        elif not _same(name, asked, made_with[name]):
            differ.append(f"{name}={asked!r} (the group's: {_shown(name, made_with[name])})")
    return differ


def _same(name: str, asked: Any, made: Any) -> bool:
    if name == "init_method":  # no init_method is env://: the launcher's environment
        return asked == (made or "env://")
    if name == "device_id":
        return made is not None and _device(asked) == _device(made)
    if name in ("store", "pg_options"):
        return asked is made
    return asked == made


def _shown(name: str, made: Any) -> str:
    if made is not None:
        return repr(made)
    return "'env://', the launcher's environment" if name == "init_method" else "none"


def _device(device_id: Any) -> Any:
    return torch.device(device_id) if isinstance(device_id, str) else device_id
