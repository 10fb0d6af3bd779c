"""The backends: one communicator module per library, and what they share.

Each module moves tensors through one library (``mpi``, ``gloo``, ``nccl``, torch's own
NCCL/XCCL, ``local``); :mod:`smddp.comm` (the registry) imports one only when its backend
is chosen.
"""
