"""smddprun's command line: its options, apart from the program and the program's arguments.

``smddprun [options] (script.py | -m module) [args]``: everything from the program on belongs
to the program, even words that look like smddprun's options. :func:`parse_args` returns an
:class:`Options`; :mod:`smddp.launch` decides from it how to start the job.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

_EPILOG = """\
examples:
  smddprun -np 2 train.py --epochs 3        one host, 2 processes
  smddprun -H node1:8,node2:8 train.py      2 hosts, 8 processes each (np defaults to 16)
  smddprun -np 4 -x NCCL_DEBUG=INFO -m my_pkg.train
  smddprun -np 2 --dry-run train.py         print the command, start nothing

what each process gets (as on SageMaker; values already set win):
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, SMDATAPARALLEL_LOCAL_RANK, MASTER_ADDR (the
  first host of -H/--hostfile or of the Slurm allocation, else 127.0.0.1), MASTER_PORT (a free
  port), SAGEMAKER_INSTANCE_TYPE (when SM_* says it), and the smdistributed import alias:
  'import smdistributed.dataparallel.torch.distributed' is smddp's module, unless a real
  smdistributed is installed (then that one is used) or --no-alias. A RANK or WORLD_SIZE
  that contradicts the job, or a MASTER_PORT in use here, is an error before anything starts.
  On one host also OMP_NUM_THREADS = cores / N (unless set), as torchrun does.
  Forwarded to every rank: SMDDP_*, NCCL_*, FI_*, SM_*, CUDA_VISIBLE_DEVICES, PYTHONPATH,
  PATH, LD_LIBRARY_PATH, OMP_NUM_THREADS, and each -x.

which launcher (--launcher auto, the default):
  one host (no -H, --hostfile or batch allocation), no --mpi-args, no SMDDP_MPIRUN: smddprun
  starts the processes itself; they use shared memory between them and the job listens on no
  network address (docs/security.md). A script that uses mpi4py itself needs MPI: pass
  --launcher mpirun (mpi4py stops such a script with that advice instead of seeing 1 process).
  Otherwise mpirun: $SMDDP_MPIRUN, else the one beside this Python (pip install 'smddp[mpi]'
  puts Open MPI there), else mpirun or mpiexec on PATH (Open MPI, MPICH or Intel MPI); with
  none, one host's processes are started here all the same.
"""


@dataclass
class Options:
    """What the command line asked for."""

    nproc: Optional[int] = None
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    exports: List[str] = field(default_factory=list)
    mpi_args: List[str] = field(default_factory=list)
    launcher: str = "auto"
    python: str = sys.executable
    alias: bool = True
    dry_run: bool = False
    program: List[str] = field(default_factory=list)  # [script, args...] or ["-m", module, args...]



_VALUE_OPTIONS = {"-np", "-n", "--np", "--nproc", "--hostfile", "-H", "--host", "-x", "--mpi-args",
                  "--launcher", "--python"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smddprun", allow_abbrev=False, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="smddprun [-np N] [--hostfile FILE | -H HOST:SLOTS,...] [-x VAR[=VAL]]... "
              "[--mpi-args ARGS] [--dry-run] (script.py | -m module) [args ...]",
        description="Run a PyTorch script on N processes with smddp, like SageMaker's smdistributed "
                    "runner: on one host as processes it starts itself, across hosts under mpirun.",
    )
    p.add_argument("-np", "-n", "--np", "--nproc", dest="nproc", type=int, metavar="N",
                   help="number of processes (default: the hosts' slots, else SM_NUM_GPUS, "
                        "else the CUDA GPUs here, else 1)")
    p.add_argument("--hostfile", metavar="FILE", help="Open MPI hostfile ('host slots=N' lines)")
    p.add_argument("-H", "--host", dest="hosts", metavar="HOST:SLOTS,...",
                   help="hosts and their slots, e.g. node1:8,node2:8")
    p.add_argument("-x", dest="exports", action="append", default=[], metavar="VAR[=VAL]",
                   help="set (VAR=VAL) or forward (VAR) a variable for every rank; repeatable")
    p.add_argument("--mpi-args", default="", metavar="ARGS",
                   help='more mpirun arguments, one quoted string: --mpi-args "--bind-to none"')
    p.add_argument("--launcher", choices=("auto", "mpirun", "local"), default="auto",
                   help="auto (default): local processes on one host, mpirun across hosts or with "
                        "--mpi-args; mpirun: always mpirun; local: always local processes")
    p.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="interpreter for the ranks (default: this one, %(default)s)")
    p.add_argument("--no-alias", dest="alias", action="store_false",
                   help="do not map 'import smdistributed.dataparallel...' to smddp")
    p.add_argument("--dry-run", action="store_true", help="print the command(s), start nothing")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    p.add_argument("script", nargs="?", help="the training script")
    return p


def _split_program(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Separate smddprun's own options from the program and its arguments.

    The program starts at the first word that is not an option or an option's value, at
    ``-m MODULE``, or after ``--``; everything from there belongs to the program.
    ``--mpi-args VALUE`` becomes ``--mpi-args=VALUE``: its value usually starts with a dash,
    which argparse would take for an option.
    """
    own: List[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return own, list(argv[i + 1:])
        if word == "-m":
            return own + list(argv[i:i + 2]), list(argv[i + 2:])
        if word == "--mpi-args" and i + 1 < len(argv):
            own.append(f"--mpi-args={argv[i + 1]}")
            i += 2
        elif word in _VALUE_OPTIONS:
            own += list(argv[i:i + 2])
            i += 2
        elif word.startswith("-"):
            own.append(word)
            i += 1
        else:
            return own + [word], list(argv[i + 1:])
    return own, []


def parse_args(argv: Sequence[str]) -> Options:
    """Read smddprun's command line.

    Raises:
        SystemExit: on ``--help`` or an invalid command line (argparse's exit status 2).
    """
    parser = _parser()
    own, rest = _split_program(argv)
    ns = parser.parse_args(own)
    if ns.module and ns.script:
        rest = [ns.script, *rest]
    if ns.module:
        program = ["-m", ns.module, *rest]
    elif ns.script:
        program = [ns.script, *rest]
    elif rest:
        program = rest
    else:
        parser.error("no program: give a script (smddprun -np 2 train.py) or -m module")
    if ns.hosts and ns.hostfile:
        parser.error("give --hostfile or -H, not both")
    if ns.nproc is not None and ns.nproc < 1:
        parser.error(f"-np must be at least 1, got {ns.nproc}")
    for spec in ns.exports:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(=|$)", spec):
            parser.error(f"-x {spec!r}: expected VAR or VAR=VALUE")
    return Options(
        nproc=ns.nproc, hosts=ns.hosts, hostfile=ns.hostfile, exports=list(ns.exports),
        mpi_args=shlex.split(ns.mpi_args), launcher=ns.launcher, python=ns.python,
        alias=ns.alias, dry_run=ns.dry_run, program=program,
    )
