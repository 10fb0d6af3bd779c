"""smddp's MPI driver for SageMaker training jobs, in place of the SDK's ``mpi_driver.py``.

smddp.sagemaker ships this file as ``sm_drivers/distributed_drivers/mpi_driver.py``; it runs
inside the training container next to the SDK's driver helpers. It does what the SDK's MPI
driver does (start sshd, bootstrap the workers, run ``mpirun`` from the first host with the
SDK's options) except for one thing: ``-np`` is hosts x processes per host. The SDK's driver
passes the per-host count, so a job on several instances would run on the first one only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Mapping

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


def mpirun_command(env: Mapping[str, str]) -> List[str]:
    """The ``mpirun`` command that starts the whole job from the first host."""
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
    return command + hyperparameters_to_cli_args(json.loads(env["SM_HPS"]))


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
    command = mpirun_command(os.environ)
    logger.info(f"Executing command: {' '.join(command)}")
    exit_code, error_traceback = execute_commands(command)
    write_status_file_to_workers(workers)
    if exit_code != 0:
        write_failure_file(error_traceback)
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
