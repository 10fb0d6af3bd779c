"""What a SageMaker job receives as its code: the user's files, smddp as a wheel, a requirements line.

The training container needs nothing preinstalled: the code channel carries a wheel of the
smddp installed here (built from the installed files, so editable installs work too), a
``requirements.txt`` that installs it before the script starts, and a small entry script
that runs the user's script through smddp (the ``smdistributed`` import alias, and the whole
job ending when one process fails).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import zipfile
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import smddp
from smddp.errors import InvalidArgumentError

#: The entry script written into the job's code; it runs the user's entry point.
ENTRY_SCRIPT = "_smddp_entry.py"

_ENTRY_TEMPLATE = '''\
"""Written by smddp.sagemaker: runs {script!r} through smddp in every process of the job.

``python -m smddp.alias`` turns on the smdistributed import alias, sets
SMDATAPARALLEL_LOCAL_RANK and ends the whole job when this process fails.
"""
import runpy
import sys

sys.argv = ["smddp.alias", {script!r}, *sys.argv[1:]]
runpy.run_module("smddp.alias", run_name="__main__", alter_sys=True)
'''

_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", ".ipynb_checkpoints")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _package_files() -> Iterable[Tuple[str, Path]]:
    """``(name in wheel, file)`` for every file of the installed ``smddp`` package."""
    root = Path(smddp.__file__).resolve().parent
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
            yield f"smddp/{relative.as_posix()}", path


def _entry_points() -> str:
    """The installed distribution's ``entry_points.txt`` (``smddprun``, ...), if it has one."""
    try:
        from importlib import metadata

        text = metadata.distribution("smddp").read_text("entry_points.txt")
    except Exception:  # noqa: BLE001 - smddp may be on sys.path without being installed
        return ""
    return text or ""


def build_wheel(dest: str) -> Path:
    """Write a pure-Python wheel of the installed smddp into ``dest``.

    The wheel declares no dependencies: the training image brings PyTorch, and pip must not
    replace the image's CUDA build of it.

    Args:
        dest: an existing directory.

    Returns:
        The wheel's path, ``dest/smddp-<version>-py3-none-any.whl``.
    """
    version = smddp.__version__
    dist_info = f"smddp-{version}.dist-info"
    wheel = Path(dest) / f"smddp-{version}-py3-none-any.whl"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: smddp\n"
        f"Version: {version}\n"
        "Summary: smddp shipped into a SageMaker training job by smddp.sagemaker\n"
    )
    wheel_file = "Wheel-Version: 1.0\nGenerator: smddp.sagemaker\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    records: List[str] = []
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:

        def add(name: str, data: bytes) -> None:
            archive.writestr(name, data)
            records.append(f"{name},{_record_hash(data)},{len(data)}")

        for name, path in _package_files():
            add(name, path.read_bytes())
        add(f"{dist_info}/METADATA", metadata.encode())
        add(f"{dist_info}/WHEEL", wheel_file.encode())
        entry_points = _entry_points()
        if entry_points:
            add(f"{dist_info}/entry_points.txt", entry_points.encode())
        records.append(f"{dist_info}/RECORD,,")
        archive.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return wheel


def resolve_entry_point(entry_point: str, source_dir: Optional[str]) -> Path:
    """The entry point's file: relative to ``source_dir`` when one is given, as in SDK v2.

    Raises:
        InvalidArgumentError: ``source_dir`` is not a local directory, or the file is missing.
    """
    if not entry_point:
        raise InvalidArgumentError("entry_point is required: the Python script the job runs")
    if source_dir is not None:
        if "://" in source_dir:
            raise InvalidArgumentError(
                f"source_dir={source_dir!r}: smddp ships code from a local directory; download it first"
            )
        if not os.path.isdir(source_dir):
            raise InvalidArgumentError(f"source_dir={source_dir!r} is not a directory")
        path = Path(source_dir) / entry_point
        if not path.resolve().is_relative_to(Path(source_dir).resolve()):
            raise InvalidArgumentError(f"entry_point={entry_point!r} must be inside source_dir={source_dir!r}")
    else:
        path = Path(entry_point)
    if not path.is_file():
        where = f" in source_dir={source_dir!r}" if source_dir is not None else ""
        raise InvalidArgumentError(f"entry_point={entry_point!r} not found{where}")
    if path.suffix != ".py":
        raise InvalidArgumentError(f"entry_point={entry_point!r} must be a Python script (.py)")
    return path.resolve()


def check_dependencies(dependencies: Optional[Sequence[str]]) -> List[Path]:
    """The ``dependencies`` paths, each checked to exist.

    Raises:
        InvalidArgumentError: a dependency does not exist.
    """
    paths = []
    for dependency in dependencies or ():
        path = Path(dependency)
        if not path.exists():
            raise InvalidArgumentError(f"dependency {dependency!r} does not exist")
        paths.append(path.resolve())
    return paths


def stage_code(
    dest: str,
    entry_point: Path,
    source_dir: Optional[str],
    dependencies: Sequence[Path] = (),
) -> str:
    """Lay out the job's code channel in ``dest`` and return the entry script to run.

    ``dest`` receives ``source_dir`` (or just the entry point when there is none), each
    dependency under its own name (as SDK v2 does), the smddp wheel, ``requirements.txt``
    (the user's lines after the wheel's) and :data:`ENTRY_SCRIPT`.

    Args:
        dest: an empty directory.
        entry_point: the resolved entry point.
        source_dir: the user's source directory, or None.
        dependencies: resolved files or directories to ship next to the code.

    Returns:
        :data:`ENTRY_SCRIPT`, the name of the script the job's launcher runs.
    """
    root = Path(dest)
    if source_dir is not None:
        shutil.copytree(source_dir, root, ignore=_IGNORED, dirs_exist_ok=True)
        script = entry_point.relative_to(Path(source_dir).resolve()).as_posix()
    else:
        shutil.copy2(entry_point, root / entry_point.name)
        script = entry_point.name
    for dependency in dependencies:
        target = root / dependency.name
        if dependency.is_dir():
            shutil.copytree(dependency, target, ignore=_IGNORED, dirs_exist_ok=True)
        else:
            shutil.copy2(dependency, target)

    wheel = build_wheel(dest)
    requirements = root / "requirements.txt"
    user_lines = requirements.read_text() if requirements.is_file() else ""
    requirements.write_text(f"./{wheel.name}\n{user_lines}")
    (root / ENTRY_SCRIPT).write_text(_ENTRY_TEMPLATE.format(script=script))
    return ENTRY_SCRIPT
