"""The ``smddp-bench`` command: arguments, the job's setup, the sweep and its report."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import traceback
from typing import List, Optional, Sequence, Tuple

from smddp.bench.adapters import Impl, SmddpImpl, TorchImpl
from smddp.bench.output import Progress, Report, mean_busbw, write_csv, write_plot
from smddp.bench.runner import Row, Runner
from smddp.bench.sizes import (
    AVERAGE_MODES,
    OPS,
    REDOPS,
    choices,
    dtype_names,
    format_size,
    parse_size,
    shape,
    sweep,
    torch_dtype,
)
from smddp.job.excepthook import abort_job

#: One table: (op, implementation, dtype name, redop or "none").
Section = Tuple[str, Impl, str, str]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The ``smddp-bench`` command line."""
    parser = argparse.ArgumentParser(
        prog="smddp-bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Benchmark smddp's collectives, with nccl-tests' columns and bandwidth conventions.\n"
            "Run it under a launcher: 'mpirun -np 2 smddp-bench ...', 'torchrun --nproc-per-node 2\n"
            "-m smddp.bench ...'; plain 'smddp-bench' runs a world of one. Rank 0 prints a table per\n"
            "collective: size(B) count type redop root time(us) algbw(GB/s) busbw(GB/s) #wrong."
        ),
        epilog=(
            "sizes: bytes of one rank's buffer (all_reduce, broadcast: the tensor; all_gather,\n"
            "  all_to_all: the whole output). Suffixes K, M, G are powers of 1024.\n"
            "timing: warmup calls, a barrier, then ITERS back-to-back blocking calls; time is the\n"
            "  elapsed time / ITERS (device synchronized once at the end), averaged over ranks (-a 1).\n"
            "algbw = size / time; busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather,\n"
            "  all_to_all), 1 (broadcast). GB/s = 1e9 bytes/s.\n"
            "exit status: 0, or 1 when --check found wrong elements or a rank failed."
        ),
    )
    parser.add_argument("--op", default="all_reduce",
                        help="collective(s): all_reduce, broadcast, all_gather, all_to_all, a comma-separated "
                             "list, or all (default: all_reduce)")
    parser.add_argument("-b", "--minbytes", type=_size_arg, default=parse_size("1K"),
                        help="smallest message size (default: 1K)")
    parser.add_argument("-e", "--maxbytes", type=_size_arg, default=parse_size("64M"),
                        help="largest message size (default: 64M)")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0,
                        help="multiply the size by this factor each step (default: 2); 1 steps by --stepbytes")
    parser.add_argument("-i", "--stepbytes", type=_size_arg, default=parse_size("1M"),
                        help="add this many bytes each step when --stepfactor is 1 (default: 1M)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default: 20)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed warm-up iterations per size (default: 5)")
    parser.add_argument("-d", "--dtype", default="float",
                        help="element type: float, half, bfloat16, double, int8, uint8, int32, int64 "
                             "(torch names such as float32 too), a comma-separated list, or all (default: float)")
    parser.add_argument("--redop", default="sum",
                        help="reduction of all_reduce: sum, avg, min, max, a list, or all (default: sum)")
    parser.add_argument("--root", type=int, default=0, help="source rank of broadcast (default: 0)")
    parser.add_argument("--backend", default=None,
                        help="smddp backend, as init_process_group(backend=...): mpi, gloo, nccl, xccl, local, "
                             "... (default: SMDDP_BACKEND, else chosen from the launcher and machine)")
    parser.add_argument("--api", choices=("smddp", "torch"), default="smddp",
                        help="call smddp.torch.distributed functions (smddp, default) or torch.distributed "
                             "functions on the smddp process group (torch, the path DDP and FSDP take)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "xpu"), default="auto",
                        help="where buffers live (default: auto, the device of the backend; CUDA and XPU "
                             "use the device of the local rank)")
    parser.add_argument("-c", "--check", action="store_true",
                        help="verify every result against the value computed locally from all ranks' seeded "
                             "inputs and report the wrong elements per size in #wrong")
    parser.add_argument("--compare", action="append", default=[], metavar="BACKEND",
                        help="also run torch.distributed's BACKEND (e.g. gloo) in the same job, on a group "
                             "made with torch.distributed.new_group(backend=BACKEND); repeatable")
    parser.add_argument("-a", "--average", type=int, choices=sorted(AVERAGE_MODES), default=1,
                        help="time reported across ranks: 0 rank 0, 1 average (default), 2 minimum, 3 maximum")
    parser.add_argument("--csv", metavar="FILE", help="write every row to FILE as CSV (rank 0)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot bandwidth against size, log axes, one line per collective and "
                             "implementation (rank 0; needs matplotlib: pip install 'smddp[bench]')")
    parser.add_argument("--plot-metric", choices=("busbw", "algbw"), default="busbw",
                        help="bandwidth on the plot's y axis (default: busbw)")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress lines on stderr: auto (once a second during sweeps longer than a "
                             "second), on, off")
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        args.ops = choices(args.op, OPS, "op")
        args.redops = choices(args.redop, REDOPS, "redop")
        args.dtypes = dtype_names(args.dtype)
        args.sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.root < 0:
        parser.error("--root must be a rank (0 or more)")
    args.compare = list(dict.fromkeys(b.strip().lower() for b in args.compare if b.strip()))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'smddp[bench]'")


def _pick_device(requested: str, backend: str):
    import torch

    from smddp import comm

    kind = requested
    if kind == "auto":
        info = comm.BACKENDS.get(backend)
        kind = info.device if info is not None else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "xpu":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _gather_hosts(rank: int, world_size: int, device) -> List[str]:
    """``Rank  r Pid  p on host device d`` lines, one per rank, gathered to every rank."""
    import torch

    import smddp.torch.distributed as dist

    line = f"Pid {os.getpid():6d} on {socket.gethostname():>12s} device {device}"
    data = line.encode()[:200].ljust(200)
    mine = torch.tensor(list(data), dtype=torch.uint8)
    if world_size == 1:
        return [f"Rank {rank:2d} {line}"]
    outs = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(outs, mine)
    return [f"Rank {r:2d} " + bytes(o.tolist()).decode(errors="replace").rstrip() for r, o in enumerate(outs)]


def _abort(exc: BaseException) -> None:
    """A rank failed: make the whole job stop instead of leaving the others in a collective."""
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    abort_job(1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``smddp-bench``; returns the exit status.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0, 1 when ``--check`` found wrong elements, 2 for a ``--root`` outside the job.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)

    import torch

    import smddp.torch.distributed as dist
    from smddp.job.topology import discover

    topology = discover(os.environ)
    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        # NCCL binds to the current device: pick it before the communicator is made.
        torch.cuda.set_device(topology.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=args.backend)
    try:
        return _run(args, topology.launcher)
    except Exception as exc:  # noqa: BLE001 - one failed rank must not leave the others waiting
        if topology.size > 1:
            _abort(exc)
        raise
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, launcher: str) -> int:
    """Every rank: the sweep of every section, rank 0's report and files; returns the exit status."""
    import torch.distributed as tdist

    import smddp
    import smddp.torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.root >= world_size:
        if rank == 0:
            print(f"smddp-bench: --root {args.root} is not a rank of this job (0..{world_size - 1})",
                  file=sys.stderr)
        return 2
    backend = dist.get_backend()
    device = _pick_device(args.device, backend)
    impls = _implementations(args, backend)
    report = Report(sys.stdout if rank == 0 else None)
    report.preamble(smddp.__version__, args, world_size, launcher, backend, device,
                    _gather_hosts(rank, world_size, device))
    rows = _sweep(args, _sections(args, impls), device, rank, world_size, report)
    if rank == 0:
        _write_files(args, rows, world_size, device)
    for impl in impls[1:]:
        tdist.destroy_process_group(impl.group)
    dist.barrier()
    return 1 if any(r.wrong for r in rows) else 0


def _implementations(args: argparse.Namespace, backend: str) -> List[Impl]:
    """smddp's (through ``--api``), then one torch group per ``--compare`` backend."""
    import torch.distributed as tdist

    impls: List[Impl] = [SmddpImpl() if args.api == "smddp" else TorchImpl(None, "smddp", backend)]
    for other in args.compare:
        group = tdist.new_group(backend=other)
        impls.append(TorchImpl(group, f"torch-{other}", other, emulate_avg=other == "gloo"))
    return impls


def _sections(args: argparse.Namespace, impls: Sequence[Impl]) -> List[Section]:
    """Every table, in print order: op, then implementation, then dtype, then redop."""
    return [(op, impl, dtype_name, redop)
            for op in args.ops for impl in impls for dtype_name in args.dtypes
            for redop in (args.redops if op == "all_reduce" else ["none"])]


def _sweep(args: argparse.Namespace, sections: Sequence[Section], device, rank: int, world_size: int,
           report: Report) -> List[Row]:
    """Measure every size of every section; print each row as it comes and the summary at the end."""
    progress = Progress(len(sections) * len(args.sizes), args.progress if rank == 0 else "off")
    rows: List[Row] = []
    averages = []
    for op, impl, dtype_name, redop in sections:
        report.section(op, impl.label, impl.api, dtype_name, redop)
        section_rows = _sweep_sizes(args, Runner(impl, device, rank, world_size, args.average), op,
                                    dtype_name, redop, report, progress)
        rows.extend(section_rows)
        averages.append((op, impl.label, dtype_name, redop, mean_busbw(section_rows)))
        if len(sections) > 1:
            report.section_average(averages[-1][-1])
    report.summary(rows, averages, args.check)
    return rows


def _sweep_sizes(args: argparse.Namespace, runner: Runner, op: str, dtype_name: str, redop: str,
                 report: Report, progress: Progress) -> List[Row]:
    """One section's rows: each size of the sweep once (sizes that round to the same case are skipped)."""
    rows: List[Row] = []
    seen = set()
    label = runner.impl.label
    for nbytes in args.sizes:
        _, size_bytes = shape(op, nbytes, torch_dtype(dtype_name).itemsize, runner.world_size)
        if size_bytes in seen:
            progress.step(f"{op} {label} {format_size(nbytes)}")
            continue
        seen.add(size_bytes)
        row = runner.measure(op, nbytes, dtype_name, redop if op == "all_reduce" else "sum",
                             args.root, args.warmup, args.iters, args.check)
        rows.append(row)
        report.row(row)
        progress.step(f"{op} {label} {format_size(row.size_bytes)}")
    return rows


def _write_files(args: argparse.Namespace, rows: Sequence[Row], world_size: int, device) -> None:
    """Rank 0: the ``--csv`` and ``--plot`` files."""
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        title = f"smddp-bench: {world_size} ranks, {', '.join(args.dtypes)}, {device.type}, {socket.gethostname()}"
        write_plot(args.plot, rows, args.plot_metric, title)
