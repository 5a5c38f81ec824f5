"""How fast a ring's backward adds a block's bf16 gradient into its float32 accumulator on this GPU: the
mixed-dtype in-place add the ring uses against casting first, on the shapes of 64K over 8 ranks (32/8 heads,
D = 128). Prints µs per add (CUDA events, median of 20) and the bytes moved per µs.

    PYTHONPATH=. python3 benchmarks/accumulate_probe.py
"""

from __future__ import annotations

import statistics

import torch


def timed(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


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
