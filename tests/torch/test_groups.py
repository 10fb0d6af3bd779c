"""Subgroups of the smddp backend: new_group, new_subgroups, DeviceMesh, FSDP2 HSDP.

The launched tests run ``tests/ranks/group_checks.py``; each rank checks every result
against values it computes locally from seeded inputs (see the script).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
from fake_cupy import X86_ID, fake_cupy

from smddp.comm.backends.local import LocalCommunicator
from smddp.comm.backends.nccl.communicator import share_unique_id
from smddp.comm.base import Context
from smddp.comm.subgroups import group_topology, members, subgroup_communicators
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.job.topology import Topology

from launchers import RANKS, assert_all_ranks_passed, free_port, mpirun, rank_lines, run, torchrun

SCRIPT = "tests/ranks/group_checks.py"


@pytest.mark.mpi
def test_subgroups_under_mpirun():
    """3 ranks on MPI: a full group, [0, 2] beside a group of one, [0, 1] with a non-member."""
    result = mpirun(3, [SCRIPT, "groups"], timeout=180, env={"SMDDP_TIMEOUT": "60"})
    passed = assert_all_ranks_passed(result, 3, at_least=40)
    assert int(passed[0]) > int(passed[2]), passed  # rank 0 is in [0, 2] and [0, 1]
    assert "CHECK 1 a group of one: all_reduce is the identity" in result.stdout
    assert "CHECK 2 new_group: a non-member gets NON_GROUP_MEMBER" in result.stdout


@pytest.mark.mpi
def test_device_mesh_and_hsdp_under_mpirun():
    """4 ranks on MPI: a 2 x 2 DeviceMesh's slices, and FSDP2 HSDP equal to whole-batch training."""
    result = mpirun(4, [SCRIPT, "groups", "hsdp"], timeout=240, env={"SMDDP_TIMEOUT": "90"})
    assert_all_ranks_passed(result, 4, at_least=50)
    for rank in range(4):
        assert f"CHECK {rank} DeviceMesh['replicate']: all_reduce over its column" in result.stdout
        assert f"CHECK {rank} HSDP (replicate x shard) equals whole-batch training: fc1.weight" in result.stdout


def test_subgroups_on_gloo_under_torchrun():
    """torchrun (gloo communicators over each group's store): the same checks on 3 ranks."""
    result = torchrun(3, [SCRIPT, "groups"], timeout=180, env={"SMDDP_TIMEOUT": "60"})
    assert_all_ranks_passed(result, 3, at_least=40)


@pytest.mark.mpi
def test_debug_mismatch_in_a_subgroup_names_global_ranks():
    """SMDDP_DEBUG=1: the group of global ranks 1 and 2 calls mismatched shapes."""
    result = mpirun(3, [SCRIPT, "debug"], timeout=120, env={"SMDDP_DEBUG": "1", "SMDDP_TIMEOUT": "60"})
    assert_all_ranks_passed(result, 3, at_least=0)
    for rank in (1, 2):
        assert f"CHECK {rank} SMDDP_DEBUG: the mismatch names the group and its global ranks" in result.stdout


# ============================================================================ in-process
WORLD = Topology(rank=5, size=8, local_rank=1, local_size=4, node_rank=1, launcher="openmpi")


@pytest.mark.unit
@pytest.mark.parametrize("ranks, want", [
    # (rank, size, local_rank, local_size, node_rank) of global rank 5 (host 1 of 2, 4 per host)
    ([1, 5], (1, 2, 0, 1, 1)),
    ([4, 5, 6, 7], (1, 4, 1, 4, 0)),
    ([0, 2, 5, 7], (2, 4, 0, 2, 1)),
    ([5], (0, 1, 0, 1, 0)),
    ([7, 5, 0], (1, 3, 1, 2, 1)),  # group-rank order is the given order
])
def test_group_topology(ranks, want):
    got = group_topology(WORLD, ranks)
    assert (got.rank, got.size, got.local_rank, got.local_size, got.node_rank) == want
    # Never MPI_COMM_WORLD's launcher: the group's members meet through the group's own store.
    assert not got.mpi and got.distributed


@pytest.mark.unit
def test_group_topology_keeps_a_torchrun_launcher():
    world = dataclasses.replace(WORLD, launcher="torchrun")
    assert group_topology(world, [4, 5]).launcher == "torchrun"


@pytest.mark.unit
def test_group_topology_refuses_a_non_member():
    with pytest.raises(InvalidArgumentError, match="rank 5 is not a member"):
        group_topology(WORLD, [0, 1])


@pytest.mark.unit
@pytest.mark.parametrize("ranks", [[0, 0], [-1, 2]])
def test_members_refuses_duplicates_and_negatives(ranks):
    with pytest.raises(InvalidArgumentError, match="distinct and non-negative"):
        members(ranks)


@pytest.mark.mpi
def test_timeout_in_a_subgroup_names_global_ranks():
    """Global rank 2 never calls the group's all_reduce: rank 1's timeout names it and the group.

    Rank 1 made one more group than rank 2 before this one: rank 2 is still found alive and not
    started (issue 33 item 7: each group's stall channel is keyed by the group, not by a count
    of this process's groups). The job is broken afterwards, so it ends through MPI_Abort (a non-zero exit is expected).
    """
    result = mpirun(3, [SCRIPT, "stall"], timeout=120, env={"SMDDP_TIMEOUT": "3"})
    assert "FAILED" not in result.stdout, result.output
    assert "CHECK 1 the timeout names the group, global ranks, and the rank that never arrived" in result.stdout, (
        result.output)


# ============================================================================ what a group costs (issue 52)
MANY = str(RANKS / "many_groups.py")


def _limited_torchrun(soft_files: int, args, timeout: float, env=None):
    """torchrun whose agent (the store's host) and ranks start with a soft limit of ``soft_files`` open files."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    return run(["bash", "-c", f"ulimit -Sn {soft_files} && exec {shlex.join(cmd)}"], timeout, env)


@pytest.mark.slow
def test_200_groups_fit_a_store_host_held_to_256_files_and_leave_nothing_once_destroyed():
    """Each rank at ``ulimit -n 1024``, the store's host (torchrun's agent) at 256: 200 groups alive at
    once, exact; the store's host holds as many connections as with none (no group opens its own),
    and once destroyed the groups hold no file, thread or segment."""
    result = _limited_torchrun(256, [MANY, "200", "--files", "1024"], timeout=240)
    assert_all_ranks_passed(result, 2, at_least=4)
    assert int(rank_lines(result.stdout, "STORE")[0]) <= 8, result.output  # 2 ranks: no more than at start
    files, threads = map(int, rank_lines(result.stdout, "PEAK")[0].split())
    assert files <= 2 * 200 and threads <= 3 * 200, result.output  # under gloo's own 5 and 3 per group


@pytest.mark.slow
def test_a_rank_out_of_open_files_names_the_limit_on_every_rank():
    """At ``ulimit -n 64`` the groups run out of files: every rank raises, naming the limit, in seconds
    (gloo's threads would abort the process instead: accept: Too many open files)."""
    result = _limited_torchrun(64, [MANY, "60"], timeout=60)
    assert result.returncode != 0, result.output
    for rank in (0, 1):
        assert f"[rank{rank}]: smddp.errors.ResourceLimitError: process group" in result.output, result.output
    assert "of its limit of 64 (ulimit -n)" in result.output and "EnforceNotMet" not in result.output


@pytest.mark.slow
def test_a_64_mb_shared_memory_directory_holds_20_live_groups_exact_and_never_fills(tmp_path):
    """A container's 64 MB /dev/shm: the world and 20 groups, all alive, exact; the groups that would
    take its last quarter run flat, so it never fills."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a 64 MB tmpfs needs root")
    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)]).returncode:
        pytest.skip("this machine refuses to mount a tmpfs")
    try:
        result = torchrun(2, [MANY, "20"], timeout=240, env={"SMDDP_SHM_DIR": str(small)})
        assert_all_ranks_passed(result, 2, at_least=4)
        assert "would leave less than a quarter of it" in result.output, result.output
        assert list(small.iterdir()) == []  # every segment unlinked once mapped
    finally:
        subprocess.run(["umount", str(small)])


# ============================================================================ NCCL subgroups, on a stand-in
class _StandInNCCL:
    """Records how a subgroup's NCCL communicator is made (no GPU here)."""

    name = "nccl"
    device_types = ("cuda",)

    def __init__(self, ctx):
        self.ctx, self.device_id = ctx, torch.device("cuda", 1)

    def subgroup(self, ranks, ctx):
        made = type(self)(ctx)
        made.ranks = list(ranks)
        return made

    def close(self):
        pass


class _NoSubgroups(_StandInNCCL):
    name = "device-standin"
    subgroup = None  # a device communicator with no subgroup of its own


def _group_ctx(ranks):
    topology = group_topology(WORLD, ranks)
    return Context(topology, timedelta(seconds=10), tdist.HashStore())


@pytest.mark.unit
def test_nccl_subgroup_is_made_by_the_parents_subgroup_with_the_groups_context():
    parent = _StandInNCCL(None)
    made = subgroup_communicators({"cuda": parent}, [1, 5], _group_ctx([1, 5]))["cuda"]
    assert type(made) is _StandInNCCL and made is not parent and made.ranks == [1, 5]
    assert (made.ctx.topology.rank, made.ctx.topology.size) == (1, 2) and not made.ctx.topology.mpi


@pytest.mark.unit
def test_a_group_of_one_is_local_and_a_device_communicator_without_subgroups_is_refused_by_name():
    parent = _StandInNCCL(None)
    assert isinstance(subgroup_communicators({"cuda": parent}, [5], _group_ctx([5]))["cuda"], LocalCommunicator)
    with pytest.raises(BackendUnavailableError, match="'device-standin' backend cannot make subgroups"):
        subgroup_communicators({"cuda": _NoSubgroups(None)}, [1, 5], _group_ctx([1, 5]))


@pytest.mark.unit
def test_nccl_subgroup_members_meet_whatever_they_created_before(monkeypatch):
    """Global ranks 1 and 5 may have made different numbers of NCCL communicators: the group's store
    (torch's prefix for the group) names the key, so it agrees."""
    fake = fake_cupy(monkeypatch, uid=X86_ID)
    store = tdist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    got = {}

    def member(world_rank: int) -> None:
        world = dataclasses.replace(WORLD, rank=world_rank, local_rank=world_rank % 4, node_rank=world_rank // 4)
        topology = group_topology(world, [1, 5])
        got[world_rank] = share_unique_id(fake, topology, tdist.PrefixStore("pg-1-5", store))

    threads = [threading.Thread(target=member, args=(5,)), threading.Thread(target=member, args=(1,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got == {1: X86_ID, 5: X86_ID}
    assert fake.calls == ["get_unique_id"]  # group rank 0 (global rank 1) only
