"""What a job exposes on this host: its listening sockets, and what stays when its launcher dies.

Real jobs hold still (``scripts/exposure_probe.py``) while the test reads every listening TCP
socket of their processes from /proc (``/proc/net/tcp{,6}`` and each process's descriptors).
A job on one host must listen on loopback only, in every process smddp controls: the ranks
under every launcher (plain ``mpirun`` included, where smddp initializes MPI in the ranks), and
smddprun itself. Open MPI 5's daemon (``prterun``) and torchrun's agent are not smddp's and
cannot be put on loopback (docs/security.md); they are left out.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from smddp.job import mca, sockets

from launchers import MPIRUN, RANKS, ROOT, base_env, descendants, free_port

PROBE = str(RANKS / "exposure_probe.py")
SMDDPRUN = [sys.executable, "-m", "smddp.launch"]
Listener = Tuple[str, int]


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word in the host's (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening() -> Dict[int, Listener]:
    """``{socket inode: (address, port)}`` of every TCP socket of this host in LISTEN state."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    addr, port = fields[1].split(":")
                    found[int(fields[9])] = (_address(addr), int(port, 16))
    return found


def sockets_of(pid: int) -> Set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def listeners_of(pids: List[int]) -> Dict[int, List[Listener]]:
    table = listening()
    return {pid: sorted(table[i] for i in sockets_of(pid) if i in table) for pid in pids}


def exposed(found: Dict[int, List[Listener]]) -> Dict[int, List[Listener]]:
    out = {pid: [s for s in socks if not ipaddress.ip_address(s[0]).is_loopback] for pid, socks in found.items()}
    return {pid: socks for pid, socks in out.items() if socks}


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Held:
    """A job started in its own session, held by its ranks until :meth:`release`."""

    def __init__(self, cmd: List[str], ranks: int, tmp: Path, env: Dict[str, str] | None = None):
        self.piddir = tmp / "pids"
        self.piddir.mkdir()
        self.proc = subprocess.Popen([*cmd, PROBE, str(self.piddir)], env=base_env(env), cwd=str(ROOT),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while len(self.rank_pids()) < ranks and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if len(self.rank_pids()) < ranks:
            out, err = self.finish()
            pytest.fail(f"the ranks did not start\n--- stdout\n{out}\n--- stderr\n{err}")

    def rank_pids(self) -> List[int]:
        return sorted(int(p.name.split(".")[1]) for p in self.piddir.glob("rank*"))

    def processes(self) -> List[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def finish(self, timeout: float = 60) -> Tuple[str, str]:
        (self.piddir / "release").write_text("")
        try:
            return self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                for pid in self.processes():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.communicate()


def check_reduced(out: str, ranks: int) -> None:
    # torchrun's ranks share one stdout without line tags: two lines may run together.
    found = sorted(re.findall(r"REDUCED (\d+) (ok|WRONG)", out))
    assert found == [(str(r), "ok") for r in range(ranks)], out


def assert_loopback_only(job: Held, ranks: int, not_ours: Set[str]) -> str:
    """Every process of ``job`` but those named ``not_ours`` listens on loopback only; each rank
    listens. Returns the job's output (stdout, then stderr)."""
    pids = [p for p in job.processes() if comm(p) not in not_ours]
    found = listeners_of(pids)
    out, err = job.finish()
    assert job.proc.returncode == 0, out + err
    check_reduced(out, ranks)
    assert exposed(found) == {}, f"{exposed(found)}\n{found}"
    for pid in job.rank_pids():
        assert found.get(pid), f"rank {pid} listens nowhere: the probe saw nothing ({found})"
    return out + err


@pytest.mark.parametrize("ranks", [2, 3])
def test_smddprun_on_one_host_listens_on_loopback_only_launcher_included(tmp_path, ranks):
    # smddprun's default on one host: every process of the job, smddprun itself included.
    job = Held([*SMDDPRUN, "-np", str(ranks)], ranks, tmp_path)
    assert not any(comm(p) in ("prterun", "mpirun") for p in job.processes()), "the default started mpirun"
    assert_loopback_only(job, ranks, not_ours=set())


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_smddprun_over_mpirun_listens_on_loopback_only(tmp_path, ranks):
    # --launcher mpirun: the ranks and smddprun; Open MPI 5's daemon listens on every interface
    # (docs/security.md says why no option narrows it). Local mode starts its jobs this way.
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    job = Held([*SMDDPRUN, "--launcher", "mpirun", "-np", str(ranks)], ranks, tmp_path)
    assert_loopback_only(job, ranks, not_ours={"prterun", "mpirun"})


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_plain_mpirun_on_one_host_listens_on_loopback_only(tmp_path, ranks):
    # No option at all: smddp initializes MPI in the ranks, with shared memory only (smddp/job/mca.py).
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    job = Held([MPIRUN, "-np", str(ranks), "--oversubscribe", sys.executable], ranks, tmp_path)
    assert_loopback_only(job, ranks, not_ours={"prterun", "mpirun"})


def small_dev_shm(size: str) -> List[str]:
    """A command prefix that runs the rest in a mount namespace of its own with a ``size`` /dev/shm."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a /dev/shm of its own needs root and unshare")
    mount = f"mount -t tmpfs -o size={size} tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", mount], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    return ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$@"', "small-dev-shm"]


@pytest.mark.mpi
def test_plain_mpirun_in_a_4_mb_dev_shm_runs_over_loopback_only(tmp_path):
    # Open MPI's shared memory (16 MiB a rank) does not fit: with smddp's "self,sm" MPI_Init used
    # to fail. Its segments now go to the job's session directory (smddp/job/mca.py); smddp's own
    # plane does not fit either, so rank 0 warns once and the collectives run on MPI.
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    job = Held([*small_dev_shm("4m"), MPIRUN, "-np", "2", "--oversubscribe", sys.executable], 2, tmp_path)
    output = assert_loopback_only(job, 2, not_ours={"prterun", "mpirun"})
    assert output.count("shared-memory plane unavailable") == 1, output


@pytest.mark.mpi
def test_the_users_own_btl_wins_under_plain_mpirun(tmp_path):
    # The user asked for TCP: the ranks listen where Open MPI's TCP transport does, beyond loopback.
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    job = Held([MPIRUN, "-np", "2", "--oversubscribe", "--mca", "btl", "self,tcp", sys.executable], 2, tmp_path)
    found = listeners_of(job.rank_pids())
    out, err = job.finish()
    assert job.proc.returncode == 0, out + err
    check_reduced(out, 2)
    assert sorted(exposed(found)) == job.rank_pids(), found


@pytest.mark.unit
def test_mca_defaults_only_for_an_open_mpi_rank_on_one_host_without_a_btl_of_its_own(tmp_path):
    one_host = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_VERSION": "5.0.11",
                "OMPI_MCA_mca_base_param_files": str(tmp_path / "none.conf"), "HOME": str(tmp_path)}
    cases = [
        ({}, "self,sm"),
        ({"OMPI_VERSION": "4.1.6"}, "self,vader"),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, None),  # the job spans hosts
        ({"OMPI_MCA_btl": "self,tcp"}, "self,tcp"),  # the user's --mca btl or environment
        ({"OMPI_MCA_mca_base_param_files": str(tmp_path / "btl.conf")}, None),  # the user's parameter file
    ]
    (tmp_path / "btl.conf").write_text("# mine\nbtl = self,tcp\n")
    for change, expected in cases:
        env = {**one_host, **change}
        mca.one_host_defaults(env)
        assert env.get("OMPI_MCA_btl") == expected, change
    env = {"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}  # MPICH: not Open MPI's settings
    mca.one_host_defaults(env)
    assert "OMPI_MCA_btl" not in env


@pytest.mark.unit
def test_open_mpi_segments_move_only_where_they_fit_and_the_user_did_not_place_them(tmp_path):
    # (The move itself, where /dev/shm is small: test_plain_mpirun_in_a_4_mb_dev_shm_...)
    session = tmp_path / "ompi.1" / "1"
    (session / "0").mkdir(parents=True)
    rank = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_VERSION": "5.0.11",
            "OMPI_MCA_mca_base_param_files": str(tmp_path / "none.conf"), "HOME": str(tmp_path),
            "OMPI_FILE_LOCATION": str(session / "0")}
    placed = {**rank, "OMPI_MCA_btl_sm_segment_size": str(1 << 60), "OMPI_MCA_btl_sm_backing_directory": "/mine"}
    mca.one_host_defaults(placed)
    assert placed["OMPI_MCA_btl_sm_backing_directory"] == "/mine"  # the user's, even where nothing fits
    nowhere = {**rank, "OMPI_MCA_btl_sm_segment_size": str(1 << 60)}
    mca.one_host_defaults(nowhere)
    assert "OMPI_MCA_btl_sm_backing_directory" not in nowhere  # no directory holds it: Open MPI says so
    free = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    if free is not None and free.f_bavail * free.f_frsize >= 32 << 20:
        roomy = dict(rank)
        mca.one_host_defaults(roomy)
        assert "OMPI_MCA_btl_sm_backing_directory" not in roomy  # /dev/shm holds 16 MiB: left alone


def test_torchrun_ranks_listen_on_loopback_only(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = Held(cmd, 2, tmp_path)
    # torchrun's agent (its rendezvous and agent stores) is torch's: docs/security.md
    agent = {job.proc.pid}
    pids = [p for p in job.processes() if p not in agent]
    found = listeners_of(pids)
    out, err = job.finish()
    assert job.proc.returncode == 0, out + err
    check_reduced(out, 2)
    assert exposed(found) == {}, found
    assert all(found.get(pid) for pid in job.rank_pids()), found


def _other_interface() -> Tuple[str, str]:
    for _, name in socket.if_nameindex():
        try:
            address = sockets.interface_address(name)
        except Exception:  # noqa: BLE001 - no IPv4 address on it
            continue
        if not ipaddress.ip_address(address).is_loopback:
            return name, address
    pytest.skip("this host has no interface but loopback")


def test_socket_ifname_binds_the_store_and_gloo_to_that_interface(tmp_path):
    """Two ranks that look like a job across hosts (no LOCAL_WORLD_SIZE, MASTER_ADDR not loopback)."""
    name, address = _other_interface()
    piddir = tmp_path / "pids"
    piddir.mkdir()
    port = free_port()
    procs = []
    for rank in range(2):
        env = base_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": address, "MASTER_PORT": str(port),
                        "SMDDP_SOCKET_IFNAME": name, "SMDDP_CPU_PLANE": "gloo"})
        procs.append(subprocess.Popen([sys.executable, PROBE, str(piddir)], env=env, cwd=str(ROOT),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        deadline = time.monotonic() + 120
        while len(list(piddir.glob("rank*"))) < 2 and time.monotonic() < deadline and all(
                p.poll() is None for p in procs):
            time.sleep(0.1)
        found = listeners_of([p.pid for p in procs])
        (piddir / "release").write_text("")
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    check_reduced(outs[0][0] + outs[1][0], 2)
    store = [s for s in found[procs[0].pid] if s[1] == port]
    assert store == [(address, port)], found  # the store: that address only, not every interface
    for socks in found.values():
        assert socks and all(s[0] == address for s in socks), found  # gloo's devices too


def _job_files(pids: List[int]) -> Set[str]:
    """The /dev/shm files the ranks map (Open MPI's segments; smddp's are already unlinked)."""
    files = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith("(deleted)"):
                files.add(fields[5])
    return files


@pytest.mark.mpi
@pytest.mark.parametrize("victim", ["smddprun", "mpirun"])
def test_sigkill_of_the_launcher_leaves_nothing(tmp_path, victim):
    """SIGKILL to smddprun (or to its mpirun): within 10 s no rank, no listening port, no segment."""
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    job = Held([*SMDDPRUN, "--launcher", "mpirun", "-np", "2"], 2, tmp_path)
    try:
        everyone = job.processes()
        # By socket inode, not port: once the job's sockets are closed, another process may
        # listen on the same port (a busy machine hands ephemeral ports out again).
        table = listening()
        ports = {i: table[i] for p in everyone for i in sockets_of(p) if i in table}
        files = _job_files(job.rank_pids())
        assert files, "the ranks map no Open MPI segment: nothing to check"
        target = job.proc.pid if victim == "smddprun" else next(p for p in everyone if comm(p) == "prterun")
        os.kill(target, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (any(alive(p) for p in everyone) or any(map(os.path.exists, files))):
            time.sleep(0.1)
        left = [(p, comm(p)) for p in everyone if alive(p)]
        still = {ports[i] for i in set(listening()) & set(ports)}
        assert left == [], f"still running 10 s after SIGKILL of {victim}: {left}"
        assert still == set(), still
        assert [f for f in files if os.path.exists(f)] == [], files
        if victim == "mpirun":
            job.proc.communicate(timeout=10)
            assert job.proc.returncode == -signal.SIGKILL  # smddprun ends as mpirun ended
    finally:
        job.finish(timeout=10)
