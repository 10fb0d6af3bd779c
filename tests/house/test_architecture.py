"""The floors of smddp's house, kept: who may import whom, no circles, torch's privates in one place.

docs/architecture.md ("The house") draws the floors. Every import in smddp/ is read (module
level and inside functions alike, ``TYPE_CHECKING`` included) and held against the rules below;
a rule broken names the file, the line and the import. The compiled core's fragments
(``smddp/comm/planes/_shm_*.h``, one translation unit) may call only what they or the fragments
included before them define, so they call each other in no circle.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier

ROOT = Path(__file__).resolve().parents[2]
SMDDP = ROOT / "smddp"

#: The communicator contract's floor: the interface, the reduction arithmetic, the wait loop.
_CONTRACT = {"smddp.comm.base", "smddp.comm.reduction", "smddp.comm.waiting"}

#: The floors, top to bottom: a part may import itself and the parts named with it (rules are
#: prefixes of dotted module names; the longest prefix that matches a module is its part).
RULES: Dict[str, Set[str]] = {
    # root: imported by all, importing nothing of smddp but one another as written here
    "smddp.errors": set(),
    "smddp.knobs": {"smddp.errors"},
    "smddp._compat": set(),
    "smddp": {"smddp.errors"},  # smddp/__init__.py
    # the running job's facts
    "smddp.job": {"smddp.errors", "smddp.knobs", "smddp.job"},
    # launching: never the communication
    "smddp.launch": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp.launch"},
    "smddp.alias": {"smddp.errors", "smddp.launch"},
    # communication, floor by floor
    "smddp.comm.needs": set(),
    "smddp.comm.waiting": set(),
    "smddp.comm.reduction": {"smddp.errors"},
    "smddp.comm.base": {"smddp.errors", "smddp.job", "smddp.comm.reduction", "smddp.comm.waiting"},
    "smddp.comm.mismatch": {"smddp.errors", "smddp.comm.mismatch"} | _CONTRACT,
    "smddp.comm.store": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp.comm.needs"},
    "smddp.comm.backends": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp._compat",
                            "smddp.comm.needs", "smddp.comm.mismatch", "smddp.comm.backends"} | _CONTRACT,
    "smddp.comm.engine": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp._compat",
                          "smddp.comm.mismatch", "smddp.comm.engine"} | _CONTRACT,
    "smddp.comm.algorithms": {"smddp.errors", "smddp.comm.engine", "smddp.comm.algorithms"} | _CONTRACT,
    "smddp.comm.planes": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp.comm.needs",
                          "smddp.comm.mismatch", "smddp.comm.backends", "smddp.comm.planes"} | _CONTRACT,
    "smddp.comm": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp._compat", "smddp.comm"},  # the registry
    # what users import
    "smddp.torch": {"smddp.errors", "smddp.knobs", "smddp.job", "smddp._compat", "smddp.comm", "smddp.torch"},
    "smddp.sagemaker": {"smddp", "smddp.errors", "smddp.knobs", "smddp.job", "smddp.launch", "smddp.sagemaker"},
    # tools
    "smddp.bench": {"smddp", "smddp.errors", "smddp.knobs", "smddp.job", "smddp.comm", "smddp.torch",
                    "smddp.bench"},
    "smddp.info": {"smddp", "smddp.errors", "smddp.knobs", "smddp.job", "smddp.comm", "smddp.info"},
}

#: torch's private names that only smddp/_compat.py may use: attributes reached from a torch module
#: whose name starts with an underscore, and these members called on torch's objects.
PRIVATE_MEMBERS = {"_set_group_name", "_get_backend", "_register_backend", "_register_builtin_comm_hook",
                   "_Options", "_DistributedBackendOptions", "_RecordFunctionFast", "_create_work_from_future"}
TORCH_NAMES = {"torch", "tdist", "dist", "c10d"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(name: str) -> str:
    best = ""
    for rule in RULES:
        if (name == rule or name.startswith(rule + ".")) and len(rule) > len(best):
            best = rule
    return best


def imports(path: Path) -> List[Tuple[int, str]]:
    """``(line, module)`` for every smddp module ``path`` imports (``from smddp.x import y``: ``smddp.x.y``
    when that is a module, else ``smddp.x``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "smddp"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "smddp":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or (ROOT / sub.replace(".", "/")).is_dir()
                found.append((node.lineno, sub if is_module else node.module))
    return found


def sources() -> List[Path]:
    return sorted(SMDDP.rglob("*.py"))


def allowed(part: str, rules: Set[str]) -> bool:
    """A part named by a rule, or inside one (``smddp`` alone names the package's own ``__init__``)."""
    return any(part == rule or (rule != "smddp" and part.startswith(rule + ".")) for rule in rules)


def broken_rules(rules: Dict[str, Set[str]] = RULES) -> List[str]:
    """Every import that a rule forbids, in words."""
    broken = []
    for path in sources():
        me = module_name(path)
        mine = part_of(me)
        assert mine, f"{me} belongs to no floor: give it a rule in tests/house/test_architecture.py"
        for line, target in imports(path):
            theirs = part_of(target)
            if theirs != mine and not allowed(theirs, rules[mine]):
                broken.append(f"{path.relative_to(ROOT)}:{line}: {mine} may not import {target} ({theirs})")
    return broken


def test_every_import_keeps_the_floors():
    assert not broken_rules(), "\n".join(broken_rules())


def test_a_broken_rule_is_named(tmp_path):
    """The rules bite: taking one allowed import away makes the check name it."""
    weaker = {part: set(allowed) for part, allowed in RULES.items()}
    weaker["smddp.comm.engine"].discard("smddp.comm.mismatch")  # the engine's debug and stall use it
    found = broken_rules(weaker)
    assert any("smddp/comm/engine/" in b and "smddp.comm.mismatch" in b for b in found), found


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    edges: Dict[str, Set[str]] = defaultdict(set)
    for path in sources():
        me = module_name(path)
        for _, target in imports(path):
            if target != me and not me.startswith(target + "."):  # a package's own __init__ is not a circle
                edges[me].add(target)
    assert not circles(edges), circles(edges)


def test_torch_private_apis_only_through_compat():
    found = []
    for path in sources():
        if path.name == "_compat.py" and path.parent == SMDDP:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                root = base.id if isinstance(base, ast.Name) else ""
                chain.reverse()
                if root in TORCH_NAMES and any(p.startswith("_") and not p.startswith("__") for p in chain):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {root}.{'.'.join(chain)}")
                elif node.attr in PRIVATE_MEMBERS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                if any(p.startswith("_") for p in node.module.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ...")
    assert not found, "torch's private APIs outside smddp/_compat.py:\n" + "\n".join(sorted(set(found)))


_C_FRAGMENTS = ROOT / "smddp" / "comm" / "planes"
_DEF = re.compile(r"^(?:static\s+)?(?:inline\s+)?[\w \t\*]+?\b(\w+)\s*\([^;]*?\)\s*\{", re.M)


def test_the_compiled_core_calls_only_what_comes_before_it():
    main = (_C_FRAGMENTS / "_shm_native.c").read_text()
    order = re.findall(r'^#include "(_shm_\w+\.h)"', main, re.M)
    assert order, "the core includes no fragment"
    defined: Dict[str, str] = {}
    texts = {name: (_C_FRAGMENTS / name).read_text() for name in order}
    for name in order:
        for fn in _DEF.findall(texts[name]):
            defined.setdefault(fn, name)
    late = []
    for i, name in enumerate(order):
        allowed = set(order[:i + 1])
        body = re.sub(r"/\*.*?\*/", "", texts[name], flags=re.S)
        for fn in set(re.findall(r"\b(\w+)\s*\(", body)):
            home = defined.get(fn)
            if home is not None and home not in allowed:
                late.append(f"{name} calls {fn}, defined later in {home}")
    assert not late, "\n".join(late)


def test_the_top_level_holds_few_modules():
    modules = sorted(p.name for p in SMDDP.glob("*.py"))
    assert len(modules) <= 6, modules


@pytest.mark.parametrize("folder", sorted(p for p in SMDDP.rglob("*") if p.is_dir() and p.name != "__pycache__"))
def test_every_folder_says_what_it_holds(folder):
    init = folder / "__init__.py"
    assert init.exists(), f"{folder} is not a package"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring saying what the folder holds"
