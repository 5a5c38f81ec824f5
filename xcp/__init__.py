"""xcp: context-parallel (ring) attention with proven-safe, bounded buffer lifetimes on any device."""

from .api import attention, shard, unshard
from .backend import Backend
from .comm import LocalGroup, LocalWorld
from .hookspecs import hookimpl
from .lifetime import BufferLedger, track_buffers
from .plugins import get_backend, list_backends
from .ring import RingConfig, ring_backward, ring_forward
from .schedule import BALANCES, Plan, Step, plan

__all__ = [
    "BALANCES",
    "Backend",
    "BufferLedger",
    "LocalGroup",
    "LocalWorld",
    "Plan",
    "RingConfig",
    "Step",
    "attention",
    "get_backend",
    "hookimpl",
    "list_backends",
    "plan",
    "ring_backward",
    "ring_forward",
    "shard",
    "track_buffers",
    "unshard",
]

__version__ = "0.1.0"
