"""Collectives built from the engine's own (:mod:`smddp.comm.algorithms.derived`)."""
