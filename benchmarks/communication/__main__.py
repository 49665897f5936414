"""``python -m benchmarks.communication``: see ``benchmarks.communication.exchanges``."""

import sys

from benchmarks.communication.exchanges import main

sys.exit(main())
