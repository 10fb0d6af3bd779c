"""Where the sockets smddp opens listen: loopback for a job on one host, else where asked.

smddp listens in two places: rank 0's ``TCPStore`` (the job's key-value store, which has no
authentication) and each rank's gloo device (gloo's connections between ranks). torch binds
both to every interface (the store) or to the address of the host's name (gloo). Here:

- ``SMDDP_SOCKET_IFNAME=<interface>``: both listen on that interface's IPv4 address only
  (``GLOO_SOCKET_IFNAME``, torch's own variable, still wins for gloo).
- A job on one host: both listen on loopback, where only this host's processes can connect.
- Otherwise the store listens on every interface and gloo on the host name's address, as in
  torch (see docs/security.md for what that exposes and how to narrow it).

A job is on one host when its rank 0 is reached over loopback (``MASTER_ADDR`` is a loopback
address: no other host could reach it), or when a launcher that counts the processes per host
(Open MPI, MPICH, PMIx, Slurm, or ``LOCAL_WORLD_SIZE`` as torchrun and smddprun set it) says
they are all here.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
from typing import List, Mapping, Optional, Tuple

from smddp import knobs
from smddp.errors import InvalidArgumentError
from smddp.job.topology import Topology

#: The variable that pins smddp's sockets (and smddprun's mpirun) to one interface.
IFNAME_ENV = "SMDDP_SOCKET_IFNAME"
#: The address a job on one host listens on.
LOOPBACK = "127.0.0.1"
#: Launchers that count the processes of each host themselves (``Topology.local_size`` is theirs;
#: for the others it is the world size unless ``LOCAL_WORLD_SIZE`` says).
_COUNTS_PER_HOST = frozenset({"openmpi", "mpich", "pmix", "slurm"})
_SIOCGIFADDR = 0x8915


def interface(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The interface ``SMDDP_SOCKET_IFNAME`` names, or None when it is unset."""
    return knobs.value(IFNAME_ENV, env)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this host.

    Raises:
        InvalidArgumentError: there is no such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise _not_here(name, "has no IPv4 address" if exc.errno == errno.EADDRNOTAVAIL else "") from None
    return socket.inet_ntoa(packed[20:24])


def check_interface(name: str) -> None:
    """Raise unless this host has a network interface ``name`` (``SMDDP_SOCKET_IFNAME``'s value).

    Raises:
        InvalidArgumentError: it has none of that name (the error lists the ones it has).
    """
    if name not in {known for _, known in socket.if_nameindex()}:
        raise _not_here(name, "")


def _not_here(name: str, why: str) -> InvalidArgumentError:
    known = ", ".join(n for _, n in socket.if_nameindex())
    return InvalidArgumentError(
        f"{IFNAME_ENV}={name} (environment) {why or 'is not an interface here'} (this host has: {known}): name "
        f"one of them, or unset {IFNAME_ENV} (loopback on one host)")


def is_loopback(host: Optional[str]) -> bool:
    """True when every address ``host`` resolves to is a loopback address (False if it does not resolve)."""
    if not host:
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def one_host(topology: Topology, env: Optional[Mapping[str, str]] = None) -> bool:
    """True when every rank of the job surely runs on this host (see the module's docstring)."""
    env = os.environ if env is None else env
    if topology.size <= 1 or is_loopback(topology.master_addr or env.get("MASTER_ADDR")):
        return True
    counted = topology.launcher in _COUNTS_PER_HOST or bool(env.get("LOCAL_WORLD_SIZE"))
    return counted and topology.local_size >= topology.size


def store_address(master_addr: Optional[str], on_one_host: bool,
                  env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The address rank 0's store listens on; None for every interface (torch's default).

    Args:
        master_addr: the address the other ranks connect to (``MASTER_ADDR``), if known.
        on_one_host: every rank runs on this host (:func:`one_host`).
        env: the environment (default ``os.environ``).

    Raises:
        InvalidArgumentError: ``SMDDP_SOCKET_IFNAME`` names no interface with an IPv4 address.
    """
    name = interface(env)
    if name:
        return interface_address(name)
    if on_one_host or is_loopback(master_addr):
        if not master_addr:
            return LOOPBACK
        try:  # the address the other ranks of this host will connect to
            return socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError:
            return LOOPBACK
    return None


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address:port`` only (port 0: a free one), for a store to adopt.

    Raises:
        InvalidArgumentError: the port is taken on that address.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As TCPStore does: a port whose last connections linger in TIME_WAIT is still usable.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if port == 0:  # a free port, smddp's own choice: no variable of the user's to blame
            raise InvalidArgumentError(f"the job's store cannot listen on {address} ({exc.strerror})") from None
        raise InvalidArgumentError(
            f"MASTER_PORT={port}: the job's store cannot listen on {address}:{port} ({exc.strerror}; another "
            f"job on this host may hold it): choose another MASTER_PORT, or unset it and let the launcher pick "
            f"one") from None
    return sock


def gloo_binding(on_one_host: bool, env: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str]]:
    """How each gloo device of this rank binds: ``[("interface", name) | ("hostname", address)]``.

    An empty list means gloo's default device (the address of this host's name).
    ``GLOO_SOCKET_IFNAME`` (comma-separated, torch's variable) wins, then ``SMDDP_SOCKET_IFNAME``,
    then loopback for a job on one host.
    """
    env = os.environ if env is None else env
    torch_names = [n for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if torch_names:
        return [("interface", n) for n in torch_names]
    name = interface(env)
    if name:
        check_interface(name)  # named here, not as gloo's "Unable to find address for" from deep inside
        return [("interface", name)]
    return [("hostname", LOOPBACK)] if on_one_host else []
