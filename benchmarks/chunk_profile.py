"""Where the device time of a KV cache's chunk goes: a chunk of T tokens after L cached, over P virtual ranks of
one GPU and over a world of one (the same kernels on the whole cache), each under torch.profiler; prints the
kernels by total device time for both, so the split's cost shows kernel by kernel.

    PYTHONPATH=. python3 benchmarks/chunk_profile.py [--cached 131072] [--chunk 4096] [--world 8]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import xcp


def caches(world: xcp.LocalWorld | None, p: int, k: torch.Tensor, v: torch.Tensor, capacity: int) -> list:
    if world is None:
        cache = xcp.KVCache(capacity=capacity)
        cache.prefill(k, v)
        return [cache]
    out = []
    for r in range(p):
        cache = xcp.KVCache(group=world.group(r), capacity=capacity)
        cache.prefill(xcp.shard(k, p, r), xcp.shard(v, p, r))
        out.append(cache)
    return out


def chunk(world: xcp.LocalWorld | None, held: list, q, k, v) -> None:
    if world is None:
        held[0].append(k, v)
        held[0].attention(q)
        return

    def rank(group):
        held[group.rank()].append(k, v)
        return held[group.rank()].attention(q)

    world.run(rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    dev, dt, h, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    k, v = (torch.randn(1, args.cached, hkv, d, device=dev, dtype=dt) for _ in range(2))
    steps = [(torch.randn(1, args.chunk, n, d, device=dev, dtype=dt) for n in (h, hkv, hkv)) for _ in range(3)]
    steps = [tuple(s) for s in steps]
    capacity = args.cached + 3 * args.chunk
    for p in (1, args.world):
        world = None if p == 1 else xcp.LocalWorld(p, device=dev)
        held = caches(world, p, k, v, capacity)
        chunk(world, held, *steps[0])  # warm-up: kernels built, the configuration agreed
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for s in steps[1:]:
                chunk(world, held, *s)
            torch.cuda.synchronize()
        print(f"\n===== P {p}: two chunks of {args.chunk} after {args.cached} cached, kernels by device time")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=args.top, max_name_column_width=60))
        if world is not None:
            world.close()
        del held


if __name__ == "__main__":
    main()
