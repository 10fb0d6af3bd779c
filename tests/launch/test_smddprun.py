"""smddprun end to end: real mpirun, real processes, SageMaker's script with its imports unchanged.

Failure and Ctrl-C tests record every pid a job starts (ranks and a grandchild each) and
check that none is left running afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from smddp.launch import smddprun
from smddp.launch import smdistributed as alias_finder

from launchers import MPIRUN, RANKS, ROOT, base_env, run

_SCRIPT_SMDDPRUN = Path(sysconfig.get_path("scripts")) / "smddprun"
# The installed console script when there is one, so its entry point is exercised too.
SMDDPRUN = [str(_SCRIPT_SMDDPRUN)] if _SCRIPT_SMDDPRUN.exists() else [sys.executable, "-m", "smddp.launch"]
PY_LAUNCH = [sys.executable, "-m", "smddp.launch"]
EXAMPLES = ROOT / "examples"
HOLD = str(RANKS / "launch_hold.py")
PROBE = str(RANKS / "launch_probe.py")


def tagged(stdout: str, word: str) -> dict:
    """``{rank: rest}`` from ``[1,<rank>]<stdout>: WORD <rank> rest`` lines; the two ranks must agree."""
    found = {}
    for tag, rank, rest in re.findall(rf"^\[\d+,(\d+)\]<stdout>: {word} (\d+) (.*)$", stdout, re.M):
        assert tag == rank, f"output of rank {rank} tagged as rank {tag}"
        found[int(rank)] = rest
    return found


def state_dict_sha256(path: Path) -> str:
    """The examples' ``weights_sha256``, computed here from the saved checkpoint."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in torch.load(path, map_location="cpu").items():
        digest.update(name.encode())
        digest.update(bytes(tensor.detach().cpu().clone().untyped_storage()))
    return digest.hexdigest()


def assert_trained_in_sync(result, size: int, model_dir: Path) -> None:
    result.check()
    weights = tagged(result.stdout, "WEIGHTS")
    assert sorted(weights) == list(range(size)), result.output
    assert len(set(weights.values())) == 1, f"ranks ended with different weights: {weights}"
    assert state_dict_sha256(model_dir / "model.pt") == weights[0], "the checkpoint is not the trained model"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended


def recorded_pids(piddir: Path) -> list:
    return [int(p) for f in piddir.iterdir() for p in f.name.split(".")[1:]]


def kill_left(piddir: Path, waited: list) -> list:
    """Wait up to 15 s for ``waited`` to end; then SIGKILL whatever recorded in ``piddir`` is left and say which."""
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in waited) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in recorded_pids(piddir) if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def assert_none_left(piddir: Path, ranks: int) -> None:
    """Every rank and grandchild recorded in ``piddir`` has ended (waits up to 15 s for the kills to land)."""
    pids = recorded_pids(piddir)
    assert len(pids) == 2 * ranks, f"expected {ranks} ranks with a grandchild each, got pids {pids}"
    left = kill_left(piddir, pids)
    assert not left, f"processes left running: {left}"


def hold_job(launcher: str, ranks: int, piddir: Path, env=None) -> subprocess.Popen:
    """smddprun running ``launch_hold.py`` with no failing rank; returns once every rank has started."""
    proc = subprocess.Popen([*PY_LAUNCH, "--launcher", launcher, "-np", str(ranks), HOLD, str(piddir), "-1"],
                            env=base_env(env), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(piddir.iterdir())) < ranks and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(list(piddir.iterdir())) < ranks:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the ranks did not start\n{out}\n{err}")
    return proc


# ------------------------------------------------------------------ command line, no processes

def test_help_documents_every_option():
    result = run([*PY_LAUNCH, "--help"], timeout=30).check()
    for option in ("-np", "--hostfile", "-H", "-x VAR[=VAL]", "--mpi-args", "-m MODULE", "--dry-run",
                   "--launcher", "--no-alias", "SMDATAPARALLEL_LOCAL_RANK", "SMDDP_MPIRUN"):
        assert option in result.stdout, option


@pytest.mark.unit
@pytest.mark.parametrize("argv, program", [
    (["-np", "2", "train.py", "-np", "5", "--dry-run"], ["train.py", "-np", "5", "--dry-run"]),
    (["-x", "A=1", "-m", "pkg.train", "--lr", "1"], ["-m", "pkg.train", "--lr", "1"]),
    (["--dry-run", "--", "train.py", "-x"], ["train.py", "-x"]),
    (["--mpi-args", "--verbose", "train.py"], ["train.py"]),
])
def test_program_and_its_arguments_are_kept_apart(argv, program):
    assert smddprun.parse_args(argv).program == program


@pytest.mark.unit
def test_mpi_args_may_start_with_a_dash():
    assert smddprun.parse_args(["--mpi-args", "--verbose", "t.py"]).mpi_args == ["--verbose"]
    assert smddprun.parse_args(["--mpi-args", "--bind-to none -v", "t.py"]).mpi_args == ["--bind-to", "none", "-v"]


def test_dry_run_shows_the_openmpi_command(tmp_path):
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    result = run([*PY_LAUNCH, "-np", "3", "--dry-run", "-x", "FOO=1", "-x", "NCCL_DEBUG",
                  "--mpi-args", "--bind-to none", "missing_train.py", "--epochs", "1"],
                 timeout=30, env={"SMDDP_MPIRUN": MPIRUN, "NCCL_DEBUG": "INFO", "SMDDP_X": "1"}).check()
    cmd = result.stdout.strip()
    words = cmd.split()
    # One rendezvous address and port for the job, forwarded to every rank (SageMaker's MASTER_*).
    assert "MASTER_ADDR=127.0.0.1" in words and "-x MASTER_ADDR " in cmd and "-x MASTER_PORT " in cmd
    assert int(next(w for w in words if w.startswith("MASTER_PORT="))[len("MASTER_PORT="):]) > 0
    mpirun_at = next(i for i, w in enumerate(words) if w.endswith(("mpirun", "mpiexec")))
    assert words[mpirun_at + 1:mpirun_at + 3] == ["-np", "3"]
    assert "--tag-output" in words
    assert ("--allow-run-as-root" in words) == (os.geteuid() == 0)
    assert ("--oversubscribe" in words) == (3 > smddprun.physical_cores())
    assert words[0] == "FOO=1", cmd  # set here, forwarded by name below
    for name in ("FOO", "NCCL_DEBUG", "SMDDP_X", "PYTHONPATH", "OMP_NUM_THREADS"):
        assert f"-x {name} " in cmd, name
    assert cmd.endswith(f"--bind-to none {sys.executable} -m smddp.launch.bootstrap missing_train.py --epochs 1"), cmd
    assert re.search(r" --mca btl self,(sm|vader) ", cmd), cmd  # one host: shared memory only
    assert "Traceback" not in result.stderr  # nothing ran


@pytest.mark.parametrize("users", ["--mpi-args", "OMPI_MCA_btl"])
def test_dry_run_keeps_the_users_own_btl(users):
    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    args, env = (["--mpi-args", "--mca btl self,tcp"], {}) if users == "--mpi-args" else ([], {users: "self,tcp"})
    result = run([*PY_LAUNCH, "--launcher", "mpirun", "-np", "2", "--dry-run", *args, "train.py"],
                 timeout=30, env={"SMDDP_MPIRUN": MPIRUN, **env}).check()
    assert re.findall(r"--mca btl (\S+)", result.stdout) == (["self,tcp"] if args else []), result.stdout


def test_dry_run_speaks_mpich_to_hydra(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    result = run([*PY_LAUNCH, "-np", "4", "-H", "a:2,b:2", "--dry-run", "-x", "FOO=1", "train.py"],
                 timeout=30, env={"SMDDP_MPIRUN": str(fake)}).check()
    words = result.stdout.split()
    # Only FOO and the job's rendezvous point (the first host) are set across hosts.
    assert words[0] == "FOO=1" and words[1] == "MASTER_ADDR=a" and words[3] == str(fake), result.stdout
    assert words[2].startswith("MASTER_PORT=")
    assert words[4:8] == ["-n", "4", "-hosts", "a:2,b:2"]
    assert "-prepend-rank" in words and "FOO" in words[words.index("-genvlist") + 1].split(",")


def test_dry_run_of_local_processes():
    result = run([*PY_LAUNCH, "--launcher", "local", "-np", "2", "--dry-run", "train.py", "--lr", "1"],
                 timeout=30).check()
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        for assignment in (f"RANK={rank}", "WORLD_SIZE=2", f"LOCAL_RANK={rank}", "LOCAL_WORLD_SIZE=2",
                           "MASTER_ADDR=127.0.0.1", f"SMDATAPARALLEL_LOCAL_RANK={rank}"):
            assert f" {assignment} " in f" {line} ", (assignment, line)
        assert line.endswith("-m smddp.launch.bootstrap train.py --lr 1")


def test_local_job_fails_when_every_rank_fails_at_once(tmp_path):
    # Ranks that all exit before the supervisor's first look still make the job fail.
    import io

    from smddp.launch.local_job import LocalJob

    fail = [sys.executable, "-c", "import sys; sys.exit(3)"]
    for _ in range(3):
        out, err = io.BytesIO(), io.BytesIO()
        assert LocalJob([(fail, dict(os.environ)), (fail, dict(os.environ))]).run(out, err) == 3


def test_one_host_default_starts_no_mpirun_and_mpi4py_says_so(tmp_path):
    """On one host smddprun starts the ranks itself; a script's own mpi4py is refused, not a world of 1."""
    script = tmp_path / "uses_mpi4py.py"
    # Each rank says it started, then waits (10 s at most) for the other to say so before it
    # imports mpi4py: the first refusal makes smddprun stop the other rank, maybe before it printed.
    script.write_text(
        "import os, pathlib, time\nprint('STARTED', os.environ['RANK'], flush=True)\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "(here / ('started' + os.environ['RANK'])).touch()\n"
        "end = time.monotonic() + 10\n"
        "while len(list(here.glob('started*'))) < int(os.environ['WORLD_SIZE']) and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "from mpi4py import MPI\nprint('SIZE', MPI.COMM_WORLD.Get_size(), flush=True)\n")
    dry = run([*PY_LAUNCH, "-np", "2", "--dry-run", str(script)], timeout=30).check()
    assert "mpirun" not in dry.stdout and len(dry.stdout.strip().splitlines()) == 2, dry.output
    result = run([*PY_LAUNCH, "-np", "2", str(script)], timeout=60)
    assert result.returncode != 0, result.output
    assert sorted(re.findall(r"STARTED (\d)", result.stdout)) == ["0", "1"], result.output
    assert "SIZE" not in result.stdout, result.output
    assert "smddprun started without mpirun" in result.stderr and "--launcher mpirun" in result.stderr, result.output
    if MPIRUN is not None:
        under_mpi = run([*PY_LAUNCH, "--launcher", "mpirun", "-np", "2", str(script)], timeout=60).check()
        assert sorted(re.findall(r"SIZE (\d)", under_mpi.stdout)) == ["2", "2"], under_mpi.output


def test_clear_errors_instead_of_a_start(tmp_path):
    missing = run([*PY_LAUNCH, "--launcher", "mpirun", "-np", "2", "train.py"], timeout=30,
                  env={"SMDDP_MPIRUN": str(tmp_path / "no-mpirun")})
    assert missing.returncode == 2 and "SMDDP_MPIRUN" in missing.stderr, missing.output
    remote = run([*PY_LAUNCH, "--launcher", "local", "-H", "a:1,b:1", "train.py"], timeout=30)
    assert remote.returncode == 2 and "needs mpirun" in remote.stderr, remote.output
    no_program = run([*PY_LAUNCH, "-np", "2"], timeout=30)
    assert no_program.returncode == 2 and "no program" in no_program.stderr, no_program.output
    # Issue 53: an SMDDP_MPIRUN the system cannot run, and a MASTER_PORT that is no port, are named
    # (they were a traceback and int()'s message).
    garbage = tmp_path / "mpirun"
    garbage.write_bytes(b"\0\1 not a program")
    garbage.chmod(0o755)
    broken = run([*PY_LAUNCH, "--launcher", "mpirun", "-np", "2", "train.py"], timeout=30,
                 env={"SMDDP_MPIRUN": str(garbage)})
    assert broken.returncode == 2, broken.output
    assert f"smddprun: error: cannot run SMDDP_MPIRUN={garbage} (environment)" in broken.stderr, broken.output
    assert "Traceback" not in broken.output, broken.output
    port = run([*PY_LAUNCH, "--launcher", "local", "-np", "2", "train.py"], timeout=30, env={"MASTER_PORT": "http"})
    assert port.returncode == 2, port.output
    assert ("smddprun: error: MASTER_PORT=http (environment) is not a whole number: MASTER_PORT takes a whole number "
            "from 1 to 65535") in port.stderr, port.output


# ------------------------------------------------------------------ the import alias

@pytest.mark.unit
def test_alias_is_smddp_itself_and_can_be_turned_off():
    import smddp.torch.distributed as smddp_dist

    assert alias_finder.enable()
    try:
        import smdistributed.dataparallel.torch.distributed as sm_dist

        assert sm_dist is smddp_dist
        assert smddp_dist.__spec__.name == "smddp.torch.distributed"
    finally:
        alias_finder.disable()
    assert "smdistributed" not in sys.modules
    with pytest.raises(ImportError):
        import smdistributed  # noqa: F401


def _fake_smdistributed(root: Path, with_dataparallel: bool) -> Path:
    pkg = root / "smdistributed"
    (pkg / "modelparallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = 'fake install'\n")
    (pkg / "modelparallel" / "__init__.py").write_text("")
    if with_dataparallel:
        torch_dir = pkg / "dataparallel" / "torch"
        torch_dir.mkdir(parents=True)
        for init in (pkg / "dataparallel", torch_dir):
            (init / "__init__.py").write_text("")
        (torch_dir / "distributed.py").write_text("WHO = 'the real smdistributed'\n")
    return root


def test_a_real_smdistributed_is_not_shadowed(tmp_path):
    fake = _fake_smdistributed(tmp_path / "site", with_dataparallel=True)
    script = tmp_path / "which.py"
    script.write_text("import smdistributed.dataparallel.torch.distributed as d\nprint('WHICH', d.WHO)\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    result = run([*PY_LAUNCH, "--launcher", "local", "-np", "2", str(script)], timeout=60, env=env).check()
    assert result.stdout.count("WHICH the real smdistributed") == 2, result.output
    notes = [line for line in result.stderr.splitlines() if "real smdistributed.dataparallel is installed" in line]
    assert len(notes) == 1 and str(fake) in notes[0], result.stderr


def test_alias_fills_in_beside_smdistributed_modelparallel(tmp_path):
    """``python -m smddp.alias``, the opt-in outside smddprun, next to an install without dataparallel."""
    fake = _fake_smdistributed(tmp_path / "site", with_dataparallel=False)
    script = tmp_path / "mixed.py"
    script.write_text(
        "import smdistributed, smdistributed.modelparallel\n"
        "import smdistributed.dataparallel.torch.distributed as d\n"
        "import smddp.torch.distributed as s\n"
        "print('MIXED', smdistributed.REAL, d is s)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    result = run([sys.executable, "-m", "smddp.alias", str(script)], timeout=60, env=env).check()
    assert "MIXED fake install True" in result.stdout, result.output


# ------------------------------------------------------------------ real jobs

@pytest.mark.mpi
def test_every_rank_gets_its_environment_and_the_alias():
    result = run([*SMDDPRUN, "--launcher", "mpirun", "-np", "2", PROBE, "-np", "5", "--dry-run"], timeout=120).check()
    probes = {rank: json.loads(rest) for rank, rest in tagged(result.stdout, "PROBE").items()}
    assert sorted(probes) == [0, 1], result.output
    assert sorted(p["local_rank"] for p in probes.values()) == [0, 1]
    for report in probes.values():
        assert report["launcher"] == "openmpi" and report["size"] == 2
        assert report["SMDATAPARALLEL_LOCAL_RANK"] == str(report["local_rank"])
        assert report["argv"] == ["-np", "5", "--dry-run"] and report["argv0"] == PROBE
        assert report["same_distributed"] and report["same_ddp"]
        assert report["spec_name"] == "smddp.torch.distributed"


@pytest.mark.mpi
def test_unmodified_sagemaker_script_trains_on_2_ranks(tmp_path):
    result = run([*SMDDPRUN, "-np", "2", str(EXAMPLES / "train_smdistributed.py"), "--samples", "512",
                  "--model-dir", str(tmp_path)], timeout=240)
    assert_trained_in_sync(result, 2, tmp_path)
    assert result.stdout.count("Test set:") == 2 and "[1,1]<stdout>: Test set" not in result.stdout


@pytest.mark.mpi
def test_unmodified_sagemaker_script_trains_on_3_ranks(tmp_path):
    result = run([*PY_LAUNCH, "-np", "3", str(EXAMPLES / "train_smdistributed.py"), "--samples", "192",
                  "--epochs", "1", "--model-dir", str(tmp_path)], timeout=240)
    assert_trained_in_sync(result, 3, tmp_path)


def test_without_mpirun_smddprun_starts_the_ranks_itself(tmp_path):
    """A virtual environment without Open MPI and a PATH without mpirun: one host's job runs all the same."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=60)
    path = os.pathsep.join([str(venv / "bin"), "/usr/bin", "/bin"])
    if shutil.which("mpirun", path=path) or shutil.which("mpiexec", path=path):
        pytest.skip("this machine has an mpirun in /usr/bin")
    model_dir = tmp_path / "model"
    result = run([str(venv / "bin" / "python"), "-m", "smddp.launch", "-np", "2", str(EXAMPLES / "train_v2.py"),
                  "--samples", "512", "--model-dir", str(model_dir)], timeout=240, env={"PATH": path})
    assert_trained_in_sync(result, 2, model_dir)
    forced = run([str(venv / "bin" / "python"), "-m", "smddp.launch", "--launcher", "mpirun", "-np", "2", "x.py"],
                 timeout=60, env={"PATH": path})
    assert forced.returncode == 2 and "no mpirun found" in forced.stderr, forced.output


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), "local"])
def test_a_failing_rank_ends_the_whole_job(tmp_path, launcher):
    ranks = 3
    start = time.monotonic()
    result = run([*PY_LAUNCH, "--launcher", launcher, "-np", str(ranks), HOLD, str(tmp_path), "1"], timeout=60)
    assert result.returncode != 0, result.output
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr, result.output
    assert "smddp/launch/bootstrap.py" not in result.stderr  # the traceback shows the user's frames only
    assert_none_left(tmp_path, ranks)
    print(f"{launcher}: job ended {time.monotonic() - start:.1f} s after start")


@pytest.mark.mpi
def test_a_killed_mpirun_leaves_no_pmix_directory_behind(tmp_path):
    """mpirun killed outright cannot remove ``$TMPDIR/ompi.<its pid>``; smddprun does. Left,
    it made a later mpirun given the same pid fail at start (the PMIx listener)."""
    ranks, piddir, tmpdir = 2, tmp_path / "pids", tmp_path / "tmp"
    piddir.mkdir()
    tmpdir.mkdir()
    proc = hold_job("mpirun", ranks, piddir, {"TMPDIR": str(tmpdir)})
    try:
        rank_pid = recorded_pids(piddir)[0]
        mpirun_pid = int(Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        session = tmpdir / f"ompi.{mpirun_pid}"
        assert session.is_dir(), f"mpirun {mpirun_pid} has no {session}: {sorted(tmpdir.iterdir())}"
        os.kill(mpirun_pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out + err  # smddprun ends as mpirun did
    assert not session.exists(), f"{session} left behind: {sorted(p.name for p in session.iterdir())}"
    # The ranks follow the mpirun that started them; their own children (the script's
    # grandchildren here) are orphaned, not stopped: see docs/security.md.
    rank_pids = [int(f.name.split(".")[1]) for f in piddir.iterdir()]
    left = kill_left(piddir, rank_pids)
    assert not any(p in left for p in rank_pids), f"ranks left running: {left}"


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), "local"])
def test_ctrl_c_leaves_no_process(tmp_path, launcher):
    ranks = 2
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc = hold_job(launcher, ranks, piddir)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, out + err
    assert_none_left(piddir, ranks)
