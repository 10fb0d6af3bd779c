"""Which training image a job runs: AWS's PyTorch training image for the version and device.

smddp ships itself into the job, so any PyTorch training image works: unlike SDK v2's
smdistributed check, there is no ceiling on ``framework_version`` and no instance allow-list.
The SDK's own image table (``sagemaker.core.image_uris``) gives the registry of each region.
"""

from __future__ import annotations

from typing import Optional, Tuple

from smddp.errors import InvalidArgumentError


def _version_key(version: str) -> Tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("."))


def default_versions() -> Tuple[str, str]:
    """The newest PyTorch training image version the installed SDK knows, and its Python."""
    from sagemaker.core import image_uris

    versions = image_uris.config_for_framework("pytorch")["training"]["versions"]
    newest = max(versions, key=_version_key)
    return newest, versions[newest]["py_versions"][-1]


def training_image(
    region: str,
    instance_type: str,
    framework_version: Optional[str] = None,
    py_version: Optional[str] = None,
) -> str:
    """The URI of the PyTorch training image for a job.

    Args:
        region: the AWS region of the job.
        instance_type: a SageMaker instance type; GPU types get the GPU image.
        framework_version: PyTorch version (``"2.8.0"``, or ``"2.8"``); default: the newest
            the installed SDK knows.
        py_version: Python version tag (``"py312"``); default: the newest for the version.

    Returns:
        The image URI, e.g. ``763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.8.0-gpu-py312``.

    Raises:
        InvalidArgumentError: the SDK has no image for that version, Python or region
            (pass ``image_uri`` to choose one yourself).
    """
    from sagemaker.core import image_uris

    if framework_version is None:
        framework_version, default_py = default_versions()
        py_version = py_version or default_py
    elif py_version is None:
        config = image_uris.config_for_framework("pytorch")["training"]
        full = config.get("version_aliases", {}).get(framework_version, framework_version)
        known = config["versions"].get(full)
        if known is None:
            raise InvalidArgumentError(
                f"no PyTorch training image for framework_version={framework_version!r}; "
                f"known versions: {', '.join(sorted(config['versions'], key=_version_key))} "
                "(or pass image_uri)"
            )
        py_version = known["py_versions"][-1]
    try:
        return image_uris.retrieve(
            "pytorch", region=region, version=framework_version, py_version=py_version,
            instance_type=instance_type, image_scope="training",
        )
    except ValueError as exc:
        raise InvalidArgumentError(f"{exc} (or pass image_uri to choose the image yourself)") from exc
