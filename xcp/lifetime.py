"""Buffer lifetimes: the received-shard slots of the ring and the ledger that counts them.

Rule 2 of DESIGN.md: the forward holds exactly two received-KV slots, the backward two KV and two dKV
slots, used ping-pong; the receive into a slot is issued only after the compute and the send that last
read it. ``keep_all`` reproduces the unbounded behaviour of other libraries (one fresh buffer per received
shard, all kept until the call ends) so benchmarks and tests can show the difference.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

POLICIES = ("bounded", "keep_all")


def check_policy(policy: str) -> str:
    """Return ``policy`` if known, else raise a ValueError listing the known policies."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


@dataclass
class BufferLedger:
    """Bytes and shards of ring buffers alive now and at peak, for one rank (one thread).

    ``peak_kv_shards`` counts received KV and dKV shards alive at once (a K and V pair is one shard).
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    live_kv_shards: int = 0
    peak_kv_shards: int = 0
    allocations: int = 0
    _live: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _next: int = field(default=0, repr=False)

    def add(self, nbytes: int, shards: int = 1) -> int:
        """Count a buffer of ``nbytes`` holding ``shards`` shards; return a token for :meth:`release`."""
        self._next += 1
        self._live[self._next] = (nbytes, shards)
        self.allocations += 1
        self.live_bytes += nbytes
        self.live_kv_shards += shards
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_kv_shards = max(self.peak_kv_shards, self.live_kv_shards)
        return self._next

    def release(self, token: int) -> None:
        """Stop counting the buffer of ``token`` (it is no longer referenced by the ring)."""
        nbytes, shards = self._live.pop(token)
        self.live_bytes -= nbytes
        self.live_kv_shards -= shards


_local = threading.local()


def _ledgers() -> list[BufferLedger]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def track_buffers() -> Iterator[BufferLedger]:
    """Count the ring buffers of every xcp call made in this thread (one rank) inside the block."""
    ledger = BufferLedger()
    stack = _ledgers()
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.remove(ledger)


def _count(nbytes: int, shards: int) -> list[tuple[BufferLedger, int]]:
    return [(ledger, ledger.add(nbytes, shards)) for ledger in _ledgers()]


class ShardSlots:
    """Receive buffers for shards of the ring (a shard is a tuple of tensors, e.g. (K, V)).

    ``bounded``: two slots allocated on first use, slot ``j % 2`` receives the shard of step j.
    ``keep_all``: a fresh buffer per step, all alive until :meth:`release`.
    """

    def __init__(self, like: Sequence[torch.Tensor], policy: str = "bounded", dtype: torch.dtype | None = None):
        self._like = list(like)
        self._dtype = dtype
        self._policy = check_policy(policy)
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._tokens: list[list[tuple[BufferLedger, int]]] = []

    def _allocate(self, zero: bool) -> list[torch.Tensor]:
        make = torch.zeros_like if zero else torch.empty_like
        bufs = [make(t, dtype=self._dtype or t.dtype) for t in self._like]
        self._tokens.append(_count(sum(b.numel() * b.element_size() for b in bufs), 1))
        return bufs

    def slot(self, step: int, zero: bool = False) -> list[torch.Tensor]:
        """The buffers that receive (or hold) the shard of ``step``; zero-filled when ``zero``."""
        key = step % 2 if self._policy == "bounded" else step
        bufs = self._slots.get(key)
        if bufs is None:
            bufs = self._slots[key] = self._allocate(zero)
        elif zero:
            for b in bufs:
                b.zero_()
        return bufs

    def release(self) -> None:
        """Drop every slot and stop counting it."""
        self._slots.clear()
        for tokens in self._tokens:
            for ledger, token in tokens:
                ledger.release(token)
        self._tokens.clear()
