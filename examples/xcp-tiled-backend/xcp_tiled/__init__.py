"""An example third-party xcp backend, ``tiled``: see README.md."""

from .backend import TiledBackend

__all__ = ["TiledBackend"]
