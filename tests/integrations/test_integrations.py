"""The real libraries SageMaker scripts use, on smddp's world under ``smddprun -np 2``.

Hugging Face's Trainer and accelerate (with SageMaker's data-parallel switch and no init in the
script, under smddprun and in local mode, or with smddp initialized first), each trained to the
parameters torch's gloo gives under torchrun; Lightning (AWS's ``LightningEnvironment``
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

from launchers import RANKS, rank_lines, run, torchrun

ROOT = Path(__file__).resolve().parents[2]
SMDDPRUN = [sys.executable, "-m", "smddp.launch", "-np", "2"]

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def smddprun(script: str, *args: str, env: dict | None = None, prefix: str, launcher: str = "auto") -> dict:
    """Run a script under ``smddprun -np 2 --launcher LAUNCHER``; return each rank's JSON report."""
    result = run([*SMDDPRUN, "--launcher", launcher, str(RANKS / script), *args], timeout=240, env=env).check()
    reports = {rank: json.loads(body) for rank, body in rank_lines(result.stdout, prefix).items()}
    assert sorted(reports) == [0, 1], result.output
    return reports


def assert_trained_in_step(reports: dict) -> None:
    """Every rank started from the same weights and ended with the same, different, weights."""
    assert {r["initial"] for r in reports.values()} == {reports[0]["initial"]}
    assert {r["final"] for r in reports.values()} == {reports[0]["final"]}, reports
    assert reports[0]["final"] != reports[0]["initial"], "training changed nothing"


# What SageMaker's toolkit exports for distribution={"smdistributed": {"dataparallel": {"enabled": True}}},
# and what accelerate's SageMaker launcher adds to the job's environment.
SWITCH = {"SM_FRAMEWORK_PARAMS": json.dumps({
    "sagemaker_distributed_dataparallel_enabled": True, "sagemaker_instance_type": "ml.p4d.24xlarge",
    "sagemaker_distributed_dataparallel_custom_mpi_options": ""})}
ACCELERATE_SWITCH = {"ACCELERATE_USE_SAGEMAKER": "true", "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE": "DATA_PARALLEL"}
#: script: (its report's prefix, what its switch needs beyond SM_FRAMEWORK_PARAMS)
HF_SCRIPTS = {"hf_trainer.py": ("HF_TRAINER", {}), "accelerate_sagemaker.py": ("ACCELERATE", ACCELERATE_SWITCH)}


def needs_hugging_face() -> None:
    pytest.importorskip("transformers", reason="pip install 'smddp[integrations]'")
    pytest.importorskip("accelerate", reason="pip install 'smddp[integrations]'")


@pytest.fixture(scope="module")
def gloo_digests():
    """``script -> (initial, final)`` parameter digests of the script trained on torch's gloo (torchrun)."""
    found = {}

    def digests(script: str) -> tuple:
        if script not in found:
            prefix = HF_SCRIPTS[script][0]
            result = torchrun(2, [str(RANKS / script)], timeout=240, env={"ACCELERATE_USE_CPU": "true"}).check()
            reports = {rank: json.loads(body) for rank, body in rank_lines(result.stdout, prefix).items()}
            assert sorted(reports) == [0, 1] and {r["backend"] for r in reports.values()} == {"gloo"}, result.output
            assert_trained_in_step(reports)
            found[script] = (reports[0]["initial"], reports[0]["final"])
        return found[script]

    return digests


def assert_trained_as_gloo(reports: dict, reference: tuple) -> None:
    """Every rank trained on smddp's world of 2, on CPU, to the parameters torch's gloo gives."""
    assert sorted(reports) == [0, 1], reports
    for report in reports.values():
        assert (report["world"], report["backend"]) == (2, "smddp"), report
        assert report["wrapped"] == "DistributedDataParallel" and report["device"].startswith("cpu"), report
        assert (report["initial"], report["final"]) == reference, (reports, reference)


@pytest.mark.parametrize("script", sorted(HF_SCRIPTS))
def test_sagemaker_switch_trains_hugging_face_on_cpu_under_smddprun(script, gloo_digests):
    """No init in the script: SageMaker's switch has transformers/accelerate start smddp's group."""
    needs_hugging_face()
    prefix, extra = HF_SCRIPTS[script]
    reports = smddprun(script, env={**SWITCH, **extra}, prefix=prefix)
    assert_trained_as_gloo(reports, gloo_digests(script))


@pytest.mark.parametrize("script", sorted(HF_SCRIPTS))
def test_init_smddp_first_then_hugging_face_on_cpu(script, gloo_digests):
    """No switch: the script starts smddp's group itself, then asks transformers/accelerate for the CPU."""
    needs_hugging_face()
    reports = smddprun(script, "--init-first", prefix=HF_SCRIPTS[script][0])
    assert_trained_as_gloo(reports, gloo_digests(script))
    if script == "accelerate_sagemaker.py":
        for report in reports.values():
            assert report["refused"] == "Your assigned backend smddp is not available, please use gloo"


@pytest.mark.parametrize("script", sorted(HF_SCRIPTS))
def test_sagemaker_switch_trains_hugging_face_on_cpu_in_local_mode(script, gloo_digests, tmp_path):
    """The same scripts, unchanged, as a local-mode job of smddp.sagemaker with the smdistributed switch."""
    needs_hugging_face()
    from smddp.sagemaker import PyTorch

    prefix, extra = HF_SCRIPTS[script]
    est = PyTorch(entry_point=script, source_dir=str(RANKS), instance_type="local", instance_count=1,
                  environment=extra, max_run=240, output_path=str(tmp_path / "out"),
                  distribution={"smdistributed": {"dataparallel": {"enabled": True, "processes_per_host": 2}}})
    job = est.fit(logs=False)
    name = prefix.lower()
    with tarfile.open(Path(job.model_data).with_name("output.tar.gz")) as tar:
        reports = {int(m.name[len(name) + 1:-5]): json.load(tar.extractfile(m)) for m in tar.getmembers()
                   if m.name.startswith(f"{name}-")}
    assert_trained_as_gloo(reports, gloo_digests(script))


SWITCH_CHECK = """\
import json, os, sys
import torch, torch.distributed as dist
from smddp.launch import sagemaker_switch
os.environ.update(json.loads(sys.argv[1]))
report = {"applied": sagemaker_switch.apply(), "device": os.environ.get("ACCELERATE_TORCH_DEVICE")}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for ids in ([1], [0]):
    try:
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=ids)
        report[str(ids)] = "accepted"
    except ValueError as exc:
        report[str(ids)] = str(exc).split(" arguments")[0]
dist.destroy_process_group()
print("SWITCH", json.dumps(report))
"""


@pytest.mark.parametrize("case", ["switch", "switch, ACCELERATE_TORCH_DEVICE set", "no switch"])
def test_what_the_switch_changes_on_cpu(case):
    """Only this rank's local rank is taken as no device_ids; a device the user named is kept."""
    env = {"LOCAL_RANK": "1", "SMDATAPARALLEL_LOCAL_RANK": "1", **(SWITCH if "no" not in case else {})}
    if "set" in case:
        env["ACCELERATE_TORCH_DEVICE"] = "cpu:0"
    result = run([sys.executable, "-c", SWITCH_CHECK, json.dumps(env)], timeout=120).check()
    report = json.loads(result.stdout.split("SWITCH ", 1)[1])
    refused = "DistributedDataParallel device_ids and output_device"  # torch's own error
    expected = {"switch": (True, "cpu", "accepted"), "switch, ACCELERATE_TORCH_DEVICE set": (True, "cpu:0", "accepted"),
                "no switch": (False, None, refused)}[case]
    assert (report["applied"], report["device"], report["[1]"]) == expected, report
    assert report["[0]"] == refused, report


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
    result = run([sys.executable, str(RANKS / "lightning_ddp.py"), "--env", "launcher"], timeout=240).check()
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
    (src / "train.py").write_text((RANKS / "toolkit_env.py").read_text())
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
