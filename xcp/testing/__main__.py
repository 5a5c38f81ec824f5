"""``python -m xcp.testing --xcp-backend NAME [pytest options]``: the conformance suite for one backend.

Works from any directory: it loads the pytest plugin itself, collects the suite from the installed
package and writes no cache into the current directory.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import pytest

    args = sys.argv[1:] if argv is None else list(argv)
    return int(
        pytest.main(["-p", "xcp.testing.pytest_plugin", "-p", "no:cacheprovider", "--pyargs", "xcp.testing", *args])
    )


if __name__ == "__main__":
    sys.exit(main())
