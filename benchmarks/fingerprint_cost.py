"""What the shared-memory plane's fingerprint costs a small all_reduce: this core against one without.

::

    mpirun -np 2 python benchmarks/fingerprint_cost.py                  # against main's core
    mpirun -np 2 python benchmarks/fingerprint_cost.py --baseline REF --sizes 4K,64K

Rank 0 builds the compiled core (``_shm_native.c`` and its headers) of git revision
``--baseline`` (default ``main``, from before fingerprints) into a temporary directory; every
rank loads it beside this checkout's core, and both drive the same segment of the job's
shared-memory plane (the protocol's counters are handed from one to the other between
turns). Contenders, float32 SUM in place:

- ``core-baseline``: the baseline core's all_reduce, called and advanced with no Python
  layer around it;
- ``core``: this checkout's, the same way (with its fingerprint: written with the first step,
  every rank's compared before the fold);
- ``smddp``: ``smddp.torch.distributed.all_reduce(t)`` (this core under the whole API), to
  set the difference against what a user's call costs.

Each round runs every contender once, in an order that rotates every round; a turn is a
barrier, then ``iters`` calls timed one by one, and the round's figure is the median call on
the slowest rank. The table gives medians over rounds and the median over rounds of the
per-round ratio ``core / core-baseline`` (paired: load that drifts between rounds cancels
out), and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Dict

import numpy as np
import torch

import smddp.torch.distributed as dist
from smddp.bench import format_size, parse_size

_SOURCES = ("_shm_native.c", "_shm_fold.h", "_shm_sync.h", "_shm_ops.h")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_baseline(ref: str, into: str) -> str:
    """Compile the core of git revision ``ref`` into directory ``into``; return the library's path."""
    for name in _SOURCES:
        text = subprocess.run(["git", "-C", _REPO, "show", f"{ref}:smddp/comm/backends/{name}"],
                              check=True, capture_output=True).stdout
        with open(os.path.join(into, name), "wb") as f:
            f.write(text)
    out = os.path.join(into, "_shm_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*cc, "-O3", "-std=gnu11", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    os.path.join(into, "_shm_native.c"), "-o", out], check=True)
    return out


def load(path: str):
    """The core at ``path``, as a module of its own (beside the one smddp imported)."""
    spec = importlib.util.spec_from_file_location("_shm_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="git revision of the core to compare with (default: main)")
    parser.add_argument("--sizes", default="4K", help="comma-separated message sizes (default: 4K)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds; each runs every contender (default: 30)")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per contender per round (default: 200)")
    args = parser.parse_args(argv)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    dist.init_process_group()
    from mpi4py import MPI

    from smddp.comm.planes import shm
    from smddp.comm.planes.shm_segment import HEADER
    from smddp.torch import groups

    comm = MPI.COMM_WORLD
    plane = getattr(groups.current().engine.comms["cpu"], "_shm", None)
    if plane is None or not plane.native:
        raise SystemExit("fingerprint_cost.py needs the shared-memory plane's compiled core (one host, built)")
    with tempfile.TemporaryDirectory(prefix="smddp-baseline-") as tmp:
        path = comm.bcast(build_baseline(args.baseline, tmp) if comm.rank == 0 else None)
        baseline = load(path)  # loaded (mapped) before rank 0 removes the directory
        comm.Barrier()
    old = baseline.Segment(plane._mm, plane.rank, plane.size, plane.slot, HEADER, shm.SPIN_NS)
    new = plane._seg
    seq = [1 << 20]  # beyond the engine's numbers; all ranks count alike

    def core_old(t: torch.Tensor) -> None:
        op = old.all_reduce(t.data_ptr(), t.numel(), 0, 0, shm.CHUNK_BYTES, shm.NATIVE_ONE_SHOT_MAX)
        while not op.advance(shm._TEST_WAIT_NS):
            pass

    def core_new(t: torch.Tensor) -> None:
        seq[0] += 1
        op = new.all_reduce(t.data_ptr(), t.numel(), 0, 0, shm.CHUNK_BYTES, shm.NATIVE_ONE_SHOT_MAX, seq[0])
        while not op.advance(shm._TEST_WAIT_NS):
            pass

    contenders: Dict[str, tuple] = {"core-baseline": (core_old, old), "core": (core_new, new),
                                    "smddp": (lambda t: dist.all_reduce(t), new)}
    owner = [new]  # the segment whose counters are current

    def hand_to(segment) -> None:
        if segment is not owner[0]:
            for name in ("epoch", "last_written", "steps"):
                setattr(segment, name, getattr(owner[0], name))
            owner[0] = segment

    names = list(contenders)
    rows = []
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        tensor = torch.ones(nbytes // 4)
        medians: Dict[str, np.ndarray] = {name: np.zeros(args.rounds) for name in names}
        for name in names:  # warm up and check the sum
            call, segment = contenders[name]
            hand_to(segment)
            tensor.fill_(1.0)
            call(tensor)
            if float(tensor[0]) != comm.size:
                raise RuntimeError(f"{name} gave {float(tensor[0])}, expected {comm.size}")
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                call, segment = contenders[name]
                hand_to(segment)
                comm.Barrier()
                samples = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    call(tensor)
                    samples.append(time.perf_counter() - start)
                medians[name][r] = statistics.median(samples)
        for name in names:
            comm.Allreduce(MPI.IN_PLACE, medians[name], op=MPI.MAX)
        ratio = float(np.median(medians["core"] / medians["core-baseline"]))
        extra = float(np.median(medians["core"] - medians["core-baseline"]))
        rows.append((nbytes, {n: float(np.median(m)) for n, m in medians.items()}, ratio, extra))
    hand_to(new)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if comm.rank == 0:
        print(f"# fingerprint cost: mpirun -np {comm.size} python {' '.join(sys.argv)}")
        print(f"# baseline core: {args.baseline}; {args.rounds} rounds x {args.iters} calls; "
              f"load average before {load_before}, after {load_after}")
        print("| size | " + " | ".join(names) + " | core / core-baseline | extra per call | extra / smddp |")
        print("|---|" + "---|" * (len(names) + 3))
        for nbytes, times, ratio, extra in rows:
            cells = " | ".join(f"{times[n] * 1e6:.2f} us" for n in names)
            print(f"| {format_size(nbytes)} | {cells} | {ratio:.3f} | {extra * 1e9:.0f} ns | "
                  f"{extra / times['smddp'] * 100:.1f}% |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
