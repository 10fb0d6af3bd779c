"""The shared-memory plane's operations in torch: its Python path.

:class:`TorchPath` holds the plane's protocol (see :mod:`smddp.comm.planes.shm`) written
with torch tensor views of the segment, given to it as a :class:`SegmentView`. Each operation
is a generator of waits: ``(rank or None, epoch)`` on the epoch words, or a Pending (the
hierarchical plane's step between hosts). :class:`~smddp.comm.planes.shm.Plane` holds one and
drives them; it runs the same protocol in its compiled core where that is built, and these
wherever it is not, for the hierarchical plane's half-precision all-reduces, and with
``SMDDP_SHM_NATIVE=0``.

Every operation's first step also writes its fingerprint next to the rank's epoch word and,
once every rank has published that step, compares every rank's with its own before it uses
their data (:meth:`TorchPath._check`); the compiled core does the same.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch

from smddp.comm.mismatch.fingerprint import Print, mismatch_error, signature
from smddp.comm.planes.shm_segment import HEADER
from smddp.comm.reduction import HALF as _HALF
from smddp.comm.reduction import Op, average, combine

#: All-reduces up to this many bytes run in one step (every rank reduces everything). Fixed:
#: ``SMDDP_SHM_ONE_SHOT_MAX`` tunes the compiled core, whose copies cost less per step.
ONE_SHOT_MAX = 1 << 20

_Wait = Tuple[Optional[int], int]  # (rank or None for all, epoch)

#: The first fold of two parts, into the output (:func:`~smddp.comm.reduction.combine` folds the rest).
#: bool folds as torch's bool arithmetic does: SUM an or, PRODUCT an and (the compiled core's bits).
_PAIRWISE = {Op.SUM: torch.add, Op.AVERAGE: torch.add, Op.MIN: torch.minimum, Op.MAX: torch.maximum,
             Op.PRODUCT: torch.mul, Op.BAND: torch.bitwise_and, Op.BOR: torch.bitwise_or,
             Op.BXOR: torch.bitwise_xor}

#: int64 index, in a rank's header line, of its fingerprint of even steps (odd: the next two).
#: The line holds, before it, the epoch word, the pid and the compiled core's sleeper count.
FP_WORD = 4


class Counters:
    """Where this rank is in the protocol (the compiled core's ``Segment`` has the same fields)."""

    __slots__ = ("epoch", "last_written", "steps")

    def __init__(self):
        self.epoch = 0  # the last epoch this rank published
        self.last_written = 0  # epoch of the latest step's copy-in: buffers older than it are free
        self.steps = 0  # steps started (a step's parity picks its buffer)


class SegmentView:
    """One rank's view of the plane's segment: what the Python path reads and writes.

    Attributes:
        rank: this rank's index among the plane's ranks.
        size: the plane's ranks.
        slot: bytes of each buffer.
        part_bytes: bytes of each slice of a hierarchical all-reduce (the compiled core's too).
        data: the segment as a uint8 tensor.
        words: the segment as int64 words (the header's epoch words and fingerprints).
        stride: words between two ranks' header lines.
        names: each plane rank's group rank (errors name them).
        group: the group's name (errors name it).
    """

    __slots__ = ("rank", "size", "slot", "part_bytes", "data", "words", "stride", "names", "group")

    def __init__(self, rank: int, size: int, slot: int, part_bytes: int, data: torch.Tensor, words: memoryview,
                 stride: int, names: List[int], group: str):
        self.rank, self.size, self.slot, self.part_bytes = rank, size, slot, part_bytes
        self.data, self.words, self.stride = data, words, stride
        self.names, self.group = names, group


class TorchPath:
    """The plane's operations as generators over torch views of the segment.

    Each operation (:meth:`all_reduce`, :meth:`all_reduce_across`, :meth:`reduce_scatter`,
    :meth:`all_gather`, :meth:`broadcast`, :meth:`barrier`) returns a generator of waits that
    :class:`~smddp.comm.planes.shm.Plane` drives; :meth:`reached` says whether a wait is over and
    :meth:`behind` which ranks it still waits for.

    Args:
        view: this rank's view of the segment.
        core: the compiled core's ``Segment`` where the plane has one: it keeps the protocol's
            counters (this path shares them) and publishes the epoch (waking peers asleep on it).
            None: this path keeps its own :class:`Counters`.
    """

    def __init__(self, view: SegmentView, core=None):
        self.rank, self.size, self.slot, self.part_bytes = view.rank, view.size, view.slot, view.part_bytes
        self.names, self.group = view.names, view.group
        self._bytes, self._words, self._stride = view.data, view.words, view.stride
        self._core = core
        self._state = core if core is not None else Counters()
        self._cache: dict = {}

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
        if self._core is not None:
            return self._core.publish()  # wakes the peers asleep on this rank's epoch word
        state = self._state
        state.epoch += 1
        self._words[self.rank * self._stride] = state.epoch
        return state.epoch

    def reached(self, wait) -> bool:
        """True once ``wait`` is over: the epoch words show it, or its Pending completed."""
        if not isinstance(wait, tuple):
            return wait.test()  # a Pending (the hierarchical plane's step between hosts)
        rank, epoch = wait
        words, stride = self._words, self._stride
        if rank is not None:
            return words[rank * stride] >= epoch
        for r in range(self.size):
            if words[r * stride] < epoch:
                return False
        return True

    def behind(self, wait: _Wait) -> List[int]:
        """The ranks that ``wait`` still waits for."""
        rank, epoch = wait
        ranks = range(self.size) if rank is None else (rank,)
        return [r for r in ranks if self._words[r * self._stride] < epoch]

    def _step(self) -> Iterator[_Wait]:
        """Start a step: wait until this step's buffer is free. Yields waits; leaves the step in ``_state.steps``."""
        state = self._state
        state.steps += 1
        if not self.reached((None, state.last_written)):
            yield (None, state.last_written)

    def _written(self, fp: Optional[Print] = None) -> int:
        """Publish this step's copy-in; ``fp``: the operation's fingerprint (its first step)."""
        if fp is not None:
            at = self.rank * self._stride + FP_WORD + 2 * (self._state.steps % 2)
            self._words[at], self._words[at + 1] = fp
        self._state.last_written = self._publish()
        return self._state.last_written

    def _check(self, fp: Optional[Print]) -> None:
        """After the first step's wait on every rank: raise if a rank's fingerprint is not ``fp``.

        Raises:
            CollectiveMismatchError: on every rank, which all stop after the same step.
        """
        if fp is None:
            return
        words, stride = self._words, self._stride
        at = FP_WORD + 2 * (self._state.steps % 2)
        prints = [(words[r * stride + at], words[r * stride + at + 1]) for r in range(self.size)]
        if any(p != fp for p in prints):
            raise mismatch_error(prints, self.names, "the shared-memory plane", self.group)

    # ------------------------------------------------------------------ operations
    def all_reduce(self, tensor: torch.Tensor, op: Op, seq: int) -> Iterator[_Wait]:
        """Reduce flat contiguous ``tensor`` in place over the plane's ranks; ``seq``: its number."""
        flat = tensor.view(-1)
        fp = (flat.numel(), signature(seq, "all_reduce", flat.dtype, op))
        nbytes = flat.numel() * flat.element_size()
        if nbytes <= min(ONE_SHOT_MAX, self.slot):
            yield from self._reduce_one_shot(flat, op, fp)
            return
        per_step = self.slot // flat.element_size()
        for start in range(0, flat.numel(), per_step):
            yield from self._reduce_slice(flat[start:start + per_step], op, fp if start == 0 else None)

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
            _PAIRWISE[op](parts[0], parts[1], out=acc)
            for part in parts[2:]:
                combine(acc, part, op)
        if scale and op is Op.AVERAGE:
            average(acc, self.size)
        if acc is not out:
            out.copy_(acc)

    def _reduce_one_shot(self, flat: torch.Tensor, op: Op, fp: Print) -> Iterator[_Wait]:
        yield from self._step()
        views = self._views(self._state.steps, flat.dtype, flat.numel())
        views[self.rank].copy_(flat)
        yield (None, self._written(fp))
        self._check(fp)
        self._fold(flat, views, op, True)

    def _reduce_slice(self, flat: torch.Tensor, op: Op, fp: Optional[Print]) -> Iterator[_Wait]:
        yield from self._step()
        n = flat.numel()
        views = self._views(self._state.steps, flat.dtype, n)
        mine = views[self.rank]
        bounds = _bounds(n, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        # Publish only what the others reduce; this rank's own part stays private until reduced.
        mine[:lo].copy_(flat[:lo])
        mine[hi:].copy_(flat[hi:])
        yield (None, self._written(fp))
        self._check(fp)
        parts = [flat[lo:hi] if r == self.rank else views[r][lo:hi] for r in range(self.size)]
        self._fold(mine[lo:hi], parts, op, True)
        flat[lo:hi].copy_(mine[lo:hi])
        yield (None, self._publish())
        for r in range(self.size):
            if r != self.rank:
                flat[bounds[r]:bounds[r + 1]].copy_(views[r][bounds[r]:bounds[r + 1]])

    def all_reduce_across(self, tensor: torch.Tensor, op: Op, across, world: int, tag: int,
                          agreed=None) -> Iterator[_Wait]:
        """All-reduce flat ``tensor`` over several hosts: this host's part through shared memory,
        the hosts' parts through ``across`` (a communicator of the ranks with this local rank).

        Per slice of ``part_bytes`` (as the compiled core cuts them: a host on this path and one
        with the core run one job): each local rank reduces its part of the slice over the host,
        all-reduces that part with the same local rank of every other host (float32 for half
        types), and the host all-gathers the parts. ``world`` (the group's size) divides an
        AVERAGE; ``tag`` is the collective's sequence number; ``agreed``: the group's exchange of
        this call's fingerprint, awaited before any step (it raises if the calls differ).
        """
        if agreed is not None:
            yield agreed
        across_op = Op.SUM if op is Op.AVERAGE else op
        flat = tensor.view(-1)
        fp = (flat.numel(), signature(tag, "all_reduce", flat.dtype, op))
        per_step = max(self.part_bytes // flat.element_size(), self.size)
        for begin in range(0, max(flat.numel(), 1), per_step):
            part = flat[begin:begin + per_step]
            yield from self._step()
            step, n = self._state.steps, part.numel()
            mine = self._view(self.rank, step, part.dtype, n)
            mine.copy_(part)
            yield (None, self._written(fp if begin == 0 else None))
            self._check(fp if begin == 0 else None)
            bounds = _bounds(n, self.size)
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            target = part[lo:hi]
            acc = torch.empty(hi - lo, dtype=torch.float32) if part.dtype in _HALF else target
            self._fold(acc, [self._view(r, step, part.dtype, n)[lo:hi] for r in range(self.size)], op, False)
            if hi > lo:
                yield across.all_reduce(acc, across_op, tag)
            if op is Op.AVERAGE:
                average(acc, world)
            if acc is not target:
                target.copy_(acc)
            mine[lo:hi].copy_(target)
            yield (None, self._publish())
            for r in range(self.size):
                if r != self.rank:
                    part[bounds[r]:bounds[r + 1]].copy_(self._view(r, step, part.dtype, n)[bounds[r]:bounds[r + 1]])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, seq: int
                            ) -> Iterator[_Wait]:
        """Rank r receives the ``op`` of every rank's slice r of flat ``input`` into flat ``output``."""
        m = output.numel()
        rows = input.view(self.size, m)
        out = output.view(-1)
        fp = (m, signature(seq, "reduce_scatter", input.dtype, op))
        per_step = max(1, self.slot // (input.element_size() * self.size))
        for start in range(0, max(m, 1), per_step):
            length = min(per_step, m - start)
            yield from self._step()
            step = self._state.steps
            cells = self._view(self.rank, step, input.dtype, self.size * length).view(self.size, length)
            cells.copy_(rows[:, start:start + length])
            yield (None, self._written(fp if start == 0 else None))
            self._check(fp if start == 0 else None)
            lo = self.rank * length
            parts = [self._view(r, step, input.dtype, self.size * length)[lo:lo + length] for r in range(self.size)]
            self._fold(out[start:start + length], parts, op, True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, seq: int) -> Iterator[_Wait]:
        """Fill flat ``output`` with every rank's flat ``input`` in rank order."""
        m = input.numel()
        src, out = input.view(-1), output.view(-1)
        fp = (m, signature(seq, "all_gather", input.dtype))
        per_step = max(1, self.slot // input.element_size())
        for start in range(0, max(m, 1), per_step):
            length = min(per_step, m - start)
            yield from self._step()
            step = self._state.steps
            self._view(self.rank, step, input.dtype, length).copy_(src[start:start + length])
            yield (None, self._written(fp if start == 0 else None))
            self._check(fp if start == 0 else None)
            for r in range(self.size):
                out[r * m + start:r * m + start + length].copy_(self._view(r, step, input.dtype, length))

    def broadcast(self, tensor: torch.Tensor, src: int, seq: int) -> Iterator[_Wait]:
        """Copy rank ``src``'s flat ``tensor`` into every rank's.

        The first step waits for every rank (each checks every fingerprint, the root too);
        the others, for the root only.
        """
        flat = tensor.view(-1)
        fp = (flat.numel(), signature(seq, "broadcast", flat.dtype, root=src))
        per_step = max(1, self.slot // flat.element_size())
        for start in range(0, max(flat.numel(), 1), per_step):
            part = flat[start:start + per_step]
            yield from self._step()
            step = self._state.steps
            if self.rank == src:
                self._view(src, step, part.dtype, part.numel()).copy_(part)
            epoch = self._written(fp if start == 0 else None)
            if start == 0:
                yield (None, epoch)
                self._check(fp)
            elif self.rank != src:
                yield (src, epoch)
            if self.rank != src:
                part.copy_(self._view(src, step, part.dtype, part.numel()))

    def barrier(self, seq: int) -> Iterator[_Wait]:
        """Complete once every rank of the plane has entered it."""
        fp = (-1, signature(seq, "barrier"))
        yield from self._step()  # the fingerprint's half of the header line must be free
        yield (None, self._written(fp))
        self._check(fp)


def _bounds(n: int, parts: int) -> List[int]:
    """Split points of ``n`` elements into ``parts`` near-equal runs (as torch.tensor_split)."""
    q, r = divmod(n, parts)
    out, total = [0], 0
    for i in range(parts):
        total += q + (1 if i < r else 0)
        out.append(total)
    return out
