"""The engine's health: broken or usable, what its errors say, where every rank is.

:class:`Health` is the part of :class:`~smddp.comm.engine.Engine` that decides and
reports failure:

- a job is broken by its first failure (a timeout, a library error, an interrupt) and
  every later collective fails at once (:meth:`Health._check_usable`);
- errors name the collective, its sequence number and this rank (its global rank in a
  subgroup), and, through :mod:`smddp.comm.engine.stall`, where the other ranks are;
- at exit (:mod:`smddp.job.excepthook`) a broken job ends every rank, and a healthy one leaves
  a note for the ranks that may still wait for it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, List, Optional, Sequence

import smddp.comm.engine.stall as _stall
from smddp.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeout
from smddp.job import excepthook

if TYPE_CHECKING:
    from smddp.comm.engine.handle import Handle


class Health:
    """Failure state and reports of an engine; :class:`~smddp.comm.engine.Engine` inherits it."""

    rank: int
    size: int
    timeout: float
    seq: int
    _closed: bool

    def _init_health(self, store) -> None:
        """Start healthy; with ``store`` (the job's torch Store), answer other ranks' questions."""
        self._broken: Optional[BaseException] = None
        # What this rank is doing, for the ranks that time out waiting for it.
        self._last_op = ""  # the name of collective number self.seq
        self._last_start = 0.0  # time.monotonic() when the latest synchronous one started
        self._done_seq = 0  # the latest synchronous collective that completed
        # The latest asynchronous one while in flight (the engine forgets it once done: it is the
        # caller's Work); _done_seq then counts it.
        self._last_handle: Optional[Handle] = None
        self._end_note: Optional[dict] = None  # set when the script ends
        self._statuses: Optional[dict] = None  # the other ranks' answers, asked once
        self._report_lock = threading.Lock()
        self._channel: Optional[_stall.StoreChannel] = None
        self._channel_group = ""  # this group's name in the channel ("": the world)
        self._ended_known = 0  # how many of this group's ranks were seen to have ended
        self._owns_channel = False  # the world's engine opens the process's channel and closes it
        if self.size > 1:
            if store is not None:
                self._channel = self._open_channel(store)
                self._owns_channel = self._channel is not None
            excepthook.watch(self)

    #: For a subgroup: its name and its members' global ranks (group rank i is global_ranks[i]).
    group_name: str = ""
    global_ranks: Optional[List[int]] = None

    def describe_group(self, name: str, global_ranks: Sequence[int],
                       channel: Optional[_stall.StoreChannel] = None) -> None:
        """Make this a subgroup's engine: errors name global ranks and the group ``name``.

        ``channel``: the process's stall channel (the world engine's :attr:`stall_channel`), which
        then answers and asks about this group too: a subgroup opens no store connection and
        starts no thread of its own.
        """
        self.group_name, self.global_ranks = name, list(global_ranks)
        if channel is not None and self.size > 1 and self._channel is None:
            self._channel, self._channel_group = channel, name
            channel.serve(name, self.status)

    @property
    def stall_channel(self) -> Optional[_stall.StoreChannel]:
        """The stall channel this engine asks and answers through (None without a store)."""
        return self._channel

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's ``rank``."""
        return rank if self.global_ranks is None else self.global_ranks[rank]

    def _who(self) -> str:
        if self.global_ranks is None:
            return f"rank {self.rank} of {self.size}"
        return (f"rank {self.global_rank(self.rank)} (rank {self.rank} of the {self.size} in process group "
                f"{self.group_name!r}, global ranks {_stall.ranks_text(self.global_ranks)})")


    def _check_usable(self) -> None:
        if self._closed:
            raise CollectiveError("the process group was destroyed; call init_process_group() again")
        if self._broken is not None:
            # A timeout noticed after the call that stalled (nccl's watchdog) is raised as one.
            kind = CollectiveTimeout if isinstance(self._broken, CollectiveTimeout) else CollectiveError
            raise kind(
                f"the job is broken after an earlier failure and cannot run more collectives: "
                f"{self._broken}"
            ) from self._broken

    def failure(self, exc: BaseException, handle: Handle) -> BaseException:
        """``exc`` as the CollectiveError that ``handle`` ends with; the job is broken by it."""
        if not isinstance(exc, CollectiveError):
            # A peer that died or left shows here first (gloo: "connection closed"): say where the others are.
            report = self._stall_report(handle.seq, handle.op_name, stalled=False) if self._broken is None else ""
            wrapped = CollectiveError(
                f"{handle.op_name} (sequence number {handle.seq}) failed on {self._who()}: {exc}{report}"
            )
            wrapped.__cause__ = exc
            exc = wrapped
        # A mismatch found before any data was used (the shared-memory plane's fingerprints)
        # leaves the ranks in step: raised on every rank, it breaks nothing.
        if self._broken is None and not isinstance(exc, CollectiveMismatchError):
            self._broken = exc
        return exc

    def look_for_ended(self, seq: int, op_name: str) -> None:
        """Raise now, not at the deadline, if a rank of this group has ended before collective ``seq``.

        A rank whose script ended (``sys.exit``, or its last line), or that destroyed the group,
        after an earlier collective of the group will never join this one: under ``mpirun`` it
        then waits in ``MPI_Finalize`` and the others waited for their whole timeout (30 minutes
        by default). A long wait looks once a second (:func:`smddp.comm.waiting.poll`'s ``watch``):
        one store read, the count of the group's ranks that have ended.

        Raises:
            CollectiveError: naming the ranks and where each ended; the job is broken by it.
        """
        channel = self._channel
        if channel is None:
            return
        try:
            found = channel.ended(self._channel_group, self._ended_known)
        except Exception:  # noqa: BLE001 - the store is gone: the deadline still holds
            return
        if found is None:
            return
        self._ended_known = len(found)
        me = self.global_rank(self.rank)
        gone = {rank: st for rank, st in found.items() if rank != me and int(st.get("seq") or 0) < seq}
        if not gone:
            return
        error = CollectiveError(
            f"{op_name} (sequence number {seq}) cannot complete on {self._who()}: a rank of the group ended "
            f"before it and will never join it (seen now, not at the {self.timeout:g} s timeout). "
            f"{_stall.describe(gone, seq, op_name, True, self.advice)} The job is now broken: further "
            f"collectives fail at once."
        )
        if self._broken is None:
            self._broken = error
        raise error

    def _timeout(self, seq: int, op_name: str, detail: str = "") -> CollectiveTimeout:
        return CollectiveTimeout(
            f"{op_name} (sequence number {seq}) did not complete within {self.timeout:g} s on "
            f"{self._who()}{': ' + detail if detail else ''}.{self._stall_report(seq, op_name)} "
            f"The job is now broken: further collectives fail at once (the timeout is set by "
            f"SMDDP_TIMEOUT or init_process_group(timeout=...))."
        )

    def stalled(self, seq: int, op_name: str, detail: str = "") -> CollectiveTimeout:
        """The timeout error for ``seq``, the job marked broken by it; ``detail``: what it waited for."""
        error = self._timeout(seq, op_name, detail)
        if self._broken is None:
            self._broken = error
        return error

    def interrupted(self, seq: int, op_name: str) -> None:
        """Collective ``seq`` was interrupted (KeyboardInterrupt) while it waited: the job is broken."""
        if self._broken is None:
            self._broken = CollectiveError(
                f"{op_name} (sequence number {seq}) was interrupted on rank {self.rank}; the ranks are "
                f"no longer in step"
            )

    def _close_health(self) -> None:
        """The engine is closing: tell the other ranks, stop answering them."""
        if self._channel is not None:
            if self._broken is None:
                self._end_note = {"state": "closed"}
                try:
                    self._channel.note_end(self.status(), self._channel_group)
                except Exception:  # noqa: BLE001 - the store may already be gone
                    pass
            if self._owns_channel:
                self._channel.close()
            else:
                self._channel.leave(self._channel_group)
        if self._broken is None:
            excepthook.forget(self)  # a broken engine still ends the job at exit

    # ------------------------------------------------------------------ where every rank is
    def _open_channel(self, store) -> Optional[_stall.StoreChannel]:
        if store is None:
            return None
        try:
            channel = _stall.StoreChannel(store, self.rank, self.size)
            channel.serve("", self.status)
        except Exception as exc:  # noqa: BLE001 - a store without clone() or queues
            print(f"smddp: rank {self.rank}: timeouts will not name the stalled ranks: {exc}", file=sys.stderr)
            return None
        return channel

    def status(self) -> _stall.Status:
        """Where this rank is: its latest collective, whether it finished, how long ago it started."""
        seq, op_name, handle = self.seq, self._last_op, self._last_handle
        if handle is not None and handle.seq == seq:
            done, started = handle.done, handle.deadline - self.timeout
        else:
            done, started = self._done_seq >= seq, self._last_start
        state = "broken" if self._broken is not None else "running"
        found = {"rank": self.rank, "seq": seq, "op": op_name, "done": bool(done), "state": state,
                 "age": round(time.monotonic() - started, 3) if seq else 0.0}
        if self._end_note is not None:
            found.update(self._end_note)
        return found

    def _stall_report(self, seq: int, op_name: str, stalled: bool = True) -> str:
        if self._channel is None:
            return ""
        with self._report_lock:
            if self._statuses is None:
                try:
                    if self._owns_channel:  # its own channel, over its own store: its own ranks
                        found = self._channel.query()
                        self._statuses = {self.global_rank(rank): st for rank, st in found.items()}
                    else:  # the process's channel: the world's ranks
                        self._statuses = self._channel.query(self._channel_group, self.global_ranks)
                except Exception as exc:  # noqa: BLE001 - the report is best effort
                    return f" (could not ask the other ranks where they are: {exc})"
        text = _stall.describe(self._statuses, seq, op_name, stalled, self.advice)  # by global rank
        return " " + text if text else ""

    def at_exit(self, failure: Optional[str] = None) -> None:
        """The interpreter is exiting (called by :mod:`smddp.job.excepthook`).

        A broken job ends at once (under MPI, every rank). Otherwise this rank leaves a note
        for ranks that may still wait for it and, under MPI, waits (answering their
        questions) until every rank has ended, as ``MPI_Finalize`` would.

        Args:
            failure: the uncaught exception that ends the script, if any.
        """
        if self._broken is not None:
            print(f"smddp: rank {self.rank} is exiting with the job broken ({type(self._broken).__name__}); "
                  f"ending the job now rather than waiting for a collective that will never complete",
                  file=sys.stderr)
            excepthook.abort_job(1)
        if self._closed or self._channel is None:
            return
        self._end_note = {"state": "failed", "error": failure} if failure else {"state": "exiting"}
        if not self._owns_channel:  # a subgroup: its note; the world's engine waits and closes
            self._channel.note_end(self.status(), self._channel_group)
            return
        try:
            self._channel.note_end(self.status())
            # Long enough for a rank still in a collective to time out and ask this one.
            wait = self.timeout + 2 * _stall.ANSWER_WAIT + 5
            if excepthook.mpi_running() and not failure and not self._channel.wait_all_ended(wait):
                print(f"smddp: rank {self.rank}: other ranks have not reached the end of their script within "
                      f"{wait:g} s", file=sys.stderr)
        finally:
            # Stop the responder now: a thread that wakes up during interpreter shutdown
            # (when rank 0's store goes away) aborts the process.
            self._channel.close()
