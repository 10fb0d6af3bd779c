"""``smddp-info``: the environment report to paste into bug reports (``report``), and the child
process that looks at torch, MPI and the GPUs for it (``probe``)."""

from __future__ import annotations


def main(argv=None) -> int:
    """``smddp-info``'s entry point (:func:`smddp.info.report.main`)."""
    from smddp.info.report import main as report

    return report(argv)
