"""smddp.sagemaker.PyTorch against a real moto server on 127.0.0.1: the jobs SageMaker would get.

The SDK v3 path runs for real (ModelTrainer uploads, CreateTrainingJob, DescribeTrainingJob,
CloudWatch logs); only AWS is fake, and nothing leaves loopback (a guard refuses any other
host name, which also proves the SDK's telemetry is off). The uploaded code is downloaded back
and checked by running it: the smddp wheel installs with pip and the job's entry script runs
the user's script with the hyperparameters; smddp's MPI driver builds the whole job's mpirun.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sagemaker.train", reason="the SageMaker SDK v3 is not installed: pip install 'smddp[sagemaker]'")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")

import boto3  # noqa: E402

import smddp  # noqa: E402
from smddp.errors import InvalidArgumentError  # noqa: E402
from smddp.sagemaker import JobFailedError, PyTorch  # noqa: E402

from launchers import python, run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:sagemaker.train.configs has been moved:DeprecationWarning")

REGION = "us-west-2"
ACCOUNT = "123456789012"  # moto's account
BUCKET = "smddp-moto-bucket"
LOOPBACK = {None, "127.0.0.1", "localhost", "::1"}

TRAIN = """\
import argparse, json, os, sys
import smddp
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int)
parser.add_argument("--lr", type=float)
parser.add_argument("--optimizer")
args = parser.parse_args()
print("RESULT", json.dumps({"smddp": smddp.__file__, "args": vars(args), "cwd": os.getcwd()}))
"""


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    """A moto server on loopback, the environment that points the SDK at it, a role and a bucket."""
    config = tmp_path_factory.mktemp("sagemaker-config") / "config.yaml"
    config.write_text("SchemaVersion: '1.0'\nSageMaker:\n  PythonSDK:\n    Modules:\n      TelemetryOptOut: true\n")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "SAGEMAKER_VALIDATE_ROLE": "false",
        "SAGEMAKER_USER_CONFIG_OVERRIDE": str(config),
    }
    dropped = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    saved = {name: os.environ.get(name) for name in (*env, *dropped)}
    os.environ.update(env)
    for name in dropped:
        os.environ.pop(name, None)

    boto = boto3.Session(region_name=REGION)
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"Service": "sagemaker.amazonaws.com"}}]}
    role = boto.client("iam").create_role(RoleName="SMDDPTrainingRole", AssumeRolePolicyDocument=json.dumps(trust))
    boto.client("s3").create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    try:
        yield SimpleNamespace(role=role["Role"]["Arn"], boto=boto, endpoint=env["AWS_ENDPOINT_URL"])
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def loopback_only(monkeypatch):
    """Refuse to resolve any host but loopback; the list of refused names must stay empty."""
    refused = []
    resolve = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        if host not in LOOPBACK:
            refused.append(host)
            raise socket.gaierror(f"test guard: {host} is not loopback")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    yield refused
    assert refused == [], f"something tried to reach {refused}"


@pytest.fixture
def session(aws, loopback_only):
    from sagemaker.core.helper.session_helper import Session

    return Session(boto_session=aws.boto, default_bucket=BUCKET)


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    (src / "helpers").mkdir(parents=True)
    (src / "train.py").write_text(TRAIN)
    (src / "helpers" / "__init__.py").write_text("")
    (src / "requirements.txt").write_text("tqdm\n")
    return src


def describe(aws, name):
    return aws.boto.client("sagemaker").describe_training_job(TrainingJobName=name)


def channel(job, name):
    for entry in job["InputDataConfig"]:
        if entry["ChannelName"] == name:
            return entry["DataSource"]["S3DataSource"]["S3Uri"]
    raise AssertionError(f"no channel {name!r} in {[c['ChannelName'] for c in job['InputDataConfig']]}")


def download(aws, uri, dest: Path) -> Path:
    """Every object under an S3 prefix, into ``dest`` with the same relative paths."""
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    s3 = aws.boto.client("s3")
    found = s3.list_objects_v2(Bucket=bucket, Prefix=prefix.rstrip("/") + "/").get("Contents", [])
    assert found, f"nothing uploaded under {uri}"
    for obj in found:
        target = dest / obj["Key"][len(prefix):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, obj["Key"], str(target))
    return dest


def smdistributed_estimator(session, aws, source, **overrides):
    kwargs = dict(
        entry_point="train.py", source_dir=str(source), role=aws.role, sagemaker_session=session,
        instance_type="ml.p4d.24xlarge", instance_count=2, framework_version="2.8.0", py_version="py312",
        hyperparameters={"epochs": 3, "lr": 0.1, "optimizer": "sgd"},
        distribution={"smdistributed": {"dataparallel": {"enabled": True,
                                                         "custom_mpi_options": "-x NCCL_DEBUG=VERSION"}}},
        base_job_name="smddp-moto", max_run=7200,
    )
    kwargs.update(overrides)
    return PyTorch(**kwargs)


def test_smdistributed_job_as_sagemaker_receives_it(aws, session, source, tmp_path):
    lib = tmp_path / "libs" / "shared_lib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VALUE = 42\n")
    est = smdistributed_estimator(session, aws, source, dependencies=[str(lib)])
    job = est.fit({"training": f"s3://{BUCKET}/data/train"}, wait=False)

    got = describe(aws, job.name)
    assert job.name.startswith("smddp-moto-")
    assert got["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert got["ResourceConfig"]["InstanceCount"] == 2
    assert got["AlgorithmSpecification"]["TrainingImage"] == (
        f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch-training:2.8.0-gpu-py312"
    )
    # The user's, then what SDK v2 adds for smdistributed data parallel, JSON-encoded as v2 sends them.
    assert got["HyperParameters"] == {
        "epochs": "3", "lr": "0.1", "optimizer": "sgd",
        "sagemaker_program": '"train.py"', "sagemaker_container_log_level": "20", "sagemaker_region": f'"{REGION}"',
        "sagemaker_distributed_dataparallel_enabled": "true", "sagemaker_instance_type": '"ml.p4d.24xlarge"',
        "sagemaker_distributed_dataparallel_custom_mpi_options": '"-x NCCL_DEBUG=VERSION"',
    }
    assert got["RoleArn"] == aws.role
    assert got["StoppingCondition"]["MaxRuntimeInSeconds"] == 7200
    assert channel(got, "training") == f"s3://{BUCKET}/data/train"
    assert est.model_data == f"s3://{BUCKET}/smddp-moto/{job.name}/output/model.tar.gz"
    assert est.latest_training_job is job and job.describe()["TrainingJobName"] == job.name

    drivers = download(aws, channel(got, "sm_drivers"), tmp_path / "sm_drivers")
    assert json.loads((drivers / "distributed.json").read_text()) == {
        "process_count_per_node": 8, "mpi_additional_options": ["-x", "NCCL_DEBUG=VERSION"],
    }
    assert json.loads((drivers / "sourcecode.json").read_text())["entry_script"] == "_smddp_entry.py"
    assert json.loads((drivers / "sourcecode.json").read_text())["requirements"] == "requirements.txt"
    assert "mpi_driver.py" in (drivers / "sm_train.sh").read_text()

    code = download(aws, channel(got, "code"), tmp_path / "code")
    wheel = f"smddp-{smddp.__version__}-py3-none-any.whl"
    assert {"train.py", "helpers", "_smddp_entry.py", "requirements.txt", wheel} <= {p.name for p in code.iterdir()}
    assert (code / "shared_lib" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (code / "requirements.txt").read_text().splitlines() == [f"./{wheel}", "tqdm"]


def test_shipped_wheel_installs_and_entry_runs_the_script(aws, session, source, tmp_path):
    job = smdistributed_estimator(session, aws, source, instance_count=1).fit(wait=False)
    code = download(aws, channel(describe(aws, job.name), "code"), tmp_path / "code")
    (code / "requirements.txt").write_text(f"./smddp-{smddp.__version__}-py3-none-any.whl\n")  # offline: no tqdm

    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
         "--target", str(site), "-r", "requirements.txt"], timeout=120, cwd=str(code)).check()
    assert (site / "smddp" / "sagemaker" / "_driver" / "mpi_driver.py").is_file()
    assert (site / "smddp" / "torch" / "distributed.py").is_file()

    # The container runs: cd /opt/ml/input/data/code; python -m mpi4py _smddp_entry.py --epochs 3 ...
    result = run([sys.executable, "_smddp_entry.py", "--epochs", "3", "--lr", "0.1", "--optimizer", "sgd"],
                 timeout=60, env={"PYTHONPATH": str(site)}, cwd=str(code)).check()
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    assert Path(report["smddp"]).resolve().is_relative_to(site.resolve()), report
    assert report["args"] == {"epochs": 3, "lr": 0.1, "optimizer": "sgd"}


def decoded(value: str):
    """A hyperparameter as SDK v3's environment script decodes it: JSON when it parses, else the string."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def test_smddp_mpi_driver_starts_every_host(aws, session, source, tmp_path):
    """SDK v3's driver passes -np <per host>; smddp's passes hosts x per host."""
    job = smdistributed_estimator(session, aws, source).fit(wait=False)
    drivers = download(aws, channel(describe(aws, job.name), "sm_drivers"), tmp_path / "sm_drivers")
    assert "smddp" in (drivers / "distributed_drivers" / "mpi_driver.py").read_text()
    # As SDK v3's environment script exports them: hyperparameters decoded, v2's sagemaker_* among them.
    hps = {k: decoded(v) for k, v in describe(aws, job.name)["HyperParameters"].items()}
    env = {
        "SM_HOSTS": json.dumps(["algo-1", "algo-2"]), "SM_CURRENT_HOST": "algo-1",
        "SM_MASTER_ADDR": "algo-1", "SM_MASTER_PORT": "7777",
        "SM_DISTRIBUTED_CONFIG": (drivers / "distributed.json").read_text(),
        "SM_ENTRY_SCRIPT": "_smddp_entry.py", "SM_HPS": json.dumps(hps),
        "SM_TRAINING_ENV": json.dumps({"hyperparameters": hps, "current_host": "algo-1"}),
        "SM_CURRENT_INSTANCE_TYPE": "ml.p4d.24xlarge", "SM_NUM_GPUS": "8", "SM_NETWORK_INTERFACE_NAME": "eth0",
    }
    probe = ("import json, os, sys; sys.path.insert(0, sys.argv[1]);"
             "from distributed_drivers.mpi_driver import mpirun_command, rank_environment;"
             "os.environ.update(rank_environment(os.environ));"
             "print('CMD', json.dumps(mpirun_command(os.environ)));"
             "print('ENV', json.dumps({k: os.environ.get(k) for k in ('MASTER_ADDR', 'MASTER_PORT',"
             " 'SAGEMAKER_INSTANCE_TYPE', 'SM_FRAMEWORK_PARAMS', 'SM_HPS', 'SM_TRAINING_ENV')}))")
    result = python(["-c", probe, str(drivers)], timeout=60, env=env).check()
    cmd = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("CMD "))[4:])
    assert cmd[0] == "mpirun"
    assert cmd[cmd.index("--host") + 1] == "algo-1:8,algo-2:8"
    assert cmd[cmd.index("-np") + 1] == "16"
    assert "NCCL_DEBUG=VERSION" in cmd and "FI_PROVIDER=efa" in cmd
    # The sagemaker_* hyperparameters are framework parameters, not the script's arguments.
    assert cmd[-9:] == ["-m", "mpi4py", "_smddp_entry.py", "--epochs", "3", "--lr", "0.1", "--optimizer", "sgd"]
    for name in ("MASTER_ADDR", "MASTER_PORT", "SAGEMAKER_INSTANCE_TYPE", "SM_FRAMEWORK_PARAMS", "SM_HPS"):
        assert cmd[cmd.index(name) - 1] == "-x", name
    ranks = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("ENV "))[4:])
    assert (ranks["MASTER_ADDR"], ranks["MASTER_PORT"], ranks["SAGEMAKER_INSTANCE_TYPE"]) == (
        "algo-1", "7777", "ml.p4d.24xlarge")
    framework = json.loads(ranks["SM_FRAMEWORK_PARAMS"])
    assert framework == {
        "sagemaker_program": "train.py", "sagemaker_container_log_level": 20, "sagemaker_region": REGION,
        "sagemaker_distributed_dataparallel_enabled": True, "sagemaker_instance_type": "ml.p4d.24xlarge",
        "sagemaker_distributed_dataparallel_custom_mpi_options": "-x NCCL_DEBUG=VERSION",
    }
    assert json.loads(ranks["SM_HPS"]) == {"epochs": 3, "lr": 0.1, "optimizer": "sgd"}
    training_env = json.loads(ranks["SM_TRAINING_ENV"])
    assert training_env["additional_framework_parameters"] == framework
    assert training_env["hyperparameters"] == {"epochs": 3, "lr": 0.1, "optimizer": "sgd"}


@pytest.mark.parametrize(
    "instance_type, distribution, driver, per_host, processor",
    [
        ("ml.g5.12xlarge", {"torch_distributed": {"enabled": True}}, "torchrun_driver.py", 4, "gpu"),
        ("ml.m5.xlarge", None, "mpi_driver.py", 1, "cpu"),
        ("ml.g5.48xlarge", {"mpi": {"enabled": True, "processes_per_host": 2}}, "mpi_driver.py", 2, "gpu"),
    ],
)
def test_launcher_and_processes_per_host(aws, session, source, tmp_path, instance_type, distribution, driver,
                                         per_host, processor):
    est = smdistributed_estimator(session, aws, source, instance_type=instance_type, instance_count=1,
                                  distribution=distribution)
    job = est.fit(wait=False)
    got = describe(aws, job.name)
    assert got["ResourceConfig"]["InstanceType"] == instance_type
    assert f"2.8.0-{processor}-py312" in got["AlgorithmSpecification"]["TrainingImage"]
    drivers = download(aws, channel(got, "sm_drivers"), tmp_path / "sm_drivers")
    assert driver in (drivers / "sm_train.sh").read_text()
    assert json.loads((drivers / "distributed.json").read_text())["process_count_per_node"] == per_host


def test_image_uri_and_default_versions(aws, session, source):
    custom = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/my-training:latest"
    job = smdistributed_estimator(session, aws, source, image_uri=custom, instance_count=1).fit(wait=False)
    assert describe(aws, job.name)["AlgorithmSpecification"]["TrainingImage"] == custom

    from smddp.sagemaker._images import default_versions

    newest, py = default_versions()
    est = smdistributed_estimator(session, aws, source, framework_version=None, py_version=None, instance_count=1)
    image = describe(aws, est.fit(wait=False).name)["AlgorithmSpecification"]["TrainingImage"]
    assert image.endswith(f"pytorch-training:{newest}-gpu-{py}")

    with pytest.raises(InvalidArgumentError, match="framework_version='0.0.1'"):
        smdistributed_estimator(session, aws, source, framework_version="0.0.1", py_version=None).fit(wait=False)


def test_wait_follows_the_job_to_completion(aws, session, source):
    """moto finishes a training job as soon as it is created: wait=True returns with it Completed."""
    est = smdistributed_estimator(session, aws, source, instance_count=1, output_path=f"s3://{BUCKET}/models")
    job = est.fit(f"s3://{BUCKET}/data/train", wait=True, logs=False)
    assert job.status == "Completed"
    assert est.model_data == f"s3://{BUCKET}/models/{job.name}/output/model.tar.gz"
    assert describe(aws, job.name)["ModelArtifacts"]["S3ModelArtifacts"] == est.model_data


def test_logs_streams_cloudwatch(aws, session, source, caplog, capsys):
    est = smdistributed_estimator(session, aws, source, instance_count=2)
    job = est.fit(wait=False)
    logs = aws.boto.client("logs")
    group = "/aws/sagemaker/TrainingJobs"
    if group not in [g["logGroupName"] for g in logs.describe_log_groups(logGroupNamePrefix=group)["logGroups"]]:
        logs.create_log_group(logGroupName=group)
    for host in ("algo-1", "algo-2"):
        stream = f"{job.name}/{host}-1700000000"
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
        logs.put_log_events(logGroupName=group, logStreamName=stream,
                            logEvents=[{"timestamp": int(time.time() * 1000), "message": f"hello from {host}"}])
    with caplog.at_level("INFO"):
        est.logs()
    shown = caplog.text + "".join(capsys.readouterr())
    assert "hello from algo-1" in shown and "hello from algo-2" in shown


def test_failed_job_raises_with_its_failure_reason(aws, session, source, monkeypatch):
    from moto.backends import get_backend

    backend = get_backend("sagemaker")[ACCOUNT][REGION]
    create = backend.create_training_job

    def create_failing(**kwargs):
        job = create(**kwargs)
        job.training_job_status = "Failed"
        job.failure_reason = "AlgorithmError: ValueError: loss is NaN at epoch 2"
        return job

    monkeypatch.setattr(backend, "create_training_job", create_failing)
    est = smdistributed_estimator(session, aws, source, instance_count=1)
    with pytest.raises(JobFailedError, match="loss is NaN at epoch 2") as caught:
        est.fit(wait=True, logs=False)
    assert caught.value.status == "Failed"
    assert est.latest_training_job.status == "Failed"


def test_role_is_required_before_anything_is_uploaded(aws, session, source):
    s3 = aws.boto.client("s3")
    before = s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)
    est = smdistributed_estimator(session, aws, source, role=None)
    with pytest.raises(InvalidArgumentError, match="role is required"):
        est.fit(f"s3://{BUCKET}/data/train")
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == before
    assert est.latest_training_job is None


def test_local_inputs_are_uploaded_as_channels(aws, session, source, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text("1,2\n3,4\n")
    job = smdistributed_estimator(session, aws, source, instance_count=1).fit(
        {"training": f"file://{data}", "test": str(data)}, wait=False)
    got = describe(aws, job.name)
    for name in ("training", "test"):
        fetched = download(aws, channel(got, name), tmp_path / f"fetched-{name}")
        assert (fetched / "train.csv").read_text() == "1,2\n3,4\n"


@pytest.mark.parametrize("distribution, expected", [
    ({"mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-v"}},
     {"sagemaker_mpi_enabled": "true", "sagemaker_mpi_num_of_processes_per_host": "2",
      "sagemaker_mpi_custom_mpi_options": '"-v"'}),
    ({"pytorchddp": {"enabled": True}},
     {"sagemaker_pytorch_ddp_enabled": "true", "sagemaker_instance_type": '"ml.g5.48xlarge"'}),
    (None, {}),
    # SDK v3's torchrun driver would hand sagemaker_* to the script as arguments: none are sent.
    ({"torch_distributed": {"enabled": True}}, None),
])
def test_sagemaker_hyperparameters_per_distribution(aws, session, source, distribution, expected):
    est = smdistributed_estimator(session, aws, source, instance_type="ml.g5.48xlarge", instance_count=1,
                                  distribution=distribution)
    sent = describe(aws, est.fit(wait=False).name)["HyperParameters"]
    framework = {k: v for k, v in sent.items() if k.startswith("sagemaker_")}
    if expected is None:
        assert framework == {}
        return
    common = {"sagemaker_program": '"train.py"', "sagemaker_container_log_level": "20",
              "sagemaker_region": f'"{REGION}"'}
    assert framework == {**common, **expected}
