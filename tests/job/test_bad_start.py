"""A bad start never hangs: a rank that cannot start ends the whole job within seconds, naming what to change.

Real jobs, under the launcher where each case used to hang (issue 53): a rank that raised inside
``init_process_group`` after MPI started waited in ``MPI_Finalize`` while the others waited for it
(a ``MASTER_PORT`` another job holds, a mistyped ``SMDDP_SOCKET_IFNAME``, ``SMDDP_TIMEOUT=0``); and
an ``SMDDP_SHM_DIR`` the job cannot write left the segment's creator going on without the plane
while its host-mates waited 30 minutes for the segment's name. Each job must end well within
:data:`LIMIT_S`, name the variable, and leave no process and no segment behind. The values the
parser refuses without starting a job are tested in-process (``test_knobs.py``, ``test_topology.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from smddp.errors import InvalidArgumentError

from launchers import MPIRUN, RANKS, mpirun, rank_lines, run, untagged

SCRIPT = str(RANKS / "bad_start.py")
#: What "within seconds" means here, on a loaded 2-core VM (each job starts two Pythons with torch).
LIMIT_S = 30
SMDDPRUN = [sys.executable, "-m", "smddp.launch"]



def left_behind(token: str) -> list:
    """The processes whose command line carries ``token`` (every process the job started does)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if token.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture
def segments():
    """An ``SMDDP_SHM_DIR`` of the test's own: what smddp leaves in it can be seen."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    where = Path(tempfile.mkdtemp(prefix="smddp-test-bad-start-", dir=shm))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def job(launch, env: dict, shm_dir: Path):
    """Run ``launch(args, env)`` on the rank script; returns the result and its seconds.

    Asserts what every case shares: it ended within :data:`LIMIT_S` (the helper fails the test if
    not), and left no process and no segment behind.
    """
    token = f"bad-start-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    result = launch([SCRIPT, token], {"SMDDP_SHM_DIR": str(shm_dir), **env})
    took = time.monotonic() - started
    assert took < LIMIT_S, result.output
    time.sleep(0.2)  # an aborted rank's last moments
    assert left_behind(token) == [], (left_behind(token), result.output)
    assert [p.name for p in shm_dir.iterdir()] == [], result.output
    return result, took


def under_mpirun(args, env):
    return mpirun(2, args, timeout=LIMIT_S, env=env)


def aborted_naming(result, *words: str) -> None:
    """The job failed, rank 0's error names ``words``, and the job ended through MPI_Abort."""
    out = untagged(result.output)
    assert result.returncode != 0, result.output
    assert "STARTED" not in out, result.output
    for word in words:
        assert word in out, (word, result.output)
    assert "ending every rank of the job (MPI_Abort)" in out, result.output


@pytest.mark.mpi
def test_a_master_port_another_job_holds_ends_the_mpirun_job(segments):
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result, took = job(under_mpirun, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, segments)
    aborted_naming(result, f"MASTER_PORT={port}: the job's store cannot listen on 127.0.0.1:{port}")


@pytest.mark.mpi
def test_a_mistyped_socket_interface_ends_the_mpirun_job(segments):
    result, took = job(under_mpirun, {"SMDDP_SOCKET_IFNAME": "eht0"}, segments)
    aborted_naming(result, "SMDDP_SOCKET_IFNAME=eht0 (environment) is not an interface here (this host has: lo")


@pytest.mark.mpi
def test_a_zero_timeout_ends_the_mpirun_job_naming_it(segments):
    # Every rank refuses it before MPI starts; mpirun ends the job on the first non-zero exit.
    result, took = job(under_mpirun, {"SMDDP_TIMEOUT": "0"}, segments)
    out = untagged(result.output)
    assert result.returncode != 0 and "STARTED" not in out, result.output
    assert "SMDDP_TIMEOUT=0 (environment) is not above 0 (write none for no deadline)" in out, result.output


# ---------------------------------------------------------------------------- a directory the job cannot write
def unwritable(where: Path):
    """A command prefix under which ``where`` cannot be written, and the words the warning has for it.

    As root (which writes any directory) a read-only tmpfs is mounted there in a mount namespace of
    the job's own, which ends with it; as another user the directory loses its write permission.
    Either way it has room, so the failure is the open's (``O_CREAT | O_EXCL``), not a lack of space.
    """
    if os.geteuid() != 0:
        where.chmod(0o555)
        return [], "this user cannot create files in"
    probe = ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o ro,size=64m smddp-test {where} && test ! -w {where}"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("root, but no mount namespace here (unshare --mount) to make a read-only SMDDP_SHM_DIR in")
    mount = f'mount -t tmpfs -o ro,size=64m smddp-test {where} && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", mount, "sh"], "is read-only (Read-only file system)"


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), "smddprun"])
def test_an_shm_dir_the_job_cannot_write_is_every_ranks_fallback(launcher, segments):
    """The segment's creator cannot make it: it tells its host-mates, and every rank falls back at once."""
    prefix, why = unwritable(segments)
    if launcher == "mpirun":
        assert MPIRUN
        command = [*prefix, MPIRUN, "-np", "2", "--oversubscribe", sys.executable]
    else:
        command = [*prefix, *SMDDPRUN, "-np", "2"]
    result, took = job(lambda args, env: run([*command, *args], timeout=LIMIT_S, env=env), {}, segments)
    result.check()
    assert sorted(rank_lines(result.stdout, "EXACT")) == [0, 1], result.output
    out = untagged(result.output)
    assert f"SMDDP_SHM_DIR={segments} (environment) {why}" in out, result.output
    assert out.count("shared-memory plane unavailable") == 1, result.output
    assert "--shm-size" not in out and "enlarge" not in out, result.output  # the advice fits the reason


@pytest.mark.unit
def test_a_mistyped_interface_is_named_before_gloo_or_mpirun_meet_it():
    """Under torchrun gloo's own words came first (*Unable to find address for: eht0*), under smddprun's
    mpirun prterun's (*No network interfaces were found*): both now smddp's, naming the variable."""
    from smddp.job import sockets
    from smddp.launch.mpi_job import MPI, network_args

    named = r"^SMDDP_SOCKET_IFNAME=eht0 \(environment\) is not an interface here \(this host has: .*lo"
    with pytest.raises(InvalidArgumentError, match=named):
        sockets.gloo_binding(True, {"SMDDP_SOCKET_IFNAME": "eht0"})
    with pytest.raises(InvalidArgumentError, match=named):
        network_args(MPI("mpirun", "openmpi", 5), True, {"SMDDP_SOCKET_IFNAME": "eht0"})
    assert sockets.gloo_binding(True, {"SMDDP_SOCKET_IFNAME": "lo"}) == [("interface", "lo")]
