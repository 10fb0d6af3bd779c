"""Which ranks never arrived: ask every rank where it is when a collective times out.

Each process runs one responder thread, for all its groups, that blocks on its own queue in the
job's key-value store (``queue_pop`` on a private connection: the GIL is released and no CPU is
used while it waits). A rank whose collective timed out pushes a query onto every other rank's queue;
each responder answers with its :func:`status` (the last collective it started, whether it
finished, how long ago, whether the script has ended). Nothing is exchanged while
collectives run normally, so the hot path pays nothing.

A rank answers while its main thread sleeps, computes in torch, or waits in a collective.
A rank that does not answer within :data:`ANSWER_WAIT` seconds is named as not answering.
Each rank leaves its process id and host identity in the store when it starts answering, so
that a rank on the same host can say more: the silent process is stopped (``SIGSTOP``, a
debugger), dead, or alive and stuck in code that never releases Python's GIL. Advice about
uneven batches is given only about ranks that answered.

When a script ends, its rank leaves a note in the store (``exiting``/``closed``/``failed``)
so that a rank still waiting learns that the other one left its training loop (the
uneven-batches case). Under MPI the ending rank also waits, answering queries, until every
rank has ended (``MPI_Finalize`` would wait for them anyway), so that rank 0, whose process
hosts the store, keeps it alive for the others.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from smddp.comm.mismatch.fingerprint import ranks_text
from smddp.comm.waiting import poll
from smddp.job.host import host_identity  # the one definition of "this host" (pid namespace included)

#: Seconds a timed-out rank waits for the other ranks' answers.
ANSWER_WAIT = 3.0

#: What a rank says about itself; see :meth:`smddp.comm.engine.Engine.status`.
Status = Dict[str, object]

_POLL = 0.02


def _pause() -> None:
    time.sleep(_POLL)  # a store round trip costs far more than a collective's test


def labelled(op_name: str, label: Optional[str]) -> str:
    """The name a collective goes by in errors and stall reports: ``all_reduce (<label>)``."""
    return f"{op_name} ({label})" if label else op_name


def label_of(op_name: object) -> Optional[str]:
    """The caller's label in a name made by :func:`labelled`, None if it has none."""
    name = str(op_name)
    if not name.endswith(")") or " (" not in name:
        return None
    return name[name.index(" (") + 2:-1]


class StoreChannel:
    """Answers and asks "where are you?" for every group of this process, over the job's store.

    One channel per process and world, whatever the number of groups: one responder thread and one
    store connection of its own (the responder blocks on it: a blocking call on a shared connection
    would hold that connection's lock against every other user), so the store's host holds one
    connection per rank for it, not one per rank and group. Each group's engine serves under the
    group's name (:meth:`serve`; the world's is ``""``); queries and answers name the group, and
    ranks are the world's (global) ranks.

    Args:
        store: the world's store: its keys are the world's own (the world's namespace), so the
            channel's keys need no number of their own. A per-process count would differ between
            ranks that made different numbers of groups, and their questions would go unanswered.
        rank: this process's rank in the world.
        size: number of ranks in the world.
    """

    def __init__(self, store, rank: int, size: int):
        import torch.distributed as tdist

        self.rank, self.size = rank, size
        self.store = tdist.PrefixStore("smddp/stall", store)
        self._conn: Optional[object] = None  # the responder's own connection, made as it starts
        self._groups: Dict[str, Callable[[], Status]] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._query_lock = threading.Lock()
        self._queries = itertools.count(1)
        self._notes: Dict[str, Status] = {}  # each group's final status, once it has ended here

    def serve(self, group: str, status: Callable[[], Status]) -> None:
        """Answer the queries about ``group`` with ``status()``; the first call starts the responder
        and says which process answers."""
        with self._lock:
            self._groups[group] = status
            if self._thread is not None:
                return
            self._conn = self.store.clone()
            self._conn.set_timeout(timedelta(days=365))
            self.store.set(f"p/{self.rank}", json.dumps({"pid": os.getpid(), "host": host_identity()}))
            self._thread = threading.Thread(target=self._serve, name="smddp-stall-responder", daemon=True)
            self._thread.start()

    def leave(self, group: str) -> None:
        """Stop answering about ``group`` (destroyed): its note, left by :meth:`note_end`, answers."""
        with self._lock:
            self._groups.pop(group, None)

    def _serve(self) -> None:
        key = f"q/{self.rank}"
        while True:
            try:
                raw = self._conn.queue_pop(key, block=True)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            query = _json_dict(raw)
            if query is None or not all(type(query.get(k)) is int for k in ("from", "id")) or \
                    type(query.get("group", "")) is not str:
                if query is not None and query.get("stop") is True:
                    return
                continue  # not a query smddp wrote: ignored, and the responder keeps answering
            group = query.get("group", "")
            with self._lock:
                status, note = self._groups.get(group), self._notes.get(group)
            base = f"a/{group}/{query['from']}/{query['id']}"
            try:
                # A group destroyed here answers with its note; one not made yet says so.
                answer = status() if status is not None else note or {"seq": 0, "age": 0.0, "state": "absent"}
                self._conn.set(f"{base}/{self.rank}", json.dumps(answer))
                self._conn.add(f"{base}/n", 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def query(self, group: str = "", members: Optional[Sequence[int]] = None,
              timeout: float = ANSWER_WAIT) -> Dict[int, Optional[Status]]:
        """Ask every other member of ``group`` for its status.

        Args:
            group: the group's name (``""``: the world).
            members: the group's global ranks (default: every rank of the world).
            timeout: seconds to wait for answers.

        Returns:
            ``{global rank: status or None}`` for every other member; None: no answer, no note
            left at exit, and nothing known of its process. A rank that did not answer whose
            process is on this host gets ``{"state": "silent", "process": ..., "pid": ...}``, with
            ``process`` one of :func:`process_state`'s answers.
        """
        with self._query_lock:
            qid = next(self._queries)
            message = json.dumps({"from": self.rank, "id": qid, "group": group})
            others = [r for r in (range(self.size) if members is None else members) if r != self.rank]
            for r in others:
                self.store.queue_push(f"q/{r}", message)
            base = f"a/{group}/{self.rank}/{qid}"
            # Ranks that have ended left a note instead of an answer: do not wait for them.
            poll(lambda: self.store.add(f"{base}/n", 0) + self.store.add(f"ended/{group}", 0) >= len(others),
                 time.monotonic() + timeout, pause=_pause)
            found: Dict[int, Optional[Status]] = {}
            for r in others:
                found[r] = self._read(f"{base}/{r}") or self._read(f"x/{group}/{r}") or self._silent(r)
            return found

    def _silent(self, rank: int) -> Optional[Status]:
        """What this host can see of ``rank``'s process, which did not answer."""
        where = self._read(f"p/{rank}")
        if not isinstance(where, dict) or not where.get("host") or where.get("host") != host_identity():
            return None
        pid = where.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return None
        return {"state": "silent", "process": process_state(pid), "pid": pid}

    def _read(self, key: str) -> Optional[Status]:
        if not self.store.check([key]):
            return None
        found = _json_dict(self.store.get(key))
        if found is None or not all(isinstance(found.get(k, 0), (int, float)) for k in ("seq", "age")):
            return None  # not a status smddp wrote: treated as no answer
        return found

    def note_end(self, status: Status, group: str = "") -> None:
        """Leave this rank's final status in ``group`` where the others find it (once per group)."""
        with self._lock:
            if group in self._notes:
                return
            self._notes[group] = status
        self.store.set(f"x/{group}/{self.rank}", json.dumps(status))
        self.store.append(f"who/{group}", f"{self.rank},")  # before the count: a reader of one finds the other
        self.store.add(f"ended/{group}", 1)

    def ended(self, group: str = "", known: int = 0) -> Optional[Dict[int, Status]]:
        """The ranks of ``group`` that have ended here (their script's end, ``destroy_process_group``,
        an uncaught exception), each with the status it left; None while their number is still
        ``known`` (one store read: the count).
        """
        if self.store.add(f"ended/{group}", 0) == known:
            return None
        found: Dict[int, Status] = {}
        for part in self.store.get(f"who/{group}").decode().split(","):
            if part.isdigit():
                note = self._read(f"x/{group}/{part}")
                if note is not None:
                    found[int(part)] = note
        return found

    def wait_all_ended(self, timeout: float) -> bool:
        """Wait until every rank of the world has called :meth:`note_end` for it, answering queries meanwhile.

        Returns:
            True if they all did within ``timeout`` seconds.
        """

        def ended() -> bool:
            try:
                return self.store.add("ended/", 0) >= self.size
            except Exception:  # noqa: BLE001 - the store's host has gone: nothing to wait for
                return True

        return poll(ended, time.monotonic() + timeout, pause=_pause)

    def close(self) -> None:
        """Stop the responder thread."""
        if self._thread is not None and self._thread.is_alive():
            try:
                self.store.queue_push(f"q/{self.rank}", json.dumps({"stop": True}))
            except Exception:  # noqa: BLE001 - the store is gone: so is the thread's connection
                pass
            # It must be gone before the interpreter shuts down: a thread that returns from a
            # blocking store call during shutdown aborts the process. It ends within
            # milliseconds; the bound only matters on a starved CPU.
            self._thread.join(10.0)


def _json_dict(raw) -> Optional[dict]:
    """``raw`` (bytes from the store) as a JSON object, or None: the store's values are only ever
    read as JSON, never unpickled, and a malformed one is ignored."""
    try:
        found = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def process_state(pid: int) -> str:
    """``"stopped"``, ``"dead"`` or ``"alive"``: process ``pid`` on this host, from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "dead"
    if state in ("T", "t"):
        return "stopped"
    return "dead" if state in ("Z", "X", "x") else "alive"


# ---------------------------------------------------------------------------- the report
def _where(st: Status) -> str:
    seq, op, age = st.get("seq", 0), st.get("op") or "", float(st.get("age") or 0.0)
    state = st.get("state")
    last = f"after sequence {seq} ({op})" if seq else "before its first collective"
    if state == "exiting":
        return f"has reached the end of its script, {last}"
    if state == "closed":
        return f"has called destroy_process_group(), {last}"
    if state == "failed":
        return f"has ended with an uncaught exception ({st.get('error', '?')}), {last}"
    if state == "absent":
        return "has not made this group yet (or has destroyed it)"
    if not seq:
        return "has not started any collective yet"
    if state == "broken":
        return f"has given up after its own collective failed or timed out, {last}"
    if st.get("done"):
        return (f"is outside collectives: its last one, sequence {seq} ({op}), started {age:.1f} s ago and "
                f"finished; since then it has been computing, loading data or sleeping, or it left the loop")
    return f"is waiting in sequence {seq} ({op}), started {age:.1f} s ago"


def _kind(op_name: object) -> str:
    return str(op_name).split(" ", 1)[0]


def describe(statuses: Dict[int, Optional[Status]], seq: int, op_name: str, stalled: bool = True,
             advice: Optional[Mapping[str, str]] = None) -> str:
    """Sentences naming the ranks that never arrived at collective ``seq`` (``op_name``).

    Args:
        statuses: each other rank's answer (None: no answer).
        seq: the sequence number of the collective this rank waits in.
        op_name: what this rank called.
        stalled: it timed out (else it failed: nothing is said when every rank is in step).
        advice: label to a sentence for the user (the engine's ``advice``), added when this
            rank's collective, or the one an answering peer is in instead, carries that label.
    """
    advice = advice or {}
    if _kind(op_name) in ("send", "recv", "receive"):
        return _positions(statuses)
    missing: Dict[str, List[int]] = {}
    different: Dict[str, List[int]] = {}
    silent: Dict[int, Optional[Status]] = {}
    mine = advice.get(label_of(op_name) or "")
    # A label's advice fits only ranks that answered and are elsewhere in the script
    # (another collective, outside collectives, its end), never a silent one.
    hints: List[str] = []
    for rank, st in sorted(statuses.items()):
        if st is None or st.get("state") == "silent":
            silent[rank] = st
            continue
        at = int(st.get("seq") or 0)
        if at < seq:
            missing.setdefault(_where(st), []).append(rank)
            if mine and st.get("state") not in ("failed", "broken"):
                hints.append(mine)
        elif at == seq and _kind(st.get("op")) != _kind(op_name):
            different.setdefault(str(st.get("op")), []).append(rank)
            hints += [h for h in (mine, advice.get(label_of(st.get("op")) or "")) if h]
    parts = []
    never = sorted(r for ranks in missing.values() for r in ranks)
    if never:
        parts.append(f"Ranks that never arrived: {ranks_text(never)}.")
        parts.extend(f"Rank {ranks_text(ranks)} {where}." for where, ranks in missing.items())
    for other, ranks in different.items():
        parts.append(
            f"Rank {ranks_text(ranks)} called {other} as sequence {seq} where this rank called {op_name}: "
            f"the ranks called different collectives (set SMDDP_DEBUG=1 to check every call)."
        )
    if silent:
        parts.append(_silent_text(silent))
    if not parts and stalled:
        parts.append(
            "Every rank arrived at this collective: it stalled inside the communication library "
            "(a network problem, or a peer stuck inside it); for NCCL, set NCCL_DEBUG=INFO."
        )
    parts.extend(dict.fromkeys(hints))  # each piece of advice once, in the order found
    return " ".join(parts)


#: What a silent rank's process state says, by :func:`process_state`'s answer.
_SILENT_WHY = {
    "stopped": "is stopped (SIGSTOP, Ctrl-Z or a debugger): it cannot answer or take part until "
               "resumed (kill -CONT {pid})",
    "dead": "has died",
    "alive": "is alive but not responding: hung in native code that holds Python's GIL (py-spy dump "
             "--native --pid {pid} shows where)",
    None: "is not answering: alive but not responding (stopped, or hung in native code that holds "
          "Python's GIL), or dead",
}


def _silent_text(silent: Dict[int, Optional[Status]]) -> str:
    """Sentences about the ranks that did not answer, with what this host saw of their processes."""
    by_state: Dict[Optional[str], List[int]] = {}
    for rank, st in silent.items():
        by_state.setdefault(st.get("process") if st else None, []).append(rank)
    parts = [f"Ranks that did not answer within {ANSWER_WAIT:g} s: {ranks_text(silent)}."]
    for state, ranks in by_state.items():
        why = _SILENT_WHY.get(state, _SILENT_WHY[None])
        pids = [silent[r]["pid"] for r in ranks if silent[r]]
        where = f" (process {', '.join(map(str, pids))} on this host)" if pids else ""
        parts.append(f"Rank {ranks_text(ranks)}{where} {why.format(pid=' '.join(map(str, pids)))}.")
    return " ".join(parts)


def _positions(statuses: Dict[int, Optional[Status]]) -> str:
    """Where each rank is, for a point-to-point message (which involves two ranks, not all)."""
    where: Dict[str, List[int]] = {}
    silent: Dict[int, Optional[Status]] = {}
    for rank, st in sorted(statuses.items()):
        if st is None or st.get("state") == "silent":
            silent[rank] = st
        else:
            where.setdefault(_where(st), []).append(rank)
    parts = [f"Rank {ranks_text(ranks)} {text}." for text, ranks in where.items()]
    if silent:
        parts.append(_silent_text(silent))
    return " ".join(parts)
