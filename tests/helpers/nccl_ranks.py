"""Ranks as threads for the ``nccl`` communicator on the host-memory stand-in (tests/helpers/nccl_standin.py).

Each rank has its own NCCLCommunicator and engine over one TCPStore, as processes would; its
inputs are seeded per rank (:func:`seeded`) and its results are checked against values
computed locally from every rank's inputs (:func:`expected_reduce`).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as tdist
from nccl_standin import HostStream

from smddp.comm.backends.nccl.communicator import NCCLCommunicator
from smddp.comm.base import Context
from smddp.comm.engine import Engine
from smddp.comm.reduction import Op
from smddp.job import excepthook
from smddp.job.topology import Topology

JOIN = 60.0  # seconds a rank's thread may take at most: a hang fails the test instead


def run_ranks(fake, size: int, body, timeout: float = 20.0, with_store: bool = False, master=None,
              prefix: Optional[str] = None, device: Optional[Callable[[int], torch.device]] = None):
    """``body(rank, engine, comm)`` on ``size`` ranks (threads); returns ``{rank: result}``.

    Each rank has its own NCCLCommunicator and engine with the given ``timeout``, over one
    TCPStore (passed as a fourth argument with ``with_store``; ``master``: an existing server,
    ``prefix``: the world's key prefix, as smddp's groups put one per init_process_group), and
    ``device(rank)`` as its ``device_id``. Engines and communicators are closed afterwards
    whatever happened.
    """
    own_master = master is None
    if own_master:
        master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    results, errors = {}, []
    # Every rank starts its body once all are set up: a short deadline then measures the
    # operations, not how long a starved machine takes to start threads.
    ready = threading.Barrier(size, timeout=JOIN)

    def rank(r: int) -> None:
        engine = nccl_comm = None
        try:
            store = tdist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
            if prefix is not None:
                store = tdist.PrefixStore(prefix, store)
            topology = Topology(rank=r, size=size, local_rank=r, local_size=size,
                                launcher="torchrun" if size > 1 else "none")
            ctx = Context(topology, timedelta(seconds=timeout), store, device(r) if device else None)
            nccl_comm = NCCLCommunicator(ctx)
            # the stand-in's tensors live on the CPU: route them to the NCCL communicator
            engine = Engine({"cpu": nccl_comm}, timeout=timeout, store=store)
            ready.wait()
            results[r] = body(r, engine, nccl_comm, *((store,) if with_store else ()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()
        finally:
            if engine is not None:
                engine.close()
                excepthook.forget(engine)  # a broken engine would end pytest's process at exit
            if nccl_comm is not None:
                nccl_comm.close()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    assert sorted(results) == list(range(size))
    for stream in fake.streams.values():
        # the only failure a "kernel" may have: NCCL's call ended by an abort (its own or a peer's)
        assert all("was aborted" in str(e) for e in stream.errors), stream.errors
        stream.close()
    return results


def seeded(rank: int, shape, dtype, what: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input ``what``: the same on every call, different per rank."""
    g = torch.Generator().manual_seed(1000 * what + rank)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def expected_reduce(size: int, shape, dtype, op: Op, what: int, ncclavg: bool = True) -> torch.Tensor:
    """NCCL's result: the reduction of every rank's input, rounded once to ``dtype``.

    ``ncclavg=False``: AVERAGE as before NCCL 2.10, the rounded sum divided by ``size``.
    bool reduces as logic (SUM is an or); complex reduces its real and imaginary parts.
    """
    if op is Op.AVERAGE and not ncclavg and dtype.is_floating_point:
        return expected_reduce(size, shape, dtype, Op.SUM, what) / size
    stack = torch.stack([seeded(r, shape, dtype, what) for r in range(size)])
    if dtype is torch.bool:
        return {Op.SUM: stack.any(0), Op.MAX: stack.any(0), Op.MIN: stack.all(0), Op.PRODUCT: stack.all(0)}[op]
    if dtype.is_complex:
        wide = stack.to(torch.complex128).sum(0)
        return (wide / size if op is Op.AVERAGE else wide).to(dtype)
    wide = stack.double() if dtype.is_floating_point else stack.long()
    if op is Op.SUM:
        out = wide.sum(0)
    elif op is Op.PRODUCT:
        out = wide.prod(0)
    elif op is Op.MIN:
        out = wide.min(0).values
    elif op is Op.MAX:
        out = wide.max(0).values
    elif dtype.is_floating_point:
        out = wide.sum(0) / size
    else:
        out = torch.div(wide.sum(0), size, rounding_mode="trunc")
    return out.to(dtype)


def gate(stream: HostStream) -> threading.Event:
    """Hold ``stream``'s queue until the returned event is set."""
    opened = threading.Event()
    stream.enqueue(lambda: opened.wait(JOIN))
    return opened
