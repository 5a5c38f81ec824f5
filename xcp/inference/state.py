"""A preallocated KV cache's bookkeeping on the device, so that a decode step never asks the host.

A cache with ``capacity`` (:class:`xcp.KVCache`) is meant to be captured into a device graph once and
replayed for every token: a replay runs the device work alone, so whatever the step must know about the
cache's length has to be read and advanced by device ops. :class:`DeviceCounts` keeps it: one small int64
tensor holding the global length, this rank's length and the next position's residue mod P (whose token
the rank keeps when it is the rank's own), and the global position of every storage row (what a
window needs). A decode step's append writes the token in place at the row the device
counters name and advances them; its attention reads the visible storage range ``[lo, hi)`` from them. Each
is a handful of small device ops, since eagerly every op costs host time.

Placement is :mod:`xcp.inference.plan`'s: a single token at position p is kept by rank ``p % P``. Every rank
writes the token at the row after its last one (so no rank branches on the host), but only the owner
counts it; the storage has one scratch row past its room, so a rank whose share is full still has a row to
write into. A step past the capacity still counts in the global length (no host check is possible inside a
graph), so the next host read (:meth:`DeviceCounts.read`) sees it: the cache then refuses every call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..documents import PositionRun

FAR = (1 << 62) - 1
"""The position of a storage row that holds no token yet: after every real position."""

SEQ, LOCAL, PHASE = 0, 1, 2
"""The entries of :attr:`DeviceCounts.counts`."""


class DeviceCounts:
    """The lengths and positions of one rank's storage of ``room`` rows (+ 1 scratch row) on ``device``.

    :param room: the rows that hold this rank's tokens at full capacity.
    :param capacity: the global tokens the cache may hold.
    :param world_size: P; :param rank: this rank.
    """

    def __init__(self, room: int, capacity: int, world_size: int, rank: int, device: torch.device) -> None:
        self.room, self.capacity, self.world_size, self.rank = room, capacity, world_size, rank
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)
        """``[seq_len, local_len, seq_len % P]``: the tokens of all ranks (past the capacity too), of this rank,
        and the residue that picks the next token's owner."""
        self.positions = torch.full((room + 1,), FAR, dtype=torch.int64, device=device)
        """The global position of each storage row (:data:`FAR` where none is held)."""
        self._rows = torch.arange(room + 1, device=device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)
        residues = torch.arange(world_size, device=device)
        next_residue = torch.where(residues + 1 < world_size, 1, 1 - world_size)
        self._steps = torch.stack((torch.ones_like(residues), (residues == rank).long(), next_residue), dim=1)
        """Row j: what a token at a position ``p`` with ``p % P == j`` adds to :attr:`counts` (1; 1 for its owner;
        the step of the residue to ``(j + 1) % P``): one lookup, no modulo, per token."""

    # ------------------------------------------------------------------ host side (eager, outside steps)
    def record(self, runs: Iterable[PositionRun], seq_len: int, local_len: int) -> None:
        """Tokens stored by the host path (a prefill or a chunk): their rows' positions, then the lengths."""
        for run in runs:
            rows = self.positions[run.local0 : run.local0 + run.count]
            torch.arange(run.count, device=rows.device, out=rows).mul_(run.stride).add_(run.global0)
        self.counts[SEQ].fill_(seq_len)  # fills, not a copy from host memory: that would wait for the stream
        self.counts[LOCAL].fill_(local_len)
        self.counts[PHASE].fill_(seq_len % self.world_size)

    def read(self) -> tuple[int, int, int]:
        """``(seq_len, local_len, overflow)`` as the device has them now, overflow the tokens past the
        capacity (not kept): one host read (it waits for the device), for use between steps."""
        seq, local, _ = (int(x) for x in self.counts.tolist())
        return seq, local, max(0, seq - self.capacity)

    # ------------------------------------------------------------------ device side (inside a step)
    def append_token(
        self, k_store: torch.Tensor, k: torch.Tensor, values: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        """Write one token (``k`` [B, 1, Hkv, D], and ``values`` = (v_store, v) where the values are stored
        apart) at the row after this rank's last and count it where this rank owns its position; device ops
        only."""
        seq, local = self.counts[SEQ : SEQ + 1], self.counts[LOCAL : LOCAL + 1]
        row = torch.clamp(local, max=self.room)  # a full share writes into the scratch row
        k_store.index_copy_(1, row, k)
        if values is not None:
            values[0].index_copy_(1, row, values[1])
        self.positions.index_copy_(0, row, seq)
        if self.world_size == 1:
            self.counts.add_(self._steps[0])
        else:
            self.counts.add_(torch.index_select(self._steps, 0, self.counts[PHASE : PHASE + 1]).view(3))

    def visible(self, left: int | None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The storage range ``[lo, hi)`` the newest token's query sees, as device tensors of one element:
        every token held, or with a window of ``left`` tokens those at positions ``>= newest - left``, and
        with chunked attention those of the newest token's chunk of ``chunk`` positions (positions increase
        along the storage, so they form a suffix of it)."""
        seq, local = self.counts[SEQ : SEQ + 1], self.counts[LOCAL : LOCAL + 1]
        hi = torch.clamp(local, max=self.room)
        if left is None and chunk is None:
            return self._zero, hi
        newest = seq - 1
        starts = [] if left is None else [newest - left]
        if chunk is not None:
            starts.append(torch.div(newest, chunk, rounding_mode="floor") * chunk)
        first = starts[0] if len(starts) == 1 else torch.maximum(*starts)
        early = (self.positions < first) & (self._rows < hi)
        return early.sum(0, keepdim=True), hi

    def newest(self) -> torch.Tensor:
        """The newest token's global position, a device tensor of one element (ALiBi's query position)."""
        return self.counts[SEQ : SEQ + 1] - 1


__all__ = ["FAR", "DeviceCounts"]
