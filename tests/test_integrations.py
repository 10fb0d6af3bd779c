"""The real libraries SageMaker scripts use, on smddp's world under ``smddprun -np 2``.

Hugging Face's Trainer, accelerate's SageMaker switch, Lightning (AWS's ``LightningEnvironment``
pattern and Lightning's ``MPIEnvironment``), AWS's training toolkit in local mode and the
``env://`` init of AWS's examples. The libraries come from ``pip install 'smddp[integrations]'``
(part of ``[dev]``); a test skips, naming the package, only where its library is missing.
Models are built from configs and data is made in the scripts: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from launchers import rank_lines, run

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
SMDDPRUN = [sys.executable, "-m", "smddp.launch", "-np", "2"]

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def smddprun(script: str, *args: str, env: dict | None = None, prefix: str, launcher: str = "auto") -> dict:
    """Run a script under ``smddprun -np 2 --launcher LAUNCHER``; return each rank's JSON report."""
    result = run([*SMDDPRUN, "--launcher", launcher, str(SCRIPTS / script), *args], timeout=240, env=env).check()
    reports = {rank: json.loads(body) for rank, body in rank_lines(result.stdout, prefix).items()}
    assert sorted(reports) == [0, 1], result.output
    return reports


def assert_trained_in_step(reports: dict) -> None:
    """Every rank started from the same weights and ended with the same, different, weights."""
    assert {r["initial"] for r in reports.values()} == {reports[0]["initial"]}
    assert {r["final"] for r in reports.values()} == {reports[0]["final"]}, reports
    assert reports[0]["final"] != reports[0]["initial"], "training changed nothing"


def test_hf_trainer_on_smddp_world():
    pytest.importorskip("transformers", reason="pip install 'smddp[integrations]'")
    pytest.importorskip("accelerate", reason="pip install 'smddp[integrations]'")
    reports = smddprun("hf_trainer.py", prefix="HF_TRAINER")
    for report in reports.values():
        assert (report["world"], report["backend"]) == (2, "smddp")
        assert report["wrapped"] == "DistributedDataParallel"
    assert_trained_in_step(reports)


def test_accelerate_sagemaker_switch_initializes_smddp():
    pytest.importorskip("transformers", reason="pip install 'smddp[integrations]'")
    pytest.importorskip("accelerate", reason="pip install 'smddp[integrations]'")
    # What SageMaker's toolkit exports for distribution={"smdistributed": {"dataparallel": {"enabled": True}}}.
    framework = {"sagemaker_distributed_dataparallel_enabled": True, "sagemaker_instance_type": "ml.p4d.24xlarge",
                 "sagemaker_distributed_dataparallel_custom_mpi_options": ""}
    reports = smddprun("accelerate_sagemaker.py", env={"SM_FRAMEWORK_PARAMS": json.dumps(framework)},
                       prefix="ACCELERATE")
    for rank, report in reports.items():
        assert report["sagemaker_dp"] is True
        assert report["initialized"] and (report["backend"], report["world"]) == ("smddp", 2)
        assert report["env_rank"] == rank and report["sum"] == 3.0
        # The only failure: accelerate's set_device takes the local rank modulo the CUDA device count (0 here).
        assert report["error"] == "ZeroDivisionError: integer modulo by zero", report
        assert report["where"].endswith(("accelerate/state.py:set_device", "accelerate\\state.py:set_device"))


def test_deepspeed_comm_on_smddp_world():
    # Not in [integrations] (see docs/integrations.md); its first init on CPU compiles a C++ op.
    pytest.importorskip("deepspeed", reason="pip install -c constraints.txt --no-build-isolation deepspeed")
    reports = smddprun("deepspeed_comm.py", prefix="DEEPSPEED")
    for report in reports.values():
        assert (report["world"], report["backend"]) == (2, "smddp")
        assert report["sum"] == [1.0 + 2.0, 10.0 + 20.0]
        assert report["gathered"] == [[float(r), float(r * r)] for r in range(2)]
        assert report["broadcast"] == 1.0 + 7


@pytest.mark.parametrize("environment", ["aws", "mpi"])
def test_lightning_ddp_strategy(environment):
    pytest.importorskip("lightning", reason="pip install 'smddp[integrations]'")
    # Lightning's MPIEnvironment reads the job from mpi4py: it needs mpirun beneath smddprun.
    launcher = "mpirun" if environment == "mpi" else "auto"
    reports = smddprun("lightning_ddp.py", "--env", environment, prefix="LIGHTNING", launcher=launcher)
    expected = {"aws": "LightningEnvironment", "mpi": "MPIEnvironment"}[environment]
    for rank, report in reports.items():
        assert (report["world"], report["backend"], report["global_rank"]) == (2, "smddp", rank)
        assert report["environment"] == expected and report["plane"] == "shm"
    assert_trained_in_step(reports)


def test_lightning_own_launcher_gets_the_shm_plane():
    """A plain ``python script.py``: Lightning's launcher starts rank 1 itself; no MPI anywhere."""
    pytest.importorskip("lightning", reason="pip install 'smddp[integrations]'")
    result = run([sys.executable, str(SCRIPTS / "lightning_ddp.py"), "--env", "launcher"], timeout=240).check()
    reports = {rank: json.loads(body) for rank, body in rank_lines(result.stdout, "LIGHTNING").items()}
    assert sorted(reports) == [0, 1], result.output
    for rank, report in reports.items():
        assert (report["world"], report["backend"], report["global_rank"]) == (2, "smddp", rank)
        assert report["plane"] == "shm", report
    assert_trained_in_step(reports)


def test_toolkit_environment_in_local_mode(tmp_path):
    pytest.importorskip("sagemaker_training", reason="pip install 'smddp[integrations]'")
    pytest.importorskip("transformers", reason="pip install 'smddp[integrations]'")
    from smddp.sagemaker import PyTorch

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text((SCRIPTS / "toolkit_env.py").read_text())
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.csv").write_text("1,2\n")
    (tmp_path / "labels.csv").write_text("0\n")
    hyperparameters = {"epochs": 2, "lr": 0.5, "model-name": "tiny", "layers": [2, 2]}
    est = PyTorch(
        entry_point="train.py", source_dir=str(src), instance_type="local", instance_count=2,
        hyperparameters=hyperparameters, max_run=240, output_path=str(tmp_path / "out"),
        distribution={"smdistributed": {"dataparallel": {
            "enabled": True, "processes_per_host": 1, "custom_mpi_options": "-x SMDDP_TEST_MARK=42"}}},
    )
    job = est.fit({"training": str(data), "labels": str(tmp_path / "labels.csv")}, logs=False)

    with tarfile.open(Path(job.model_data).with_name("output.tar.gz")) as tar:
        got = {int(m.name[8:-5]): json.load(tar.extractfile(m)) for m in tar.getmembers()
               if m.name.startswith("toolkit-")}
    assert sorted(got) == [0, 1]
    for rank, seen in got.items():
        host = f"algo-{rank + 1}"
        assert seen["differs"] == {} and seen["compared"] > 30, "the toolkit exports what local mode set"
        assert seen["hosts"] == ["algo-1", "algo-2"] and seen["current_host"] == host
        assert seen["is_master"] is (rank == 0)
        assert seen["hyperparameters"] == hyperparameters
        assert seen["user_args"] == seen["argv"] == [
            "--epochs", "2", "--layers", "[2, 2]", "--lr", "0.5", "--model-name", "tiny"]
        assert seen["channels"] == {"training": ["part-0.csv"], "labels": ["labels.csv"]}
        assert all(path.endswith(f"/{host}/input/data/{name}") for name, path in seen["channel_dirs"].items())
        assert seen["model_dir"] == seen["sm_model_dir"] and seen["model_dir"].endswith(f"/{host}/model")
        assert (seen["num_gpus"], seen["num_cpus"]) == (0, os.cpu_count())
        assert seen["job_name"] == job.name and seen["user_entry_point"] == "train.py"
        assert seen["current_instance_type"] == "local"
        assert seen["framework_params"] == {
            "sagemaker_distributed_dataparallel_enabled": True, "sagemaker_instance_type": "local",
            "sagemaker_distributed_dataparallel_custom_mpi_options": "-x SMDDP_TEST_MARK=42"}
        assert seen["sagemaker_dp"] is True, "transformers' is_sagemaker_dp_enabled() reads SM_FRAMEWORK_PARAMS"
        assert seen["mark"] == "42", "custom_mpi_options reach mpirun"
        # AWS's examples' env:// init on the variables every process gets.
        assert (seen["torch_rank"], seen["world"], seen["local_rank"]) == (rank, 2, 0)
        assert seen["backend"] == "smddp" and seen["grad_ok"] is True


TOOLKIT_VIEW = """\
import json
from sagemaker_training.environment import Environment
env = Environment()
print("TOOLKIT", json.dumps({"vars": env.to_env_vars(), "args": env.to_cmd_args()}))
"""


@pytest.mark.parametrize("form", ["smdistributed", "mpi", "none"])
def test_container_is_what_the_toolkit_reads(tmp_path, form):
    """One host's folder and SM_* values against the toolkit reading that folder, for several forms."""
    pytest.importorskip("sagemaker_training", reason="pip install 'smddp[integrations]'")
    from smddp.sagemaker import _distribution
    from smddp.sagemaker._container import Container, job_hyperparameters

    distribution = {"smdistributed": {"smdistributed": {"dataparallel": {"enabled": True}}},
                    "mpi": {"mpi": {"enabled": True, "processes_per_host": 3, "custom_mpi_options": "-x A=1"}},
                    "none": None}[form]
    dist = _distribution.parse(distribution)
    user = {"n": 4, "opts": {"b": 2, "a": "x"}, "flag": False, "name": "run 1", "nothing": None, "ratio": 0.25}
    framework = _distribution.framework_hyperparameters(dist, "ml.p4d.24xlarge", "sub/train.py", 3, "eu-west-1")
    hps = job_hyperparameters(user, framework, "job-7", "file:///code")
    container = Container(
        base_dir=tmp_path / "algo-2", job_name="job-7", host="algo-2", hosts=["algo-1", "algo-2", "algo-3"],
        instance_type="ml.p4d.24xlarge", hyperparameters=hps, channels=["eval", "train"], num_gpus=0,
        processes_per_host=3, entry_script=tmp_path / "sub" / "train.py", source_dir=tmp_path,
    )
    container.write_config()
    for name in ("eval", "train"):
        (container.base_dir / "input" / "data" / name).mkdir()
    ours = container.environment()
    result = run([sys.executable, "-c", TOOLKIT_VIEW], timeout=60, cwd=str(tmp_path),
                 env={"SAGEMAKER_BASE_DIR": str(container.base_dir), "TRAINING_JOB_NAME": "job-7"}).check()
    toolkit = json.loads(result.stdout.split("TOOLKIT ", 1)[1])
    differs = {k: (v, ours.get(k)) for k, v in toolkit["vars"].items() if ours.get(k) != v}
    assert differs == {}
    assert json.loads(ours["SM_USER_ARGS"]) == toolkit["args"] == [
        "--flag", "False", "-n", "4", "--name", "run 1", "--nothing", "", "--opts", "a=x,b=2", "--ratio", "0.25"]
    assert json.loads(ours["SM_HPS"]) == user
    expected = {k: v for k, v in framework.items() if k not in (
        "sagemaker_program", "sagemaker_container_log_level", "sagemaker_region")}
    assert json.loads(ours["SM_FRAMEWORK_PARAMS"]) == expected
    assert (ours["SM_MODULE_NAME"], ours["SM_USER_ENTRY_POINT"]) == ("sub/train", "sub/train.py")
