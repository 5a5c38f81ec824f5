"""The CUDA and Ascend backends on their devices: block kernels against float64 math, a ring over
LocalWorld, streams, hand-off, memory statistics and (CUDA) graph capture.

Each test skips with "needs a CUDA GPU" / "needs torch_npu" where that hardware or package is absent.
References are xcp.kernels.math.math_forward / math_backward in float64 on the CPU, fed the same (rounded) inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from strategies import assert_close_to

import xcp
from xcp.kernels.math import math_backward, math_forward
from xcp.lifetime import hand_off
from xcp.ring import RingConfig, ring_backward, ring_forward
from xcp_cuda import CUDABackend
from xcp_npu import NPUBackend

MASKS = ("none", "causal", "strict")
NEG_INF = float("-inf")
SKIP = {"cuda": "needs a CUDA GPU", "npu": "needs torch_npu"}


def _backend(name: str, **kwargs):
    backend = CUDABackend(**kwargs) if name == "cuda" else NPUBackend(**kwargs)
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"{SKIP[name]} ({reason})")
    return backend


# Tolerances, as a fraction of max(1, max |reference|), by input dtype. They cover the kernels' own
# rounding: bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3) and flash rounds P to bf16 before P·V, so
# outputs carry a few eps; gradients sum O(S) such terms with cancellation, hence twice that. fp16 has
# 11 bits (eps 4.9e-4). fp32 blocks run the memory-efficient kernel, whose fp32 GEMMs may use TF32 on
# sm80+ (11 bits). lse is computed from exact products with fp32 sums: ~1e-6 relative, except TF32.
TOL = {
    torch.bfloat16: {"out": 2e-2, "lse": 1e-3, "grad": 4e-2},
    torch.float16: {"out": 3e-3, "lse": 1e-3, "grad": 6e-3},
    torch.float32: {"out": 3e-3, "lse": 2e-3, "grad": 6e-3},
    torch.float64: {"out": 1e-10, "lse": 1e-10, "grad": 1e-10},
}


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def _kernel_cases(name):
    """(dtype, head_dim) per backend: each kernel path of the backend at least once."""
    if name == "cuda":  # flash (64 half), efficient (64 fp32, 20 fp32), math (20 half, fp64)
        half_and_fp32 = [(dt, d) for dt in (torch.bfloat16, torch.float16, torch.float32) for d in (64, 20)]
        return [*half_and_fp32, (torch.float64, 32)]
    return [(dt, d) for dt in (torch.bfloat16, torch.float16, torch.float32) for d in (64, 128)]


KERNEL_CASES = [
    pytest.param(name, dt, d, id=f"{name}-{str(dt).split('.')[-1]}-d{d}")
    for name in ("cuda", "npu")
    for dt, d in _kernel_cases(name)
]


@pytest.mark.parametrize("name,dtype,d", KERNEL_CASES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(128, 128), (33, 33), (80, 48), (48, 80)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2, "native"), (8, 2, "repeat")], ids=["mha", "gqa", "gqa-repeat"])
def test_block_kernel_against_float64_math(name, dtype, d, mask, sq, sk, heads):
    h, hkv = heads[0], heads[1]
    backend = _backend(name, **({"gqa": heads[2]} if len(heads) > 2 else {}))
    device = torch.device(name)
    b, scale = 2, 1 / math.sqrt(d)
    q, k, v = (_rand(s, dtype, device, i) for i, s in enumerate([(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)]))
    out, lse = backend.forward(q, k, v, mask, scale)
    assert out.device.type == name and lse.device.type == name
    assert lse.shape == (b, h, sq) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    qc, kc, vc = (x.cpu().double() for x in (q, k, v))
    ref_out, ref_lse = math_forward(qc, kc, vc, mask, scale)
    tol = TOL[dtype]
    assert_close_to("out", out, ref_out, tol["out"])
    assert_close_to("lse", lse, ref_lse, tol["lse"])

    # backward from a merged out/lse, as a ring step gets it: the row saw more keys in other blocks
    dout = _rand((b, sq, h, d), dtype, device, 10)
    merged_lse = torch.where(ref_lse == NEG_INF, 0.5, ref_lse + 0.25)
    merged_out = _rand((b, sq, h, d), dtype, device, 11)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    dq, dk, dv = backend.backward(dout, q, k, v, merged_out, merged_lse.to(acc).to(device), mask, scale)
    ref = math_backward(dout.cpu().double(), qc, kc, vc, merged_out.cpu().double(), merged_lse, mask, scale)
    for gname, got, want, x in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, (q, k, v)):
        assert got.shape == x.shape and got.device.type == name
        assert_close_to(gname, got, want, tol["grad"])


# ---------------------------------------------------------------------------------------------- a full ring
@pytest.mark.parametrize("name", ["cuda", "npu"])
@pytest.mark.parametrize("balance", ["zigzag", "stripe"])
def test_ring_on_local_world(name, balance):
    """P = 2 virtual ranks on one device: causal ring forward and backward (stripe uses strict blocks)
    against whole-sequence float64 math. bf16, GQA 8/2."""
    backend = _backend(name)
    device, dtype, p = torch.device(name), torch.bfloat16, 2
    b, s, h, hkv, d = 1, 256, 8, 2, 64
    scale = 1 / math.sqrt(d)
    q, k, v = (_rand(x, dtype, device, i) for i, x in enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d)]))
    dout = _rand((b, s, h, d), dtype, device, 9)
    shards = [[xcp.shard(x, p, r, balance=balance) for x in (q, k, v, dout)] for r in range(p)]

    def rank(group):
        ql, kl, vl, dl = shards[group.rank()]
        cfg = RingConfig(group, backend, True, scale, balance)
        out, lse = ring_forward(ql, kl, vl, cfg)
        return (out, *ring_backward(dl, ql, kl, vl, out, lse, cfg))

    results = xcp.LocalWorld(p, device).run(rank)
    got = [xcp.unshard([r[i] for r in results], balance=balance) for i in range(4)]
    qc, kc, vc, dc = (x.cpu().double() for x in (q, k, v, dout))
    ref_out, ref_lse = math_forward(qc, kc, vc, "causal", scale)
    ref = math_backward(dc, qc, kc, vc, ref_out, ref_lse, "causal", scale)
    tol = TOL[dtype]
    assert_close_to("out", got[0], ref_out, tol["out"])
    for gname, g, want in zip(("dq", "dk", "dv"), got[1:], ref):
        assert_close_to(gname, g, want, tol["grad"])


# ---------------------------------------------------------------------------------------------- streams, memory
@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_streams_events_and_handoff(name):
    backend = _backend(name)
    device = torch.device(name)
    main = backend.current_stream(device)
    side = backend.new_stream(device)
    x = torch.arange(1 << 20, dtype=torch.float32, device=device)
    done = backend.new_event()
    backend.wait_stream(side, main)
    with backend.stream_context(side):
        y = x * 2
        backend.record_event(done, side)
    backend.wait_event(main, done)
    handed = hand_off(backend, y, main, backend.handoff_policy)
    if backend.handoff_policy == "clone":
        assert handed is not y and handed.data_ptr() != y.data_ptr()
    else:
        assert handed is y
    backend.synchronize_event(done)
    assert torch.equal(handed, x * 2)


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_memory_statistics(name):
    backend = _backend(name)
    device = torch.device(name)
    backend.synchronize(device)  # blocks earlier tests handed to other streams are freed at the next
    torch.empty(1, device=device)  # allocation once their work has ended: let that happen before counting
    before = backend.memory_stats(device)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    during = backend.memory_stats(device)
    assert during["allocated"] - before["allocated"] >= 64 << 20
    assert during["peak"] >= during["allocated"]
    del x
    backend.reset_peak_memory(device)
    after = backend.memory_stats(device)
    assert after["peak"] == after["allocated"] < during["allocated"]


def test_cuda_graph_capture_of_the_block_kernels():
    """is_capturing() is True inside capture, and forward + backward replay to the eager results."""
    backend = _backend("cuda")
    device, dtype = torch.device("cuda"), torch.bfloat16
    q, k, v, dout = (_rand((1, 128, 8, 64), dtype, device, i) for i in range(4))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    scale = 0.125

    def step():
        out, lse = backend.forward(q, k, v, "strict", scale)
        return (out, lse, *backend.backward(dout, q, k, v, out, lse, "strict", scale))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    assert not backend.is_capturing()
    graph = torch.cuda.CUDAGraph()
    flags = []
    with torch.cuda.graph(graph):
        flags.append(backend.is_capturing())
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert flags == [True]
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])  # forward: deterministic
    for a, b in zip(captured[2:], eager[2:]):  # flash's backward adds dq with atomics: order may differ by a bf16 ulp
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
