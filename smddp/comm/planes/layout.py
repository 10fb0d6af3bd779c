"""One agreed layout per group: where its ranks are, and how they move bytes.

When a group is made, every rank publishes, through the group's store and in the one exchange
that finds its host-mates (:func:`smddp.comm.planes.hostmates.exchange`), what it is and what it
would do: its host identity (:func:`host_identity`), whether it can run the shared-memory plane
and its compiled core, the version of the wire protocol it speaks, and its settings of every
knob that picks a path or cuts the bytes (``SMDDP_CPU_PLANE``, ``SMDDP_SHM_SLOT_BYTES``,
``SMDDP_SHM_CHUNK_BYTES``, ``SMDDP_SHM_ONE_SHOT_MAX``, ``SMDDP_SHM_CMA_MIN_BYTES``,
``SMDDP_HIERARCHICAL_MIN_BYTES``). Every
rank reads every rank's and computes the same :class:`Layout` (:func:`agree`); from then on no
rank decides such a thing from its own settings:

- tuning knobs: the group's rank 0's value, except the slot size, which is the smallest any rank
  asked for (a rank whose ``/dev/shm`` is small may lower it for everyone);
- what a host can run: a host runs the compiled core only when every one of its ranks has it
  (and wants it); otherwise its ranks run the Python path, which speaks the same protocol and
  cuts the bytes between hosts the same way (:attr:`Layout.part_bytes`);
- ranks that speak different protocols (different smddp versions) get no plane at all;
- whether a host's ranks may read and write each other's memory (the compiled core's
  single-copy all-reduce, :mod:`smddp.comm.planes.shm_cma`) is tried, not assumed: each rank
  offers a probe word in its proposal, probes every host-mate's for real, and publishes its vote
  in a second round; a host takes the path only if every one of its ranks reached every other,
  and from rank 0's ``SMDDP_SHM_CMA_MIN_BYTES``.

A subgroup's layout is the world's, restricted to its members (:func:`restrict`): every member
published its identity and settings when the world was made, in this same process, so a subgroup
needs no exchange of its own (torch makes hundreds of groups in some jobs: Megatron-style meshes,
DeviceMesh dimensions).

Values read from the store are validated, never trusted as they are: a malformed one raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from smddp.comm.planes import hostmates, shm_cma
from smddp.errors import BackendUnavailableError
from smddp.job.host import host_identity

#: The version of what ranks exchange on the wire (the shared-memory protocol, the check rows):
#: ranks that publish different ones never share a plane.
PROTOCOL = 3

#: The knobs each rank proposes, with the layout's field for each.
_TUNING = (("slot", "SMDDP_SHM_SLOT_BYTES"), ("chunk", "SMDDP_SHM_CHUNK_BYTES"),
           ("one_shot", "SMDDP_SHM_ONE_SHOT_MAX"), ("cma_min", "SMDDP_SHM_CMA_MIN_BYTES"),
           ("hier_min", "SMDDP_HIERARCHICAL_MIN_BYTES"))


@dataclass(frozen=True)
class Layout:
    """A group's agreed layout: the same on every rank of the group.

    Attributes:
        mates: the hosts and this rank's place among them.
        plane: the ``SMDDP_CPU_PLANE`` the group runs (rank 0's).
        slot: bytes of each shared-memory buffer (the smallest any rank asked for).
        chunk_bytes: bytes per step of the compiled core's larger collectives (rank 0's).
        one_shot_max: all-reduces up to this many bytes are one step in the compiled core (rank 0's).
        cma_min_bytes: on a host whose :attr:`cma` is True, all-reduces of at least this many bytes
            (above ``one_shot_max``) read and write the peers' buffers directly (rank 0's).
        hierarchical_min_bytes: all-reduces below this stay flat on the hierarchical plane (rank 0's).
        shm: per host, whether every one of its ranks can run the shared-memory plane.
        native: per host, whether every one of its ranks runs the compiled core.
        native_f16: per host, whether every one of its ranks' cores reduces float16.
        cma: per host, whether its ranks run the single-copy all-reduce: each runs the compiled
            core, offered it, and read and wrote every host-mate's probe word.
        cma_why: per host, why it does not ("" where it does).
        same_protocol: every rank speaks :data:`PROTOCOL`.
        differs: the knobs some rank set to another value than the layout's.
        votes: each rank's single-copy vote where its host voted (``"1"``, or ``"0"`` and why not),
            by its rank in the group: what :func:`restrict` reads for a subgroup's hosts.
    """

    mates: hostmates.Hostmates
    plane: str
    slot: int
    chunk_bytes: int
    one_shot_max: int
    cma_min_bytes: int
    hierarchical_min_bytes: int
    shm: Tuple[bool, ...]
    native: Tuple[bool, ...]
    native_f16: Tuple[bool, ...]
    cma: Tuple[bool, ...]
    cma_why: Tuple[str, ...]
    same_protocol: bool
    differs: Tuple[str, ...]
    votes: Tuple[Tuple[int, str], ...] = ()

    @property
    def one_host(self) -> bool:
        """Every rank of the group is on this host (loopback reaches them all)."""
        return len(self.mates.hosts) == 1

    @property
    def part_bytes(self) -> int:
        """Bytes of each slice of a hierarchical all-reduce: both implementations cut the same parts."""
        return min(self.chunk_bytes, self.slot)


def proposal(plane: str, shm: bool, native: bool, native_f16: bool, tuning: Mapping[str, int],
             env: Optional[Mapping[str, str]] = None, cma: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    """What this rank publishes: its identity, what it can run, and its settings.

    Args:
        plane: its ``SMDDP_CPU_PLANE``.
        shm: it can run the shared-memory plane (x86-64 Linux with a shared-memory directory).
        native: its compiled core is built and ``SMDDP_SHM_NATIVE`` is not off.
        native_f16: its core reduces float16.
        tuning: its ``slot``, ``chunk``, ``one_shot``, ``cma_min`` and ``hier_min`` byte counts.
        env: the environment the identity is read from.
        cma: its probe word (:func:`smddp.comm.planes.shm_cma.offer`), or None: it will not read or
            write its host-mates' memory (no core, ``SMDDP_SHM_CMA`` off).
    """
    mine = {"host": host_identity(env), "protocol": PROTOCOL, "plane": plane, "ok": bool(shm),
            "native": bool(native), "f16": bool(native_f16), "cma": dict(cma) if cma else None}
    mine.update({field: int(tuning[field]) for field, _ in _TUNING})
    return mine


def agree(store, rank: int, size: int, mine: Mapping[str, Any],
          refusal: Optional[Callable[[Mapping[str, int]], str]] = None) -> Layout:
    """Publish ``mine`` (:func:`proposal`), read every rank's, and compute the group's layout.

    Args:
        store: the group's store, with a prefix of the caller's.
        rank: this rank in the group.
        size: the group's size.
        mine: this rank's :func:`proposal`.
        refusal: probes a host-mate's probe word for real: "" if this rank may read and write its
            memory, else why not (:func:`smddp.comm.planes.shm_cma.refusal`); None: it may not.

    Raises:
        BackendUnavailableError: a rank published something that is not a proposal.
    """
    info = hostmates.exchange(store, rank, size, dict(mine))
    for r, entry in enumerate(info):
        _validate(r, entry)
    mates = hostmates.grouped(info, rank)
    return _computed(mates, _vote(store, mates, refusal))


def restrict(world: Layout, ranks: List[int], rank: int) -> Layout:
    """The layout of the subgroup of ``world``'s ``ranks`` (group rank ``i`` is ``ranks[i]``), without
    an exchange: each member's proposal and single-copy vote are those it made for the world.

    A host of the subgroup takes the single-copy all-reduce only if each of its members could read
    and write every world host-mate's memory (a subset of those it probed).

    Args:
        world: the world's agreed layout.
        ranks: the subgroup's members, by their rank in ``world``.
        rank: this rank in the subgroup.
    """
    info = [world.mates.info[r] for r in ranks]
    mates = hostmates.grouped(info, rank)
    voted = dict(world.votes)
    votes = {i: voted[r] for i, r in enumerate(ranks) if r in voted}
    return _computed(mates, votes)


def _computed(mates: hostmates.Hostmates, votes: Mapping[int, str]) -> Layout:
    """The layout that every rank of a group computes alike from its ranks' proposals and votes."""
    info = mates.info
    first = info[0]
    tuning = {field: first[field] for field, _ in _TUNING}
    tuning["slot"] = min(entry["slot"] for entry in info)
    differs = [knob for field, knob in _TUNING if any(entry[field] != tuning[field] for entry in info)]
    if any(entry["plane"] != first["plane"] for entry in info):
        differs.insert(0, "SMDDP_CPU_PLANE")

    def every(key: str) -> Tuple[bool, ...]:
        return tuple(all(info[r][key] for r in members) for members in mates.hosts)

    why = list(_unvoted(mates))
    for h, members in enumerate(mates.hosts):
        if not why[h]:
            found = (votes.get(r, "0a rank did not vote") for r in members)
            why[h] = next((vote[1:201] or "a rank voted no" for vote in found if vote != "1"), "")
    return Layout(
        mates=mates, plane=first["plane"], slot=tuning["slot"], chunk_bytes=tuning["chunk"],
        one_shot_max=tuning["one_shot"], cma_min_bytes=tuning["cma_min"], hierarchical_min_bytes=tuning["hier_min"],
        shm=every("ok"), native=every("native"), native_f16=every("f16"), cma=tuple(not text for text in why),
        cma_why=tuple(why), same_protocol=all(entry["protocol"] == PROTOCOL for entry in info),
        differs=tuple(differs), votes=tuple(sorted(votes.items())),
    )


def _unvoted(mates: hostmates.Hostmates) -> List[str]:
    """Per host, why its ranks cannot take the single-copy all-reduce without voting ("": they vote)."""
    info = mates.info
    why = []
    for members in mates.hosts:
        core = [local for local, r in enumerate(members) if not info[r]["native"]]
        offered = [local for local, r in enumerate(members) if not info[r]["cma"]]
        why.append("one rank on the host" if len(members) < 2 else
                   f"local rank {core[0]} does not run the compiled core" if core else
                   f"local rank {offered[0]} offered none (SMDDP_SHM_CMA off, or no cross-memory attach)"
                   if offered else "")
    return why


def _vote(store, mates: hostmates.Hostmates, refusal) -> Dict[int, str]:
    """Each rank's vote, on the hosts that vote: may it read and write each host-mate's memory.

    On a host whose ranks all run the core and offered it, each rank probes every host-mate and
    publishes its vote (``"1"``, or ``"0"`` and why not); every rank reads the same votes, so every
    rank computes the same answer (:func:`_computed`: a host takes the path only if every vote is
    yes); where no host could, there is no round (every rank knows that from the proposals).
    """
    info = mates.info
    why = _unvoted(mates)
    if not why[mates.host]:
        me = mates.rank
        refused = [(local, refusal(info[r]["cma"]) if refusal is not None else "no probe")
                   for local, r in enumerate(mates.ranks) if r != me]
        refused = [f"local rank {mates.local_rank} cannot read or write local rank {local}'s memory ({text})"
                   for local, text in refused if text]
        store.set(f"cma/{me}", "0" + refused[0] if refused else "1")
    votes: Dict[int, str] = {}
    for h, members in enumerate(mates.hosts):
        if not why[h]:
            votes.update((r, store.get(f"cma/{r}").decode(errors="replace")) for r in members)
    return votes


def _validate(rank: int, entry: Any) -> None:
    kinds: List[Tuple[str, type]] = [("host", str), ("plane", str), ("protocol", int), ("ok", bool),
                                     ("native", bool), ("f16", bool)]
    kinds += [(field, int) for field, _ in _TUNING]
    bad = [key for key, kind in kinds if not isinstance(entry, dict) or type(entry.get(key)) is not kind]
    if not bad:
        bad = [field for field, _ in _TUNING if entry[field] < 1]
        if not shm_cma.valid(entry.get("cma")):
            bad.append("cma")
    if bad:
        raise BackendUnavailableError(
            f"rank {rank} of the group published a layout smddp cannot use (fields {', '.join(bad)}): "
            f"is it running another smddp, or did something else write to the job's store?")
