"""Nothing silently wrong, nothing reachable (issue 25).

- an argument error one rank can see alone raises on that rank before anything is sent, on
  every CPU backend, and the job goes on (real 2-rank jobs, ``tests/ranks/safety_job.py``);
- a stall report names a stopped rank as not answering, without the uneven-batches advice;
- what the stall reports read from the store is JSON, checked, never unpickled.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist

from smddp.comm.engine import stall
from smddp.torch._labels import ADVICE

from launchers import mpirun, rank_lines

SCRIPT = "tests/ranks/safety_job.py"

#: Every case of ``safety_job.py badargs``: each rank must raise its promised error.
BADARGS = (
    "v1_a2a_own_split", "torch_a2a_own_split", "torch_a2a_list_own", "v1_all_reduce_expanded",
    "torch_all_reduce_expanded", "v1_broadcast_expanded", "v1_all_gather_expanded",
    "torch_all_gather_into_expanded", "torch_reduce_scatter_expanded", "torch_scatter_expanded",
    "torch_coalesced_expanded", "v1_all_reduce_sparse",
)

PLANES = {
    "shm": {},  # mpirun's default on one host: the mpi backend over shared memory
    "mpi": {"SMDDP_CPU_PLANE": "mpi"},
    "gloo": {"SMDDP_BACKEND": "gloo"},
}


def _found(output: str, word: str) -> dict:
    """``{case: {rank: rest}}`` from lines ``WORD <rank> <case> <rest>``."""
    found: dict = {}
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0].endswith(word) and parts[1].isdigit():
            found.setdefault(parts[2], {})[int(parts[1])] = parts[3] if len(parts) > 3 else ""
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("plane", sorted(PLANES))
def test_local_argument_errors_raise_on_every_rank_before_sending(plane):
    result = mpirun(2, [SCRIPT, "badargs"], timeout=120, env=PLANES[plane])
    assert "MPI_ABORT" not in result.output, result.output
    result.check()
    raised = _found(result.stdout, "RAISED")
    assert not _found(result.stdout, "WRONG") and not _found(result.stdout, "MISSED"), result.output
    assert "TOUCHED" not in result.stdout, result.output
    for case in BADARGS:
        assert sorted(raised.get(case, {})) == [0, 1], (case, result.output)
    # Nothing was sent: the ranks are still in step and compute the right sum.
    assert rank_lines(result.stdout, "AFTER") == {0: "ok", 1: "ok"}, result.output
    assert rank_lines(result.stdout, "END") == {0: "", 1: ""}, result.output


# ---------------------------------------------------------------------------- stall reports
def _kill_stopped(pid_file: str) -> None:
    """Resume and kill the process that stopped itself, if it is still there (and still ours)."""
    try:
        with open(pid_file) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"safety_job.py" not in f.read():
                return
    except (OSError, ValueError):
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


@pytest.mark.mpi
def test_stopped_rank_is_named_as_not_answering_without_join_advice(tmp_path):
    pid_file = str(tmp_path / "stopped.pid")
    try:
        result = mpirun(2, [SCRIPT, "stopped"], timeout=120, env={"SMDDP_TIMEOUT": "3", "SAFETY_PID_FILE": pid_file})
    finally:
        _kill_stopped(pid_file)
    stopping = rank_lines(result.stdout, "STOPPING")
    assert list(stopping) == [1], result.output
    pid = stopping[1].strip()
    kind, message = rank_lines(result.stdout, "STALL")[0].split(" ", 1)
    # smddp's DDP hook raises inside torch's reducer, which re-raises it as a RuntimeError with the message
    assert "all_reduce (during backward: DDP gradients) (sequence number" in message, message
    assert "did not complete" in message, message
    assert "Ranks that did not answer within 3 s: 1." in message, message
    assert f"Rank 1 (process {pid} on this host) is stopped (SIGSTOP" in message, message
    assert f"kill -CONT {pid}" in message, message
    for advice in ("Join", "drop_last", "different numbers of batches"):
        assert advice not in message, message


@pytest.mark.unit
def test_report_gives_batch_advice_only_about_ranks_that_answered():
    backward = "all_reduce (during backward: DDP gradients)"
    exiting = {"seq": 4, "op": "barrier", "done": True, "age": 0.0, "state": "exiting"}
    failed = {"seq": 4, "op": "all_reduce", "done": True, "age": 0.0, "state": "failed", "error": "ValueError"}
    stopped = {"state": "silent", "process": "stopped", "pid": 4242}
    dead = {"state": "silent", "process": "dead", "pid": 4243}
    alive = {"state": "silent", "process": "alive", "pid": 4244}
    silent = stall.describe({1: None, 2: stopped, 3: dead, 4: alive}, 5, backward, advice=ADVICE)
    assert "Join" not in silent and "drop_last" not in silent, silent
    assert silent.startswith("Ranks that did not answer within 3 s: 1-4."), silent
    assert "Rank 1 is not answering: alive but not responding (stopped, or hung in native code" in silent, silent
    assert "Rank 2 (process 4242 on this host) is stopped" in silent and "kill -CONT 4242" in silent, silent
    assert "Rank 3 (process 4243 on this host) has died" in silent, silent
    assert "Rank 4 (process 4244 on this host) is alive but not responding" in silent, silent
    # The uneven-batches case keeps its advice, also beside a silent rank.
    assert "Join([model])" in stall.describe({1: exiting}, 5, backward, advice=ADVICE)
    assert "Join([model])" in stall.describe({1: exiting, 2: stopped}, 5, backward, advice=ADVICE)
    # A rank that ended with an exception is not one that ran out of batches.
    assert "Join" not in stall.describe({1: failed}, 5, backward, advice=ADVICE)
    assert "Join" not in stall.describe({1: exiting}, 5, "all_reduce", advice=ADVICE)


def test_process_state_reads_this_host():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stall.process_state(child.pid) == "alive"
        os.kill(child.pid, signal.SIGSTOP)
        os.waitpid(child.pid, os.WUNTRACED)
        assert stall.process_state(child.pid) == "stopped"
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(timeout=10)
        assert stall.process_state(child.pid) == "dead"
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(timeout=10)
    assert stall.host_identity() and stall.host_identity() == stall.host_identity()


class Planted:
    """What an attacker who reaches the store would write: unpickling it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_stall_channel_reads_only_json_and_survives_malformed_queries(tmp_path):
    marker = tmp_path / "executed"
    server = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    asking, answering = stall.StoreChannel(server, 0, 3), stall.StoreChannel(server, 1, 3)
    here = {"seq": 3, "op": "all_reduce", "done": True, "age": 1.0, "state": "running"}
    try:
        for junk in (pickle.dumps(Planted(marker)), b"not json", b"[1, 2]", b'{"from": "0", "id": 1}',
                     b'{"from": 0, "id": 1, "group": 5}'):
            answering.store.queue_push("q/1", junk)  # before any real query: the responder must skip them
        answering.serve("", lambda: here)
        # Rank 2 never answers; in its place, notes that are not smddp's statuses.
        asking.store.set("x//2", pickle.dumps(Planted(marker)))
        asking.store.set("p/2", b'{"pid": "1", "host": "x"}')
        found = asking.query(timeout=3)
        assert found == {1: here, 2: None}, found
        asking.store.set("x//2", b'{"seq": "four"}')
        assert asking.query(timeout=1)[2] is None
    finally:
        answering.close()
    assert not marker.exists(), "a planted pickle was unpickled"


def test_one_stall_channel_serves_every_group_of_a_process_through_one_connection():
    """Groups answer under their own names through the process's one responder and connection; a
    group a rank has not made says so, and a destroyed one answers with its note."""
    server = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    asking, answering = stall.StoreChannel(server, 0, 3), stall.StoreChannel(server, 2, 3)
    world = {"seq": 7, "op": "barrier", "done": True, "age": 2.0, "state": "running"}
    sub = {"seq": 2, "op": "all_reduce", "done": False, "age": 1.0, "state": "running"}
    try:
        answering.serve("", lambda: world)
        answering.serve("5", lambda: sub)
        assert asking.query("", [0, 2], timeout=3) == {2: world}
        assert asking.query("5", [0, 2], timeout=3) == {2: sub}
        assert asking.query("6", [0, 2], timeout=3)[2]["state"] == "absent"
        assert "has not made this group yet" in stall.describe(asking.query("6", [0, 2], timeout=3), 1, "all_reduce")
        answering.note_end({**sub, "state": "closed"}, "5")
        answering.leave("5")
        assert asking.query("5", [0, 2], timeout=3)[2]["state"] == "closed"
        threads = [t for t in threading.enumerate() if t.name == "smddp-stall-responder"]
        assert len(threads) == 1  # one responder for both groups
    finally:
        answering.close()
