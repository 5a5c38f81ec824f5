"""``python -m xcp.cli``: the ``xcp`` command without the console script (torchrun and benchmarks/*.sh)."""

import sys

from . import main

sys.exit(main())
