"""xcp: context-parallel (ring) attention with proven-safe, bounded buffer lifetimes on any device."""

from .api import attention, shard, unshard
from .backend import Backend, SynchronousBackend
from .comm import Communicator, LocalGroup, LocalWorld
from .hookspecs import hookimpl
from .lifetime import BufferLedger, track_buffers
from .plugins import backend_table, get_backend, list_backends, register_plugin, unregister_plugin
from .ring import RingConfig, ring_backward, ring_forward
from .schedule import BALANCES, Plan, Step, plan

__all__ = [
    "BALANCES",
    "Backend",
    "BufferLedger",
    "Communicator",
    "LocalGroup",
    "LocalWorld",
    "Plan",
    "RingConfig",
    "Step",
    "SynchronousBackend",
    "attention",
    "backend_table",
    "get_backend",
    "hookimpl",
    "list_backends",
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
