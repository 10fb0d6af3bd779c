"""Make "hosts" out of one machine's ranks, each built its own way; imported first by a test script.

``FAKE_RANKS_PER_HOST=n``: every n ranks (by launched rank) make one host, ``SMDDP_HOST_ID=host<i>``.
Otherwise the hosts are the machines (or network namespaces) the launcher put the ranks on.
``FAKE_ENV_<host>="NAME=VALUE ..."`` sets variables on that host's ranks before smddp is imported:
a host without the compiled core (``SMDDP_SHM_NATIVE=0``), other ``SMDDP_SHM_*`` sizes, another
threshold.
"""

from __future__ import annotations

import os
import socket

LAUNCHED = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
if os.environ.get("FAKE_RANKS_PER_HOST"):
    os.environ["SMDDP_HOST_ID"] = f"host{LAUNCHED // int(os.environ['FAKE_RANKS_PER_HOST'])}"
#: This rank's host, as the variables above name it.
HOST = os.environ.get("SMDDP_HOST_ID") or socket.gethostname()
for assignment in os.environ.get(f"FAKE_ENV_{HOST}", "").split():
    name, _, value = assignment.partition("=")
    os.environ[name] = value
