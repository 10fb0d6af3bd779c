"""discover() is a pure function of the environment: one row per launcher."""

from __future__ import annotations

import socket

import pytest

from smddp.errors import InvalidArgumentError
from smddp.job import runtime
from smddp.job.topology import Topology, discover

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier

CASES = [
    ("plain python", {}, Topology()),
    ("plain python keeps MASTER_*", {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
     Topology(master_addr="h", master_port=1)),
    ("torchrun", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
     Topology(5, 8, 1, 4, 1, "10.0.0.1", 29500, "torchrun")),
    ("torchrun without LOCAL_WORLD_SIZE", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
     Topology(1, 2, 1, 2, 0, None, None, "torchrun")),
    ("open mpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0", "PMIX_RANK": "3"},
     Topology(3, 4, 1, 2, 1, None, None, "openmpi")),
    ("open mpi, second node", {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     Topology(5, 8, 1, 4, 1, None, None, "openmpi")),
    ("mpich / intel mpi", {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
     Topology(6, 8, 2, 4, 1, None, None, "mpich")),
    ("pmix under slurm", {"PMIX_RANK": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0",
                          "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "1"},
     Topology(2, 4, 0, 2, 1, None, None, "pmix")),
    ("slurm srun", {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[003-004]"},
     Topology(3, 4, 1, 2, 1, "gpu003", None, "slurm")),
    ("slurm uneven tasks per node", {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "0",
                                     "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2,1",
                                     "SLURM_STEP_NODELIST": "a1,b2", "MASTER_PORT": "1234"},
     Topology(2, 3, 0, 1, 1, "a1", 1234, "slurm")),
    # Rank 0 runs on the step's first node, not on the node that ran srun (a login node under salloc).
    ("slurm: address from the step's first node, port from the job id",
     {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NODELIST": "node[05-09]",
      "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9", "SLURM_JOB_ID": "4812345"},
     Topology(1, 2, 1, 2, 0, "node07", 17345, "slurm")),
    ("slurm: the job's node list when the step's is missing",
     {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_NODELIST": "cpu-a,cpu-b", "SLURM_JOB_ID": "7"},
     Topology(0, 1, 0, 1, 0, "cpu-a", 15007, "slurm")),
    ("slurm batch shell is not a job", {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
     Topology()),
    ("sagemaker, two hosts", {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "0"},
     Topology(1, 2, 0, 1, 1, "algo-1", 7777, "sagemaker")),
    ("sagemaker, one host", {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_GPUS": "8"},
     Topology()),
    ("sagemaker under mpirun: MPI wins", {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-1",
                                          "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16",
                                          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"},
     Topology(9, 16, 1, 8, 1, None, None, "openmpi")),
    # smddp.launch.bootstrap exports RANK/WORLD_SIZE under mpirun: the MPI variables still decide.
    ("MPI wins over an agreeing RANK", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                        "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     Topology(1, 2, 1, 2, 0, None, None, "openmpi")),
    ("torchrun inside an mpirun job", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                       "TORCHELASTIC_RUN_ID": "x", "OMPI_COMM_WORLD_RANK": "1",
                                       "OMPI_COMM_WORLD_SIZE": "2"},
     Topology(5, 8, 1, 4, 1, None, None, "torchrun")),
    ("smddprun's own launcher", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SMDDP_LAUNCHER_PID": "7",
                                 "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
     Topology(1, 2, 1, 2, 0, None, None, "torchrun")),
]


@pytest.mark.parametrize("name,env,expected", CASES, ids=[c[0] for c in CASES])
def test_discover(name, env, expected):
    assert discover(env) == expected


def test_explicit_rank_and_world_size_win():
    topo = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, rank=3, world_size=4)
    assert (topo.rank, topo.size, topo.launcher) == (3, 4, "explicit")


@pytest.mark.parametrize("kwargs", [{"rank": 1}, {"world_size": 2}])
def test_explicit_needs_both(kwargs):
    with pytest.raises(ValueError, match="both"):
        discover({}, **kwargs)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SMDDPRUN = {"SMDDP_LAUNCHER_PID": "7"}


@pytest.mark.parametrize("env,match", [
    # Issue 53: each launcher variable named with its value, who set it, and what it takes.
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"^RANK=x \(environment\) is not a whole number: RANK takes a whole number "
                                       r"from 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"^RANK=2 \(environment\) is outside the world: RANK takes a whole number "
                                       r"from 0 to 1 \(WORLD_SIZE=2\)"),
    ({"RANK": "0", "WORLD_SIZE": "0", **TORCHRUN}, r"^WORLD_SIZE=0 \(set by torchrun\) is below 1: WORLD_SIZE takes "
                                                   r"a whole number from 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2", **SMDDPRUN}, r"^RANK=-1 \(set by smddprun\) is below 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2", **TORCHRUN},
     r"^LOCAL_RANK=5 \(set by torchrun\) is outside its host: LOCAL_RANK takes a whole number from 0 to 1 "
     r"\(LOCAL_WORLD_SIZE=2\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "-2", **TORCHRUN},
     r"^LOCAL_WORLD_SIZE=-2 \(set by torchrun\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", **SMDDPRUN, "MASTER_PORT": "http"},
     r"^MASTER_PORT=http \(set by smddprun\) is not a whole number: MASTER_PORT takes a whole number from 1 to 65535"),
    ({"MASTER_PORT": "70000"}, r"^MASTER_PORT=70000 \(environment\) is above 65535"),
    ({"MASTER_PORT": "0"}, r"^MASTER_PORT=0 \(environment\) is below 1"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, r"^OMPI_COMM_WORLD_LOCAL_RANK=3 \(set by Open MPI's mpirun\) is outside its "
                                          r"host"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"},
     r"^OMPI_COMM_WORLD_SIZE=0 \(set by Open MPI's mpirun\)"),
    ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, r"^SLURM_PROCID=x \(set by Slurm's srun\)"),
    ({"PMI_RANK": "3", "PMI_SIZE": "2"},
     r"^PMI_RANK=3 \(set by MPICH's or Intel MPI's launcher\) is outside the world"),
])
def test_bad_environment_names_the_variable_and_who_set_it(env, match):
    with pytest.raises(InvalidArgumentError, match=match):
        discover(env)


def test_explicit_ranks_outside_the_world_are_named_as_arguments():
    with pytest.raises(InvalidArgumentError, match=r"^world_size=0 \(init_process_group's argument\)"):
        discover({}, rank=0, world_size=0)
    with pytest.raises(InvalidArgumentError, match=r"^rank=3 \(init_process_group's argument\) is outside the world"):
        discover({}, rank=3, world_size=2)


def test_flags():
    assert not Topology().distributed
    assert discover({"PMI_RANK": "0", "PMI_SIZE": "1"}).mpi
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}).distributed
    assert not discover({"RANK": "0", "WORLD_SIZE": "1"}).mpi


@pytest.mark.parametrize("env,named", [
    ({"RANK": "3", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, ("RANK=3", "RANK=1")),
    ({"RANK": "1", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     ("WORLD_SIZE=4", "WORLD_SIZE=2")),
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, ("RANK=0", "RANK=1")),
    ({"WORLD_SIZE": "8", "PMI_RANK": "0", "PMI_SIZE": "2"}, ("WORLD_SIZE=8", "WORLD_SIZE=2")),
])
def test_rank_set_by_hand_that_contradicts_the_launcher(env, named):
    with pytest.raises(InvalidArgumentError) as info:
        discover(env)
    for value in named:
        assert value in str(info.value)


MPI_RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}


def test_runtime_variables_from_the_launcher():
    env = {**MPI_RANK1, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "SM_CURRENT_INSTANCE_TYPE": "ml.p4d.24xlarge"}
    added = runtime.fill(env, discover(env))
    assert added == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
                     "SMDATAPARALLEL_LOCAL_RANK": "1", "SAGEMAKER_INSTANCE_TYPE": "ml.p4d.24xlarge"}
    assert discover(env).launcher == "openmpi"  # what was exported does not change who launched


def test_runtime_variables_set_by_the_user_win():
    env = {**MPI_RANK1, "LOCAL_RANK": "0", "SMDATAPARALLEL_LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1",
           "SAGEMAKER_INSTANCE_TYPE": "ml.g5.xlarge", "SM_CURRENT_INSTANCE_TYPE": "ml.p4d.24xlarge"}
    runtime.fill(env, discover(env))
    assert (env["LOCAL_RANK"], env["SMDATAPARALLEL_LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "0", "0", "a", "1")
    assert env["SAGEMAKER_INSTANCE_TYPE"] == "ml.g5.xlarge"


@pytest.mark.parametrize("env,expected", [
    ({"SM_TRAINING_ENV": '{"current_instance_type": "ml.p3.16xlarge"}'}, "ml.p3.16xlarge"),
    ({"SM_FRAMEWORK_PARAMS": '{"sagemaker_instance_type": "ml.p4de.24xlarge"}'}, "ml.p4de.24xlarge"),
    ({"SM_FRAMEWORK_PARAMS": "not json"}, None),
    ({}, None),
])
def test_instance_type(env, expected):
    assert runtime.instance_type(env) == expected


def test_a_plain_process_is_not_given_a_rank():
    env = {"PATH": "/bin"}
    assert runtime.fill(env, discover(env)) == {}
    assert not discover(env).distributed


def test_slurm_task_gets_the_derived_address_and_port():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
           "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_JOB_ID": "55"}
    runtime.fill(env, discover(env))
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "2", "n3", "15055")


def test_master_port_in_use_is_named_on_rank_0():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        with pytest.raises(InvalidArgumentError, match=f"MASTER_PORT={port} .*already in use"):
            runtime.fill(env, discover(env))
