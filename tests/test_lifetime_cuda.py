"""The lifetime rules on a real CUDA device: PyTorch's own sanitizer, graph capture, allocator statistics.

The ring runs here on a test-local backend with torch's generic CUDA streams and the math block kernel
(device-agnostic torch ops), so these tests check xcp's stream plumbing and buffers, not a vendor kernel.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import xcp
from xcp.backends.base import Backend
from xcp.kernels.math import math_backward, math_forward
from xcp.lifetime import track_buffers, workspace_disabled
from xcp.ring import RingConfig, ring_backward, ring_forward
from xcp.testing.reference import sdpa_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class CudaMath(Backend):
    """Generic CUDA streams and events (from the Backend defaults), the math kernel, record_stream."""

    name = "cuda-math-test"
    device_type = "cuda"
    dist_backend = "nccl"
    handoff_policy = "record_stream"
    dtypes = (torch.float64, torch.float32, torch.bfloat16)

    def is_capturing(self):
        return torch.cuda.is_current_stream_capturing()

    def forward(self, q, k, v, mask, scale):
        return math_forward(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        return math_backward(dout, q, k, v, out, lse, mask, scale)


def run_world(world, handoff, causal=True, seed=0):
    """Forward and backward on ``world`` virtual ranks of one GPU, each rank on its own caller stream."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_q, shape_kv = (1, 8 * world, 4, 16), (1, 8 * world, 2, 16)
    q, do = (torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.float64) for _ in range(2))
    backend = CudaMath()
    producer = torch.cuda.current_stream()  # made the inputs; every rank's stream must wait for it

    def rank(g):
        stream = torch.cuda.Stream()
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            ql, kl, vl, dl = (xcp.shard(x, world, g.rank()) for x in (q, k, v, do))
            cfg = RingConfig(g, backend, causal, 1 / math.sqrt(16), handoff=handoff)
            with track_buffers() as led:
                out, lse = ring_forward(ql, kl, vl, cfg)
                grads = ring_backward(dl, ql, kl, vl, out, lse, cfg)
            torch.cuda.current_stream().synchronize()
            return led.peak_kv_shards, (out, *grads)

    results = xcp.LocalWorld(world, device="cuda").run(rank)
    qr, kr, vr = (x.detach().cpu().requires_grad_() for x in (q, k, v))
    ref = sdpa_reference(qr, kr, vr, causal)  # float64 on the CPU
    want = (ref, *torch.autograd.grad(ref, (qr, kr, vr), do.cpu()))
    errors = [(xcp.unshard([r[1][i] for r in results]).cpu() - w).abs().max().item() for i, w in enumerate(want)]
    return [r[0] for r in results], errors


@pytest.mark.parametrize("handoff", ["record_stream", "clone", "event"])
def test_cuda_ring_matches_the_reference_with_each_handoff(handoff):
    peaks, errors = run_world(4, handoff)
    assert peaks == [4] * 4
    assert max(errors) < 1e-10  # float64 on the GPU: only the summation order differs


CSAN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import xcp, test_lifetime_cuda as t
    from xcp.lifetime import RingCall
    handoff, variant, what, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if variant == "mutant" and what == "ring":
        RingCall.comm_after_compute = lambda self: None  # the receive no longer waits for the compute
    if variant == "mutant" and what == "cache":  # the combine's hand-off dropped: M reads the partial unordered
        RingCall.hand_to_comm = lambda self, tensors, channel, ordered=False: list(tensors)
    t.sanitize_every_rank()
    if what == "ring":
        peaks, errors = t.run_world(world, handoff)
        print("clean", peaks, max(errors))
    else:
        print("clean cache", t.run_cache_world(world, handoff))
    """
)


def sanitize_every_rank():
    """PyTorch's CUDA sanitizer on, its dispatch mode (per thread) entered in every LocalWorld rank's thread."""
    import torch.cuda._sanitizer as csan

    csan.enable_cuda_sanitizer()
    run = xcp.LocalWorld.run

    def run_sanitized(self, fn, *args):
        def body(g, *a):
            with csan.cuda_sanitizer.dispatch:
                return fn(g, *a)

        return run(self, body, *args)

    xcp.LocalWorld.run = run_sanitized


def csan(handoff, variant, what="ring", world=4):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = CSAN_SCRIPT.format(root=root, tests=os.path.join(root, "tests"))
    return subprocess.run([sys.executable, "-c", script, handoff, variant, what, str(world)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("handoff", ["record_stream", "clone"])
def test_pytorch_cuda_sanitizer_reports_nothing(handoff):
    done = csan(handoff, "correct")
    assert done.returncode == 0 and "clean [4, 4, 4, 4]" in done.stdout, done.stdout + done.stderr
    assert "CSAN detected a possible data race" not in done.stderr


def test_pytorch_cuda_sanitizer_sees_the_missing_wait():
    done = csan("record_stream", "mutant")  # proves the sanitizer is really watching the rank threads
    assert done.returncode != 0
    report = done.stderr
    assert "CSAN detected a possible data race" in report
    assert "/xcp/" in report.split("Previous access")[0]  # the racing access is the ring's, not the test's
    assert "aten::randn" not in report  # and not the inputs' creation
    assert "CSAN detected a possible data race" in done.stdout + done.stderr


def run_cache_world(world, handoff, decode=3, chunk=3, seed=0):
    """A KV cache with capacity (the graph-safe decode path) on ``world`` virtual ranks of one GPU, each rank
    on its own caller stream: a prompt, ``decode`` steps of one token, one chunk; bf16 on the cuda backend
    (flash for the storage range). Returns the largest relative error of any rank's output at any step
    against float64 attention over the whole sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    prompt = 4 * world  # zigzag: a multiple of 2P
    steps = [1] * decode + [chunk]
    total = prompt + sum(steps)
    q = torch.randn(1, total, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, total, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    producer = torch.cuda.current_stream()  # made the inputs; every rank's stream must wait for it

    def rank(g):
        stream = torch.cuda.Stream()
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            r = g.rank()
            cache = xcp.KVCache(group=g, capacity=total, handoff=handoff)
            cache.prefill(xcp.shard(k[:, :prompt], world, r), xcp.shard(v[:, :prompt], world, r))
            outs, s = [], prompt
            for t in steps:
                cache.append(k[:, s : s + t], v[:, s : s + t])
                s += t
                outs.append(cache.attention(q[:, s - t : s]))
            torch.cuda.current_stream().synchronize()
            return [out.cpu() for out in outs]

    results = xcp.LocalWorld(world, device="cuda").run(rank)
    qd, kd, vd = (x.cpu().double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1)
    worst, s = 0.0, prompt
    for i, t in enumerate(steps):
        s += t
        seen = torch.arange(s).view(1, s) <= torch.arange(s - t, s).view(t, 1)  # causal, bottom-right
        want = torch.nn.functional.scaled_dot_product_attention(qd[:, :, s - t : s], kd[:, :, :s], vd[:, :, :s],
                                                                attn_mask=seen).transpose(1, 2)  # fmt: skip
        for outs in results:
            worst = max(worst, ((outs[i].double() - want).norm() / want.norm()).item())
    return worst


@pytest.mark.parametrize("handoff", ["record_stream", "clone", "event"])
def test_cuda_cache_matches_the_reference_with_each_handoff(handoff):
    assert run_cache_world(3, handoff) < 2e-2  # bf16's bound


@pytest.mark.parametrize("handoff", ["record_stream", "clone"])
def test_pytorch_cuda_sanitizer_reports_nothing_in_the_cache_combine(handoff):
    """Decode steps and a chunk of a KV cache over 3 virtual ranks under CSAN: the combine's packed partial,
    written on the caller's stream and gathered on the comm stream, is handed off without a race."""
    done = csan(handoff, "correct", "cache", 3)
    assert done.returncode == 0 and "clean cache" in done.stdout, done.stdout + done.stderr
    assert float(done.stdout.split("clean cache")[1].split()[0]) < 2e-2
    assert "CSAN detected a possible data race" not in done.stderr


def test_pytorch_cuda_sanitizer_sees_the_cache_combine_without_its_hand_off():
    """With the combine's hand-off dropped (the comm stream no longer waits for the partial's writes), CSAN
    reports the race, and the racing access is xcp's."""
    done = csan("record_stream", "mutant", "cache", 3)
    assert done.returncode != 0
    report = done.stderr
    assert "CSAN detected a possible data race" in report, done.stdout + report
    assert "/xcp/" in report.split("Previous access")[0]
    assert "aten::randn" not in report


class MirrorComm:
    """A ring of ``size`` ranks that all hold the same shards, simulated by one rank: each exchange copies
    what it sends into what it receives, on the current stream. Non-causal attention over P copies of one
    shard equals attention over the shard, so the result has a one-call reference."""

    ranks_are_threads = False

    def __init__(self, size):
        self._size, self.store = size, {}

    def rank(self):
        return 0

    def size(self):
        return self._size

    def rank_store(self):
        return self.store

    def exchange(self, sends, recvs, tag, backend, step=None):
        stream = backend.current_stream()
        for (buf, _), (t, _) in zip(recvs, sends):
            buf.copy_(t)
        done = backend.new_event()
        backend.record_event(done, stream)
        return Done(backend, done)


class Done:
    def __init__(self, backend, event):
        self.backend, self.event = backend, event

    def wait(self):
        self.backend.wait_event(self.backend.current_stream(), self.event)


def test_graph_capture_replays_like_eager():
    backend, world = CudaMath(), 4
    cfg = RingConfig(MirrorComm(world), backend, False, 0.25, balance="contiguous", handoff="record_stream")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=gen, device="cuda") for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = ring_forward(q, k, v, cfg)[0]  # warm-up: fills the workspace, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), track_buffers() as led:
        captured = ring_forward(q, k, v, cfg)[0]
    assert led.allocations == 0 and led.peak_kv_shards == 2  # rule 4: the slots came from the workspace
    for x in (q, k, v):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
    graph.replay()
    again = ring_forward(q, k, v, cfg)[0]
    torch.cuda.synchronize()
    want = sdpa_reference(q, k, v, False).float()  # on the CPU
    assert (captured - again).abs().max().item() < 1e-6  # same kernels, same order: float32 rounding only
    assert (captured.cpu() - want).abs().max().item() < 1e-5  # float32 against float64 SDPA
    assert not torch.equal(eager, captured)  # the replay really used the new inputs


def test_ledger_peak_agrees_with_the_allocator():
    backend, world = CudaMath(), 8
    policies = ("bounded", "keep_all")
    cfg = {p: RingConfig(MirrorComm(world), backend, False, 0.1, "contiguous", slots=p) for p in policies}
    q, k, v = (torch.randn(1, 1024, 2, 128, device="cuda") for _ in range(3))  # K and V: 1 MiB each
    measured, ledger = {}, {}
    for policy in policies:
        with workspace_disabled():
            ring_forward(q, k, v, cfg[policy])  # warm the kernels and the allocator's pools
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with track_buffers() as led:
                out = ring_forward(q, k, v, cfg[policy])[0]
            torch.cuda.synchronize()
        measured[policy] = torch.cuda.max_memory_allocated() - base
        ledger[policy] = led.peak_bytes
        del out
    shard = 2 * 2**20
    assert ledger["bounded"] == 2 * shard and ledger["keep_all"] == (world - 1) * shard
    # same kernels and temporaries in both runs: the allocator's extra peak is exactly the extra slots
    # (1 MiB tensors are multiples of the allocator's 512-byte rounding, so no margin is needed)
    assert measured["keep_all"] - measured["bounded"] == ledger["keep_all"] - ledger["bounded"]
