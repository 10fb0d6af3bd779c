"""smddp's MPI driver for SageMaker training jobs, in place of the SDK's ``mpi_driver.py``.

smddp.sagemaker ships this file as ``sm_drivers/distributed_drivers/mpi_driver.py``; it runs
inside the training container next to the SDK's driver helpers. It does what the SDK's MPI
driver does (start sshd, bootstrap the workers, run ``mpirun`` from the first host with the
SDK's options) except for two things:

- ``-np`` is hosts x processes per host. The SDK's driver passes the per-host count, so a job
  on several instances would run on the first one only.
- every rank gets what SageMaker's smdistributed runner gives it: ``MASTER_ADDR`` (the first
  host), ``MASTER_PORT`` (7777), ``SAGEMAKER_INSTANCE_TYPE``, and the ``sagemaker_*``
  hyperparameters in ``SM_FRAMEWORK_PARAMS`` (and ``SM_TRAINING_ENV``'s
  ``additional_framework_parameters``) instead of on the script's command line, as
  SageMaker's training toolkit does. Values already set win.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

sys.path.insert(0, str(Path(__file__).parent.parent))

from common.utils import (  # noqa: E402
    execute_commands,
    get_process_count,
    hyperparameters_to_cli_args,
    logger,
    write_failure_file,
)
from distributed_drivers.mpi_utils import (  # noqa: E402
    bootstrap_master_node,
    bootstrap_worker_node,
    get_mpirun_command,
    start_sshd_daemon,
    write_env_vars_to_file,
    write_status_file_to_workers,
)

#: The SDK's command ends with ``python -m mpi4py <entry script>``.
_PROGRAM_WORDS = 4


def _split_hyperparameters(env: Mapping[str, str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(the script's hyperparameters, the sagemaker_* framework parameters)`` from ``SM_HPS``."""
    hps = json.loads(env.get("SM_HPS") or "{}")
    framework = {k: v for k, v in hps.items() if k.startswith("sagemaker_")}
    return {k: v for k, v in hps.items() if k not in framework}, framework


def rank_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables this driver adds for every rank (those ``env`` lacks)."""
    hosts = json.loads(env["SM_HOSTS"])
    user, framework = _split_hyperparameters(env)
    added = {
        "MASTER_ADDR": env.get("SM_MASTER_ADDR") or hosts[0],
        "MASTER_PORT": str(env.get("SM_MASTER_PORT") or 7777),
        "SAGEMAKER_INSTANCE_TYPE": env.get("SM_CURRENT_INSTANCE_TYPE") or "",
        "SM_FRAMEWORK_PARAMS": json.dumps(framework),
    }
    added = {k: v for k, v in added.items() if v and not env.get(k)}
    if framework:
        added["SM_HPS"] = json.dumps(user)
        if env.get("SM_TRAINING_ENV"):
            training_env = json.loads(env["SM_TRAINING_ENV"])
            training_env["hyperparameters"] = user
            training_env.setdefault("additional_framework_parameters", {}).update(framework)
            added["SM_TRAINING_ENV"] = json.dumps(training_env)
    return added


def mpirun_command(env: Mapping[str, str]) -> List[str]:
    """The ``mpirun`` command that starts the whole job from the first host.

    ``env`` must already hold :func:`rank_environment`'s variables: they are forwarded by name.
    """
    hosts = json.loads(env["SM_HOSTS"])
    config = json.loads(env["SM_DISTRIBUTED_CONFIG"])
    per_host = get_process_count(int(config.get("process_count_per_node") or 0))
    command = get_mpirun_command(
        host_count=len(hosts),
        host_list=[f"{host}:{per_host}" for host in hosts],
        num_processes=per_host * len(hosts),
        additional_options=config.get("mpi_additional_options") or [],
        entry_script_path=env["SM_ENTRY_SCRIPT"],
    )
    exports: List[str] = []
    for name in ("MASTER_ADDR", "MASTER_PORT", "SAGEMAKER_INSTANCE_TYPE", "SM_FRAMEWORK_PARAMS", "SM_HPS",
                 "SM_TRAINING_ENV"):
        if name in env:
            exports += ["-x", name]
    at = len(command) - _PROGRAM_WORDS
    user, _ = _split_hyperparameters(env)
    return command[:at] + exports + command[at:] + hyperparameters_to_cli_args(user)


def main() -> None:
    """Start sshd; workers wait for the first host, which runs the job and then releases them."""
    hosts = json.loads(os.environ["SM_HOSTS"])
    master = os.environ["SM_MASTER_ADDR"]
    write_env_vars_to_file()
    start_sshd_daemon()
    if os.environ["SM_CURRENT_HOST"] != master:
        bootstrap_worker_node(master)
        return
    workers = [host for host in hosts if host != master]
    bootstrap_master_node(workers)
    os.environ.update(rank_environment(os.environ))
    command = mpirun_command(os.environ)
    logger.info(f"Executing command: {' '.join(command)}")
    exit_code, error_traceback = execute_commands(command)
    write_status_file_to_workers(workers)
    if exit_code != 0:
        write_failure_file(error_traceback)
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
