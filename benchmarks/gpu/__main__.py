"""``python -m benchmarks.gpu``: see ``benchmarks.gpu.peers``."""

import sys

from benchmarks.gpu.peers import main

sys.exit(main())
