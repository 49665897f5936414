"""``python -m benchmarks.checkpoint_stall``: see ``benchmarks.checkpoint_stall.study``."""

import sys

from benchmarks.checkpoint_stall.study import main

sys.exit(main())
