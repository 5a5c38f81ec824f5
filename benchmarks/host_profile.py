"""Where the host time of a ring step goes: one rank's forward+backward loop run alone (its exchanges a
loopback, its kernels returning cached outputs, as ``xcp bench --host`` runs it) under cProfile, and the
host time of a world-of-one call against torch SDPA's. Prints the functions with the most own time.

    PYTHONPATH=. python3 benchmarks/host_profile.py [--device cuda] [--world 8] [--tokens 2048]

Profiling slows Python down about twice; read the table for shares, ``xcp bench --host`` for the figure.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time

import torch

import xcp
from xcp.plugins import select_backend
from xcp.ring import RingConfig, ring_backward, ring_forward
from xcp.testing.doubles import LoopbackCommunicator, NullKernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = select_backend(args.device, device.type)
    null = NullKernels(backend)
    n, h, hkv, d = args.tokens, 32, 8, 128
    q = torch.randn(1, n, h, d, device=device, dtype=dtype)
    k = torch.randn(1, n, hkv, d, device=device, dtype=dtype)
    v = torch.randn(1, n, hkv, d, device=device, dtype=dtype)
    dout = torch.randn_like(q)
    cfg = RingConfig(LoopbackCommunicator(args.world, 0), null, True, 1 / math.sqrt(d), "zigzag")  # type: ignore[arg-type]

    def loop(calls: int) -> None:
        for _ in range(calls):
            out, lse = ring_forward(q, k, v, cfg)
            ring_backward(dout, q, k, v, out, lse, cfg)
        backend.synchronize(device)

    loop(5)
    t0 = time.perf_counter()
    loop(args.calls)
    per_call = (time.perf_counter() - t0) / args.calls * 1e6
    print(
        f"{args.device}: P = {args.world}, {n} tokens per rank, causal zigzag: {per_call:.0f} µs host per "
        f"forward+backward ({per_call / args.world:.0f} µs per step of both passes), kernels not run"
    )
    prof = cProfile.Profile()
    prof.enable()
    loop(args.calls)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())

    # a world of one: xcp.attention against SDPA, host time per call (kernels run, tiny problem)
    qs, ks, vs = (x[:, :128].detach().clone().requires_grad_() for x in (q, k, v))
    g = torch.randn_like(qs)

    def xcp_call() -> None:
        xcp.attention(qs, ks, vs, causal=True).backward(g)

    def sdpa_call() -> None:
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        o.backward(g.transpose(1, 2))

    for name, fn in (("xcp.attention", xcp_call), ("torch SDPA", sdpa_call)):
        for _ in range(20):
            fn()
        backend.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        backend.synchronize(device)
        print(
            f"world of one, 128 tokens, fwd+bwd: {name} {(time.perf_counter() - t0) / args.calls * 1e6:.0f} µs per call"
        )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        xcp_call()
    backend.synchronize(device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
