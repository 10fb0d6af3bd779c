"""``python -m smddp.launch``: ``smddprun``."""

import sys

from smddp.launch.smddprun import main

sys.exit(main())
