"""The import alias behind ``smddp.alias`` and ``smddprun``: ``smdistributed.dataparallel.torch`` is ``smddp.torch``.

A meta-path finder maps ``smdistributed.dataparallel.torch`` and every module under it to the
module of the same name under ``smddp.torch``, and provides empty ``smdistributed`` and
``smdistributed.dataparallel`` packages above it. The aliases are the same module objects
as smddp's, not copies: module state (whether the process group is initialized) and classes
(``DistributedDataParallel``) are shared.

A real smdistributed install always wins: when ``smdistributed.dataparallel`` can be
imported from ``sys.path``, :func:`enable` leaves the import system alone and says so.
Importing this module changes nothing; :func:`enable` does.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import List, Optional, Sequence

#: The alias root and the smddp package it stands for.
ALIAS_ROOT = "smdistributed.dataparallel.torch"
TARGET_ROOT = "smddp.torch"

# Packages above ALIAS_ROOT that exist only as empty containers for it.
_CONTAINERS = ("smdistributed", "smdistributed.dataparallel")


def _target_of(fullname: str) -> Optional[str]:
    """The smddp module that alias ``fullname`` stands for, or None if it is not one."""
    if fullname == ALIAS_ROOT:
        return TARGET_ROOT
    if fullname.startswith(ALIAS_ROOT + "."):
        return TARGET_ROOT + fullname[len(ALIAS_ROOT):]
    return None


def _spec_exists(name: str, path: Optional[Sequence[str]] = None) -> bool:
    """True when a module ``name`` can be found on ``sys.path`` (or ``path``) without importing it."""
    return importlib.machinery.PathFinder.find_spec(name, path) is not None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the already-imported smddp module, or an empty container package."""

    def __init__(self, target: Optional[str]) -> None:
        self.target = target

    def __repr__(self) -> str:
        return f"smddp alias of {self.target}" if self.target else "smddp alias"

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        if self.target is None:
            return None
        module = importlib.import_module(self.target)
        # The import system overwrites __spec__ on whatever we return; keep the real one.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias_spec = module.__spec__
        if self.target is None:
            module.__doc__ = f"smddp's stand-in for {alias_spec.name} (see smddp.alias)."
        else:
            module.__spec__ = alias_spec.loader_state
        _FINDER.loaded.append(alias_spec.name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``smdistributed.dataparallel.torch[.*]`` and its parents, unless they are real.

    It sits first on ``sys.meta_path``: placed after the path finder, ``smdistributed...torch.X``
    would be found as a second copy of ``smddp/torch/X.py`` through the parent's ``__path__``.
    It steps aside for any ``smdistributed`` package or ``smdistributed.dataparallel`` module
    that the path finder can see.
    """

    def __init__(self) -> None:
        self.loaded: List[str] = []

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib protocol
        if fullname in _CONTAINERS:
            if _spec_exists(fullname, path):
                return None
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(None), is_package=True)
        smddp_name = _target_of(fullname)
        if smddp_name is None or not _is_ours(sys.modules.get("smdistributed.dataparallel")):
            return None
        try:
            smddp_spec = importlib.util.find_spec(smddp_name)
        except ImportError:
            return None
        if smddp_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(smddp_name),
            is_package=smddp_spec.submodule_search_locations is not None,
        )


_FINDER = _AliasFinder()


def _is_ours(module: Optional[ModuleType]) -> bool:
    return module is not None and isinstance(getattr(module, "__loader__", None), _AliasLoader)


def real_smdistributed() -> Optional[str]:
    """Where a real ``smdistributed.dataparallel`` is installed, or None.

    Looks on ``sys.path`` without importing anything, and at modules already imported.
    """
    imported = sys.modules.get("smdistributed.dataparallel")
    if imported is not None and not _is_ours(imported):
        return getattr(imported, "__file__", None) or repr(imported)
    top = sys.modules.get("smdistributed")
    if top is not None and not _is_ours(top):
        search: Optional[List[str]] = list(getattr(top, "__path__", []))
        where = getattr(top, "__file__", None) or repr(top)
    else:
        spec = importlib.machinery.PathFinder.find_spec("smdistributed")
        if spec is None:
            return None
        if spec.submodule_search_locations is None:
            return spec.origin  # a plain module named smdistributed: it hides any package
        search = list(spec.submodule_search_locations)
        where = spec.origin or search[0]
    sub = importlib.machinery.PathFinder.find_spec("smdistributed.dataparallel", search)
    if sub is None:
        return None
    return sub.origin or (list(sub.submodule_search_locations or []) or [where])[0]


def is_enabled() -> bool:
    """True when the alias finder is installed in this process."""
    return _FINDER in sys.meta_path


def enable(note: bool = True) -> bool:
    """Install the alias, unless a real smdistributed is installed.

    Args:
        note: print one line on stderr when a real install is found and left alone.

    Returns:
        True when the alias is active, False when a real ``smdistributed.dataparallel``
        takes precedence.
    """
    if is_enabled():
        return True
    real = real_smdistributed()
    if real is not None:
        if note:
            print(
                f"smddp: a real smdistributed.dataparallel is installed ({real}); using it, "
                "smddp's import alias is off",
                file=sys.stderr, flush=True,
            )
        return False
    sys.meta_path.insert(0, _FINDER)
    return True


def disable() -> None:
    """Remove the alias and forget the ``smdistributed`` modules it provided.

    smddp's own modules stay imported under their ``smddp`` names.
    """
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in _FINDER.loaded:
        sys.modules.pop(name, None)
    _FINDER.loaded.clear()
