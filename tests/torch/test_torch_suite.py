"""torch's own distributed test suite, on smddp and on gloo: smddp passes whatever gloo passes.

A subset that fits CI's time (subgroups, coalesced and object collectives, the basic
collectives, point-to-point, DDP on CPU), 2 ranks per test, through
``tools/torch_suite.py``. The whole suite, with the comparison table, is
``python tools/torch_suite.py --markdown docs/torch-suite.md`` (see docs/torch-suite.md).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from launchers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import torch_suite  # noqa: E402 - tools/ is not a package

CI_TESTS = [
    r"full_group", r"coalesced", r"_object", r"_group$", r"subgroup", r"batch_isend_irecv_gloo",
    r"get_backend", r"DistributedDataParallelCPU$", r"sparse_all_reduce", r"accumulate_gradients_no_sync$",
    r"^test_(all_reduce_sum|broadcast|all_gather|barrier|reduce_sum|gather|scatter|send_recv|isend|irecv)$",
]
# torch refuses monitored_barrier by backend name (torch_suite.CANNOT_PASS).
CI_EXCLUDE = [r"monitored_barrier"]


def test_smddp_passes_every_test_gloo_passes(tmp_path):
    # The two backends at once, each in its own worker process with its own TEMP_DIR (torch's file
    # stores): the tests mostly wait (rank start-up, joins), so together they take 29 s, not 50.
    def run(backend: str) -> dict:
        return torch_suite.run_backend(backend, CI_TESTS, [], world_size=2, test_timeout=60,
                                       log=tmp_path / f"{backend}.log", exclude=CI_EXCLUDE)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(("gloo", "smddp"), pool.map(run, ("gloo", "smddp"))))
    gloo, smddp = results["gloo"], results["smddp"]
    log = (tmp_path / "smddp.log").read_text()[-4000:]
    assert sorted(gloo) == sorted(smddp), log
    # Not vacuous: the subset really runs the subgroup and coalesced tests on gloo.
    passed = {name for name, record in gloo.items() if record["outcome"] == "passed"}
    assert len(passed) >= 40, torch_suite.counts(gloo)
    assert {"test_all_reduce_full_group_sum", "test_all_gather_coalesced_simple",
            "test_all_gather_object_subgroup", "test_accumulate_gradients_no_sync"} <= passed
    lost = torch_suite.regressions(gloo, smddp)
    assert not lost, {name: smddp[name]["detail"][-1500:] for name in lost}
    errors = [name for name, record in smddp.items() if record["outcome"] in ("error", "failed")]
    assert not errors, {name: smddp[name]["detail"][-1500:] for name in errors}
