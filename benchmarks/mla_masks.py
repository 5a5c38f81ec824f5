"""What a ring's blocks cost per (query, key) pair at q/k 192, v 128 on the CUDA backend, through the calls the
ring makes (``backend.forward`` / ``backward``): the causal diagonal, stripe's strictly causal block as the ring
runs it (causal on views shifted by one row), and the unmasked blocks of zigzag with their backward as one
unmasked call against causal calls on squares and reversed squares (``causal_backward``), with the largest
relative difference of the two forms' gradients.

    python3 benchmarks/mla_masks.py [--sizes 2048,4096,8192,16384] [--heads 32]
"""

from __future__ import annotations

import argparse
import functools

import torch
from mla_blocks import timed  # this folder, run as a script

from xcp_cuda import CUDABackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    one, halves = CUDABackend(causal_backward=False), CUDABackend(causal_backward=True)
    h, dt, scale = args.heads, torch.bfloat16, 192**-0.5
    print(f"{'block':<30}{'backward':>10}{'fwd ms':>9}{'bwd ms':>9}{'fwd/Gpair':>11}{'bwd/Gpair':>11}  differs by")
    for n in (int(x) for x in args.sizes.split(",")):
        cases = [
            ("causal", n, n, "causal", 0),
            ("causal, shifted views", n, n, "causal", 1),  # stripe, src > r: rows 1.. against keys ..n-2
            ("none", n, n // 2, "none", 0),
            ("none", n // 2, n, "none", 0),
            ("none", n, n, "none", 0),
        ]
        for label, sq, sk, mask, shift in cases:
            q = torch.randn(1, sq, h, 192, device="cuda", dtype=dt)[:, shift:]
            k = torch.randn(1, sk, h, 192, device="cuda", dtype=dt)[:, : sk - shift]
            v = torch.randn(1, sk, h, 128, device="cuda", dtype=dt)[:, : sk - shift]
            dout = torch.randn(1, sq, h, 128, device="cuda", dtype=dt)[:, shift:]
            pairs = q.shape[1] * k.shape[1] if mask == "none" else q.shape[1] * (k.shape[1] + 1) / 2
            fwd = functools.partial(one.forward, q, k, v, mask, scale)
            out, lse = fwd()
            f = timed(fwd)
            forms = (("one call", one), ("causal", halves)) if mask == "none" else (("one call", one),)
            grads = []
            for form, be in forms:
                bwd = functools.partial(be.backward, dout, q, k, v, out.to(dt), lse, mask, scale)
                grads.append(bwd())
                b = timed(bwd)
                differs = ""
                if len(grads) == 2:
                    rel = (((a.float() - c.float()).norm() / c.float().norm()).item() for a, c in zip(*grads))
                    differs = f"{max(rel):.1e}"
                name = f"{label} {q.shape[1]}x{k.shape[1]}"
                print(f"{name:<30}{form:>10}{f:9.3f}{b:9.3f}{f / pairs * 1e9:11.3f}{b / pairs * 1e9:11.3f}  {differs}")
            del q, k, v, dout, out, lse, fwd, grads
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
