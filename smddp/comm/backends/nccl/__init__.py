"""The ``nccl`` backend: NCCL through CuPy's bindings, on CUDA tensors.

``communicator`` (``NCCLCommunicator``: what torch's ProcessGroupNCCL does, item by item),
``lane`` (the group's NCCL communicator on its device, made at first use), ``direct`` (the
all-reduce that needs nothing from the engine, and its ``StreamWork``), ``pending`` (what a
general-path collective hands the engine), ``watchdog`` (deadlines, held tensors, pooled events),
``failures`` (what a failure or a passed deadline does), ``unique_id`` (rank 0's id through the
group's store) and ``bindings`` (CuPy's module: its codes, what NCCL refuses, the dtypes sent
converted).
"""
