"""Submit smddp training jobs to SageMaker, or run them on this machine in SageMaker's shape.

``smddp.sagemaker.PyTorch`` takes the SageMaker Python SDK v2 ``sagemaker.pytorch.PyTorch``
estimator's arguments (change one import) and submits through SDK v3's ``ModelTrainer``;
``instance_type="local"`` runs the job here under ``smddprun``, without Docker. The SageMaker
SDK is imported only when a job is submitted to SageMaker.
"""

from __future__ import annotations

from smddp.sagemaker._estimator import Estimator, PyTorch
from smddp.sagemaker._job import JobFailedError, TrainingJob

__all__ = ["PyTorch", "Estimator", "JobFailedError", "TrainingJob"]
