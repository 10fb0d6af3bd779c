"""smddp-bench's output: the table, CSV, plot and progress lines."""

from __future__ import annotations

import csv
import sys
import time
from typing import Dict, List, Sequence, Tuple

from smddp.bench.runner import Row
from smddp.bench.sizes import AVERAGE_MODES, format_size

CSV_FIELDS = ("op", "impl", "backend", "api", "device", "world_size", "size_bytes", "count", "dtype", "redop",
              "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong")


HEADER = ("#    size(B)        count      type   redop    root    time(us)  algbw(GB/s)  busbw(GB/s)  #wrong")


def format_row(row: Row) -> str:
    """One table row, aligned under :data:`HEADER`."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return (f"{row.size_bytes:12d} {row.count:12d} {row.dtype:>9s} {row.redop:>7s} {row.root:7d} "
            f"{row.time_us:11.2f} {row.algbw_gbps:12.2f} {row.busbw_gbps:12.2f} {wrong:>7s}")


def write_csv(path: str, rows: Sequence[Row]) -> None:
    """Every row, with full precision, under :data:`CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            record = {name: getattr(row, name) for name in CSV_FIELDS}
            record["wrong"] = "" if row.wrong is None else row.wrong
            writer.writerow(record)


def write_plot(path: str, rows: Sequence[Row], metric: str = "busbw", title: str = "") -> None:
    """Bandwidth against size, log axes, one line per collective and implementation.

    Needs matplotlib (``pip install 'smddp[bench]'``). Points with zero bandwidth (a world
    of one has no bus traffic) cannot sit on a log axis and are left out.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'smddp[bench]'") from exc

    # One colour per collective (and dtype, redop when several), one line style per implementation.
    lines: Dict[Tuple[str, str], List[Row]] = {}
    dtypes = {r.dtype for r in rows}
    redops = {r.redop for r in rows if r.op == "all_reduce"}
    for row in rows:
        what = row.op
        if len(dtypes) > 1:
            what += f" {row.dtype}"
        if len(redops) > 1 and row.op == "all_reduce":
            what += f" {row.redop}"
        lines.setdefault((what, row.label), []).append(row)
    colours = {what: f"C{i % 10}" for i, what in enumerate(dict.fromkeys(w for w, _ in lines))}
    styles = {label: ("-", "--", ":", "-.")[i % 4] for i, label in enumerate(dict.fromkeys(lb for _, lb in lines))}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    plotted = 0
    for (what, label), group in lines.items():
        points = [(r.size_bytes, getattr(r, f"{metric}_gbps")) for r in group]
        points = [(x, y) for x, y in points if y > 0]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, color=colours[what], linestyle=styles[label],
                label=f"{what} {label}")
        plotted += 1
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(int(x)) if x >= 1 else ""))
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(f"{metric} (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no {metric} above zero to plot", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Progress:
    """Progress lines on stderr.

    Args:
        total: number of steps.
        mode: ``"auto"`` (at most one line a second, none for a sweep shorter than a
            second), ``"on"`` (every step) or ``"off"``.
    """

    def __init__(self, total: int, mode: str = "auto", stream=None):
        self.total, self.mode = total, mode
        self.stream = stream or sys.stderr
        self.start = self.last = time.monotonic()
        self.done = 0

    def step(self, what: str) -> None:
        """Count one step done (``what``); print a line if the mode says it is time."""
        self.done += 1
        now = time.monotonic()
        if self.mode == "off":
            return
        if self.mode == "auto" and (now - self.start < 1.0 or (now - self.last < 1.0 and self.done < self.total)):
            return
        self.last = now
        print(f"smddp-bench: [{self.done:>4d}/{self.total}] {what} ({now - self.start:.1f} s)",
              file=self.stream, flush=True)




class Report:
    """Rank 0's tables, in nccl-tests' layout; on other ranks (``stream`` None) nothing is printed.

    Args:
        stream: where rank 0 writes (stdout), or None on the other ranks.
    """

    def __init__(self, stream=None):
        self.out = stream

    def _print(self, text: str) -> None:
        if self.out is not None:
            print(text, file=self.out, flush=True)

    def preamble(self, version: str, args, world_size: int, launcher: str, backend: str, device,
                 hosts: Sequence[str]) -> None:
        """The sweep's parameters, the job, and one line per rank (``hosts``)."""
        import torch

        step = f"{args.stepfactor:g}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
        self._print(f"# smddp-bench {version}: nranks {world_size} minBytes {args.minbytes} "
                    f"maxBytes {args.maxbytes} step: {step} warmup iters: {args.warmup} iters: {args.iters} "
                    f"validation: {int(args.check)}")
        self._print(f"# launcher: {launcher}  backend: {backend}  api: {args.api}  "
                    f"device: {device.type}  time: {AVERAGE_MODES[args.average]}  torch: {torch.__version__}")
        self._print("#\n# Using devices")
        for host in hosts:
            self._print(f"#  {host}")

    def section(self, op: str, label: str, api: str, dtype_name: str, redop: str) -> None:
        """The heading of one table: a collective on one implementation, dtype and reduction."""
        self._print(f"#\n# Collective: {op}  implementation: {label}  api: {api}  "
                    f"type: {dtype_name}" + (f"  redop: {redop}" if op == "all_reduce" else ""))
        self._print("#")
        self._print(HEADER)

    def row(self, row: Row) -> None:
        """One measured size."""
        self._print(format_row(row))

    def section_average(self, busbw: float) -> None:
        """The mean bus bandwidth of the table just printed."""
        self._print(f"# Avg bus bandwidth    : {busbw:.4g} GB/s")

    def summary(self, rows: Sequence[Row], averages: Sequence[Tuple[str, str, str, str, float]],
                check: bool) -> None:
        """The wrong-value total (with ``--check``), each table's mean bus bandwidth, and the overall mean."""
        self._print("#")
        if check:
            wrong = sum(r.wrong or 0 for r in rows)
            self._print(f"# Wrong values         : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        if len(averages) > 1:
            self._print("# Avg bus bandwidth per collective (GB/s):")
            for op, label, dtype_name, redop, avg in averages:
                extra = redop if op == "all_reduce" else ""
                self._print(f"#   {op:<11s} {label:<18s} {dtype_name:<9s} {extra:<5s} {avg:10.4g}")
        self._print(f"# Avg bus bandwidth    : {mean_busbw(rows):.4g} GB/s")
        self._print("#")


def mean_busbw(rows: Sequence[Row]) -> float:
    """The mean bus bandwidth of ``rows`` (0 for none)."""
    return sum(r.busbw_gbps for r in rows) / max(len(rows), 1)
