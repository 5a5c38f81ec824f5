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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import schedule
from .agreement import check_agreement
from .checks import (
    check_backend_serves,
    check_documents,
    check_ulysses,
    check_ulysses_divides,
    check_ulysses_heads,
)
from .comm import Communicator, hybrid_groups
from .ring import RingAttention, RingConfig, once_differentiable, ring_backward, ring_forward
from .spec import CallSpec
from .traffic import RingTraffic, ring_traffic


def kv_replicas(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many copies of each K/V head the head groups need: 1 when ``ulysses`` divides ``kv_heads``,
    else the factor that makes ``kv_heads`` the smallest multiple of itself that ``ulysses`` divides (it
    divides ``heads`` too, as both ``kv_heads`` and ``ulysses`` do)."""
    return math.lcm(kv_heads, ulysses) // kv_heads


def _alltoall_sent(ulysses: int, batch: int, tokens: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes a rank sends of one [B, tokens, heads, D] tensor in a head group's all-to-all: all but the piece
    of its own heads, (U - 1) / U of it (U divides ``heads``, so the division is exact)."""
    return (ulysses - 1) * batch * tokens * heads * head_dim * itemsize // ulysses


def _of_ring(name: str, doc: str) -> Any:
    """A property of :class:`HybridTraffic` that reads ``name`` of its ring's :class:`RingTraffic`."""
    return property(lambda self: getattr(self.ring_part, name), doc=doc)


@dataclass(frozen=True)
class HybridTraffic:
    """The bytes one rank sends in one forward and one backward of the hybrid on P = U x R ranks, per step and
    per tensor (made by :func:`hybrid_traffic`; B batch, S tokens, H query heads, H_kv' K/V heads after
    replication, D head size):

    - each all-to-all sends (U - 1) / U of the rank's tensors of S/P tokens (it keeps the piece of its own
      heads): ``q`` = (U-1)/U · B·(S/P)·H·D·itemsize bytes, and the same for ``out``, ``dout`` and ``dq``;
      ``kv`` = (U-1)/U · B·(S/P)·H_kv'·D·itemsize for each of k, v, dk and dv. Forward: q, k, v in, out back;
      backward: dout in, dq, dk, dv back.
    - the ring over R ranks runs m = ``ring_steps`` steps (R, or fewer where documents or a window leave the
      later blocks empty) on K/V shards of S/R tokens and H_kv'/U heads, ``kv_shard`` = 2·B·(S/R)·(H_kv'/U)·D·
      itemsize (K and V): forward m - 1 shards; backward m - 1 shards and m dK/dV messages of as many elements
      in the accumulator dtype (``dkv_message``), none when m = 1.
    """

    world: int
    ulysses: int
    q: int
    """Bytes of q sent in the first all-to-all (also of out, dout and dq in theirs)."""
    kv: int
    """Bytes of k (and of v, dk, dv) sent in their all-to-all."""
    ring_part: RingTraffic
    """The ring over R ranks (:func:`xcp.traffic.ring_traffic`: shards of S/R tokens, H_kv'/U heads)."""

    @property
    def ring(self) -> int:
        """R, the ranks of a ring."""
        return self.world // self.ulysses

    ring_steps = _of_ring("steps", "m, the steps the ring runs.")
    kv_shard = _of_ring("kv_shard", "Bytes of one K/V shard of the ring (K and V).")
    dkv_message = _of_ring("dkv_message", "Bytes of one dK/dV message of the ring's backward.")
    forward_ring = _of_ring("forward", "The ring's bytes in the forward.")
    backward_ring_kv = _of_ring("backward_kv", "The K/V shards travel as in the forward.")
    backward_ring_dkv = _of_ring("backward_dkv", "The ring's dK/dV messages in the backward.")

    @property
    def forward_alltoall(self) -> int:
        """q, k, v in and out back; 0 when U = 1."""
        return 2 * self.q + 2 * self.kv

    @property
    def forward(self) -> int:
        return self.forward_alltoall + self.forward_ring

    @property
    def backward_alltoall(self) -> int:
        """dout in and dq, dk, dv back: the forward's count."""
        return self.forward_alltoall

    @property
    def backward(self) -> int:
        return self.backward_alltoall + self.backward_ring_kv + self.backward_ring_dkv

    @property
    def total(self) -> int:
        """Forward and backward together."""
        return self.forward + self.backward


def hybrid_traffic(
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    world_size: int,
    ulysses: int,
    ring_steps: int | None = None,
) -> HybridTraffic:
    """The :class:`HybridTraffic` of ``xcp.attention(..., ulysses=U)`` on ``world_size`` ranks over ``seq_len``
    tokens: U = 1 is the ring alone (no all-to-all), U = P the all-to-all alone (a ring of one rank moves
    nothing). ``ring_steps``: the steps the ring over R runs (default R)."""
    u = check_ulysses(ulysses)
    r = check_ulysses_divides(u, world_size)
    check_ulysses_heads(u, heads)
    m = r if ring_steps is None else ring_steps
    kv = kv_heads * kv_replicas(heads, kv_heads, u)
    item = torch.empty((), dtype=dtype).element_size()
    n = seq_len // world_size
    return HybridTraffic(
        world=world_size,
        ulysses=u,
        q=_alltoall_sent(u, batch, n, heads, head_dim, item),
        kv=_alltoall_sent(u, batch, n, kv, head_dim, item),
        ring_part=ring_traffic(seq_len, r, m, kv // u, head_dim, dtype, batch),
    )


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
    def forward(ctx, comm: Communicator, backend: Any, to_tokens: bool, *xs: torch.Tensor):
        ctx.comm, ctx.backend, ctx.to_tokens = comm, backend, to_tokens
        ctx.thread = threading.get_ident()
        move = heads_to_tokens if to_tokens else tokens_to_heads
        return tuple(move(comm, backend, xs))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        comm = ctx.comm
        if comm.ranks_are_threads and threading.get_ident() != ctx.thread:
            raise RuntimeError(
                f"xcp: autograd ran the backward of a LocalWorld rank's all-to-all (head-group rank {comm.rank()}) "
                "outside its thread; PyTorch runs GPU backward on one worker thread per device, where an exchange "
                "that waits for its peers would hang. Use real ranks (torchrun) there."
            )
        move = tokens_to_heads if ctx.to_tokens else heads_to_tokens
        with torch.no_grad():
            moved = move(comm, ctx.backend, [g.contiguous() for g in grads])
        return (None, None, None, *once_differentiable(moved, grads))


# ----------------------------------------------------------------------------------------------------
# One hybrid call


def _shaped(x: torch.Tensor, seq: int, heads: int) -> torch.Tensor:
    """A view of x's first element with shape [B, seq, heads, D] (no memory): for checks on shapes only."""
    return x[:, :1, :1].expand(x.shape[0], seq, heads, x.shape[3])


@dataclass(frozen=True)
class HybridConfig:
    """Everything one hybrid call needs besides the tensors (made by :func:`hybrid_config`).

    :param head: this rank's head group (U consecutive ranks; this rank is ``head.rank() = r % U``).
    :param ring: the configuration of the ring over the R ranks with this rank's ``r % U``, with the global
        documents and window.
    :param ulysses: U.
    :param replicas: copies made of each K/V head (:func:`kv_replicas`; 1 when U divides the K/V heads).
    """

    head: Communicator
    ring: RingConfig
    ulysses: int
    replicas: int = 1

    def own_sinks(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The sinks of this rank's H / U query heads (a slice), or None."""
        return None if sinks is None else _own_heads(sinks, self.ulysses, self.head.rank())

    def replicate(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v with each K/V head repeated ``replicas`` times (as they are when 1)."""
        if self.replicas == 1:
            return k, v
        return k.repeat_interleave(self.replicas, dim=2), v.repeat_interleave(self.replicas, dim=2)


def _own_heads(per_head: torch.Tensor, ulysses: int, group_rank: int) -> torch.Tensor:
    """The slice of a per-query-head tensor [H] (sinks, ALiBi slopes) of the H / U heads of head-group rank
    ``group_rank``."""
    h = per_head.shape[0] // ulysses
    return per_head[group_rank * h : (group_rank + 1) * h]


def hybrid_config(
    q: torch.Tensor,
    k: torch.Tensor,
    comm: Communicator,
    backend: Any,
    ulysses: int,
    *,
    causal: bool,
    scale: float,
    balance: str = schedule.DEFAULT_BALANCE,
    slots: str = "bounded",
    handoff: str | None = None,
    cu_seqlens: Any = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
) -> HybridConfig:
    """Check what depends on U (U divides P and the heads; the ring's balance and documents), check on the
    whole group that every rank passed the same configuration (first call of a configuration), and make
    the head group and the ring. ``q``, ``k`` and ``v`` are this rank's shards (their shapes are read; v
    defaults to k's shape); the other arguments are checked by the caller, as :func:`xcp.attention` does."""
    world = comm.size()
    u = ulysses
    r = check_ulysses_divides(u, world, "the group's size")
    n, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    check_ulysses_heads(u, heads)
    t = kv_replicas(heads, kv_heads, u)
    h, hkv = heads // u, kv_heads * t // u
    qv, kv = _shaped(q, u * n, h), _shaped(k, u * n, hkv)  # the shapes the ring will see, for the checks
    vv = kv if v is None else _shaped(v, u * n, hkv)
    documents = check_documents(cu_seqlens, qv, r, balance, window, ulysses=u, chunk=chunk)
    spec = CallSpec(causal, scale, balance, slots, handoff, documents, window, u, softcap=softcap, chunk=chunk)
    # the ranks agree on the call, ulysses included, before any group is made or any head group exchanges
    check_agreement(comm, backend, qv, kv, vv, spec, sinks, alibi_slopes)
    head, ring = hybrid_groups(comm, u)
    check_backend_serves(backend, qv, ring.size(), causal, balance, value_dim=vv.shape[3])
    own_slopes = None if alibi_slopes is None else _own_heads(alibi_slopes, u, head.rank())
    return HybridConfig(head, RingConfig.of(ring, backend, spec, own_slopes), u, t)


class HybridState(NamedTuple):
    """What :func:`hybrid_backward` needs of a forward: the ring's inputs and results, in the ring layout
    (``[B, U·n, H/U, D]``; the K/V heads replicated where U does not divide them) and ``lse`` ``[B, H/U, U·n]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def hybrid_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: HybridConfig, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, HybridState]:
    """This rank's output of the hybrid (all-to-all, ring over R ranks, all-to-all back) without autograd,
    and the state :func:`hybrid_backward` takes: the hybrid's :func:`xcp.ring_forward`, for drivers of
    virtual ranks on a GPU, where autograd runs every backward on one device thread (docs/architecture.md,
    Autograd and virtual ranks). ``sinks`` [H]: the whole tensor (each rank applies its heads' slice)."""
    out, state, _ = _forward(q, k, v, cfg, sinks, keep=True)
    assert state is not None
    return out, state


def _forward(
    q, k, v, cfg: HybridConfig, sinks, keep: bool, return_lse: bool = False
) -> tuple[torch.Tensor, HybridState | None, torch.Tensor | None]:
    backend = cfg.ring.backend
    k, v = cfg.replicate(k, v)
    qr, kr, vr = heads_to_tokens(cfg.head, backend, (q, k, v))
    del k, v
    out_r, lse_r = ring_forward(qr, kr, vr, cfg.ring, cfg.own_sinks(sinks))
    state = HybridState(qr, kr, vr, out_r, lse_r) if keep else None
    lse = _lse_of_heads(tokens_to_heads(cfg.head, backend, (_lse_as_tokens(lse_r),))[0]) if return_lse else None
    del qr, kr, vr, lse_r
    return tokens_to_heads(cfg.head, backend, (out_r,))[0], state, lse


def _lse_as_tokens(lse: torch.Tensor) -> torch.Tensor:
    """The ring's lse [B, h, U·n] as a [B, U·n, h, 1] tensor, the layout :func:`tokens_to_heads` moves."""
    return lse.transpose(1, 2).unsqueeze(-1)


def _lse_of_heads(lse: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_lse_as_tokens` after the all-to-all: [B, n, H, 1] to [B, H, n], contiguous."""
    return lse.squeeze(-1).transpose(1, 2).contiguous()


def hybrid_backward(
    dout: torch.Tensor, state: HybridState, cfg: HybridConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of this rank's shards from the ``state`` of :func:`hybrid_forward`: dout goes
    to the ring layout by an all-to-all, :func:`xcp.ring_backward` runs over the R ranks, dq, dk and dv come
    back in one all-to-all, and the gradients of replicated K/V heads are summed. The sinks' gradient is not
    computed here (as with :func:`xcp.ring_backward`)."""
    backend = cfg.ring.backend
    (dout_r,) = heads_to_tokens(cfg.head, backend, (dout.contiguous(),))
    grads_r = ring_backward(dout_r, *state, cfg.ring)
    del dout_r
    dq, dk, dv = tokens_to_heads(cfg.head, backend, grads_r)
    del grads_r
    t = cfg.replicas
    if t > 1:  # head i·t + j is copy j of K/V head i (repeat_interleave)
        dk, dv = (g.unflatten(2, (g.shape[2] // t, t)).sum(3) for g in (dk, dv))
    return dq, dk, dv


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: HybridConfig, sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """This rank's output of :func:`xcp.attention` with ``ulysses`` > 1 on the configuration of
    :func:`hybrid_config`: under autograd where an input needs a gradient, else :func:`hybrid_forward`'s;
    and, with ``return_lse``, its lse [B, H, n] (this rank's rows and all heads: the ring's lse of H / U
    heads goes back by its own all-to-all, through which a gradient of lse reaches the ring's Function and
    raises there), else None."""
    needs_grad = any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if torch.is_grad_enabled() and needs_grad:
        backend = cfg.ring.backend
        k, v = cfg.replicate(k, v)  # autograd sums the replicas' gradients back
        qr, kr, vr = HeadExchange.apply(cfg.head, backend, True, q, k, v)
        out_r, lse_r = RingAttention.apply(qr, kr, vr, cfg.own_sinks(sinks), cfg.ring)
        out = HeadExchange.apply(cfg.head, backend, False, out_r)[0]
        if not return_lse:
            return out, None
        return out, _lse_of_heads(HeadExchange.apply(cfg.head, backend, False, _lse_as_tokens(lse_r))[0])
    out, _, lse = _forward(q, k, v, cfg, sinks, keep=False, return_lse=return_lse)
    return out, lse
