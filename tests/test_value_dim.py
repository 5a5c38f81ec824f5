"""Value heads of another size than the queries' and keys' (multi-head latent attention, as DeepSeek-V3 and
Kimi-K2 have it: q and k 192, v 128): every path of xcp.attention and the KV cache against the tests' own
float64 whole-sequence reference, out and every gradient to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from helpers import independent_masked_reference, installed, run_sharded
from hypothesis import given, settings
from hypothesis import strategies as st

import xcp

DIMS = [(192, 128), (128, 64), (64, 128), (576, 512)]
"""(q/k head dim, v head dim): DeepSeek-V3's, a smaller pair, the other way round, absorbed MLA decode's."""


def tensors(s: int, h: int, hkv: int, dqk: int, dv: int, seed: int, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, s, n, dqk, generator=g, dtype=torch.float64) for n in (h, hkv))
    v = torch.randn(batch, s, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, s, h, dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def assert_close(got, want, names=("out", "dq", "dk", "dv", "dsinks")):
    for name, a, b in zip(names, got, want):
        assert a is not None and a.shape == b.shape, (name, None if a is None else a.shape, b.shape)
        err = (a.double() - b).abs().max().item()
        assert err < 1e-10, f"{name}: error {err:.3g}"


@settings(max_examples=20, deadline=None)
@given(
    dims=st.sampled_from(DIMS),
    world=st.sampled_from([1, 2, 4, 8]),
    balance=st.sampled_from(xcp.BALANCES),
    causal=st.booleans(),
    hkv=st.sampled_from([1, 2, 4]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_dense_ring(dims, world, balance, causal, hkv, with_sinks, seed):
    s = xcp.schedule.required_multiple(world, balance) * (2 if world < 8 else 1)
    q, k, v, dout = tensors(s, 4, hkv, *dims, seed)
    sinks = torch.randn(4, dtype=torch.float64) if with_sinks else None
    got = run_sharded(q, k, v, dout, world, balance=balance, causal=causal, sinks=sinks)
    want = independent_masked_reference(q, k, v, dout, (0, s), causal, sinks)
    assert got[0].shape[-1] == dims[1]
    assert_close(got, want)


@settings(max_examples=15, deadline=None)
@given(
    dims=st.sampled_from(DIMS[:3]),
    world=st.sampled_from([1, 2, 4]),
    balance=st.sampled_from(["zigzag", "contiguous", "stripe"]),
    causal=st.booleans(),
    window=st.sampled_from([None, (3, 0), (2, 5)]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_documents_windows_and_sinks(dims, world, balance, causal, window, with_sinks, seed):
    """Packed documents with empty ones among them, a window, sinks: the varlen calls in v's dim."""
    s = xcp.schedule.required_multiple(world, balance) * 3
    if causal and window is not None:
        window = (window[0], 0)
    cut = s // 3
    cu = (0, 0, cut, cut, s - 2, s)
    q, k, v, dout = tensors(s, 4, 2, *dims, seed)
    sinks = torch.randn(4, dtype=torch.float64) if with_sinks else None
    got = run_sharded(q, k, v, dout, world, balance=balance, causal=causal, sinks=sinks,
                      cu_seqlens=torch.tensor(cu), window=window)  # fmt: skip
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks, window=window)
    assert_close(got, want)


@pytest.mark.parametrize("dims", DIMS[:3])
@pytest.mark.parametrize("documents", [False, True])
def test_hybrid(dims, documents):
    """ulysses = 2 over 4 ranks: the all-to-alls over heads carry q/k and v in their own dims."""
    s = 16
    q, k, v, dout = tensors(s, 4, 2, *dims, seed=3)
    cu = (0, 5, 5, s) if documents else (0, s)
    extra = {"cu_seqlens": torch.tensor(cu)} if documents else {}
    got = run_sharded(q, k, v, dout, 4, ulysses=2, causal=True, **extra)
    assert_close(got, independent_masked_reference(q, k, v, dout, cu, True))


@pytest.mark.parametrize("world", [1, 2])
def test_return_lse_and_compile(world):
    """The lse of rows whose values are of another dim, and the compiled op: out's shape in v's dim."""
    s = 8
    q, k, v, dout = tensors(s, 4, 2, 12, 8, seed=4)
    compiled = torch.compile(xcp.attention, backend="aot_eager", fullgraph=True)

    def rank(group):
        r = group.rank()
        local = [xcp.shard(x, world, r).requires_grad_() for x in (q, k, v)]
        out, lse = xcp.attention(*local, causal=True, group=group, return_lse=True)
        if world == 1:  # compiled graphs take a ProcessGroup or None, not a LocalWorld's thread ranks
            again = compiled(*local, causal=True)
            assert again.shape == out.shape
            torch.testing.assert_close(again, out, rtol=0, atol=1e-12)
        out.backward(xcp.shard(dout, world, r))
        return out.detach(), *(x.grad for x in local), lse

    with xcp.LocalWorld(world) as w:
        per_rank = w.run(rank)
    got = [xcp.unshard([p[i] for p in per_rank]) for i in range(4)]
    assert_close(got, independent_masked_reference(q, k, v, dout, (0, s), True))
    lse = torch.cat([xcp.unshard([p[4].transpose(1, 2) for p in per_rank])], dim=0).transpose(1, 2)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1)
    scores = (qh @ kh.transpose(-1, -2)) * 12**-0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    assert (lse - torch.logsumexp(scores, -1)).abs().max().item() < 1e-10


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("capacity", [None, 64])
def test_kv_cache(dims, capacity):
    """Prefill, decode steps and a chunk over 3 ranks; each step's out in v's dim against the reference."""
    world, prompt, steps = 3, 6, [1, 1, 5, 1]
    total = prompt + sum(steps)
    q, k, v, _ = tensors(total, 2, 1, *dims, seed=5)

    def rank(group):
        cache = xcp.KVCache(group=group, capacity=capacity)
        cache.prefill(*(xcp.shard(x[:, :prompt], world, group.rank()) for x in (k, v)))
        outs, at = [], prompt
        for t in steps:
            cache.append(k[:, at : at + t], v[:, at : at + t])
            at += t
            outs.append(cache.attention(q[:, at - t : at]))
        return outs

    with xcp.LocalWorld(world) as w:
        assert_steps(w.run(rank), q, k, v, prompt, steps)


def assert_steps(per_rank, q, k, v, prompt: int, steps) -> None:
    """Each rank's out of each step (``steps[i]`` new tokens after the prompt and the steps before) equals the
    causal reference over every token so far, to 1e-10."""
    at = prompt
    for i, t in enumerate(steps):
        at += t
        dout = torch.zeros(1, at, q.shape[2], v.shape[3], dtype=torch.float64)
        want = independent_masked_reference(q[:, :at], k[:, :at], v[:, :at], dout, (0, at), True)[0][:, at - t :]
        for outs in per_rank:
            assert outs[i].shape == want.shape and (outs[i] - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("capacity", [None, 64])
def test_kv_cache_with_values_in_keys(capacity):
    """KVCache(values_in_keys=Dv) stores the keys alone and reads the values as their first Dv channels (an
    absorbed MLA cache, 24/16 here as 576/512): every step's out equals the reference with v = k[..., :Dv],
    and the storage is that of the keys alone."""
    world, prompt, steps, dv = 3, 6, [1, 1, 5, 1], 16
    total = prompt + sum(steps)
    q, k, _, _ = tensors(total, 2, 1, 24, 24, seed=7)
    v = k[..., :dv]

    def rank(group):
        cache = xcp.KVCache(group=group, capacity=capacity, values_in_keys=dv)
        shared = xcp.KVCache(group=group, capacity=capacity)  # the same values stored apart
        for c, value in ((cache, None), (shared, v)):
            c.prefill(xcp.shard(k[:, :prompt], world, group.rank()), None if value is None else
                      xcp.shard(value[:, :prompt], world, group.rank()))  # fmt: skip
        outs, at = [], prompt
        for t in steps:
            cache.append(k[:, at : at + t], None)
            shared.append(k[:, at : at + t], v[:, at : at + t])
            at += t
            outs.append(cache.attention(q[:, at - t : at]))
        assert torch.equal(cache.values(), cache.keys()[..., :dv])
        assert cache.values().data_ptr() == cache.keys().data_ptr()  # a view, not a copy
        assert cache.nbytes * (24 + dv) == shared.nbytes * 24
        return outs

    with xcp.LocalWorld(world) as w:
        assert_steps(w.run(rank), q, k, v, prompt, steps)


def test_values_in_keys_errors():
    _, k, v, _ = tensors(8, 4, 2, 12, 8, seed=8)
    with pytest.raises(ValueError, match=r"values_in_keys: expected None or a positive integer .*; got 0"):
        xcp.KVCache(values_in_keys=0)
    cache = xcp.KVCache(values_in_keys=8)
    with pytest.raises(ValueError, match=r"v_l: expected None \(KVCache\(values_in_keys=8\) reads the values"):
        cache.prefill(k, v)
    with pytest.raises(ValueError, match="k_l: expected a head dim of at least values_in_keys=8 .*; got 6"):
        cache.prefill(k[..., :6], None)
    cache.prefill(k, None)
    with pytest.raises(ValueError, match=r"v: expected None"):
        cache.append(k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="k: expected head_dim 12 .*; got 16"):
        cache.append(torch.zeros(1, 1, 2, 16, dtype=k.dtype), None)
    with pytest.raises(TypeError, match="v_l: expected a torch.Tensor; got NoneType"):  # values of their own
        xcp.KVCache().prefill(k, None)


def test_value_shape_errors():
    q, k, v, _ = tensors(8, 4, 2, 12, 8, seed=6)
    with pytest.raises(ValueError, match=r"v: expected shape \(1, 8, 2, Dv\)"):
        xcp.attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"k: expected head_dim 12 \(that of q\); got 8"):
        xcp.attention(q, v, v)
    cache = xcp.KVCache()
    cache.prefill(k, v)
    with pytest.raises(ValueError, match="v: expected value head_dim 8 .*; got 12"):
        cache.append(k[:, :1], k[:, :1])


def test_a_backend_that_does_not_declare_value_head_dims_refuses_them():
    """A backend's kernels may take one head dim (``value_head_dims`` False, the default): such values are
    refused before any kernel runs, naming the backend; values of q's head dim still run."""
    from xcp.backends.cpu import CPUBackend

    class OneHeadDim(CPUBackend):
        name = "one-head-dim"
        value_head_dims = False

    q, k, v, _ = tensors(8, 4, 2, 12, 8, seed=7)
    with installed(OneHeadDim()):
        with pytest.raises(ValueError, match="v: expected head dim 12 .*backend 'one-head-dim' does not declare"):
            xcp.attention(q, k, v, device="one-head-dim")
        cache = xcp.KVCache(device="one-head-dim")
        cache.prefill(k, v)
        with pytest.raises(ValueError, match="v: expected head dim 12"):
            cache.attention(q[:, -1:])
        assert xcp.attention(q, k, k, device="one-head-dim").shape == q.shape
