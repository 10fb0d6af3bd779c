"""The shared-memory CPU plane: collectives among the ranks of one host through /dev/shm.

The ranks of a host map one segment. Each rank owns two buffers in it (double buffering)
and one epoch word, the count of steps it has signalled. A step is: wait until every
rank's word shows it left the step before last (so this buffer is free again), copy in,
publish the new epoch, wait until the other ranks have published theirs, read their
buffers. No trailing barrier: the epoch words order everything.

- all_reduce up to :data:`ONE_SHOT_MAX` bytes is one step (every rank reduces every
  buffer, in rank order, so every rank computes the same bits); larger ones run a
  reduce-scatter and an all-gather per slice (each part reduced by exactly one rank).
- float16 and bfloat16 are accumulated in float32 and rounded once, as the MPI path does.
- Operations are generators advanced by ``Pending.test()``, one at a time in issue order
  (a later operation waits for the earlier ones to leave the buffers); ``test()`` never
  waits long, so the engine's deadline, its progress thread and its timeouts apply as
  they do to MPI.

The segment itself (its size, set-up and clean-up) is :mod:`smddp.comm.backends.shm_segment`'s.

The epoch words rely on x86-64's ordering of stores (data before flag); elsewhere
:func:`supported` is False and the MPI plane is used.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from typing import Iterator, List, Optional, Tuple

import torch

from smddp.comm.backends.shm_segment import HEADER, SLOT_BYTES, alive, map_segment, segment_bytes, supported
from smddp.comm.base import HALF as _HALF
from smddp.comm.base import Op, Pending, average, combine
from smddp.errors import CollectiveError

#: All-reduces up to this many bytes run in one step (every rank reduces everything).
ONE_SHOT_MAX = int(os.environ.get("SMDDP_SHM_ONE_SHOT_MAX", 1 << 20))
_WORD = 64  # bytes between two ranks' epoch words: one cache line each
_SPINS = 64  # flag checks per test() call before handing the core back
_LIVENESS_EVERY = 1.0  # seconds between checks that the awaited ranks still exist

_Wait = Tuple[Optional[int], int]  # (rank or None for all, epoch)


class Plane:
    """The shared segment of one host's ranks and the operations over it.

    Args:
        comm: an mpi4py communicator of exactly the ranks that share the segment (used only
            during set-up, to agree on the segment's name).
        group: a name for the group (part of the segment's name).
        slot: bytes of each buffer.

    Raises:
        OSError: /dev/shm cannot hold the segment (:func:`open_plane` turns that into a
            fallback).
    """

    def __init__(self, comm, group: str = "world", slot: int = SLOT_BYTES):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.slot = slot
        self.name, self._mm = map_segment(comm, group, segment_bytes(self.size, slot))
        self._words = memoryview(self._mm).cast("q")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._stride = _WORD // 8
        self._words[self.rank * self._stride + 1] = os.getpid()
        comm.Barrier()
        self._pids = [self._words[r * self._stride + 1] for r in range(self.size)]
        self._epoch = 0  # the last epoch this rank published
        self._last_written = 0  # epoch of the latest step's copy-in: buffers older than it are free
        self._steps = 0
        self._cache: dict = {}
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._waiting_since = 0.0
        self._next_liveness = 0.0

    # ------------------------------------------------------------------ primitives
    def _buffer(self, rank: int, step: int) -> torch.Tensor:
        start = HEADER + (rank * 2 + step % 2) * self.slot
        return self._bytes[start:start + self.slot]

    def _view(self, rank: int, step: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._views(step, dtype, numel)[rank]

    def _views(self, step: int, dtype: torch.dtype, numel: int) -> List[torch.Tensor]:
        """Every rank's buffer of ``step`` as ``numel`` elements of ``dtype`` (cached: views cost microseconds)."""
        key = (step % 2, dtype, numel)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= 256:
                self._cache.clear()
            views = self._cache[key] = [self._buffer(r, step).view(dtype)[:numel] for r in range(self.size)]
        return views

    def _publish(self) -> int:
        self._epoch += 1
        self._words[self.rank * self._stride] = self._epoch
        return self._epoch

    def _reached(self, wait) -> bool:
        if not isinstance(wait, tuple):
            return wait.Test()  # an MPI request (the hierarchical plane's step between hosts)
        rank, epoch = wait
        words, stride = self._words, self._stride
        if rank is not None:
            return words[rank * stride] >= epoch
        for r in range(self.size):
            if words[r * stride] < epoch:
                return False
        return True

    def _behind(self, wait: _Wait) -> List[int]:
        rank, epoch = wait
        ranks = range(self.size) if rank is None else (rank,)
        return [r for r in ranks if self._words[r * self._stride] < epoch]

    def _step(self) -> Iterator[_Wait]:
        """Start a step: wait until this step's buffer is free. Yields waits; leaves the step in ``_steps``."""
        self._steps += 1
        if not self._reached((None, self._last_written)):
            yield (None, self._last_written)

    def _written(self) -> int:
        self._last_written = self._publish()
        return self._last_written

    # ------------------------------------------------------------------ driving
    def start(self, gen: Iterator[_Wait]) -> Pending:
        """Queue an operation (a generator of waits); it runs after the ones queued before it."""
        op = _Op(self, gen)
        with self._lock:
            self._queue.append(op)
            if len(self._queue) == 1:
                # Nothing ahead of it: copy in and publish now, in the caller's thread, so the
                # other ranks can proceed before anyone tests this operation.
                self._advance()
        return op

    def _advance(self) -> None:
        """Run queued operations until one must wait for other ranks (lock held)."""
        queue = self._queue
        while queue:
            op = queue[0]
            if op.wait is not None and not self._reached(op.wait):
                self._check_peers(op.wait)
                return
            self._waiting_since = 0.0
            try:
                op.wait = next(op.gen)
            except StopIteration:
                op.done = True
                queue.popleft()
            except BaseException as exc:
                # The buffers are in an unknown state: every later operation fails too.
                for other in queue:
                    other.error, other.done = exc, True
                queue.clear()
                raise

    def _check_peers(self, wait) -> None:
        if not isinstance(wait, tuple):
            return
        now = time.monotonic()
        if not self._waiting_since:
            self._waiting_since, self._next_liveness = now, now + _LIVENESS_EVERY
        elif now >= self._next_liveness:
            self._next_liveness = now + _LIVENESS_EVERY
            dead = [r for r in self._behind(wait) if not alive(self._pids[r])]
            if dead:
                raise CollectiveError(
                    f"local rank(s) {dead} of this host's shared-memory group (pids "
                    f"{[self._pids[r] for r in dead]}) exited in the middle of a collective; "
                    f"the job cannot continue: look for their error output"
                )

    # ------------------------------------------------------------------ operations
    def all_reduce(self, tensor: torch.Tensor, op: Op) -> Iterator[_Wait]:
        """Reduce flat contiguous ``tensor`` in place over the plane's ranks."""
        flat = tensor.view(-1)
        nbytes = flat.numel() * flat.element_size()
        if nbytes <= min(ONE_SHOT_MAX, self.slot):
            yield from self._reduce_one_shot(flat, op)
            return
        per_step = self.slot // flat.element_size()
        for start in range(0, flat.numel(), per_step):
            yield from self._reduce_slice(flat[start:start + per_step], op)

    def _fold(self, out: torch.Tensor, parts: List[torch.Tensor], op: Op, scale: bool) -> None:
        """``out`` = the ``op`` of ``parts`` in rank order; half types accumulate in float32.

        ``out`` may be float32 for half ``parts`` (the accumulator is then ``out`` itself).
        ``scale``: divide an AVERAGE by the plane's size.
        """
        if parts[0].dtype in _HALF or len(parts) == 1:
            acc = out if out.dtype == torch.float32 or parts[0].dtype not in _HALF else torch.empty(
                out.shape, dtype=torch.float32)
            acc.copy_(parts[0])
            for part in parts[1:]:
                combine(acc, part, op)
        else:
            acc = out
            if op in (Op.SUM, Op.AVERAGE):
                torch.add(parts[0], parts[1], out=acc)
            elif op is Op.MIN:
                torch.minimum(parts[0], parts[1], out=acc)
            elif op is Op.MAX:
                torch.maximum(parts[0], parts[1], out=acc)
            else:
                torch.mul(parts[0], parts[1], out=acc)
            for part in parts[2:]:
                combine(acc, part, op)
        if scale and op is Op.AVERAGE:
            average(acc, self.size)
        if acc is not out:
            out.copy_(acc)

    def _reduce_one_shot(self, flat: torch.Tensor, op: Op) -> Iterator[_Wait]:
        yield from self._step()
        views = self._views(self._steps, flat.dtype, flat.numel())
        views[self.rank].copy_(flat)
        yield (None, self._written())
        self._fold(flat, views, op, True)

    def _reduce_slice(self, flat: torch.Tensor, op: Op) -> Iterator[_Wait]:
        yield from self._step()
        n = flat.numel()
        views = self._views(self._steps, flat.dtype, n)
        mine = views[self.rank]
        bounds = _bounds(n, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        # Publish only what the others reduce; this rank's own part stays private until reduced.
        mine[:lo].copy_(flat[:lo])
        mine[hi:].copy_(flat[hi:])
        yield (None, self._written())
        parts = [flat[lo:hi] if r == self.rank else views[r][lo:hi] for r in range(self.size)]
        self._fold(mine[lo:hi], parts, op, True)
        flat[lo:hi].copy_(mine[lo:hi])
        yield (None, self._publish())
        for r in range(self.size):
            if r != self.rank:
                flat[bounds[r]:bounds[r + 1]].copy_(views[r][bounds[r]:bounds[r + 1]])

    def all_reduce_across(self, tensor: torch.Tensor, op: Op, across, mpi_op, mpi_type, world: int
                          ) -> Iterator[_Wait]:
        """All-reduce flat ``tensor`` over several hosts: this host's part through shared memory,
        the hosts' parts through ``across`` (an mpi4py communicator of the ranks with this local rank).

        Per slice: each local rank reduces its part of the slice over the host, all-reduces that
        part with the same local rank of every other host (MPI, float32 for half types), and
        the host all-gathers the parts. ``world`` (the job's size) divides an AVERAGE.
        """
        from smddp.comm.backends.mpi import _buffer

        flat = tensor.view(-1)
        per_step = self.slot // flat.element_size()
        for begin in range(0, flat.numel(), per_step):
            part = flat[begin:begin + per_step]
            yield from self._step()
            step, n = self._steps, part.numel()
            mine = self._view(self.rank, step, part.dtype, n)
            mine.copy_(part)
            yield (None, self._written())
            bounds = _bounds(n, self.size)
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            target = part[lo:hi]
            acc = torch.empty(hi - lo, dtype=torch.float32) if part.dtype in _HALF else target
            self._fold(acc, [self._view(r, step, part.dtype, n)[lo:hi] for r in range(self.size)], op, False)
            if hi > lo:
                yield across.Iallreduce(_mpi_in_place(), _buffer(acc, mpi_type(acc.dtype)), op=mpi_op)
            if op is Op.AVERAGE:
                average(acc, world)
            if acc is not target:
                target.copy_(acc)
            mine[lo:hi].copy_(target)
            yield (None, self._publish())
            for r in range(self.size):
                if r != self.rank:
                    part[bounds[r]:bounds[r + 1]].copy_(self._view(r, step, part.dtype, n)[bounds[r]:bounds[r + 1]])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op) -> Iterator[_Wait]:
        """Rank r receives the ``op`` of every rank's slice r of flat ``input`` into flat ``output``."""
        m = output.numel()
        rows = input.view(self.size, m)
        out = output.view(-1)
        per_step = max(1, self.slot // (input.element_size() * self.size))
        for start in range(0, m, per_step):
            length = min(per_step, m - start)
            yield from self._step()
            step = self._steps
            cells = self._view(self.rank, step, input.dtype, self.size * length).view(self.size, length)
            cells.copy_(rows[:, start:start + length])
            yield (None, self._written())
            lo = self.rank * length
            parts = [self._view(r, step, input.dtype, self.size * length)[lo:lo + length] for r in range(self.size)]
            self._fold(out[start:start + length], parts, op, True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Iterator[_Wait]:
        """Fill flat ``output`` with every rank's flat ``input`` in rank order."""
        m = input.numel()
        src, out = input.view(-1), output.view(-1)
        per_step = max(1, self.slot // input.element_size())
        for start in range(0, m, per_step):
            length = min(per_step, m - start)
            yield from self._step()
            step = self._steps
            self._view(self.rank, step, input.dtype, length).copy_(src[start:start + length])
            yield (None, self._written())
            for r in range(self.size):
                out[r * m + start:r * m + start + length].copy_(self._view(r, step, input.dtype, length))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Iterator[_Wait]:
        """Copy rank ``src``'s flat ``tensor`` into every rank's."""
        flat = tensor.view(-1)
        per_step = max(1, self.slot // flat.element_size())
        for start in range(0, flat.numel(), per_step):
            part = flat[start:start + per_step]
            yield from self._step()
            step = self._steps
            if self.rank == src:
                self._view(src, step, part.dtype, part.numel()).copy_(part)
            epoch = self._written()
            if self.rank != src:
                yield (src, epoch)
                part.copy_(self._view(src, step, part.dtype, part.numel()))

    def barrier(self) -> Iterator[_Wait]:
        """Complete once every rank of the plane has entered it."""
        self._steps += 1
        yield (None, self._written())

    def close(self) -> None:
        """Unmap the segment (already unlinked)."""
        with self._lock:
            self._queue.clear()
        self._words.release()
        del self._bytes
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor view still exists: the mapping goes with the process


def _mpi_in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _bounds(n: int, parts: int) -> List[int]:
    """Split points of ``n`` elements into ``parts`` near-equal runs (as torch.tensor_split)."""
    q, r = divmod(n, parts)
    out, total = [0], 0
    for i in range(parts):
        total += q + (1 if i < r else 0)
        out.append(total)
    return out


class _Op(Pending):
    """One queued shared-memory operation."""

    __slots__ = ("_plane", "gen", "wait", "done", "error")

    def __init__(self, plane: Plane, gen: Iterator[_Wait]):
        self._plane = plane
        self.gen = gen
        self.wait: Optional[_Wait] = None
        self.done = False
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if not self.done:
            plane = self._plane
            with plane._lock:
                for spin in range(_SPINS):
                    plane._advance()
                    if self.done:
                        break
                    if spin:
                        os.sched_yield()  # on a busy host the awaited rank may need this core
        if self.error is not None:
            raise self.error
        return self.done


def open_plane(comm, group: str = "world", slot: int = SLOT_BYTES) -> Optional[Plane]:
    """A :class:`Plane` over ``comm``'s ranks, or None (one warning, on local rank 0) where it cannot be had.

    Args:
        comm: an mpi4py communicator whose ranks share this host.
        group: a name for the group, part of the segment's name.
        slot: bytes of each buffer.

    Returns:
        The plane, or None when this is not x86-64 Linux or /dev/shm is too small.
    """
    usable = comm.allreduce(1 if supported() else 0) == comm.Get_size()
    if not usable:
        return None
    try:
        return Plane(comm, group, slot)
    except OSError as exc:
        if comm.Get_rank() == 0:
            warnings.warn(
                f"smddp: shared-memory plane unavailable, CPU collectives go through MPI: {exc} "
                f"(enlarge it, e.g. docker run --shm-size=1g, or set SMDDP_SHM_SLOT_BYTES lower)",
                RuntimeWarning, stacklevel=2)
        return None
