"""How fast a ring's backward adds a block's bf16 gradient into its float32 accumulator on this GPU: the
mixed-dtype in-place add of torch against casting first and against the CUDA backend's Triton add (``fused_add_``,
what the ring uses), on the shapes of 64K over 8 ranks (32/8 heads, D = 128; 32 heads of 192 and 128 for MLA).
Prints µs per add (CUDA events, median of 20) and the bytes moved per µs.

    PYTHONPATH=. python3 benchmarks/accumulate_probe.py
"""

from __future__ import annotations

import torch

from benchmarks.device_varlen_check import timed as median_ms
from xcp_cuda import CUDABackend


def timed(fn) -> float:
    """Median µs of ``fn`` (CUDA events, 20 repetitions after one warm-up)."""
    return median_ms(fn, reps=20, warmup=1) * 1e3


def main() -> None:
    dev = torch.device("cuda")
    backend = CUDABackend()
    for rows, heads, dim in ((8192, 32, 128), (4096, 32, 128), (8192, 8, 128), (8192, 32, 192), (4096, 32, 192)):
        acc = torch.zeros(1, 8192, heads, dim, device=dev)
        view = acc[:, 8192 - rows :]
        g = torch.randn(1, rows, heads, dim, device=dev, dtype=torch.bfloat16)
        ideal = g.numel() * (2 + 4 + 4)  # read bf16, read and write float32
        for name, fn in (
            ("add_(bf16)", lambda v=view, g=g: v.add_(g)),
            ("add_(bf16.float())", lambda v=view, g=g: v.add_(g.float())),
            ("fused_add_", lambda v=view, g=g: backend.fused_add_(v, g)),
        ):
            us = timed(fn)
            rate = ideal / us / 1e3
            print(f"rows {rows:5d} heads {heads:2d} D {dim}  {name:20} {us:8.1f} µs  {rate:6.2f} GB/ms (useful)")


if __name__ == "__main__":
    main()
