"""The SageMaker path: a training job submitted through SDK v3's ``ModelTrainer``.

The job runs AWS's PyTorch training image with the code channel from :mod:`._package`
(the user's code, smddp as a wheel, a requirements line) and SDK v3's ``MPI`` or
``Torchrun`` driver. The MPI driver is smddp's (``_driver/mpi_driver.py``), which starts every
host's processes; the SDK's starts only the first host's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.sagemaker import _distribution, _images, _instances, _package
from smddp.sagemaker._job import JobFailedError, TrainingJob

_DRIVER = Path(__file__).resolve().parent / "_driver" / "mpi_driver.py"


def _sdk():
    """Import SDK v3 lazily: local mode must work without it."""
    try:
        from sagemaker.core.helper.session_helper import Session
        from sagemaker.core.training.configs import (
            CheckpointConfig,
            Compute,
            InputData,
            OutputDataConfig,
            SourceCode,
            StoppingCondition,
        )
        from sagemaker.train import ModelTrainer
        from sagemaker.train.distributed import MPI, Torchrun
    except ImportError as exc:
        raise BackendUnavailableError(
            f"submitting to SageMaker needs the SageMaker Python SDK v3 ({exc}): pip install 'smddp[sagemaker]'"
        ) from exc
    return {
        "Session": Session, "ModelTrainer": ModelTrainer, "MPI": MPI, "Torchrun": Torchrun,
        "SourceCode": SourceCode, "Compute": Compute, "InputData": InputData,
        "OutputDataConfig": OutputDataConfig, "StoppingCondition": StoppingCondition,
        "CheckpointConfig": CheckpointConfig,
    }


def _smddp_mpi(sdk: Dict[str, Any], driver_dir: str, **config: Any):
    """SDK v3's ``MPI`` config with smddp's driver in place of the SDK's."""

    class SmddpMPI(sdk["MPI"]):
        @property
        def driver_dir(self) -> str:
            return driver_dir

    return SmddpMPI(**config)


def distributed_config(sdk: Dict[str, Any], dist: _distribution.Distribution, instance_type: str, workdir: str):
    """The SDK v3 distributed config: processes per host from the distribution, else one per GPU."""
    per_host = dist.processes_per_host or _instances.default_processes_per_host(instance_type)
    if dist.launcher == _distribution.TORCHRUN:
        return sdk["Torchrun"](process_count_per_node=per_host)
    driver_dir = os.path.join(workdir, "driver")
    os.makedirs(driver_dir)
    shutil.copy2(_DRIVER, driver_dir)
    return _smddp_mpi(
        sdk, driver_dir, process_count_per_node=per_host, mpi_additional_options=list(dist.mpi_options) or None
    )


def job_hyperparameters(estimator: Any, entry_point: Path, dist: _distribution.Distribution, region: Optional[str]):
    """The user's hyperparameters plus the ``sagemaker_*`` ones SDK v2 sends, JSON-encoded as v2 does.

    Only jobs under smddp's MPI driver get the ``sagemaker_*`` ones: it moves them into
    ``SM_FRAMEWORK_PARAMS`` as SageMaker's toolkit does, while SDK v3's torchrun driver would
    pass them to the script as ``--sagemaker_program ...`` arguments. A name the user set wins.
    """
    hyperparameters = dict(estimator.hyperparameters)
    if dist.launcher != _distribution.MPI:
        return hyperparameters
    source_dir = estimator.source_dir
    program = entry_point.relative_to(Path(source_dir).resolve()).as_posix() if source_dir else entry_point.name
    per_host = dist.processes_per_host or _instances.default_processes_per_host(estimator.instance_type)
    framework = _distribution.framework_hyperparameters(dist, estimator.instance_type, program, per_host, region)
    for name, value in framework.items():
        hyperparameters.setdefault(name, json.dumps(value))
    return hyperparameters


def input_channels(sdk: Dict[str, Any], inputs: Any) -> Optional[List[Any]]:
    """``fit``'s ``inputs`` as SDK v3 ``InputData``: S3 URIs as they are, local paths uploaded by the SDK."""
    if inputs is None:
        return None
    if isinstance(inputs, (list, tuple)):
        return list(inputs)
    if isinstance(inputs, (str, os.PathLike)) or not isinstance(inputs, dict):
        inputs = {"training": inputs}
    channels = []
    for name, source in inputs.items():
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if isinstance(source, str) and source.startswith("file://"):
            source = source[len("file://"):]
        if isinstance(source, str) and "://" not in source and not os.path.exists(source):
            raise InvalidArgumentError(f"input channel {name!r}: {source!r} is neither an S3 URI nor a local path")
        channels.append(sdk["InputData"](channel_name=name, data_source=source))
    return channels


class RemoteJob:
    """One SageMaker training job: stage the code, build the ``ModelTrainer``, start it."""

    def __init__(self, estimator: Any, entry_point: Path, dependencies: List[Path], dist: _distribution.Distribution):
        self.est = estimator
        self.entry_point = entry_point
        self.dependencies = dependencies
        self.dist = dist
        self.sdk = _sdk()

    def session(self):
        return self.est.sagemaker_session or self.sdk["Session"]()

    def start(self, inputs: Any, job_name: Optional[str]) -> TrainingJob:
        """Upload the code and start the job (its ``wait()`` follows it to its end).

        Returns:
            The job, started: ``wait()`` raises :class:`~smddp.errors.JobFailedError` if it fails,
            with its failure reason.
        """
        sdk, est = self.sdk, self.est
        session = self.session()
        image = est.image_uri or _images.training_image(
            session.boto_region_name, est.instance_type, est.framework_version, est.py_version
        )
        workdir = tempfile.mkdtemp(prefix="smddp-job-")
        try:
            code = os.path.join(workdir, "code")
            os.makedirs(code)
            entry = _package.stage_code(code, self.entry_point, est.source_dir, self.dependencies)
            options: Dict[str, Any] = {}
            if est.output_path:
                options["output_data_config"] = sdk["OutputDataConfig"](s3_output_path=est.output_path)
            if est.checkpoint_s3_uri:
                options["checkpoint_config"] = sdk["CheckpointConfig"](s3_uri=est.checkpoint_s3_uri)
            trainer = sdk["ModelTrainer"](
                training_image=image,
                source_code=sdk["SourceCode"](source_dir=code, entry_script=entry, requirements="requirements.txt"),
                compute=sdk["Compute"](instance_type=est.instance_type, instance_count=est.instance_count),
                distributed=distributed_config(sdk, self.dist, est.instance_type, workdir),
                hyperparameters=job_hyperparameters(est, self.entry_point, self.dist, session.boto_region_name),
                environment=dict(est.environment),
                stopping_condition=sdk["StoppingCondition"](max_runtime_in_seconds=est.max_run),
                role=est.role,
                sagemaker_session=session,
                base_job_name=job_name or est.base_job_name,
                **options,
            )
            trainer.train(input_data_config=input_channels(sdk, inputs), wait=False, logs=False)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

        resource = trainer._latest_training_job  # the SDK's documented handle on the job it started
        name = resource.training_job_name
        output = trainer.output_data_config.s3_output_path.rstrip("/")
        model_data = f"{output}/{name}/output/model.tar.gz"

        def describe() -> Dict[str, Any]:
            response = dict(session.sagemaker_client.describe_training_job(TrainingJobName=name))
            response.pop("ResponseMetadata", None)
            return response

        def follow(show_logs: bool) -> None:
            from sagemaker.core.utils.exceptions import FailedStatusError

            try:
                resource.wait(logs=show_logs)
            except FailedStatusError:
                resource.refresh()
                raise JobFailedError(name, str(resource.training_job_status), str(resource.failure_reason)) from None

        return TrainingJob(name, model_data, describe, follow, resource)
