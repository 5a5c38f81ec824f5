"""A KV cache with capacity on a CUDA device: a decode step (append one token, attend its query) captured once
into a CUDA graph and replayed for every new token, for a world of one and for a LocalWorld whose every rank's
step is captured into ONE graph; each replay's output against an eager cache's step and float64 math, and the
allocator's count of live bytes unchanged by the replays and by eager steps.
"""

from __future__ import annotations

import pytest
import torch

import xcp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

B, H, HKV, D = 2, 32, 8, 64
"""bf16, 32 query heads over 8 K/V heads: the GQA of the GPU issue's targets, tiny."""
PROMPT = 64
WARM = 2
"""Eager steps before the capture (the first call of a configuration agrees among ranks; kernels get built)."""
TOL = 2e-2
"""Relative 2-norm error bound of bf16 (as ``xcp run`` and ``xcp bench`` check bf16)."""


def _tokens(total: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [B, total, H, D], k and v [B, total, HKV, D] in bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, total, h, D, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))


def _float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int) -> torch.Tensor:
    """float64 attention of the query at position p over the tokens 0..p (it sees every one of them)."""
    qd = q[:, p : p + 1].double().transpose(1, 2)
    kd, vd = (x[:, : p + 1].double().transpose(1, 2).repeat_interleave(H // HKV, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd).transpose(1, 2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm()).item()


def _allocated() -> int:
    """Live bytes once the device is idle and the allocator has freed what streams were still using (blocks
    handed to another stream are freed at the allocator's next allocation after their work ends)."""
    torch.cuda.synchronize()
    probe = torch.empty(1, device="cuda")
    del probe
    return torch.cuda.memory_allocated()


def _statics() -> tuple[torch.Tensor, ...]:
    """The captured step's inputs, kept in place: q [B, 1, H, D], k and v [B, 1, HKV, D]."""
    return tuple(torch.zeros(B, 1, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))


def _feed(statics: tuple[torch.Tensor, ...], tokens: tuple[torch.Tensor, ...], p: int) -> None:
    for static, x in zip(statics, tokens):
        static.copy_(x[:, p : p + 1])


def _eager_outputs(tokens: tuple[torch.Tensor, ...], total: int, first: int) -> list[torch.Tensor]:
    """A world of one's eager cache (capacity ``total``), prefilled with the prompt: its output at each step
    from position ``first`` on (the steps before are made too, unchecked)."""
    q, k, v = tokens
    cache = xcp.KVCache(capacity=total)
    cache.prefill(k[:, :PROMPT], v[:, :PROMPT])
    outs = []
    for p in range(PROMPT, total):
        cache.append(k[:, p : p + 1], v[:, p : p + 1])
        out = cache.attention(q[:, p : p + 1])
        if p >= first:
            outs.append(out)
    assert cache.seq_len == total
    return outs


def _check_steps(replayed: list[torch.Tensor], tokens: tuple[torch.Tensor, ...], total: int, first: int) -> None:
    """Each rank's replayed outputs (``replayed[r][i]``, the step at position ``first + i``) against the eager
    cache's and float64 math over every token up to its position."""
    eager = _eager_outputs(tokens, total, first)
    for i, want in enumerate(eager):
        p = first + i
        exact = _float64(*tokens, p)
        assert _rel(want, exact) <= TOL, (p, _rel(want, exact))
        for r, outs in enumerate(replayed):
            assert outs.shape[0] == len(eager)
            assert _rel(outs[i], want) <= TOL, (r, p, _rel(outs[i], want))
            assert _rel(outs[i], exact) <= TOL, (r, p, _rel(outs[i], exact))


def test_world_of_one_replays_a_captured_step_for_every_token():
    """One capture of append + attention, 100 replays each with a new token and query copied into the
    captured inputs: each output is the eager cache's step and float64 attention over every token so far,
    and the replays allocate nothing."""
    steps = 100
    total = PROMPT + WARM + steps
    tokens = _tokens(total)
    q, k, v = tokens
    cache = xcp.KVCache(capacity=total)
    cache.prefill(k[:, :PROMPT], v[:, :PROMPT])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as for any CUDA graph
        for p in range(PROMPT, PROMPT + WARM):
            cache.append(k[:, p : p + 1], v[:, p : p + 1])
            cache.attention(q[:, p : p + 1])
    torch.cuda.current_stream().wait_stream(side)
    statics = _statics()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.append(statics[1], statics[2])
        captured = cache.attention(statics[0])
    replayed = torch.empty(steps, *captured.shape, dtype=captured.dtype, device="cuda")
    before = _allocated()
    for i in range(steps):
        _feed(statics, tokens, PROMPT + WARM + i)
        graph.replay()
        replayed[i].copy_(captured)
    assert _allocated() == before
    assert (cache.seq_len, cache.local_len) == (total, total)  # the device's counters, read back
    _check_steps([replayed], tokens, total, PROMPT + WARM)


def test_local_world_of_four_replays_one_graph_of_every_rank():
    """Four virtual ranks, each a thread on its own stream forking from the capture stream and joining it:
    one graph holds every rank's append, attention and combine; each replay's output, on every rank, is the
    eager step's and float64's, the replays allocate nothing, and each rank holds its share of the tokens."""
    world_size, steps = 4, 24
    total = PROMPT + WARM + steps
    tokens = _tokens(total, seed=1)
    q, k, v = tokens
    world = xcp.LocalWorld(world_size, device="cuda")
    caches = [xcp.KVCache(group=world.group(r), capacity=total) for r in range(world_size)]
    for r, cache in enumerate(caches):
        cache.prefill(xcp.shard(k[:, :PROMPT], world_size, r), xcp.shard(v[:, :PROMPT], world_size, r))
    streams = [torch.cuda.Stream() for _ in range(world_size)]

    def rank(group, main, q1, k1, v1):
        stream = streams[group.rank()]
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            cache = caches[group.rank()]
            cache.append(k1, v1)
            return stream, cache.attention(q1)

    def step(q1, k1, v1) -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        results = world.run(rank, main, q1, k1, v1)
        for stream, _ in results:
            main.wait_stream(stream)
        return [out for _, out in results]

    for p in range(PROMPT, PROMPT + WARM):
        step(q[:, p : p + 1], k[:, p : p + 1], v[:, p : p + 1])
    statics = _statics()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the rank threads issue onto joined streams
        captured = step(*statics)
    replayed = torch.empty(world_size, steps, *captured[0].shape, dtype=captured[0].dtype, device="cuda")
    before = _allocated()
    for i in range(steps):
        _feed(statics, tokens, PROMPT + WARM + i)
        graph.replay()
        for r in range(world_size):
            replayed[r, i].copy_(captured[r])
    assert _allocated() == before
    held = [cache.local_len for cache in caches]
    assert all(cache.seq_len == total for cache in caches)
    assert sum(held) == total and max(held) - min(held) <= 1
    _check_steps(list(replayed), tokens, total, PROMPT + WARM)
    world.close()


@pytest.mark.parametrize("world_size", [1, 4])
def test_eager_decode_steps_leave_memory_flat(world_size):
    """1,000 eager decode steps on caches with capacity: the live bytes after step 10 and after step 1000 are
    the same (storage allocated once, nothing kept per step)."""
    steps = 1000
    total = PROMPT + steps
    q, k, v = _tokens(PROMPT + 1, seed=2)
    world = xcp.LocalWorld(world_size, device="cuda")
    caches = [xcp.KVCache(group=world.group(r), capacity=total) for r in range(world_size)]
    for r, cache in enumerate(caches):
        cache.prefill(xcp.shard(k[:, :PROMPT], world_size, r), xcp.shard(v[:, :PROMPT], world_size, r))
    q1, k1, v1 = q[:, PROMPT:], k[:, PROMPT:], v[:, PROMPT:]
    streams = [torch.cuda.Stream() for _ in range(world_size)]

    def rank(group, main):
        stream = streams[group.rank()]
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            cache = caches[group.rank()]
            cache.append(k1, v1)
            cache.attention(q1)
        return stream

    at_10 = None
    for i in range(steps):
        main = torch.cuda.current_stream()
        for stream in world.run(rank, main):
            main.wait_stream(stream)
        if i + 1 == 10:
            at_10 = _allocated()
    assert _allocated() == at_10
    assert [cache.seq_len for cache in caches] == [total] * world_size
    world.close()


@pytest.mark.parametrize("over_heads", [False, True], ids=["all-gather", "over-heads"])
def test_chunk_combines_on_four_ranks(over_heads):
    """A chunk of 80 tokens after the prompt on 4 virtual ranks of the GPU, its combine one all-gather of
    the packed partials or over heads (lse all-gather, all-to-all of the weighted partials, all-gather of
    the merged heads): every rank's output against float64 attention, each row seeing the tokens up to its own."""
    from xcp.inference import plan as cache_plan

    assert cache_plan.HEADS_COMBINE_MIN_QUERIES <= 80
    world_size, chunk = 4, 80
    total = PROMPT + chunk
    q, k, v = _tokens(total, seed=2)

    def rank(group):
        cache = xcp.KVCache(group=group, capacity=total, combine="heads" if over_heads else "gather")
        r = group.rank()
        cache.prefill(xcp.shard(k[:, :PROMPT], world_size, r), xcp.shard(v[:, :PROMPT], world_size, r))
        cache.append(k[:, PROMPT:], v[:, PROMPT:])
        return cache.attention(q[:, PROMPT:])

    with xcp.LocalWorld(world_size, device="cuda") as world:
        outs = world.run(rank)
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(H // HKV, 1) for x in (kd, vd))
    rows, cols = torch.arange(PROMPT, total, device="cuda"), torch.arange(total, device="cuda")
    allowed = cols.view(1, total) <= rows.view(-1, 1)
    want = torch.nn.functional.scaled_dot_product_attention(qd[:, :, PROMPT:], kd, vd, attn_mask=allowed)
    for out in outs:
        assert out.dtype == torch.bfloat16 and _rel(out, want.transpose(1, 2)) <= TOL
