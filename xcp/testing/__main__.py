"""``python -m xcp.testing --xcp-backend NAME [pytest options]``: the conformance suite for one backend.

Works from any directory: it loads the pytest plugin itself, collects the suite from the installed
package, loads no ``conftest.py`` (the suite needs none, and one of the current directory, xcp's own
tests/conftest.py at the repository's root, may need what the suite does not: hypothesis) and writes no
cache into the current directory. Needs pytest (xcp's ``test`` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path


def install_hint(module_file: str | Path = __file__) -> str:
    """How to install the test extra: from a checkout (editable) or from an index, judged from where this
    module lies (``module_file``, this file unless a caller says otherwise)."""
    root = Path(module_file).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "xcp" / "testing").is_dir():
        return f"pip install -e '.[test]' (in {root})"
    return "pip install 'xcp[test]'"


def main(argv: list[str] | None = None) -> int:
    try:
        import pytest
    except ImportError as exc:
        print(
            f"python -m xcp.testing needs pytest, which is not importable ({exc}); "
            f"install xcp's test extra: {install_hint()}",
            file=sys.stderr,
        )
        return 2

    args = sys.argv[1:] if argv is None else list(argv)
    return int(
        pytest.main(
            ["-p", "xcp.testing.pytest_plugin", "-p", "no:cacheprovider", "--noconftest", "--pyargs", "xcp.testing"]
            + args
        )
    )


if __name__ == "__main__":
    sys.exit(main())
