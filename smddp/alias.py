"""Opt in to zero-edit imports: ``import smdistributed.dataparallel.torch...`` gets smddp.

Importing this module turns the alias on, the way importing
``smdistributed.dataparallel.torch.torch_smddp`` registers a backend::

    import smddp.alias  # noqa: F401
    import smdistributed.dataparallel.torch.distributed as dist  # is smddp.torch.distributed

To run a script unchanged, start it through this module instead (any launcher)::

    python -m smddp.alias train.py --epochs 3
    torchrun --nproc-per-node 2 -m smddp.alias train.py
    mpirun -np 2 python -m smddp.alias train.py

``smddprun`` does the same for every process it starts. A real smdistributed install is
never shadowed: when one is importable the alias stays off and a note says so on stderr.
"""

from __future__ import annotations

from smddp.launch.smdistributed import ALIAS_ROOT, TARGET_ROOT, disable, enable, is_enabled, real_smdistributed

__all__ = ["ALIAS_ROOT", "TARGET_ROOT", "enable", "disable", "is_enabled", "real_smdistributed"]

enable()

if __name__ == "__main__":
    from smddp.launch.bootstrap import main

    main()
