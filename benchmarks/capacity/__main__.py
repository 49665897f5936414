"""``python -m benchmarks.capacity``: see ``benchmarks.capacity.search``."""

import sys

from benchmarks.capacity.search import main

sys.exit(main())
