"""Launching: ``smddprun`` and what runs in each process before the user's script.

``smddprun`` (the command line, ``args``), its job on one host without mpirun (``local_job``)
or under mpirun (``mpi_job``), the first code of every process it starts (``bootstrap``, which
watches its parent, ``parent_watch``), the import alias of ``smdistributed`` (``smdistributed``)
and SageMaker's data-parallel switch (``sagemaker_switch``). Nothing here imports
``smddp.comm``. ``python -m smddp.launch`` is ``smddprun``.
"""

from __future__ import annotations


def main(argv=None) -> int:
    """``smddprun``'s entry point (:func:`smddp.launch.smddprun.main`)."""
    from smddp.launch.smddprun import main as smddprun

    return smddprun(argv)
