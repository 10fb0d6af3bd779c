"""The shared-memory CPU plane under every launcher: each rank's all-reduces exact, and the plane named.

The plane meets its host-mates through the job's torch Store, so mpirun, smddprun (both
launchers), torchrun, ``torch.multiprocessing.spawn`` and torchrun's c10d rendezvous across two
hosts (the hierarchical plane over gloo) all get it. Under the launchers that bind no rank to CPUs
(torchrun, smddprun's own), each rank of a host runs on CPUs of its own (``smddp.job.placement``).
Lightning's launcher, srun and local mode check the plane in tests/integrations/test_integrations.py,
tests/launch/test_slurm.py and tests/sagemaker/test_local_mode.py.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from launchers import RANKS, ROOT, free_port, mpirun, python, rank_lines, run, torchrun

sys.path.insert(0, str(ROOT / "benchmarks"))
from netns_hosts import NamespaceError, two_hosts  # noqa: E402

SCRIPT = str(RANKS / "plane_report.py")
SMDDPRUN = [sys.executable, "-m", "smddp.launch"]


def assert_plane(result, size: int, backend: str, plane: str) -> None:
    assert result.returncode == 0, result.output
    assert sorted(rank_lines(result.stdout, "PASSED")) == list(range(size)), result.output
    assert rank_lines(result.stdout, "PLANE") == {r: f"{backend} {plane}" for r in range(size)}, result.output


def assert_own_cpus(result, size: int) -> None:
    """Under a launcher that binds no rank: each rank of the host runs on CPUs of its own, together
    the CPUs the job may use; with fewer CPUs than ranks, each keeps them all (issue 55)."""
    allowed = set(os.sched_getaffinity(0))
    cpus = {r: {int(c) for c in line.split(",")} for r, line in rank_lines(result.stdout, "CPUS").items()}
    assert sorted(cpus) == list(range(size)), result.output
    if size > len(allowed):
        assert all(c == allowed for c in cpus.values()), cpus
        return
    assert set().union(*cpus.values()) == allowed, cpus
    assert sum(len(c) for c in cpus.values()) == len(allowed), cpus  # no CPU in two ranks' shares
    assert all(cpus.values()), cpus


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_mpirun(np):
    assert_plane(mpirun(np, [SCRIPT, "v1"], timeout=180), np, "mpi", "shm")


@pytest.mark.mpi
def test_smddprun_over_mpirun():
    assert_plane(run([*SMDDPRUN, "--launcher", "mpirun", "-np", "2", SCRIPT, "v1"], timeout=180), 2, "mpi", "shm")


def test_smddprun_on_one_host():
    # smddprun's default on one host: it starts the ranks itself (its local launcher).
    result = run([*SMDDPRUN, "-np", "2", SCRIPT, "v1"], timeout=180)
    assert_plane(result, 2, "gloo", "shm")
    assert_own_cpus(result, 2)


@pytest.mark.parametrize("np", [2, 3])
def test_torchrun_standalone(np):
    """On 2 ranks with ``SMDDP_DEBUG=1``, which also says which plane and why, where each rank runs,
    and at the end how long each rank's main thread waited for a CPU."""
    result = torchrun(np, [SCRIPT, "v2"], timeout=180, env={"SMDDP_DEBUG": "1"} if np == 2 else None)
    assert_plane(result, np, "gloo", "shm")
    assert_own_cpus(result, np)
    if np == 2:
        assert "smddp: CPU plane: shm (all 2 ranks share one host)" in result.output, result.output
        for rank in range(np):
            assert f"smddp: rank {rank}: its main thread waited for a CPU " in result.output, result.output
            assert re.search(rf"smddp: rank {rank}: (runs|left) on CPUs? ", result.output), result.output


def test_torchrun_v1_api():
    assert_plane(torchrun(2, [SCRIPT, "v1"], timeout=180), 2, "gloo", "shm")


def test_multiprocessing_spawn_with_env_init():
    assert_plane(python([SCRIPT, "spawn"], timeout=180), 2, "gloo", "shm")


def test_pinned_gloo_plane_under_torchrun():
    """Also ``SMDDP_CPU_BIND=none``: the ranks keep every CPU the job may use."""
    result = torchrun(2, [SCRIPT, "v2"], timeout=180, env={"SMDDP_CPU_PLANE": "gloo", "SMDDP_CPU_BIND": "none"})
    assert_plane(result, 2, "gloo", "gloo")
    allowed = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert rank_lines(result.stdout, "CPUS") == {0: allowed, 1: allowed}, result.output


def test_torchrun_c10d_across_two_hosts_is_hierarchical_over_gloo():
    """Two network-namespace hosts of two ranks each, met by torchrun's c10d rendezvous."""
    try:
        hosts_cm = two_hosts()
        hosts = hosts_cm.__enter__()
    except NamespaceError as exc:
        pytest.skip(f"two namespace hosts cannot be made here: {exc}")
    try:
        endpoint = f"10.213.{hosts.subnet}.1:{free_port()}"
        commands = []
        for node, host in enumerate(("host1", "host2")):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "smddp-test", "--tee", "3", SCRIPT, "v2"]
            env = ["env", f"PYTHONPATH={ROOT}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
                   "SMDDP_HIERARCHICAL_MIN_BYTES=65536"]
            commands.append(" ".join(shlex.quote(a) for a in hosts.command([*env, *argv], host)))
        # Both hosts at once; the job's output is the two torchruns' output together.
        result = run(["bash", "-c", f"{commands[1]} & {commands[0]}; status=$?; wait $! || status=1; exit $status"],
                     timeout=300)
    finally:
        hosts_cm.__exit__(None, None, None)
    assert_plane(result, 4, "gloo", "hierarchical")
