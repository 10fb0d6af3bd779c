"""smddp's environment variables: one table, one parser that checks every one, the docs in step with both."""

from __future__ import annotations

import math
import re

import pytest

from smddp import knobs
from smddp.errors import BackendUnavailableError, InvalidArgumentError, SMDDPError

from launchers import ROOT, python


@pytest.mark.unit
def test_unset_or_empty_gives_the_default_and_values_parse():
    assert knobs.value("SMDDP_SHM_CHUNK_BYTES", {}) == 1 << 20
    assert knobs.value("SMDDP_SHM_CHUNK_BYTES", {"SMDDP_SHM_CHUNK_BYTES": "  "}) == 1 << 20
    assert knobs.value("SMDDP_SHM_CHUNK_BYTES", {"SMDDP_SHM_CHUNK_BYTES": "65536"}) == 65536
    assert knobs.value("SMDDP_SHM_SPIN_US", {"SMDDP_SHM_SPIN_US": "2.5"}) == 2.5
    for off in ("0", "false", "No", "OFF"):
        assert knobs.value("SMDDP_SHM_NATIVE", {"SMDDP_SHM_NATIVE": off}) is False
    assert knobs.value("SMDDP_DEBUG", {}) is False and knobs.value("SMDDP_DEBUG", {"SMDDP_DEBUG": "1"}) is True
    assert knobs.set_knobs({"SMDDP_DEBUG": "1", "SMDDP_TIMEOUT": "", "PATH": "/bin"}) == {"SMDDP_DEBUG": "1"}


@pytest.mark.unit
def test_a_value_that_does_not_parse_names_the_variable_the_value_and_where_it_came_from():
    with pytest.raises(InvalidArgumentError, match=r"^SMDDP_SHM_SLOT_BYTES=4M \(environment\) is not a whole number "
                                                   r"of bytes: SMDDP_SHM_SLOT_BYTES takes a whole number of bytes from "
                                                   r"8 to .*, a multiple of 8; unset it for the default \(4194304\)"):
        knobs.value("SMDDP_SHM_SLOT_BYTES", {"SMDDP_SHM_SLOT_BYTES": "4M"})
    # As an unknown backend= argument: the same exception, whichever way the backend was named.
    with pytest.raises(BackendUnavailableError, match=r"^SMDDP_BACKEND=Bogus \(environment\) is an unknown backend "
                                                      r"'bogus': SMDDP_BACKEND takes one of auto, smddp, mpi, gloo"):
        knobs.value("SMDDP_BACKEND", {"SMDDP_BACKEND": "Bogus"})
    with pytest.raises(InvalidArgumentError, match=r"^SMDDP_HOST_ID='a\\nb' \(smddprun -x\) is not a name"):
        knobs.value("SMDDP_HOST_ID", {"SMDDP_HOST_ID": "a\nb"}, source="smddprun -x")


#: What a hostile or careless environment puts in a variable: text, zero, negative, fractions,
#: huge, not finite, unknown words, control characters, relative paths, very long.
HOSTILE = ["lots", "0", "-5", "-1", "0.5", "4096.5", "7", "65537", "1e19", "9" * 40, "1e400", "inf", "-inf", "nan",
           "bogus", "none", "1", "yes", "ring", "http", "eth 0", "a\nb", "\x07", "rel/dir", "../x", "/tmp", "x" * 5000]


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(knobs.KNOBS))
def test_every_knob_is_checked_for_type_and_range_by_the_one_parser(name):
    """A knob added without a rule, or with a rule that lets a hostile value through, fails here."""
    knob = knobs.KNOBS[name]
    rule = knob.rule
    assert isinstance(rule, knobs.Rule), f"{name} has no rule of smddp.knobs (its parse is {rule!r})"
    if isinstance(rule, (knobs.Whole, knobs.Number)):
        # A range on both sides, and finite: 0 and negatives are refused where a size must be positive.
        assert math.isfinite(rule.least) and math.isfinite(rule.most) and rule.least < rule.most, name
    if knob.default is not None:
        assert rule.admits(knob.default), f"{name}'s default {knob.default!r} is outside its own rule"
    for text in HOSTILE:
        try:
            got = knobs.value(name, {name: text})
        except SMDDPError as exc:
            assert isinstance(exc, rule.error), (name, exc)
            message = str(exc)
            shown = text if text.isprintable() and len(text) <= 80 and " " not in text else repr(text[:80])
            assert message.startswith(f"{name}={shown[:60]}"), message
            assert "(environment) is " in message and f"{name} takes {rule.allowed}" in message, message
            continue
        assert rule.admits(got), (name, text, got)
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            assert math.isfinite(got) and got >= 0, (name, text, got)


@pytest.mark.unit
def test_sizes_are_positive_and_bounded_and_the_slot_a_multiple_of_8():
    refused = {"SMDDP_SHM_SLOT_BYTES": ["0", "-8", "65537", "1e19", "inf", "nan", "1e400"],
               "SMDDP_SHM_CHUNK_BYTES": ["0", "-1", "1e19"], "SMDDP_SHM_ONE_SHOT_MAX": ["0", "-1"],
               "SMDDP_SHM_CMA_MIN_BYTES": ["0", "-1"], "SMDDP_HIERARCHICAL_MIN_BYTES": ["0", "-1"],
               "SMDDP_MPI_RING_MIN_BYTES": ["0", "1e19"], "SMDDP_SHM_SPIN_US": ["-1", "nan", "inf", "1e7"],
               "SMDDP_TIMEOUT": ["0", "-5", "nan", "inf", "1e400", "1e19", "soon"],
               "SMDDP_NCCL_ASYNC_ERROR_HANDLING": ["4", "-1", "2.5"], "SMDDP_MPI_LARGE_ALLREDUCE": ["bogus"],
               "SMDDP_CPU_PLANE": ["bogus"], "SMDDP_NCCL_STREAM": ["bogus"], "SMDDP_DEBUG": ["bogus", "2"],
               "SMDDP_SHM_DIR": ["dev/shm", "./x"], "SMDDP_SOCKET_IFNAME": ["eth 0", "x" * 16]}
    for name, texts in refused.items():
        for text in texts:
            with pytest.raises(knobs.KNOBS[name].rule.error, match=f"^{re.escape(name)}="):
                knobs.value(name, {name: text})
    taken = {"SMDDP_SHM_SLOT_BYTES": ("65536", 65536), "SMDDP_SHM_CHUNK_BYTES": ("1e6", 1000000),
             "SMDDP_TIMEOUT": ("none", float(knobs.NO_DEADLINE_S)), "SMDDP_BACKEND": ("Torch_NCCL", "torch-nccl"),
             "SMDDP_MPI_LARGE_ALLREDUCE": ("Blocking", "blocking"), "SMDDP_SHM_CMA_MIN_BYTES": ("100000", 100000),
             "SMDDP_DEBUG": ("detail", True), "SMDDP_SHM_NATIVE": ("no", False)}
    for name, (text, want) in taken.items():
        assert knobs.value(name, {name: text}) == want, name


@pytest.mark.unit
def test_the_backend_choices_are_the_registrys():
    from smddp import comm

    assert set(knobs.BACKEND_CHOICES) == set(comm.BACKENDS) | {"auto", "smddp"}


def test_a_bad_tuning_value_fails_the_import_with_its_name():
    res = python(["-c", "import smddp.comm.planes.shm"], env={"SMDDP_SHM_CHUNK_BYTES": "lots"}, timeout=60)
    assert res.returncode != 0, res.output
    assert "InvalidArgumentError: SMDDP_SHM_CHUNK_BYTES=lots (environment) is not a whole number of bytes" \
        in res.stderr, res.output


@pytest.mark.unit
def test_no_module_reads_an_smddp_variable_but_the_table():
    readers = []
    for path in (ROOT / "smddp").rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"(?:environ|env)\s*(?:\.get\(|\[)\s*[\"'](SMDDP_[A-Z_]+)", text):
            readers.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    # smddprun's own marker to its ranks is not a setting (documented in docs/launching.md)
    assert readers == [], readers


@pytest.mark.unit
def test_the_docs_list_every_variable_with_its_default_and_what_it_takes():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    found = list(re.finditer(r"^\| `(SMDDP_[A-Z_]+)` \| ([^|]+) \| ([^|]+) \|", text, re.M))
    rows = {m.group(1): m.group(2) for m in found}
    takes = {m.group(1): m.group(3).strip() for m in found}
    assert set(rows) == set(knobs.KNOBS), set(rows) ^ set(knobs.KNOBS)
    for name, knob in knobs.KNOBS.items():
        assert takes[name] == knob.rule.allowed, (name, takes[name])
        default = rows[name].strip()
        if isinstance(knob.default, bool):
            assert default == ("on" if knob.default else "off"), name
        elif knob.default is None:
            assert default == "unset", name
        elif isinstance(knob.default, int) and knob.default >= 1024:
            size = f"{knob.default >> 20} MiB" if knob.default % (1 << 20) == 0 else f"{knob.default >> 10} KiB"
            assert default == size, name
        else:
            assert default == f"`{knob.default}`", name
