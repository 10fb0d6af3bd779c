"""Local mode for real: smddp.sagemaker.PyTorch(instance_type="local") runs jobs on this machine.

Each job starts real processes through smddprun (or torchrun), and the training script reports
what it saw (rank, arguments, every SM_* variable, its channels) into SM_OUTPUT_DATA_DIR, which
local mode packs as output.tar.gz next to model.tar.gz, as SageMaker does. The notebook is
executed end to end. The default output directory is private to the user, and one it does not own is refused.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from smddp.errors import BackendUnavailableError, InvalidArgumentError, InvalidTypeError
from smddp.sagemaker import Estimator, JobFailedError, PyTorch

ROOT = Path(__file__).resolve().parents[2]

REPORT = """\
import argparse, json, os, sys
from smddp.job.topology import discover

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int)
parser.add_argument("--lr", type=float)
parser.add_argument("--optimizer")
parser.add_argument("--use-amp")
parser.add_argument("--layers")
parser.add_argument("--plane")
args = parser.parse_args()
topo = discover(os.environ)
plane = None
if args.plane:  # join the job's world and report the CPU plane its all-reduce took
    import torch, torch.distributed as tdist
    import smddp.torch.torch_smddp
    from smddp.torch import groups
    tdist.init_process_group(backend="smddp")
    total = torch.tensor([float(topo.rank + 1)])
    tdist.all_reduce(total)
    plane = [groups.current().engine.comms["cpu"].plane, total.item()]
    tdist.destroy_process_group()
try:
    import shared_lib
    dependency = shared_lib.VALUE
except ImportError:
    dependency = None
channels = {name: sorted(os.listdir(os.environ["SM_CHANNEL_" + name.upper()]))
            for name in json.loads(os.environ["SM_CHANNELS"])}
record = {
    "rank": topo.rank, "size": topo.size, "local_rank": topo.local_rank, "local_size": topo.local_size,
    "launcher": topo.launcher, "args": {k: v for k, v in vars(args).items() if k != "plane"},
    "argv": sys.argv[1:], "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith("SM_") or k in ("SMDATAPARALLEL_LOCAL_RANK", "MY_SETTING", "TRAINING_JOB_NAME",
                                            "SAGEMAKER_INSTANCE_TYPE")},
    "channels": channels, "config": sorted(os.listdir(os.environ["SM_INPUT_CONFIG_DIR"])), "dependency": dependency,
    "plane": plane,
}
with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"rank-{topo.rank}.json"), "w") as f:
    json.dump(record, f)
weights = f"weights-{os.environ['SM_CURRENT_HOST']}-{topo.local_rank}"
with open(os.path.join(os.environ["SM_MODEL_DIR"], weights), "w") as f:
    f.write(str(topo.rank))
if os.environ.get("FAIL_ON_RANK") == str(topo.rank):
    raise ValueError(f"bad shard on rank {topo.rank}")
"""

HYPERPARAMETERS = {"epochs": 3, "lr": 0.1, "optimizer": "adam", "use-amp": True, "layers": [1, 2]}
# As SageMaker's training toolkit passes them: sorted by name, each value through str().
ARGV = ["--epochs", "3", "--layers", "[1, 2]", "--lr", "0.1", "--optimizer", "adam", "--use-amp", "True"]


@pytest.fixture
def src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "report.py").write_text(REPORT)
    (src / "notes.txt").write_text("not a script\n")
    (tmp_path / "outside.py").write_text("print('outside')\n")
    return src


@pytest.fixture
def data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("1,2\n")
    (data / "b.csv").write_text("3,4\n")
    (tmp_path / "labels.csv").write_text("0\n1\n")
    return data


def members(archive):
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def records(job):
    model = Path(job.model_data.replace("file://", ""))
    found = members(model.with_name("output.tar.gz"))
    return {int(name[5:-5]): json.loads(body) for name, body in found.items() if name.startswith("rank-")}


def test_two_processes_get_sagemaker_environment(src, data, tmp_path, monkeypatch):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)  # a known region would add sagemaker_region
    out = tmp_path / "out"
    est = PyTorch(
        entry_point="report.py", source_dir=str(src), instance_type="local",
        hyperparameters=HYPERPARAMETERS, environment={"MY_SETTING": "on"}, max_run=120,
        distribution={"mpi": {"enabled": True, "processes_per_host": 2}}, output_path=f"file://{out}",
    )
    job = est.fit({"training": f"file://{data}", "test": str(tmp_path / "labels.csv")}, logs=False)

    assert job is est.latest_training_job and job.status == "Completed"
    assert est.model_data == f"file://{out}/{job.name}/output/model.tar.gz"
    assert set(members(out / job.name / "output" / "model.tar.gz")) == {"weights-algo-1-0", "weights-algo-1-1"}
    # SDK v2 sends every value JSON-encoded, with its sagemaker_* hyperparameters for the mpi form.
    assert job.describe()["HyperParameters"] == {
        "epochs": "3", "lr": "0.1", "optimizer": '"adam"', "use-amp": "true", "layers": "[1, 2]",
        "sagemaker_program": '"report.py"', "sagemaker_container_log_level": "20",
        "sagemaker_job_name": f'"{job.name}"', "sagemaker_submit_directory": f'"file://{src.resolve()}"',
        "sagemaker_mpi_enabled": "true", "sagemaker_mpi_num_of_processes_per_host": "2",
        "sagemaker_mpi_custom_mpi_options": '""',
    }

    got = records(job)
    assert sorted(got) == [0, 1]
    for rank, seen in got.items():
        env = seen["env"]
        assert (seen["size"], seen["local_rank"], seen["local_size"]) == (2, rank, 2)
        assert seen["args"] == {"epochs": 3, "lr": 0.1, "optimizer": "adam", "use_amp": "True", "layers": "[1, 2]"}
        assert seen["argv"] == ARGV and json.loads(env["SM_USER_ARGS"]) == ARGV
        assert json.loads(env["SM_HPS"]) == HYPERPARAMETERS  # types kept: int, float, bool, list
        assert (env["SM_HP_EPOCHS"], env["SM_HP_LR"], env["SM_HP_OPTIMIZER"]) == ("3", "0.1", "adam")
        assert (env["SM_HP_USE-AMP"], env["SM_HP_LAYERS"]) == ("true", "[1,2]")
        assert json.loads(env["SM_FRAMEWORK_PARAMS"]) == {
            "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 2,
            "sagemaker_mpi_custom_mpi_options": ""}
        assert json.loads(env["SM_CHANNELS"]) == ["test", "training"]
        assert seen["channels"] == {"training": ["a.csv", "b.csv"], "test": ["labels.csv"]}
        assert json.loads(env["SM_HOSTS"]) == ["algo-1"] and env["SM_CURRENT_HOST"] == "algo-1"
        assert env["SM_NUM_GPUS"] == "0" and env["SM_NUM_CPUS"] == str(os.cpu_count())
        assert env["SM_MODEL_DIR"].endswith("/algo-1/model")
        assert env["SM_OUTPUT_DATA_DIR"].endswith("/algo-1/output/data")
        assert env["TRAINING_JOB_NAME"] == job.name
        assert json.loads(env["SM_TRAINING_ENV"])["hyperparameters"] == HYPERPARAMETERS
        assert env["MY_SETTING"] == "on"
        assert env["SAGEMAKER_INSTANCE_TYPE"] == "local"  # as SageMaker's own local mode says
        assert seen["config"] == ["hyperparameters.json", "inputdataconfig.json", "resourceconfig.json"]
        assert Path(seen["cwd"]).resolve() == src.resolve()
    assert not Path(got[0]["env"]["SM_MODEL_DIR"]).parents[1].exists(), "the emulated hosts are removed"


def test_two_emulated_hosts(src, tmp_path):
    out = tmp_path / "out"
    lib = tmp_path / "libs" / "shared_lib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VALUE = 42\n")
    est = Estimator(
        entry_point=str(src / "report.py"), instance_type="local", instance_count=2, max_run=120,
        dependencies=[str(lib)],
        distribution={"smdistributed": {"dataparallel": {"enabled": True, "processes_per_host": 2}}},
        output_path=str(out),
    )
    job = est.fit(logs=False)
    assert est.model_data == str(out / job.name / "output" / "model.tar.gz")
    assert set(members(est.model_data)) == {f"weights-algo-{h}-{r}" for h in (1, 2) for r in (0, 1)}

    got = records(job)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, seen in got.items():
        env, host = seen["env"], rank // 2
        assert env["SM_CURRENT_HOST"] == f"algo-{host + 1}" and env["SM_CURRENT_HOST_RANK"] == str(host)
        assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"]
        assert (seen["size"], seen["local_rank"], seen["local_size"]) == (4, rank % 2, 2)
        assert env["SMDATAPARALLEL_LOCAL_RANK"] == str(rank % 2)
        assert f"/algo-{host + 1}/model" in env["SM_MODEL_DIR"]
        assert seen["argv"] == [] and json.loads(env["SM_CHANNELS"]) == []
        assert seen["dependency"] == 42


def test_torch_distributed_runs_under_torchrun(src, tmp_path):
    est = PyTorch(
        entry_point="report.py", source_dir=str(src), instance_type="local", max_run=120,
        hyperparameters={"epochs": 1, "plane": "yes"}, output_path=str(tmp_path / "out"),
        distribution={"torch_distributed": {"enabled": True, "processes_per_host": 2}},
    )
    got = records(est.fit(logs=False))
    assert sorted(got) == [0, 1]
    assert {seen["launcher"] for seen in got.values()} == {"torchrun"}
    assert [seen["plane"] for seen in got.values()] == [["shm", 3.0]] * 2  # shared memory under torchrun
    assert {seen["env"]["SM_CURRENT_HOST"] for seen in got.values()} == {"algo-1"}
    assert got[1]["args"]["epochs"] == 1


def test_failure_raises_with_the_scripts_error(src, tmp_path):
    est = PyTorch(
        entry_point="report.py", source_dir=str(src), instance_type="local", max_run=120,
        environment={"FAIL_ON_RANK": "1"}, output_path=str(tmp_path / "out"),
        distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
    )
    with pytest.raises(JobFailedError, match="ValueError: bad shard on rank 1") as caught:
        est.fit(logs=False)
    assert caught.value.status == "Failed"
    assert est.latest_training_job.status == "Failed"
    assert "bad shard on rank 1" in est.latest_training_job.describe()["FailureReason"]
    assert not (tmp_path / "out" / est.latest_training_job.name / "output" / "model.tar.gz").exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"entry_point": "missing.py"}, InvalidArgumentError, "entry_point='missing.py' not found"),
        ({"instance_type": "local_cpu"}, InvalidArgumentError, "unknown instance_type 'local_cpu'.*local, local_gpu"),
        ({"instance_type": None}, InvalidArgumentError, "instance_type is required"),
        ({"instance_count": 0}, InvalidArgumentError, "instance_count must be a positive integer"),
        ({"distribution": {"torch_distributed": {"enabled": True}, "mpi": {"enabled": True}}},
         InvalidArgumentError, "conflicting distribution options: torch_distributed and mpi"),
        ({"distribution": {"smdistributed": {"modelparallel": {"enabled": True}}}},
         InvalidArgumentError, "'modelparallel'.*valid keys: dataparallel"),
        ({"distribution": {"horovod": {"enabled": True}}},
         InvalidArgumentError, "'horovod'.*valid keys: smdistributed, mpi, torch_distributed, pytorchddp"),
        ({"distribution": {"mpi": {"enabled": True, "processes_per_host": 0}}},
         InvalidArgumentError, "processes_per_host'\\] must be a positive integer"),
        ({"distribution": {"mpi": {"enabled": "yes"}}}, InvalidTypeError, "must be True or False"),
        ({"distribution": ["mpi"]}, InvalidTypeError, "distribution must be a dict"),
        ({"hyperparameters": {"learning rate": 1}}, InvalidArgumentError, "cannot be a command-line option"),
        ({"dependencies": ["no/such/lib"]}, InvalidArgumentError, "dependency 'no/such/lib' does not exist"),
        ({"entry_point": "../outside.py"}, InvalidArgumentError, "must be inside source_dir"),
        ({"entry_point": "notes.txt"}, InvalidArgumentError, "must be a Python script"),
        ({"hyperparameters": {"seed": object()}}, InvalidTypeError, "hyperparameters must be JSON values"),
        ({"environment": {"THREADS": 4}}, InvalidTypeError, "environment must map strings to strings"),
    ],
)
def test_bad_arguments_fail_at_construction(src, kwargs, error, message):
    arguments = {"entry_point": "report.py", "source_dir": str(src), "instance_type": "local", **kwargs}
    with pytest.raises(error, match=message):
        PyTorch(**arguments)


@pytest.mark.unit
@pytest.mark.parametrize(
    "inputs, error, message",
    [
        ("s3://bucket/train", InvalidArgumentError, "local mode reads and writes local files only"),
        ({"training": "/no/such/data"}, InvalidArgumentError, "does not exist"),
        ({"training": 3}, InvalidTypeError, "must be a path"),
    ],
)
def test_bad_inputs_fail_before_anything_runs(src, tmp_path, inputs, error, message):
    est = PyTorch(entry_point="report.py", source_dir=str(src), instance_type="local",
                  output_path=str(tmp_path / "out"), max_run=60)
    with pytest.raises(error, match=message):
        est.fit(inputs)
    assert est.latest_training_job is None
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_remote_job_needs_a_role_before_anything_is_uploaded(src):
    est = PyTorch(entry_point="report.py", source_dir=str(src), instance_type="ml.p4d.24xlarge")
    with pytest.raises(InvalidArgumentError, match="role is required"):
        est.fit("s3://bucket/train")
    assert est.latest_training_job is None
    with pytest.raises(InvalidArgumentError, match="call fit"):
        est.model_data  # noqa: B018


def test_importing_the_estimator_loads_neither_the_sdk_nor_torch():
    """Local mode works with smddp alone; smddp.sagemaker knows nothing of collectives."""
    from launchers import python

    modules = ["smddp.sagemaker", "smddp.sagemaker._local", "smddp.sagemaker._remote", "smddp.sagemaker._entry",
               "smddp.sagemaker._package", "smddp.sagemaker._images"]
    probe = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}];"
             "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'sagemaker', 'torch', 'boto3'}),"
             " sorted(m for m in sys.modules if m.startswith('smddp.torch')))")
    result = python(["-c", probe], timeout=60).check()
    assert "LOADED [] []" in result.stdout


def test_local_gpu_needs_a_gpu(src):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    est = PyTorch(entry_point="report.py", source_dir=str(src), instance_type="local_gpu", max_run=60)
    with pytest.raises(BackendUnavailableError, match="local_gpu"):
        est.fit()


@pytest.mark.gpu
def test_local_gpu_runs_one_process_per_gpu(src, tmp_path):
    import torch

    count = torch.cuda.device_count()
    est = PyTorch(entry_point="report.py", source_dir=str(src), instance_type="local_gpu", max_run=120,
                  output_path=str(tmp_path / "out"))
    got = records(est.fit(logs=False))
    assert sorted(got) == list(range(count))
    assert {seen["env"]["SM_NUM_GPUS"] for seen in got.values()} == {str(count)}
    assert {seen["env"]["SM_CURRENT_INSTANCE_TYPE"] for seen in got.values()} == {"local_gpu"}


def test_quickstart_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    notebook = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    env_role = os.environ.pop("SMDDP_SAGEMAKER_ROLE", None)  # the SageMaker cell must skip here
    try:
        client = nbclient.NotebookClient(
            notebook, timeout=240, kernel_name="python3",
            resources={"metadata": {"path": str(ROOT / "notebooks")}},
        )
        client.execute()
    finally:
        if env_role is not None:
            os.environ["SMDDP_SAGEMAKER_ROLE"] = env_role
    text = "\n".join(
        out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
    )
    images = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert "completed in" in text and "processes: 2" in text
    assert "Skipped the SageMaker job" in text
    assert len(images) == 1, "the loss plot"


# ---------------------------------------------------------------------------- local mode's output
SAVE = """\
import os
with open(os.path.join(os.environ["SM_MODEL_DIR"], "weights"), "w") as f:
    f.write("42")
"""


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of this test's, as ``tempfile.gettempdir()`` and ``$TMPDIR``."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    src = tmp_path / "src"
    src.mkdir()
    (src / "save.py").write_text(SAVE)
    return tmp, src / "save.py"


def _estimator(script: Path):
    from smddp.sagemaker import PyTorch

    return PyTorch(entry_point=str(script), instance_type="local", max_run=120)


def test_local_mode_default_output_is_private_to_the_user(private_tmp):
    tmp, script = private_tmp
    default = tmp / f"smddp-local-{os.getuid()}"
    default.mkdir(mode=0o755)  # left by an older run, as the old default was made
    os.chmod(default, 0o755)
    old = os.umask(0o027)
    try:
        est = _estimator(script)
        job = est.fit(logs=False)
    finally:
        os.umask(old)
    model = Path(est.model_data)
    assert model == default / job.name / "output" / "model.tar.gz", est.model_data
    assert oct(os.stat(default).st_mode & 0o777) == oct(0o700)
    assert os.stat(default).st_uid == os.getuid()
    # The archive's mode is the umask's (0o666 & ~0o027), not a fixed 0o644.
    assert oct(os.stat(model).st_mode & 0o777) == oct(0o640)


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
@pytest.mark.parametrize("planted", ["other user", "link"])
def test_local_mode_refuses_a_default_output_it_does_not_own(private_tmp, planted):
    import smddp

    tmp, script = private_tmp
    default = tmp / f"smddp-local-{os.getuid()}"
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    if planted == "other user":
        default.mkdir(mode=0o777)
        os.chown(default, 65534, 65534)  # nobody
    else:
        default.symlink_to(elsewhere, target_is_directory=True)
    est = _estimator(script)
    with pytest.raises(smddp.UnsafePathError) as caught:
        est.fit(logs=False)
    message = str(caught.value)
    assert isinstance(caught.value, PermissionError)
    assert str(default) in message and "output_path=" in message and "TMPDIR" in message, message
    assert ("belongs to user id 65534" if planted == "other user" else "is a link") in message, message
    # Nothing was written there, and no job ran.
    assert list(elsewhere.iterdir()) == [] and (planted == "link" or list(default.iterdir()) == [])
    assert not [p for p in tmp.iterdir() if p.name.startswith("smddp-") and p != default]
