"""Two "hosts" on one Linux machine: network namespaces joined by a veth pair (root only).

Each host is a network namespace with its own address (10.213.N.1 and .2, private to the
namespaces) and, per process, its own host name (``unshare --uts``). Open MPI reaches the
second host through a launch agent that enters its namespace instead of ssh
(``--mca plm_ssh_agent``), so a job started with ``-H host1:2,host2:2`` runs two ranks per
"host" and talks TCP between them, as across real machines. /dev/shm stays shared, as the
ranks of one real host share it; the hosts differ by name, as MPI sees them.

::

    python benchmarks/netns_hosts.py -- smddprun -H host1:2,host2:2 --mpi-args "$SMDDP_NETNS_MPI_ARGS" \\
        benchmarks/allreduce_cpu.py --sizes 16M

The command runs on host1 with ``SMDDP_NETNS_MPI_ARGS`` set (the mpirun arguments the agent
needs). Namespaces, links and files are removed afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, List, Optional, Sequence

HOSTS = ("host1", "host2")


class NamespaceError(RuntimeError):
    """The namespaces cannot be made here (not root, no ``ip``/``unshare``, no permission)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TwoHosts:
    """Live namespaces: :meth:`command` wraps a command to run on host1."""

    def __init__(self, tag: str, subnet: int, workdir: str):
        self.tag, self.subnet, self.workdir = tag, subnet, workdir
        self.agent = os.path.join(workdir, "agent.sh")
        net = f"10.213.{subnet}.0/24"
        self.mpi_args = (f"--mca plm_ssh_agent {self.agent} --mca btl_tcp_if_include {net} "
                         f"--mca oob_tcp_if_include {net}")

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def command(self, argv: Sequence[str], host: str = "host1") -> List[str]:
        """``argv`` as run on ``host``, with ``SMDDP_NETNS_MPI_ARGS`` in its environment."""
        # The agent hands its arguments to sh -c as one string, as ssh does: quote each.
        return [self.agent, host, *(_quote(a) for a in ["env", f"SMDDP_NETNS_MPI_ARGS={self.mpi_args}", *argv])]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@contextlib.contextmanager
def two_hosts(subnet: Optional[int] = None) -> Iterator[TwoHosts]:
    """Make host1 and host2; remove them on exit.

    Raises:
        NamespaceError: they cannot be made here (the message says why).
    """
    if os.geteuid() != 0:
        raise NamespaceError("network namespaces need root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise NamespaceError(f"{tool} is not installed")
    tag = f"smddp{os.getpid() % 100000}"
    subnet = os.getpid() % 200 + 20 if subnet is None else subnet
    workdir = tempfile.mkdtemp(prefix="smddp-netns-")
    hosts = TwoHosts(tag, subnet, workdir)
    made: List[str] = []
    veth = (f"{tag}a", f"{tag}b")
    try:
        for host in HOSTS:
            ns = hosts.namespace(host)
            _ip("netns", "add", ns)
            made.append(ns)
            # ip netns exec bind-mounts /etc/netns/NS/hosts over /etc/hosts: names resolve inside only.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(
                    f"10.213.{subnet}.{j + 1} {h}\n" for j, h in enumerate(HOSTS)))
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i, host in enumerate(HOSTS):
            ns = hosts.namespace(host)
            _ip("link", "set", veth[i], "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.213.{subnet}.{i + 1}/24", "dev", veth[i])
            _ip("-n", ns, "link", "set", veth[i], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        with open(hosts.agent, "w") as f:
            f.write("#!/bin/sh\n"
                    "# Open MPI's ssh: agent HOST COMMAND... runs COMMAND in HOST's namespace, under HOST's name.\n"
                    'host=$1; shift\n'
                    f'exec ip netns exec "{tag}-$host" unshare --uts sh -c "hostname $host && $*"\n')
        os.chmod(hosts.agent, 0o755)
        probe = subprocess.run(hosts.command(["hostname"], "host2"), capture_output=True, text=True, timeout=30)
        if probe.returncode or probe.stdout.strip() != "host2":
            raise NamespaceError(f"cannot enter the namespaces: {probe.stderr.strip() or probe.stdout.strip()}")
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        # The veth pair goes with its namespaces; one never moved into them is removed here.
        subprocess.run(["ip", "link", "del", veth[0]], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with two_hosts() as hosts:
            return subprocess.run(hosts.command(argv)).returncode
    except NamespaceError as exc:
        print(f"netns_hosts: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
