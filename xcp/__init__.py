"""xcp: context-parallel (ring) attention with proven-safe, bounded buffer lifetimes on any device.

The public names load on first use (PEP 562), so importing a submodule that needs no torch (the pytest
plugin, the schedule) stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import attention, shard, unshard
    from .backends.base import Backend, SynchronousBackend
    from .comm import CommTimeout, Communicator, LocalGroup, LocalWorld
    from .context import context
    from .documents import choose_balance
    from .hookspecs import hookimpl
    from .inference.cache import KVCache
    from .inference.paged import PagedKVCache
    from .inference.paged_decode import PagedDecode
    from .inference.partials import combine
    from .lifetime import BufferLedger, track_buffers
    from .padding import pad_to_balance
    from .plugins import backend_table, get_backend, list_backends, register_plugin, unregister_plugin
    from .ring import RingConfig, ring_backward, ring_forward
    from .schedule import BALANCES, DOCUMENT_BALANCES, Plan, Step, plan

_EXPORTS = {
    "BALANCES": "schedule",
    "DOCUMENT_BALANCES": "schedule",
    "Backend": "backends.base",
    "BufferLedger": "lifetime",
    "CommTimeout": "comm",
    "KVCache": "inference.cache",
    "PagedKVCache": "inference.paged",
    "PagedDecode": "inference.paged_decode",
    "combine": "inference.partials",
    "Communicator": "comm",
    "LocalGroup": "comm",
    "LocalWorld": "comm",
    "Plan": "schedule",
    "RingConfig": "ring",
    "Step": "schedule",
    "SynchronousBackend": "backends.base",
    "attention": "api",
    "backend_table": "plugins",
    "choose_balance": "documents",
    "context": "context",
    "get_backend": "plugins",
    "hookimpl": "hookspecs",
    "list_backends": "plugins",
    "pad_to_balance": "padding",
    "plan": "schedule",
    "register_plugin": "plugins",
    "ring_backward": "ring",
    "ring_forward": "ring",
    "shard": "api",
    "track_buffers": "lifetime",
    "unregister_plugin": "plugins",
    "unshard": "api",
}
"""Public name -> the submodule that defines it."""

__all__ = [
    "BALANCES",
    "DOCUMENT_BALANCES",
    "Backend",
    "BufferLedger",
    "CommTimeout",
    "KVCache",
    "PagedKVCache",
    "PagedDecode",
    "Communicator",
    "LocalGroup",
    "LocalWorld",
    "Plan",
    "RingConfig",
    "Step",
    "SynchronousBackend",
    "attention",
    "backend_table",
    "choose_balance",
    "combine",
    "context",
    "get_backend",
    "hookimpl",
    "list_backends",
    "pad_to_balance",
    "plan",
    "register_plugin",
    "ring_backward",
    "ring_forward",
    "shard",
    "track_buffers",
    "unregister_plugin",
    "unshard",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule, as ``xcp.schedule`` after a plain ``import xcp``
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'xcp' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
