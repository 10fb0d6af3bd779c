"""The CPU planes: shared memory within a host, hierarchical across hosts.

``choose`` picks and builds a group's CPU communicator from its agreed ``layout``;
``communicators`` composes the planes as communicators (one host: ``ShmCommunicator``; several:
``HierarchicalCommunicator``); ``shm`` runs the shared-memory collectives over ``shm_segment``'s
segment, in the compiled core (``_shm_native.c`` and ``_shm_*.h``) or, as the fallback, through
``shm_torch``; ``shm_cma`` says whether a host's ranks may read each other's memory;
``hostmates`` finds the ranks of one host.
"""
