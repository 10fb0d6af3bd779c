"""smddp's PyTorch API, the twin of ``smdistributed.dataparallel.torch``.

- :mod:`smddp.torch.distributed`: ``init_process_group``, ranks, collectives, ``ReduceOp``.
- :mod:`smddp.torch.parallel`: ``DistributedDataParallel``.
- :mod:`smddp.torch.torch_smddp`: importing it registers the ``"smddp"`` backend with
  ``torch.distributed`` (v2 style).
"""
