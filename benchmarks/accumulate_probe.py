"""How fast a ring's backward adds a block's bf16 gradient into its float32 accumulator on this GPU: the
mixed-dtype in-place add the ring uses against casting first, on the shapes of 64K over 8 ranks (32/8 heads,
D = 128). Prints µs per add (CUDA events, median of 20) and the bytes moved per µs.

    PYTHONPATH=. python3 benchmarks/accumulate_probe.py
"""

from __future__ import annotations

import torch

from benchmarks.device_varlen_check import timed as median_ms


def timed(fn) -> float:
    """Median µs of ``fn`` (CUDA events, 20 repetitions after one warm-up)."""
    return median_ms(fn, reps=20, warmup=1) * 1e3


def main() -> None:
    dev = torch.device("cuda")
    for rows, heads in ((8192, 32), (4096, 32), (8192, 8)):
        acc = torch.zeros(1, 8192, heads, 128, device=dev)
        view = acc[:, 8192 - rows :]
        g = torch.randn(1, rows, heads, 128, device=dev, dtype=torch.bfloat16)
        ideal = g.numel() * (2 + 4 + 4)  # read bf16, read and write float32
        for name, fn in (
            ("add_(bf16)", lambda v=view, g=g: v.add_(g)),
            ("add_(bf16.float())", lambda v=view, g=g: v.add_(g.float())),
        ):
            us = timed(fn)
            print(f"rows {rows:5d} heads {heads:2d}  {name:20} {us:8.1f} µs  {ideal / us / 1e3:6.2f} GB/ms (useful)")


if __name__ == "__main__":
    main()
