"""The private torch APIs smddp relies on, each wrapped in one place.

When torch changes one of these, this file is the only one to mend.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch.distributed as tdist

#: torch's Work base class that a Python subclass may extend (``wait``, ``get_future``).
WorkBase = tdist._Work if hasattr(tdist, "_Work") else tdist.Work


def register_backend(name: str, creator: Callable, devices) -> None:
    """Register ``creator(options, backend_options)`` as torch backend ``name`` (once)."""
    if getattr(tdist.Backend, name.upper(), None) is not None:
        return
    tdist.Backend.register_backend(name, creator, extended_api=True, devices=list(devices))


def rendezvous_handlers() -> dict:
    """torch's table of ``init_method`` schemes to rendezvous functions."""
    return sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers


def default_timeout():
    """torch's default process-group timeout (30 minutes for non-NCCL backends)."""
    from torch.distributed import constants

    return constants.default_pg_timeout
