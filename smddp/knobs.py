"""Every ``SMDDP_*`` environment variable smddp reads, and the one parser of every variable smddp reads.

One table (:data:`KNOBS`) and one reader (:func:`value`): each module that honours a variable
asks :func:`value` for it, where it used to parse ``os.environ`` itself, so a variable has one
default, one rule and one error. A rule (:class:`Rule`) says what a value must be: its type, its
range (sizes positive and bounded, multiples where the plane needs them, numbers finite), its
choices; a value outside it is refused where it is read, by an error that names the variable, the
value, where it came from, and what is allowed (``SMDDP_BACKEND=bogus (environment) is not one of
the choices: SMDDP_BACKEND takes one of auto, ...``). The launcher's own variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``, ...) go through the same parser
(:func:`read`, from :mod:`smddp.job.topology`), named with the launcher that set them.
docs/troubleshooting.md lists the table for users (``tests/job/test_knobs.py`` keeps the two in
step, and checks that every knob has a rule that refuses what it must), and ``smddp-info`` shows
the ones that are set.

Tuning knobs are read once, when the module that uses them is imported (set them before
``import smddp``, or in the launcher's environment); the others when the job starts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from smddp.errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["Knob", "KNOBS", "Rule", "Switch", "OneOf", "Bytes", "Seconds", "Number", "Whole", "Text", "AbsolutePath",
           "NO_DEADLINE_S", "value", "read", "origin", "set_knobs"]

#: The largest byte count any knob takes (256 TiB): far beyond any machine's shared memory, and
#: small enough that a segment of 64 ranks' buffers stays within a signed 64-bit size.
MOST_BYTES = 1 << 48
#: What ``SMDDP_TIMEOUT=none`` (no deadline) means, and the longest timeout: ten years, which
#: every wait smddp and torch make (the store, gloo, threads, the shared-memory core) can hold.
NO_DEADLINE_S = 10 * 365 * 24 * 3600


class Refused(ValueError):
    """A text a rule does not take; its message says why, in a few words (``below 1``)."""


class Rule:
    """What a variable's text must be, and the value it becomes.

    Attributes:
        allowed: what the rule takes, in words for errors and the docs.
        error: the exception a refused text raises (an :class:`~smddp.errors.SMDDPError`).
    """

    allowed = ""
    error = InvalidArgumentError

    def parse(self, text: str):
        """The value of ``text`` (stripped, not empty).

        Raises:
            Refused: the text is not of the rule's type, or its value is out of its range or choices.
        """
        raise NotImplementedError

    def admits(self, found) -> bool:
        """True if ``found`` is a value this rule could have returned (the tests' check)."""
        raise NotImplementedError


class Switch(Rule):
    """On or off: ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` (any case).

    Args:
        also_on: more words that turn it on (``SMDDP_DEBUG`` takes torch's ``info`` and ``detail``).
    """

    ON = ("1", "true", "yes", "on")
    OFF = ("0", "false", "no", "off")

    def __init__(self, *also_on: str):
        self.on = self.ON + also_on
        self.allowed = "1 or 0 (true/false, yes/no, on/off" + "".join(f", {w}" for w in also_on) + ")"

    def parse(self, text: str) -> bool:
        word = text.lower()
        if word in self.on or word in self.OFF:
            return word in self.on
        raise Refused("neither on nor off")

    def admits(self, found) -> bool:
        return isinstance(found, bool)


class OneOf(Rule):
    """One of a few words, in any case (``_`` read as ``-``); the value is the word as listed.

    Args:
        choices: the words.
        noun: what a word names, for the error (``"backend"``: *is an unknown backend 'x'*).
        error: the exception a word not listed raises (the one a wrong argument of the same kind raises).
    """

    def __init__(self, *choices: str, noun: str = "", error=InvalidArgumentError):
        self.choices, self.noun, self.error = tuple(choices), noun, error
        self.allowed = "one of " + ", ".join(self.choices)

    def parse(self, text: str) -> str:
        word = text.lower().replace("_", "-")
        if word not in self.choices:
            raise Refused(f"an unknown {self.noun} {word!r}" if self.noun else "not one of the choices")
        return word

    def admits(self, found) -> bool:
        return found in self.choices


def _number(text: str, what: str) -> float:
    try:
        found = float(text)
    except ValueError:
        raise Refused(f"not {what}") from None
    if not math.isfinite(found):
        raise Refused("not a finite number")
    return found


class Whole(Rule):
    """A whole number from ``least`` to ``most``.

    Args:
        least: the smallest value taken.
        most: the largest.
        unit: what it counts, for the words (``"bytes"``), or "".
        multiple: every value is a multiple of this.
    """

    def __init__(self, least: int, most: int, unit: str = "", multiple: int = 1):
        self.least, self.most, self.unit, self.multiple = least, most, unit, multiple
        what = f"a whole number of {unit}" if unit else "a whole number"
        self.allowed = f"{what} from {least} to {_size_words(most) if unit == 'bytes' else most}"
        if multiple > 1:
            self.allowed += f", a multiple of {multiple}"

    def parse(self, text: str) -> int:
        what = f"a whole number of {self.unit}" if self.unit else "a whole number"
        try:
            found = int(text)
        except ValueError:
            real = _number(text, what)  # 1e6 is a whole number too; 4096.5, inf and nan are not
            if real != int(real):
                raise Refused(f"not {what}") from None
            found = int(real)
        if found < self.least:
            raise Refused(f"below {self.least}")
        if found > self.most:
            raise Refused(f"above {self.most}")
        if found % self.multiple:
            raise Refused(f"not a multiple of {self.multiple}")
        return found

    def admits(self, found) -> bool:
        return (type(found) is int and self.least <= found <= self.most  # noqa: E721 - bool is not a count
                and found % self.multiple == 0)


def _size_words(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n} ({n >> shift} {unit})"
    return str(n)


def Bytes(least: int = 1, multiple: int = 1) -> Whole:  # noqa: N802 - reads as the rule's name in the table
    """A byte count from ``least`` to :data:`MOST_BYTES`, a multiple of ``multiple``."""
    return Whole(least, MOST_BYTES, "bytes", multiple)


def _plain(x: float) -> str:
    return str(int(x)) if x == int(x) else repr(x)


class Number(Rule):
    """A finite number from ``least`` to ``most``.

    Args:
        least: the smallest value taken.
        most: the largest.
        unit: what it measures, for the words.
    """

    def __init__(self, least: float, most: float, unit: str):
        self.least, self.most, self.unit = least, most, unit
        self.allowed = f"a number of {unit} from {_plain(least)} to {_plain(most)}"

    def parse(self, text: str) -> float:
        found = _number(text, f"a number of {self.unit}")
        if found < self.least:
            raise Refused(f"below {_plain(self.least)}")
        if found > self.most:
            raise Refused(f"above {_plain(self.most)}")
        return found

    def admits(self, found) -> bool:
        return isinstance(found, float) and self.least <= found <= self.most


class Seconds(Rule):
    """A duration in seconds, above 0 and at most :data:`NO_DEADLINE_S`, or ``none`` (no deadline).

    Users write 0 or -1 for "no timeout", which torch's stores read as "give up at once": neither
    is taken; ``none`` is the spelling for no deadline (:data:`NO_DEADLINE_S`).
    """

    NONE = "none"
    allowed = f"a number of seconds above 0 and at most {NO_DEADLINE_S} (ten years), or none for no deadline"

    def parse(self, text: str) -> float:
        if text.lower() == self.NONE:
            return float(NO_DEADLINE_S)
        found = _number(text, "a number")
        if found <= 0:
            raise Refused("not above 0 (write none for no deadline)")
        if found > NO_DEADLINE_S:
            raise Refused(f"above {NO_DEADLINE_S} (write none for no deadline)")
        return found

    def admits(self, found) -> bool:
        return isinstance(found, float) and 0 < found <= NO_DEADLINE_S


class Text(Rule):
    """Text matching ``pattern`` (whole), described as ``what``.

    Args:
        pattern: a regular expression the whole (stripped) text must match.
        what: what the text is, in words.
    """

    def __init__(self, pattern: str, what: str):
        self.pattern = re.compile(pattern)
        self.allowed = what

    def parse(self, text: str) -> str:
        if self.pattern.fullmatch(text) is None:
            raise Refused("not " + self.allowed.split(" (")[0])
        return text

    def admits(self, found) -> bool:
        return isinstance(found, str) and self.pattern.fullmatch(found) is not None


class AbsolutePath(Text):
    """An absolute path (every rank then means the same directory, whatever its working directory)."""

    def __init__(self):
        super().__init__(r"/[^\x00-\x1f]{0,4095}", "an absolute path (starting with /)")


_PRINTABLE = r"[^\x00-\x1f\x7f]{1,%d}"


@dataclass(frozen=True)
class Knob:
    """One environment variable.

    Attributes:
        name: the variable (``SMDDP_...``).
        default: its value when unset or empty (None: no value).
        rule: what its text must be and the value it becomes (:class:`Rule`).
        meaning: what it sets, in the words of the docs.
        trades: what moving it away from the default costs and buys ("" for a plain switch).
    """

    name: str
    default: object
    rule: Rule
    meaning: str
    trades: str = ""


#: The backends ``SMDDP_BACKEND`` names (``smddp.comm.BACKENDS``' names, and the automatic choice);
#: ``tests/job/test_knobs.py`` keeps the two in step.
BACKEND_CHOICES = ("auto", "smddp", "mpi", "gloo", "local", "nccl", "torch-nccl", "xccl", "ccl", "torch-gloo")

KNOBS: Dict[str, Knob] = {k.name: k for k in (
    # ---- the job
    Knob("SMDDP_BACKEND", None, OneOf(*BACKEND_CHOICES, noun="backend", error=BackendUnavailableError),
         "the backend (mpi, gloo, torch-nccl, nccl, xccl, ccl, torch-gloo, local) instead of the automatic choice"),
    Knob("SMDDP_TIMEOUT", None, Seconds(),
         "how long a collective may take, in seconds, before CollectiveTimeout (when the script "
         "passes no timeout=)"),
    Knob("SMDDP_DEBUG", False, Switch("info", "detail"),
         "compare every collective across ranks before it runs (names the mismatch), print "
         "the CPU plane each group took, and at the end how long each rank waited for a CPU",
         "one small exchange per collective"),
    Knob("SMDDP_CPU_BIND", "auto", OneOf("auto", "none"),
         "auto: under torchrun and smddprun's own launcher (which bind no rank), each rank of a host runs "
         "on its own share of the host's CPUs, as mpirun binds its ranks; none: leave placement to the OS"),
    Knob("SMDDP_ALIAS_SMDISTRIBUTED", True, Switch(),
         "0: processes smddprun starts do not map smdistributed imports to smddp"),
    Knob("SMDDP_MPIRUN", None, Text(_PRINTABLE % 4096, "a command: a path, or a name on PATH"),
         "the mpirun smddprun runs (default: the one beside this Python, then PATH)"),
    Knob("SMDDP_DDP_HOOK", True, Switch(),
         "0: smddp's DistributedDataParallel keeps torch's path (no communication hook) on the "
         "shared-memory plane",
         "off: each bucket's all-reduce goes through a Work and the progress thread"),
    Knob("SMDDP_SOCKET_IFNAME", None, Text(r"[^\s/]{1,15}", "an interface name (1 to 15 characters, no spaces or /)"),
         "the network interface smddp's store and gloo listen on, and smddprun's mpirun uses "
         "(default: loopback on one host; every interface across hosts)"),
    Knob("SMDDP_HOST_ID", None, Text(_PRINTABLE % 255, "a name of 1 to 255 printable characters"),
         "the name ranks compare to find their host-mates (default: the host name)"),
    # ---- CPU planes
    Knob("SMDDP_CPU_PLANE", "auto", OneOf("auto", "shm", "hierarchical", "mpi", "gloo"),
         "auto, shm, hierarchical, or a flat backend (mpi, gloo): pins how CPU bytes move"),
    Knob("SMDDP_SHM_NATIVE", True, Switch(),
         "0: the shared-memory plane runs its Python path instead of the compiled core"),
    Knob("SMDDP_HIERARCHICAL_MIN_BYTES", 256 * 1024, Bytes(),
         "all-reduces smaller than this stay on the flat backend on the hierarchical plane",
         "lower: more small messages take two extra steps within each host"),
    Knob("SMDDP_SHM_CHUNK_BYTES", 1 << 20, Bytes(),
         "bytes per step of the compiled core's larger collectives",
         "larger: fewer steps, but a step's buffers may fall out of the caches"),
    Knob("SMDDP_SHM_ONE_SHOT_MAX", 32 << 10, Bytes(),
         "all-reduces up to this many bytes run in one step in the compiled core",
         "larger: fewer synchronisations, but every rank reduces every byte"),
    Knob("SMDDP_SHM_CMA", False, Switch(),
         "1: all-reduces on one host from SMDDP_SHM_CMA_MIN_BYTES read and write the peers' buffers "
         "directly (cross-memory attach: process_vm_readv/writev) instead of copying through the "
         "shared segment, where the kernel lets the host's ranks; a rank with it off turns it off "
         "for its host",
         "on: fewer copies, but the kernel's cost per page of the peers' buffers (measured slower "
         "than the segment at every size to 64 MB on a 2-core VM: docs/performance.md)"),
    Knob("SMDDP_SHM_CMA_MIN_BYTES", 64 << 20, Bytes(),
         "all-reduces of at least this many bytes read and write the peers' buffers directly, where "
         "the kernel lets the host's ranks do so",
         "lower: smaller messages skip the segment's copies but pay the kernel's cost per page "
         "(benchmarks/allreduce_cpu.py's smddp-segment column shows which wins on a machine)"),
    Knob("SMDDP_SHM_SPIN_US", 20.0, Number(0, 1e6, "microseconds"),
         "microseconds a wait on the peers spins before it sleeps",
         "longer: lower latency when peers are close behind, less CPU for a rank still computing"),
    # A multiple of 8: the segment is read as 64-bit words, and a slot holds whole float64s.
    Knob("SMDDP_SHM_SLOT_BYTES", 4 << 20, Bytes(8, multiple=8),
         "bytes of each of a rank's two shared-memory buffers",
         "larger: fewer steps for large messages, more shared memory per rank and per subgroup"),
    Knob("SMDDP_SHM_DIR", "/dev/shm", AbsolutePath(), "where the shared-memory segments are created"),
    # ---- MPI
    Knob("SMDDP_SHM_MAX_BYTES", 512 << 20, Bytes(),
         "the most shared memory one process maps for its groups' segments; a group whose segment would "
         "pass it runs its CPU collectives on its flat path",
         "larger: more groups (subgroups, DeviceMesh dimensions) on shared memory, more RAM committed"),
    Knob("SMDDP_MPI_RING_MIN_BYTES", 256 * 1024, Bytes(),
         "all-reduces of at least this many bytes take the large-message path under MPI",
         "lower: more messages take smddp's ring instead of MPI_Iallreduce"),
    Knob("SMDDP_MPI_LARGE_ALLREDUCE", "ring", OneOf("ring", "blocking"),
         "ring (smddp's, progressed by whoever tests it) or blocking (MPI_Allreduce on a thread)",
         "blocking: about 10% faster alone, but its busy-polling slows DDP's backward"),
    # ---- NCCL
    Knob("SMDDP_NCCL_STREAM", "side", OneOf("side", "current"),
         "side (each group's own stream, as torch's NCCL group) or current (the caller's current "
         "stream): where smddp's NCCL collectives run",
         "current: no overlap of DDP's reduction with backward, no event per collective"),
    Knob("SMDDP_NCCL_ASYNC_ERROR_HANDLING", None, Whole(0, 3),
         "what an NCCL collective past its deadline, or an NCCL error, does: 3 ends the process "
         "(torch's default), 2 aborts the communicator and raises at the next call, 1 aborts then "
         "ends, 0 only raises (unset: TORCH_NCCL_ASYNC_ERROR_HANDLING, else 3)",
         "2: the script may catch the error, but a host read before the next call sees un-reduced data"),
)}


def _shown(text: str) -> str:
    """``text`` as an error shows it: bare when it is one plain word, else quoted (and cut)."""
    if re.fullmatch(r"[\w.+\-/:@,%]{1,80}", text):
        return text
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def read(name: str, text: str, rule: Rule, source: str, after: str = ""):
    """The value of variable ``name``'s ``text`` under ``rule``: the one parser of every variable.

    Args:
        name: the variable (a knob, or a launcher's: ``WORLD_SIZE``, ``MASTER_PORT`` ...).
        text: its text (stripped here).
        rule: what it must be.
        source: where it came from, for the error (``"environment"``, ``"set by torchrun"``).
        after: what the error adds after the rule (what the variable sets, what to do).

    Raises:
        InvalidArgumentError: ``rule`` refuses the text (or the rule's own ``error``); the message names
            the variable, the value, ``source``, why, and what ``rule`` allows.
    """
    try:
        return rule.parse(text.strip())
    except Refused as why:
        raise rule.error(f"{name}={_shown(text)} ({source}) is {why}: {name} takes {rule.allowed}{after}") from None


def value(name: str, env: Optional[Mapping[str, str]] = None, source: str = "environment"):
    """The value of environment variable ``name`` (one of :data:`KNOBS`), parsed.

    Args:
        name: the variable.
        env: the environment to read (default: ``os.environ``).
        source: where ``env`` came from, for the error.

    Returns:
        Its value, or its default when it is unset or empty.

    Raises:
        InvalidArgumentError: its rule refuses the value: not of its type, out of its range, not
            one of its choices (the error names the variable, the value, ``source`` and what is allowed);
            ``SMDDP_BACKEND`` raises BackendUnavailableError, as an unknown ``backend=`` argument does.
        KeyError: ``name`` is not one of :data:`KNOBS`.
    """
    knob = KNOBS[name]
    text = (os.environ if env is None else env).get(name, "")
    if not text.strip():
        return knob.default
    after = f"; unset it for the default{_default_words(knob)}. {name}: {knob.meaning}"
    return read(name, text, knob.rule, source, after)


def _default_words(knob: Knob) -> str:
    if knob.default is None:
        return ""
    if isinstance(knob.default, bool):
        return " (on)" if knob.default else " (off)"
    return f" ({knob.default})"


def origin(name: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Where knob ``name``'s value comes from, for messages: ``"environment"`` or ``"the default"``."""
    return "environment" if (os.environ if env is None else env).get(name, "").strip() else "the default"


def set_knobs(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The ``SMDDP_*`` variables of :data:`KNOBS` that are set in ``env``, as text."""
    env = os.environ if env is None else env
    return {name: env[name] for name in KNOBS if env.get(name, "").strip()}
