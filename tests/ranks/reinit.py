"""init_process_group / destroy_process_group three times in one process, v2 style.

Each destroy must close smddp's engine then and there: its threads stop and its shared memory
closes, instead of piling up until exit (one set per init). ``--old-torch``: torch versions
that do not call a Python group's ``shutdown()`` from ``destroy_process_group()``, emulated;
there the next ``init_process_group()`` closes the group left open.
"""

import sys
import threading

import torch
import torch.distributed as tdist

import smddp.torch.distributed as v1
import smddp.torch.torch_smddp  # noqa: F401
from smddp.torch import groups, process_group

old_torch = "--old-torch" in sys.argv
# Whether destroy_process_group() itself must close the engine: on torch >= 2.7 (it calls the
# group's shutdown()), not emulating an older one.
closes_at_destroy = groups._DESTROY_CALLS_SHUTDOWN and not old_torch
if old_torch:
    process_group.SmddpProcessGroup.shutdown = lambda self: None
    groups._DESTROY_CALLS_SHUTDOWN = False

baseline = threading.active_count()
engines = []
for cycle in range(3):
    tdist.init_process_group(backend="smddp")
    rank, size = tdist.get_rank(), tdist.get_world_size()
    engine = groups.current().engine
    if engines:  # the previous group is closed by now, whichever way
        assert engines[-1]._closed, f"cycle {cycle}: the previous engine is still open"
    engines.append(engine)
    t = torch.arange(4, dtype=torch.float32) + 10 * rank + cycle
    handle = tdist.all_reduce(t, async_op=True)  # the progress thread may start for it
    handle.wait()
    expected = sum(torch.arange(4, dtype=torch.float32) + 10 * r + cycle for r in range(size))
    assert torch.equal(t, expected), (cycle, t, expected)
    tdist.destroy_process_group()
    assert not v1.is_initialized()
    if closes_at_destroy:
        assert engine._closed, f"cycle {cycle}: destroy_process_group() left the engine open"
        cpu = engine.comms["cpu"]
        assert getattr(cpu, "_shm", None) is None, f"cycle {cycle}: the shared-memory plane is still open"
        assert threading.active_count() == baseline, (cycle, threading.enumerate())
print(f"REINIT_OK {rank} {threading.active_count() - baseline}")
