"""torch.profiler sees smddp's communication as it sees gloo's (torchrun, 2 ranks, every rank).

tests/ranks/profiled.py runs the same collectives and DDP steps on each backend under the
profiler and writes each rank's communication events. For smddp they must carry the events
gloo's trace has: the dispatcher's ``c10d::<op>`` (category ``cpu_op``) with the same
argument shapes, and one backend event per collective (``smddp:<op>`` as ``gloo:<op>``,
category ``user_annotation``) with the same input shapes and a duration -- DDP's gradient
bucket reduces among them, through torch's DDP and through smddp's.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from launchers import RANKS, torchrun

# gloo names its backend event after the algorithm; smddp after the engine's collective.
ALIASES = {"all_gather_into_tensor": "all_gather"}


def run_backend(backend: str, outdir: str) -> dict:
    result = torchrun(2, [str(RANKS / "profiled.py"), backend, outdir], timeout=300)
    assert result.returncode == 0, result.output
    reports = {}
    for rank in range(2):
        path = Path(outdir) / f"{backend}-{rank}.json"
        assert path.exists(), result.output
        report = json.loads(path.read_text())
        assert report["failures"] == [], (rank, report["failures"])
        reports[rank] = report
    return reports


def c10d_events(trace) -> Counter:
    return Counter((e["name"], json.dumps(e["dims"])) for e in trace if e["name"].startswith("c10d::"))


def backend_events(trace, backend: str) -> Counter:
    found = Counter()
    for e in trace:
        if e["name"].startswith(backend + ":"):
            op = e["name"].split(":", 1)[1]
            found[(ALIASES.get(op, op), json.dumps(e["dims"]))] += 1
    return found


def test_profiler_sees_smddp_as_gloo():
    with tempfile.TemporaryDirectory(prefix="smddp-profiler-") as outdir:
        gloo = run_backend("gloo", outdir)
        smddp = run_backend("smddp", outdir)
    for rank in range(2):
        theirs, ours = gloo[rank]["torch_ddp"], smddp[rank]["torch_ddp"]
        # The dispatcher's events: same names, same argument shapes, as CPU ops.
        assert c10d_events(ours["trace"]) == c10d_events(theirs["trace"]), (rank, ours["trace"], theirs["trace"])
        assert {e["cat"] for e in ours["trace"] if e["name"].startswith("c10d::")} == {"cpu_op"}
        # The backend's events: one per collective, same input shapes, each with a duration.
        assert backend_events(ours["trace"], "smddp") == backend_events(theirs["trace"], "gloo"), \
            (rank, ours["trace"], theirs["trace"])
        mine = [e for e in ours["trace"] if e["name"].startswith("smddp:")]
        assert {e["cat"] for e in mine} == {"user_annotation"}
        assert all(e["dur"] is not None and e["dur"] >= 0 for e in mine), mine
        # The profiler's events too (not only the chrome trace), with input shapes.
        events = Counter((e["name"], json.dumps(e["shapes"])) for e in ours["events"])
        assert events[("smddp:all_reduce", "[[5, 3]]")] == 1 and events[("smddp:all_reduce", "[[7]]")] == 1, events
        assert events[("smddp:broadcast", "[[4, 2]]")] == 1, events
        # DDP's gradient bucket (the whole model: 36 elements), reduced once per step.
        numel = smddp[rank]["ddp_numel"]
        bucket = (json.dumps([[[numel]], [], [], [], [], []]))
        assert c10d_events(ours["trace"])[("c10d::allreduce_", bucket)] == 2, ours["trace"]
        assert backend_events(ours["trace"], "smddp")[("all_reduce", json.dumps([[numel]]))] == 2, ours["trace"]
        # smddp's own DDP (its communication hook on the shared-memory plane) shows the same.
        own = smddp[rank]["smddp_ddp"]["trace"]
        assert c10d_events(own)[("c10d::allreduce_", bucket)] == 2, own
        assert backend_events(own, "smddp")[("all_reduce", json.dumps([[numel]]))] == 2, own
