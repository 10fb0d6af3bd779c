"""What a process group costs, smddp's beside torch's gloo: time, descriptors, threads, memory, store connections.

::

    python benchmarks/groups.py                         # 100 groups at 2 ranks, smddp and gloo
    python benchmarks/groups.py --ranks 4 --groups 100
    python benchmarks/groups.py --ranks 2 --groups 1000 --json out.json
    python benchmarks/groups.py --jobs 3                # each backend's job three times, alternated

Jobs make many groups: Megatron-style meshes (every rank calls ``new_group`` for each tensor-,
pipeline- and data-parallel group), DeviceMesh dimensions, HSDP. The driver starts
``torchrun --nproc-per-node R`` jobs of this script (``--worker``), one per backend, alternated
``--jobs`` times. In each job every rank, after ``init_process_group`` (smddp's: ``backend="smddp"``
through ``import smddp.torch.torch_smddp``; gloo's: ``backend="gloo"``), makes ``--groups`` groups of
every rank with ``torch.distributed.new_group``, runs one checked all-reduce on each, then destroys
them, and reports:

- ``create``: seconds for the ``new_group`` calls, and ``first``: for the first all-reduce on each
  (where a backend connects or maps what it made lazily), each the slowest rank's;
- ``fds``, ``threads``, ``rss``: this process's open descriptors, threads and resident memory
  (MiB) before the groups, at their peak (all made and used) and after ``destroy``: the largest
  rank's;
- ``store``: the TCP connections the job's store host (torchrun's agent, on the master port)
  holds at the peak;
- ``shm``: bytes of ``/dev/shm`` in use (``statvfs``) at the peak, beyond what was in use before;
- per group: ``fds/group`` and ``threads/group`` (peak less before, over the groups);
- with ``--speed``, before the groups: a subgroup of every rank's 1 MB all-reduce against the
  world's, in the same rounds (a subgroup keeps the shared-memory plane).

Every all-reduce is checked against the sum of the ranks' seeded inputs; a wrong value fails the
job. The figures are per job; with ``--jobs`` each line is the median over jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


# --------------------------------------------------------------------------- what a process holds
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _store_connections(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the store host's side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state = fields[1], fields[3]
                    if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                        count += 1
        except OSError:
            continue
    return count


def _shm_used() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# --------------------------------------------------------------------------- worker (one rank)
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    if args.backend == "smddp":
        import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend
    tdist.init_process_group(args.backend)
    rank, size = tdist.get_rank(), tdist.get_world_size()
    port = int(os.environ["MASTER_PORT"])
    world = torch.zeros(1)
    tdist.all_reduce(world)
    speed = _subgroup_speed(size) if args.speed else 0.0
    tdist.barrier()
    before = {"fds": _fds(), "threads": _status("Threads"), "rss": _status("VmRSS"), "shm": _shm_used()}

    started = time.perf_counter()
    groups = [tdist.new_group(list(range(size))) for _ in range(args.groups)]
    create = time.perf_counter() - started
    wrong = 0
    started = time.perf_counter()
    for i, group in enumerate(groups):
        g = torch.Generator().manual_seed(i)
        rows = torch.randint(-100, 100, (size, 4), generator=g).float()
        t = rows[rank].clone()
        tdist.all_reduce(t, group=group)
        wrong += not torch.equal(t, rows.sum(0))
    first = time.perf_counter() - started
    tdist.barrier()
    peak = {"fds": _fds(), "threads": _status("Threads"), "rss": _status("VmRSS"), "shm": _shm_used(),
            "store": _store_connections(port) if rank == 0 else 0}
    tdist.barrier()
    for group in groups:
        tdist.destroy_process_group(group)
    del groups
    tdist.barrier()
    after = {"fds": _fds(), "threads": _status("Threads"), "rss": _status("VmRSS"), "shm": _shm_used()}

    mine = torch.tensor([create, first, before["fds"], peak["fds"], after["fds"], before["threads"],
                         peak["threads"], after["threads"], peak["rss"] / 1024, after["rss"] / 1024,
                         peak["shm"] - before["shm"], after["shm"] - before["shm"], peak["store"], wrong, speed],
                        dtype=torch.float64)
    tdist.all_reduce(mine, op=tdist.ReduceOp.MAX)
    if rank == 0:
        keys = ("create", "first", "fds_before", "fds_peak", "fds_after", "threads_before", "threads_peak",
                "threads_after", "rss_peak", "rss_after", "shm_peak", "shm_after", "store", "wrong", "speed")
        print("GROUPS " + json.dumps(dict(zip(keys, mine.tolist()))), flush=True)
    tdist.destroy_process_group()


def _subgroup_speed(size: int, nbytes: int = 1 << 20, rounds: int = 9, calls: int = 40) -> float:
    """A subgroup of every rank's all-reduce of ``nbytes`` over the world's, in the same rounds:
    the median over rounds of the within-round ratio of the median calls (the slowest rank's)."""
    import torch
    import torch.distributed as tdist

    sub = tdist.new_group(list(range(size)))
    t = torch.ones(nbytes // 4)
    ratios = []
    for r in range(rounds + 1):  # the first round warms up (a group's segment is made at its first use)
        medians = {}
        for name, group in (("world", None), ("sub", sub))[:: 1 if r % 2 else -1]:
            tdist.barrier()
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                tdist.all_reduce(t, group=group)
                times.append(time.perf_counter() - started)
            medians[name] = statistics.median(times)
        slowest = torch.tensor([medians["world"], medians["sub"]], dtype=torch.float64)
        tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
        if r:
            ratios.append(float(slowest[1] / slowest[0]))
    tdist.destroy_process_group(sub)
    return statistics.median(ratios)


# --------------------------------------------------------------------------- driver
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(backend: str, ranks: int, groups: int, timeout: float, speed: bool = False) -> Dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           HERE, "--worker", "--backend", backend, "--groups", str(groups)] + (["--speed"] if speed else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        out.seek(0)
        text = out.read()
    for line in text.splitlines():
        if "GROUPS " in line:
            return json.loads(line.split("GROUPS ", 1)[1])
    raise RuntimeError(f"the {backend} job (exit {proc.returncode}) reported nothing:\n{text[-4000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="processes per job (default 2)")
    parser.add_argument("--groups", type=int, default=100, help="groups each job makes (default 100)")
    parser.add_argument("--backends", default="smddp,gloo", help="comma-separated (default: smddp,gloo)")
    parser.add_argument("--jobs", type=int, default=1, help="jobs per backend, alternated (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a job may take (default 900)")
    parser.add_argument("--json", metavar="FILE", help="write every job's figures to FILE")
    parser.add_argument("--speed", action="store_true",
                        help="also time a 1 MB all-reduce on a subgroup of every rank against the world's")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="smddp", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    runs: Dict[str, List[Dict[str, float]]] = {b: [] for b in backends}
    load = os.getloadavg()
    for _ in range(args.jobs):
        for backend in backends:
            runs[backend].append(run_job(backend, args.ranks, args.groups, args.timeout, args.speed))
    n = args.groups
    print(f"# {n} groups of {args.ranks} ranks under torchrun, {args.jobs} job(s) per backend; "
          f"command: python {' '.join(['benchmarks/groups.py'] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"# machine: {platform.node()}, {os.cpu_count()} CPUs; load average before "
          f"{load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    header = (f"{'backend':<8}{'create s':>10}{'first s':>10}{'fds peak':>10}{'fds/grp':>9}{'fds after':>11}"
              f"{'thr peak':>10}{'thr/grp':>9}{'thr after':>11}{'rss MiB':>9}{'store':>7}{'shm MiB':>9}"
              f"{'shm after':>11}")
    print(header)

    def med(backend: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[backend])

    summary = {"groups": n, "ranks": args.ranks, "jobs": runs}
    for b in backends:
        fds_per = (med(b, "fds_peak") - med(b, "fds_before")) / n
        thr_per = (med(b, "threads_peak") - med(b, "threads_before")) / n
        print(f"{b:<8}{med(b, 'create'):>10.3f}{med(b, 'first'):>10.3f}{med(b, 'fds_peak'):>10.0f}{fds_per:>9.2f}"
              f"{med(b, 'fds_after'):>11.0f}{med(b, 'threads_peak'):>10.0f}{thr_per:>9.2f}"
              f"{med(b, 'threads_after'):>11.0f}{med(b, 'rss_peak'):>9.0f}{med(b, 'store'):>7.0f}"
              f"{med(b, 'shm_peak') / 2**20:>9.1f}{med(b, 'shm_after') / 2**20:>11.1f}")
        if any(r["wrong"] for r in runs[b]):
            print(f"# {b}: WRONG all-reduce results")
            return 1
    if args.speed:
        for b in backends:
            print(f"# {b}: a subgroup's 1 MB all-reduce / the world's = {med(b, 'speed'):.2f}x "
                  f"(median of within-round ratios, each job's median over jobs)")
    if "smddp" in runs and "gloo" in runs:
        ratio = statistics.median(s["create"] / g["create"] for s, g in zip(runs["smddp"], runs["gloo"]))
        print(f"# create: smddp / gloo = {ratio:.2f}x (median of per-job pairs)")
        summary["create_ratio"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
