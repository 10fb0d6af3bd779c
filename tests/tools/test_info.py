"""smddp-info: with and without a launcher, with and without mpi4py, text and JSON."""

from __future__ import annotations

import json
import os

import pytest

from launchers import ROOT, mpirun, python

# A sitecustomize that makes "import MODULE" fail as if it were not installed.
HIDE = '''
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "MODULE" or name.startswith("MODULE."):
            raise ModuleNotFoundError("No module named 'MODULE' (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, _Hide())
'''


def _without(module: str, tmp_path) -> dict:
    """An environment whose Python cannot import ``module`` (a sitecustomize in ``tmp_path``)."""
    (tmp_path / "sitecustomize.py").write_text(HIDE.replace("MODULE", module))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


@pytest.fixture
def no_mpi4py(tmp_path):
    return _without("mpi4py", tmp_path)


def _backend(report, name):
    return next(b for b in report["backends"]["registry"] if b["name"] == name)


def test_plain_python_json_and_text():
    import torch

    import smddp
    from smddp.info.report import format_report

    report = json.loads(python(["-m", "smddp.info", "--json"], timeout=120).check().stdout)
    assert report["smddp"]["version"] == smddp.__version__ and report["torch"]["version"] == torch.__version__
    assert report["topology"]["launcher"] == "none" and report["topology"]["size"] == 1
    assert report["backends"]["auto"]["this launcher"] == "local"
    assert _backend(report, "local")["runs_here"] and _backend(report, "gloo")["runs_here"]
    assert report["torch"]["gloo"] is True
    text = format_report(report)
    for needle in (f"smddp         {smddp.__version__}", f"torch         {torch.__version__}", "mpi4py",
                   "MPI library", "CuPy", "oneCCL", "backends", "launcher      none", "rank 0 of 1", "GPUs"):
        assert needle in text, needle
    pytest.importorskip("mpi4py")
    import mpi4py

    assert report["mpi4py"]["version"] == mpi4py.__version__
    assert report["mpi"]["library_version"] and report["mpi"]["standard"]
    assert _backend(report, "mpi")["runs_here"]
    assert report["backends"]["auto"]["under mpirun -np 2"] == "mpi"


@pytest.mark.mpi
def test_under_mpirun_rank_0_reports():
    res = mpirun(2, ["-m", "smddp.info", "--json"], timeout=120).check()
    report = json.loads(res.stdout)  # exactly one document: rank 0's
    assert report["topology"]["launcher"] == "openmpi" and report["topology"]["size"] == 2
    assert report["topology"]["rank"] == 0
    assert report["backends"]["auto"]["this launcher"] == "mpi"
    assert report["environment"]["OMPI_COMM_WORLD_SIZE"] == "2"


@pytest.mark.mpi
def test_under_mpirun_every_rank_reports():
    text = mpirun(2, ["-m", "smddp.info", "--all-ranks"], timeout=120).check().stdout
    assert "[rank 0] launcher      openmpi" in text and "[rank 1] launcher      openmpi" in text
    assert "[rank 1] topology      rank 1 of 2" in text


def test_without_mpi4py(no_mpi4py):
    from smddp.info.report import format_report

    report = json.loads(python(["-m", "smddp.info", "--json"], env=no_mpi4py, timeout=120).check().stdout)
    assert report["mpi4py"]["version"] is None and "hidden by the test" in report["mpi4py"]["error"]
    assert "library_version" not in report["mpi"]
    mpi = _backend(report, "mpi")
    assert not mpi["runs_here"] and "smddp[mpi]" in mpi["note"]
    assert report["backends"]["auto"]["under mpirun -np 2"] == "gloo"
    assert "mpi4py        not installed" in format_report(report)


@pytest.mark.skipif(not __import__("shutil").which("mpirun"), reason="mpirun not installed")
def test_without_mpi4py_under_mpirun(no_mpi4py):
    res = mpirun(2, ["-m", "smddp.info", "--json"], env=no_mpi4py, timeout=120).check()
    report = json.loads(res.stdout)
    assert report["topology"]["launcher"] == "openmpi" and report["mpi4py"]["version"] is None
    assert report["backends"]["auto"]["this launcher"] == "gloo"


def test_collect_never_initializes_mpi_in_process():
    code = ("import sys, smddp.info.report as i; r = i.collect(); "
            "print('MPI-IMPORTED' if 'mpi4py.MPI' in sys.modules else 'MPI-UNTOUCHED'); "
            "print(len(i.format_report(r).splitlines()))")
    res = python(["-c", code], timeout=120).check()
    assert "MPI-UNTOUCHED" in res.stdout


def test_without_torch_says_so_in_one_line(tmp_path):
    """An interpreter without torch (smddp installed by another Python's pip): one line, exit 1."""
    result = python(["-m", "smddp.info"], timeout=120, env=_without("torch", tmp_path))
    assert result.returncode == 1, result.output
    assert "torch is not importable in" in result.stderr and "Traceback" not in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.unit
def test_help_documents_every_option():
    from smddp.info.report import build_parser

    text = build_parser().format_help()
    assert "--json" in text and "--all-ranks" in text
