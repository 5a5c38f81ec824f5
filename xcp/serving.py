"""The serving kit's public name for the paged placement (``xcp.serving.local_lengths``, an exact spelling
engines call): :mod:`xcp.inference.serving` holds it."""

from __future__ import annotations

from .inference.serving import local_lengths

__all__ = ["local_lengths"]
