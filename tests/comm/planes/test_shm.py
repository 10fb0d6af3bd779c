"""The shared-memory CPU plane and the MPI backend's plane choice, in real mpirun jobs.

The plane runs in its compiled core (``_shm_native.c``, built by the README's install) and
keeps a Python path as the fallback: both are run here, and must agree bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from smddp.comm.planes.choose import settings
from smddp.comm.planes.shm_segment import pid_namespace, sweep_stale

from launchers import RANKS, mpirun, rank_lines, torchrun, untagged

SCRIPT = str(RANKS / "shm_checks.py")
SHM = Path("/dev/shm")

pytestmark = pytest.mark.mpi


def ours() -> set:
    return {p.name for p in SHM.glob("smddp-shm-*")} if SHM.is_dir() else set()


def assert_all_ranks_passed(result, size: int, plane: str, core: str = "") -> None:
    assert result.returncode == 0, result.output
    if core:
        assert rank_lines(result.stdout, "CORE") == {r: core for r in range(size)}, result.output
    assert sorted(rank_lines(result.stdout, "PASSED")) == list(range(size)), result.output
    digests = rank_lines(result.stdout, "DIGEST")
    assert len(set(digests.values())) == 1, digests  # bitwise identical on every rank
    planes = rank_lines(result.stdout, "PLANES")
    for rank in range(size):
        used = dict(item.split(":") for item in planes[rank].split(","))
        # all_to_all on shared memory needs the compiled core; the Python path leaves it to MPI.
        assert used.pop("all_to_all_single") == ("mpi" if core == "python" else plane), used
        assert used["reduce_scatter"] == plane, used  # native, not derived from all_to_all_single
        assert set(used.values()) == {plane}, used


def test_the_compiled_core_is_built():
    # The README's install builds it; without it the plane runs (slower) in Python.
    from smddp.comm.planes import shm

    assert shm.native is not None, "smddp/comm/planes/_shm_native.c was not built: pip install -e . again"
    assert settings({}).native and not settings({"SMDDP_SHM_NATIVE": "0"}).native
    # Both implementations stop at the ranks whose epoch words the segment's header holds.
    assert shm.native.MAX_RANKS == shm.MAX_LOCAL_RANKS == 64


def test_every_collective_on_the_shm_plane():
    before = ours()
    result = mpirun(2, [SCRIPT, "checks", "shm"], timeout=300, env={"SMDDP_DEBUG": "1"})
    assert_all_ranks_passed(result, 2, "shm", "native")
    assert ours() <= before  # nothing left in /dev/shm
    # SMDDP_DEBUG says which plane each collective took
    assert "smddp: CPU plane: shm (all 2 ranks share one host)" in result.stderr, result.stderr
    for rank in range(2):
        assert f"smddp: rank {rank}: all_reduce on the shm plane" in result.stderr, result.stderr
        assert f"smddp: rank {rank}: all_to_all_single on the shm plane" in result.stderr, result.stderr


@pytest.mark.parametrize("np", [2, 3])
def test_compiled_core_and_python_path_agree_bit_for_bit(np):
    """Every collective in 64 KiB slots (in slices), exact on every rank, nothing left in /dev/shm; and
    the same seeded inputs, random floats included, give the compiled core's results on the Python
    path bit for bit (the same reduction order, float32 accumulation of halves).

    On 3 ranks the Python path is the one the ranks agree on when one of them (rank 1) cannot use
    the core; on 2, every rank's ``SMDDP_SHM_NATIVE=0``."""
    before = ours()
    env = {"SMDDP_SHM_SLOT_BYTES": "65536"}
    native = mpirun(np, [SCRIPT, "checks", "shm"], timeout=300, env=env)
    off = {"SHM_CHECKS_PYTHON_ON_RANK": "1"} if np == 3 else {"SMDDP_SHM_NATIVE": "0"}
    python = mpirun(np, [SCRIPT, "checks", "shm"], timeout=300, env={**env, **off})
    assert_all_ranks_passed(native, np, "shm", "native")
    assert_all_ranks_passed(python, np, "shm", "python")
    assert rank_lines(native.stdout, "DIGEST") == rank_lines(python.stdout, "DIGEST")
    assert ours() <= before  # nothing left in /dev/shm


def test_a_rank_waiting_for_its_peer_gives_its_core_back():
    # Rank 1 sleeps 1 s before the all-reduce: the others wait in the compiled core, which
    # spins 20 us and then sleeps on the peer's epoch word until it publishes.
    result = mpirun(3, [SCRIPT, "idle", "shm"], timeout=120)
    assert_all_ranks_passed_simple(result, 3)
    assert rank_lines(result.stdout, "CORE") == {0: "native", 1: "native", 2: "native"}, result.output
    for rank in (0, 2):
        cpu, wall = map(float, rank_lines(result.stdout, "WAITCPU")[rank].split())
        assert wall > 0.5, result.output  # it did wait for rank 1
        assert cpu < 0.25 * wall, result.output  # ... mostly asleep, not spinning


def assert_all_ranks_passed_simple(result, size: int) -> None:
    assert result.returncode == 0, result.output
    assert sorted(rank_lines(result.stdout, "PASSED")) == list(range(size)), result.output


def test_unknown_or_impossible_plane_is_an_error():
    result = mpirun(2, [SCRIPT, "checks", "shm"], timeout=120, env={"SMDDP_CPU_PLANE": "fast"})
    refused = "SMDDP_CPU_PLANE=fast (environment) is not one of the choices"
    assert result.returncode != 0 and refused in result.output, result.output
    # All ranks on one host: there is nothing to be hierarchical about.
    result = mpirun(2, [SCRIPT, "checks", "shm"], timeout=120, env={"SMDDP_CPU_PLANE": "hierarchical"})
    assert result.returncode != 0 and "SMDDP_CPU_PLANE=hierarchical cannot be used" in result.output, result.output


def test_plane_pinned_to_mpi():
    result = mpirun(2, [SCRIPT, "checks", "mpi"], timeout=300, env={"SMDDP_CPU_PLANE": "mpi"})
    assert_all_ranks_passed(result, 2, "mpi")


def test_plane_pinned_to_gloo():
    result = mpirun(2, [SCRIPT, "checks", "gloo"], timeout=300, env={"SMDDP_CPU_PLANE": "gloo"})
    assert result.returncode == 0, result.output
    assert sorted(rank_lines(result.stdout, "PASSED")) == [0, 1], result.output


def test_dev_shm_too_small_falls_back_to_mpi_with_one_warning():
    # A 1 TiB buffer per rank: no /dev/shm holds it, as Docker's 64 MB holds no 8 MiB x ranks.
    result = mpirun(2, [SCRIPT, "checks", "mpi"], timeout=300, env={"SMDDP_SHM_SLOT_BYTES": str(1 << 40)})
    assert_all_ranks_passed(result, 2, "mpi")
    assert result.output.count("shared-memory plane unavailable") == 1, result.output
    assert "--shm-size" in result.output


def test_a_shm_dir_that_is_not_one_is_said_once_and_the_job_runs_on_mpi(tmp_path):
    # SMDDP_SHM_DIR named by the user and missing: said (with the variable) on rank 0, never silent.
    missing = tmp_path / "no-such-dir"
    result = mpirun(2, [str(RANKS / "plane_report.py"), "v1"], timeout=120, env={"SMDDP_SHM_DIR": str(missing)})
    assert result.returncode == 0, result.output
    assert rank_lines(result.stdout, "PLANE") == {0: "mpi mpi", 1: "mpi mpi"}, result.output
    said = f"SMDDP_SHM_DIR={missing} (environment) is not a directory: the shared-memory plane is off"
    assert result.stderr.count(said) == 1, result.stderr


def test_kill_9_leaves_nothing_behind():
    # A segment a crash during set-up left behind: its creator's pid no longer exists.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = SHM / f"smddp-shm-0-host-world-abcdef-n{pid_namespace()}-p{dead.pid}"
    stale.write_bytes(b"\0" * 4096)
    before = ours() - {stale.name}
    result = mpirun(2, [SCRIPT, "kill", "shm"], timeout=120, env={"SMDDP_TIMEOUT": "60"})
    assert result.returncode != 0, result.output
    assert "KILLING 1" in result.stdout and "UNREACHABLE" not in result.stdout, result.output
    assert not stale.exists()  # swept by the next job's set-up
    assert ours() <= before, ours() - before


def test_segment_names_smddp_makes_and_refuses(monkeypatch):
    from smddp.comm.planes import shm_segment

    for bad in ("/dev/shm/smddp-shm-x", "smddp-shm-../etc", "smddp-shm-a/b", "smddp-shm-", "smddp-shm-a.b",
                "other-x", "smddp-shm-" + "x" * 201, "smddp-shm-\u00e9", "smddp-shm-x\n", None):
        assert not shm_segment.valid_name(bad), bad
    # Whatever the host, job and group are called, the name smddp makes is one it accepts.
    monkeypatch.setattr(shm_segment.socket, "gethostname", lambda: "ip-10-0-0-1.ec2..internal/../x")
    monkeypatch.setenv("SLURM_JOB_ID", "12/../34")
    name = shm_segment._new_name("my group/../x" * 5)
    assert shm_segment.valid_name(name) and name.endswith(f"-n{pid_namespace()}-p{os.getpid()}"), name


def test_sweep_removes_only_segments_of_dead_processes_in_its_pid_namespace(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = pid_namespace()
    gone = f"smddp-shm-1-h-world-aaaaaa-n{here}-p{dead.pid}"
    kept = [
        f"smddp-shm-1-h-world-bbbbbb-n{here}-p{os.getpid()}",  # alive
        # A container's job that shares this /dev/shm: its pid means nothing in this namespace.
        f"smddp-shm-1-h-world-cccccc-n{int(here) + 1}-p{dead.pid}",
        f"smddp-shm-1-h-world-dddddd-p{dead.pid}",  # no namespace: not judged
        "other-file",
    ]
    for name in [gone, *kept]:
        (tmp_path / name).write_bytes(b"")
    assert sweep_stale(str(tmp_path)) == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


SETUP = str(RANKS / "segment_setup.py")


def test_planted_segment_names_are_refused_and_touch_nothing(tmp_path):
    """Issue 33 item 3: the name read from the store is validated, opened without following links.

    Rank 0 creates its segment; the others read a planted name (absolute, ../, a link in the
    shared-memory directory, a name with no file): every rank refuses with the reason, the victim
    file outside the directory is untouched, rank 0 removes its own segment, and a clean init
    after them runs on the plane, exact.
    """
    shm_dir = Path(tempfile.mkdtemp(prefix="smddp-test-segments-", dir=SHM if SHM.is_dir() else None))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shm_dir / "smddp-shm-planted-link").symlink_to(victim)
    try:
        result = mpirun(2, [SETUP, "plant", str(victim)], timeout=180, env={"SMDDP_SHM_DIR": str(shm_dir)})
        assert result.returncode == 0, result.output
        refused = {}
        for line in result.stdout.splitlines():
            parts = untagged(line).split(None, 3)
            if parts and parts[0] == "REFUSED":
                refused[(int(parts[1]), parts[2])] = parts[3]
        why = {"absolute": "is not one smddp makes", "dotdot": "is not one smddp makes",
               "link": "is a symbolic link", "missing": "is missing from"}
        for rank in (0, 1):  # every rank refuses, with local rank 1's reason
            for kind, words in why.items():
                assert words in refused.get((rank, kind), ""), result.output
        assert rank_lines(result.stdout, "EXACT") == {0: "shm", 1: "shm"}, result.output
        assert victim.read_text() == "precious"
        assert sorted(p.name for p in shm_dir.iterdir()) == ["smddp-shm-planted-link"]  # nothing of smddp's
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_a_rank_lost_during_set_up_leaves_no_segment(mode):
    """Issue 33 item 6: rank 1 dies (kill -9) or stalls between reading the name and mapping it.

    kill: mpirun ends rank 0 with SIGTERM as it waits; stall: rank 0's wait times out. Either
    way rank 0, which created the segment, removes it, and the directory is empty afterwards.
    """
    shm_dir = Path(tempfile.mkdtemp(prefix="smddp-test-segments-", dir=SHM if SHM.is_dir() else None))
    try:
        env = {"SMDDP_SHM_DIR": str(shm_dir), "SMDDP_TIMEOUT": "3"}
        result = mpirun(2, [SETUP, mode], timeout=120, env=env)
        if mode == "kill":
            assert result.returncode != 0 and "INITIALIZED" not in result.stdout, result.output
        else:
            assert result.returncode == 0, result.output
            assert "to map its segment (removed now)" in rank_lines(result.stdout, "WAITED").get(0, ""), result.output
            assert "is missing from" in rank_lines(result.stdout, "MISSING").get(1, ""), result.output
        assert list(shm_dir.iterdir()) == [], result.output
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_slot_below_the_minimum_falls_back_to_mpi_with_one_warning():
    # 4 KiB buffers could not give each of 64 peers a share of an all-to-all step.
    result = mpirun(2, [SCRIPT, "checks", "mpi"], timeout=300, env={"SMDDP_SHM_SLOT_BYTES": "4096"})
    assert_all_ranks_passed(result, 2, "mpi")
    assert result.output.count("below the shared-memory plane's minimum") == 1, result.output


# ---------------------------------------------------------------------------- single copy (issue 37)
#: Small sizes, so that every switch point is a few hundred KiB: the core's one-step limit (4 KiB),
#: its steps (64 KiB), the single-copy threshold (an odd 100,000 bytes), the slot (256 KiB: the
#: Python path's one-step limit and slice).
SWITCHES = {"SMDDP_SHM_SLOT_BYTES": "262144", "SMDDP_SHM_CHUNK_BYTES": "65536", "SMDDP_SHM_ONE_SHOT_MAX": "4096",
            "SMDDP_SHM_CMA": "1", "SMDDP_SHM_CMA_MIN_BYTES": "100000"}


def single_copy(result, size: int) -> dict:
    """``{rank: (threshold, all-reduces run single-copy)}``, after checking every rank passed, bit for bit."""
    assert result.returncode == 0, result.output
    assert sorted(rank_lines(result.stdout, "PASSED")) == list(range(size)), result.output
    assert len(set(rank_lines(result.stdout, "DIGEST").values())) == 1, result.output
    return {r: tuple(map(int, v.split())) for r, v in rank_lines(result.stdout, "SINGLECOPY").items()}


@pytest.mark.parametrize("np", [2, 3])
def test_single_copy_and_segment_paths_agree_bit_for_bit_at_every_switch_point(np):
    """Every dtype and op, at sizes on either side of every switch point: exact on every rank, and
    the single-copy path, the segment path and the Python path give the same bits."""
    before = ours()
    runs = {}
    for path, extra in (("single", {}), ("segment", {"SMDDP_SHM_CMA": "0"}), ("python", {"SMDDP_SHM_NATIVE": "0"})):
        runs[path] = mpirun(np, [SCRIPT, "switch", "shm"], timeout=300, env={**SWITCHES, **extra})
        counts = single_copy(runs[path], np)
        if path == "single":  # the threshold is the group's; every rank ran the same all-reduces that way
            assert len(set(counts.values())) == 1 and counts[0][0] == 100000 and counts[0][1] > 0, counts
        else:
            assert set(counts.values()) == {(0, 0)}, counts
    digests = {path: rank_lines(result.stdout, "DIGEST")[0] for path, result in runs.items()}
    assert len(set(digests.values())) == 1, digests
    assert ours() <= before


def test_a_rank_that_turns_single_copy_off_turns_it_off_for_its_host():
    result = mpirun(3, [SCRIPT, "switch", "shm", "light"], timeout=300,
                    env={**SWITCHES, "SHM_CHECKS_NO_CMA_ON_RANK": "2", "SMDDP_DEBUG": "1"})
    assert set(single_copy(result, 3).values()) == {(0, 0)}, result.output
    assert "smddp: single-copy all-reduce: off (local rank 2 offered none (SMDDP_SHM_CMA off" in result.stderr, \
        result.stderr


def test_a_rank_killed_during_single_copy_all_reduces_fails_the_job_and_leaves_nothing():
    before = ours()
    env = {**SWITCHES, "SHM_CHECKS_KILL_NUMEL": str(1 << 20), "SMDDP_TIMEOUT": "60"}
    result = mpirun(2, [SCRIPT, "kill", "shm"], timeout=120, env=env)
    assert result.returncode != 0, result.output
    assert "KILLING 1" in result.stdout and "UNREACHABLE" not in result.stdout, result.output
    assert ours() <= before, ours() - before


def test_a_kernel_that_refuses_cross_memory_attach_gets_the_segment_path():
    """Ranks of one user in two groups, without CAP_SYS_PTRACE: the kernel refuses each one's
    process_vm_readv of the other's memory. The set-up probe sees it, the host votes no, and the
    all-reduces take the segment path, with the bits of a job where the ranks may read each other.

    torchrun starts them (Open MPI's PMIx refuses ranks of another group); ``setpriv`` sets each
    rank's group and drops the capability, as a container without ``CAP_SYS_PTRACE`` would.
    """
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv (util-linux) to run the ranks in different groups")
    wrap = f"exec {setpriv} --bounding-set=-sys_ptrace --regid=$((4000 + LOCAL_RANK)) --clear-groups \"$@\""
    argv = ["sh", "-c", wrap, "sh", sys.executable, SCRIPT, "switch", "shm", "light"]
    refused = torchrun(2, argv, timeout=300, env={**SWITCHES, "SMDDP_DEBUG": "1"}, torchrun_args=["--no-python"])
    assert set(single_copy(refused, 2).values()) == {(0, 0)}, refused.output
    assert "single-copy all-reduce: off (local rank 0 cannot read or write local rank 1's memory " \
           "(Operation not permitted" in refused.output, refused.output
    allowed = torchrun(2, [SCRIPT, "switch", "shm", "light"], timeout=300, env=SWITCHES)
    counts = single_copy(allowed, 2)
    assert counts[0][1] > 0 and counts[0] == counts[1], allowed.output
    assert rank_lines(refused.stdout, "DIGEST")[0] == rank_lines(allowed.stdout, "DIGEST")[0]
