"""Run ``xcp bench`` from a checkout: ``python benchmarks/ring_bench.py [xcp bench flags]``.

The measuring code lives in :mod:`xcp.cli.bench` so that the console script and this file share it.
"""

import sys

from xcp.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
