"""Nothing hangs, nothing is silently wrong: faults injected into real jobs.

Each test starts a job (``tests/ranks/fault_job.py MODE``) under ``mpirun``, ``torchrun`` or
``smddprun`` with a hard time limit, and checks what every rank printed. Detection times are
printed (``pytest -s`` shows them) but never asserted: the launcher's time limit is what
proves "no hang", and the assertions check what ended each rank and what the errors say.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Dict, List

import pytest
import torch

from smddp.comm.backends.local import LocalCommunicator
from smddp.comm.base import Context
from smddp.comm.engine import Engine, debug, stall
from smddp.comm.engine.handle import DETACHABLE
from smddp.job.topology import Topology
from smddp.torch import _labels

from launchers import ROOT, base_env, mpirun, python, rank_lines, torchrun

SCRIPT = "tests/ranks/fault_job.py"
RESTART = "tests/ranks/restart_job.py"
TIMEOUT_S = 5  # the collective timeout the stall tests run with


def report(fault: str, seconds: float, extra: str = "") -> None:
    print(f"\ndetection: {fault}: {seconds:.2f} s {extra}".rstrip())


def lines(output: str, word: str) -> Dict[int, str]:
    return rank_lines(output, word)


# ---------------------------------------------------------------------------- torchrun restarts
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_torchrun_restart_runs_right_on_the_store_the_failed_attempt_left(how):
    """Issue 33 item 9: ``torchrun --max-restarts 1`` keeps one store for both attempts.

    Rank 1 raises (or is SIGKILLed) in attempt 0 after the plane, a subgroup and collectives
    have put their keys in the store. The restarted attempt must not read them: every rank is
    on the shared-memory plane again, its all-reduces are exact and DDP trains like the replica.
    """
    result = torchrun(2, [RESTART, how], timeout=240, env={"SMDDP_TIMEOUT": "60"},
                      torchrun_args=["--max-restarts", "1"])
    assert result.returncode == 0, result.output
    planes = {(int(r), int(rest.split()[0])): rest.split()[1]
              for r, rest in _all(result.stdout, "ATTEMPT")}
    assert planes == {(r, a): "shm" for r in (0, 1) for a in (0, 1)}, result.output
    assert sorted(_all(result.stdout, "EXACT")) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], result.output
    trained = dict(_all(result.stdout, "TRAINED"))
    assert trained.keys() == {"0", "1"} and len(set(trained.values())) == 1, result.output
    assert all(rest.startswith("1 ") for rest in trained.values()), result.output  # in the restarted attempt
    assert "UNREACHABLE" not in result.stdout, result.output


def _all(output: str, word: str) -> List[tuple]:
    """Every ``WORD <rank> <rest>`` line (a rank may print one per attempt), torchrun's tags removed."""
    found = []
    for line in output.splitlines():
        for piece in re.split(r"\[default\d+\]:", line):  # another rank's line may start inside this one
            parts = piece.split(None, 2)
            if len(parts) >= 2 and parts[0] == word:
                found.append((parts[1], parts[2] if len(parts) > 2 else ""))
    return found


# ---------------------------------------------------------------------------- a rank dies
@pytest.mark.mpi
def test_uncaught_exception_ends_the_job_with_its_traceback_first():
    # Rank 0 waits in an all-reduce with the default 30-minute timeout: only the abort can end
    # it within the launcher's 60 s.
    result = mpirun(2, [SCRIPT, "crash"], timeout=60)
    end = time.time()
    assert result.returncode != 0, result.output
    crashed = float(lines(result.stdout, "CRASH")[1])
    assert "UNREACHABLE" not in result.stdout
    assert lines(result.stdout, "END") == {}, result.output
    err = result.stderr
    assert "ZeroDivisionError: rank 1 fails on purpose" in err, err
    assert err.index("ZeroDivisionError") < err.index("MPI_ABORT"), "the traceback must come before the abort"
    assert "ending every rank of the job" in err
    assert "CollectiveTimeout" not in err, "rank 0 must be ended by the abort, not by a timeout"
    report("uncaught exception on rank 1 (mpirun -np 2)", end - crashed, "to the end of the job")


@pytest.mark.mpi
def test_rank_that_dies_ends_the_job():
    # As above: rank 0's 30-minute timeout cannot end it within the launcher's 60 s.
    result = mpirun(2, [SCRIPT, "die"], timeout=60)
    end = time.time()
    assert result.returncode != 0, result.output
    died = float(lines(result.stdout, "DIE")[1])
    assert "UNREACHABLE" not in result.stdout
    assert lines(result.stdout, "END") == {}, result.output
    assert "CollectiveTimeout" not in result.stderr
    report("rank 1 exits (os._exit) before a collective (mpirun -np 2)", end - died, "to the end of the job")


# ---------------------------------------------------------------------------- a rank stalls
def check_stall(result, ranks: List[int], backend: str) -> None:
    # Rank 1 sleeps 120 s, past the launcher's 90 s: the job ends only because the others time
    # out and end it.
    timeouts = lines(result.stdout, "TIMEOUT")
    assert sorted(timeouts) == ranks, result.output
    for rank in ranks:
        seconds, message = timeouts[rank].split(" ", 1)
        assert f"all_reduce (sequence number 3) did not complete within {TIMEOUT_S} s" in message, message
        assert "Ranks that never arrived: 1." in message, message
        assert "Rank 1 is outside collectives: its last one, sequence 2 (barrier)" in message, message
        assert "The job is now broken" in message
        report(f"rank 1 sleeps past a {TIMEOUT_S} s timeout ({backend}), seen by rank {rank}", float(seconds))
    fast = lines(result.stdout, "FASTFAIL")
    for rank in ranks:
        seconds, message = fast[rank].split(" ", 1)
        # Raised before anything is sent: the call cannot wait for the sleeping rank.
        assert "the job is broken after an earlier failure and cannot run more collectives" in message, message
        report(f"the next collective after the timeout, rank {rank} ({backend})", float(seconds), "(fails fast)")
    # A broken job ends at exit instead of waiting for the sleeping rank.
    assert result.returncode != 0
    assert "exiting with the job broken" in result.stderr
    assert 1 not in lines(result.stdout, "END"), "rank 1 must be ended, not waited for"


@pytest.mark.mpi
def test_timeout_names_the_rank_that_never_arrived_mpi():
    start = time.monotonic()
    result = mpirun(3, [SCRIPT, "sleep"], timeout=90, env={"SMDDP_TIMEOUT": str(TIMEOUT_S)})
    check_stall(result, [0, 2], "mpi, 3 ranks")
    print(f"job took {time.monotonic() - start:.1f} s; rank 1 would have slept 120 s")


@pytest.mark.mpi
@pytest.mark.skipif(not DETACHABLE, reason="this torch has no PythonCallbackWork")
def test_timeout_raised_by_a_wait_from_cpp():
    """The Work torch's API returned, dropped by Python, waited on by C++ (DDP's join() does that)."""
    result = mpirun(2, [SCRIPT, "sleep-cpp"], timeout=90, env={"SMDDP_TIMEOUT": str(TIMEOUT_S)})
    check_stall(result, [0], "mpi, waited on from C++")


def test_timeout_names_the_rank_that_never_arrived_gloo():
    start = time.monotonic()
    result = torchrun(2, [SCRIPT, "sleep"], timeout=90, env={"SMDDP_TIMEOUT": str(TIMEOUT_S)})
    check_stall(result, [0], "gloo under torchrun")
    print(f"job took {time.monotonic() - start:.1f} s; rank 1 would have slept 120 s")


INIT = {
    "smddp": "import smddp.torch.distributed as dist; dist.init_process_group()",
    "torch": ("import torch.distributed as td, smddp.torch.torch_smddp; "
              "td.init_process_group('smddp', store=td.HashStore(), rank=0, world_size=1)"),
}


@pytest.mark.parametrize("entry", sorted(INIT))
def test_bad_smddp_timeout_is_one_error_whichever_init(entry):
    result = python(["-c", INIT[entry]], env={"SMDDP_TIMEOUT": "soon"})
    assert result.returncode != 0, result.output
    assert ("smddp.errors.InvalidArgumentError: SMDDP_TIMEOUT=soon (environment) is not a number: SMDDP_TIMEOUT "
            "takes a number of seconds above 0") in result.stderr, result.output


# ---------------------------------------------------------------------------- SMDDP_DEBUG
MISMATCHES = {
    "shape": "(they differ in shape)",
    "op": "(they differ in reduction op)",
    "dtype": "(they differ in dtype)",
    "operation": "rank 1: broadcast(src=0",
    "src": "(they differ in source rank)",
    "splits": "rank 2 sends 2 elements to rank 1, which expects 3 from it",
}


@pytest.mark.mpi
def test_debug_mismatches_raise_on_every_rank():
    result = mpirun(3, [SCRIPT, "mismatch"], timeout=60, env={"SMDDP_DEBUG": "1"}).check()
    found: Dict[str, Dict[int, str]] = {}
    for line in result.stdout.splitlines():
        parts = line.split(" ", 4)
        if parts[0] == "MISMATCH":
            found.setdefault(parts[2], {})[int(parts[1])] = parts[4]
            report(f"SMDDP_DEBUG mismatch ({parts[2]}), rank {parts[1]}", float(parts[3]))
    assert "MISSED" not in result.stdout, result.output
    for name, expected in MISMATCHES.items():
        messages = found.get(name, {})
        assert sorted(messages) == [0, 1, 2], (name, result.output)
        assert len(set(messages.values())) == 1, f"ranks disagree about the {name} mismatch: {messages}"
        message = messages[0]
        assert expected in message, (name, message)
        if name != "splits":
            assert "Ranks that differ from rank 0: 1." in message and "rank 0, 2:" in message, message
    # The job stays usable after a mismatch: nothing was run.
    after = lines(result.stdout, "AFTER")
    assert after == {r: "[3.0, 3.0, 3.0, 3.0]" for r in range(3)}, after


@pytest.mark.unit
def test_debug_is_off_by_default_and_costs_no_exchange():
    assert not debug.enabled({})
    assert not debug.enabled({"SMDDP_DEBUG": "0"}) and not debug.enabled({"SMDDP_DEBUG": "off"})
    assert debug.enabled({"SMDDP_DEBUG": "1"}) and debug.enabled({"SMDDP_DEBUG": "detail"})
    comm = LocalCommunicator(Context(Topology(), timedelta(seconds=5)))
    assert Engine({"cpu": comm}, 5.0)._debug is None


@pytest.mark.unit
def test_fingerprint_explains_itself():
    row = debug.fingerprint(7, "all_reduce", None, torch.ones(2, 3, dtype=torch.bfloat16), label=2)
    assert debug.explain(row, ("first", "second")) == "all_reduce(dtype=bfloat16, shape=(2, 3)) as sequence 7 (second)"
    assert debug.explain(row) == "all_reduce(dtype=bfloat16, shape=(2, 3)) as sequence 7 (a labelled call)"
    wide = debug.fingerprint(1, "broadcast", None, torch.ones([1] * 9), src=2)
    assert "src=2" in debug.explain(wide) and "..." in debug.explain(wide)
    assert len(wide) == debug.WIDTH


# ---------------------------------------------------------------------------- uneven batches in DDP
HINT_WORDS = ("different numbers of batches", "drop_last=True", "Join([model])")


@pytest.mark.mpi
def test_uneven_batches_named_under_debug():
    result = mpirun(2, [SCRIPT, "uneven"], timeout=90, env={"SMDDP_DEBUG": "1", "SMDDP_TIMEOUT": "30"}).check()
    uneven = lines(result.stdout, "UNEVEN")
    assert sorted(uneven) == [0, 1], result.output
    for rank, text in uneven.items():
        kind, seconds, message = text.split(" ", 2)
        assert kind == "CollectiveMismatchError", text
        assert "(during backward: DDP gradients)" in message and "rank 1: barrier()" in message
        assert all(word in message for word in HINT_WORDS), message
        report(f"uneven batches in DDP under SMDDP_DEBUG=1, rank {rank}", float(seconds))


@pytest.mark.mpi
def test_uneven_batches_named_as_the_rank_ends_not_at_the_timeout():
    # Under mpirun the rank that ran out of batches waits in MPI_Finalize, alive: its note at the end of
    # its script is what the waiting rank sees, within a second or so, long before a 60 s timeout.
    result = mpirun(2, [SCRIPT, "uneven"], timeout=90, env={"SMDDP_TIMEOUT": "60"})
    assert lines(result.stdout, "DONE") == {1: "3"}, result.output
    kind, seconds, message = lines(result.stdout, "UNEVEN")[0].split(" ", 2)
    # smddp's DDP hook raises inside torch's reducer, which re-raises it as a RuntimeError with the message
    assert "all_reduce (during backward: DDP gradients) (sequence number" in message, message
    assert "cannot complete on rank 0 of 2: a rank of the group ended before it and will never join it " \
           "(seen now, not at the 60 s timeout)" in message, message
    assert "Ranks that never arrived: 1. Rank 1 has reached the end of its script" in message, message
    assert all(word in message for word in HINT_WORDS), message
    report("uneven batches in DDP (mpi, 60 s timeout), rank 0", float(seconds))


@pytest.mark.mpi
def test_uneven_batches_without_the_hook_raise_from_backward_as_the_rank_ends():
    # Without smddp's hook (SMDDP_DDP_HOOK=0: torch's own path, as torch's DDP over the smddp backend)
    # only C++ waits for the gradient all-reduce: the progress thread sees the rank that ended, and the
    # reducer raises the error from backward() (it read a failed future's value and crashed before).
    result = mpirun(2, [SCRIPT, "uneven"], timeout=90, env={"SMDDP_TIMEOUT": "60", "SMDDP_DDP_HOOK": "0"})
    assert lines(result.stdout, "DONE") == {1: "3"}, result.output
    assert "Segmentation fault" not in result.output, result.output
    kind, seconds, message = lines(result.stdout, "UNEVEN")[0].split(" ", 2)
    assert "all_reduce (during backward: DDP gradients) (sequence number" in message, message
    assert "cannot complete on rank 0 of 2: a rank of the group ended before it and will never join it " \
           "(seen now, not at the 60 s timeout)" in message, message
    assert "Ranks that never arrived: 1. Rank 1 has reached the end of its script" in message, message
    report("uneven batches in DDP without smddp's hook (mpi, 60 s timeout), rank 0", float(seconds))


def test_uneven_batches_named_on_gloo():
    result = torchrun(2, [SCRIPT, "uneven"], timeout=90, env={"SMDDP_TIMEOUT": str(TIMEOUT_S)})
    assert lines(result.stdout, "DONE") == {1: "3"}, result.output
    kind, seconds, message = lines(result.stdout, "UNEVEN")[0].split(" ", 2)
    # Here gloo notices the peer's exit first (its connection closes), before any timeout.
    assert "Ranks that never arrived: 1. Rank 1 has reached the end of its script" in message, message
    assert all(word in message for word in HINT_WORDS), message
    report("uneven batches in DDP (gloo under torchrun), rank 0", float(seconds))


# ---------------------------------------------------------------------------- Ctrl-C
def _session_processes(sid: int) -> List[str]:
    """Live (not zombie) processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                with open(f"/proc/{entry}/cmdline") as f:
                    found.append(f"{entry} {f.read().replace(chr(0), ' ')[:120]}")
        except OSError:
            continue
    return found


@pytest.mark.parametrize("launcher", ["mpirun", "local"])
def test_ctrl_c_on_smddprun_leaves_no_process(launcher):
    if launcher == "mpirun":
        pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "smddp.launch", "--launcher", launcher, "-np", "2", SCRIPT, "hold"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base_env(),
                            cwd=str(ROOT), start_new_session=True)
    try:
        pids, deadline, seen = [], time.monotonic() + 60, []
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if " PID " in f" {line}":
                pids.append(int(line.split()[-1]))
        assert len(pids) == 2, "".join(seen)
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the launcher
        proc.communicate(timeout=30)
        left = _session_processes(proc.pid)
        while left and time.monotonic() - start < 15:
            time.sleep(0.1)
            left = _session_processes(proc.pid)
        assert not left, f"processes left after Ctrl-C: {left}"
        assert proc.returncode != 0
        report(f"Ctrl-C on smddprun ({launcher}): every process gone", time.monotonic() - start)
    finally:
        if proc.poll() is None or _session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate()


# ---------------------------------------------------------------------------- the report's words
@pytest.mark.unit
def test_stall_report_words():
    statuses = {
        1: {"seq": 4, "op": "all_reduce", "done": True, "age": 9.5, "state": "running"},
        2: {"seq": 5, "op": "all_reduce", "done": False, "age": 1.0, "state": "running"},
        3: {"seq": 5, "op": "broadcast", "done": False, "age": 1.0, "state": "running"},
        4: None,
        5: {"seq": 4, "op": "barrier", "done": True, "age": 0.0, "state": "exiting"},
        6: {"seq": 4, "op": "all_reduce", "done": True, "age": 9.5, "state": "running"},
    }
    text = stall.describe(statuses, 5, "all_reduce")
    assert text.startswith("Ranks that never arrived: 1, 5-6.")
    assert "Rank 1, 6 is outside collectives: its last one, sequence 4 (all_reduce), started 9.5 s ago" in text
    assert "Rank 5 has reached the end of its script, after sequence 4 (barrier)" in text
    assert "Rank 3 called broadcast as sequence 5 where this rank called all_reduce" in text
    assert "did not answer within 3 s: 4" in text
    assert "drop_last" not in text
    labelled = "all_reduce (during backward: DDP gradients)"
    assert "drop_last" in stall.describe({1: statuses[5]}, 5, labelled, advice=_labels.ADVICE)
    assert "drop_last" not in stall.describe({1: statuses[5]}, 5, labelled)  # a label without advice
    # A peer in a labelled collective where this rank is in another brings that label's advice.
    peer = {"seq": 5, "op": "all_reduce (mine)", "done": False, "age": 1.0, "state": "running"}
    assert stall.describe({1: peer}, 5, "barrier", advice={"mine": "Do this."}).endswith("Do this.")
    assert stall.describe({1: statuses[2]}, 5, "all_reduce").startswith("Every rank arrived")
    assert stall.describe({1: statuses[2]}, 5, "all_reduce", stalled=False) == ""
    assert stall.ranks_text([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    # A message involves two ranks: the others are only located, never called "missing".
    p2p = stall.describe({1: statuses[1], 3: statuses[3]}, 5, "send to rank 1 (tag 0)")
    assert "never arrived" not in p2p and "different collectives" not in p2p
    assert p2p.startswith("Rank 1 is outside collectives") and "Rank 3 is waiting in sequence 5 (broadcast)" in p2p


# ---------------------------------------------------------------------------- the one wait loop
@pytest.mark.unit
def test_poll_returns_false_once_the_deadline_has_passed():
    from smddp.comm.waiting import poll

    calls = []

    def done_much_later() -> bool:  # a poll that ignored its deadline would return True
        calls.append(1)
        return len(calls) > 1_000_000

    # A deadline already past: poll gives up after its busy polls, never waiting.
    assert poll(done_much_later, time.monotonic() - 1) is False
    assert 1 < len(calls) < 100_000
    blocks: List[float] = []
    calls.clear()
    assert poll(done_much_later, time.monotonic() - 1, block=blocks.append) is False and blocks == []
    # Done on the third test: True, with the waits in between going through block or pause.
    state = iter([False, False, True])
    assert poll(lambda: next(state), float("inf"), block=blocks.append) is True
    assert len(blocks) == 2 and all(0 < s <= 0.5 for s in blocks)
    pauses = []
    state = iter([False, True])
    assert poll(lambda: next(state), float("inf"), pause=lambda: pauses.append(1)) is True and pauses == [1]
