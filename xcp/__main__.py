"""``python -m xcp``: the ``xcp`` command without the console script.

It hands over to ``python -m xcp.cli`` (whose ``__main__`` calls :func:`xcp.cli.main`) by module name,
so that this entry point does not make the library import its tools (tests/test_purity.py).
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("xcp.cli", run_name="__main__", alter_sys=True)
