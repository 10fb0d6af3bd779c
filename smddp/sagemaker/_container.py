"""One host of a SageMaker training container, as SageMaker and its training toolkit lay it out.

A container's ``/opt/ml`` holds ``input/config/{hyperparameters,resourceconfig,inputdataconfig}.json``
and ``input/data/<channel>``; AWS's ``sagemaker-training`` toolkit
(``sagemaker_training.environment.Environment()``) reads them under ``SAGEMAKER_BASE_DIR`` and
exports the ``SM_*`` variables of the training script. :class:`Container` writes the same files
under a local folder and computes the same ``SM_*`` values, formatted as the toolkit formats
them (strings as they are, anything else compact JSON with sorted keys), so that a script, the
toolkit itself, Hugging Face's ``is_sagemaker_dp_enabled()`` and accelerate all see what they
would see on SageMaker. It also adds the variables SDK v3's containers set (``SM_MASTER_ADDR``,
``SM_HOST_COUNT``, ...).

Hyperparameters are stored as SDK v2 sends them: every value JSON-encoded. Those named
``sagemaker_*`` (added by the SDK for the ``distribution``) are split off as the toolkit does:
the toolkit's own names go nowhere, the rest become the framework parameters
(``SM_FRAMEWORK_PARAMS``), and only the user's reach the script's command line.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

#: SageMaker's name for the only instance group of a homogeneous cluster.
GROUP = "homogeneousCluster"
#: The toolkit's own hyperparameters: consumed by it, neither framework parameters nor the script's.
TOOLKIT_HYPERPARAMETERS = frozenset({
    "sagemaker_program", "sagemaker_submit_directory", "sagemaker_enable_cloudwatch_metrics",
    "sagemaker_region", "sagemaker_container_log_level", "sagemaker_job_name",
    "default_user_module_name", "_tuning_objective_metric", "sagemaker_s3_output",
})
#: The port SageMaker's PyTorch containers give ``MASTER_PORT`` (``SM_MASTER_PORT`` in SDK v3).
MASTER_PORT = 7777


def env_value(value: Any) -> str:
    """A value as the toolkit exports it: strings as they are, None empty, else compact sorted JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cmd_args(hyperparameters: Mapping[str, Any]) -> List[str]:
    """The script's arguments as the toolkit builds them: sorted names, ``--name str(value)``.

    One-letter names get one dash; a dict value becomes ``k=v,k=v``. ``True`` is passed as
    ``True`` and a list as ``[1, 2]``, since the toolkit formats values with ``str``.
    """
    args: List[str] = []
    for name in sorted(hyperparameters):
        value = hyperparameters[name]
        if isinstance(value, Mapping):
            value = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        args += [f"--{name}" if len(name) > 1 else f"-{name}", "" if value is None else str(value)]
    return args


def split_hyperparameters(hyperparameters: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(the user's, the framework parameters)``: the toolkit's split of all hyperparameters."""
    user = {k: v for k, v in hyperparameters.items()
            if k not in TOOLKIT_HYPERPARAMETERS and not k.startswith("sagemaker_")}
    framework = {k: v for k, v in hyperparameters.items()
                 if k.startswith("sagemaker_") and k not in TOOLKIT_HYPERPARAMETERS}
    return user, framework


@dataclass
class Container:
    """One emulated host of a job: its ``/opt/ml``-shaped folder and its ``SM_*`` environment.

    Attributes:
        base_dir: the host's folder, exported as ``SAGEMAKER_BASE_DIR`` (``/opt/ml`` on SageMaker).
        job_name: the training job's name (``TRAINING_JOB_NAME``).
        host: this host's name (``algo-1``, ``algo-2``, ...).
        hosts: every host of the job, in order.
        instance_type: the job's instance type (``local`` or ``local_gpu`` here).
        hyperparameters: all of the job's hyperparameters, ``sagemaker_*`` ones included, decoded.
        channels: the input channels' names.
        num_gpus: GPUs this host's processes share.
        processes_per_host: processes started on each host.
        entry_script: the script's path (``SM_ENTRY_SCRIPT``, SDK v3).
        source_dir: the folder the script runs from (``SM_SOURCE_DIR``, SDK v3).
        num_cpus: CPUs of the host.
        network_interface_name: the interface hosts reach each other on.
    """

    base_dir: Path
    job_name: str
    host: str
    hosts: Sequence[str]
    instance_type: str
    hyperparameters: Mapping[str, Any]
    channels: Sequence[str]
    num_gpus: int
    processes_per_host: int
    entry_script: Path
    source_dir: Path
    num_cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    network_interface_name: str = "lo"

    def resource_config(self) -> Dict[str, Any]:
        """``resourceconfig.json``, as SageMaker writes it for a homogeneous cluster."""
        return {
            "current_host": self.host, "current_instance_type": self.instance_type,
            "current_group_name": GROUP, "hosts": list(self.hosts),
            "instance_groups": [{"instance_group_name": GROUP, "instance_type": self.instance_type,
                                 "hosts": list(self.hosts)}],
            "network_interface_name": self.network_interface_name,
        }

    def input_data_config(self) -> Dict[str, Any]:
        """``inputdataconfig.json``: every channel in File mode, fully replicated."""
        return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                       "RecordWrapperType": "None"} for name in self.channels}

    def write_config(self) -> None:
        """Create the host's folders and write its three ``input/config`` files.

        ``input/data/<channel>`` is left to the caller (it links the local inputs there).
        """
        for sub in ("model", "output/data", "output/intermediate", "input/config", "input/data"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        config = self.base_dir / "input" / "config"
        encoded = {k: json.dumps(v) for k, v in self.hyperparameters.items()}
        (config / "hyperparameters.json").write_text(json.dumps(encoded))
        (config / "resourceconfig.json").write_text(json.dumps(self.resource_config()))
        (config / "inputdataconfig.json").write_text(json.dumps(self.input_data_config()))

    def training_env(self) -> Dict[str, Any]:
        """``SM_TRAINING_ENV``: every property of the toolkit's ``Environment``, for this host."""
        user, framework = split_hyperparameters(self.hyperparameters)
        base = self.base_dir
        program = self.hyperparameters.get("sagemaker_program")
        module = str(program)[:-3] if str(program).endswith(".py") else str(program)
        mp_parameters = env_value(user["mp_parameters"]) if "mp_parameters" in user else None
        # Only the distribution forms SageMaker's toolkit knows put the group into a distribution.
        distributed = any(framework.get(f"sagemaker_{name}_enabled") for name in (
            "mpi", "parameter_server", "distributed_dataparallel", "pytorch_ddp", "pytorch_xla_multi_worker",
            "multi_worker_mirrored_strategy", "torch_distributed"))
        groups = [GROUP] if distributed else []
        resource = self.resource_config()
        distribution_hosts = list(self.hosts) if distributed else []
        return {
            "additional_framework_parameters": framework,
            "channel_input_dirs": {name: str(base / "input" / "data" / name) for name in self.channels},
            "current_host": self.host,
            "current_instance_group": GROUP,
            "current_instance_group_hosts": list(self.hosts),
            "current_instance_type": self.instance_type,
            "distribution_hosts": distribution_hosts,
            "distribution_instance_groups": groups,
            "framework_module": os.environ.get("SAGEMAKER_TRAINING_MODULE"),
            "hosts": list(self.hosts),
            "hyperparameters": user,
            "input_config_dir": str(base / "input" / "config"),
            "input_data_config": self.input_data_config(),
            "input_dir": str(base / "input"),
            "instance_groups": [GROUP],
            "instance_groups_dict": {GROUP: resource["instance_groups"][0]},
            "is_hetero": False,
            "is_master": self.host == (distribution_hosts or list(self.hosts))[0],
            "is_modelparallel_enabled": mp_parameters and mp_parameters != "{}",
            "is_smddpmprun_installed": shutil.which("smddpmprun") is not None,
            "is_smddprun_installed": shutil.which("smddprun") is not None,
            "job_name": self.job_name,
            "log_level": self.hyperparameters.get("sagemaker_container_log_level", 20),
            "master_hostname": (distribution_hosts or list(self.hosts))[0],
            "model_dir": str(base / "model"),
            "module_dir": str(self.hyperparameters.get("sagemaker_submit_directory", base / "code")),
            "module_name": module,
            "network_interface_name": self.network_interface_name,
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "num_neurons": 0,
            "output_data_dir": str(base / "output" / "data"),
            "output_dir": str(base / "output"),
            "output_intermediate_dir": str(base / "output" / "intermediate"),
            "resource_config": resource,
            "topology": [],
            "user_entry_point": program,
        }

    def environment(self) -> Dict[str, str]:
        """Every variable a training script in this container finds, as strings.

        The toolkit's ``SM_*`` set (``Environment().to_env_vars()``), ``SAGEMAKER_BASE_DIR``
        and ``TRAINING_JOB_NAME``, SDK v3's additions, and ``SM_OUTPUT_FAILURE``.
        """
        training = self.training_env()
        toolkit = {
            "hosts": training["hosts"], "network_interface_name": training["network_interface_name"],
            "hps": training["hyperparameters"], "user_entry_point": training["user_entry_point"],
            "framework_params": training["additional_framework_parameters"],
            "resource_config": training["resource_config"], "input_data_config": training["input_data_config"],
            "output_data_dir": training["output_data_dir"], "channels": sorted(training["channel_input_dirs"]),
            "current_host": self.host, "current_instance_type": self.instance_type,
            "current_instance_group": GROUP, "current_instance_group_hosts": training["current_instance_group_hosts"],
            "instance_groups": training["instance_groups"], "instance_groups_dict": training["instance_groups_dict"],
            "distribution_instance_groups": training["distribution_instance_groups"], "is_hetero": False,
            "module_name": training["module_name"], "log_level": training["log_level"],
            "framework_module": training["framework_module"], "input_dir": training["input_dir"],
            "input_config_dir": training["input_config_dir"], "output_dir": training["output_dir"],
            "num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "num_neurons": 0,
            "model_dir": training["model_dir"], "module_dir": training["module_dir"], "training_env": training,
            "user_args": cmd_args(training["hyperparameters"]),
            "output_intermediate_dir": training["output_intermediate_dir"],
        }
        for name, path in training["channel_input_dirs"].items():
            toolkit[f"channel_{name}"] = path
        for name, value in training["hyperparameters"].items():
            toolkit[f"hp_{name}"] = value
        env = {f"SM_{key.upper()}": env_value(value) for key, value in toolkit.items()}
        env.update({
            "SAGEMAKER_BASE_DIR": str(self.base_dir),
            "TRAINING_JOB_NAME": self.job_name,
            "SM_OUTPUT_FAILURE": str(self.base_dir / "output" / "failure"),
            "SM_CURRENT_HOST_RANK": str(list(self.hosts).index(self.host)),
            "SM_HOST_COUNT": str(len(self.hosts)),
            "SM_MASTER_ADDR": self.hosts[0],
            "SM_MASTER_PORT": str(MASTER_PORT),
            "SM_IS_HETERO": "false",
            "SM_ENTRY_SCRIPT": str(self.entry_script),
            "SM_SOURCE_DIR": str(self.source_dir),
            "SM_DISTRIBUTED_CONFIG": json.dumps({"process_count_per_node": self.processes_per_host}),
        })
        return env


def job_hyperparameters(
    user: Mapping[str, Any], framework: Mapping[str, Any], job_name: str, submit_directory: Optional[str],
) -> Dict[str, Any]:
    """The user's hyperparameters plus the ``sagemaker_*`` ones SDK v2 sends; a name the user set wins.

    Args:
        user: the estimator's ``hyperparameters``.
        framework: the ``sagemaker_*`` hyperparameters for the job's ``distribution``
            (:func:`smddp.sagemaker._distribution.framework_hyperparameters`).
        job_name: the job's name (``sagemaker_job_name``).
        submit_directory: where the code is (``sagemaker_submit_directory``), if anywhere.

    Returns:
        ``{name: value}``, decoded values.
    """
    merged: Dict[str, Any] = {**framework, "sagemaker_job_name": job_name}
    if submit_directory is not None:
        merged["sagemaker_submit_directory"] = submit_directory
    merged.update(user)
    return merged
