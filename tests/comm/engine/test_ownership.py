"""The engine owns every operation in flight: dropped handles never change a result.

Issue 13: an async all_reduce whose Work was dropped ended with different values on each
rank (AVERAGE's divide and the copy-back never ran; the ring stopped posting its stages).
"""

from __future__ import annotations

import time

import pytest

from launchers import mpirun, python, rank_lines, torchrun

SCRIPT = "tests/ranks/dropped_handles.py"


def assert_all_ranks_passed(result, size: int) -> None:
    assert result.returncode == 0, result.output
    assert not rank_lines(result.stdout, "FAIL"), result.output
    passed = rank_lines(result.stdout, "PASSED")
    assert sorted(passed) == list(range(size)), result.output
    assert all(int(count) >= 50 for count in passed.values()), passed


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_dropped_handles_mpi(np):
    assert_all_ranks_passed(mpirun(np, [SCRIPT], timeout=240), np)


def test_dropped_handles_gloo_torchrun():
    assert_all_ranks_passed(torchrun(2, [SCRIPT], timeout=240), 2)


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_exit_with_operations_in_flight(np):
    """The script ends with dropped operations in flight: every rank exits 0, no abort."""
    result = mpirun(np, [SCRIPT, "exit-in-flight"], timeout=120)
    assert result.returncode == 0, result.output
    assert sorted(rank_lines(result.stdout, "EXITING")) == list(range(np)), result.output
    for sign in ("terminate called", "Aborted", "NBC_Start_round", "Segmentation"):
        assert sign not in result.output, result.output


@pytest.mark.mpi
@pytest.mark.parametrize("level, refused", [("serialized", True), ("multiple", False)])
def test_mpi_thread_level_checked(level, refused):
    """The engine calls MPI from several threads: a lower level is refused, naming it."""
    code = (
        "import mpi4py\n"
        f"mpi4py.rc.thread_level = {level!r}\n"
        "from smddp.comm.backends import mpi\n"
        "try:\n"
        "    mpi._check_thread_level()\n"
        "except mpi.BackendUnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
        "else:\n"
        "    print('ACCEPTED')\n"
    )
    result = python(["-c", code], timeout=60)
    assert result.returncode == 0, result.output
    if refused:
        assert "REFUSED" in result.stdout and "MPI_THREAD_SERIALIZED" in result.stdout, result.output
    else:
        assert "ACCEPTED" in result.stdout, result.output


def test_collective_done_as_it_starts_needs_no_thread():
    """An asynchronous collective that completed as it started, with nothing in flight before
    it, is done at once: its handle, torch's Work and future, and a callback added later; no
    progress thread is started for it. One rank: its communicator completes everything at once."""
    code = (
        "import torch, torch.distributed as tdist\n"
        "import smddp.torch.torch_smddp\n"
        "tdist.init_process_group(backend='smddp')\n"
        "import smddp.torch.distributed as dist\n"
        "from smddp.torch import groups\n"
        "engine = groups.current().engine\n"
        "t = torch.arange(4.0)\n"
        "h = dist.all_reduce(t, op=dist.ReduceOp.AVERAGE, async_op=True)\n"
        "seen = []\n"
        "h.add_done_callback(lambda handle: seen.append(handle.seq))\n"
        "work = tdist.all_reduce(t, async_op=True)\n"
        "future = tdist.broadcast(t, 0, async_op=True).get_future()\n"
        "print('DONE', h.is_completed(), work.is_completed(), future.done(), seen == [h.seq])\n"
        "import threading\n"
        "print('THREAD', any(t.name == 'smddp-progress' for t in threading.enumerate()), len(engine.flight.handles))\n"
        "print('VALUES', t.tolist())\n"
        "tdist.destroy_process_group()\n"
    )
    result = python(["-c", code], timeout=120)
    assert result.returncode == 0, result.output
    assert "DONE True True True True" in result.stdout, result.output
    assert "THREAD False 0" in result.stdout, result.output
    assert "VALUES [0.0, 1.0, 2.0, 3.0]" in result.stdout, result.output


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["error", "interrupt"])
def test_a_failed_synchronous_collective_keeps_its_buffers(how):
    """Issue 33 item 10: the ring's receive into its scratch is still posted when rank 0 fails.

    The engine keeps the failed operation, so rank 1's part lands in live memory, intact; on
    main, an interrupted one was dropped (its scratch freed under MPI: the process aborted).
    """
    result = mpirun(2, ["tests/ranks/failed_ring.py", how], timeout=120,
                    env={"SMDDP_CPU_PLANE": "mpi", "SMDDP_TIMEOUT": "4"})
    assert rank_lines(result.stdout, "INTERRUPTED" if how == "interrupt" else "FAILED").keys() == {0}, result.output
    assert rank_lines(result.stdout, "KEPT") == {0: "65536"}, result.output
    assert rank_lines(result.stdout, "TIMEOUT").keys() == {1}, result.output  # the peer is told, in time
    for sign in ("DROPPED", "CORRUPT", "UNEXPECTED", "Process received signal", "Segmentation"):
        assert sign not in result.output, result.output


# ---------------------------------------------------------------------------- one set of threads for every group
def _later(n: int):
    """An operation that completes at its ``n``-th test (the progress thread's)."""
    from smddp.comm.base import Pending

    class Later(Pending):
        def test(self) -> bool:
            nonlocal n
            n -= 1
            return n <= 0

    return Later()


def _slow_engine():
    from datetime import timedelta

    from smddp.comm.base import Communicator, Context
    from smddp.comm.engine import Engine
    from smddp.job.topology import Topology

    class Slow(Communicator):
        name = "slow"

        def all_reduce(self, tensor, op, tag):
            return _later(20)

        broadcast = all_gather = barrier = lambda self, *args: _later(20)

        def all_to_all_single(self, output, input, output_counts, input_counts, tag):
            return _later(20)

    ctx = Context(Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none"), timedelta(seconds=10))
    return Engine({"cpu": Slow(ctx)}, timeout=10)


@pytest.mark.unit
def test_one_progress_thread_and_one_set_of_completion_threads_serve_every_engine():
    """A group adds no thread: 30 engines' asynchronous collectives, each with a future callback, are
    advanced by the process's one progress thread and completed by its shared completion threads."""
    import threading

    import torch

    from smddp.comm.engine import completer, progress
    from smddp.comm.reduction import Op

    before = {t.name for t in threading.enumerate()}
    engines = [_slow_engine() for _ in range(30)]
    try:
        seen = []
        chained = []
        for i, engine in enumerate(engines):
            handle = engine.all_reduce(torch.ones(2), Op.SUM, async_op=True)
            chained.append(handle.get_future().then(lambda fut, i=i: seen.append(i)))
        torch.futures.wait_all(chained)
        names = [t.name for t in threading.enumerate() if t.name not in before]
        assert names.count("smddp-progress") <= 1, names
        # every engine hands its completions to the process's one Completer (whose threads are made
        # as concurrent jobs need them and reused): none has threads of its own
        assert all(engine.flight.completer is completer.COMPLETER for engine in engines)
        assert {name for name in names if "completion" in name} <= {"smddp-completion"}, names
        assert sorted(seen) == list(range(30)), seen
    finally:
        for engine in engines:
            engine.close()
    assert all(not progress.SERVICE.serves(engine.flight) for engine in engines)  # each let go as it closed


@pytest.mark.unit
def test_an_engine_closed_while_the_progress_thread_is_inside_it_leaves_the_thread_serving_the_others():
    """close() lets an engine go while the process's progress thread is inside it: the thread must go
    on serving every other engine (it once removed the engine a second time, died of the ValueError,
    and every group's asynchronous collectives waited for ever)."""
    import threading

    from smddp.comm.engine.progress import Service

    inside, release = threading.Event(), threading.Event()

    class Fake:
        def __init__(self, block: bool):
            self.block, self.passes = block, 0

        def advance(self) -> bool:
            self.passes += 1
            if self.block and not release.is_set():
                inside.set()
                release.wait(10)
            return False

        def idle(self) -> bool:
            return True  # nothing in flight: the thread lets it go after a pass

    service = Service()
    closing, other = Fake(block=True), Fake(block=False)
    service.attach(closing)
    service.attach(other)
    service.wake(closing)
    assert inside.wait(10), "the progress thread never passed over the engine"
    forgetting = threading.Thread(target=service.forget, args=(closing,))
    forgetting.start()  # waits for the thread to leave the engine
    release.set()
    forgetting.join(10)
    assert not forgetting.is_alive()
    thread = service._thread
    service.wake(other)  # the same thread serves the next engine with work
    deadline = time.monotonic() + 10
    while other.passes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert other.passes > 0 and thread is not None and thread.is_alive() and service._thread is thread
    service.forget(other)  # the last engine closes: the thread ends
    assert not thread.is_alive() and service._thread is None
