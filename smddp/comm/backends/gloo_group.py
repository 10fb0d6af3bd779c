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
(:mod:`smddp.torch._functional_backends`) are made here, over devices every group of the process
shares.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Dict, List

import torch.distributed as tdist

from smddp import _compat
from smddp.job import sockets

#: This process's gloo devices, one list per binding: every gloo group of the process shares them.
_DEVICES: Dict[tuple, List] = {}
_DEVICES_LOCK = threading.Lock()


def devices(one_host: bool) -> List:
    """This process's gloo devices for a group (one per interface asked for), bound as the module says.

    A gloo device is a listening socket, an event loop and its thread; the groups of a process share
    one per binding, as gloo's contexts may, so a group adds only its connections (one per peer) and
    its worker threads, not a listener and a loop of its own: jobs make hundreds of groups
    (docs/groups.md). Its peers connect as the group is made (gloo's lazy connection does not
    work with a shared device).

    Args:
        one_host: every rank of the group runs on this host (loopback reaches them all).
    """
    gloo = tdist.ProcessGroupGloo
    binding = tuple(sockets.gloo_binding(one_host))
    with _DEVICES_LOCK:
        found = _DEVICES.get(binding)
        if found is None:
            if not binding:
                found = [gloo.create_default_device(lazy_init=False)]
            else:
                found = [gloo.create_device(**{kind: value}, lazy_init=False) for kind, value in binding]
            _DEVICES[binding] = found
    return found


def gloo_group(store, rank: int, size: int, timeout: timedelta, one_host: bool):
    """A ``ProcessGroupGloo`` on ``store`` over this process's shared devices (:func:`devices`), with
    torch's two worker threads (a callback on one of them may start and wait for another collective
    of the same group, as torch's own gloo groups allow).

    Args:
        store: the store the ranks exchange their addresses through.
        rank: this rank in the group.
        size: the group's size.
        timeout: gloo's own limit on each operation.
        one_host: every rank of the group runs on this host (from the group's layout).
    """
    return tdist.ProcessGroupGloo(store, rank, size, _compat.gloo_options(devices(one_host), timeout, 2))
