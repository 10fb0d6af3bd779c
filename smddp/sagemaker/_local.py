"""Local mode: run a training job on this machine under smddprun, as SageMaker would run it.

No Docker. Each emulated host (``algo-1``, ``algo-2``, ...) gets an ``/opt/ml``-shaped
directory in a temporary folder (:class:`smddp.sagemaker._container.Container`): ``model/``,
``output/data/``, ``input/config/{hyperparameters,resourceconfig,inputdataconfig}.json`` and
``input/data/<channel>`` (links to the local inputs), exported as ``SAGEMAKER_BASE_DIR`` so
AWS's training toolkit reads it. The job's hyperparameters carry the ``sagemaker_*`` ones SDK
v2 sends for its ``distribution``. All processes of all hosts form one job started by smddprun
(or torchrun for ``torch_distributed``); each process exports its host's ``SM_*`` environment
(:mod:`._entry`) before the script runs. Afterwards the hosts' model directories are packed as
``<output_path>/<job>/output/model.tar.gz``, as SageMaker does.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import smddp
from smddp.errors import BackendUnavailableError, InvalidArgumentError, InvalidTypeError, UnsafePathError
from smddp.launch import smddprun
from smddp.sagemaker import _distribution
from smddp.sagemaker._container import Container, cmd_args, job_hyperparameters, split_hyperparameters
from smddp.sagemaker._job import JobFailedError, TrainingJob


def default_output() -> str:
    """Where local jobs write ``<job>/output/model.tar.gz`` when ``output_path`` is not given:
    ``smddp-local-<uid>`` in the temporary directory (``$TMPDIR``, else ``/tmp``), one per user.

    :func:`private_dir` makes it, or checks it, before a job runs.
    """
    return os.path.join(tempfile.gettempdir(), f"smddp-local-{os.getuid()}")


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter (mode 0700), made if missing.

    A shared temporary directory lets anyone create a name first: a directory that exists is
    used only if it is a real directory (not a link) of this user; one it owns with a wider
    mode is narrowed to 0700.

    Raises:
        UnsafePathError: ``path`` belongs to another user, or is a link or not a directory.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = (f"belongs to user id {info.st_uid}, not to you (user id {os.getuid()})"
                if stat.S_ISDIR(info.st_mode) else "is a link or a file, not a directory of yours")
        raise UnsafePathError(
            f"local mode's default output directory {path} {what}: another user could read or replace "
            f"your model there, so it is not used. Pass output_path='file:///a/folder/of/yours' to the "
            f"estimator, set TMPDIR to a directory of yours, or remove {path}"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def local_path(uri: str, what: str) -> Path:
    """A ``file://`` URI or a plain path as a path; S3 and other schemes are refused.

    Raises:
        InvalidArgumentError: the URI is not local.
    """
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if "://" in uri:
        raise InvalidArgumentError(
            f"{what} {uri!r}: local mode reads and writes local files only (file:// or a path)"
        )
    return Path(uri)


def channels(inputs: Any) -> Dict[str, Path]:
    """``{channel: local path}`` from ``fit``'s ``inputs`` (a string means channel ``training``).

    Raises:
        InvalidArgumentError: an input is not local or does not exist.
        InvalidTypeError: ``inputs`` is not None, a string or a dict of strings.
    """
    if inputs is None:
        return {}
    if isinstance(inputs, (str, os.PathLike)):
        inputs = {"training": os.fspath(inputs)}
    if not isinstance(inputs, Mapping):
        raise InvalidTypeError(f"inputs must be a path, a file:// URI or a dict of them, got {type(inputs).__name__}")
    found = {}
    for name, uri in inputs.items():
        if not isinstance(uri, (str, os.PathLike)):
            raise InvalidTypeError(f"input channel {name!r} must be a path or file:// URI in local mode")
        path = local_path(os.fspath(uri), f"input channel {name!r}")
        if not path.exists():
            raise InvalidArgumentError(f"input channel {name!r}: {path} does not exist")
        found[name] = path.resolve()
    return found


def gpu_count() -> int:
    """CUDA devices visible here (imports torch only for ``local_gpu``)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch_command(nprocs: int, dist: _distribution.Distribution, program: Sequence[str]) -> List[str]:
    """The command that starts ``nprocs`` processes of ``python -m smddp.sagemaker._entry program...``.

    smddprun for the MPI forms (``custom_mpi_options`` become its ``--mpi-args``), under
    mpirun as SageMaker runs them whenever one is installed (the script then sees MPI's
    variables and may use mpi4py); torchrun for ``torch_distributed``, through
    ``python -m smddp.alias`` as smddprun would.
    """
    entry = ["-m", "smddp.sagemaker._entry", *program]
    if dist.launcher == _distribution.TORCHRUN:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
                "-m", "smddp.alias", *entry]
    cmd = [sys.executable, "-m", "smddp.launch", "-np", str(nprocs)]
    if smddprun.find_mpirun(os.environ) is not None:
        cmd += ["--launcher", "mpirun"]
    if dist.mpi_options:
        cmd.append(f"--mpi-args={shlex.join(dist.mpi_options)}")
    return cmd + entry


class LocalModeJob:
    """One local-mode run: lays out the hosts, starts the processes, packs the model."""

    def __init__(
        self,
        job_name: str,
        entry_point: Path,
        source_dir: Optional[str],
        dependencies: Sequence[Path],
        hyperparameters: Mapping[str, Any],
        dist: _distribution.Distribution,
        instance_type: str,
        instance_count: int,
        environment: Mapping[str, str],
        output_path: Optional[str],
        max_run: int,
    ) -> None:
        self.job_name = job_name
        self.entry_point = entry_point
        self.source_dir = Path(source_dir).resolve() if source_dir is not None else entry_point.parent
        self.dependencies = list(dependencies)
        self.hyperparameters = dict(hyperparameters)
        self.dist = dist
        self.instance_type = instance_type
        self.hosts = [f"algo-{i + 1}" for i in range(instance_count)]
        self.environment = dict(environment)
        self.output_uri = output_path or default_output()
        self.output_dir = local_path(self.output_uri, "output_path").resolve()
        if output_path is None:
            private_dir(Path(self.output_uri))  # before the job runs: a refusal costs no training
        self.max_run = max_run
        self.num_gpus = 0
        self.gpu_ids: List[int] = []
        if instance_type == "local_gpu":
            self.gpu_ids = list(range(gpu_count()))
            if not self.gpu_ids:
                raise BackendUnavailableError(
                    "instance_type='local_gpu' needs a CUDA GPU on this machine; use instance_type='local'"
                )
        default = max(len(self.gpu_ids) // len(self.hosts), 1) if self.gpu_ids else 1
        self.processes_per_host = dist.processes_per_host or default
        if self.gpu_ids:
            self.num_gpus = min(self.processes_per_host, max(len(self.gpu_ids) // len(self.hosts), 1))
        program = entry_point.relative_to(self.source_dir).as_posix()
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        framework = _distribution.framework_hyperparameters(
            dist, instance_type, program, self.processes_per_host, region)
        #: What SDK v2 would send: the user's hyperparameters and the ``sagemaker_*`` ones.
        self.all_hyperparameters = job_hyperparameters(
            self.hyperparameters, framework, job_name, f"file://{self.source_dir}")
        self.status = "InProgress"
        self.reason: Optional[str] = None
        #: What ``estimator.latest_training_job`` shows for this run.
        self.job = TrainingJob(job_name, self.model_data, self.describe)

    @property
    def model_data(self) -> str:
        """Where ``model.tar.gz`` goes, spelled like ``output_path`` (``file://`` or a path)."""
        path = self.output_dir / self.job_name / "output" / "model.tar.gz"
        return f"file://{path}" if self.output_uri.startswith("file://") else str(path)

    def _containers(self, work: Path, data: Mapping[str, Path]) -> Dict[str, Dict[str, str]]:
        """Lay out every host's folder under ``work``; return each host's environment."""
        envs = {}
        for host in self.hosts:
            container = Container(
                base_dir=work / host, job_name=self.job_name, host=host, hosts=self.hosts,
                instance_type=self.instance_type, hyperparameters=self.all_hyperparameters, channels=sorted(data),
                num_gpus=self.num_gpus, processes_per_host=self.processes_per_host,
                entry_script=self.entry_point, source_dir=self.source_dir,
            )
            container.write_config()
            for name, source in data.items():
                channel = container.base_dir / "input" / "data" / name
                if source.is_dir():
                    channel.symlink_to(source, target_is_directory=True)
                else:
                    channel.mkdir()
                    (channel / source.name).symlink_to(source)
            env = container.environment()
            if self.gpu_ids and len(self.hosts) > 1:
                first = self.hosts.index(host) * self.num_gpus
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids[first:first + self.num_gpus])
            envs[host] = env
        return envs

    def _process_env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SM_")}
        env.update(self.environment)
        paths = [str(Path(smddp.__file__).resolve().parent.parent)]
        # SageMaker places each dependency next to the script under its own name: import it by that name.
        paths += [str(dependency.parent) for dependency in self.dependencies]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + [p for p in [env.get("PYTHONPATH")] if p]))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run(self, cmd: List[str], env: Dict[str, str], logs: bool) -> tuple[int, str]:
        tail: collections.deque = collections.deque(maxlen=40)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env, cwd=str(self.source_dir), start_new_session=True,
        )
        timed_out = threading.Event()

        def stop() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(self.max_run, stop)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line)
                if logs:
                    print(line, end="", flush=True)
            code = proc.wait()
        except BaseException:
            stop()
            proc.wait()
            raise
        finally:
            timer.cancel()
        if timed_out.is_set():
            tail.append(f"stopped: the job ran longer than max_run={self.max_run} seconds\n")
        return code, "".join(tail)

    def _failure_reason(self, work: Path, code: int, tail: str) -> str:
        for host in self.hosts:
            failure = work / host / "output" / "failure"
            if failure.is_file() and failure.read_text().strip():
                return failure.read_text().strip()
        lines = tail.strip().splitlines()[-10:]
        return f"the job exited with status {code}; last output:\n" + "\n".join(lines)

    def _pack(self, work: Path) -> None:
        out = self.output_dir / self.job_name / "output"
        out.mkdir(parents=True, exist_ok=True)
        for sub, archive in (("model", "model.tar.gz"), ("output/data", "output.tar.gz")):
            with tarfile.open(out / archive, "w:gz") as tar:
                seen = set()
                for host in self.hosts:
                    folder = work / host / sub
                    for path in sorted(folder.rglob("*")):
                        name = path.relative_to(folder).as_posix()
                        if name not in seen:
                            seen.add(name)
                            tar.add(path, arcname=name, recursive=False)

    def describe(self) -> Dict[str, Any]:
        """A ``DescribeTrainingJob``-shaped record of this run."""
        record = {
            "TrainingJobName": self.job_name,
            "TrainingJobStatus": self.status,
            "HyperParameters": {k: json.dumps(v) for k, v in self.all_hyperparameters.items()},
            "AlgorithmSpecification": {"TrainingImage": "local", "TrainingInputMode": "File"},
            "ResourceConfig": {"InstanceType": self.instance_type, "InstanceCount": len(self.hosts)},
            "OutputDataConfig": {"S3OutputPath": self.output_uri},
            "ModelArtifacts": {"S3ModelArtifacts": self.model_data},
        }
        if self.reason is not None:
            record["FailureReason"] = self.reason
        return record

    def run(self, data: Mapping[str, Path], logs: bool) -> TrainingJob:
        """Run the job to its end; the returned record says where the model is.

        Args:
            data: the input channels, from :func:`channels`.
            logs: print the job's output as it comes.

        Raises:
            JobFailedError: a process failed or the job ran past ``max_run``; the message
                carries the failure reason (the script's error, or the job's last output).
        """
        work = Path(tempfile.mkdtemp(prefix=f"smddp-{self.job_name}-"))
        try:
            spec = {"hosts": self.hosts, "processes_per_host": self.processes_per_host,
                    "env": self._containers(work, data)}
            spec_file = work / "job.json"
            spec_file.write_text(json.dumps(spec))
            nprocs = self.processes_per_host * len(self.hosts)
            user, _ = split_hyperparameters(self.all_hyperparameters)
            program = [str(spec_file), str(self.entry_point), *cmd_args(user)]
            cmd = launch_command(nprocs, self.dist, program)
            print(f"smddp local mode: job {self.job_name}, {len(self.hosts)} host(s) x "
                  f"{self.processes_per_host} process(es)", flush=True)
            start = time.monotonic()
            code, tail = self._run(cmd, self._process_env(), logs)
            if code != 0:
                self.status, self.reason = "Failed", self._failure_reason(work, code, tail)
                raise JobFailedError(self.job_name, "Failed", self.reason)
            self._pack(work)
            self.status = "Completed"
            print(f"smddp local mode: job {self.job_name} completed in {time.monotonic() - start:.1f}s; "
                  f"model artifacts: {self.model_data}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.job
