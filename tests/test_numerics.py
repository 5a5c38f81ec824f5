"""Ring attention against an independent float64 whole-sequence reference (tests/helpers.py), for the
output and the gradients of q, k and v, on a LocalWorld of P threads.

Tolerances. Errors are measured as max|got - ref| / max|ref| per tensor (``max_rel_error``); the reference
runs in float64 on the very values the ring saw (inputs already rounded to the tested dtype), so what is
measured is the ring's own arithmetic, not the rounding of the inputs. With u the unit roundoff of a dtype
(2^-p for p significant bits):

- float64 (u = 1.1e-16): everything is computed in float64; 1e-10 absolute leaves a margin of ~10^5.
- float32 (u = 6.0e-8): the CPU kernel computes in float32; a dot product over n terms has a forward error
  of at most n·u, and the longest reductions here (softmax over <= 64 keys, matmuls over them, the merge
  over P blocks) stay below ~100 terms, so 2e-5 (≈ 330u). Measured worst over P in {1, 2, 4, 8}, every
  balance, causal or not, GQA: 8.3e-7.
- bfloat16 (8 significant bits, u = 2^-8 ≈ 3.9e-3): blocks compute and merge in float32 and the output is
  cast to bfloat16 once, so out is off by at most one rounding: tolerance 2u = 7.8e-3 (measured 3.4e-3).
  The backward reads that rounded output (delta = rowsum(dout·out)) and casts dq, dk, dv once more, so
  gradients carry about two roundings: tolerance 4u = 1.6e-2 (measured 6.8e-3).
- float16 (11 significant bits, u = 2^-11 ≈ 4.9e-4): the same reasoning, out 2u = 9.8e-4 (measured
  4.1e-4), gradients 4u = 2.0e-3 (measured 7.9e-4).
"""

from __future__ import annotations

import pytest
import torch
from helpers import TENSORS, assert_matches, independent_masked_reference
from hypothesis import given
from strategies import max_rel_error, random_inputs, ring_cases

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.kernels.merge import merge_, new_accumulators
from xcp.testing.reference import reference_gradients, sdpa_reference

BF16_U = 2.0**-8
FP16_U = 2.0**-11
TOLERANCE = {  # (out, gradients), relative to max|ref|; see the module docstring
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2 * BF16_U, 4 * BF16_U),
    torch.float16: (2 * FP16_U, 4 * FP16_U),
}


# ------------------------------------------------------------------------------------------------ float64


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_float64_grid(reference, ring, world, causal, balance, kv_heads):
    """Batch 2, 4 query heads, head_dim 6 (not a power of two), 2..4 tokens per zigzag chunk."""
    seq = 2 * world * (2 + world % 3)
    q, k, v, dout = random_inputs(2, seq, 4, kv_heads, 6, seed=world * 100 + kv_heads)
    assert_matches(ring(q, k, v, dout, world, causal, balance), reference(q, k, v, dout, causal))


@given(case=ring_cases())
def test_float64_random_configurations(reference, ring, case):
    q, k, v, dout = random_inputs(case.batch, case.seq, case.heads, case.kv_heads, case.head_dim, seed=case.seed)
    got = ring(q, k, v, dout, case.world, case.causal, case.balance)
    assert_matches(got, reference(q, k, v, dout, case.causal))


def test_world_of_one_without_a_group(reference):
    """group=None with no process group initialised is a world of one rank."""
    q, k, v, dout = random_inputs(2, 10, 4, 2, 6, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = xcp.attention(*leaves, causal=True)
    out.backward(dout)
    want = reference(q, k, v, dout, True)
    for got, name in zip((out.detach(), *(t.grad for t in leaves)), TENSORS):
        torch.testing.assert_close(
            got, getattr(want, name), rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("scale", [0.37, 2])
@pytest.mark.parametrize("balance", xcp.BALANCES)
def test_custom_scale(reference, ring, scale, balance):
    q, k, v, dout = random_inputs(1, 12, 4, 2, 5, seed=11)
    got = ring(q, k, v, dout, 3, True, balance, scale=scale)
    want = reference(q, k, v, dout, True, scale=scale)
    assert_matches(got, want)
    default = reference(q, k, v, dout, True)
    assert (got.out - default.out).abs().max() > 1e-3, "scale had no effect"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_library_references_agree_with_the_independent_one(causal):
    """xcp.testing.reference (what backend authors and the tools check against) against the tests' own
    reference, written apart from it: out, lse and the gradients, with GQA and a scale."""
    q, k, v, dout = random_inputs(2, 9, 4, 2, 6, seed=29)
    want = independent_masked_reference(q, k, v, dout, (0, 9), causal, scale=0.3)
    out, lse, dq, dk, dv = reference_gradients(dout, q, k, v, "causal" if causal else "none", 0.3)
    for name, got, w in zip(TENSORS, (out, dq, dk, dv), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-12)
    sdpa = sdpa_reference(q, k, v, causal, scale=0.3)
    torch.testing.assert_close(sdpa, want[0], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------- low-precision dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision(reference, ring, dtype, balance, causal):
    world = 4
    q, k, v, dout = random_inputs(2, 2 * world * 3, 4, 2, 12, dtype=dtype, seed=7)
    got = ring(q, k, v, dout, world, causal, balance)
    want = reference(q, k, v, dout, causal)
    tol_out, tol_grad = TOLERANCE[dtype]
    for name in TENSORS:
        g = getattr(got, name)
        assert g.dtype == dtype, f"{name} has dtype {g.dtype}, want {dtype}"
        assert torch.isfinite(g).all(), f"{name} is not finite"
        err = max_rel_error(g, getattr(want, name))
        tol = tol_out if name == "out" else tol_grad
        assert err <= tol, f"{name}: error {err:.3e} > {tol:.3e} ({dtype})"


# ------------------------------------------------------------------------------------ fully masked rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_gives_zeros_for_rows_that_see_no_key(dtype):
    """Under the strict mask query 0 sees no key: out 0 and lse -inf there, and no NaN anywhere."""
    be = CPUBackend()
    q, k, v, dout = random_inputs(2, 5, 4, 2, 6, dtype=dtype, seed=5)
    out, lse = be.forward(q, k, v, "strict", 0.4)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert (lse[:, :, 0] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, 1:]).all()
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, "strict", 0.4)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0]))
    # the last key is seen by no query under the strict mask: it gets no gradient
    assert torch.equal(dk[:, -1], torch.zeros_like(dk[:, -1]))
    assert torch.equal(dv[:, -1], torch.zeros_like(dv[:, -1]))


def test_strict_kernel_rows_match_the_reference():
    """Rows 1.. of a square strict block are causal attention of q[1:] against k[:-1]; row 0 sees no key."""
    be = CPUBackend()
    q, k, v, _ = random_inputs(1, 6, 2, 1, 4, seed=8)
    out, _ = be.forward(q, k, v, "strict", 0.5)
    shifted, _ = be.forward(q[:, 1:], k[:, :-1], v[:, :-1], "causal", 0.5)
    torch.testing.assert_close(out[:, 1:], shifted, rtol=0, atol=1e-12)


def test_new_accumulators_start_at_zero_and_minus_infinity():
    q = torch.randn(2, 5, 3, 4).to(torch.bfloat16)
    out, lse = new_accumulators(q, value_dim=6)  # initialised unless told ``empty``
    assert (out.dtype, lse.dtype, out.shape, lse.shape) == (torch.float32, torch.float32, (2, 5, 3, 6), (2, 3, 5))
    assert torch.equal(out, torch.zeros_like(out)) and (lse == float("-inf")).all()
    out, lse = new_accumulators(q.double(), empty=True)
    assert (out.dtype, out.shape, lse.shape) == (torch.float64, (2, 5, 3, 4), (2, 3, 5))


def test_merge_of_empty_blocks_keeps_zeros():
    q = torch.randn(1, 4, 2, 3)
    out, lse = new_accumulators(q)
    empty_lse = torch.full((1, 2, 4), float("-inf"))
    merge_(out, lse, torch.zeros(1, 4, 2, 3), empty_lse)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == float("-inf")).all()
    block = torch.randn(1, 4, 2, 3)
    block_lse = torch.randn(1, 2, 4)
    merge_(out, lse, block, block_lse)  # the first real block replaces the empty state exactly
    merge_(out, lse, torch.full_like(block, 5.0), empty_lse)  # an empty block changes nothing
    assert torch.equal(out, block) and torch.equal(lse, block_lse)


# ------------------------------------------------------------------------- purity, determinism, autograd


def test_inputs_are_never_mutated():
    world = 3
    q, k, v, dout = random_inputs(2, 12, 4, 2, 6, seed=13)

    def rank_fn(group):
        r = group.rank()
        local = [xcp.shard(t, world, r).requires_grad_() for t in (q, k, v)]
        d = xcp.shard(dout, world, r)
        kept = [t.detach().clone() for t in (*local, d)]
        out = xcp.attention(*local, causal=True, group=group)
        out.backward(d)
        return all(torch.equal(a, b) for a, b in zip((*local, d), kept))

    full = [t.clone() for t in (q, k, v, dout)]
    assert xcp.LocalWorld(world).run(rank_fn) == [True] * world
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, dout), full))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_second_call_is_bitwise_identical(ring, dtype):
    q, k, v, dout = random_inputs(2, 16, 4, 2, 6, dtype=dtype, seed=17)
    first = ring(q, k, v, dout, 4, True, "zigzag")
    second = ring(q, k, v, dout, 4, True, "zigzag")
    for name in TENSORS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name


@pytest.mark.parametrize(
    "grads", [(True, False, False), (False, True, False), (False, False, True), (True, False, True)]
)
def test_gradients_for_a_subset_of_inputs(reference, ring, grads):
    q, k, v, dout = random_inputs(1, 16, 4, 2, 6, seed=19)
    got = ring(q, k, v, dout, 4, True, "zigzag", grads=grads)
    want = reference(q, k, v, dout, True)
    torch.testing.assert_close(got.out, want.out, rtol=0, atol=1e-10)
    for name, asked in zip(("dq", "dk", "dv"), grads):
        g = getattr(got, name)
        if asked:
            torch.testing.assert_close(g, getattr(want, name), rtol=0, atol=1e-10)
        else:
            assert g is None, f"{name} was computed though not asked for"


def test_under_no_grad(reference):
    world = 2
    q, k, v, dout = random_inputs(1, 8, 2, 1, 6, seed=23)

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank()).requires_grad_() for t in (q, k, v)]
        with torch.no_grad():
            out = xcp.attention(*local, causal=True, group=group)
        return out

    outs = xcp.LocalWorld(world).run(rank_fn)
    assert not any(o.requires_grad for o in outs)
    torch.testing.assert_close(xcp.unshard(outs), reference(q, k, v, dout, True).out, rtol=0, atol=1e-10)
