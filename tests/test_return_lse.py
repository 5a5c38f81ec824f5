"""``xcp.attention(..., return_lse=True)``: ``(out, lse)``, lse [B, H, S_local] of this rank's rows.

Against a float64 reference of the whole sequence written here (explicit scores under one mask, the sink as
one more logit, ``torch.logsumexp``; gradients by autograd), to 1e-10: LocalWorlds of 1, 2 and 4 ranks,
causal and not, GQA, windows, sinks, documents, the hybrid (ulysses=2 on 4 ranks), the world of one that a
backend's ``whole_attention`` would serve, and torch.compile. Gradients through lse are not supported: a
non-zero one raises, none or zeros leave the gradients of q, k, v as they are without lse.
"""

from __future__ import annotations

import inspect
import math
import typing

import pytest
import torch
from helpers import installed
from strategies import random_inputs

import xcp
from xcp.api import _Options
from xcp.backends.cpu import CPUBackend

TOL = 1e-10
H, HKV, D = 4, 2, 8
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)


def reference(q, k, v, dout, causal=False, cu=None, window=None, sinks=None, scale=None):
    """(out, lse, dq, dk, dv) of the whole sequence in float64: the scores under the document, causal and
    window mask, the sink as one more logit per head, lse by torch.logsumexp, gradients by autograd."""
    s, groups = q.shape[1], q.shape[2] // k.shape[2]
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pos = torch.arange(s)
    doc = torch.bucketize(pos, torch.tensor(cu or [0, s])[1:], right=True)
    left, right = window or (None, None)
    i, j = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j - i >= -(s if left is None else left))
    allowed &= j - i <= (0 if causal else s if right is None else right)
    kr, vr = (t.repeat_interleave(groups, dim=2) for t in x[1:])
    scale = q.shape[3] ** -0.5 if scale is None else scale
    scores = (torch.einsum("bihd,bjhd->bhij", x[0], kr) * scale).masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.exp(scores - lse.unsqueeze(-1))[..., :s], vr)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, x, dout.double()))


def run(q, k, v, dout, world, *, balance="zigzag", ulysses=1, cu=None, **options):
    """Shard over ``world`` LocalWorld ranks, ``xcp.attention(..., return_lse=True)`` on each, backward with
    dout's shard, unshard: (out, lse, dq, dk, dv) of the whole sequence."""
    place = dict(balance=balance, ulysses=ulysses)

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank(), **place).requires_grad_() for t in (q, k, v)]
        cu_seqlens = None if cu is None else torch.tensor(cu)
        out, lse = xcp.attention(*local, group=group, cu_seqlens=cu_seqlens, return_lse=True, **place, **options)
        assert lse.shape == (q.shape[0], q.shape[2], local[0].shape[1]) and lse.dtype == torch.float64
        out.backward(xcp.shard(dout, world, group.rank(), **place))
        return out.detach(), lse.detach(), *(t.grad for t in local)

    per_rank = xcp.LocalWorld(world, timeout=30).run(rank_fn)
    return [xcp.unshard([r[i] for r in per_rank], dim=2 if i == 1 else 1, **place) for i in range(5)]


def assert_all_close(got, want, tol=TOL, what=""):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        err = (g.double() - w).abs().max().item()
        assert err <= tol, f"{what} {name}: max abs error {err:.3e} > {tol:g}"


CASES: dict[str, dict[str, typing.Any]] = {
    "full, stripe": dict(causal=False, balance="stripe"),
    "causal": dict(causal=True),
    "causal window, contiguous": dict(causal=True, window=(5, 0), balance="contiguous"),
    "window both sides": dict(causal=False, window=(3, 6)),
    "sinks": dict(causal=True, sinks=SINKS),
    "documents": dict(causal=True, cu=[0, 3, 17, 32]),
    "documents, window, sinks": dict(causal=True, cu=[0, 9, 10, 32], window=(4, 0), sinks=SINKS),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_out_lse_and_gradients_match_the_whole_sequence(world, name):
    options = CASES[name]
    q, k, v, dout = random_inputs(1, 32, H, HKV, D, seed=world * 31 + len(name))
    want = reference(q, k, v, dout, **{o: options[o] for o in ("causal", "cu", "window", "sinks") if o in options})
    assert_all_close(run(q, k, v, dout, world, **options), want, what=f"P={world} {name}")


@pytest.mark.parametrize(
    ("kv_heads", "options"),
    [(2, dict(causal=True)), (1, dict(causal=False, sinks=SINKS)), (2, CASES["documents, window, sinks"])],
    ids=["causal", "replicated kv, sinks", "documents, window, sinks"],
)
def test_the_hybrid_returns_each_ranks_own_rows_and_all_heads(kv_heads, options):
    """ulysses=2 on 4 ranks: the ring's lse of H/2 heads comes back through the reverse all-to-all."""
    q, k, v, dout = random_inputs(1, 32, H, kv_heads, D, seed=7 + kv_heads)
    want = reference(q, k, v, dout, **{o: options[o] for o in ("causal", "cu", "window", "sinks") if o in options})
    assert_all_close(run(q, k, v, dout, 4, ulysses=2, **options), want, what="P=4 U=2")


def test_without_grad_the_same_lse_and_out():
    """No input requires grad (the plain forward, ring and hybrid): the same out and lse, batch 2."""
    q, k, v, _ = random_inputs(2, 16, H, HKV, D, seed=3)
    want = reference(q, k, v, torch.zeros_like(q), causal=True)[:2]
    got = xcp.attention(q, k, v, causal=True, return_lse=True)
    for world, ulysses in ((2, 1), (4, 2)):

        def rank_fn(group, world=world, ulysses=ulysses):
            local = [xcp.shard(t, world, group.rank(), ulysses=ulysses) for t in (q, k, v)]
            return xcp.attention(*local, causal=True, group=group, ulysses=ulysses, return_lse=True)

        per_rank = xcp.LocalWorld(world).run(rank_fn)
        sharded = [xcp.unshard([r[i] for r in per_rank], dim=1 + i, ulysses=ulysses) for i in range(2)]
        assert_all_close(sharded, want, what=f"P={world} U={ulysses}")
    assert_all_close(got, want, what="world of one")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("world", [1, 2])
def test_lse_is_float32_for_float32_and_16_bit_inputs(world, dtype, tol):
    q, k, v, _ = random_inputs(1, 16, H, HKV, D, dtype=dtype, seed=5)

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank()) for t in (q, k, v)]
        return xcp.attention(*local, causal=True, group=group, return_lse=True)[1]

    lses = xcp.LocalWorld(world).run(rank_fn)
    assert all(lse.dtype == torch.float32 and lse.shape == (1, H, 16 // world) for lse in lses)
    want = reference(q, k, v, torch.zeros_like(q), causal=True)[1]
    assert (xcp.unshard(lses, dim=2).double() - want).abs().max().item() <= tol


class _Whole(CPUBackend):
    """The CPU backend with a ``whole_attention`` (as CUDA's SDPA), which returns no lse."""

    name = "whole-lse"

    def __init__(self) -> None:
        self.calls = 0

    def whole_attention(self, q, k, v, causal, scale):
        self.calls += 1
        return super().forward(q, k, v, "causal" if causal else "none", scale)[0]


def test_a_world_of_one_with_return_lse_takes_the_block_kernel_not_whole_attention():
    q, k, v, dout = random_inputs(2, 12, H, HKV, D, seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with installed(_Whole()) as backend:
        xcp.attention(q, k, v, causal=True, device=backend.name)
        assert backend.calls == 1
        out, lse = xcp.attention(*leaves, causal=True, device=backend.name, return_lse=True)
        assert backend.calls == 1
    out.backward(dout)
    assert_all_close((out.detach(), lse, *(t.grad for t in leaves)), reference(q, k, v, dout, causal=True))
    assert all(torch.equal(t.detach(), x) for t, x in zip(leaves, (q, k, v))), "inputs are never mutated"


class _SeesNothing(CPUBackend):
    """A block kernel whose rows see no key (out 0, lse -inf), as a row that no mask lets through."""

    name = "sees-nothing"

    def forward(self, q, k, v, mask, scale):
        out, lse = super().forward(q, k, v, mask, scale)
        return torch.zeros_like(out), torch.full_like(lse, -math.inf)


@pytest.mark.parametrize(("world", "sinks"), [(1, None), (2, None), (2, SINKS)])
def test_rows_that_see_no_key_give_out_zero_and_lse_minus_inf(world, sinks):
    """Through the merge, the sinks (then lse is the sink's logit alone) and the world of one; never NaN."""
    q, k, v, _ = random_inputs(1, 8, H, HKV, D, seed=2)

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank()) for t in (q, k, v)]
        return xcp.attention(*local, causal=True, group=group, sinks=sinks, device="sees-nothing", return_lse=True)

    with installed(_SeesNothing()):
        results = xcp.LocalWorld(world).run(rank_fn)
    for out, lse in results:
        assert not out.isnan().any() and not out.abs().any()
        want = torch.full_like(lse, -math.inf) if sinks is None else SINKS.view(1, -1, 1).expand_as(lse)
        assert torch.equal(lse, want)


# ------------------------------------------------------------------------------------------ gradients


def _lse_grad_world(world, ulysses, loss):
    """``loss(out, lse)`` backward on every rank of a LocalWorld; the gradients of q, k, v of each rank."""
    q, k, v, _ = random_inputs(1, 16, H, HKV, D, seed=13)

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank(), ulysses=ulysses).requires_grad_() for t in (q, k, v)]
        out, lse = xcp.attention(*local, causal=True, group=group, ulysses=ulysses, sinks=SINKS, return_lse=True)
        loss(out, lse).backward()
        return [t.grad for t in local]

    return xcp.LocalWorld(world, timeout=30).run(rank_fn)


@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (4, 2)])
def test_a_gradient_through_lse_raises(world, ulysses):
    for loss in (lambda out, lse: out.sum() + lse.sum(), lambda out, lse: lse.exp().mean()):
        with pytest.raises(RuntimeError, match="return_lse: gradients through lse are not supported"):
            _lse_grad_world(world, ulysses, loss)


@pytest.mark.parametrize(("world", "ulysses"), [(1, 1), (2, 1), (4, 2)])
def test_an_unused_or_zero_lse_gradient_leaves_the_gradients_as_they_are(world, ulysses):
    want = _lse_grad_world(world, ulysses, lambda out, lse: (out * out).sum())
    for loss in (lambda out, lse: (out * out).sum() + 0 * lse.sum(), lambda out, lse: (out * out).sum()):
        for got_rank, want_rank in zip(_lse_grad_world(world, ulysses, loss), want):
            assert all(torch.equal(g, w) for g, w in zip(got_rank, want_rank))


# ------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("bad", ["yes", 1.5, 1, None, torch.tensor(True)])
def test_a_return_lse_that_is_not_a_bool_is_named(bad):
    q, k, v, _ = random_inputs(1, 4, H, HKV, D)
    with pytest.raises(TypeError, match=r"return_lse: expected a bool; got "):
        xcp.attention(q, k, v, return_lse=bad)


def test_the_default_returns_out_alone_and_the_typed_options_list_every_keyword():
    q, k, v, _ = random_inputs(1, 4, H, HKV, D)
    assert isinstance(xcp.attention(q, k, v), torch.Tensor)
    keywords = [p.name for p in inspect.signature(xcp.attention).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keywords[-1] == "return_lse" and list(_Options.__annotations__) == keywords[:-1]


# ------------------------------------------------------------------------------------------ torch.compile

COMPILED = {
    "causal": dict(causal=True),
    "documents, window, sinks": dict(causal=True, cu_seqlens=[0, 5, 40, 64], window=(10, 0)),
}


@pytest.mark.parametrize("name", list(COMPILED))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_attention_returns_lse(backend, name):
    """One graph; out, lse and the gradients of q, k, v (lse returned and unused) equal eager's and the
    float64 reference's; a gradient through the compiled lse raises."""
    torch._dynamo.reset()
    options = COMPILED[name]
    q, k, v, dout = random_inputs(1, 64, H, HKV, D, dtype=torch.float32, seed=17)
    sinks = SINKS.float() if "window" in options else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fn(q, k, v):
        return xcp.attention(q, k, v, sinks=sinks, return_lse=True, **options)

    out, lse = torch.compile(fn, fullgraph=True, backend=backend)(*leaves)
    assert lse.dtype == torch.float32 and lse.shape == (1, H, 64)
    out.backward(dout)
    cu = options.get("cu_seqlens")
    want = reference(q, k, v, dout, causal=True, cu=cu, window=options.get("window"), sinks=sinks)
    assert_all_close((out.detach(), lse.detach(), *(t.grad for t in leaves)), want, tol=2e-5, what=backend)
    out, lse = torch.compile(fn, fullgraph=True, backend=backend)(*leaves)
    with pytest.raises(RuntimeError, match="return_lse: gradients through lse are not supported"):
        lse.sum().backward()
