"""Sequences of any length: pad to the next length the balance can split, as a document of its own.

A balance splits only some lengths (zigzag over P ranks: multiples of 2P; :func:`xcp.schedule.required_multiple`).
:func:`pad_to_balance` appends the fewest tokens that make the length one it splits and returns the
document boundaries with the padding as one more document, so that :func:`xcp.attention` with those
``cu_seqlens`` keeps the padding from seeing or being seen: the real tokens' outputs and gradients are
those of the unpadded sequence. Nothing is rounded down; cut the results back with
``out.narrow(dim, 0, out.shape[dim] - pad)``.

The padding document may have any length from 1 up (a single token, fewer tokens than ranks): documents
of any length are served; only the total must split.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from . import schedule
from .checks import check_dim, check_ulysses, check_ulysses_divides
from .documents import check_cu_seqlens


def padded_length(seq_len: int, world_size: int, balance: str = schedule.DEFAULT_BALANCE, ulysses: int = 1) -> int:
    """The shortest length >= ``seq_len`` that :func:`xcp.shard` splits over ``world_size`` ranks with
    ``balance`` (and ``ulysses``: a multiple of what the ring of P / U ranks needs and of P)."""
    schedule.check_world(world_size)
    ulysses = check_ulysses(ulysses)
    rings = check_ulysses_divides(ulysses, int(world_size), "world_size")
    multiple = math.lcm(schedule.required_multiple(rings, balance), int(world_size))
    if not schedule.is_integer(seq_len) or seq_len < 1:
        raise ValueError(f"seq_len: expected an integer >= 1 (at least one real token); got {seq_len!r}")
    return -(-int(seq_len) // multiple) * multiple


def pad_to_balance(
    x: torch.Tensor,
    world_size: int,
    *,
    balance: str = schedule.DEFAULT_BALANCE,
    dim: int = 1,
    value: float = 0,
    cu_seqlens: Any = None,
    ulysses: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``x`` padded along ``dim`` to the next length ``balance`` splits over ``world_size`` ranks, the
    document boundaries with the padding as a document of its own, and the number of tokens padded.

    :param x: the WHOLE sequence (q, k, v, token ids, labels, ...), S tokens along ``dim``; not modified.
    :param world_size: P, the ranks the sequence is sharded over.
    :param balance: the balance of :func:`xcp.shard` / :func:`xcp.attention` (``zigzag``, ``contiguous``,
        ``stripe``).
    :param dim: the sequence dim (1 in xcp's layout ``[batch, seq, heads, head_dim]``).
    :param value: what the padded entries hold (0; -100 for labels). It does not reach the real tokens.
    :param cu_seqlens: the GLOBAL boundaries ``[0, ..., S]`` of packed documents already in ``x`` (a list
        of ints or a 1-D integer tensor; None: one document).
    :param ulysses: U, as for :func:`xcp.shard` (the length must then split over P / U rings and P ranks).
    :returns: ``(padded, cu, pad)``: ``padded`` is a new tensor of S + pad tokens along ``dim`` (``x``
        itself when pad is 0); ``cu`` the boundaries ending ``[..., S, S + pad]`` (an int CPU tensor, of
        cu_seqlens' dtype when that is a tensor, else int32), to pass to :func:`xcp.attention` as
        ``cu_seqlens`` (batch 1), or None when neither documents nor padding are there; ``pad`` the number
        of tokens appended, 0 <= pad < the balance's multiple. Cut results back with
        ``out.narrow(dim, 0, S)``.

    Documents need batch 1. With batch > 1 and *causal* attention, call :func:`xcp.attention` without
    ``cu``: padding at the end of every row is never seen by a real token, and is exact when nothing
    else (the loss) reads the pad's outputs. Non-causal attention over padded rows of batch > 1 is not
    exact: pack the rows into batch 1 as documents first.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor; got {type(x).__name__}")
    dim = check_dim(x, dim)
    if not isinstance(value, numbers.Number):
        raise TypeError(f"value: expected a number to fill the padding with; got {value!r}")
    seq_len = x.shape[dim]
    if seq_len < 1:
        raise ValueError(f"x.shape[{dim}]: expected at least one token to pad; got {seq_len}")
    schedule.check_balance(balance)
    pad = padded_length(seq_len, world_size, balance, ulysses) - seq_len
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len)
    if pad == 0:
        return x, None if bounds is None else _boundaries(bounds, cu_seqlens), 0
    shape = list(x.shape)
    shape[dim] = pad
    padded = torch.cat([x, x.new_full(shape, value)], dim=dim)
    return padded, _boundaries((*(bounds or (0, seq_len)), seq_len + pad), cu_seqlens), pad


def _boundaries(bounds: tuple[int, ...], like: Any) -> torch.Tensor:
    """``bounds`` as a CPU tensor, of the dtype of ``like`` where that is an integer tensor, else int32."""
    dtype = like.dtype if isinstance(like, torch.Tensor) else torch.int32
    return torch.tensor(bounds, dtype=dtype)
