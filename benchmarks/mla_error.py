"""bf16 error of the ring with values of another head dim (MLA: q/k 192, v 128) against float64 attention,
beside torch SDPA's own bf16 error against the same float64 reference: out, dq, dk, dv, relative 2-norm.
The issue's bar: the ring's error within 1.5x of SDPA's.

    python3 benchmarks/mla_error.py [--seq 8192] [--world 8] [--heads 8] [--balance zigzag]
        [--causal-backward-min N]

``--causal-backward-min`` sets the fewest rows of the squares an unmasked block's backward runs as causal
calls (``xcp_cuda.backend.CAUSAL_BACKWARD_MIN``, 8192): lower, small sequences take that path too.
"""

from __future__ import annotations

import argparse

import torch

from xcp.cli.bench.virtual import VirtualRing, check_against_whole_kernel
from xcp.cli.common import error
from xcp.plugins import select_backend
from xcp_cuda import backend as cuda_backend


def reference(q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    """out, dq, dk, dv of SDPA on the given tensors (float64 ones: the exact reference), [B, S, H, D]."""
    leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    grads = torch.autograd.grad(out, leaves, dout.transpose(1, 2))
    return [x.transpose(1, 2) for x in (out.detach(), *grads)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--balance", default="zigzag")
    ap.add_argument("--causal-backward-min", type=int, default=cuda_backend.CAUSAL_BACKWARD_MIN)
    args = ap.parse_args()
    cuda_backend.CAUSAL_BACKWARD_MIN = args.causal_backward_min
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, h = args.seq, args.heads
    full = [torch.randn(1, s, h, d, device="cuda", generator=gen, dtype=torch.float64).to(torch.bfloat16)
            for d in (192, 192, 128, 128)]  # fmt: skip
    exact = reference(*(x.double() for x in full), causal=True)
    sdpa = reference(*full, causal=True)
    ring = VirtualRing(select_backend(None, "cuda"), args.world, tuple(full), True, args.balance)
    results = ring.run(backward=True)
    got = check_against_whole_kernel(ring, results, exact[0], exact[1:])
    print(f"S {s}, {h} heads (MHA), q/k 192, v 128, bf16, causal, {args.world} ranks, {args.balance}, causal "
          f"backward from {args.causal_backward_min} rows: relative 2-norm error against float64")  # fmt: skip
    print(f"{'':6}{'ring':>10}{'SDPA':>10}{'ratio':>8}")
    worst = 0.0
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        mine, theirs = got[name], error(sdpa[i], exact[i]).rel
        worst = max(worst, mine / theirs)
        print(f"{name:<6}{mine:10.3e}{theirs:10.3e}{mine / theirs:8.3f}")
    print(f"worst ratio {worst:.3f} (bar: 1.5)")


if __name__ == "__main__":
    main()
