"""Where a paged, interleaved KV cache keeps each token: the formula every rank (and an engine) shares.

Position p of any sequence lives on rank ``(p // I) % P`` (I the interleave, P the ranks: vLLM's decode
context parallelism lays its cache out so), so a rank holds ``floor(L / (P·I))·I + clamp(L mod (P·I) − r·I,
0, I)`` of a sequence of L tokens, and every rank computes every rank's share from the global lengths
without talking. :func:`local_lengths` is that formula on the device (for an engine's metadata, inside a
captured graph); the rest is the same in pure Python for :class:`xcp.PagedKVCache`'s plans.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def check_placement(world_size: Any, rank: Any, interleave: Any) -> tuple[int, int, int]:
    """``(world_size, rank, interleave)`` as ints: P >= 1, 0 <= rank < P, I >= 1."""
    for name, x, low in (("world_size", world_size, 1), ("interleave", interleave, 1)):
        if isinstance(x, bool) or not isinstance(x, int) or x < low:
            raise ValueError(f"{name}: expected an integer >= {low}; got {x!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an integer in [0, {world_size}) (world_size {world_size}); got {rank!r}")
    return world_size, rank, interleave


def local_lengths(seq_lens: torch.Tensor, world_size: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """The tokens rank ``rank`` of ``world_size`` holds of sequences of ``seq_lens`` tokens (an integer tensor
    of any shape), position p living on rank ``(p // interleave) % world_size``: a tensor of seq_lens' shape,
    dtype and device, made by device ops alone (no host read, so it may run inside a captured graph)."""
    p, r, i = check_placement(world_size, rank, interleave)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.is_floating_point() or seq_lens.is_complex():
        got = f"dtype {seq_lens.dtype}" if isinstance(seq_lens, torch.Tensor) else type(seq_lens).__name__
        raise TypeError(f"seq_lens: expected an integer tensor; got {got}")
    span = p * i
    return seq_lens // span * i + torch.clamp(seq_lens % span - r * i, min=0, max=i)


def held(seq_len: int, world_size: int, rank: int, interleave: int = 1) -> int:
    """:func:`local_lengths` of one length, on the host."""
    span = world_size * interleave
    return seq_len // span * interleave + min(max(seq_len % span - rank * interleave, 0), interleave)


def kept(start: int, count: int, world_size: int, rank: int, interleave: int = 1) -> Iterator[tuple[int, int]]:
    """The ``(first position, tokens)`` runs of positions ``start .. start + count - 1`` that ``rank`` keeps,
    in order: the pieces of the interleave's blocks of I positions that are the rank's."""
    if world_size == 1:  # every position is the rank's: one run (not one per interleave block)
        if count > 0:
            yield start, count
        return
    span, stop = world_size * interleave, start + count
    block0 = (start // span) * span + rank * interleave  # the rank's block in the span holding start
    while block0 < stop:
        lo, hi = max(block0, start), min(block0 + interleave, stop)
        if lo < hi:
            yield lo, hi - lo
        block0 += span


__all__ = ["held", "kept", "local_lengths"]
