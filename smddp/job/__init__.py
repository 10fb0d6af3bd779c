"""The running job's facts: who this process is and where its peers are.

``topology`` (rank, sizes, launcher: a pure function of the environment), ``host`` (the one
definition of "the same host"), ``runtime`` (what SageMaker gives each process), ``sockets``
(where smddp may listen), ``wire`` (small values sent between ranks), ``mca`` (Open MPI's
settings before it starts) and ``excepthook`` (one failing rank ends the whole job). Nothing
here imports smddp beyond ``smddp.errors`` and ``smddp.knobs``.
"""
