"""``python -m smddp.bench``: the ``smddp-bench`` command."""

from __future__ import annotations

import sys

from smddp.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
