"""Packed documents (cu_seqlens) and attention sinks across the ring.

Three layers, each against something independent of it:
- the plan (xcp.documents) against a brute-force list of the allowed (query, key) pairs of every block,
  built from the global positions each rank holds (xcp.schedule.shard_indices) and the document of each;
- the ring in float64 against one softmax over the whole sequence with an explicit global mask (and the
  sink as an extra value-less logit), for out, dq, dk, dv and dsinks (tests/helpers.py's
  independent_masked_reference);
- the kernel calls a ring makes, counted, against the non-empty (document, block) pairs.
"""

from __future__ import annotations

import bisect
import re

import numpy
import pytest
import torch
from helpers import NAMES, allowed_pairs, independent_masked_reference, pairs_of_runs, rank_errors, ring_with_documents
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from strategies import assert_close_to, layouts

import xcp
from xcp import documents, schedule
from xcp.backends.cpu import CPUBackend
from xcp.kernels.merge import NEG_INF, apply_sinks_, sinks_grad
from xcp.ring import RingConfig, ring_backward, ring_forward

# ---------------------------------------------------------------------------------------------- the plan


@settings(max_examples=300, deadline=None)
@given(layouts())
@example((2, "stripe", True, (0, 6, 14, 24)))  # stripe's causal runs must never join an unmasked call
def test_the_plan_computes_exactly_the_allowed_pairs(layout):
    world, balance, causal, cu = layout
    n = cu[-1] // world
    for rank in range(world):
        plan = documents.document_plan(cu, world, rank, causal, balance)
        for i, runs in enumerate(plan.steps):
            want = allowed_pairs(cu, world, rank, (rank - i) % world, balance, causal)
            got = pairs_of_runs(runs)
            assert len(got) == len(set(got)), "no pair is computed twice"
            assert set(got) == want
            assert plan.pairs[i] == len(want)
            joined = documents.join_runs(runs)  # the varlen fillers' calls: the same pairs, none twice
            assert sorted(pairs_of_runs(joined)) == sorted(got)
            for run in runs:  # a run's segments tile its rows without gaps
                assert run.cu_q[0] == 0 and run.cu_q[-1] == run.q1 - run.q0
                assert run.cu_k[0] == 0 and run.cu_k[-1] == run.k1 - run.k0
                assert 0 <= run.q0 < run.q1 <= n and 0 <= run.k0 < run.k1 <= n
        assert sum(plan.work(n)) == pytest.approx(sum(plan.pairs) / n**2)


def test_blocks_of_two_ranks_are_small_under_zigzag_and_contiguous():
    """The shape claim the fast path rests on. A document that holds keys of one chunk and queries of
    another holds every position between them, so each pair of chunks shares at most one document:
    causal blocks of two ranks are one dense call or none; non-causal ones at most one segment per pair
    of chunks (4 under zigzag); a rank's own causal block is one varlen call."""
    cu = (0, 1, 5, 40, 41, 90, 128, 200, 256)
    for balance in ("zigzag", "contiguous"):
        for causal in (True, False):
            for rank in range(4):
                plan = documents.document_plan(cu, 4, rank, causal, balance)
                for i, runs in enumerate(plan.steps[1:], start=1):
                    segments = sum(r.segments for r in runs)
                    limit = 1 if causal or balance == "contiguous" else 4
                    assert segments <= limit, (balance, causal, rank, i, runs)
                    assert not causal or all(r.segments == 1 and not r.causal for r in runs)
                own = plan.steps[0]
                assert len(own) == 1 and own[0].causal == causal and own[0].segments >= 1


@pytest.mark.parametrize(
    ("cu", "seq", "message"),
    [
        ([0, 4, 3, 8], 8, "non-decreasing boundaries (a repeat is an empty document); got cu_seqlens[1] = 4 > "),
        ([0, -2, 8], 8, "non-decreasing boundaries (a repeat is an empty document); got cu_seqlens[0] = 0 > "),
        ([0, 0, 0], None, "expected at least one token (cu_seqlens[-1] > 0); got [0, 0, 0]"),
        ([1, 8], 8, "expected cu_seqlens[0] == 0; got 1"),
        ([0, 6], 8, "expected cu_seqlens[-1] == 8 (the global sequence length: local length x ranks); got 6"),
        ([0], 8, "at least 2 boundaries"),
        ([0, 2.5, 8], 8, "integer boundaries; got 2.5"),
        ([[0, 8]], 8, "expected 1 dim"),
        ("0,8", 8, "expected a 1-D sequence"),
    ],
)
def test_bad_boundaries_are_named(cu, seq, message):
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*" + re.escape(message)):
        documents.check_cu_seqlens(cu, seq)


def test_boundaries_of_numpy_integers_come_back_as_ints():
    """Boundaries given as numpy integers are returned as Python ints, as a tensor's tolist() gives them."""
    got = documents.check_cu_seqlens([0, numpy.int64(3), numpy.int32(3), numpy.uint8(8)], 8)
    assert got == (0, 3, 8) and all(type(x) is int for x in got)


# ---------------------------------------------------------------------------------------------- numerics


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts(max_chunks=3),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_float64_ring_with_documents_matches_the_masked_reference(layout, kv_heads, groups, with_sinks, seed):
    world, balance, causal, cu = layout
    gen = torch.Generator().manual_seed(seed)
    heads, seq = kv_heads * groups, cu[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, dout = rnd(1, seq, heads, 4), rnd(1, seq, kv_heads, 4), rnd(1, seq, kv_heads, 4), rnd(1, seq, heads, 4)
    sinks = rnd(heads) if with_sinks else None
    got = ring_with_documents(q, k, v, dout, world, balance, causal, cu, sinks)
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)],
    ids=["float32", "bfloat16", "float16"],
)
def test_low_precision_ring_with_documents(dtype, tol):
    """Tolerances: inputs are rounded to the dtype once (the reference sees the rounded values), blocks
    accumulate in float32, so the error is the output's rounding (bf16: 2^-8 relative; fp16: 2^-11) plus
    float32 summation, times a small factor for the backward's longer chains."""
    cu = (0, 1, 7, 30, 31, 48)
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(1, 48, h, 16, generator=gen, dtype=torch.float64).to(dtype) for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64).to(dtype)
    got = ring_with_documents(q, k, v, dout, 3, "zigzag", True, cu, sinks)
    want = independent_masked_reference(q, k, v, dout, cu, True, sinks)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype
        assert_close_to(name, g, w, tol)


def test_one_document_is_the_dense_path_exactly():
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    plain = ring_with_documents(q, k, v, dout, 2, "zigzag", True, (0, 16))

    def dense(group):
        r = group.rank()
        local = [xcp.shard(t, 2, r).requires_grad_() for t in (q, k, v)]
        out = xcp.attention(*local, causal=True, group=group)
        out.backward(xcp.shard(dout, 2, r))
        return [out.detach(), *(t.grad for t in local)]

    per_rank = xcp.LocalWorld(2).run(dense)
    for i in range(4):
        assert torch.equal(plain[i], xcp.unshard([res[i] for res in per_rank]))


# ---------------------------------------------------------------------------------------------- sinks


def test_sinks_never_give_nan_even_on_rows_that_see_only_the_sink():
    out = torch.zeros(1, 3, 2, 4, dtype=torch.float64)
    out[:, 1:] = 1.0
    lse = torch.tensor([[[NEG_INF, 0.5, 2.0], [NEG_INF, NEG_INF, 1.0]]], dtype=torch.float64)
    sinks = torch.tensor([0.3, NEG_INF], dtype=torch.float64)
    o, merged = out.clone(), lse.clone()
    apply_sinks_(o, merged, sinks)
    assert not torch.isnan(o).any() and not torch.isnan(merged).any()
    assert torch.equal(o[0, 0], torch.zeros(2, 4))  # head 0 row 0: only the sink, no value: 0
    assert merged[0, 0, 0] == 0.3 and merged[0, 1, 0] == NEG_INF and merged[0, 1, 1] == NEG_INF  # no key and no sink
    assert torch.allclose(merged[0, 0, 1], torch.logaddexp(torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.3)))
    assert torch.equal(o[0, 2, 1], out[0, 2, 1])  # a -inf sink changes nothing
    g = sinks_grad(torch.ones_like(o), o, merged, sinks)
    assert not torch.isnan(g).any() and g[1] == 0


def test_extreme_sinks_through_the_ring_stay_finite():
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 16, h, 4, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    sinks = torch.tensor([NEG_INF, 80.0, -80.0, 0.0], dtype=torch.float64)
    got = ring_with_documents(q, k, v, dout, 2, "stripe", True, (0, 1, 9, 16), sinks)
    want = independent_masked_reference(q, k, v, dout, (0, 1, 9, 16), True, sinks)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


def test_sinks_without_documents_match_the_reference(reference):
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 12, h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    per_rank = xcp.LocalWorld(3).run(
        lambda g: xcp.attention(*(xcp.shard(t, 3, g.rank()) for t in (q, k, v)), group=g, sinks=sinks)
    )
    want = independent_masked_reference(q[:1], k[:1], v[:1], dout[:1], (0, 12), False, sinks)[0]
    assert_close_to("out[0]", xcp.unshard(per_rank)[:1], want, 1e-12)


# ---------------------------------------------------------------------------------------------- kernel calls


class CountingBackend(CPUBackend):
    """The CPU backend, counting its dense calls per (query rows, key rows) shape, forward and backward."""

    name = "counting"

    def __init__(self) -> None:
        self.forward_calls = 0
        self.backward_calls = 0

    def forward(self, q, k, v, mask, scale):
        self.forward_calls += 1
        return super().forward(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        self.backward_calls += 1
        return super().backward(dout, q, k, v, out, lse, mask, scale)


@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_calls_equal_the_non_empty_segments(balance, causal):
    """The base varlen methods make one dense call per segment, so the calls count the segments: one per
    (document, block) with an allowed pair, and none for blocks with none (skipped, not masked out)."""
    world, cu = 4, (0, 1, 3, 20, 21, 40, 64)
    n = cu[-1] // world
    gen = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(1, cu[-1], 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))

    def docs_with_pairs(rank: int) -> int:
        total = 0
        for i in range(world):
            pairs = allowed_pairs(cu, world, rank, (rank - i) % world, balance, causal)
            seq = schedule.shard_indices(cu[-1], world, rank, balance)
            total += len({bisect.bisect_right(cu, seq[qi]) - 1 for qi, _ in pairs})
        return total

    def rank_fn(group):
        be = CountingBackend()
        cfg = RingConfig(group, be, causal, 0.5, balance, documents=cu)
        local = [xcp.shard(t, world, group.rank(), balance=balance) for t in (q, k, v, dout)]
        out, lse = ring_forward(*local[:3], cfg)
        ring_backward(local[3], *local[:3], out, lse, cfg)
        return be.forward_calls, be.backward_calls

    for rank, (fwd, bwd) in enumerate(xcp.LocalWorld(world).run(rank_fn)):
        want = docs_with_pairs(rank)
        assert fwd == want and bwd == want, (rank, fwd, bwd, want)
        assert want < world * len(cu), "some (document, block) pairs are empty and were skipped"
    assert n == 16


# ---------------------------------------------------------------------------------------------- errors


def test_ranks_with_different_documents_all_raise():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 2, 4, generator=gen)

    def rank_fn(group):
        cu = torch.tensor([0, 5, 16] if group.rank() == 0 else [0, 6, 16])
        local = xcp.shard(q, 2, group.rank())
        xcp.attention(local, local, local, causal=True, group=group, cu_seqlens=cu)

    messages = rank_errors(2, rank_fn)
    assert messages[0] == messages[1] and "cu_seqlens (rank 0: '2 documents (crc32 " in messages[0]


def test_a_document_plan_names_a_rank_outside_the_world_and_a_length_the_balance_cannot_split():
    with pytest.raises(ValueError, match=r"rank: expected an integer in \[0, 2\); got 5"):
        documents.document_plan((0, 3, 8), 2, 5, True, "document_zigzag")
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]: balance 'zigzag' over 2 ranks needs a positive multiple"):
        documents.document_plan((0, 3, 7), 2, 0, True, "zigzag")
