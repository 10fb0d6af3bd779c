"""Build smddp's one compiled part: the shared-memory plane's core (plain C, no torch headers).

Everything else is in setup.cfg. The extension is optional: where no C compiler is found the
install goes on, and the shared-memory plane runs its Python path (``smddp-info`` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "smddp.comm.planes._shm_native",
            ["smddp/comm/planes/_shm_native.c"],
            # One translation unit: the .c includes these (listed, they ship in the sdist too).
            depends=["smddp/comm/planes/_shm_fold.h", "smddp/comm/planes/_shm_sync.h",
                     "smddp/comm/planes/_shm_ops.h", "smddp/comm/planes/_shm_cma.h",
                     "smddp/comm/planes/_shm_op_type.h", "smddp/comm/planes/_shm_step.h"],
            # -fno-wrapv: Python's own CFLAGS carry -fwrapv, under which GCC's code for the folds
            # measured 1.2-1.3x slower at 1-4 MB (docs/performance.md); the folds' integer
            # arithmetic is unsigned, so nothing relies on signed wrap-around. -ffp-contract=off:
            # no a * b + c fused into one rounding, whatever the CPU: every build rounds alike.
            # -fno-trapping-math: no floating-point trap is ever enabled here, and without it GCC
            # keeps the half-precision conversions' branch-free selects as branches, unvectorized
            # (the results are the same bits either way).
            extra_compile_args=["-O3", "-std=gnu11", "-fno-wrapv", "-ffp-contract=off", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
