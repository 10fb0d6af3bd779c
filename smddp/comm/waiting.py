"""The wait loop: smddp's one way to wait for an operation, polling then sleeping, with a deadline.

Every wait on every plane goes through :func:`poll` (a handle's wait, the progress thread, the
stall reports' exchanges, NCCL's events): it tests busily for the first few milliseconds, where
small collectives finish, then gives the core back between tests, and stops at the deadline.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

# Busy-poll for this long (and at most this many tests) before the thread starts to sleep: small
# collectives finish within it. Past it the thread sleeps between tests, from _FIRST_NAP seconds
# doubling up to _LAST_NAP: a rank that waits for a peer gives its core back (on a host with more
# ranks than cores, a rank that spun kept the one it waited for off the CPU: the hierarchical
# plane's four ranks on two cores took 14-28 s for an all-reduce of milliseconds).
_HOT_SECONDS = 0.002
_HOT_POLLS = 4000
_FIRST_NAP = 2e-5
_LAST_NAP = 5e-4
# A Pending with ``block(seconds)`` (a library that completes on its own threads, like gloo)
# is slept on in slices of this many seconds instead of polled: polling takes the CPU from
# the very threads doing the work.
_BLOCK_SLICE = 0.5
# A wait that has gone on this long calls its ``watch`` (and again each time this long passes).
_WATCH_EVERY = 1.0


def poll(
    test: Callable[[], bool],
    deadline: float,
    block: Optional[Callable[[float], object]] = None,
    pause: Optional[Callable[[], object]] = None,
    watch: Optional[Callable[[], object]] = None,
) -> bool:
    """Call ``test()`` until it returns True or ``deadline`` passes.

    Between two calls the thread waits as suits the operation: ``block(seconds)`` for a
    library that completes it on threads of its own; else ``pause()`` if given; else it
    polls busily for up to 2 ms (small collectives finish within it), then sleeps between
    tests, 20 us at first, doubling up to half a millisecond.

    Args:
        test: returns True once the operation has completed.
        deadline: a ``time.monotonic()`` time; ``math.inf`` for none.
        block: sleeps at most the given seconds or until the operation completes (a
            Pending's ``block``).
        pause: called between two tests instead of the default back-off.
        watch: called once the wait has gone on a second, and every second after: a look at
            what the test cannot see (a peer that has ended); it raises to end the wait.

    Returns:
        True once ``test()`` did; False when the deadline passed first.
    """
    hot = block is None and pause is None
    polls, nap, hot_until, next_watch = 0, _FIRST_NAP, 0.0, None
    while not test():
        polls += 1
        now = time.monotonic()
        if hot and polls <= _HOT_POLLS:
            if polls == 1:
                hot_until = now + _HOT_SECONDS
            if now < hot_until:
                continue
        if now > deadline:
            return False
        if watch is not None:
            if next_watch is None:
                next_watch = now + _WATCH_EVERY
            elif now >= next_watch:
                watch()
                next_watch = now + _WATCH_EVERY
        if block is not None:
            block(min(_BLOCK_SLICE, deadline - now))
        elif pause is not None:
            pause()
        else:
            time.sleep(nap)
            nap = min(2 * nap, _LAST_NAP)
    return True
