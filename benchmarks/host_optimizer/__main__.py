"""``python -m benchmarks.host_optimizer``: see ``benchmarks.host_optimizer.study``."""

import sys

from benchmarks.host_optimizer.study import main

sys.exit(main())
