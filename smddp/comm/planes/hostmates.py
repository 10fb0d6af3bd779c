"""Which ranks of a group share this host, found through the group's torch Store.

Every CPU plane that uses shared memory starts here, whatever launched the job (mpirun,
torchrun, smddprun, ``mp.spawn``, srun, SageMaker): the group's store is all it needs, never
mpi4py. Each rank publishes what it is (its host identity, :func:`smddp.comm.planes.layout.host_identity`,
and what :mod:`smddp.comm.planes.layout` agrees on) and reads everyone's; ranks with the same identity
are host-mates. ``LOCAL_WORLD_SIZE`` is not used: it is the launcher's count of the job's ranks
on the host, wrong for subgroups and hybrid meshes.

Values in the store are plain text (JSON), never pickles: a store has no authentication.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Sequence

from smddp.errors import CollectiveTimeout


@dataclass
class Hostmates:
    """This rank's host within its group, and the group's layout over hosts.

    Attributes:
        rank: this process's rank in the group.
        size: the group's size.
        ranks: the group ranks on this host, ascending.
        local_rank: this process's index in ``ranks``.
        host: this host's index among the group's hosts (ordered by their lowest rank).
        hosts: every host's group ranks, in host order.
        info: what each rank published (``info[r]``): :mod:`smddp.comm.planes.layout` reads it.
    """

    rank: int
    size: int
    ranks: List[int]
    local_rank: int
    host: int
    hosts: List[List[int]]
    info: List[Dict[str, Any]]

    @property
    def local_size(self) -> int:
        """Ranks of the group on this host."""
        return len(self.ranks)


def exchange(store, rank: int, size: int, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Publish ``mine`` (JSON-able) under this rank and return every rank's, in rank order."""
    store.set(f"hostmates/{rank}", json.dumps(mine))
    return [json.loads(store.get(f"hostmates/{r}")) for r in range(size)]


def grouped(info: List[Dict[str, Any]], rank: int) -> Hostmates:
    """Group the ranks of a group by the ``"host"`` each published (:func:`exchange`'s list).

    Args:
        info: what every rank published, in rank order; ``info[r]["host"]`` is a string.
        rank: this rank in the group.

    Returns:
        The layout over hosts, the same on every rank.
    """
    by_host: Dict[str, List[int]] = {}
    for r, entry in enumerate(info):
        by_host.setdefault(entry["host"], []).append(r)
    hosts = sorted(by_host.values(), key=lambda members: members[0])
    host = next(i for i, members in enumerate(hosts) if rank in members)
    ranks = hosts[host]
    return Hostmates(rank, len(info), ranks, ranks.index(rank), host, hosts, info)


class HostChannel:
    """The set-up exchanges of one host's ranks through the store (a segment's name, barriers).

    Args:
        store: the group's store, with a prefix of the caller's.
        mates: this rank's :class:`Hostmates`.
        timeout: how long a rank waits for its host-mates.
    """

    def __init__(self, store, mates: Hostmates, timeout: timedelta):
        self.store = store
        self.mates = mates
        self.rank = mates.local_rank
        self.size = mates.local_size
        self.timeout = timeout
        self._prefix = f"host{mates.host}/"
        self._barriers = 0

    def publish(self, key: str, value: str) -> None:
        """Set ``key`` for this host's ranks."""
        self.store.set(self._prefix + key, value)

    def published(self, key: str) -> bool:
        """True once a host-mate has set ``key`` (does not wait)."""
        return self.store.check([self._prefix + key])

    def read(self, key: str) -> str:
        """Wait for ``key`` (set by a host-mate) and return it.

        Raises:
            CollectiveTimeout: it was not set within the timeout.
        """
        self._wait([self._prefix + key], f"the shared-memory set-up's {key!r}")
        return self.store.get(self._prefix + key).decode()

    def barrier(self) -> None:
        """Return once every rank of this host has entered the same barrier."""
        self._barriers += 1
        key = f"{self._prefix}barrier{self._barriers}"
        if self.store.add(key, 1) == self.size:
            self.store.set(key + "/done", "1")
        self._wait([key + "/done"], "a host-mate at the shared-memory set-up")

    def _wait(self, keys: Sequence[str], what: str) -> None:
        started = time.monotonic()
        try:
            self.store.wait(list(keys), self.timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError
            elapsed = time.monotonic() - started
            raise CollectiveTimeout(
                f"waited {elapsed:.0f}s for {what} (host ranks {self.mates.ranks}): {exc}"
            ) from exc
