"""torch's ``init_method`` schemes, taught to read the job from any launcher smddp knows.

``torch.distributed.init_process_group(backend="smddp")`` then works as scripts written for
SageMaker expect, whatever started the processes:

- ``env://`` (the default): the job meets at smddp's store (:func:`smddp.comm.store.make_store`):
  at ``MASTER_ADDR:MASTER_PORT`` when both are set, else an MPI job over MPI, an ``srun`` job
  at the address and port derived from the Slurm job; a plain ``python train.py`` is a world
  of one. Under torchrun (its agent's store), and when the caller passes ``rank``/``world_size``, torch's own
  ``env://`` runs.
- ``tcp://host:port`` and ``file:///path`` without ``?rank=..&world_size=..``: rank and world
  size come from the launcher (torch alone would refuse them). Given, they are torch's.

The schemes are torch's process-wide table, so this applies to every backend; it only turns
what torch would refuse into a working rendezvous.
"""

from __future__ import annotations

import os
from typing import Callable
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from smddp import _compat
from smddp.job.topology import discover


def _env_or_launcher(original: Callable) -> Callable:
    def env_or_launcher(url, timeout=_compat.default_timeout(), **kwargs):
        topology = discover(os.environ)
        # init_process_group(rank=..., world_size=...) reaches here as "env://?rank=..&world_size=..":
        # the caller (Lightning's launcher, mp.spawn) set up the job, torch's env:// meets it.
        explicit = int(parse_qs(urlparse(url).query).get("world_size", ["1"])[-1]) > 1
        plain = not topology.distributed and "RANK" not in os.environ and not explicit
        # Every launcher but torchrun (whose agent holds the store) meets at smddp's store, which
        # listens only where it must (loopback on one host), where torch's listens everywhere.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        derived = topology.distributed and not agent_store and not explicit
        if plain or derived:
            from smddp.comm.store import make_store

            yield make_store(topology, timeout), topology.rank, topology.size
            return
        yield from original(url, timeout=timeout, **kwargs)

    return env_or_launcher


def _ranks_from_launcher(original: Callable) -> Callable:
    def ranks_from_launcher(url, **kwargs):
        parsed = urlparse(url)
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        if "rank" not in query or "world_size" not in query:
            topology = discover(os.environ)
            if topology.distributed:
                query.setdefault("rank", str(topology.rank))
                query.setdefault("world_size", str(topology.size))
                url = urlunparse(parsed._replace(query=urlencode(query)))
        yield from original(url, **kwargs)

    return ranks_from_launcher


#: The handlers :func:`install` put in torch's table (installing again leaves them as they are).
_WRAPPED: set = set()


def install() -> None:
    """Wrap torch's ``env``, ``tcp`` and ``file`` rendezvous handlers (idempotent)."""
    handlers = _compat.rendezvous_handlers()
    for scheme, wrap in (("env", _env_or_launcher), ("tcp", _ranks_from_launcher), ("file", _ranks_from_launcher)):
        original = handlers.get(scheme)
        if original is None or original in _WRAPPED:
            continue
        wrapped = wrap(original)
        _WRAPPED.add(wrapped)
        handlers[scheme] = wrapped
