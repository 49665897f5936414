"""``python -m benchmarks.disk``: see ``benchmarks.disk.study``."""

import sys

from benchmarks.disk.study import main

sys.exit(main())
