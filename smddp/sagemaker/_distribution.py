"""The ``distribution`` argument of the SDK v2 estimator, read into one launch plan.

SDK v2 notebooks pass one of several dict forms; each becomes a :class:`Distribution` that
says how processes start on every host (``mpirun`` through smddp, or ``torchrun``), how many,
and which extra ``mpirun`` options to pass. Anything else is an error naming the valid keys.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from smddp.errors import InvalidArgumentError, InvalidTypeError

#: ``mpirun`` through smddp (SageMaker's smdistributed runner, the ``mpi`` form).
MPI = "mpi"
#: ``torchrun`` (the ``torch_distributed`` form).
TORCHRUN = "torchrun"

# Valid keys of each form, in the order error messages list them.
_FORMS = {
    "smdistributed": ("dataparallel",),
    "mpi": ("enabled", "processes_per_host", "custom_mpi_options"),
    "torch_distributed": ("enabled", "processes_per_host"),
    "pytorchddp": ("enabled", "processes_per_host", "custom_mpi_options"),
}
_DATAPARALLEL_KEYS = ("enabled", "processes_per_host", "custom_mpi_options")


@dataclass(frozen=True)
class Distribution:
    """How a job starts its processes.

    Attributes:
        launcher: :data:`MPI` or :data:`TORCHRUN`.
        processes_per_host: processes on each host; None means one per GPU of the
            instance type (one on CPU instances).
        mpi_options: extra ``mpirun`` arguments (``custom_mpi_options``, split like a shell).
        form: the ``distribution`` key it came from (``"default"`` when none was given).
        custom_mpi_options: ``custom_mpi_options`` as the user wrote it (``""`` when absent).
    """

    launcher: str = MPI
    processes_per_host: Optional[int] = None
    mpi_options: Tuple[str, ...] = field(default_factory=tuple)
    form: str = "default"
    custom_mpi_options: str = ""


def _keys(mapping: Mapping[str, Any], valid: Tuple[str, ...], where: str) -> None:
    unknown = sorted(set(mapping) - set(valid))
    if unknown:
        raise InvalidArgumentError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; valid keys: {', '.join(valid)}"
        )


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidTypeError(f"{where} must be a dict, got {type(value).__name__}")
    return value


def _enabled(options: Mapping[str, Any], where: str) -> bool:
    enabled = options.get("enabled", False)
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"{where}['enabled'] must be True or False, got {enabled!r}")
    return enabled


def _processes(options: Mapping[str, Any], where: str) -> Optional[int]:
    count = options.get("processes_per_host")
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"{where}['processes_per_host'] must be a positive integer, got {count!r}")
    return count


def _mpi_options(options: Mapping[str, Any], where: str) -> Tuple[str, ...]:
    custom = options.get("custom_mpi_options")
    if custom is None:
        return ()
    if not isinstance(custom, str):
        raise InvalidTypeError(f"{where}['custom_mpi_options'] must be a string, got {type(custom).__name__}")
    return tuple(shlex.split(custom))


def parse(distribution: Optional[Mapping[str, Any]]) -> Distribution:
    """Read the estimator's ``distribution`` argument.

    Accepted forms (exactly one may be enabled)::

        None                                            # smddp data parallel under mpirun
        {"smdistributed": {"dataparallel": {"enabled": True, "custom_mpi_options": "-x NCCL_DEBUG=INFO"}}}
        {"mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "..."}}
        {"pytorchddp": {"enabled": True}}               # as SDK v2 does: smdistributed data parallel
        {"torch_distributed": {"enabled": True}}        # torchrun

    ``processes_per_host`` is also accepted in the smdistributed, pytorchddp and
    torch_distributed forms (an smddp extension; SageMaker's default is one per GPU). A form
    whose ``enabled`` is False is ignored; with none enabled, one process runs per host.

    Args:
        distribution: the dict passed to the estimator, or None.

    Returns:
        The :class:`Distribution` to launch with.

    Raises:
        InvalidTypeError: ``distribution`` or one of its values has the wrong type.
        InvalidArgumentError: an unknown key (the message lists the valid ones), a bad
            ``processes_per_host``, or more than one form enabled.
    """
    if distribution is None:
        return Distribution()
    distribution = _mapping(distribution, "distribution")
    _keys(distribution, tuple(_FORMS), "distribution")

    chosen: List[Distribution] = []
    for form, value in distribution.items():
        where = f"distribution[{form!r}]"
        options = _mapping(value, where)
        _keys(options, _FORMS[form], where)
        if form == "smdistributed":
            if "dataparallel" not in options:
                continue
            where += "['dataparallel']"
            options = _mapping(options["dataparallel"], where)
            _keys(options, _DATAPARALLEL_KEYS, where)
        if not _enabled(options, where):
            continue
        launcher = TORCHRUN if form == "torch_distributed" else MPI
        chosen.append(Distribution(
            launcher, _processes(options, where), _mpi_options(options, where), form,
            options.get("custom_mpi_options") or "",
        ))

    if len(chosen) > 1:
        names = " and ".join(d.form for d in chosen)
        raise InvalidArgumentError(
            f"conflicting distribution options: {names} are all enabled; enable exactly one of "
            f"{', '.join(_FORMS)}"
        )
    if not chosen:
        return Distribution(MPI, 1, (), "disabled")
    return chosen[0]


def framework_hyperparameters(
    dist: Distribution, instance_type: str, program: str, processes_per_host: int, region: Optional[str] = None,
) -> Dict[str, Any]:
    """The ``sagemaker_*`` hyperparameters SDK v2's PyTorch estimator adds for this job.

    SageMaker's training toolkit moves them into ``SM_FRAMEWORK_PARAMS``, where Hugging Face's
    ``is_sagemaker_dp_enabled()`` looks for ``sagemaker_distributed_dataparallel_enabled``.
    SDK v2 sends each value JSON-encoded (``json.dumps``); these are the decoded values.
    ``sagemaker_job_name`` and ``sagemaker_submit_directory`` are not among them: SDK v3
    names the job and uploads the code only inside ``ModelTrainer.train()``.

    Args:
        dist: the parsed ``distribution``.
        instance_type: the job's instance type.
        program: the entry point, relative to ``source_dir``.
        processes_per_host: processes started on each host.
        region: the AWS region, when known.

    Returns:
        ``{name: value}``: the program, log level and region, plus what SDK v2 adds for the
        ``distribution`` form (``sagemaker_distributed_dataparallel_*``,
        ``sagemaker_pytorch_ddp_enabled``, ``sagemaker_mpi_*`` or
        ``sagemaker_torch_distributed_enabled``, with ``sagemaker_instance_type``).
    """
    params: Dict[str, Any] = {"sagemaker_program": program, "sagemaker_container_log_level": 20}
    if region:
        params["sagemaker_region"] = region
    if dist.form == "smdistributed":
        params.update(
            sagemaker_distributed_dataparallel_enabled=True,
            sagemaker_instance_type=instance_type,
            sagemaker_distributed_dataparallel_custom_mpi_options=dist.custom_mpi_options,
        )
    elif dist.form == "pytorchddp":
        params.update(sagemaker_pytorch_ddp_enabled=True, sagemaker_instance_type=instance_type)
    elif dist.form == "mpi":
        params.update(
            sagemaker_mpi_enabled=True,
            sagemaker_mpi_num_of_processes_per_host=processes_per_host,
            sagemaker_mpi_custom_mpi_options=dist.custom_mpi_options,
        )
    elif dist.form == "torch_distributed":
        params.update(sagemaker_torch_distributed_enabled=True, sagemaker_instance_type=instance_type)
    return params
