"""Tools for testing xcp and its backends.

- :mod:`xcp.testing.conformance`: the checks every backend must pass (``python -m xcp.testing
  --xcp-backend NAME`` runs them under pytest);
- :mod:`xcp.testing.reference`: the float64 reference attention they compare against;
- :mod:`xcp.testing.pytest_plugin`: the ``--xcp-backend`` option and ``xcp_backend`` fixture;
- :mod:`xcp.testing.sanitizer` and :mod:`xcp.testing.sim_device`: the lifetime sanitizer and the
  simulated asynchronous device it runs the ring on (``xcp sanitize``);
- :mod:`xcp.testing.doubles`: stand-ins for a communicator and a backend's kernels, for the tools and
  tests that measure or check one part of a call alone.

Nothing is imported here, so that importing one tool does not pull in the others (or pytest).
"""
