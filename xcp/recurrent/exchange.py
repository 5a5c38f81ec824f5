"""The one collective of state passing and of halos: an all-gather of small per-rank tensors whose
backward is an all-to-all of their gradients (each rank gets back, summed, what every rank's use of its
piece contributed). A thin autograd Function around plain functions, as the ring's.

Lifetimes (docs/lifetime.md): each collective runs as the KV cache's combine does
(:func:`xcp.inference.partials.exchange`): the receive buffer made on the caller's stream C before the
comm stream M forks (rule 1), the tensor sent written on C and handed to M (rule 3.3: M waits for C, the
policy ``handoff`` keeps its memory valid while M reads it), C waiting for M at the join."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..comm import Communicator
from ..inference.partials import exchange


def gather(
    comm: Communicator, backend: Any, handoff: str | None, parts: Sequence[torch.Tensor], rows: int, tag: str
) -> torch.Tensor:
    """Every rank's ``parts`` (equal shapes; zeros after them up to ``rows``) in one all-gather:
    ``[P, rows, *part.shape]``, rank j's at ``[j]``.

    The parts are packed into the buffer sent on the caller's stream C after the comm stream M forked, then
    handed to M (docs/lifetime.md rule 3.3), as the combine's partial is."""
    shape, like = tuple(parts[0].shape), parts[0]
    recv = like.new_empty((comm.size(), rows, *shape))  # rule 1: made on C before M forks

    def pack() -> torch.Tensor:
        padding = [like.new_zeros(shape)] * (rows - len(parts))
        return torch.stack([*parts, *padding])

    if comm.size() == 1:
        recv[0].copy_(pack())
        return recv
    exchange(comm, backend, handoff, "all_gather", pack, recv, tag)
    return recv


def scatter_sum(comm: Communicator, backend: Any, handoff: str | None, grads: torch.Tensor, tag: str) -> torch.Tensor:
    """The backward of :func:`gather`: ``grads[j]`` goes to rank j; this rank's gradient is the sum of what
    every rank sent it. (``grads`` is autograd's, written before M forks: rule 1 orders M's read after it,
    and it lives until the join.)"""
    if comm.size() == 1:
        return grads[0]
    recv = torch.empty_like(grads, memory_format=torch.contiguous_format)  # rule 1
    exchange(comm, backend, handoff, "all_to_all", grads.contiguous, recv, tag)
    return recv.sum(0)


class Gather(torch.autograd.Function):
    """Autograd wrapper of :func:`gather` / :func:`scatter_sum` (tags ``tag`` and ``"d" + tag``)."""

    @staticmethod
    def forward(ctx, comm: Communicator, backend: Any, handoff: str | None, tag: str, rows: int, *parts: torch.Tensor):
        ctx.comm, ctx.backend, ctx.handoff, ctx.tag = comm, backend, handoff, tag
        ctx.thread = threading.get_ident()
        return gather(comm, backend, handoff, parts, rows, tag)

    @staticmethod
    def backward(ctx, grads: torch.Tensor):
        comm = ctx.comm
        if comm.size() > 1 and comm.ranks_are_threads and threading.get_ident() != ctx.thread:
            raise RuntimeError(
                f"xcp: autograd ran the backward of LocalWorld rank {comm.rank()}'s {ctx.tag} exchange outside its "
                "thread; PyTorch runs GPU backward on one worker thread per device, where an exchange that waits "
                "for its peers would hang. Use real ranks (torchrun) there."
            )
        with torch.no_grad():
            mine = scatter_sum(comm, ctx.backend, ctx.handoff, grads, "d" + ctx.tag)
        n = len(ctx.needs_input_grad) - 5
        return (None, None, None, None, None, *(mine[i] for i in range(n)))


def gather_differentiable(
    comm: Communicator, backend: Any, handoff: str | None, parts: Sequence[torch.Tensor], rows: int, tag: str
) -> torch.Tensor:
    """:func:`gather`, through autograd when a part needs a gradient."""
    if comm.size() > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return Gather.apply(comm, backend, handoff, tag, rows, *parts)
    return gather(comm, backend, handoff, parts, rows, tag)


class _Tie(torch.autograd.Function):
    """``x`` unchanged, with ``others`` in its graph (gradient zero): a rank whose outputs use none of a
    gathered tensor must still run that exchange's backward, or its peers would wait for it forever."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.others = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.others))


def tie(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``x``, whose backward also reaches the backward of every tensor of ``others`` that needs a gradient."""
    needed = [o for o in others if o.requires_grad]
    if not needed or not torch.is_grad_enabled():
        return x
    return _Tie.apply(x, *needed)
