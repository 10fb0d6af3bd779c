"""Importing this module registers the ``"smddp"`` backend with ``torch.distributed``.

The v2 style of smdistributed (1.4 and later)::

    import smddp.torch.torch_smddp  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group(backend="smddp")

Under ``mpirun`` no ``MASTER_ADDR``/``MASTER_PORT`` is needed: the ranks meet over MPI.
The backend (mpi, gloo, nccl, ...) is chosen as for
:func:`smddp.torch.distributed.init_process_group`; ``SMDDP_BACKEND`` overrides it.
"""

from smddp.torch.groups import register as _register

_register()
