"""Shared test configuration: Hypothesis profiles, a float64 reference attention and a ring runner.

Profiles: ``ci`` (no deadline, few examples, failing example printed as a reproducible blob) is chosen when
the ``CI`` environment variable is set, ``dev`` otherwise; ``HYPOTHESIS_PROFILE`` overrides both
(``thorough`` runs many more examples, for an occasional deep check).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings

import xcp

# Threads and a fresh autograd graph per example make timings noisy on a 2-core machine, so no profile
# has a deadline; example counts keep the whole suite within a few minutes there.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=20,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", deadline=None, max_examples=500, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


# --------------------------------------------------------------------------------------------------------
# Reference: plain float64 matmul-softmax attention on the whole sequence, differentiated by autograd.


@dataclass
class Result:
    """Output and gradients of an attention call, all on the whole (unsharded) sequence."""

    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> Result:
    """Attention of the whole sequence in float64, layout [B, S, H, D], K/V heads repeated for GQA.

    Independent of xcp: one softmax over all keys (no blocks, no log-sum-exp merge), gradients by
    autograd. Every input is converted to float64 first, so the reference sees exactly the (possibly
    rounded) values the ring saw.
    """
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    qh = q64.transpose(1, 2)  # [B, H, S, D]
    kh = k64.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        s = q.shape[1]
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)
    out.backward(dout.detach().to(torch.float64))
    return Result(out.detach(), q64.grad, k64.grad, v64.grad)


# --------------------------------------------------------------------------------------------------------
# The ring on a LocalWorld of P threads, sharded and unsharded with xcp's own shard/unshard.


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    world_size: int,
    causal: bool,
    balance: str = "zigzag",
    scale: float | None = None,
    grads: Sequence[bool] = (True, True, True),
    **kwargs,
) -> Result:
    """Shard q, k, v, dout over ``world_size`` virtual ranks, run :func:`xcp.attention` on each, unshard.

    Each rank calls ``.backward`` on its output with its shard of ``dout`` (skipped when ``dout`` is
    None). ``grads`` says which of q, k, v require grad; a gradient that was not asked for is None.
    """
    p = world_size

    def rank_fn(group: xcp.LocalGroup):
        r = group.rank()
        local = [xcp.shard(t, p, r, balance=balance).requires_grad_(g) for t, g in zip((q, k, v), grads)]
        out = xcp.attention(*local, causal=causal, group=group, scale=scale, balance=balance, **kwargs)
        if dout is not None:
            out.backward(xcp.shard(dout, p, r, balance=balance))
        return out.detach(), *(t.grad for t in local)

    per_rank = xcp.LocalWorld(p, timeout=60).run(rank_fn)

    def gather(i: int) -> torch.Tensor | None:
        parts = [res[i] for res in per_rank]
        return None if parts[0] is None else xcp.unshard(parts, balance=balance)

    return Result(gather(0), gather(1), gather(2), gather(3))


@pytest.fixture(scope="session")
def reference():
    """:func:`reference_attention` as a fixture."""
    return reference_attention


@pytest.fixture(scope="session")
def ring():
    """:func:`ring_attention` as a fixture."""
    return ring_attention
