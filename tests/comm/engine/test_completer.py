"""The engine's completion threads (smddp/comm/engine/completer.py), in process.

A job (a finished operation's callbacks) may wait for a later job, as torch's PowerSGD hook waits
in a callback for the future of an all-reduce it started: each job gets a thread of its own, so
completions nest as deep as callbacks do. Idle threads end; close() ends them all.
"""

from __future__ import annotations

import threading
import time

import pytest

from smddp.comm.engine import completer
from smddp.comm.engine.completer import Completer, completing

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier

WAIT = 30.0


def test_a_job_that_waits_for_a_later_job_gets_it_done_nested_three_deep():
    pool, seen = Completer("test-completion"), []

    def job(depth: int, done: threading.Event) -> None:
        seen.append((depth, completing(), threading.current_thread().name))
        if depth < 3:
            inner = threading.Event()
            pool.submit(lambda: job(depth + 1, inner))
            assert inner.wait(WAIT), "the nested job never ran"
        done.set()

    outer = threading.Event()
    pool.submit(lambda: job(1, outer))
    assert outer.wait(WAIT)
    assert [depth for depth, _, _ in seen] == [1, 2, 3]
    assert all(flag for _, flag, _ in seen) and len({name for _, _, name in seen}) == 1  # one name, three threads
    assert not completing()  # the calling thread is not a completion thread
    pool.close()


def test_idle_threads_are_reused_then_end(monkeypatch):
    monkeypatch.setattr(completer, "IDLE_SECONDS", 0.2)
    pool, threads = Completer("test-completion"), []
    for _ in range(3):
        ran = threading.Event()
        pool.submit(lambda ran=ran: (threads.append(threading.current_thread()), ran.set()))
        assert ran.wait(WAIT)
        time.sleep(0.01)  # the thread goes back to idle
    assert len(set(threads)) == 1  # one idle thread served every job
    threads[0].join(WAIT)
    assert not threads[0].is_alive()  # ended once idle for IDLE_SECONDS
    pool.close()


def test_a_job_that_raises_is_reported_and_the_thread_serves_on(capsys):
    pool, ran = Completer("test-completion"), threading.Event()
    pool.submit(lambda: 1 // 0)
    pool.submit(ran.set)
    assert ran.wait(WAIT)
    pool.close()
    time.sleep(0.05)
    assert "ZeroDivisionError" in capsys.readouterr().err
