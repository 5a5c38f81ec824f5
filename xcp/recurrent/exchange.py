"""The one collective of state passing and of halos: an all-gather of small per-rank tensors whose
backward is an all-to-all of their gradients (each rank gets back, summed, what every rank's use of its
piece contributed). A thin autograd Function around plain functions, as the ring's."""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..comm import Communicator


def gather(comm: Communicator, backend: Any, x: torch.Tensor, tag: str) -> torch.Tensor:
    """Every rank's ``x`` stacked in group order: ``[P, *x.shape]`` (``x`` itself in a world of one)."""
    if comm.size() == 1:
        return x.unsqueeze(0)
    all_gather = getattr(comm, "all_gather", None)
    if all_gather is None:
        raise TypeError(f"group: a recurrent layer needs a communicator with all_gather(); got {type(comm).__name__}")
    send = x.contiguous()
    recv = send.new_empty((comm.size(), *send.shape))
    all_gather(send, recv, tag, backend).wait()
    return recv


def scatter_sum(comm: Communicator, backend: Any, grads: torch.Tensor, tag: str) -> torch.Tensor:
    """The backward of :func:`gather`: ``grads[j]`` goes to rank j; this rank's gradient is the sum of what
    every rank sent it."""
    if comm.size() == 1:
        return grads[0]
    all_to_all = getattr(comm, "all_to_all", None)
    if all_to_all is None:
        raise TypeError(f"group: a recurrent layer needs a communicator with all_to_all(); got {type(comm).__name__}")
    send = grads.contiguous()
    recv = torch.empty_like(send)
    all_to_all(send, recv, tag, backend).wait()
    return recv.sum(0)


class Gather(torch.autograd.Function):
    """Autograd wrapper of :func:`gather` / :func:`scatter_sum` (tags ``tag`` and ``"d" + tag``)."""

    @staticmethod
    def forward(ctx, comm: Communicator, backend: Any, tag: str, x: torch.Tensor) -> torch.Tensor:
        ctx.comm, ctx.backend, ctx.tag = comm, backend, tag
        ctx.thread = threading.get_ident()
        return gather(comm, backend, x, tag)

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
            return None, None, None, scatter_sum(comm, ctx.backend, grads, "d" + ctx.tag)


def gather_differentiable(comm: Communicator, backend: Any, x: torch.Tensor, tag: str) -> torch.Tensor:
    """:func:`gather`, through autograd when ``x`` needs a gradient."""
    if comm.size() > 1 and torch.is_grad_enabled() and x.requires_grad:
        return Gather.apply(comm, backend, tag, x)
    return gather(comm, backend, x, tag)


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
