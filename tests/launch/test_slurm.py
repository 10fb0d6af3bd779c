"""Slurm for real: a one-node cluster (munged, slurmctld, slurmd from Debian's packages) on loopback.

The fixture writes a ``slurm.conf`` and a munge key into a temporary directory, starts the three
daemons there as this user, waits for the node to be idle, and stops them afterwards. Where they
cannot start (packages missing, not root) the tests skip and say why. ``.ci/run`` installs
``slurm-wlm`` and ``munge``.

The jobs run exactly as a Slurm user would type them: ``srun --ntasks-per-node N python train.py``,
with no ``MASTER_ADDR``/``MASTER_PORT`` (smddp derives them from the job, as Lightning does).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smddp.job.topology import SLURM_BASE_PORT

from launchers import RANKS, ROOT, base_env, free_port, rank_lines, run

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "scancel")

_CONF = """\
ClusterName=smddptest
SlurmctldHost={node}(127.0.0.1)
SlurmUser={user}
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge/socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _node_name() -> str:
    """This host's short name when it resolves (Slurm's default node name), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _sbin(name: str):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _stop(pidfile: Path) -> None:
    """End the daemon whose pid ``pidfile`` holds (SIGTERM, then SIGKILL after 10 s)."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _start(cmd, env, why: str) -> None:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.skip(f"{why} failed to start ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """``{"SLURM_CONF": ...}`` of a running one-node cluster with 4 CPUs."""
    missing = [name for name in DAEMONS + CLIENTS if not _sbin(name)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs; these tests run as another user")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = _node_name()
    conf = d / "slurm.conf"
    conf.write_text(_CONF.format(node=node, user="root", dir=d, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**base_env(), "SLURM_CONF": str(conf)}
    try:
        _start([_sbin("munged"), "--force", f"--key-file={key}", f"--socket={d}/munge/socket",
                f"--pid-file={d}/munge/pid", f"--log-file={d}/munge/log", f"--seed-file={d}/munge/seed"],
               env, "munged")
        _start([_sbin("slurmctld"), "-i"], env, "slurmctld")
        _start([_sbin("slurmd"), "-N", node], env, "slurmd")
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                                   timeout=30).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            logs = "\n".join((d / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (d / f).exists())
            pytest.skip(f"the Slurm node never became idle (state {state!r}):\n{logs}")
        print(f"slurm: one node {node!r} (4 CPUs) on loopback, SLURM_CONF={conf}")
        yield {"SLURM_CONF": str(conf)}
    finally:
        # Jobs a failed test left behind end with their steps before the daemons go.
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
        time.sleep(1)
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munge/pid"):
            _stop(d / pidfile)


def srun(slurm, ntasks: int, args, timeout: float = 180, env=None):
    """``srun --ntasks-per-node N ARGS`` on the test cluster, with this worktree on PYTHONPATH."""
    return run(["srun", "--ntasks-per-node", str(ntasks), *args], timeout, {**slurm, **(env or {})})


def test_readme_line_trains_in_sync(slurm, tmp_path):
    """README: ``srun --ntasks-per-node 8 python train.py``, here with 2 tasks."""
    result = srun(slurm, 2, [sys.executable, str(ROOT / "examples" / "train.py"), "--epochs", "1",
                             "--samples", "512", "--model-dir", str(tmp_path)], timeout=300).check()
    weights = rank_lines(result.stdout, "WEIGHTS")
    assert sorted(weights) == [0, 1], result.output
    assert len(set(weights.values())) == 1, f"ranks ended with different weights: {weights}"
    assert (tmp_path / "model.pt").is_file()
    assert "Training on 2 process(es)" in result.stdout


@pytest.mark.parametrize("ntasks", [2, 3])
def test_every_task_gets_the_runtime_and_env_init_works(slurm, ntasks):
    result = srun(slurm, ntasks, [sys.executable, "-m", "smddp.alias", str(RANKS / "runtime_env.py"), "--init"])
    result.check()
    found = {rank: json.loads(rest) for rank, rest in rank_lines(result.stdout, "RUNTIME").items()}
    assert sorted(found) == list(range(ntasks)), result.output
    for rank, r in found.items():
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(ntasks), str(rank), str(ntasks))
        assert r["SMDATAPARALLEL_LOCAL_RANK"] == str(rank)
        # The first node of the job, and 15000 + the job id's last 4 digits (as Lightning derives it).
        assert (r["MASTER_ADDR"], r["MASTER_PORT"]) == (_node_name(), str(SLURM_BASE_PORT + int(r["job"][-4:])))
        assert (r["torch_rank"], r["torch_size"]) == (rank, ntasks)
        assert r["sum"] == ntasks * (ntasks + 1) / 2
        assert r["plane"] == "shm"  # srun without MPI: the shared-memory plane over the job's store


def test_init_methods_under_srun(slurm, tmp_path):
    """torch's init methods with no MASTER_ADDR/MASTER_PORT anywhere: the job says where to meet."""
    result = srun(slurm, 2, [sys.executable, str(RANKS / "init_methods.py"), str(free_port()), str(free_port()),
                             str(tmp_path), "default", "env", "tcp", "file", "store", "v1-then-torch"])
    result.check()
    found = {}
    for line in result.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[0] == "INIT":
            found[(int(parts[1]), parts[2])] = json.loads(parts[3])
    assert len(found) == 12, result.output
    for (rank, mode), r in found.items():
        assert r["torch"] == [rank, 2] and r["torch_sum"] == r["v1_sum"] == 3.0 and r["bcast"] == 1.0, (mode, r)


def test_a_rank_set_by_hand_that_contradicts_srun_is_named(slurm):
    result = srun(slurm, 2, [sys.executable, "-m", "smddp.alias", str(RANKS / "runtime_env.py")],
                  timeout=60, env={"RANK": "5"})
    assert result.returncode != 0, result.output
    assert "RANK=5 (environment) contradicts the launcher (Slurm's srun)" in result.stderr, result.output
    assert "RUNTIME" not in result.stdout
