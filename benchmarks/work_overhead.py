"""What torch's API costs per call on smddp's ProcessGroup, with the data plane out of the way.

::

    python benchmarks/work_overhead.py                        # this checkout
    python benchmarks/work_overhead.py --trees OLD NEW        # two checkouts, alternated

One process, a world of 1 (``init_process_group("smddp")`` on a loopback store), so a collective
moves no data and what is timed is the glue: torch's Python API, smddp's ProcessGroup, the
``Work`` it returns and the engine. Contenders, on a 1024-element float32 tensor:

- ``sync``: ``torch.distributed.all_reduce(t)`` (torch >= 2.8 passes ``asyncOp=False`` and
  takes ``None`` back: the engine's synchronous path, no ``Work``);
- ``async``: ``torch.distributed.all_reduce(t, async_op=True).wait()``: its ``Work`` is the
  engine's handle, settled as it is made (C++ may keep it after Python has dropped it);
- ``async-broadcast``: ``torch.distributed.broadcast(t, 0, async_op=True).wait()``.

Each round times ``--iters`` calls of each contender in turn and keeps the mean per call; the
table gives the median over ``--rounds``. ``--clock cpu`` times the calling thread's CPU time
instead of the wall clock: on a loaded machine the wall clock mostly measures the wait for a
core (a world of 1 runs every call in that thread). With ``--trees``, each tree runs in its own process
(``PYTHONPATH`` on it), alternated ``--jobs`` times, and the ratio column is the median of
NEW/OLD over the pairs of jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("sync", "async", "async-broadcast")


def measure(iters: int, rounds: int, clock: str = "wall") -> dict:
    """Median over rounds of the mean time per call of each contender, in this process.

    Args:
        iters: calls per contender per round.
        rounds: rounds.
        clock: ``"wall"`` (``time.perf_counter``) or ``"cpu"`` (this thread's CPU time).

    Returns:
        Contender to seconds per call.
    """
    now = time.perf_counter if clock == "wall" else time.thread_time
    import torch
    import torch.distributed as dist

    import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend

    with socket.socket() as s:  # a free port on loopback for the world's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("smddp", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(1024)
    calls = {
        "sync": lambda: dist.all_reduce(t),
        "async": lambda: dist.all_reduce(t, async_op=True).wait(),
        "async-broadcast": lambda: dist.broadcast(t, 0, async_op=True).wait(),
    }
    per_round = {name: [] for name in CONTENDERS}
    for name in CONTENDERS:  # warm-up
        for _ in range(iters // 10 + 1):
            calls[name]()
    for _ in range(rounds):
        for name in CONTENDERS:
            call = calls[name]
            start = now()
            for _ in range(iters):
                call()
            per_round[name].append((now() - start) / iters)
    dist.destroy_process_group()
    return {name: statistics.median(times) for name, times in per_round.items()}


def _run_tree(tree: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(HERE, "work_overhead.py"), "--iters", str(args.iters),
           "--rounds", str(args.rounds), "--clock", args.clock, "--json", "-"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="calls per contender per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds in one process (default 7)")
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="compare two checkouts")
    parser.add_argument("--jobs", type=int, default=3, help="with --trees: pairs of processes (default 3)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock (default) or the calling thread's CPU time")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON ('-' for stdout, alone)")
    args = parser.parse_args(argv)

    sys.path.insert(0, HERE)
    from allreduce_cpu import _load, _machine  # noqa: PLC0415 - beside this file (imports torch and smddp)

    load_before = _load()
    if not args.trees:
        result = measure(args.iters, args.rounds, args.clock)
        if args.json == "-":
            print(json.dumps(result))
            return
        print(f"# python benchmarks/work_overhead.py --iters {args.iters} --rounds {args.rounds} --clock {args.clock}")
        print(f"# machine: {_machine()}; load average {load_before} before, {_load()} after")
        for name in CONTENDERS:
            print(f"{name:>16}: {result[name] * 1e6:7.2f} us per call")
    else:
        old, new = ([] for _ in range(2))
        for job in range(args.jobs):
            for tree, into in ((args.trees[0], old), (args.trees[1], new))[:: 1 if job % 2 == 0 else -1]:
                into.append(_run_tree(tree, args))
            print(f"pair {job + 1}/{args.jobs}; load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        print(f"# python benchmarks/work_overhead.py --trees {' '.join(args.trees)} --jobs {args.jobs} "
              f"--clock {args.clock}")
        print(f"# machine: {_machine()}; load average {load_before} before, {_load()} after")
        result = {}
        for name in CONTENDERS:
            a = [r[name] for r in old]
            b = [r[name] for r in new]
            ratio = statistics.median(y / x for x, y in zip(a, b))
            result[name] = {"old_s": a, "new_s": b, "ratio": ratio}
            print(f"{name:>16}: OLD {statistics.median(a) * 1e6:7.2f} us  NEW {statistics.median(b) * 1e6:7.2f} us"
                  f"  NEW/OLD {ratio:.2f}")
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
