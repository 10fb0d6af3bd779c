"""Every ``SMDDP_*`` environment variable smddp reads: its default, what it does, what it trades.

One table (:data:`KNOBS`) and one reader (:func:`value`): each module that honours a variable
asks :func:`value` for it, where it used to parse ``os.environ`` itself, so a variable has one
default, one parser and one error for a value that does not parse. docs/tools.md lists the same
table for users (``tests/house/test_docs.py`` keeps the two in step), and ``smddp-info`` shows the
ones that are set.

Tuning knobs are read once, when the module that uses them is imported (set them before
``import smddp``, or in the launcher's environment); the others when the job starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional

from smddp.errors import InvalidArgumentError

__all__ = ["Knob", "KNOBS", "flag", "value", "set_knobs"]


def flag(text: str) -> bool:
    """A switch's value: anything but empty, ``0``, ``false``, ``no`` or ``off`` turns it on."""
    return text.strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Knob:
    """One environment variable.

    Attributes:
        name: the variable (``SMDDP_...``).
        default: its value when unset or empty (None: no value).
        parse: turns the text into the value (``int``, ``float``, ``str``, :func:`flag`).
        meaning: what it sets, in the words of the docs.
        trades: what moving it away from the default costs and buys ("" for a plain switch).
    """

    name: str
    default: object
    parse: Callable[[str], object]
    meaning: str
    trades: str = ""

    @property
    def expects(self) -> str:
        """What a valid value is, in words, for errors."""
        return {int: "a whole number", _bytes: "a number of bytes", float: "a number"}.get(self.parse, "valid")


def _bytes(text: str) -> int:
    return int(float(text))


KNOBS: Dict[str, Knob] = {k.name: k for k in (
    # ---- the job
    Knob("SMDDP_BACKEND", None, str,
         "the backend (mpi, gloo, nccl, torch-nccl, xccl, ccl, local) instead of the automatic choice"),
    Knob("SMDDP_TIMEOUT", None, float,
         "how long a collective may take, in seconds, before CollectiveTimeout (when the script "
         "passes no timeout=)"),
    Knob("SMDDP_DEBUG", False, flag,
         "compare every collective across ranks before it runs (names the mismatch), and print "
         "the CPU plane each group took",
         "one small exchange per collective"),
    Knob("SMDDP_ALIAS_SMDISTRIBUTED", True, flag,
         "0: processes smddprun starts do not map smdistributed imports to smddp"),
    Knob("SMDDP_MPIRUN", None, str,
         "the mpirun smddprun runs (default: the one beside this Python, then PATH)"),
    Knob("SMDDP_DDP_HOOK", True, flag,
         "0: smddp's DistributedDataParallel keeps torch's path (no communication hook) on the "
         "shared-memory plane",
         "off: each bucket's all-reduce goes through a Work and the progress thread"),
    Knob("SMDDP_SOCKET_IFNAME", None, str,
         "the network interface smddp's store and gloo listen on, and smddprun's mpirun uses "
         "(default: loopback on one host; every interface across hosts)"),
    Knob("SMDDP_HOST_ID", None, str,
         "the name ranks compare to find their host-mates (default: the host name)"),
    # ---- CPU planes
    Knob("SMDDP_CPU_PLANE", "auto", str,
         "auto, shm, hierarchical, or a flat backend (mpi, gloo): pins how CPU bytes move"),
    Knob("SMDDP_SHM_NATIVE", True, flag,
         "0: the shared-memory plane runs its Python path instead of the compiled core"),
    Knob("SMDDP_HIERARCHICAL_MIN_BYTES", 256 * 1024, _bytes,
         "all-reduces smaller than this stay on the flat backend on the hierarchical plane",
         "lower: more small messages take two extra steps within each host"),
    Knob("SMDDP_SHM_CHUNK_BYTES", 1 << 20, _bytes,
         "bytes per step of the compiled core's larger collectives",
         "larger: fewer steps, but a step's buffers may fall out of the caches"),
    Knob("SMDDP_SHM_ONE_SHOT_MAX", 32 << 10, _bytes,
         "all-reduces up to this many bytes run in one step in the compiled core",
         "larger: fewer synchronisations, but every rank reduces every byte"),
    Knob("SMDDP_SHM_CMA", False, flag,
         "1: all-reduces on one host from SMDDP_SHM_CMA_MIN_BYTES read and write the peers' buffers "
         "directly (cross-memory attach: process_vm_readv/writev) instead of copying through the "
         "shared segment, where the kernel lets the host's ranks; a rank with it off turns it off "
         "for its host",
         "on: fewer copies, but the kernel's cost per page of the peers' buffers (measured slower "
         "than the segment at every size to 64 MB on a 2-core VM: docs/performance.md)"),
    Knob("SMDDP_SHM_CMA_MIN_BYTES", 64 << 20, _bytes,
         "all-reduces of at least this many bytes read and write the peers' buffers directly, where "
         "the kernel lets the host's ranks do so",
         "lower: smaller messages skip the segment's copies but pay the kernel's cost per page "
         "(benchmarks/allreduce_cpu.py's smddp-segment column shows which wins on a machine)"),
    Knob("SMDDP_SHM_SPIN_US", 20.0, float,
         "microseconds a wait on the peers spins before it sleeps",
         "longer: lower latency when peers are close behind, less CPU for a rank still computing"),
    Knob("SMDDP_SHM_SLOT_BYTES", 4 << 20, _bytes,
         "bytes of each of a rank's two shared-memory buffers",
         "larger: fewer steps for large messages, more shared memory per rank and per subgroup"),
    Knob("SMDDP_SHM_DIR", "/dev/shm", str, "where the shared-memory segments are created"),
    # ---- MPI
    Knob("SMDDP_MPI_RING_MIN_BYTES", 256 * 1024, _bytes,
         "all-reduces of at least this many bytes take the large-message path under MPI",
         "lower: more messages take smddp's ring instead of MPI_Iallreduce"),
    Knob("SMDDP_MPI_LARGE_ALLREDUCE", "ring", str,
         "ring (smddp's, progressed by whoever tests it) or blocking (MPI_Allreduce on a thread)",
         "blocking: about 10% faster alone, but its busy-polling slows DDP's backward"),
    # ---- NCCL
    Knob("SMDDP_NCCL_STREAM", "side", str,
         "side (each group's own stream, as torch's NCCL group) or current (the caller's current "
         "stream): where smddp's NCCL collectives run",
         "current: no overlap of DDP's reduction with backward, no event per collective"),
    Knob("SMDDP_NCCL_ASYNC_ERROR_HANDLING", None, int,
         "what an NCCL collective past its deadline, or an NCCL error, does: 3 ends the process "
         "(torch's default), 2 aborts the communicator and raises at the next call, 1 aborts then "
         "ends, 0 only raises (unset: TORCH_NCCL_ASYNC_ERROR_HANDLING, else 3)",
         "2: the script may catch the error, but a host read before the next call sees un-reduced data"),
)}


def value(name: str, env: Optional[Mapping[str, str]] = None):
    """The value of environment variable ``name`` (one of :data:`KNOBS`), parsed.

    Args:
        name: the variable.
        env: the environment to read (default: ``os.environ``).

    Returns:
        Its parsed value, or its default when it is unset or empty.

    Raises:
        InvalidArgumentError: the value does not parse (the error names the variable).
        KeyError: ``name`` is not one of :data:`KNOBS`.
    """
    knob = KNOBS[name]
    text = (os.environ if env is None else env).get(name, "")
    if not text.strip():
        return knob.default
    try:
        return knob.parse(text.strip())
    except ValueError:
        default = "" if knob.default is None else f" ({knob.default!r})"
        raise InvalidArgumentError(
            f"{name}={text!r} is not {knob.expects}: {name} sets {knob.meaning}; unset it for the "
            f"default{default}") from None


def set_knobs(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The ``SMDDP_*`` variables of :data:`KNOBS` that are set in ``env``, as text."""
    env = os.environ if env is None else env
    return {name: env[name] for name in KNOBS if env.get(name, "").strip()}
