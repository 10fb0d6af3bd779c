"""How the check scripts report: one line per check, one at the end, all ranks alike.

``CHECK <rank> <name>`` per passed check, ``FAILED <rank> <name> <why>`` per failed one, then
``PASSED <rank> <count>`` or ``FAILURES <rank> <count>``. The tests read these lines from
every rank's output.
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """Print ``line`` in one write: with PYTHONUNBUFFERED, print() writes the newline separately and
    the ranks' lines can interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Checklist:
    """The checks of one rank.

    Args:
        rank: this process's rank, printed on every line.
    """

    def __init__(self, rank: int):
        self.rank, self.passed, self.failed = rank, 0, 0

    def check(self, name: str, ok: bool, why: str = "") -> None:
        """Count and print one check: ``ok`` passes it; ``why`` says what was found otherwise."""
        if ok:
            self.passed += 1
            say(f"CHECK {self.rank} {name}")
        else:
            self.failed += 1
            say(f"FAILED {self.rank} {name} {why}")

    def summary(self) -> int:
        """Print the closing line; return the exit status (1 if any check failed)."""
        if self.failed:
            say(f"FAILURES {self.rank} {self.failed}")
            return 1
        say(f"PASSED {self.rank} {self.passed}")
        return 0
