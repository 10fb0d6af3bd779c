"""The unit tier starts no job: no test marked ``unit`` starts a process, directly or through its module's helpers.

``pytest -m unit`` is the fast tier (in-process, seconds): a test marked ``unit`` (by its decorator or
its module's ``pytestmark``) that calls a launcher (``tests/helpers/launchers.py``'s ``run``,
``mpirun``, ``torchrun``, ``python``), ``subprocess``, or ``multiprocessing``'s spawn, itself or
through a function of its own module, belongs to the launched tiers instead. Read from the source
(``ast``): it holds on machines where the test itself would be skipped (a GPU test on a CPU host).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: Names that start a process, as a test module calls them: the launchers' helpers, and the
#: standard library's and torch's ways (``subprocess.run``, ``mp.spawn``) by their last part.
LAUNCHER_HELPERS = {"run", "mpirun", "torchrun", "python"}
PROCESS_CALLS = {"Popen", "check_call", "check_output", "spawn", "start_processes"}
PROCESS_MODULES = {"subprocess", "multiprocessing", "mp", "torch.multiprocessing"}


def _is_unit(decorators: List[ast.expr]) -> bool:
    return any("unit" in {n.attr for n in ast.walk(d) if isinstance(n, ast.Attribute)} for d in decorators)


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def launching_unit_tests(source: str) -> List[str]:
    """``name (line): what it calls`` for each unit test of ``source`` that starts a process."""
    tree = ast.parse(source)
    module_unit = any(
        isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _is_unit([node.value]) for node in tree.body)
    launchers = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                 and node.module == "launchers" for alias in node.names if alias.name in LAUNCHER_HELPERS}
    functions: Dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions[f"{node.name}.{item.name}"] = item

    def direct(function: ast.AST) -> Set[str]:
        found = set()
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            head, _, last = name.rpartition(".")
            if name in launchers or (head in PROCESS_MODULES and (last in PROCESS_CALLS or head == "subprocess")):
                found.add(name)
            elif name in functions:
                found.add(f"->{name}")
        return found

    calls = {name: direct(f) for name, f in functions.items()}

    def starts(name: str, seen: Set[str]) -> Set[str]:
        out = set()
        for call in calls.get(name, ()):
            if call.startswith("->"):
                if call[2:] not in seen:
                    out |= starts(call[2:], seen | {call[2:]})
            else:
                out.add(call)
        return out

    found = []
    for name, function in functions.items():
        if not name.split(".")[-1].startswith("test_") or not (module_unit or _is_unit(function.decorator_list)):
            continue
        started = starts(name, {name})
        if started:
            found.append(f"{name} ({function.lineno}): {', '.join(sorted(started))}")
    return found


def test_no_unit_test_starts_a_process():
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        hits = launching_unit_tests(path.read_text())
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"unit tests that start a process (drop their unit mark, or keep them in-process): {found}"


def test_the_rule_bites():
    source = '''
import pytest
import subprocess
from launchers import mpirun, run as launch

pytestmark = [pytest.mark.unit]

def helper():
    return launch(["x"])

def test_through_a_helper():
    helper()

def test_subprocess():
    subprocess.run(["true"])

def test_in_process():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_mpirun():
    mpirun(2, ["x"])
'''
    assert launching_unit_tests(source) == [
        "test_through_a_helper (11): launch", "test_subprocess (14): subprocess.run", "test_mpirun (21): mpirun"]
    marked = '''
import pytest
from launchers import torchrun

@pytest.mark.unit
def test_marked():
    torchrun(2, ["x"])

def test_launched():
    torchrun(2, ["x"])
'''
    assert launching_unit_tests(marked) == ["test_marked (6): torchrun"]
