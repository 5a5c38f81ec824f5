"""Serving: xcp.serving.local_lengths, xcp.combine and xcp.testing.check_combine, xcp.PagedKVCache.

The paged cache runs random workloads over virtual ranks — sequences joining and leaving, chunks of a
chunked prefill beside other sequences' decode steps — and every step's output on every rank is checked
against the tests' float64 attention over each sequence's whole history (no xcp code).
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch
from helpers import independent_masked_reference

import xcp
from xcp.comm import LocalWorld, resolve_group
from xcp.plugins import select_backend
from xcp.serving import local_lengths
from xcp.testing import check_combine


# ---------------------------------------------------------------------- local_lengths
@pytest.mark.parametrize("world,interleave", [(1, 1), (3, 1), (4, 2), (2, 5)])
def test_local_lengths_count_the_positions_each_rank_holds(world, interleave):
    lengths = torch.tensor([[0, 1, 2, 7], [8, 15, 16, 101]])
    for r in range(world):
        got = local_lengths(lengths, world, r, interleave)
        want = [[sum((p // interleave) % world == r for p in range(n)) for n in row] for row in lengths.tolist()]
        assert got.tolist() == want and got.dtype == lengths.dtype and got.shape == lengths.shape


def test_local_lengths_refuse_bad_arguments():
    with pytest.raises(ValueError, match="rank: expected an integer in \\[0, 2\\)"):
        local_lengths(torch.tensor([3]), 2, 2)
    with pytest.raises(ValueError, match="interleave: expected an integer >= 1; got 0"):
        local_lengths(torch.tensor([3]), 2, 0, interleave=0)
    with pytest.raises(TypeError, match="seq_lens: expected an integer tensor; got dtype torch.float32"):
        local_lengths(torch.tensor([3.0]), 2, 0)


# ---------------------------------------------------------------------- combine and check_combine
def test_combine_passes_its_own_property_suite():
    check_combine(xcp.combine, max_examples=30)


def _naive_combine(out, lse, group=None, *, lse_base="e", handoff=None, timeout=None):
    """A combine as public engines first wrote theirs: the weights exp(L_r - L) times every rank's out, with no
    mask for the ranks that saw nothing (0 x NaN) and nothing for rows no rank saw (-inf - -inf)."""
    comm = resolve_group(group)
    backend = select_backend(None, "cpu")
    p = comm.size()
    lse = lse.double() * (math.log(2.0) if lse_base == "2" else 1.0)
    outs = torch.empty((p, *out.shape), dtype=torch.float64)
    lses = torch.empty((p, *lse.shape), dtype=torch.float64)
    comm.all_gather(out.double().contiguous(), outs, "combine", backend).wait()
    comm.all_gather(lse.contiguous(), lses, "combine", backend).wait()
    merged = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - merged).transpose(-1, -2).unsqueeze(-1)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (weights * outs).sum(0).to(out.dtype), merged.to(acc)


def _base_blind(out, lse, group=None, *, lse_base="e", handoff=None, timeout=None):
    """xcp's combine told every lse is natural: a base-2 lse merged as natural."""
    return xcp.combine(out, lse, group, handoff=handoff, timeout=timeout)


@pytest.mark.parametrize("broken,why", [(_naive_combine, "NaN"), (_base_blind, "lse off by")])
def test_check_combine_catches_broken_combines(broken, why):
    with pytest.raises(AssertionError, match=why) as caught:
        check_combine(broken, max_examples=60, shrink=False)
    assert "Case(world=" in str(caught.value)  # the counterexample


def test_combine_ragged_lead_dims_bf16_and_errors():
    """[B1, B2, S, H, Dv] 16-bit partials over 3 ranks, one rank NaN where it saw nothing, merged to the float64
    merge; the inputs are not changed; bad shapes and bases are refused by name."""
    g = torch.Generator().manual_seed(1)
    outs = [torch.randn(2, 3, 4, 2, 8, generator=g).bfloat16() for _ in range(3)]
    lses = [torch.randn(2, 3, 2, 4, generator=g) for _ in range(3)]
    lses[1][0, 0] = -math.inf
    outs[1][0, 0] = math.nan
    lses[2] = lses[2] / math.log(2.0)
    kept = [outs[0].clone(), lses[0].clone()]

    def rank(group):  # rank 2 passes its lse in base 2 (the conversion is each rank's own)
        r = group.rank()
        return xcp.combine(outs[r], lses[r], group, lse_base="2" if r == 2 else "e")

    with LocalWorld(3) as w:
        results = w.run(rank)
    lses_e = [lses[0].double(), lses[1].double(), lses[2].double() * math.log(2.0)]
    stacked = torch.stack(lses_e)
    merged = torch.logsumexp(stacked, 0)
    weights = torch.exp(stacked - merged).transpose(-1, -2).unsqueeze(-1)
    want = (weights * torch.stack([o.double().nan_to_num() for o in outs])).sum(0)
    for out, lse in results:
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse.double(), merged, atol=1e-5, rtol=1e-5)
    assert torch.equal(kept[0], outs[0]) and torch.equal(kept[1], lses[0])
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 3, 2, 4\)"):
        xcp.combine(outs[0], lses[0].transpose(-1, -2))
    with pytest.raises(ValueError, match="lse_base: expected one of 'e', '2'; got 'ten'"):
        xcp.combine(outs[0], lses[0], lse_base="ten")


# ---------------------------------------------------------------------- PagedKVCache
H, HKV, D = 4, 2, 8


def _reference_rows(q, k, v, length: int, t: int, causal: bool, window, sinks, variants=None):
    """Rows ``length - t .. length - 1`` of the float64 attention of one sequence's first ``length`` tokens
    (no xcp code), and their lse [H, t] (sink included; plain attention only: ``variants`` None)."""
    qs, ks, vs = (x[None, :length] for x in (q, k, v))
    out = independent_masked_reference(qs, ks, vs, torch.zeros_like(qs[..., : vs.shape[-1]]), (0, length), causal,
                                       sinks, window=window, **(variants or {}))[0][0, length - t :]  # fmt: skip
    i = torch.arange(length - t, length)[:, None]
    j = torch.arange(length)[None]
    allowed = torch.ones(t, length, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= i - left
        if right is not None:
            allowed &= j <= i + right
    keys = k[:length].double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.einsum("thd,shd->hts", q[length - t : length].double(), keys) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, -1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double()[:, None])
    return out, lse


def _rows(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The pieces one after the other along dim 0 (a step may have none)."""
    return torch.cat(pieces) if pieces else like[:0]


def _workload(seed: int, steps: int):
    """Steps of (append batch, attention batch): each step some sequences start (a first chunk), some running
    ones decode one token, some take another chunk of their prompt, and some leave (freed after the step)."""
    rng = random.Random(seed)
    lengths: dict[int, int] = {}
    next_id, plan = 0, []
    for _ in range(steps):
        batch = []
        for sid in list(lengths):
            if rng.random() < 0.8:
                batch.append((sid, 1 if rng.random() < 0.6 else rng.randint(2, 9)))
        for _ in range(rng.randint(0 if lengths else 1, 2)):
            batch.append((next_id, rng.randint(1, 23)))
            next_id += 1
        rng.shuffle(batch)
        leaving = [sid for sid in lengths if rng.random() < 0.2]
        for sid, t in batch:
            lengths[sid] = lengths.get(sid, 0) + t
        plan.append((batch, leaving))
        for sid in leaving:
            del lengths[sid]
    return plan, next_id


def _run_paged(world, *, interleave=1, causal=True, window=None, sinks=False, hkv=HKV, dv=D, values_in_keys=None,
               seed=0, steps=6, block_size=4, num_blocks=64, dtype=torch.float64, return_lse=False,
               variants=None):  # fmt: skip
    plan, n_ids = _workload(seed, steps)
    g = torch.Generator().manual_seed(seed)
    total = 200
    qs = [torch.randn(total, H, D, generator=g, dtype=torch.float64) for _ in range(n_ids)]
    ks = [torch.randn(total, hkv, D, generator=g, dtype=torch.float64) for _ in range(n_ids)]
    vs = [k[..., :values_in_keys] if values_in_keys else torch.randn(total, hkv, dv, generator=g, dtype=torch.float64)
          for k in ks]  # fmt: skip
    sink = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=num_blocks, block_size=block_size, interleave=interleave,
                                 values_in_keys=values_in_keys)  # fmt: skip
        lengths: dict[int, int] = {}
        outs = []
        for batch, leaving in plan:
            ids = [sid for sid, _ in batch]
            cu = [0]
            for _, t in batch:
                cu.append(cu[-1] + t)
            spans = [(lengths.get(sid, 0), lengths.get(sid, 0) + t) for sid, t in batch]
            k = _rows([ks[sid][a:b] for sid, (a, b) in zip(ids, spans)], ks[0]).to(dtype)
            v = None if values_in_keys else _rows([vs[sid][a:b] for sid, (a, b) in zip(ids, spans)], vs[0]).to(dtype)
            cache.append(ids, k, v, torch.tensor(cu))
            for sid, (_, b) in zip(ids, spans):
                lengths[sid] = b
                assert cache.seq_len(sid) == b
                assert cache.local_len(sid) == local_lengths(torch.tensor(b), world, group.rank(), interleave).item()
            q = _rows([qs[sid][a:b] for sid, (a, b) in zip(ids, spans)], qs[0]).to(dtype)
            sinks_now = None if sink is None else sink.to(dtype)
            out = cache.attention(q, ids, cu, causal=causal, window=window, sinks=sinks_now, return_lse=return_lse,
                                  **(variants or {}))  # fmt: skip
            outs.append(out)
            for sid in leaving:
                cache.free(sid)
                del lengths[sid]
        held = sum(-(-cache.local_len(s) // block_size) for s in cache.seq_ids())
        return outs, cache.free_blocks, held, cache.num_blocks

    with LocalWorld(world) as w:
        results = w.run(rank)
    wants, lengths = [], {}
    for batch, leaving in plan:
        rows, lses = [], []
        for sid, t in batch:
            lengths[sid] = lengths.get(sid, 0) + t
            out, lse = _reference_rows(qs[sid], ks[sid], vs[sid], lengths[sid], t, causal, window, sink, variants)
            rows.append(out)
            lses.append(lse)
        wants.append(
            (
                _rows(rows, vs[0][:0, :1].expand(0, H, -1)),
                torch.cat([torch.empty(H, 0, dtype=torch.float64), *lses], dim=1),
            )
        )
        for sid in leaving:
            del lengths[sid]
    return results, wants


def _assert_paged(results, wants, tol=1e-10, return_lse=False):
    first = results[0][0]
    for outs, free, held, num_blocks in results:
        assert free + held == num_blocks  # every block is a sequence's or free
        for step, (got, (want, want_lse)) in enumerate(zip(outs, wants)):
            out = got[0] if return_lse else got
            torch.testing.assert_close(out.double(), want, atol=tol, rtol=0, msg=f"step {step}")
            if return_lse:
                torch.testing.assert_close(got[1].double(), want_lse, atol=tol, rtol=0, msg=f"lse, step {step}")
        for a, b in zip(outs, first):
            assert torch.equal(a[0] if return_lse else a, b[0] if return_lse else b)  # the same on every rank


@pytest.mark.parametrize(
    "world,options",
    [
        (1, {}),
        (3, {}),
        (3, {"interleave": 2, "sinks": True, "return_lse": True}),
        (2, {"window": (5, 0), "hkv": 1}),
        (4, {"causal": False, "window": (3, 2), "dv": 6, "block_size": 3}),
        (3, {"values_in_keys": 5, "interleave": 3, "sinks": True}),
        (
            3,
            {
                "interleave": 2,
                "variants": {"softcap": 1.5, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=torch.float64)},
            },
        ),
        (2, {"variants": {"chunk": 5}, "window": (6, 0)}),
    ],
)
def test_paged_cache_matches_float64_over_a_changing_batch(world, options):
    results, wants = _run_paged(world, seed=world, **options)
    _assert_paged(results, wants, return_lse=options.get("return_lse", False))


@pytest.mark.parametrize(
    "world,options,pages,gathers",
    [
        (3, {}, True, False),
        (2, {"interleave": 2, "window": (5, 0)}, True, True),
        (2, {"causal": False, "window": (60, 2)}, True, False),
        (2, {"variants": {"softcap": 1.5}}, False, True),
    ],
)
def test_a_backend_that_reads_the_pool_in_place_gets_every_prefix_call_and_no_block_is_copied(
    monkeypatch, world, options, pages, gathers
):
    """With ``paged_in_place`` the decode rows and the chunks' prefix groups go to ONE ``forward_paged`` call per
    step (here the base class's, the math over the table): exact, and with interleave 1 and no window no
    sequence's rows are gathered on the host path at all; the windowed calls keep the gathered path (a band
    goes to the paged call only where it is causal from row 0; a window open to the right over the whole
    prefix is a prefix per row), and a softcap keeps every call there (forward_paged serves no softcap)."""
    from xcp.backends.cpu import CPUBackend
    from xcp.inference.paged import PagedKVCache

    calls = {"paged": 0, "gathered": 0}
    paged, rows = CPUBackend.forward_paged, PagedKVCache._rows
    pools = set()

    def counted_paged(self, q, k_pool, *args, **kwargs):
        calls["paged"] += 1
        pools.add(k_pool.shape[0])
        return paged(self, q, k_pool, *args, **kwargs)

    def counted_rows(self, seq):
        calls["gathered"] += 1
        return rows(self, seq)

    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v: True)
    monkeypatch.setattr(CPUBackend, "forward_paged", counted_paged)
    monkeypatch.setattr(PagedKVCache, "_rows", counted_rows)
    results, wants = _run_paged(world, seed=11, **options)
    _assert_paged(results, wants)
    assert (calls["paged"] > 0) == pages
    assert (calls["gathered"] > 0) == gathers
    assert pools == ({64 + 1} if pages else set())  # the pool the kernel reads: num_blocks and the sink block


@pytest.mark.parametrize("world", [1, 2])
def test_a_backend_that_reads_only_decode_calls_in_place_gets_the_one_query_calls(monkeypatch, world):
    """A backend whose ``paged_in_place`` is False for every call and True for ``max_q=1`` (CUDA's Triton paged
    decode on torch 2.11 or blocks of 16): the one-query calls (decode rows) go to ``forward_paged`` with max_q 1,
    the chunks' calls are gathered per sequence; exact. One whose ``paged_in_place`` takes no ``max_q`` is asked for
    every call only (here False: everything gathered, nothing paged)."""
    from xcp.backends.cpu import CPUBackend
    from xcp.inference.paged import PagedKVCache

    calls = {"paged": [], "gathered": 0}
    paged, rows = CPUBackend.forward_paged, PagedKVCache._rows

    def counted_paged(self, q, k_pool, v_pool, table, cu_q, used, max_q, *args, **kwargs):
        calls["paged"].append(max_q)
        return paged(self, q, k_pool, v_pool, table, cu_q, used, max_q, *args, **kwargs)

    def counted_rows(self, seq):
        calls["gathered"] += 1
        return rows(self, seq)

    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v, max_q=None: max_q == 1)
    monkeypatch.setattr(CPUBackend, "forward_paged", counted_paged)
    monkeypatch.setattr(PagedKVCache, "_rows", counted_rows)
    results, wants = _run_paged(world, seed=11)
    _assert_paged(results, wants)
    assert calls["paged"] and set(calls["paged"]) == {1} and calls["gathered"] > 0
    calls["paged"], calls["gathered"] = [], 0
    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v: False)
    results, wants = _run_paged(world, seed=11)
    _assert_paged(results, wants)
    assert not calls["paged"] and calls["gathered"] > 0


def test_a_chunk_one_query_calls_go_to_a_decode_only_paged_kernel_too(monkeypatch):
    """Over two ranks, the last 3 of 5 tokens as queries: on each rank the plan ends with a call of the last row
    alone from key row 0 (rank 0: rows 0-1 see positions 0 and 2, row 2 also 4; rank 1: row 0 sees 1, rows 1-2
    see 1 and 3). A backend that reads only one-query calls in place gets that call (query row 2, max_q 1);
    the rest is gathered; exact against the gathered path."""
    from xcp.backends.cpu import CPUBackend

    seen = []
    paged = CPUBackend.forward_paged

    def counted_paged(self, q, k_pool, v_pool, table, cu_q, used, max_q, *args, **kwargs):
        seen.append((q.shape[0], cu_q.tolist(), max_q))
        return paged(self, q, k_pool, v_pool, table, cu_q, used, max_q, *args, **kwargs)

    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(5, n, D, generator=g, dtype=torch.float64) for n in (HKV, HKV, H))

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=4, block_size=2)
        cache.append(["a"], k, v, [0, 5])
        return cache.attention(q[2:], ["a"], [0, 3])

    with LocalWorld(2) as w:
        want = w.run(rank)[0]
    monkeypatch.setattr(CPUBackend, "paged_in_place", lambda self, q, k, v, max_q=None: max_q == 1)
    monkeypatch.setattr(CPUBackend, "forward_paged", counted_paged)
    with LocalWorld(2) as w:
        got = w.run(rank)
    assert seen == [(1, [0, 1], 1)] * 2  # one paged call on each rank: the last row alone
    for out in got:
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_a_call_goes_to_the_paged_kernel_only_under_the_mask_it_computes():
    """``_paged_mask`` against brute force over every small call from key row 0: where it sends a call to
    forward_paged without a mask (False) the call's pairs are all of them, where causal bottom-right (True)
    exactly those; and a band ``(left, 0)`` reaching key 0 from every query is always sent (causal)."""
    from xcp.documents import Run
    from xcp.inference.paged import _paged_mask

    for sq in range(1, 5):
        for sk in range(1, 8):
            off = sk - sq
            everything = {(m, j) for m in range(sq) for j in range(sk)}
            bottom_right = {(m, j) for m, j in everything if j <= m + off}
            calls = [(False, None, everything)] + ([(True, None, bottom_right)] if sq == sk else [])
            for left in range(sk + sq + 1):
                for right in range(sk + sq + 1):
                    pairs = {(m, j) for m, j in everything if m + off - left <= j <= m + off + right}
                    calls.append((False, (left, right), pairs))
            for causal, band, pairs in calls:
                mask = _paged_mask(Run(0, sq, 0, sk, causal, (0, sq), (0, sk), band))
                if mask is not None:
                    assert pairs == (bottom_right if mask else everything), (sq, sk, causal, band, mask)
                if band is not None and band[1] == 0 and band[0] >= sk - 1:
                    assert mask is True, (sq, sk, band)
    assert _paged_mask(Run(0, 2, 1, 3, False, (0, 2), (0, 2))) is None  # not from key row 0
    assert _paged_mask(Run(0, 2, 0, 2, False, (0, 1, 2), (0, 1, 2))) is None  # two segments


def test_paged_cache_bf16_matches_float64():
    results, wants = _run_paged(3, dtype=torch.bfloat16, seed=5, interleave=2)
    _assert_paged(results, wants, tol=3e-2)


def test_a_step_the_pool_cannot_hold_is_refused_on_every_rank_and_writes_nothing():
    """Rank 0 holds more of a sequence than the others (3 ranks, 7 tokens: 3, 2, 2): with 2 blocks of 2 a rank,
    the step fits ranks 1 and 2 and not rank 0, and every rank says so; the cache is then exactly as before."""
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(10, HKV if i < 2 else H, D, generator=g, dtype=torch.float64) for i in range(3))

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=2, block_size=2)
        cache.append(["a"], k[:2], v[:2], [0, 2])
        before = (cache.free_blocks, cache.seq_len("a"), cache.local_len("a"), cache.block_table("a"))
        with pytest.raises(ValueError) as caught:
            cache.append(["a", "b"], k[2:10], v[2:10], [0, 1, 8])
        after = (cache.free_blocks, cache.seq_len("a"), cache.local_len("a"), cache.block_table("a"))
        out = cache.attention(q[1:2], ["a"], [0, 1])
        assert "b" not in cache.seq_ids()
        return str(caught.value), before == after, out

    with LocalWorld(3) as w:
        results = w.run(rank)
    want, _ = _reference_rows(q, k, v, 2, 1, True, None, None)
    for message, unchanged, out in results:
        assert message.startswith("num_blocks: expected a pool that holds the step (PagedKVCache(num_blocks=2,")
        assert "rank 0 needing 2 more blocks with 1 free" in message
        assert unchanged
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_paged_cache_errors_name_the_argument():
    cache = xcp.PagedKVCache(num_blocks=4, block_size=2)
    k = torch.randn(3, HKV, D)
    with pytest.raises(ValueError, match="q: expected a cache that holds tokens"):
        cache.attention(torch.randn(1, H, D), ["a"], [0, 1])
    cache.append(["a"], k, k, [0, 3])
    with pytest.raises(KeyError, match="seq_id: expected a sequence the cache holds; got 'zz'"):
        cache.attention(torch.randn(1, H, D), ["zz"], [0, 1])
    with pytest.raises(ValueError, match="seq_ids: expected distinct ids; got 'a' more than once"):
        cache.append(["a", "a"], k, k, [0, 1, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens: expected the last offset to be k.shape\[0\] = 3; got 2"):
        cache.append(["a"], k, k, [0, 2])
    with pytest.raises(ValueError, match=r"cu_seqlens: expected len\(seq_ids\) \+ 1 = 2 offsets; got 3"):
        cache.append(["a"], k, k, [0, 1, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens: expected at most seq_len\('a'\) = 3 queries"):
        cache.attention(torch.randn(4, H, D), ["a"], [0, 4])
    with pytest.raises(ValueError, match="k: expected 3 dims"):
        cache.append(["a"], k[None], k[None], [0, 3])
    with pytest.raises(TypeError, match="k: expected dtype torch.float32"):
        cache.append(["a"], k.double(), k.double(), [0, 3])
    with pytest.raises(ValueError, match="num_blocks: expected a positive integer; got 0"):
        xcp.PagedKVCache(num_blocks=0)
    with pytest.raises(KeyError, match="seq_id"):
        cache.free("zz")
    cache.free("a")
    assert cache.free_blocks == 4 and cache.seq_ids() == []


def test_a_paged_step_is_not_captured(monkeypatch):
    from xcp.backends.cpu import CPUBackend

    cache = xcp.PagedKVCache(num_blocks=4, block_size=2)
    k = torch.randn(3, HKV, D)
    cache.append(["a"], k, k, [0, 3])
    monkeypatch.setattr(CPUBackend, "is_capturing", lambda self: True)
    with pytest.raises(RuntimeError, match="append: expected no device-graph capture"):
        cache.append(["a"], k[:1], k[:1], [0, 1])
    with pytest.raises(RuntimeError, match="attention: expected no device-graph capture"):
        cache.attention(torch.randn(1, H, D), ["a"], [0, 1])
    assert cache.seq_len("a") == 3


# ---------------------------------------------------------------------- the tools
def test_sanitize_serve_is_clean_and_catches_a_dropped_hand_off_and_a_block_freed_early(monkeypatch):
    """Requests arriving, prefilling in chunks, decoding and leaving on the simulated device: clean and exact
    with the hand-off; without it the all-gather's read of the packed partial races its write; a free that
    gives a request's blocks back while the request still holds them is found by the pool's audit."""
    from xcp.inference.paged import PagedKVCache
    from xcp.lifetime import RingCall
    from xcp.testing.serve_sanitizer import sanitize_serve

    report = sanitize_serve(requests=4, world=3, interleave=2)
    assert report.ok, report.format()
    assert report.max_error["out"] < 1e-12
    with monkeypatch.context() as m:
        m.setattr(RingCall, "hand_to_comm", lambda self, tensors, channel, ordered=False: list(tensors))
        report = sanitize_serve(requests=4, world=3)
    races = [f for f in report.findings if f.kind == "race"]
    assert any(any("p2p combine" in a.op for a in f.accesses) for f in races), report.format()

    def early(self, seq_id):  # the blocks go back, the request keeps them (and is never forgotten)
        self._free.extend(self._seqs[seq_id].blocks)

    monkeypatch.setattr(PagedKVCache, "free", early)
    report = sanitize_serve(requests=4, world=3)
    assert {"reuse", "leak"} <= report.kinds(), report.format()
    assert any("is free and in the table of" in f.message or "tables of" in f.message for f in report.findings)


def test_serve_commands(capsys):
    from xcp.cli import main

    flags = ["--world", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
    assert main(["run", "--serve", "3", *flags, "--interleave", "2", "--block-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "xcp run: serve 3 requests" in out and out.rstrip().endswith("PASS") and "FAIL" not in out
    assert main(["plan", "--serve", "3", *flags, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "blocks per rank" in out and "sends" in out
    assert main(["plan", "--serve", "--world", "2"]) == 0  # N alone: 8 requests
    assert "serve 8 requests" in capsys.readouterr().out
    assert main(["sanitize", "--serve", "3", "--world", "2"]) == 0
    assert "no finding" in capsys.readouterr().out
    assert main(["run", "--block-size", "3"]) == 2
    assert "--block-size: expected only with --serve; got 3 without it" in capsys.readouterr().err


def test_one_collective_per_attention_call_once_the_ranks_agreed(monkeypatch):
    """After the first call (the agreement's check), every attention call of a changing batch makes exactly one
    collective: the all-gather of the packed partials; and ranks that pass different batches are refused."""
    from xcp.comm.local import LocalGroup

    calls: dict[int, list[str]] = {0: [], 1: []}
    inside = threading.local()  # a collective made by another (all_gather's own exchange) is not counted

    def counted(name, original):
        def call(self, *a, **kw):
            if not getattr(inside, "depth", 0):
                calls[self.rank()].append(name)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(self, *a, **kw)
            finally:
                inside.depth -= 1

        return call

    for name in ("all_gather", "exchange", "all_to_all"):
        monkeypatch.setattr(LocalGroup, name, counted(name, getattr(LocalGroup, name)))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(12, HKV, D, generator=g, dtype=torch.float64)
    q = torch.randn(12, H, D, generator=g, dtype=torch.float64)

    def rank(group):
        cache = xcp.PagedKVCache(group, num_blocks=8, block_size=2)
        cache.append(["a", "b"], k[:7], k[:7], [0, 4, 7])
        cache.attention(q[:7], ["a", "b"], [0, 4, 7])  # the first call: the agreement too
        counts = []
        for t, (lo, hi) in enumerate([(7, 8), (8, 10), (10, 11)]):
            ids = ["a", "b"] if t != 1 else ["b"]
            cu = [0, 1, hi - lo] if t != 1 else [0, hi - lo]
            cache.append(ids, k[lo:hi], k[lo:hi], cu)
            before = len(calls[group.rank()])
            cache.attention(q[lo:hi], ids, cu)
            counts.append(calls[group.rank()][before:])
        return counts

    with LocalWorld(2) as w:
        results = w.run(rank)
    assert all(c == [["all_gather"]] * 3 for c in results), results  # the all-gather alone

    def disagree(group):
        cache = xcp.PagedKVCache(group, num_blocks=8, block_size=2)
        cache.append(["a"], k[:4], k[:4], [0, 4])
        t = 1 if group.rank() == 0 else 2
        return cache.attention(q[4 - t : 4], ["a"], [0, t])

    with pytest.raises(RuntimeError, match="ValueError"):
        with LocalWorld(2) as w:
            w.run(disagree)


def test_a_paged_cache_defaults_to_blocks_of_16_and_says_what_it_holds():
    """docs/serving.md: block_size=16 by default; repr names the rank, the sequences and the free blocks."""
    cache = xcp.PagedKVCache(num_blocks=4)
    assert cache.block_size == 16
    assert repr(cache) == "<PagedKVCache rank 0 of 1: 0 sequences, 4 of 4 blocks of 16 free, interleave 1>"


def test_a_combine_over_a_communicator_without_the_collective_is_refused_by_name():
    from xcp.backends.cpu import CPUBackend
    from xcp.inference.partials import exchange

    class PointToPointOnly:  # a third-party communicator of exchange() alone
        def size(self):
            return 2

    recv = torch.empty(2, 3)
    with pytest.raises(TypeError, match=r"group: a combine over 2 ranks needs a communicator with all_gather\(\)"):
        exchange(PointToPointOnly(), CPUBackend(), None, "all_gather", lambda: torch.ones(3), recv, "combine")


def test_combine_over_two_ranks_and_alone():
    """Two ranks' float64 partials merge to the logsumexp-weighted sum on both; a world of one returns its own
    partial as a new tensor (the caller's is never aliased), a NaN lse as -inf (that row weighs 0), and checks
    its arguments like any world."""
    g = torch.Generator().manual_seed(2)
    outs = [torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    lses = [torch.randn(1, 2, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    merged = torch.logsumexp(torch.stack(lses), 0)
    want = sum(torch.exp(lse - merged).transpose(-1, -2).unsqueeze(-1) * out for out, lse in zip(outs, lses))
    with LocalWorld(2) as w:
        results = w.run(lambda group: xcp.combine(outs[group.rank()], lses[group.rank()], group))
    for out, lse in results:
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, merged)
    out, lse = xcp.combine(outs[0], lses[0])
    assert torch.equal(out, outs[0]) and out.untyped_storage().data_ptr() != outs[0].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="handoff: expected one of"):
        xcp.combine(outs[0], lses[0], handoff="later")
    nan_lse = lses[0].clone()
    nan_lse[0, 1, 2] = math.nan  # a kernel that divided 0 by 0 where the rank saw nothing
    out, lse = xcp.combine(outs[0], nan_lse)
    assert lse[0, 1, 2] == -math.inf and torch.equal(out[0, 2, 1], torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="out: expected a floating-point tensor; got dtype torch.int64"):
        xcp.combine(outs[0].long(), lses[0])
    with pytest.raises(TypeError, match="lse: expected a floating-point tensor; got list"):
        xcp.combine(outs[0], [0.0])
    with pytest.raises(ValueError, match=r"out: expected \[\.\.\., S, H, Dv\] \(at least 3 dims\); got shape \(3, 8\)"):
        xcp.combine(torch.zeros(3, 8), torch.zeros(8, 3))
    with pytest.raises(ValueError, match="lse: expected a tensor on out's device cpu; got meta"):
        xcp.combine(outs[0], lses[0].to("meta"))


@pytest.mark.parametrize(
    "options, error, name",
    [
        ({"causal": "yes"}, TypeError, "causal"),
        ({"window": (-1, 0)}, ValueError, "window"),
        ({"sinks": torch.zeros(3)}, ValueError, "sinks"),
        ({"softcap": -1.0}, ValueError, "softcap"),
    ],
)
def test_paged_attention_names_a_bad_argument(options, error, name):
    cache = xcp.PagedKVCache(num_blocks=4)
    cache.append(["a"], torch.randn(3, HKV, D), torch.randn(3, HKV, D), [0, 3])
    with pytest.raises(error, match=rf"^{name}: expected"):
        cache.attention(torch.randn(1, H, D), ["a"], [0, 1], **options)
