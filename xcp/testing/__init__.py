"""Tools for testing xcp and its backends.

- :mod:`xcp.testing.conformance`: the checks every backend must pass (``python -m xcp.testing
  --xcp-backend NAME`` runs them under pytest);
- :mod:`xcp.testing.reference`: the float64 reference attention they compare against;
- :mod:`xcp.testing.pytest_plugin`: the ``--xcp-backend`` option and ``xcp_backend`` fixture.

Nothing is imported here, so that importing one tool does not pull in the others (or pytest).
"""
