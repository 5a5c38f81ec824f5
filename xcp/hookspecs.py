"""Hook specifications of xcp's plugin system (pluggy, project name ``xcp``).

A plugin is any object or module with functions marked ``@xcp.hookimpl`` and named after a hook below.
Built-in backends register through these hooks exactly like third-party ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .backends.base import Backend

PROJECT = "xcp"
ENTRY_POINT_GROUP = "xcp"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def xcp_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the backends a plugin provides.

    Called when xcp builds its table of backends: on first use, and again after a plugin is registered
    or unregistered, so it should be cheap and do nothing but create backends. Call ``register`` once per
    backend. Import the vendor module (torch_npu, flash_attn, ...) lazily inside the backend, not here,
    so that a missing package makes the backend unavailable (``available()`` says why) instead of
    breaking discovery.

    If this hook raises, the plugin is reported by name (a warning and a row of ``xcp backends``), the
    backends it registered are dropped and every other plugin's backends still work.

    :param register: ``register(backend)``, where ``backend`` is an instance of :class:`xcp.Backend`
        with a well-formed identity (a malformed one raises here). Two backends with one name, from any
        plugins, are an error that names both plugins.
    :returns: nothing.
    """
