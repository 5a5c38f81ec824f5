"""The yardstick of ``xcp bench --serve``: what a user would call instead of xcp, one whole-batch call over every
request's tokens on one device.

- :class:`Flat` (CUDA, where the aten flash varlen op serves the dtype and head dim): every request's keys and
  values stored contiguously in one buffer ``[rows, Hkv, D]`` (a region per request, reserved for all it will
  hold), ONE call of ``aten._flash_attention_forward`` with ``cum_seq_k`` the regions' starts and ``seqused_k``
  their lengths (a call every torch with flash has, 2.11 included);
- :class:`Whole` with ``flash_paged`` (CUDA, where this torch's flash op takes ``block_table`` and the blocks hold
  a multiple of 256 rows): one pool, ONE call of the flash op's paged form;
- :class:`Whole` elsewhere (the CPU): one pool, ONE call of the backend's ``forward_paged``.

Each holds its own copy of the tokens; a decode step writes its new tokens, then makes its one call, from
metadata planned on the host into device buffers, so a captured graph of it replays with new lengths.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...backends.fused import op_takes_argument
from ...inference.paged import PagedKVCache
from ...inference.paged_decode import PagedDecode
from .decode import flash_serves

FLAT = "flash varlen with seqused_k over contiguous K/V"
FLASH_PAGED = "flash varlen with block_table (its paged form)"
FORWARD_PAGED = "the backend's forward_paged"
PAGED_FORM_MULTIPLE = 256
"""Flash's paged form takes blocks of a multiple of 256 rows (see docs/backends.md, Paged KV pools)."""


def _flash_op() -> Any:
    return torch.ops.aten._flash_attention_forward


def flash_takes_block_table(op: Any = None) -> bool:
    """Whether this torch's flash varlen op has the paged form (torch 2.11's schema ends ``seqused_k, alibi_slopes``:
    no)."""
    return op_takes_argument(op or _flash_op(), "block_table")


def choose(device: torch.device, dtype: torch.dtype, head_dim: int, block: int) -> str:
    """The yardstick for these pools: :data:`FLASH_PAGED`, :data:`FLAT` or :data:`FORWARD_PAGED`."""
    if not flash_serves(device, dtype, head_dim):
        return FORWARD_PAGED
    return FLASH_PAGED if block % PAGED_FORM_MULTIPLE == 0 and flash_takes_block_table() else FLAT


class Whole:
    """One pool on one device holding every request's tokens (a world of one's cache, planned by
    :class:`xcp.PagedDecode`), its decode step the new tokens written and ONE paged call: flash's paged form
    (``flash_paged``) or the backend's ``forward_paged``."""

    def __init__(self, backend, num_blocks: int, block: int, flash_paged: bool = False) -> None:
        self.backend, self.flash_paged = backend, flash_paged
        self.label = FLASH_PAGED if flash_paged else FORWARD_PAGED
        self.cache = PagedKVCache(None, num_blocks=num_blocks, block_size=block, device=backend.name)
        self.decode: PagedDecode | None = None

    def reserve(self, seq_id: Any, rows: int) -> None:
        """Nothing: the pool's blocks are taken as the tokens come."""

    def append(self, ids: list, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> None:
        self.cache.append(ids, k, v, cu)

    def free(self, seq_id: Any) -> None:
        self.cache.free(seq_id)

    def start_decoding(self, max_batch: int, max_len: int) -> None:
        self.decode = PagedDecode(self.cache, max_batch=max_batch, max_len=max_len)

    def plan(self, order: list, batch: int) -> None:
        """The step's metadata (:meth:`xcp.PagedDecode.plan`), padded to ``batch`` rows like the ranks'."""
        assert self.decode is not None and self.decode.plan(order) == batch

    def nbytes(self) -> int:
        k, v = self.cache._k, self.cache._v
        if k is None or v is None:
            return 0
        return k.numel() * k.element_size() + (0 if v.data_ptr() == k.data_ptr() else v.numel() * v.element_size())

    def _call(self, q, table, cu_q, used, max_q: int, max_k: int, causal: bool) -> torch.Tensor:
        c = self.cache
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.flash_paged:
            zeros = torch.zeros(table.shape[0] + 1, dtype=torch.int32, device=q.device)  # flash reads the table
            return _flash_op()(q, c._k, c._v, cu_q, zeros, max_q, max_k, 0.0, causal, False, scale=scale,
                               seqused_k=used, block_table=table)[0]  # fmt: skip
        return self.backend.forward_paged(q, c._k, c._v, table, cu_q, used, max_q, max_k, scale, causal)[0]

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The planned step: write, then one paged call."""
        d, c = self.decode, self.cache
        assert d is not None and d._buffers is not None and c._k is not None and c._v is not None
        b, buf = d.batch, d._buffers
        hkv, dim = c._k.shape[2], c._k.shape[3]
        c._k.view(-1, hkv, dim).index_copy_(0, buf["slots"][:b], k)
        c._v.view(-1, hkv, c._v.shape[3]).index_copy_(0, buf["slots"][:b], v)
        return self._call(q, buf["table"][:b], buf["cu_q"][: b + 1], buf["used"][:b], 1, d.max_keys, False)

    def mixed(self, q: torch.Tensor, ids: list, cu: list[int]) -> torch.Tensor:
        """One paged call, causal aligned bottom-right, of the packed queries of ``ids`` (each its newest
        ``cu[i+1] - cu[i]``) over their tokens (the table built on the host)."""
        c = self.cache
        tables = [c.block_table(i) for i in ids]
        width = max(len(t) for t in tables)
        dev = q.device
        table = torch.tensor([t + [c.sink_block] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        used = torch.tensor([c.seq_len(i) for i in ids], dtype=torch.int32, device=dev)
        cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
        return self._call(q, table, cu_q, used, max(b - a for a, b in zip(cu, cu[1:])), width * c.block_size, True)


class Flat:
    """Every request's keys and values in one contiguous buffer ``[rows + 1, Hkv, D]`` (the last row takes a padded
    row's write), a region reserved per request; a decode step its new tokens written and ONE flash varlen call with
    ``cum_seq_k`` the regions' starts and ``seqused_k`` the lengths, from device buffers the host plans.

    :param op: the flash varlen op (tests pass a stand-in with its signature)."""

    label = FLAT

    def __init__(self, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 op: Any = None) -> None:  # fmt: skip
        self.k, self.v = (torch.empty((rows + 1, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(2))
        self.op = op or _flash_op()
        self.start: dict[Any, int] = {}
        self.room: dict[Any, int] = {}
        self.length: dict[Any, int] = {}
        self.taken = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.batch, self.max_keys = 0, 0

    def reserve(self, seq_id: Any, rows: int) -> None:
        """A region of ``rows`` rows for ``seq_id`` (regions are never reused: the buffer holds them all)."""
        if self.taken + rows > self.k.shape[0] - 1:
            raise ValueError(f"rows: expected at most {self.k.shape[0] - 1 - self.taken} more; got {rows}")
        self.start[seq_id], self.room[seq_id], self.length[seq_id] = self.taken, rows, 0
        self.taken += rows

    def append(self, ids: list, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> None:
        rows: list[int] = []
        for i, a, b in zip(ids, cu, cu[1:]):
            at = self.start[i] + self.length[i]
            if self.length[i] + b - a > self.room[i]:
                raise ValueError(f"{i!r}: expected at most {self.room[i]} tokens; got {self.length[i] + b - a}")
            rows += range(at, at + b - a)
            self.length[i] += b - a
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)
        self.k.index_copy_(0, index, k)
        self.v.index_copy_(0, index, v)

    def free(self, seq_id: Any) -> None:
        del self.length[seq_id]

    def start_decoding(self, max_batch: int, max_len: int) -> None:
        dev = self.k.device
        self.max_keys = max_len
        self.buffers = {"slots": torch.zeros(max_batch, dtype=torch.int64, device=dev),
                        "cu_k": torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),
                        "used": torch.zeros(max_batch, dtype=torch.int32, device=dev),
                        "cu_q": torch.arange(max_batch + 1, dtype=torch.int32, device=dev)}  # fmt: skip

    def plan(self, order: list, batch: int) -> None:
        """Each listed request one more token (its slot, its start and length on the device), padded to ``batch``
        rows that write the scratch row and see no key."""
        scratch = self.k.shape[0] - 1
        slots, starts, used = [scratch] * batch, [0] * (batch + 1), [0] * batch
        for row, i in enumerate(order):
            if self.length[i] + 1 > min(self.room[i], self.max_keys):
                raise ValueError(f"{i!r}: expected at most {min(self.room[i], self.max_keys)} tokens; got more")
            slots[row], starts[row] = self.start[i] + self.length[i], self.start[i]
            self.length[i] += 1
            used[row] = self.length[i]
        for name, values in (("slots", slots), ("cu_k", starts), ("used", used)):
            buf = self.buffers[name]
            buf[: len(values)].copy_(torch.tensor(values, dtype=buf.dtype))
        self.batch = batch

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _call(self, q, cu_q, cu_k, used, max_q: int, max_k: int, causal: bool) -> torch.Tensor:
        return self.op(q, self.k, self.v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                       scale=1.0 / math.sqrt(q.shape[-1]), seqused_k=used)[0]  # fmt: skip

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The planned step: the new tokens written into their slots, then one flash varlen call."""
        b, buf = self.batch, self.buffers
        self.k.index_copy_(0, buf["slots"][:b], k)
        self.v.index_copy_(0, buf["slots"][:b], v)
        return self._call(q, buf["cu_q"][: b + 1], buf["cu_k"][: b + 1], buf["used"][:b], 1, self.max_keys, False)

    def mixed(self, q: torch.Tensor, ids: list, cu: list[int]) -> torch.Tensor:
        """One flash varlen call, causal aligned bottom-right on each request's length, of the packed queries of
        ``ids`` (each its newest ``cu[i+1] - cu[i]``) over their tokens."""
        dev = q.device
        cu_q, cu_k, used = (torch.tensor(x, dtype=torch.int32, device=dev) for x in
                            (cu, [self.start[i] for i in ids] + [0], [self.length[i] for i in ids]))  # fmt: skip
        return self._call(q, cu_q, cu_k, used, max(b - a for a, b in zip(cu, cu[1:])), self.max_keys, True)
