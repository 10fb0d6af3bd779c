"""Container-side drivers that smddp.sagemaker ships into SageMaker training jobs (not imported here)."""
