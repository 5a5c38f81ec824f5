"""Backends: the contract every device implements and the built-in ones.

- :mod:`xcp.backends.base`: the contract (:class:`~xcp.backends.base.Backend`, its three groups: required
  device primitives, optional fast paths, tool hooks), :class:`~xcp.backends.base.SynchronousBackend` and
  :func:`~xcp.backends.base.check_backend`;
- :mod:`xcp.backends.fused`: the base for backends whose block kernel is a fused vendor op (the mask tiling,
  GQA by repetition);
- :mod:`xcp.backends.cpu`: the built-in CPU backend and its plugin hook.
"""
