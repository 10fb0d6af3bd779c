"""discover() is a pure function of the environment: one row per launcher."""

from __future__ import annotations

import pytest

from smddp._topology import Topology, discover

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
                                     "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1", "MASTER_PORT": "1234"},
     Topology(2, 3, 0, 1, 1, "10.1.1.1", 1234, "slurm")),
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
    ("torchrun wins over MPI", {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                                "OMPI_COMM_WORLD_SIZE": "2"},
     Topology(0, 2, 0, 2, 0, None, None, "torchrun")),
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


@pytest.mark.parametrize("env,match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "outside"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "local rank"),
])
def test_bad_environment(env, match):
    with pytest.raises(ValueError, match=match):
        discover(env)


def test_flags():
    assert not Topology().distributed
    assert discover({"PMI_RANK": "0", "PMI_SIZE": "1"}).mpi
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}).distributed
    assert not discover({"RANK": "0", "WORLD_SIZE": "1"}).mpi
