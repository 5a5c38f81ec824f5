"""Entry point of the CUDA backend: registers :class:`xcp_cuda.CUDABackend` like any third-party plugin.

Importing this module touches no device; whether CUDA is usable is answered by ``available()``.
"""

from __future__ import annotations

from collections.abc import Callable

import xcp
from xcp.backends.base import Backend

from .backend import CUDABackend


@xcp.hookimpl
def xcp_register_backends(register: Callable[[Backend], None]) -> None:
    register(CUDABackend())
