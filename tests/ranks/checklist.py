"""How the check scripts report: one line per check, one at the end, all ranks alike.

``CHECK <rank> <name>`` per passed check, ``FAILED <rank> <name> <why>`` per failed one, then
``PASSED <rank> <count>`` or ``FAILURES <rank> <count>``. The tests read these lines from
every rank's output.
"""

from __future__ import annotations


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
            print(f"CHECK {self.rank} {name}", flush=True)
        else:
            self.failed += 1
            print(f"FAILED {self.rank} {name} {why}", flush=True)

    def summary(self) -> int:
        """Print the closing line; return the exit status (1 if any check failed)."""
        if self.failed:
            print(f"FAILURES {self.rank} {self.failed}", flush=True)
            return 1
        print(f"PASSED {self.rank} {self.passed}", flush=True)
        return 0
