"""smddp's environment variables: one table, one reader, the docs in step with both."""

from __future__ import annotations

import re

import pytest

from smddp import knobs
from smddp.errors import InvalidArgumentError

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
def test_a_value_that_does_not_parse_names_the_variable():
    with pytest.raises(InvalidArgumentError, match=r"SMDDP_SHM_SLOT_BYTES='4M' is not a number of bytes: .*"
                                                   r"default \(4194304\)"):
        knobs.value("SMDDP_SHM_SLOT_BYTES", {"SMDDP_SHM_SLOT_BYTES": "4M"})


def test_a_bad_tuning_value_fails_the_import_with_its_name():
    res = python(["-c", "import smddp.comm.planes.shm"], env={"SMDDP_SHM_CHUNK_BYTES": "lots"}, timeout=60)
    assert res.returncode != 0, res.output
    assert "InvalidArgumentError: SMDDP_SHM_CHUNK_BYTES='lots' is not a number of bytes" in res.stderr, res.output


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
def test_the_docs_list_every_variable_with_its_default():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(SMDDP_[A-Z_]+)` \| ([^|]+) \|", text, re.M)}
    assert set(rows) == set(knobs.KNOBS), set(rows) ^ set(knobs.KNOBS)
    for name, knob in knobs.KNOBS.items():
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
