"""The bytes one rank of a ring sends, per tensor and step: one formula for the tools (``xcp plan``, ``xcp
bench``), the sanitizer's bounds and the hybrid (:func:`xcp.hybrid.hybrid_traffic`).

For a ring that runs m of its R steps over shards of n tokens (batch B):

- a K/V shard is ``2·B·n·Hkv·D·itemsize`` bytes (K and V);
- the forward forwards the shard it holds m - 1 times: ``(m - 1)`` K/V shards;
- the backward forwards K/V the same m - 1 times, and sends the dK/dV it accumulated once per step (one
  step behind the K/V, the last hop going home): ``m`` dK/dV messages of ``2·B·n·Hkv·D`` elements in the
  accumulator dtype (float32 for bf16/fp16/fp32, float64 for float64). A ring of one step sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import schedule
from .kernels.merge import accumulator_dtype


@dataclass(frozen=True)
class RingTraffic:
    """The bytes one rank sends in a ring of ``steps`` of ``world`` steps (see the module docstring)."""

    world: int
    steps: int
    kv_shard: int
    """Bytes of one K/V shard: 2·B·n·Hkv·D·itemsize (K and V)."""
    dkv_message: int
    """Bytes of one dK/dV message: 2·B·n·Hkv·D·(accumulator itemsize)."""

    @property
    def forward(self) -> int:
        return (self.steps - 1) * self.kv_shard

    @property
    def backward_kv(self) -> int:
        """The K/V shards travel as in the forward."""
        return self.forward

    @property
    def backward_dkv(self) -> int:
        return self.steps * self.dkv_message if self.steps > 1 else 0

    @property
    def backward(self) -> int:
        return self.backward_kv + self.backward_dkv

    @property
    def total(self) -> int:
        """Forward and backward together."""
        return self.forward + self.backward


def ring_traffic(
    seq: int, world: int, steps: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int = 1
) -> RingTraffic:
    """The :class:`RingTraffic` of a ring of ``steps`` of ``world`` steps over ``seq`` tokens (shards of
    ``seq // world``) with ``kv_heads`` K/V heads per shard."""
    elements = 2 * batch * (seq // world) * kv_heads * head_dim
    item = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=accumulator_dtype(dtype)).element_size()
    return RingTraffic(world, steps, elements * item, elements * acc)


def travelling_tokens(seq: int, world: int, balance: str) -> int:
    """The tokens of a K/V shard as it travels the ring: S/P, or for a balance that places each document
    (shards that differ by a token) the longest shard's, which the shorter ones are padded to."""
    return schedule.shard_lengths(seq, world, balance)[0]


def ring_bytes(seq: int, world: int, steps: int, kv_heads: int, head_dim: int, value_head_dim: int,
               dtype: torch.dtype, balance: str = schedule.DEFAULT_BALANCE, batch: int = 1) -> RingTraffic:  # fmt: skip
    """:func:`ring_traffic` with v of another head dim and shards as they travel
    (:func:`travelling_tokens`): a K/V shard is K of ``head_dim`` and V of ``value_head_dim``, n·Hkv·(D + Dv)
    elements (a dK/dV message alike). The formula is linear in the head dim and counts K and V alike, so it
    is the mean of the formula at D and at Dv (exact: each is even)."""
    padded = world * travelling_tokens(seq, world, balance)
    at_d = ring_traffic(padded, world, steps, kv_heads, head_dim, dtype, batch)
    if value_head_dim == head_dim:
        return at_d
    at_dv = ring_traffic(padded, world, steps, kv_heads, value_head_dim, dtype, batch)
    return RingTraffic(world, steps, (at_d.kv_shard + at_dv.kv_shard) // 2, (at_d.dkv_message + at_dv.dkv_message) // 2)
