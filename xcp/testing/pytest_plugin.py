"""pytest plugin of the conformance suite: the ``--xcp-backend NAME`` option and the ``xcp_backend`` fixture.

Load it with ``-p xcp.testing.pytest_plugin`` (``python -m xcp.testing`` does). Installing xcp also registers
it (entry point ``pytest11``), so every pytest session of that environment loads it: at module level it
imports pytest and nothing else (no xcp module, no torch); xcp is imported only when ``--xcp-backend`` is
used (``tests/test_packaging.py`` checks this).
"""

from __future__ import annotations

from typing import Any

import pytest

OPTION = "--xcp-backend"
COMMAND = "python -m xcp.testing --xcp-backend NAME"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("xcp", "xcp backend conformance")
    group.addoption(
        OPTION,
        dest="xcp_backend",
        default=None,
        metavar="NAME",
        help="run xcp's backend conformance suite (pytest --pyargs xcp.testing) on the backend NAME",
    )


def chosen_backend(config: pytest.Config) -> Any:
    """The backend named by ``--xcp-backend``; a usage error naming the choices when absent or unusable."""
    from xcp.plugins import get_backend

    name = config.getoption("xcp_backend", default=None)
    if not name:
        raise pytest.UsageError(f"xcp.testing: choose the backend to check: {COMMAND}")
    try:
        return get_backend(name)
    except RuntimeError as exc:
        raise pytest.UsageError(f"{OPTION}={name}: {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("xcp_backend", default=None):
        chosen_backend(config)  # fail before collection when the backend cannot run here


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption("xcp_backend", default=None):
        return None
    b = chosen_backend(config)
    dtypes = ", ".join(str(d).removeprefix("torch.") for d in b.dtypes)
    return (
        f"xcp backend: {b.name} (device {b.device_type}, {b.dist_backend}, hand-off {b.handoff_policy}, "
        f"kernel {b.kernel}; dtypes {dtypes}; masks {', '.join(b.masks)})"
    )


@pytest.fixture(scope="session")
def xcp_backend(pytestconfig: pytest.Config) -> Any:
    """The backend under test (``--xcp-backend NAME``)."""
    return chosen_backend(pytestconfig)
