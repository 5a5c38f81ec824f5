"""Attention variants: logit soft-capping (``softcap=``), ALiBi (``alibi_slopes=``) and chunked attention
(``chunk=``), exact across the ring.

The float64 ring, forward and every gradient, against tests/helpers.py's independent whole-sequence
reference with the same score modification, on every balance (and the hybrid); the chunked plan against a
brute-force list of pairs; every bad argument named; a backend that lacks a modification refused before any
kernel runs, and one that declares it but ignores it caught by the conformance suite.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import NAMES, allowed_pairs, independent_masked_reference, installed, pairs_of_runs, run_sharded

import xcp
from xcp import documents
from xcp.backends.cpu import CPUBackend
from xcp.testing import conformance

S, H, HKV, D = 24, 4, 2, 8
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)  # BLOOM's for 4 heads: 2^(-8 h / H)
VARIANTS = {
    "softcap": {"softcap": 1.5},  # scores of these inputs spread over +-6: the cap bends them
    "alibi": {"alibi_slopes": SLOPES},
    "chunk": {"chunk": 5},  # chunks that cross the shards' and the documents' boundaries
}
BALANCES = ("contiguous", "zigzag", "stripe", "document_zigzag")
CU = (0, 7, S)


def inputs(seed: int, value_dim: int = D):
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(1, S, H, D, generator=gen, dtype=torch.float64)
    k = 2 * torch.randn(1, S, HKV, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, S, HKV, value_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, S, H, value_dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def assert_exact(got, want) -> None:
    for name, g, w in zip(NAMES, got, want):
        assert g is not None, f"{name} missing"
        err = (g - w).abs().max().item()
        assert err <= 1e-10, f"{name}: max abs error {err:.3e}"


CASES = [
    (balance, variant, world, causal)
    for (balance, variant), world, causal in zip(
        itertools.product(BALANCES, VARIANTS), itertools.cycle((2, 3, 4)), itertools.cycle((True, True, False))
    )
]


@pytest.mark.parametrize("balance, variant, world, causal", CASES)
def test_float64_ring_with_a_variant_matches_the_reference(balance, variant, world, causal):
    q, k, v, dout = inputs(world * 10 + len(variant))
    options = VARIANTS[variant]
    documents_ = balance == "document_zigzag"
    cu = CU if documents_ else (0, S)
    want = independent_masked_reference(q, k, v, dout, cu, causal, **options)
    extra = {"cu_seqlens": torch.tensor(CU)} if documents_ else {}
    got = run_sharded(q, k, v, dout, world, balance=balance, causal=causal, **options, **extra)
    assert_exact(got, want)


@pytest.mark.parametrize("balance, world, ulysses", [("zigzag", 4, 2), ("stripe", 2, 2), ("document_zigzag", 4, 2)])
def test_every_variant_at_once_with_sinks_a_window_documents_gqa_and_values_of_another_dim(balance, world, ulysses):
    q, k, v, dout = inputs(7, value_dim=D + 3)
    sinks = torch.randn(H, dtype=torch.float64)
    options = dict(softcap=2.0, alibi_slopes=SLOPES, chunk=7, window=(5, 0))
    want = independent_masked_reference(q, k, v, dout, CU, True, sinks=sinks, **options)
    got = run_sharded(q, k, v, dout, world, balance=balance, ulysses=ulysses, sinks=sinks, causal=True,
                      cu_seqlens=torch.tensor(CU), **options)  # fmt: skip
    assert_exact(got, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_world_of_one_runs_each_variant(variant):
    q, k, v, dout = inputs(3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = xcp.attention(*leaves, causal=True, **VARIANTS[variant])
    out.backward(dout)
    want = independent_masked_reference(q, k, v, dout, (0, S), True, **VARIANTS[variant])
    assert_exact([out.detach(), *(x.grad for x in leaves)], want)


def test_each_variant_changes_the_result():
    """The reference with a variant differs from the one without: the tests above can fail."""
    q, k, v, dout = inputs(5)
    plain = independent_masked_reference(q, k, v, dout, (0, S), True)[0]
    for options in VARIANTS.values():
        assert (independent_masked_reference(q, k, v, dout, (0, S), True, **options)[0] - plain).abs().max() > 1e-2


@pytest.mark.parametrize("balance, world, causal", [("document_zigzag", 3, True), ("stripe", 4, True),
                                                    ("zigzag", 2, False), ("contiguous", 4, True)])  # fmt: skip
@pytest.mark.parametrize("chunk", [1, 4, 5, 11, 40])
def test_the_chunked_plan_computes_each_allowed_pair_once(balance, world, causal, chunk):
    cu = (0, 9, 10, 26) if balance == "document_zigzag" else (0, 24)
    plans = [documents.document_plan(cu, world, r, causal, balance, None, chunk) for r in range(world)]
    for rank, plan in enumerate(plans):
        for i in range(world):
            want = allowed_pairs(cu, world, rank, (rank - i) % world, balance, causal, chunk=chunk)
            got = pairs_of_runs(plan.steps[i]) if i < len(plan.steps) else []
            assert len(got) == len(set(got)) and set(got) == want, (rank, i)
    if chunk == 1 and causal:
        assert len(plans[0].steps) == 1, "chunks of one token need no step beyond the own shard"


@pytest.mark.parametrize("causal", [True, False])
def test_chunks_of_one_token_are_accepted_and_each_query_sees_its_own_key(causal):
    """chunk=1, the smallest chunk: every query sees its own key alone, so each head's output is its value."""
    q, k, v, _ = inputs(1)
    out = xcp.attention(q, k, v, causal=causal, chunk=1)
    assert torch.equal(out, v.repeat_interleave(H // HKV, dim=2))


def test_choose_balance_weighs_the_chunks():
    """Chunks aligned with contiguous shards need no exchange (one step), a chunk over two shards two steps,
    where zigzag runs all P: contiguous is chosen (as for a window); without a chunk, zigzag."""
    assert xcp.choose_balance(8, causal=True, chunk=1024, seq_len=8192) == "contiguous"
    assert len(documents.document_plan((0, 8192), 8, 3, True, "contiguous", None, 1024).steps) == 1
    assert len(documents.document_plan((0, 8192), 8, 3, True, "contiguous", None, 1536).steps) == 2
    assert len(documents.document_plan((0, 8192), 8, 3, True, "zigzag", None, 1024).steps) == 8
    assert xcp.choose_balance(8, causal=True, seq_len=8192) == "zigzag"
    with pytest.raises(ValueError, match="chunk: expected a positive int"):
        xcp.choose_balance(8, causal=True, chunk=0, seq_len=8192)


BAD = [
    ({"softcap": -1.0}, ValueError, "softcap: expected a positive finite float or None; got -1.0"),
    ({"softcap": 0}, ValueError, "softcap: expected a positive finite float or None; got 0"),
    ({"softcap": float("inf")}, ValueError, "softcap: expected a positive finite float or None; got inf"),
    ({"softcap": True}, ValueError, "softcap: expected a positive finite float or None; got True"),
    ({"softcap": "30"}, ValueError, "softcap: expected a positive finite float or None; got '30'"),
    ({"alibi_slopes": [0.5] * H}, TypeError, "alibi_slopes: expected a float tensor \\[heads\\] or None; got list"),
    ({"alibi_slopes": torch.ones(HKV)}, ValueError, r"alibi_slopes: expected shape \(4,\) \(one slope per"),
    ({"alibi_slopes": torch.ones(1, H)}, ValueError, r"alibi_slopes: expected shape \(4,\)"),
    ({"alibi_slopes": torch.ones(H, dtype=torch.int64)}, TypeError, "alibi_slopes: expected a floating-point dtype"),
    ({"alibi_slopes": torch.ones(H, device="meta")}, ValueError, "alibi_slopes: expected device cpu"),
    ({"alibi_slopes": torch.ones(H).requires_grad_()}, ValueError, "alibi_slopes: expected a tensor that does not"),
    ({"chunk": 0}, ValueError, "chunk: expected a positive int"),
    ({"chunk": 2.0}, TypeError, r"chunk: expected a positive int \(tokens per chunk\) or None; got 2.0 \(float\)"),
    ({"chunk": True}, TypeError, "chunk: expected a positive int"),
]  # fmt: skip


@pytest.mark.parametrize("options, error, message", BAD)
def test_a_bad_variant_argument_is_named(options, error, message):
    q, k, v, _ = inputs(0)
    with pytest.raises(error, match=message):
        xcp.attention(q, k, v, causal=True, **options)


class NoModsBackend(CPUBackend):
    """The CPU backend without score modifications, as a fused backend (CUDA's flash op today) is."""

    name = "no-mods"
    score_mods = ()

    def forward(self, *args, **kwargs):
        raise AssertionError("a kernel ran")


@pytest.mark.parametrize("options, named", [({"softcap": 30.0}, "softcap"), ({"alibi_slopes": SLOPES}, "alibi_slopes")])
def test_a_backend_without_the_modification_refuses_it_before_any_kernel_runs(options, named):
    q, k, v, _ = inputs(0)
    with installed(NoModsBackend()):
        with pytest.raises(NotImplementedError, match=f"{named}: not supported by backend 'no-mods'"):
            xcp.attention(q, k, v, causal=True, device="no-mods", **options)
        cache = xcp.KVCache(device="no-mods")
        cache.prefill(k, v)
        with pytest.raises(NotImplementedError, match=f"{named}: not supported by backend 'no-mods'"):
            cache.attention(q[:, -1:], **options)


class IgnoresSoftcap(CPUBackend):
    """Declares soft-capping and leaves it out: what the conformance suite must catch."""

    name = "ignores-softcap"

    def forward(self, q, k, v, mask, scale, **mods):
        mods.pop("softcap", None)
        return super().forward(q, k, v, mask, scale, **mods)


def test_the_conformance_suite_checks_a_declared_modification():
    good = [c for c in conformance.cases(CPUBackend()) if c.id.startswith(("softcap-float64", "alibi-float64"))]
    assert {c.id for c in good} == {"softcap-float64", "alibi-float64"}
    for case in good:
        case.run(CPUBackend())
    (case,) = [c for c in conformance.cases(IgnoresSoftcap()) if c.id == "softcap-float64"]
    with pytest.raises(AssertionError, match=r"forward out \(softcap\)"):
        case.run(IgnoresSoftcap())


def test_ranks_that_differ_in_a_variant_are_told_which():
    q, k, v, _ = inputs(0)

    def body(group):
        r = group.rank()
        local = [xcp.shard(x, 2, r) for x in (q, k, v)]
        try:
            xcp.attention(*local, group=group, causal=True, softcap=30.0 if r == 0 else 50.0)
        except ValueError as exc:
            return str(exc)
        return None

    for message in xcp.LocalWorld(2, timeout=20).run(body):
        assert message is not None and "softcap (rank 0: 30.0; rank 1: 50.0)" in message


def test_ranks_of_the_hybrid_that_differ_in_their_slopes_are_told_which():
    """Under ulysses=U the slopes reach the agreement beside the call's spec: rank 1 passing them in another
    dtype is named, on every rank, before any head group exchanges."""
    q, k, v, _ = inputs(0)
    slopes = torch.linspace(0.1, 0.5, q.shape[2])

    def body(group):
        r = group.rank()
        local = [xcp.shard(x, 2, r, ulysses=2) for x in (q, k, v)]
        mine = slopes if r == 0 else slopes.double()
        try:
            xcp.attention(*local, group=group, causal=True, ulysses=2, alibi_slopes=mine)
        except ValueError as exc:
            return str(exc)
        return None

    for message in xcp.LocalWorld(2, timeout=20).run(body):
        assert (
            message is not None and "alibi_slopes (rank 0: '[4] torch.float32'; rank 1: '[4] torch.float64')" in message
        )


# ------------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize(
    "variant, world, balance, capacity, causal",
    [
        ("softcap", 2, "zigzag", None, True),
        ("alibi", 3, "stripe", 40, True),
        ("alibi", 2, "contiguous", None, False),
        ("chunk", 3, "zigzag", None, True),
        ("chunk", 2, "stripe", 40, True),
        ("chunk", 2, "contiguous", None, False),
        ("all", 3, "contiguous", 40, True),
    ],
)
def test_a_kv_cache_with_a_variant_matches_the_reference(variant, world, balance, capacity, causal):
    """Prefill, a chunk of 5, then decode steps (a capacity cache's run on the device's counters): every
    attention call's output against the reference's rows of the same queries over the cache's tokens."""
    options = dict(softcap=1.5, alibi_slopes=SLOPES, chunk=5) if variant == "all" else VARIANTS[variant]
    gen = torch.Generator().manual_seed(world)
    total = 24
    q, k, v = (2 * torch.randn(1, total, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    prompt = 12

    def body(group):
        r = group.rank()
        cache = xcp.KVCache(group, balance, capacity)
        cache.prefill(*(xcp.shard(x[:, :prompt], world, r, balance=balance) for x in (k, v)))
        outs = [cache.attention(q[:, prompt - 4 : prompt], causal=causal, **options)]
        cache.append(k[:, prompt : prompt + 5], v[:, prompt : prompt + 5])
        outs.append(cache.attention(q[:, prompt : prompt + 5], causal=causal, **options))
        for n in range(prompt + 5, prompt + 9):
            cache.append(k[:, n : n + 1], v[:, n : n + 1])
            outs.append(cache.attention(q[:, n : n + 1], causal=causal, **options))
        return outs

    per_rank = xcp.LocalWorld(world, timeout=30).run(body)
    ends = [(prompt, 4), (prompt + 5, 5), *((n + 1, 1) for n in range(prompt + 5, prompt + 9))]
    for i, (n, t) in enumerate(ends):
        zeros = torch.zeros(1, n, H, D, dtype=torch.float64)
        want = independent_masked_reference(q[:, :n], k[:, :n], v[:, :n], zeros, (0, n), causal, **options)[0]
        for r, outs in enumerate(per_rank):
            err = (outs[i] - want[:, n - t : n]).abs().max().item()
            assert err <= 1e-10, f"call {i} (cache of {n} tokens, {t} queries), rank {r}: error {err:.3e}"


# ------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_refuses_score_modifications_and_runs_chunks():
    """The CUDA backend declares no score modification (the aten flash/cuDNN ops have no soft-cap, and ALiBi
    needs position vectors): a call with one is refused before any kernel runs, in the ring and in a KV
    cache; chunked attention needs nothing of the backend and matches the reference on 2 virtual ranks."""
    q, k, v, dout = (x.cuda() for x in inputs(4))
    for options, named in (({"softcap": 30.0}, "softcap"), ({"alibi_slopes": SLOPES.cuda()}, "alibi_slopes")):
        with pytest.raises(NotImplementedError, match=f"{named}: not supported by backend 'cuda'"):
            xcp.attention(q, k, v, causal=True, **options)
        cache = xcp.KVCache()
        cache.prefill(k, v)
        with pytest.raises(NotImplementedError, match=f"{named}: not supported by backend 'cuda'"):
            cache.attention(q[:, -1:], **options)

    def rank(group):
        r = group.rank()
        local = [xcp.shard(x, 2, r, balance="stripe") for x in (q, k, v)]
        return xcp.attention(*local, group=group, causal=True, balance="stripe", chunk=5)

    out = xcp.unshard(xcp.LocalWorld(2).run(rank), balance="stripe")
    want = independent_masked_reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), (0, S), True, chunk=5)[0]
    assert (out.cpu() - want).abs().max().item() <= 1e-10
