"""``python -m xcp``: the ``xcp`` command without the console script (an entry point of the tools, like
xcp/cli/, so the layering test does not count it as a library module)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
