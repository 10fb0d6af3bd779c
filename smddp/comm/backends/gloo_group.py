"""torch's ``ProcessGroupGloo``, its devices listening where smddp's sockets may listen.

Each gloo device listens for its peers' connections. torch's default device listens on the
address of the host's name, reachable from other hosts; smddp binds it as
:func:`smddp.job.sockets.gloo_binding` says: ``GLOO_SOCKET_IFNAME`` (torch's variable) or
``SMDDP_SOCKET_IFNAME`` when set, loopback for a group on one host. Whether the group is on one
host is the caller's to say, from the group's agreed layout (the host identities its ranks
exchanged, :mod:`smddp.comm.planes.layout`), never from this process's environment: ranks given to
``init_process_group`` by Lightning's launcher or ``mp.spawn`` across hosts leave the
environment saying nothing, or a world of one. Both smddp's ``gloo``
plane and the gloo backend every smddp group carries for torch's functional collectives
(:mod:`smddp.torch._functional_backends`) are made here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch.distributed as tdist

from smddp import _compat
from smddp.job import sockets


def devices(one_host: bool, lazy: Optional[bool] = None) -> List:
    """This rank's gloo devices (one per interface asked for), bound as the module says.

    Args:
        one_host: every rank of the group runs on this host (loopback reaches them all).
        lazy: connect to the peers on first use (None: torch's default).
    """
    gloo = tdist.ProcessGroupGloo
    binding = sockets.gloo_binding(one_host)
    if not binding:
        return [gloo.create_default_device(lazy_init=lazy)]
    return [gloo.create_device(**{kind: value}, lazy_init=lazy) for kind, value in binding]


def gloo_group(store, rank: int, size: int, timeout: timedelta, one_host: bool, lazy: Optional[bool] = None,
               threads: Optional[int] = None):
    """A ``ProcessGroupGloo`` on ``store`` whose devices come from :func:`devices`.

    Args:
        store: the store the ranks exchange their addresses through.
        rank: this rank in the group.
        size: the group's size.
        timeout: gloo's own limit on each operation.
        one_host: every rank of the group runs on this host (from the group's layout).
        lazy: connect to the peers on first use (None: torch's default).
        threads: gloo's worker threads (None: torch's default).
    """
    return tdist.ProcessGroupGloo(store, rank, size, _compat.gloo_options(devices(one_host, lazy), timeout, threads))


def lazy_gloo_group(store, rank: int, size: int, timeout: timedelta, one_host: bool):
    """A ``ProcessGroupGloo`` as :func:`gloo_group` makes it, connecting its peers on first use where
    this torch can (so a group whose backend is never used opens no connection), with torch's two
    worker threads."""
    try:
        return gloo_group(store, rank, size, timeout, one_host, lazy=True, threads=2)
    except (AttributeError, TypeError):  # a torch without lazy gloo: connect now
        return gloo_group(store, rank, size, timeout, one_host)
