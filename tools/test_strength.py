"""The checks each test makes, compared between two revisions: a change kept every assertion or not.

For each function under ``tests/`` at each revision (read with ``git show``, nothing checked out)
it counts the checks in its body: ``assert`` statements and calls of ``raises``, ``check`` and
``fail`` (``pytest.raises``, a launched job's ``Result.check()``). Functions are matched by name,
so files that moved or were renamed still compare. It prints the totals and every test or helper
whose count fell, and the tests that are gone; it exits 1 when either list is not empty.

Usage::

    python tools/test_strength.py e29bb7c HEAD      # what a reorganization of the tests kept

A count is a floor, not a proof: a weakened condition inside an ``assert`` keeps the count. Read
the diff of the functions it names, and rerun the suite.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import Counter
from typing import Set, Tuple

CHECK_CALLS = {"raises", "check", "fail"}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def _checks_in(node: ast.AST) -> int:
    count = 0
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            count += 1
        elif isinstance(child, ast.Call):
            func = child.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            count += name in CHECK_CALLS
    return count


def checks_at(rev: str) -> Tuple[Counter, Set[str]]:
    """``({function name: checks}, {test function names})`` of ``tests/`` at revision ``rev``."""
    checks: Counter = Counter()
    tests: Set[str] = set()
    for path in _git("ls-tree", "-r", "--name-only", rev, "tests").split():
        if not path.endswith(".py"):
            continue
        tree = ast.parse(_git("show", f"{rev}:{path}"), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                checks[node.name] += _checks_in(node)
                if node.name.startswith("test"):
                    tests.add(node.name)
    return checks, tests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the revision before the change (a commit, branch or tag)")
    parser.add_argument("after", nargs="?", default="HEAD", help="the revision after it (default HEAD)")
    args = parser.parse_args(argv)
    before, tests_before = checks_at(args.before)
    after, tests_after = checks_at(args.after)
    print(f"test functions: {len(tests_before)} -> {len(tests_after)}; "
          f"checks: {sum(before.values())} -> {sum(after.values())}")
    fewer = sorted(name for name in before if after[name] < before[name])
    for name in fewer:
        print(f"fewer checks: {name} {before[name]} -> {after[name]}")
    gone = sorted(tests_before - tests_after)
    for name in gone:
        print(f"test gone: {name}")
    return 1 if fewer or gone else 0


if __name__ == "__main__":
    sys.exit(main())
