"""Entry point of the Ascend backend: registers :class:`xcp_npu.NPUBackend` like any third-party plugin.

Importing this module imports neither torch_npu nor anything that touches a device.
"""

from __future__ import annotations

from collections.abc import Callable

import xcp
from xcp.backends.base import Backend

from .backend import NPUBackend


@xcp.hookimpl
def xcp_register_backends(register: Callable[[Backend], None]) -> None:
    register(NPUBackend())
