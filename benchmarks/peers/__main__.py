"""``python -m benchmarks.peers``: see ``benchmarks.peers.run``."""

import sys

from benchmarks.peers.run import main

sys.exit(main())
