"""A world of one: xcp.attention hands the whole call to a backend's ``whole_attention`` where it has one
(the CUDA backend's is torch SDPA), and runs its own kernels under its autograd Function otherwise.

Numerics against float64 math attention on the whole sequence; the CUDA backend's SDPA call is exercised
on CPU tensors (SDPA runs there too).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import independent_reference

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.kernels.math import math_forward
from xcp_cuda import CUDABackend


def _inputs(s=12, h=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(1, s, hkv, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(1, s, hkv, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    dout = torch.randn(1, s, h, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, scale):
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = math_forward(*x, "causal" if causal else "none", scale)
    out.backward(dout.double())
    return out.detach(), *(t.grad for t in x)


class Recording(CPUBackend):
    """The CPU backend with a ``whole_attention`` that records its calls and answers with SDPA."""

    name = "whole-recording"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def whole_attention(self, q, k, v, causal, scale):
        self.calls.append((tuple(q.shape), causal, scale))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)


@pytest.fixture
def recording():
    backend = Recording()

    class Plugin:
        @xcp.hookimpl
        def xcp_register_backends(self, register):
            register(backend)

    plugin = Plugin()
    xcp.register_plugin(plugin, name="whole-recording-plugin")
    try:
        yield backend
    finally:
        xcp.unregister_plugin(plugin)


@pytest.mark.parametrize("causal", [False, True])
def test_a_world_of_one_takes_the_backends_whole_attention(recording, causal):
    q, k, v, dout = _inputs(dtype=torch.float64)
    out = xcp.attention(q, k, v, causal=causal, device="whole-recording", scale=0.3)
    out.backward(dout)
    ref = _reference(q, k, v, dout, causal, 0.3)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert (got - want).abs().max().item() < 1e-10, name
    assert recording.calls == [((1, 12, 4, 16), causal, 0.3)]


def test_options_a_whole_attention_cannot_serve_take_the_ring_path(recording):
    """Sinks, documents, windows and worlds of several ranks never go to whole_attention."""
    q, k, v, _ = _inputs(dtype=torch.float64)
    sinks = torch.zeros(4, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12])
    xcp.attention(q, k, v, causal=True, device="whole-recording", sinks=sinks)
    xcp.attention(q, k, v, causal=True, device="whole-recording", cu_seqlens=cu)
    xcp.attention(q, k, v, causal=True, device="whole-recording", window=(3, 0))
    world = xcp.LocalWorld(2)
    shards = [[xcp.shard(x.detach(), 2, r) for x in (q, k, v)] for r in range(2)]
    world.run(lambda g: xcp.attention(*shards[g.rank()], causal=True, group=g, device="whole-recording"))
    assert recording.calls == []


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_cuda_backends_whole_attention_is_sdpa(causal, dtype, tol):
    """CUDABackend.whole_attention on CPU tensors (SDPA runs there): out and gradients like float64 math
    (bf16: 8 mantissa bits, sums of O(S) terms: 3e-2 of max |ref|); None where xcp's own kernels serve."""
    backend = CUDABackend()
    backend._capability = lambda device: (9, 0)
    q, k, v, dout = _inputs(dtype=dtype, d=16)
    scale = 1 / math.sqrt(16)
    before = [x.detach().clone() for x in (q, k, v)]
    out = backend.whole_attention(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    out.backward(dout)
    ref = _reference(q, k, v, dout, causal, scale)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), f"{name}: {err:.3g}"
    assert all(torch.equal(a.detach(), b) for a, b in zip((q, k, v), before))  # inputs untouched
    q64, k64, v64, _ = _inputs(dtype=torch.float64)
    assert backend.whole_attention(q64, k64, v64, causal, scale) is None  # float64: the math kernel
    repeat = CUDABackend(gqa="repeat")
    repeat._capability = lambda device: (9, 0)
    assert repeat.whole_attention(q, k, v, causal, scale) is None


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(causal=1), TypeError, "causal: expected a bool"),
        (dict(scale=-1.0), ValueError, "scale: expected a positive finite number"),
        (dict(scale=float("nan")), ValueError, "scale: expected a positive finite number"),
        (dict(balance="spiral"), ValueError, "balance"),
        (dict(slots="all"), ValueError, "slots"),
        (dict(k=lambda k: k.float()), TypeError, "k: expected dtype torch.float64"),
        (dict(v=lambda v: v[:, :6]), ValueError, "v: expected shape"),
        (dict(q=lambda q: q[0]), ValueError, "q: expected 4 dims"),
        (dict(q=lambda q: q[:, :, :3]), ValueError, "k: expected a number of heads that divides the 3 heads"),
        (dict(q=lambda q: q.int()), TypeError, "q: expected a floating-point dtype"),
    ],
)
def test_a_world_of_one_checks_every_argument_before_whole_attention(recording, change, error, words):
    """The world of one's short path checks what the general path checks: a bad argument gets the general
    path's error naming it, and whole_attention is never called."""
    q, k, v, _ = _inputs(dtype=torch.float64)
    args = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
    options = {"causal": True}
    for name, value in change.items():
        if name in args:
            args[name] = value(args[name])
        else:
            options[name] = value
    with pytest.raises(error, match=words):
        xcp.attention(args["q"], args["k"], args["v"], device="whole-recording", **options)
    assert recording.calls == []


def test_arguments_the_short_path_leaves_to_the_general_one_still_reach_whole_attention(recording):
    """An int scale is valid; the general path checks it and then asks whole_attention."""
    q, k, v, _ = _inputs(dtype=torch.float64)
    xcp.attention(q, k, v, causal=True, device="whole-recording", scale=1)
    assert recording.calls == [((1, 12, 4, 16), True, 1.0)]


def test_every_world_of_one_leaves_by_the_same_exit(recording):
    """No group, a LocalWorld of one rank's group, or a hand-off policy given: one way out, the backend's
    whole_attention, after the same checks."""
    q, k, v, _ = _inputs(dtype=torch.float64)
    xcp.attention(q, k, v, causal=True, device="whole-recording")
    xcp.attention(q, k, v, causal=True, device="whole-recording", handoff="none")
    q, k, v = (x.detach() for x in (q, k, v))
    xcp.LocalWorld(1).run(lambda g: xcp.attention(q, k, v, group=g, device="whole-recording"))
    assert recording.calls == [((1, 12, 4, 16), True, 0.25)] * 2 + [((1, 12, 4, 16), False, 0.25)]


@pytest.mark.parametrize("balance", ["zigzag", "contiguous", "stripe"])
def test_a_world_of_one_splits_any_length_everywhere(balance):
    """S = 63 (odd: zigzag over P ranks needs a multiple of 2P, but one shard is the whole sequence):
    xcp.shard, unshard, xcp.attention, KVCache.prefill and shard_batch all take it, and compute as on one
    device (float64 against the independent reference: summation order only)."""
    from xcp.integrations.transformers import shard_batch

    s = 63
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, s + 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    for x in (q, k, v):
        assert torch.equal(xcp.shard(x[:, :s], 1, 0, balance=balance), x[:, :s])
        assert torch.equal(xcp.unshard([x[:, :s]], balance=balance), x[:, :s])
    ql, kl, vl = (x[:, :s].clone().requires_grad_() for x in (q, k, v))
    out = xcp.attention(ql, kl, vl, causal=True, balance=balance)
    out.backward(dout[:, :s])
    want = independent_reference(q[:, :s], k[:, :s], v[:, :s], dout[:, :s], True)
    for got, ref in zip((out, ql.grad, kl.grad, vl.grad), (want.out, want.dq, want.dk, want.dv)):
        assert (got - ref).abs().max() < 1e-12
    whole = independent_reference(q, k, v, dout, True).out[:, s:]  # token s attends to tokens 0..s
    for capacity in (None, s + 4):
        cache = xcp.KVCache(group=xcp.LocalWorld(1).group(0), balance=balance, capacity=capacity)
        cache.prefill(k[:, :s], v[:, :s])
        cache.append(k[:, s:], v[:, s:])
        assert (cache.attention(q[:, s:], causal=True) - whole).abs().max() < 1e-12
    ids = torch.arange(s).unsqueeze(0)
    with xcp.context(balance=balance) as ctx:
        batch = shard_batch(ids, labels=ids, ctx=ctx)
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.position_ids, ids)
    assert batch.shift_labels.tolist() == [list(range(1, s)) + [-100]] and batch.num_items_in_batch == s - 1
