"""FSDP2 step time, side by side: ``fully_shard`` on smddp's group against the same on gloo.

::

    python benchmarks/fsdp_step.py                       # mpirun jobs (about a minute)
    python benchmarks/fsdp_step.py --launcher torchrun   # torchrun jobs instead
    python benchmarks/fsdp_step.py --jobs 5 --json out.json

The driver is ``ddp_step.py``'s (:func:`ddp_step.collect`): ``--ranks``-rank and 1-rank jobs of
this script (``--worker``), alternated ``--jobs`` times; in each job every contender runs in the
same processes on the same data, with the same model and optimizer, in rounds whose order
rotates. Contenders:

- ``smddp``: ``fully_shard`` on every ``Linear`` and on the root, over a ``DeviceMesh`` of
  smddp's world group (FSDP2's all-gathers and reduce-scatters take smddp's communicator: on
  one host, the shared-memory plane);
- ``torch-gloo``: the same over a mesh of ``torch.distributed.new_group(backend="gloo")``;
- ``compute``: the plain module: the floor.

A step is ``zero_grad()``, forward (FSDP2 all-gathers each layer's parameters), cross-entropy,
``backward()`` (it reduce-scatters the gradients), ``SGD.step()`` on the shards; a figure is
the median over every step of every rank. One thread per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_step  # noqa: E402 - the shared driver, next to this file

CONTENDERS = ("smddp", "torch-gloo", "compute")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    import smddp.torch.distributed as dist

    dist.init_process_group()
    rank = dist.get_rank()
    gloo = tdist.new_group(backend="gloo")
    dims = ddp_step._layers(args.layers)

    def sharded(group) -> torch.nn.Module:
        model = ddp_step.mlp(dims)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    models = {"smddp": sharded(tdist.group.WORLD), "torch-gloo": sharded(gloo), "compute": ddp_step.mlp(dims)}
    results = ddp_step.timed_rounds(models, args, gloo, rank, dims)
    ddp_step.finish(args, results, {"params": sum(p.numel() for p in models["compute"].parameters()),
                                    "backend": dist.get_backend()})


def driver(args: argparse.Namespace) -> dict:
    return ddp_step.collect(args, __file__, CONTENDERS, ddp_step.PHASES)


def format_report(report: dict) -> str:
    s = report["setup"]
    n = s["ranks"]
    two, one = report["ms_per_step"][n], report["ms_per_step"][1]
    lines = [
        f"FSDP2 step time: {s['model']} ({s['params'] / 1e6:.1f}M parameters), fully_shard per Linear and root, "
        f"batch {s['batch_size']} per rank, 1 thread per rank, {s['launcher']}, smddp backend {s['backend']}",
        "",
        f"| ms per step (median, p10-p90) | {n} ranks | / floor | forward | backward | optimizer | 1 rank |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = (("smddp", "fully_shard on smddp"), ("torch-gloo", "fully_shard on gloo"),
              ("compute", "no FSDP (compute only): the floor"))
    for c, label in labels:
        ph = report["phases_ms"][c]
        lines.append(
            f"| {label} | {two[c]['median']:.2f} ({two[c]['p10']:.1f}-{two[c]['p90']:.1f}) "
            f"| {report['over_floor'][c]:.2f}x | "
            + " | ".join(f"{ph[p]:.2f}" for p in ddp_step.PHASES)
            + f" | {one[c]['median']:.2f} |"
        )
    lines += [
        "",
        f"fully_shard on smddp is {report['speedup']:.2f}x faster per step than on gloo (jobs: "
        f"{ddp_step.spread(report, 'torch-gloo', 'smddp')}), {report['over_floor']['smddp']:.2f}x the floor.",
        "",
        *ddp_step.footer(report),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ddp_step.run(argv, __doc__.split("\n")[0], worker, driver, format_report)


if __name__ == "__main__":
    main()
