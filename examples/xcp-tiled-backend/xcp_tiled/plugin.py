"""The plugin module the entry point names: one hook that registers the backend."""

import xcp

from .backend import TiledBackend


@xcp.hookimpl
def xcp_register_backends(register):
    register(TiledBackend())
