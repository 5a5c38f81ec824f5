"""Which CUDA kernel serves the ring's blocks when values have another head dim (MLA: q/k 192, v 128), and
what each candidate costs: for the block shapes of an 8-rank zigzag causal ring (the diagonal causal block,
the two half-shard rectangles), forward and backward of cuDNN and memory-efficient, timed by CUDA events,
beside the same blocks at 128/128. Prints the backend's choice per block.

    python3 benchmarks/mla_blocks.py [--seq 65536] [--world 8] [--heads 32]
"""

from __future__ import annotations

import argparse
import functools

import torch

from xcp.plugins import select_backend
from xcp_cuda import kernels


def timed(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    n = args.seq // args.world
    h, dt = args.heads, torch.bfloat16
    backend = select_backend(None, "cuda")
    shapes = {"diagonal (causal)": (n, n, True), "lower (all q, half k)": (n, n // 2, False),
              "upper (half q, all k)": (n // 2, n, False)}  # fmt: skip
    print(f"blocks of an {args.world}-rank zigzag causal ring at S={args.seq}: {n} tokens per rank, {h} heads, bf16")
    print(f"{'block':<24}{'dims':>9}{'choice':>10} | {'kernel':<10}{'fwd ms':>9}{'bwd ms':>9}")
    for name, (sq, sk, causal) in shapes.items():
        for dqk, dv in ((192, 128), (128, 128)):
            q = torch.randn(1, sq, h, dqk, device="cuda", dtype=dt)
            k = torch.randn(1, sk, h, dqk, device="cuda", dtype=dt)
            v = torch.randn(1, sk, h, dv, device="cuda", dtype=dt)
            choice = backend.block_kernel(q, k, causal, v)
            ops = {"cudnn": (kernels.cudnn_forward, kernels.cudnn_backward),
                   "efficient": (kernels.efficient_forward, kernels.efficient_backward)}  # fmt: skip
            if dqk == dv:
                ops["flash"] = (kernels.flash_forward, kernels.flash_backward)
            for kind, (fwd, bwd) in ops.items():
                try:
                    out, lse = fwd(q, k, v, causal, 0.1)
                    dout = torch.randn_like(out)
                    f = timed(functools.partial(fwd, q, k, v, causal, 0.1))
                    b = timed(functools.partial(bwd, dout, q, k, v, out, lse, causal, 0.1))
                    print(f"{name:<24}{f'{dqk}/{dv}':>9}{choice:>10} | {kind:<10}{f:9.3f}{b:9.3f}")
                except Exception as exc:  # noqa: BLE001 - a kernel that refuses the shape, said why
                    print(f"{name:<24}{f'{dqk}/{dv}':>9}{choice:>10} | {kind:<10} refused: {str(exc)[:80]}")
            sdpa = kernels.sdpa_picks_cudnn(q, k, causal, v)
            print(f"{'':<24}{'':>9}{'':>10} | sdpa picks cudnn: {sdpa}")


if __name__ == "__main__":
    main()
