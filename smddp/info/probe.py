"""The child process of ``smddp-info``: loads what would start MPI or a device runtime, prints JSON.

``smddp-info`` runs ``python -m smddp.info.probe`` so that importing ``mpi4py.MPI``, CuPy
and the backend modules never happens in the reporting process itself (importing
``mpi4py.MPI`` starts MPI there). MPI is loaded with ``mpi4py.rc.initialize`` off, so it is
never initialised here either. The result is one line on stdout: :data:`MARKER` followed by
the JSON object (anything a library prints before it is ignored).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict

#: Starts the line that carries the result.
MARKER = "@@SMDDP-INFO@@"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def probe_mpi() -> Dict[str, Any]:
    """mpi4py's version and the MPI library's, without initialising MPI."""
    out: Dict[str, Any] = {}
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        out["mpi4py"] = {"version": mpi4py.__version__}
        from mpi4py import MPI

        vendor, version = MPI.get_vendor()
        out["mpi"] = {
            "library_version": MPI.Get_library_version().strip(),
            "standard": ".".join(map(str, MPI.Get_version())),
            "vendor": f"{vendor} {'.'.join(map(str, version))}",
        }
    except ImportError as exc:
        out["mpi4py_error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken MPI library is reported, not raised
        out["mpi_error"] = _error(exc)
    return out


def probe_cupy() -> Dict[str, Any]:
    """CuPy's version, with the NCCL and CUDA runtime versions it loads; empty without CuPy.

    torch is imported first, as smddp's ``nccl`` backend does: a CUDA build of torch loads its
    NCCL and CUDA libraries, and CuPy then finds and reports those, the ones a job would use.
    """
    try:
        import torch  # noqa: F401 - loads the libraries CuPy must find
    except Exception:  # noqa: BLE001 - a broken torch is reported by the parent
        pass
    try:
        import cupy
    except ImportError:
        return {}
    except Exception as exc:  # noqa: BLE001 - a broken CuPy is reported, not raised
        return {"cupy_error": _error(exc)}
    info: Dict[str, Any] = {"version": cupy.__version__}
    try:
        from cupy.cuda import nccl

        v = nccl.get_version()
        info["nccl"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)
    except Exception as exc:  # noqa: BLE001
        info["nccl_error"] = _error(exc)
    try:
        v = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_runtime"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception as exc:  # noqa: BLE001
        info["cuda_runtime_error"] = _error(exc)
    return {"cupy": info}


def probe_backends() -> Dict[str, Any]:
    """For each registered backend, None when its module loads here, else why not."""
    try:
        from smddp import comm

        loads: Dict[str, Any] = {}
        for name in list(comm.BACKENDS):
            try:
                comm.backend_class(name)
                loads[name] = None
            except Exception as exc:  # noqa: BLE001 - the reason is the report
                loads[name] = str(exc)
        return {"backends": loads}
    except Exception as exc:  # noqa: BLE001
        return {"backends_error": _error(exc)}


def main() -> None:
    """Probe MPI, CuPy and the backends; write the :data:`MARKER` line to stdout."""
    out: Dict[str, Any] = {}
    out.update(probe_mpi())
    out.update(probe_cupy())
    out.update(probe_backends())
    sys.stdout.write("\n" + MARKER + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
