"""``python -m smddp.info``: ``smddp-info``."""

import sys

from smddp.info.report import main

sys.exit(main())
