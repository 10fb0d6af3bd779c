"""The first code of every process in a local-mode job: become a process on an emulated host.

``python _entry.py SPEC script.py [args]`` reads the job's spec (written by :mod:`._local`),
finds this process's emulated host from its rank (ranks fill hosts in order), exports that
host's SageMaker container environment (``SM_*``), makes the launcher's local rank and size
count within the emulated host, lets Hugging Face and accelerate take SageMaker's data-parallel
switch on CPU (:mod:`smddp.launch.sagemaker_switch`), then runs the script as ``python script.py
args`` would.
An uncaught error is written to the host's ``output/failure`` file, as SageMaker's training
toolkit does, so the estimator can report it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import Mapping, MutableMapping

from smddp.job import runtime
from smddp.job.topology import discover
from smddp.launch import sagemaker_switch

# Launcher variables for (local rank, local size, node rank), by launcher.
_LOCAL_VARS = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
)


def host_environment(spec: Mapping, env: MutableMapping[str, str]) -> str:
    """Apply the emulated host of this process's rank to ``env``; return the host's name."""
    rank = discover(env).rank
    hosts = spec["hosts"]
    per_host = spec["processes_per_host"]
    index = min(rank // per_host, len(hosts) - 1)
    host = hosts[index]
    env.update(spec["env"][host])
    if len(hosts) > 1:
        local_rank = rank - index * per_host
        for rank_var, size_var, node_var in _LOCAL_VARS:
            if rank_var in env:
                env[rank_var] = str(local_rank)
                env[size_var] = str(per_host)
                if node_var:
                    env[node_var] = str(index)
        env["SMDATAPARALLEL_LOCAL_RANK"] = str(local_rank)
    return host


def _write_failure(exc: BaseException) -> None:
    output_dir = os.environ.get("SM_OUTPUT_DIR")
    if not output_dir:
        return
    path = os.path.join(output_dir, "failure")
    if isinstance(exc, SystemExit):
        message = f"the training script exited with status {exc.code}"
    else:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        message = "".join(lines[-3:]).strip()
    try:
        with open(path, "x") as failure:
            failure.write(f"[{os.environ.get('SM_CURRENT_HOST', '?')}] {message}\n")
    except OSError:
        pass  # another process of the job reported first


def main() -> None:
    """Entry point: ``_entry.py SPEC script.py [args]``."""
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m smddp.sagemaker._entry SPEC script.py [args]")
    with open(sys.argv[1]) as spec_file:
        spec = json.load(spec_file)
    host_environment(spec, os.environ)
    instance_type = runtime.instance_type(os.environ)  # known only now, from the host's SM_* values
    if instance_type:
        os.environ.setdefault("SAGEMAKER_INSTANCE_TYPE", instance_type)
    sagemaker_switch.apply()  # SM_FRAMEWORK_PARAMS is known only now
    script, args = sys.argv[2], sys.argv[3:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_failure(exc)
        raise
    except BaseException as exc:
        _write_failure(exc)
        raise


if __name__ == "__main__":
    main()
