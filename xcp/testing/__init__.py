"""Tools for testing xcp and its backends.

- :mod:`xcp.testing.conformance`: the checks every backend must pass (``python -m xcp.testing
  --xcp-backend NAME`` runs them under pytest);
- :mod:`xcp.testing.reference`: the float64 reference attention they compare against;
- :mod:`xcp.testing.pytest_plugin`: the ``--xcp-backend`` option and ``xcp_backend`` fixture;
- :mod:`xcp.testing.sanitizer` and :mod:`xcp.testing.sim_device`: the lifetime sanitizer and the
  simulated asynchronous device it runs the ring on (``xcp sanitize``);
- :mod:`xcp.testing.combine_check`: ``check_combine``, the property suite for an engine's own combine of
  partial attentions (``xcp.testing.check_combine``, loaded on first use);
- :mod:`xcp.testing.doubles`: stand-ins for a communicator and a backend's kernels, for the tools and
  tests that measure or check one part of a call alone.

Nothing is imported here, so that importing one tool does not pull in the others (or pytest).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``check_combine`` loads its module (and Hypothesis) on first use."""
    if name == "check_combine":
        from .combine_check import check_combine

        return check_combine
    raise AttributeError(f"module 'xcp.testing' has no attribute {name!r}")
