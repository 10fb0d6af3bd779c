"""smddp installs, and its GPU tests collect, on a machine with no package registry.

The GPU machine this project can use has torch (2.11.0+cu130), cupy-cuda13x, nvidia-nccl-cu13,
mpi4py, pytest, pytest-timeout and hypothesis, and no moto, sagemaker or Open MPI. The README's
offline line must work there::

    python -m pip install --no-index --no-deps --no-build-isolation -e .
    pytest -m gpu

This test makes a virtual environment holding only that set (each package that is installed
here, with what it needs, linked from this interpreter's site-packages: nothing is downloaded),
installs a copy of the project with that line, and collects ``pytest -m gpu``: every test file
must import there.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Set

import pytest

from launchers import ROOT, run

#: The GPU machine's packages (distribution names); those not installed here are left out.
GPU_MACHINE = ("torch", "cupy-cuda13x", "cupy-cuda12x", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "mpi4py",
               "pytest", "pytest-timeout", "hypothesis")
#: What installing with --no-build-isolation needs from the environment itself.
TOOLS = ("pip", "setuptools", "wheel")
#: What the GPU machine does not have: none of it may be importable in the environment.
ABSENT = ("moto", "sagemaker", "boto3", "transformers", "lightning")


def _closure(names) -> Set[str]:
    """The installed distributions among ``names``, with everything they require (installed)."""
    found: Set[str] = set()
    todo = list(names)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if not name or name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
        for req in dist.requires or ():
            if "extra ==" not in req:
                todo.append(req)
    return found


def _link(names: Set[str], site: Path) -> None:
    """Link every top-level file or folder of each distribution into ``site``."""
    for name in names:
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source, target = base / top, site / top
            if top in ("..", "__pycache__") or not source.exists() or target.exists():
                continue
            target.symlink_to(source)


@pytest.mark.timeout(600)
def test_the_offline_install_line_works_and_every_gpu_test_collects(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = list(venv.glob("lib/python*/site-packages"))
    _link(_closure(GPU_MACHINE + TOOLS), site)
    python = str(venv / "bin" / "python")
    project = tmp_path / "project"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, project / name)
    env = {"PYTHONPATH": "", "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    absent = run([python, "-c", "import importlib.util as u, sys; "
                  f"sys.exit(sum(u.find_spec(m) is not None for m in {ABSENT!r}))"], timeout=120, env=env)
    assert absent.returncode == 0, f"the environment has packages the GPU machine lacks: {absent.output}"
    install = run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."],
                  timeout=300, env=env, cwd=str(project))
    assert install.returncode == 0, install.output
    where = run([python, "-c", "import smddp; print(smddp.__file__)"], timeout=120, env=env, cwd=str(tmp_path))
    assert where.stdout.strip() == str(project / "smddp" / "__init__.py"), where.output
    collected = run([python, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                    timeout=300, env=env, cwd=str(project))
    assert collected.returncode == 0, collected.output
    assert "error" not in collected.stdout.lower(), collected.output
    gpu_files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert "tests/comm/backends/nccl/test_gpu.py" in gpu_files, collected.output


def test_one_extra_per_cuda_version_each_with_its_cupy_and_nccl():
    """[cuda12] and [cuda13] each bring one CuPy and its NCCL; no extra brings two CuPy packages
    (they overwrite each other); the install hint names both."""
    import configparser

    from smddp.comm.needs import CUDA_INSTALL

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {name: {re.split(r"[<>=;\s]", line.strip(), maxsplit=1)[0] for line in value.splitlines() if line.strip()}
              for name, value in config["options.extras_require"].items()}
    assert {"cupy-cuda12x", "nvidia-nccl-cu12"} <= extras["cuda12"]
    assert {"cupy-cuda13x", "nvidia-nccl-cu13"} <= extras["cuda13"]
    for name, packages in extras.items():
        assert len({p for p in packages if p.startswith("cupy")}) <= 1, name
    assert "cuda" not in extras  # the old name brought CUDA 12's CuPy onto CUDA 13 machines
    assert "smddp[cuda12]" in CUDA_INSTALL and "smddp[cuda13]" in CUDA_INSTALL
