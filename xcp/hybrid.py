"""Hybrid all-to-all + ring attention: ``xcp.attention(..., ulysses=U)`` on P = U x R ranks.

Ranks ``r`` with the same ``r // U`` form a *head group* of U consecutive ranks; ranks with the same
``r % U`` form a *ring* of R ranks, in which rank r is ring position ``r // U``. Each rank holds S / P tokens
with all H heads, placed by ``xcp.shard(..., ulysses=U)``: the sequence is sharded over the R ring positions
by the balance, and each ring shard is cut into U contiguous pieces, piece ``r % U`` of ring shard ``r // U``
going to rank r. Then:

1. an all-to-all inside the head group (scatter heads, gather tokens) gives rank r the whole ring shard
   ``r // U`` (the pieces of its head group, concatenated in group order) for its H / U query heads and the
   matching K/V heads: exactly what the ring over R ranks expects of ring position ``r // U``;
2. the ring (:func:`xcp.ring.ring_forward` / ``ring_backward``, the existing schedule, balance, documents,
   window) runs over the R ranks of the ring, with global options passed unchanged;
3. a second all-to-all returns the output to the original layout (S / P tokens, all heads).

The backward mirrors both exchanges: :class:`HeadExchange` is an autograd Function whose backward is the
inverse all-to-all; the ring's own Function sits between the two exchanges unchanged. K/V heads fewer than U
(GQA) are replicated to the smallest count U divides (autograd sums their gradients back); the sinks are
sliced per head group (autograd scatters their gradient back).
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import schedule
from .agreement import check_agreement
from .comm import Communicator, hybrid_groups
from .ring import RingAttention, RingConfig, ring_forward


def check_ulysses(ulysses: Any) -> int:
    """``ulysses`` as an int; a TypeError or ValueError naming it unless a positive integer."""
    if not schedule.is_integer(ulysses):
        raise TypeError(f"ulysses: expected a positive integer (head-parallel ranks); got {ulysses!r}")
    if int(ulysses) < 1:
        raise ValueError(f"ulysses: expected a positive integer (head-parallel ranks); got {ulysses!r}")
    return int(ulysses)


def check_ulysses_divides(ulysses: int, world_size: int, what: str = "the world size") -> int:
    """R = world_size // ulysses; a ValueError naming ulysses unless it divides ``world_size``."""
    if world_size % ulysses:
        raise ValueError(
            f"ulysses: expected a divisor of {what} {world_size} (P = ulysses x ring ranks); got {ulysses}"
        )
    return world_size // ulysses


def check_ulysses_heads(ulysses: int, heads: int) -> None:
    """A ValueError naming ulysses unless it divides the query heads."""
    if heads % ulysses:
        raise ValueError(
            f"ulysses: expected a divisor of the {heads} heads of q (each rank of a head group takes "
            f"heads / ulysses of them); got {ulysses}"
        )


def kv_replicas(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many copies of each K/V head the head groups need: 1 when ``ulysses`` divides ``kv_heads``,
    else the factor that makes ``kv_heads`` the smallest multiple of itself that ``ulysses`` divides (it
    divides ``heads`` too, as both ``kv_heads`` and ``ulysses`` do)."""
    return math.lcm(kv_heads, ulysses) // kv_heads


def alltoall_bytes(
    batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, itemsize: int, world_size: int, ulysses: int
) -> int:
    """Bytes one rank sends to the other ranks of its head group in the all-to-alls of one forward
    (q, k, v in and the output back) or of one backward (dout in, dq, dk, dv back): the same count.

    Each of the four tensors has S / P tokens per rank, of which every rank keeps the piece of its own heads
    and sends ``(U - 1) / U`` of it: ``(U - 1) · B · (S / P) · D · itemsize · (2·H + 2·H_kv') / U`` with
    ``H_kv' = H_kv · kv_replicas`` (K/V heads replicated for GQA with fewer K/V heads than U). 0 when U = 1.
    """
    u = ulysses
    kv = kv_heads * kv_replicas(heads, kv_heads, u)
    n = seq_len // world_size
    return (u - 1) * batch * n * head_dim * itemsize * (2 * heads + 2 * kv) // u


# ----------------------------------------------------------------------------------------------------
# The all-to-all of a head group


def heads_to_tokens(comm: Communicator, backend: Any, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Scatter heads, gather tokens: each x [B, n, H, D] of rank j of the head group becomes
    [B, U·n, H/U, D]: this rank's head slice of the tokens of all U ranks, in group order. One collective
    for all of ``xs`` (they share a dtype)."""
    u = comm.size()
    pieces = [x.reshape(x.shape[0], x.shape[1], u, x.shape[2] // u, x.shape[3]).permute(2, 0, 1, 3, 4) for x in xs]
    got = _all_to_all(comm, backend, pieces)
    return [g.permute(1, 0, 2, 3, 4).reshape(g.shape[1], u * g.shape[2], g.shape[3], g.shape[4]) for g in got]


def tokens_to_heads(comm: Communicator, backend: Any, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`heads_to_tokens`: each y [B, U·n, h, D] becomes [B, n, U·h, D]."""
    u = comm.size()
    pieces = [y.reshape(y.shape[0], u, y.shape[1] // u, y.shape[2], y.shape[3]).transpose(0, 1) for y in ys]
    got = _all_to_all(comm, backend, pieces)
    return [g.permute(1, 2, 0, 3, 4).reshape(g.shape[1], g.shape[2], u * g.shape[3], g.shape[4]) for g in got]


def _all_to_all(comm: Communicator, backend: Any, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``pieces``: tensors [U, ...] whose row j goes to rank j; returns tensors shaped alike whose row j came
    from rank j. The pieces are packed into one send buffer [U, total] and one receive buffer, both made,
    issued and waited for on the current stream (docs/lifetime.md, the hybrid's all-to-all)."""
    all_to_all = getattr(comm, "all_to_all", None)
    if all_to_all is None:
        raise TypeError(f"group: ulysses > 1 needs a communicator with all_to_all(); got {type(comm).__name__}")
    u, first = comm.size(), pieces[0]
    sizes = [p[0].numel() for p in pieces]
    send = torch.empty((u, sum(sizes)), dtype=first.dtype, device=first.device)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for p, offset, size in zip(pieces, offsets, sizes):
        send[:, offset : offset + size].view(p.shape).copy_(p)  # the one packing copy
    recv = torch.empty_like(send)
    all_to_all(send, recv, "a2a", backend).wait()
    del send
    return [recv[:, offset : offset + size].view(p.shape) for p, offset, size in zip(pieces, offsets, sizes)]


class HeadExchange(torch.autograd.Function):
    """:func:`heads_to_tokens` (``to_tokens=True``) or :func:`tokens_to_heads` of several tensors as one
    differentiable step: the backward is the inverse all-to-all of the gradients. Saves nothing."""

    @staticmethod
    def forward(ctx, comm: Communicator, backend: Any, to_tokens: bool, *xs: torch.Tensor):  # type: ignore[override]
        ctx.comm, ctx.backend, ctx.to_tokens = comm, backend, to_tokens
        ctx.thread = threading.get_ident()
        move = heads_to_tokens if to_tokens else tokens_to_heads
        return tuple(move(comm, backend, xs))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        comm = ctx.comm
        if comm.ranks_are_threads and threading.get_ident() != ctx.thread:
            raise RuntimeError(
                f"xcp: autograd ran the backward of a LocalWorld rank's all-to-all (head-group rank {comm.rank()}) "
                "outside its thread; PyTorch runs GPU backward on one worker thread per device, where an exchange "
                "that waits for its peers would hang. Use real ranks (torchrun) there."
            )
        move = tokens_to_heads if ctx.to_tokens else heads_to_tokens
        return (None, None, None, *move(comm, ctx.backend, [g.contiguous() for g in grads]))


# ----------------------------------------------------------------------------------------------------
# One hybrid call


def _shaped(x: torch.Tensor, seq: int, heads: int) -> torch.Tensor:
    """A view of x's first element with shape [B, seq, heads, D] (no memory): for checks on shapes only."""
    return x[:, :1, :1].expand(x.shape[0], seq, heads, x.shape[3])


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Communicator,
    backend: Any,
    ulysses: int,
    *,
    causal: bool,
    scale: float,
    balance: str,
    slots: str,
    handoff: str | None,
    cu_seqlens: Any,
    window: tuple[int | None, int | None] | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's output of :func:`xcp.attention` with ``ulysses`` > 1 (arguments checked by the caller,
    except those that depend on U: U divides P and the heads, and the ring's balance and documents)."""
    from .api import check_backend_serves, check_documents  # the api imports this module

    world, rank = comm.size(), comm.rank()
    u = ulysses
    r = check_ulysses_divides(u, world, "the group's size")
    batch, n, heads, _ = q.shape
    kv_heads = k.shape[2]
    check_ulysses_heads(u, heads)
    t = kv_replicas(heads, kv_heads, u)
    h, hkv = heads // u, kv_heads * t // u
    qv, kv = _shaped(q, u * n, h), _shaped(k, u * n, hkv)  # the shapes the ring will see, for the checks
    documents = check_documents(cu_seqlens, qv, r, balance, window)
    # the ranks agree on the call (ulysses included: it shows in the shapes the ring sees) before any
    # group is made or any head group exchanges
    agreed = types.SimpleNamespace(causal=causal, balance=balance, scale=scale, documents=documents, window=window)
    check_agreement(comm, backend, qv, kv, kv, agreed, sinks)
    head, ring = hybrid_groups(comm, u)
    check_backend_serves(backend, qv, ring, causal, balance)
    cfg = RingConfig(ring, backend, causal, scale, balance, slots, handoff, documents, window)
    g = rank % u
    if t > 1:
        k, v = k.repeat_interleave(t, dim=2), v.repeat_interleave(t, dim=2)
    own_sinks = None if sinks is None else sinks[g * h : (g + 1) * h]
    needs_grad = any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if torch.is_grad_enabled() and needs_grad:
        qr, kr, vr = HeadExchange.apply(head, backend, True, q, k, v)
        out_r = RingAttention.apply(qr, kr, vr, own_sinks, cfg)
        return HeadExchange.apply(head, backend, False, out_r)[0]
    qr, kr, vr = heads_to_tokens(head, backend, (q, k, v))
    out_r = ring_forward(qr, kr, vr, cfg, own_sinks)[0]
    del qr, kr, vr
    return tokens_to_heads(head, backend, (out_r,))[0]
