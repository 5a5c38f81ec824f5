"""Hook specifications of xcp's plugin system (pluggy, project name ``xcp``).

A plugin is any object or module with functions marked ``@xcp.hookimpl`` and named after a hook below.
Built-in backends register through these hooks exactly like third-party ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .backend import Backend

PROJECT = "xcp"
ENTRY_POINT_GROUP = "xcp"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def xcp_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the backends a plugin provides.

    Called once when xcp loads its plugins. Call ``register`` once per backend; importing the vendor
    module (torch_npu, flash_attn, ...) must not happen here but lazily inside the backend, so that a
    missing package makes the backend unavailable instead of breaking discovery.

    :param register: ``register(backend)``, where ``backend`` is an instance of :class:`xcp.Backend`.
        Registering two backends with one name is an error that names both plugins.
    :returns: nothing.
    """
