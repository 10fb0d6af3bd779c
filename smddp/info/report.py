"""``smddp-info``: the environment report to paste into a bug report.

::

    smddp-info                 # or: python -m smddp.info
    smddp-info --json          # the same, as JSON
    mpirun -np 2 smddp-info    # under a launcher: rank 0 reports (--all-ranks: every rank)

It reports the versions of smddp, Python, torch, mpi4py and the MPI library, CuPy and
NCCL, oneCCL; the backends smddp has and whether each can run here; which one
``init_process_group()`` would choose under this launcher (and under mpirun and torchrun);
the launcher and topology detected; and the GPUs torch sees.

It never starts MPI in this process (importing ``mpi4py.MPI`` does): the MPI library and the
backend modules are loaded in a short-lived child process (:mod:`smddp.info.probe`) with
``mpi4py.rc.initialize`` off, so the report works with or without ``mpirun`` and with or
without mpi4py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

from smddp import knobs
from smddp.info.probe import MARKER

#: Environment variables worth showing: prefixes and exact names (values shown as they are).
ENV_PREFIXES = ("SMDDP_", "SMDATAPARALLEL_", "NCCL_", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL", "CCL_", "FI_")
ENV_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMIX_RANK",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
    "SM_HOSTS", "SM_CURRENT_HOST", "SM_NUM_GPUS", "SM_CURRENT_INSTANCE_TYPE",
    "CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "OMP_NUM_THREADS", "RDMAV_FORK_SAFE",
)
_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")

_CHILD_TIMEOUT = 60

def _version(module_name: str, dist_names: Sequence[str] = ()) -> Optional[str]:
    """A package's version without importing it (distribution metadata), else by import."""
    for name in (*dist_names, module_name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _run(cmd: Sequence[str], timeout: float = 10) -> Optional[str]:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout or done.stderr).strip() or None


def _start_child() -> Optional[subprocess.Popen]:
    """Start loading MPI, CuPy and every backend module in a child process (see :func:`_child_result`)."""
    import smddp

    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(smddp.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
    try:
        return subprocess.Popen([sys.executable, "-m", "smddp.info.probe"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    except OSError:
        return None


def _child_result(child: Optional[subprocess.Popen]) -> Dict[str, Any]:
    """What the child found: MPI and CuPy versions, and whether each backend module loads."""
    if child is None:
        return {"child_error": f"could not start {sys.executable}"}
    try:
        stdout, stderr = child.communicate(timeout=_CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"child_error": f"probing MPI and the backends took more than {_CHILD_TIMEOUT} s"}
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return {"child_error": f"the probe exited with status {child.returncode}: {' | '.join(tail)}"}


def cpu_model() -> Optional[str]:
    """This machine's CPU model (``/proc/cpuinfo``'s ``model name``), else the platform's word for it.

    Benchmarks name their machine with it, as ``smddp-info`` does.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    return None


def _environment() -> Dict[str, str]:
    shown = {}
    for name, value in sorted(os.environ.items()):
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES:
            if any(word in name.upper() for word in _SECRET_WORDS):
                value = "<hidden>"
            shown[name] = value
    return shown


def _torch_info() -> Dict[str, Any]:
    try:
        import torch
        import torch.distributed as tdist
    except ImportError as exc:
        return {"error": str(exc)}
    info: Dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "xpu": getattr(torch.version, "xpu", None),
        "distributed": tdist.is_available(),
        "threads": torch.get_num_threads(),
    }
    if tdist.is_available():
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            check = getattr(tdist, f"is_{name}_available", None)
            try:
                info[name] = bool(check()) if check else False
            except Exception:  # noqa: BLE001 - a broken backend is reported as missing
                info[name] = False
    if info.get("nccl"):
        try:
            version = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001
            pass
    return info


def _gpus() -> List[Dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    found = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                found.append({"type": "cuda", "index": i, "name": p.name,
                              "capability": f"{p.major}.{p.minor}",
                              "memory_gib": round(p.total_memory / (1 << 30), 1)})
    except Exception as exc:  # noqa: BLE001 - a broken driver is part of the report
        found.append({"type": "cuda", "error": f"{type(exc).__name__}: {exc}"})
    try:
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            for i in range(xpu.device_count()):
                p = xpu.get_device_properties(i)
                found.append({"type": "xpu", "index": i, "name": p.name,
                              "memory_gib": round(getattr(p, "total_memory", 0) / (1 << 30), 1)})
    except Exception as exc:  # noqa: BLE001
        found.append({"type": "xpu", "error": f"{type(exc).__name__}: {exc}"})
    return found


def _backends(child: Dict[str, Any], env) -> Dict[str, Any]:
    from smddp import comm
    from smddp.job.topology import Topology, discover

    found = comm.probe()
    devices = {"cpu": True, "cuda": found.cuda, "xpu": found.xpu}
    loads = child.get("backends", {})
    rows = []
    for name, info in comm.BACKENDS.items():
        error = loads.get(name) if name in loads else child.get("backends_error", "not probed")
        device_ok = devices.get(info.device, False)
        if error:
            note = f"cannot load: {error}"
        elif not device_ok:
            note = f"no {info.device} device here"
        else:
            note = info.summary
        rows.append({"name": name, "device": info.device, "loads": not error, "device_present": device_ok,
                     "runs_here": not error and device_ok, "needs": info.needs, "note": note})
    choices = {}
    try:
        here = discover(env)
    except ValueError as exc:
        here = None
        choices["this launcher"] = f"error: {exc}"
    scenarios = [("this launcher", here), ("under mpirun -np 2", Topology(size=2, local_size=2, launcher="openmpi")),
                 ("under torchrun --nproc-per-node 2", Topology(size=2, local_size=2, launcher="torchrun"))]
    for label, topology in scenarios:
        if topology is None:
            continue
        try:
            choices[label] = comm.choose_backend(None, env, topology, found)
        except Exception as exc:  # noqa: BLE001 - a bad SMDDP_BACKEND is worth reporting
            choices[label] = f"error: {exc}"
    # The text as set: a value the parser refuses is reported (its error is each choice's), not raised.
    return {"registry": rows, "auto": choices, "SMDDP_BACKEND": knobs.set_knobs(env).get("SMDDP_BACKEND"),
            "probe": {k: getattr(found, k) for k in ("cuda", "xpu", "mpi4py", "cupy", "xccl", "ccl")}}


def collect(env=None) -> Dict[str, Any]:
    """Everything the report shows, as a JSON-ready dict.

    Safe to call from any process: MPI is never initialized here (see the module docstring).

    Args:
        env: the environment to read the launcher from (default ``os.environ``).
    """
    import smddp
    from smddp.job.topology import discover

    env = os.environ if env is None else env
    started = _start_child()  # runs while this process looks at torch and the GPUs
    report: Dict[str, Any] = {
        "smddp": {"version": smddp.__version__, "path": os.path.dirname(os.path.abspath(smddp.__file__))},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count(),
                 "memory_gib": _memory_gib()},
        "torch": _torch_info(),
    }
    gpus = _gpus()
    child = _child_result(started)
    mpi4py_info: Dict[str, Any] = {"version": _version("mpi4py")}
    if "mpi4py_error" in child or not mpi4py_info["version"]:
        mpi4py_info = {"version": None, "error": child.get("mpi4py_error", "not installed")}
    report["mpi4py"] = mpi4py_info
    mpi: Dict[str, Any] = dict(child.get("mpi") or {})
    if "mpi_error" in child:
        mpi["error"] = child["mpi_error"]
    if "child_error" in child:
        mpi["error"] = child["child_error"]
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    mpi["mpirun"] = mpirun
    if mpirun:
        first = (_run([mpirun, "--version"]) or "").splitlines()
        mpi["mpirun_version"] = first[0] if first else None
    report["mpi"] = mpi
    cupy_info = child.get("cupy")
    if cupy_info is None:
        cupy_info = {"version": None, "error": child.get("cupy_error", "not installed")}
    report["cupy"] = cupy_info
    report["oneccl"] = {
        "oneccl_bindings_for_pytorch": _version("oneccl_bindings_for_pytorch", ("oneccl_bind_pt",)),
        "torch_xccl": bool(report["torch"].get("xccl")),
    }
    try:
        topology = discover(env)
        report["topology"] = {k: getattr(topology, k) for k in (
            "launcher", "rank", "size", "local_rank", "local_size", "node_rank", "master_addr", "master_port")}
        report["topology"]["distributed"] = topology.distributed
    except ValueError as exc:
        report["topology"] = {"error": str(exc)}
    report["backends"] = _backends(child, env)
    if "child_error" in child:
        report["backends"]["error"] = child["child_error"]
    report["shm"] = _shm_core(env)
    report["gpus"] = gpus
    report["environment"] = _environment()
    return report


def _shm_core(env) -> Dict[str, Any]:
    """Which implementation runs the shared-memory CPU plane here, and why."""
    from smddp.comm.planes import shm, shm_segment
    from smddp.comm.planes.choose import settings

    info: Dict[str, Any] = {"supported": shm_segment.supported(), "compiled": shm.native is not None,
                            "path": getattr(shm.native, "__file__", None)}
    if not info["supported"]:
        info["runs"] = "none (the plane needs x86-64 Linux with /dev/shm: CPU collectives use MPI or gloo)"
    elif shm.native is not None and settings(env).native:
        info["runs"] = "compiled core"
    elif shm.native is None:
        info["runs"] = "Python path (the compiled core was not built: no C compiler at install?)"
    else:
        info["runs"] = "Python path (SMDDP_SHM_NATIVE turns the compiled core off)"
    return info


def _yes(flag) -> str:
    return "yes" if flag else "no"


def format_report(report: Dict[str, Any]) -> str:
    """The plain-text report of :func:`collect`'s dict."""
    lines: List[str] = []
    add = lines.append
    s, py, host, t = report["smddp"], report["python"], report["host"], report["torch"]
    add("smddp environment report (paste all of it into a bug report)")
    add("")
    add(f"smddp         {s['version']}  ({s['path']})")
    add(f"python        {py['version']} ({py['implementation']}, {py['executable']})")
    add(f"host          {host['hostname']}: {host['platform']}, {host['cpus']} CPUs"
        + (f", {host['memory_gib']} GiB" if host.get("memory_gib") else ""))
    if host.get("cpu"):
        add(f"cpu           {host['cpu']}")
    if "error" in t:
        add(f"torch         cannot be imported: {t['error']}")
    else:
        builds = ", ".join(f"{k.upper()} {t[k]}" for k in ("cuda", "hip", "xpu") if t.get(k)) or "CPU only"
        dist = ", ".join(f"{k} {_yes(t.get(k))}" for k in ("gloo", "nccl", "mpi", "ucc", "xccl"))
        add(f"torch         {t['version']} ({builds}; {t['threads']} threads)")
        add(f"  distributed {dist}" + (f"; NCCL {t['nccl_version']}" if t.get("nccl_version") else ""))
    m4 = report["mpi4py"]
    add(f"mpi4py        {m4['version'] or 'not installed'}" + (f" ({m4['error']})" if m4.get("error") and
                                                                 m4["version"] is None and
                                                                 m4["error"] != "not installed" else ""))
    mpi = report["mpi"]
    if mpi.get("library_version"):
        add(f"MPI library   {mpi['library_version'].splitlines()[0]}")
        add(f"  standard    MPI {mpi['standard']} ({mpi['vendor']})")
    elif mpi.get("error"):
        add(f"MPI library   unavailable: {mpi['error']}")
    else:
        add("MPI library   unavailable (needs mpi4py)")
    add(f"mpirun        {mpi.get('mpirun') or 'not found'}"
        + (f" ({mpi['mpirun_version']})" if mpi.get("mpirun_version") else ""))
    cp = report["cupy"]
    if cp.get("version"):
        extra = [f"NCCL {cp['nccl']}" if cp.get("nccl") else f"NCCL unavailable ({cp.get('nccl_error')})"]
        if cp.get("cuda_runtime"):
            extra.append(f"CUDA runtime {cp['cuda_runtime']}")
        add(f"CuPy          {cp['version']} ({', '.join(extra)})")
    else:
        add(f"CuPy          {'not installed' if cp.get('error') == 'not installed' else cp.get('error')}")
    oc = report["oneccl"]
    add(f"oneCCL        oneccl_bindings_for_pytorch {oc['oneccl_bindings_for_pytorch'] or 'not installed'}; "
        f"torch XCCL {_yes(oc['torch_xccl'])}")
    add("")
    b = report["backends"]
    add("backends      name        device  runs here  note")
    for row in b["registry"]:
        add(f"              {row['name']:<11s} {row['device']:<7s} {_yes(row['runs_here']):<10s} {row['note']}")
    if b.get("error"):
        add(f"              (probe failed: {b['error']})")
    add(f"  SMDDP_BACKEND {b['SMDDP_BACKEND'] or '(not set)'}")
    for label, name in b["auto"].items():
        add(f"  init_process_group() {label}: {name}")
    shm_info = report.get("shm")
    if shm_info:
        add(f"  shared-memory CPU plane: {shm_info['runs']}")
        if shm_info["supported"]:
            add("    ranks that share a host meet through the job's store under any launcher (mpirun, smddprun,")
            add("    torchrun, srun, mp.spawn); SMDDP_DEBUG=1 prints the plane each group took and why")
    add("")
    topo = report["topology"]
    if "error" in topo:
        add(f"launcher      cannot read the topology: {topo['error']}")
    else:
        master = f"{topo['master_addr']}:{topo['master_port']}" if topo["master_addr"] else "none"
        add(f"launcher      {topo['launcher']}" + ("" if topo["distributed"] else " (a plain process: a world of one)"))
        add(f"topology      rank {topo['rank']} of {topo['size']}, local rank {topo['local_rank']} of "
            f"{topo['local_size']}, node {topo['node_rank']}, master {master}")
    gpus = report["gpus"]
    if not gpus:
        add("GPUs          none visible to torch")
    for g in gpus:
        if "error" in g:
            add(f"GPUs          {g['type']}: {g['error']}")
        else:
            cap = f", compute {g['capability']}" if g.get("capability") else ""
            add(f"GPU {g['type']}:{g['index']:<5d} {g['name']} ({g['memory_gib']} GiB{cap})")
    env = report["environment"]
    add("")
    add("environment   " + ("(none of the variables smddp reads is set)" if not env else ""))
    for name, value in env.items():
        add(f"  {name}={value}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``smddp-info`` command line."""
    parser = argparse.ArgumentParser(
        prog="smddp-info",
        description=(
            "Report smddp's environment for bug reports: versions of smddp, Python, torch, mpi4py "
            "and the MPI library, CuPy and NCCL, oneCCL; the backends and which can run here; the "
            "backend init_process_group() would choose; the launcher and topology; the GPUs. "
            "Works with or without mpirun and mpi4py; never initializes MPI in this process. "
            "Under a launcher only rank 0 reports unless --all-ranks is given."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument("--all-ranks", action="store_true",
                        help="under a launcher, every rank reports (prefixed with its rank; one JSON "
                             "document per line with --json)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``smddp-info``; returns the exit status."""
    args = build_parser().parse_args(argv)
    from smddp.job.topology import discover

    try:
        rank, launched = discover(os.environ).rank, discover(os.environ).distributed
    except ValueError:
        rank, launched = 0, False
    if launched and rank != 0 and not args.all_ranks:
        return 0
    try:
        import torch  # noqa: F401 - every section below asks torch
    except ImportError as exc:
        # A console script whose interpreter is not the one with torch (a `pip` that belongs to
        # another Python installed smddp there): say which, in one line.
        print(f"smddp-info: torch is not importable in {sys.executable} ({exc}); run it with the Python that "
              f"has torch: that Python's `-m smddp.info`, after `python -m pip install ...` with it", file=sys.stderr)
        return 1
    report = collect()
    if args.json:
        text = json.dumps(report, indent=None if args.all_ranks and launched else 2, default=str)
    else:
        text = format_report(report)
    if args.all_ranks and launched and not args.json:
        text = "\n".join(f"[rank {rank}] {line}" for line in text.splitlines())
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
