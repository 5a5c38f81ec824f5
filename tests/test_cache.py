"""xcp.KVCache: every step of a sharded cache against the tests' float64 whole-sequence reference.

A prompt prefilled from the shards the balance places (or no prompt), then appends of single tokens and
of chunks of random size; after each, the last T queries attend over the cache on every rank and must
equal the reference's rows of those positions. Then placement, memory, capacity, the errors, the
agreement check, the combine's collective and gloo processes.
"""

from __future__ import annotations

import math
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import finish_ranks, gloo_worker, independent_masked_reference, pairs_of_runs, start_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import xcp
from xcp.comm import LocalWorld, SingleRank
from xcp.inference import plan as cache_plan

B, H, HKV, D = 2, 4, 2, 8


def reference(q, k, v, s: int, t: int, causal=True, window=None, sinks=None) -> torch.Tensor:
    """Rows ``s - t .. s - 1`` of the float64 attention of the first s tokens."""
    qs, ks, vs = q[:, :s], k[:, :s], v[:, :s]
    out = independent_masked_reference(qs, ks, vs, torch.zeros_like(qs), (0, s), causal, sinks, window=window)[0]
    return out[:, s - t : s]


def inputs(total: int, seed: int = 0, hkv: int = HKV, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, total, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, total, hkv, D, generator=g, dtype=dtype)
    return q, k, torch.randn(B, total, hkv, D, generator=g, dtype=dtype)


def run_steps(world, balance, prompt, steps, *, causal=True, window=None, sinks=None, hkv=HKV, capacity=None,
              seed=0, first_queries=1, combine="auto"):  # fmt: skip
    """Every rank's outputs after the prefill (when ``prompt``) and after each append, the expected ones,
    and every rank's cache."""
    total = prompt + sum(steps)
    q, k, v = inputs(total, seed, hkv)
    first_queries = min(first_queries, prompt)
    capacity = {True: total, False: None}.get(capacity, capacity)  # True: exactly the tokens of the run

    def rank(group):
        cache = xcp.KVCache(group=group, balance=balance, capacity=capacity, combine=combine)
        r, outs = group.rank(), []
        if prompt:
            cache.prefill(*(xcp.shard(x[:, :prompt], world, r, balance=balance) for x in (k, v)))
            outs.append(cache.attention(q[:, prompt - first_queries : prompt], causal, None, window, sinks))
        s = prompt
        for t in steps:
            cache.append(k[:, s : s + t], v[:, s : s + t])
            s += t
            outs.append(cache.attention(q[:, s - t : s], causal=causal, window=window, sinks=sinks))
        return outs, cache

    with LocalWorld(world) as w:
        results = w.run(rank)
    wants, s = [], prompt
    if prompt:
        wants.append(reference(q, k, v, prompt, first_queries, causal, window, sinks))
    for t in steps:
        s += t
        wants.append(reference(q, k, v, s, t, causal, window, sinks))
    return results, wants


def assert_steps(results, wants, tol=1e-10):
    for r, (outs, _) in enumerate(results):
        assert len(outs) == len(wants)
        for i, (got, want) in enumerate(zip(outs, wants)):
            assert got.dtype == torch.float64 and got.shape == want.shape
            err = (got - want).abs().max().item()
            assert err < tol, f"rank {r}, step {i}: error {err:.3g}"
    first = results[0][0]
    for outs, _ in results[1:]:  # every rank ends with the same output
        assert all(torch.equal(a, b) for a, b in zip(outs, first))


def prompt_length(world: int, balance: str, rng: random.Random) -> int:
    return xcp.schedule.required_multiple(world, balance) * rng.randint(1, 3)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("preallocated", [False, True], ids=["growing", "capacity"])
def test_prefill_then_decode_and_chunks(world, balance, preallocated):
    """With ``capacity`` the decode steps take the device path (counters and positions on the device,
    ``forward_range``), the chunks the host's plan; both must give the reference's rows."""
    rng = random.Random(world * 7 + len(balance))
    prompt = prompt_length(world, balance, rng)
    steps = [1, 1, rng.randint(2, 9), 1, rng.randint(2, 2 * world + 3), 1]
    window = rng.choice([None, (rng.randint(0, 4), 0), (rng.randint(5, 20), None)])
    sinks = torch.randn(H, dtype=torch.float64) if rng.random() < 0.5 else None
    results, wants = run_steps(world, balance, prompt, steps, window=window, sinks=sinks, first_queries=3,
                               capacity=preallocated)  # fmt: skip
    assert_steps(results, wants)


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (3, 0), (2, 1)])
def test_windows_shorter_than_a_holding(window):
    """A window shorter than the tokens a rank holds (and than P: some ranks see nothing of a row)."""
    causal = window[1] == 0
    results, wants = run_steps(4, "stripe", 16, [1, 1, 6, 1, 9, 1], causal=causal, window=window, first_queries=5)
    assert_steps(results, wants)


@pytest.mark.parametrize("world", [1, 3])
def test_cache_filled_by_appends_alone(world):
    sinks = torch.randn(H, dtype=torch.float64)
    results, wants = run_steps(world, "zigzag", 0, [5, 1, 1, 2, 7, 1], sinks=sinks)
    assert_steps(results, wants)
    results, wants = run_steps(world, "zigzag", 0, [1, 1, 1, 4], causal=False, hkv=1)
    assert_steps(results, wants)


def test_non_causal_and_multi_query():
    results, wants = run_steps(3, "zigzag", 12, [1, 4, 1], causal=False, window=(3, 2), hkv=1, first_queries=12)
    assert_steps(results, wants)


@settings(max_examples=8, deadline=None)
@given(
    world=st.sampled_from([1, 2, 3, 4]),
    balance=st.sampled_from(xcp.BALANCES),
    chunks=st.integers(0, 2),
    steps=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.just(0))),
    with_sinks=st.booleans(),
    preallocated=st.booleans(),
    seed=st.integers(0, 100),
)
def test_random_caches(world, balance, chunks, steps, window, with_sinks, preallocated, seed):
    prompt = chunks * xcp.schedule.required_multiple(world, balance)
    sinks = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    results, wants = run_steps(world, balance, prompt, steps, window=window, sinks=sinks, seed=seed,
                               capacity=preallocated)  # fmt: skip
    assert_steps(results, wants)


# ------------------------------------------------------------------------------------------ placement, memory


def test_placement_rule():
    assert cache_plan.chunk_pieces(8, 1, 4) == ((8, 1), (9, 0), (9, 0), (9, 0))  # position % P
    assert cache_plan.chunk_pieces(9, 1, 4)[1] == (9, 1)
    assert cache_plan.chunk_pieces(10, 6, 4) == ((10, 1), (11, 1), (12, 2), (14, 2))  # the larger pieces rotate
    for start in range(12):
        for count in range(1, 12):
            pieces = cache_plan.chunk_pieces(start, count, 3)
            assert sum(n for _, n in pieces) == count and pieces[0][0] == start
            assert max(n for _, n in pieces) - min(n for _, n in pieces) <= 1


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 5),
    balance=st.sampled_from(xcp.BALANCES),
    chunks=st.integers(0, 2),
    steps=st.lists(st.integers(1, 9), max_size=5),
    queries=st.integers(1, 12),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 10)),
    right=st.one_of(st.none(), st.integers(0, 4)),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    decoded=st.integers(0, 3),
)
def test_partial_calls_compute_exactly_the_visible_pairs(
    world, balance, chunks, steps, queries, causal, left, right, chunk, decoded
):
    """Brute force over the plan: every (query, stored key) pair the mask allows, once, and nothing else; the
    chunked plan (a query sees its own chunk of ``chunk`` positions) too, over decoded tokens (runs of stride P)."""
    prompt = chunks * xcp.schedule.required_multiple(world, balance)
    seq = prompt + sum(steps) + decoded
    if seq == 0:
        return
    window = xcp.documents.check_window((left, 0 if causal else right), causal)
    queries = min(queries, seq)
    for r in range(world):
        stored = cache_plan.prefill_runs(prompt, world, r, balance) if prompt else ()
        s = prompt
        for t in steps:
            first, count = cache_plan.chunk_pieces(s, t, world)[r]
            stored = cache_plan.extend(stored, first, count)
            s += t
        stored = cache_plan.extend_decoded(stored, s, s + decoded, world, r)
        positions = [p.global0 + p.stride * i for p in stored for i in range(p.count)]
        assert positions == sorted(positions)
        want = []
        for i in range(queries):
            at = seq - queries + i
            for j, p in enumerate(positions):
                lo = window is None or window[0] is None or p >= at - window[0]
                hi = (p <= at if causal else True) and (window is None or window[1] is None or p <= at + window[1])
                if lo and hi and (chunk is None or p // chunk == at // chunk):
                    want.append((i, j))
        got = pairs_of_runs(cache_plan.chunked_calls(stored, seq, queries, causal, window, chunk))
        assert sorted(got) == want


def _partial_calls_row_by_row(stored, seq_len, queries, causal, window):
    """The plan as it was first written, one query row at a time: the reference of the stretch walk."""
    far = 1 << 62
    left, right = window if window is not None else (None, None)
    sides = (far if left is None else left, 0 if causal else (far if right is None else right))

    def fits(prev, row, rising_lo, hi_step):
        dlo, dhi = row[0] - prev[0], row[1] - prev[1]
        if dlo not in (0, 1) or dhi not in (0, 1):
            return False
        if rising_lo and dlo == 0:
            return False
        return hi_step is None or dhi == hi_step

    def segment(rows, r0):
        k0, k1, sq = rows[0][0], rows[-1][1], len(rows)
        lo, hi = rows[-1][0] - k0 - (sq - 1), rows[0][1] - 1 - k0
        return xcp.documents.diagonal_segment((r0, r0 + sq), (k0, k1), lo, hi, False)

    segs, group, r0, rising_lo, hi_step = [], [], 0, False, None
    for i in range(queries):
        row = cache_plan.visible(stored, seq_len - queries + i, sides)
        if group and row[0] < row[1] and fits(group[-1], row, rising_lo, hi_step):
            rising_lo = rising_lo or row[0] > group[-1][0]
            hi_step = row[1] - group[-1][1]
            group.append(row)
            continue
        if group:
            segs.append(segment(group, r0))
        group, r0, rising_lo, hi_step = ([row] if row[0] < row[1] else []), i, False, None
    if group:
        segs.append(segment(group, r0))
    return xcp.documents.runs(segs)


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 8),
    balance=st.sampled_from(xcp.BALANCES),
    chunks=st.integers(0, 3),
    appends=st.lists(st.tuples(st.booleans(), st.integers(0, 24)), max_size=5),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 40)),
    right=st.one_of(st.none(), st.integers(0, 40)),
    data=st.data(),
)
def test_partial_calls_walk_the_rows_as_row_by_row(world, balance, chunks, appends, causal, left, right, data):
    """The stretch walk plans exactly the calls of the row-by-row plan: prefills of every balance, chunks,
    decode tokens (runs of stride P), windows of either side, rows that see nothing."""
    rank = data.draw(st.integers(0, world - 1))
    prompt = chunks * xcp.schedule.required_multiple(world, balance)
    stored = cache_plan.prefill_runs(prompt, world, rank, balance) if prompt else ()
    s = prompt
    for decoded, count in appends:
        if decoded:
            stored = cache_plan.extend_decoded(stored, s, s + count, world, rank)
        else:
            stored = cache_plan.extend(stored, *cache_plan.chunk_pieces(s, count, world)[rank])
        s += count
    if s == 0:
        return
    queries = data.draw(st.integers(1, min(s, 40)))
    window = data.draw(st.sampled_from([None, (left, 0), (left, 0 if causal else right)]))
    want = _partial_calls_row_by_row(stored, s, queries, causal, window)
    assert cache_plan.partial_calls.__wrapped__(stored, s, queries, causal, window) == want


@pytest.mark.parametrize("window", [None, (1000, 0), (3000, None)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("balance", ["zigzag", "stripe"])
def test_partial_calls_of_a_long_chunk_as_row_by_row(balance, causal, window):
    """World 8, a 128K prefill, 7 decode tokens, a 4096-token chunk: every rank, as row by row."""
    world, prompt, chunk = 8, 128 * 1024, 4096
    if causal and window is not None:
        window = (window[0], 0)
    for rank in range(world):
        stored = cache_plan.prefill_runs(prompt, world, rank, balance)
        stored = cache_plan.extend_decoded(stored, prompt, prompt + 7, world, rank)
        stored = cache_plan.extend(stored, *cache_plan.chunk_pieces(prompt + 7, chunk, world)[rank])
        seq = prompt + 7 + chunk
        want = _partial_calls_row_by_row(stored, seq, chunk, causal, window)
        assert cache_plan.partial_calls.__wrapped__(stored, seq, chunk, causal, window) == want


def test_each_rank_holds_its_share_in_position_order():
    world, prompt, steps = 4, 16, [1, 1, 5, 1, 3, 1, 1]
    results, _ = run_steps(world, "zigzag", prompt, steps)
    caches = [c for _, c in results]
    total = prompt + sum(steps)
    positions = [c.positions() for c in caches]
    assert sorted(p for ps in positions for p in ps) == list(range(total))  # each token kept by exactly one rank
    token_bytes = B * HKV * D * 8 * 2  # K and V, float64
    for r, (c, ps) in enumerate(zip(caches, positions)):
        assert ps == sorted(ps) and c.seq_len == total
        assert c.local_len == len(ps) == cache_plan.held(total, world, r)
        growth = xcp.inference.cache.GROWTH
        assert c.nbytes <= math.ceil(growth * (total // world + 1)) * token_bytes < total * token_bytes
        k = c.keys()
        assert k is not None and k.shape[1] == c.local_len


def test_capacity_preallocates_and_never_reallocates():
    world, capacity = 3, 20
    q, k, v = inputs(capacity + 1)

    def rank(group):
        cache = xcp.KVCache(group=group, balance="contiguous", capacity=capacity)
        cache.prefill(*(xcp.shard(x[:, :6], world, group.rank(), balance="contiguous") for x in (k, v)))
        room = cache.nbytes
        pointer = cache.keys().data_ptr()
        for s in range(6, capacity):
            cache.append(k[:, s : s + 1], v[:, s : s + 1])
            cache.attention(q[:, s : s + 1])
        assert cache.nbytes == room and cache.keys().data_ptr() == pointer
        with pytest.raises(ValueError, match=f"capacity: expected at most {capacity} tokens"):
            cache.append(k[:, capacity:], v[:, capacity:])
        assert cache.seq_len == capacity  # the refused append changed nothing
        return room

    with LocalWorld(world) as w:
        rooms = w.run(rank)
    token_bytes = B * HKV * D * 8 * 2
    assert rooms == [(cache_plan.held(capacity, world, r) + 1) * token_bytes for r in range(world)]  # + a scratch row


def _replays(monkeypatch) -> threading.local:
    """Let each thread make the CPU backend report a capture in progress (``.on = True`` on what this
    returns): a step then does what a replay of a captured step does (its device work, run here eagerly)
    and the host's counters lag, as they do after real replays."""
    capturing = threading.local()
    monkeypatch.setattr(type(xcp.get_backend("cpu")), "is_capturing", lambda self: getattr(capturing, "on", False))
    return capturing


@pytest.mark.parametrize("world", [1, 3])
def test_replayed_decode_steps_read_their_lengths_back(monkeypatch, world):
    prompt, decode, capacity = 2 * world, 7, 2 * world + 10
    q, k, v = inputs(capacity + 1, seed=world)
    window, sinks = (4, 0), torch.randn(H, dtype=torch.float64)
    capturing = _replays(monkeypatch)

    def rank(group):
        cache = xcp.KVCache(group=group, balance="zigzag", capacity=capacity)
        cache.prefill(*(xcp.shard(x[:, :prompt], world, group.rank()) for x in (k, v)))
        cache.append(k[:, prompt : prompt + 1], v[:, prompt : prompt + 1])  # eager: the host keeps up
        outs = [cache.attention(q[:, prompt : prompt + 1], window=window, sinks=sinks)]
        capturing.on = True
        for s in range(prompt + 1, prompt + 1 + decode):
            cache.append(k[:, s : s + 1], v[:, s : s + 1])
            outs.append(cache.attention(q[:, s : s + 1], window=window, sinks=sinks))
            assert cache._seq == prompt + 1  # the host's own counter waits (a replay runs no Python)
        with pytest.raises(RuntimeError, match=r"append: expected a decode step \(T = 1\)"):
            cache.append(k[:, :2], v[:, :2])
        capturing.on = False
        s = prompt + 1 + decode
        assert cache.seq_len == s and cache.local_len == cache_plan.held(s, world, group.rank())
        cache.append(k[:, s : s + 2], v[:, s : s + 2])  # a chunk after replays: the host's plan is whole again
        outs.append(cache.attention(q[:, s : s + 2], window=window, sinks=sinks))
        return outs, cache

    with LocalWorld(world) as w:
        results = w.run(rank)
    wants = [reference(q, k, v, s, 1, True, window, sinks) for s in range(prompt + 1, prompt + 2 + decode)]
    wants.append(reference(q, k, v, prompt + 3 + decode, 2, True, window, sinks))
    assert_steps(results, wants)
    for r, (_, cache) in enumerate(results):  # every token kept where the placement rule puts it, in order
        positions = xcp.schedule.shard_indices(prompt, world, r, "zigzag")
        positions += [p for p in range(prompt, prompt + 1 + decode) if p % world == r]
        first, count = cache_plan.chunk_pieces(prompt + 1 + decode, 2, world)[r]
        positions += list(range(first, first + count))
        assert cache.positions() == positions
        assert torch.equal(cache.keys(), k[:, positions]) and torch.equal(cache.values(), v[:, positions])


def test_replayed_steps_past_capacity_are_reported(monkeypatch):
    capacity = 4
    q, k, v = inputs(capacity + 2)
    cache = xcp.KVCache(capacity=capacity)
    cache.append(k[:, :1], v[:, :1])
    _replays(monkeypatch).on = True
    for s in range(1, capacity + 2):  # two steps past the capacity: nothing can raise inside a replay
        cache.append(k[:, s : s + 1], v[:, s : s + 1])
        cache.attention(q[:, s : s + 1])
    monkeypatch.undo()
    for _ in range(2):  # and every later call raises again
        with pytest.raises(ValueError, match=r"capacity: expected at most 4 tokens .* got 6 .* the 2 past"):
            cache.seq_len  # noqa: B018
    with pytest.raises(ValueError, match="capacity: expected at most 4"):
        cache.attention(q[:, :2])


def test_graph_capture_takes_only_decode_steps_of_a_capacity_cache(monkeypatch):
    q, k, v = inputs(4)
    growing, preallocated = xcp.KVCache(), xcp.KVCache(capacity=8)
    for cache in (growing, preallocated):
        cache.append(k[:, :2], v[:, :2])
    _replays(monkeypatch).on = True
    with pytest.raises(RuntimeError, match="on a cache without capacity"):
        growing.append(k[:, 2:3], v[:, 2:3])
    with pytest.raises(RuntimeError, match=r"attention: expected a decode step .* got T = 2"):
        preallocated.attention(q[:, :2])
    with pytest.raises(RuntimeError, match=r"attention: .* on a cache without capacity"):
        growing.attention(q[:, 1:2])


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 5),
    balance=st.sampled_from(xcp.BALANCES),
    chunks=st.lists(st.integers(1, 7), max_size=2),
    decoded=st.integers(0, 20),
    data=st.data(),
)
def test_decoded_positions_join_runs_as_token_by_token_appends(world, balance, chunks, decoded, data):
    rank = data.draw(st.integers(0, world - 1))
    prompt = xcp.schedule.required_multiple(world, balance) * data.draw(st.integers(0, 2))
    runs = cache_plan.prefill_runs(prompt, world, rank, balance) if prompt else ()
    s = prompt
    for t in chunks:
        runs = cache_plan.extend(runs, *cache_plan.chunk_pieces(s, t, world)[rank])
        s += t
    one_by_one = runs
    for p in range(s, s + decoded):
        one_by_one = cache_plan.extend(one_by_one, *cache_plan.chunk_pieces(p, 1, world)[rank])
    assert cache_plan.extend_decoded(runs, s, s + decoded, world, rank) == one_by_one


def test_world_of_one_makes_one_call_and_no_collective(monkeypatch):
    q, k, v = inputs(9)
    calls = []
    backend = xcp.get_backend("cpu")
    forward = type(backend).forward
    monkeypatch.setattr(type(backend), "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    monkeypatch.setattr(SingleRank, "all_gather", lambda *a, **kw: pytest.fail("a collective in a world of one"))
    cache = xcp.KVCache()
    cache.append(k[:, :8], v[:, :8])
    cache.append(k[:, 8:], v[:, 8:])
    out = cache.attention(q[:, 8:])
    assert len(calls) == 1
    assert (out - reference(q, k, v, 9, 1)).abs().max() < 1e-10


def test_all_gather_of_each_communicator():
    send = torch.arange(6.0).view(2, 3)
    recv = torch.empty(1, 2, 3)
    SingleRank().all_gather(send, recv, "combine", xcp.get_backend("cpu")).wait()
    assert torch.equal(recv[0], send)

    def rank(group):
        mine = torch.full((2, 3), float(group.rank()))
        out = torch.empty(3, 2, 3)
        group.all_gather(mine, out, "combine", xcp.get_backend("cpu")).wait()
        return out

    with LocalWorld(3) as w:
        for out in w.run(rank):
            assert torch.equal(out, torch.arange(3.0).view(3, 1, 1).expand(3, 2, 3))
    with pytest.raises(ValueError, match=r"recv: expected shape \(1, 2, 3\)"):
        SingleRank().all_gather(send, torch.empty(2, 2, 3), "combine", None)


# ------------------------------------------------------------------------------------------ errors


def test_errors():
    q, k, v = inputs(8)
    cache = xcp.KVCache()
    with pytest.raises(ValueError, match="q: expected a cache that holds tokens"):
        cache.attention(q[:, :1])
    with pytest.raises(ValueError, match="k: expected T >= 1 tokens"):
        cache.append(k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match=r"v: expected shape"):
        cache.append(k[:, :2], v[:, :3])
    cache.append(k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="prefill: expected an empty cache .* after append"):
        cache.prefill(k[:, :4], v[:, :4])
    with pytest.raises(TypeError, match="k: expected dtype torch.float64 .*; got torch.float32"):
        cache.append(k[:, :1].float(), v[:, :1].float())
    with pytest.raises(ValueError, match="k: expected kv_heads 2 .*; got 1"):
        cache.append(k[:, :1, :1], v[:, :1, :1])
    with pytest.raises(ValueError, match="k: expected batch 2 .*; got 1"):
        cache.append(k[:1, :1], v[:1, :1])
    with pytest.raises(ValueError, match="k: expected head_dim 8 .*; got 4"):
        cache.append(k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="k: expected device cpu .*; got meta"):
        cache.append(k[:, :1].to("meta"), v[:, :1].to("meta"))
    with pytest.raises(ValueError, match="q: expected T >= 1 queries"):
        cache.attention(q[:, :0])
    with pytest.raises(ValueError, match="q: expected at most seq_len = 4 queries"):
        cache.attention(q[:, :5])
    with pytest.raises(ValueError, match="q: expected a number of heads that the cache's 2 kv_heads divide; got 3"):
        cache.attention(q[:, :1, :3])
    with pytest.raises(TypeError, match="q: expected dtype torch.float64"):
        cache.attention(q[:, :1].float())
    with pytest.raises(ValueError, match="q: expected head_dim 8"):
        cache.attention(q[:, :1, :, :4])
    with pytest.raises(ValueError, match="sinks: expected shape"):
        cache.attention(q[:, :1], sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="window: with causal=True"):
        cache.attention(q[:, :1], window=(2, 2))
    assert cache.seq_len == 4 and cache.local_len == 4  # the refused calls changed nothing
    twice = xcp.KVCache()
    twice.prefill(k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="prefill: expected an empty cache .* after prefill"):
        twice.prefill(k[:, :4], v[:, :4])
    with pytest.raises(NotImplementedError, match="ulysses: expected 1"):
        xcp.KVCache(ulysses=2)
    with pytest.raises(ValueError, match="capacity: expected a positive integer"):
        xcp.KVCache(capacity=0)
    with pytest.raises(ValueError, match="balance: expected one of"):
        xcp.KVCache(balance="spiral")
    with pytest.raises(ValueError, match="handoff: expected one of"):
        xcp.KVCache(handoff="copy")
    with pytest.raises(ValueError, match="combine: expected one of 'auto', 'gather', 'heads'; got 'ring'"):
        xcp.KVCache(combine="ring")
    with LocalWorld(2) as w:
        errors = w.run(lambda g: _prefill_error(g, k, v))
    want = "k_l.shape[1] x 2 ranks: balance 'zigzag' over 2 ranks needs a positive multiple of 4"
    assert all(want in e for e in errors)


def _prefill_error(group, k, v) -> str:
    with pytest.raises(ValueError) as info:
        xcp.KVCache(group=group).prefill(k[:, :3], v[:, :3])
    return str(info.value)


def test_ranks_that_disagree_are_named_once_per_configuration():
    q, k, v = inputs(8)

    def rank(group):
        cache = xcp.KVCache(group=group)
        cache.append(k[:, :4], v[:, :4])
        cache.attention(q[:, 3:4])  # agreed once
        cache.append(k[:, 4:5], v[:, 4:5])
        cache.attention(q[:, 4:5])  # the same configuration: no check
        with pytest.raises(ValueError, match=r"different arguments: causal \(rank 0: True; rank 1: False\)"):
            cache.attention(q[:, 3:5], causal=group.rank() == 0)  # T = 2: a configuration not agreed yet
        with pytest.raises(ValueError, match="scale"):
            cache.attention(q[:, 2:5], scale=0.5 + group.rank())
        return len(group.rank_store()["agreed"])

    with LocalWorld(2) as w:
        assert w.run(rank) == [1, 1]

    def uneven(group):
        cache = xcp.KVCache(group=group)
        cache.append(k[:, : 4 + group.rank()], v[:, : 4 + group.rank()])  # rank 1 holds one more token
        with pytest.raises(ValueError, match=r"k.shape \(rank 0: \(2, 4, 2, 8\); rank 1: \(2, 5, 2, 8\)\)"):
            cache.attention(q[:, 3:4])

    with LocalWorld(2) as w:
        w.run(uneven)


# ------------------------------------------------------------------------------------------ gloo processes

WORKER = gloo_worker(
    """
    import xcp
    case = torch.load(f"{workdir}/case.pt")
    q, k, v, prompt, steps = case["q"], case["k"], case["v"], case["prompt"], case["steps"]
    cache = xcp.KVCache(balance="stripe", capacity=case["capacity"])
    cache.prefill(xcp.shard(k[:, :prompt], world, rank, balance="stripe"),
                  xcp.shard(v[:, :prompt], world, rank, balance="stripe"))
    outs, s = [], prompt
    for t in steps:
        cache.append(k[:, s:s + t], v[:, s:s + t])
        s += t
        outs.append(cache.attention(q[:, s - t:s], window=case["window"], sinks=case["sinks"]))
    torch.save({"outs": outs, "local_len": cache.local_len, "nbytes": cache.nbytes}, f"{workdir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_processes(tmp_path: Path, world):
    prompt, steps = 2 * world, [1, 1, 4, 1]
    total = prompt + sum(steps)
    q, k, v = inputs(total, seed=world)
    sinks = torch.randn(H, dtype=torch.float64)
    window = (5, 0)
    torch.save(dict(q=q, k=k, v=v, prompt=prompt, steps=steps, capacity=total, sinks=sinks, window=window),
               tmp_path / "case.pt")  # fmt: skip
    finish_ranks(start_ranks(WORKER, world, tmp_path), timeout=120)
    wants, s = [], prompt
    for t in steps:
        s += t
        wants.append(reference(q, k, v, s, t, True, window, sinks))
    token_bytes = B * HKV * D * 8 * 2
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["local_len"] == cache_plan.held(total, world, r)
        assert got["nbytes"] == (got["local_len"] + 1) * token_bytes  # capacity = total: its share and a scratch row
        for out, want in zip(got["outs"], wants):
            assert (out - want).abs().max().item() < 1e-10


def test_attention_points_longer_keys_to_the_cache():
    q, k, v = inputs(8)
    with pytest.raises(ValueError, match="use xcp.KVCache"):
        xcp.attention(q[:, :1], k, v, causal=True)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("over_heads", [False, True])
def test_lower_precision_dtypes(monkeypatch, dtype, tol, over_heads):
    if over_heads:
        monkeypatch.setattr(cache_plan, "HEADS_COMBINE_MIN_QUERIES", 2)
    q, k, v = inputs(14, seed=3, dtype=dtype)

    def rank(group):
        cache = xcp.KVCache(group=group, balance="zigzag", combine="heads" if over_heads else "auto")
        cache.prefill(*(xcp.shard(x[:, :8], 2, group.rank()) for x in (k, v)))
        outs = []
        for s, t in ((8, 1), (9, 4), (13, 1)):
            cache.append(k[:, s : s + t], v[:, s : s + t])
            outs.append(cache.attention(q[:, s : s + t]))
        return outs

    with LocalWorld(2) as w:
        results = w.run(rank)
    for i, (s, t) in enumerate(((8, 1), (9, 4), (13, 1))):
        want = reference(q, k, v, s + t, t)
        for outs in results:
            assert outs[i].dtype == dtype
            assert (outs[i].double() - want).abs().max().item() < tol


def test_combine_bytes():
    assert cache_plan.combine_bytes(4, 2, 1, 8, 65, 4) == 4 * 2 * 8 * 65 * 4
    # decode: one all-gather of the packed partials; bf16 packs D + 2 channels of 2 bytes
    assert cache_plan.combine_traffic(8, 8, 1, 32, 128, torch.bfloat16) == (7 * 8 * 32 * 130 * 2, 8 * 8 * 32 * 130 * 2)
    assert cache_plan.combine_traffic(1, 8, 4096, 32, 128, torch.bfloat16) == (0, 0)
    # a long chunk over heads: the float32 lse gathered, then 1/P of the weighted partial and of the merged
    # heads per peer; P = 8, T = 4096: about four times fewer bytes sent than one all-gather
    rows = 4096 * 32
    sent, received = cache_plan.combine_traffic(8, 1, 4096, 32, 128, torch.bfloat16)
    assert (sent, received) == (7 * (rows * 4 + 2 * rows * 128 * 2 // 8), 8 * (rows * 4 + 2 * rows * 128 * 2 // 8))
    assert 3.5 < cache_plan.combine_bytes(7, 1, 4096, 32, 130, 2) / sent < 4.5
    assert cache_plan.combine_over_heads(8, 4096, 32) and not cache_plan.combine_over_heads(3, 4096, 32)
    assert not cache_plan.combine_over_heads(8, cache_plan.HEADS_COMBINE_MIN_QUERIES - 1, 32)


def test_auto_combines_over_heads_between_processes_and_gathers_between_virtual_ranks(monkeypatch):
    from xcp.testing.doubles import LoopbackCommunicator

    with LocalWorld(2) as w:
        caches = {c: xcp.KVCache(group=w.group(0), combine=c) for c in cache_plan.COMBINES}
        assert [caches[c]._combines_over_heads(64, 4) for c in cache_plan.COMBINES] == [False, False, True]
        assert not caches["heads"]._combines_over_heads(63, 4) and not caches["heads"]._combines_over_heads(64, 3)
    processes = LoopbackCommunicator(2, 0)  # not ranks_are_threads, as torch.distributed's processes
    assert xcp.KVCache(group=processes)._combines_over_heads(64, 4)
    assert not xcp.KVCache(group=processes, combine="gather")._combines_over_heads(64, 4)


@pytest.mark.parametrize(("world", "over_heads"), [(2, True), (4, True), (3, False)])
def test_long_chunks_combine_over_heads(monkeypatch, world, over_heads):
    """With ``combine="heads"``, chunks past the threshold combine over heads (lse all-gather, all-to-all of
    the weighted partials, all-gather of the merged heads) where P divides H, else with one all-gather; both
    exact, sinks and windows included, and every rank ends with the same output."""
    monkeypatch.setattr(cache_plan, "HEADS_COMBINE_MIN_QUERIES", 3)
    calls = []
    original = xcp.comm.local.LocalGroup.all_to_all

    def counted(self, send, recv, tag, backend, step=None):
        calls.append(send.shape)
        return original(self, send, recv, tag, backend, step)

    monkeypatch.setattr(xcp.comm.local.LocalGroup, "all_to_all", counted)
    prompt = 4 * world
    sinks = torch.randn(H, dtype=torch.float64)
    for window in (None, (3, 0)):
        results, wants = run_steps(world, "zigzag", prompt, [1, 7, 2, 1, 5], window=window, sinks=sinks,
                                   first_queries=4, capacity=True, combine="heads")  # fmt: skip
        assert_steps(results, wants)
    # the prompt's 4 queries and the chunks of 7 and 5 on every rank, for each window
    assert len(calls) == (world * 3 * 2 if over_heads else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_packed_partials_keep_the_lse_bit_for_bit(dtype):
    """16-bit inputs pack out as it is and the float32 lse's bits in two more channels (half the bytes of
    float32 packing); other dtypes pack both in the accumulator dtype. The lse comes back exactly, -inf too."""
    from xcp.inference.partials import pack as _pack
    from xcp.kernels.merge import packed_layout, packed_lse

    b, t, h, d = 2, 3, 4, 8
    out = torch.randn(b, t, h, d).to(dtype)
    lse = torch.randn(b, h, t, dtype=torch.float64 if dtype == torch.float64 else torch.float32) * 50
    lse[0, 1, 2] = float("-inf")
    packed = _pack(out, lse, dtype)
    half = dtype in (torch.bfloat16, torch.float16)
    assert packed_layout(dtype, d) == (dtype if half else lse.dtype, d + (2 if half else 1))
    assert packed.shape == (b, t, h, d + 2 if half else d + 1) and packed.dtype == (dtype if half else lse.dtype)
    assert torch.equal(packed[..., :d], out.to(packed.dtype))
    assert torch.equal(packed_lse(packed, d), lse.transpose(1, 2))
    assert packed_layout(torch.bfloat16, 7) == (torch.float32, 8)  # an odd D: the lse's bits would not align


def test_every_local_call_goes_in_varlen_form_one_segment_included():
    """A cache's calls change shape at every step: each goes to the backend's varlen kernel, which takes
    the lengths at run time, never to the dense one, which may plan per shape (docs: 14.3x one whole-cache
    call with dense calls on the H200, 1.26x in varlen form); the rows match the dense result."""
    from xcp.backends.cpu import CPUBackend
    from xcp.inference import partials

    class Recording(CPUBackend):
        def __init__(self):
            super().__init__()
            self.forms = []

        def forward(self, *args, **kwargs):
            self.forms.append("dense")
            return super().forward(*args, **kwargs)

        def forward_varlen(self, *args, **kwargs):
            self.forms.append("varlen")
            return super().forward_varlen(*args, **kwargs)

    stored = cache_plan.prefill_runs(12, 1, 0, "zigzag")
    calls = cache_plan.partial_calls(stored, 12, 1, True, None)  # a decode step: one segment
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 4, generator=gen, dtype=torch.float64) for n in (1, 12, 12))
    backend = Recording()
    ((rows, out, lse),) = partials.run_calls(backend, calls, q, k, v, 0.5)
    assert backend.forms[0] == "varlen" and rows == slice(0, 1)  # (the CPU's varlen kernel runs dense inside)
    want, want_lse = CPUBackend().forward(q, k, v, "none", 0.5)
    assert torch.allclose(out, want) and torch.allclose(lse, want_lse)


@pytest.mark.parametrize("rows", [(), ((1, 3),), ((0, 2),), ((0, 3),)], ids=["none", "late", "early", "all"])
def test_a_local_partial_has_a_row_for_every_query(rows):
    """local_partial of T = 3 queries (2 heads) whose calls cover none, the last two, the first two or all
    of them: the covered rows are their call's attention, the others see nothing (out 0, lse -inf); the
    shape is always the queries'."""
    from xcp.backends.cpu import CPUBackend
    from xcp.documents import Segment, runs
    from xcp.inference import partials

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 2, 4, generator=gen, dtype=torch.float64) for n in (3, 5, 5))
    calls = runs([Segment(q0, q1, 0, 5, False) for q0, q1 in rows])
    out, lse = partials.local_partial(CPUBackend(), calls, q, k, v, 0.5, torch.float64)
    assert out.shape == (1, 3, 2, 4) and lse.shape == (1, 2, 3)
    want, want_lse = CPUBackend().forward(q, k, v, "none", 0.5)
    for i in range(3):
        if any(q0 <= i < q1 for q0, q1 in rows):
            assert torch.allclose(out[:, i], want[:, i]) and torch.allclose(lse[:, :, i], want_lse[:, :, i])
        else:
            assert torch.equal(out[:, i], torch.zeros_like(out[:, i])) and torch.isneginf(lse[:, :, i]).all()


def test_no_queries_make_no_kernel_call():
    stored = cache_plan.prefill_runs(8, 2, 0, "zigzag")
    assert cache_plan.partial_calls(stored, 8, 0, True, None) == ()
    assert cache_plan.partial_calls(stored, 8, 0, False, (2, 3)) == ()
