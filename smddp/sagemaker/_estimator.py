"""``smddp.sagemaker.PyTorch``: the SDK v2 estimator's signature, on SDK v3 or on this machine."""

from __future__ import annotations

import datetime
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Union

from smddp.errors import InvalidArgumentError, InvalidTypeError
from smddp.sagemaker import _distribution, _instances, _package
from smddp.sagemaker._job import TrainingJob

#: SageMaker's default limit on a job's run time, in seconds (one day).
DEFAULT_MAX_RUN = 24 * 60 * 60


def _job_name(base: str) -> str:
    """``base`` plus a millisecond timestamp, within SageMaker's 63 characters."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H-%M-%S-%f")[:-3]
    base = re.sub(r"[^a-zA-Z0-9-]", "-", base).strip("-") or "smddp"
    return f"{base[:63 - len(stamp) - 1]}-{stamp}"


class PyTorch:
    """An estimator for training PyTorch scripts with smddp on SageMaker or on this machine.

    It takes the arguments of the SageMaker Python SDK v2 ``sagemaker.pytorch.PyTorch``
    estimator that matter for data-parallel training, so a notebook changes one import::

        from smddp.sagemaker import PyTorch   # was: from sagemaker.pytorch import PyTorch

        estimator = PyTorch(
            entry_point="train.py", source_dir="src", role=role,
            instance_type="ml.p4d.24xlarge", instance_count=2,
            framework_version="2.8.0", py_version="py312",
            hyperparameters={"epochs": 10},
            distribution={"smdistributed": {"dataparallel": {"enabled": True}}},
        )
        estimator.fit({"training": "s3://bucket/data"})

    A SageMaker job is built on SDK v3's ``ModelTrainer`` with its ``MPI`` driver (or
    ``Torchrun`` for ``torch_distributed``) and carries smddp in its code, so any PyTorch
    training image works. ``instance_type="local"`` (CPU) or ``"local_gpu"`` runs the job here
    under ``smddprun`` with SageMaker's container environment, without Docker.

    Args:
        entry_point: Path (absolute or relative) to the Python source file which should be
            executed as the entry point to training. If ``source_dir`` is specified,
            ``entry_point`` must point to a file located at the root of ``source_dir``.
        source_dir: Path (absolute or relative) to a directory with any other training
            source code dependencies aside from the entry point file. Structure within this
            directory is preserved when training on SageMaker. A ``requirements.txt`` in it
            is installed in the container.
        role: An AWS IAM role (either name or full ARN). The SageMaker training jobs and APIs
            that create SageMaker endpoints use this role to access training data and model
            artifacts. Required for SageMaker jobs, unused in local mode.
        instance_type: Type of EC2 instance to use for training, for example
            ``"ml.p4d.24xlarge"``; ``"local"`` or ``"local_gpu"`` for local mode.
        instance_count: Number of Amazon EC2 instances to use for training. In local mode,
            the number of hosts emulated on this machine.
        framework_version: PyTorch version you want to use for executing your model training
            code. Chooses the training image (no upper limit); default: the newest the
            installed SDK knows. Ignored in local mode, which uses this machine's PyTorch.
        py_version: Python version you want to use for executing your model training code,
            e.g. ``"py312"``; default: the newest for ``framework_version``.
        image_uri: A Docker image URI to use instead of AWS's PyTorch training image.
        hyperparameters: Hyperparameters that will be used for training. They reach the
            script as ``--name value`` arguments, and as ``SM_HPS``/``SM_HP_<NAME>``.
        distribution: How processes start on each host. One of
            ``{"smdistributed": {"dataparallel": {"enabled": True, "custom_mpi_options": ...}}}``,
            ``{"mpi": {"enabled": True, "processes_per_host": N, "custom_mpi_options": ...}}``,
            ``{"pytorchddp": {"enabled": True}}`` or ``{"torch_distributed": {"enabled": True}}``.
            None means smddp data parallel under MPI with one process per GPU.
        output_path: S3 location for saving the training result (model artifacts and output
            files); in local mode a ``file://`` URI or a path (default: a folder under the
            temporary directory, printed when the job ends).
        base_job_name: Prefix for the training job name.
        environment: Environment variables to be set for use during the training job.
        max_run: Timeout in seconds for training (default: 24 * 60 * 60). After this amount
            of time the job is stopped, in SageMaker and in local mode alike.
        checkpoint_s3_uri: The S3 URI in which to persist checkpoints that the algorithm
            saves to ``/opt/ml/checkpoints``.
        sagemaker_session: Session object which manages interactions with Amazon SageMaker
            APIs (SDK v3's ``sagemaker.core.helper.session_helper.Session``); default: a new one.
        dependencies: A list of paths to directories (absolute or relative) with any
            additional libraries that will be exported to the container. Each is placed next
            to the entry point under its own name.

    Raises:
        InvalidArgumentError: the entry point or a dependency is missing, the instance type
            or count is not usable, or the distribution is not understood (the message lists
            the valid forms).
        InvalidTypeError: an argument has the wrong type.
    """

    def __init__(
        self,
        entry_point: str,
        source_dir: Optional[str] = None,
        role: Optional[str] = None,
        instance_type: Optional[str] = None,
        instance_count: int = 1,
        framework_version: Optional[str] = None,
        py_version: Optional[str] = None,
        image_uri: Optional[str] = None,
        hyperparameters: Optional[Mapping[str, Any]] = None,
        distribution: Optional[Mapping[str, Any]] = None,
        output_path: Optional[str] = None,
        base_job_name: Optional[str] = None,
        environment: Optional[Mapping[str, str]] = None,
        max_run: int = DEFAULT_MAX_RUN,
        checkpoint_s3_uri: Optional[str] = None,
        sagemaker_session: Any = None,
        dependencies: Optional[List[str]] = None,
    ) -> None:
        self._entry = _package.resolve_entry_point(entry_point, source_dir)
        self._dependencies = _package.check_dependencies(dependencies)
        self._distribution = _distribution.parse(distribution)
        if not instance_type or not isinstance(instance_type, str):
            raise InvalidArgumentError(
                "instance_type is required: an ml.* instance type for SageMaker, or one of "
                f"{', '.join(_instances.LOCAL_TYPES)} for local mode"
            )
        if not _instances.is_local(instance_type) and not instance_type.startswith("ml."):
            raise InvalidArgumentError(
                f"unknown instance_type {instance_type!r}: use an ml.* instance type for SageMaker, "
                f"or one of {', '.join(_instances.LOCAL_TYPES)} for local mode"
            )
        if isinstance(instance_count, bool) or not isinstance(instance_count, int) or instance_count < 1:
            raise InvalidArgumentError(f"instance_count must be a positive integer, got {instance_count!r}")
        if isinstance(max_run, bool) or not isinstance(max_run, int) or max_run < 1:
            raise InvalidArgumentError(f"max_run must be a positive number of seconds, got {max_run!r}")
        hyperparameters = dict(hyperparameters or {})
        for name in hyperparameters:
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
                raise InvalidArgumentError(f"hyperparameter name {name!r} cannot be a command-line option")
        try:
            json.dumps(hyperparameters)
        except (TypeError, ValueError) as exc:
            raise InvalidTypeError(f"hyperparameters must be JSON values (numbers, strings, lists): {exc}") from exc
        environment = dict(environment or {})
        for name, value in environment.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise InvalidTypeError(f"environment must map strings to strings, got {name!r}: {value!r}")

        self.entry_point = entry_point
        self.source_dir = source_dir
        self.role = role
        self.instance_type = instance_type
        self.instance_count = instance_count
        self.framework_version = framework_version
        self.py_version = py_version
        self.image_uri = image_uri
        self.hyperparameters: Dict[str, Any] = hyperparameters
        self.distribution = distribution
        self.output_path = output_path
        self.base_job_name = base_job_name
        self.environment: Dict[str, str] = environment
        self.max_run = max_run
        self.checkpoint_s3_uri = checkpoint_s3_uri
        self.sagemaker_session = sagemaker_session
        self.dependencies = list(dependencies or [])
        self._latest_training_job: Optional[TrainingJob] = None

    @property
    def local(self) -> bool:
        """True when the job runs on this machine (``instance_type`` ``local`` or ``local_gpu``)."""
        return _instances.is_local(self.instance_type)

    def fit(
        self,
        inputs: Union[str, Mapping[str, Any], None] = None,
        wait: bool = True,
        logs: Union[bool, str] = True,
        job_name: Optional[str] = None,
    ) -> TrainingJob:
        """Train a model using the input training dataset.

        Args:
            inputs: Information about the training data: an S3 URI (SageMaker), a ``file://``
                URI or a local path (both modes), or a dict from channel name to one of
                those. A single URI is the ``training`` channel. Each channel reaches the
                script as ``SM_CHANNEL_<NAME>``.
            wait: Whether the call should wait until the job completes. Local mode always
                runs the job to its end.
            logs: Whether to show the logs produced by the job (``True``/``"All"`` or
                ``False``/``"None"``); only meaningful when ``wait`` is True.
            job_name: Training job name; default: ``base_job_name`` (or the entry point's
                name) plus a timestamp. For SageMaker jobs, SDK v3 uses it as the prefix of
                the name and appends its own timestamp.

        Returns:
            The job, also available as :attr:`latest_training_job`.

        Raises:
            InvalidArgumentError: ``role`` is missing for a SageMaker job, or an input is not
                usable in this mode; raised before anything is uploaded or started.
            BackendUnavailableError: the SageMaker SDK is not installed (SageMaker jobs), or
                no launcher or GPU is available here (local mode).
            JobFailedError: the job failed; the message carries the job's failure reason.
        """
        show_logs = logs not in (False, None, "None", "none")
        if self.local:
            from smddp.sagemaker._local import LocalModeJob, channels

            data = channels(inputs)
            base = job_name or self.base_job_name or f"smddp-{self._entry.stem}"
            runner = LocalModeJob(
                _job_name(base) if job_name is None else job_name, self._entry, self.source_dir,
                self._dependencies, self.hyperparameters, self._distribution, self.instance_type,
                self.instance_count, self.environment, self.output_path, self.max_run,
            )
            self._latest_training_job = runner.job
            return runner.run(data, show_logs)

        if not self.role:
            raise InvalidArgumentError(
                "role is required for a SageMaker job: pass the ARN of an IAM role SageMaker can assume "
                "(or use instance_type='local')"
            )
        from smddp.sagemaker._remote import RemoteJob

        job = RemoteJob(self, self._entry, self._dependencies, self._distribution).start(inputs, job_name)
        self._latest_training_job = job  # before the wait: a job that fails is still the latest
        if wait:
            job.wait(show_logs)
        return job

    @property
    def latest_training_job(self) -> Optional[TrainingJob]:
        """The job the last :meth:`fit` started (``.name``, ``.describe()``, ``.wait()``), or None."""
        return self._latest_training_job

    @property
    def model_data(self) -> str:
        """Where the last job's ``model.tar.gz`` is: an S3 URI, or a local path in local mode.

        Raises:
            InvalidArgumentError: :meth:`fit` has not started a job yet.
        """
        if self._latest_training_job is None:
            raise InvalidArgumentError("no training job yet: call fit() first")
        return self._latest_training_job.model_data

    def logs(self) -> None:
        """Display the logs of the last job and wait for it to end.

        Raises:
            InvalidArgumentError: :meth:`fit` has not started a job yet.
            JobFailedError: the job failed; the message carries its failure reason.
        """
        if self._latest_training_job is None:
            raise InvalidArgumentError("no training job yet: call fit() first")
        self._latest_training_job.wait(logs=True)


#: The same estimator under the SDK's generic name.
Estimator = PyTorch
