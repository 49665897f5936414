"""``python -m benchmarks.hybrid``: see ``benchmarks.hybrid.rows``."""

import sys

from benchmarks.hybrid.rows import main

sys.exit(main())
