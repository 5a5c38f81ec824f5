"""The conformance suite as pytest tests, one per check of :func:`xcp.testing.conformance.cases`.

Run it for one backend from any directory: ``python -m xcp.testing --xcp-backend NAME``, or
``pytest -p xcp.testing.pytest_plugin --pyargs xcp.testing --xcp-backend NAME``.
"""

from __future__ import annotations

import pytest

from xcp.testing import conformance
from xcp.testing.pytest_plugin import chosen_backend


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" in metafunc.fixturenames:
        cases = conformance.cases(chosen_backend(metafunc.config))
        metafunc.parametrize("conformance_case", cases, ids=str)


def test_conformance(conformance_case: conformance.Case, xcp_backend) -> None:
    conformance_case.run(xcp_backend)
