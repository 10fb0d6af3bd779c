"""A training job as the estimator reports it: ``estimator.latest_training_job``."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from smddp.errors import SMDDPError


class JobFailedError(SMDDPError, RuntimeError):
    """A training job ended in ``Failed`` (or ``Stopped``); the message carries its failure reason."""

    def __init__(self, job_name: str, status: str, reason: str) -> None:
        self.job_name = job_name
        self.status = status
        self.reason = reason
        super().__init__(f"training job {job_name} {status.lower()}: {reason}")


class TrainingJob:
    """The last job an estimator started, in SageMaker or in local mode.

    Attributes:
        name: the training job's name (``TrainingJobName``).
        model_data: where ``model.tar.gz`` is (an S3 URI, or a local path in local mode).
    """

    def __init__(
        self,
        name: str,
        model_data: str,
        describe: Callable[[], Dict[str, Any]],
        wait: Optional[Callable[[bool], None]] = None,
        resource: Any = None,
    ) -> None:
        self.name = name
        self.job_name = name
        self.model_data = model_data
        self._describe = describe
        self._wait = wait
        #: The SDK v3 ``sagemaker.core.resources.TrainingJob`` (None in local mode).
        self.resource = resource

    def describe(self) -> Dict[str, Any]:
        """The job's ``DescribeTrainingJob`` response (a dict in the same shape in local mode)."""
        return self._describe()

    @property
    def status(self) -> str:
        """``TrainingJobStatus``: ``InProgress``, ``Completed``, ``Failed`` or ``Stopped``."""
        return self.describe()["TrainingJobStatus"]

    def wait(self, logs: bool = True) -> None:
        """Block until the job ends, showing its logs.

        Raises:
            JobFailedError: the job failed or was stopped; the message has its failure reason.
        """
        if self._wait is not None:
            self._wait(logs)

    def __repr__(self) -> str:
        return f"TrainingJob(name={self.name!r}, model_data={self.model_data!r})"
