"""Where the host time of a KV cache's decode step goes: one rank's eager steps (``append`` of one token and
``attention`` of its query on a ``capacity`` cache, the combine's all-gather a loopback when P > 1, so the
rank runs alone) on a short cache, whose kernels are short: the wall time per step is the host's. Prints µs
per step for each P, then the functions with the most own and the most cumulative time under cProfile for
the last P. With ``--chunk T``, then the same for chunks of T tokens (wall time with the device's).

    PYTHONPATH=. python3 benchmarks/decode_host_profile.py [--device cuda] [--worlds 1,8] [--cached 1024]

Profiling slows Python down about twice; read the profile for shares, the first table for the figure.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import xcp
from xcp.testing.doubles import LoopbackCommunicator


def steps(cache: xcp.KVCache, q, k, v, n: int) -> None:
    for _ in range(n):
        cache.append(k, v)
        cache.attention(q)


def show(profile: cProfile.Profile, top: int) -> None:
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
        print(text.getvalue())


def host_us(fn, n: int = 300) -> float:
    """Host µs per call of ``fn`` (the device keeps running behind: a short cache's kernels are short)."""
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def op_floor(device: torch.device, b: int, h: int, hkv: int, d: int, room: int, dtype: torch.dtype) -> None:
    """What single launches cost on this host: the floor under a step's host time (CUDA only)."""
    if device.type != "cuda":
        return
    from xcp.plugins import select_backend
    from xcp_cuda.kernels import range_lengths

    q = torch.randn(b, h, d, device=device, dtype=dtype)
    k, v = (torch.randn(b * room, hkv, d, device=device, dtype=dtype) for _ in range(2))
    cum_q = torch.arange(b + 1, device=device, dtype=torch.int32)
    cum_k, used = cum_q * room, torch.full((b,), room // 2, device=device, dtype=torch.int32)
    counts, row = torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    store = torch.zeros(b, room, hkv, d, device=device, dtype=dtype)
    token = torch.randn(b, 1, hkv, d, device=device, dtype=dtype)
    launch = select_backend(None, "cuda")._range_launcher(q.view(b, 1, h, d))

    def flash() -> None:
        torch.ops.aten._flash_attention_forward(q, k, v, cum_q, cum_k, 1, room, 0.0, False, False, scale=0.1,
                                                seqused_k=used)  # fmt: skip

    figures = {
        "aten._flash_attention_forward (varlen, seqused_k)": flash,
        "index_copy_ of one token into the storage": lambda: store.index_copy_(1, row, token),
        "add_ to three int64": lambda: counts.add_(1),
        "the Triton lengths kernel (xcp_cuda)": lambda: range_lengths(b, 1, room, row, row + room // 2, launch),
    }
    print("host µs of one launch on this host:")
    for name, fn in figures.items():
        print(f"  {name:<52}{host_us(fn):7.1f}")
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worlds", default="1,8")
    ap.add_argument("--cached", type=int, default=1024, help="tokens each rank holds")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=0, help="then chunks of T tokens (0: none)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, hkv, d = 8, 32, 8, 128
    sync = getattr(torch.get_device_module(device.type), "synchronize", lambda: None)
    print(f"host µs per eager decode step of one rank (B {b}, {h}/{hkv} heads, D {d}, {dtype}, {args.cached} "
          f"tokens per rank, {device.type}; P > 1: the all-gather a loopback)")  # fmt: skip
    profile = None
    for world in (int(w) for w in args.worlds.split(",")):
        group = None if world == 1 else LoopbackCommunicator(world, 0)
        room = args.cached + 2 * args.steps + 16 + 6 * args.chunk
        cache = xcp.KVCache(group=group, capacity=world * room)
        kv = [torch.randn(b, args.cached, hkv, d, device=device, dtype=dtype) for _ in range(2)]
        cache.prefill(*kv) if world == 1 else cache.append(*(x.repeat(1, world, 1, 1) for x in kv))
        q, k, v = (torch.randn(b, 1, n, d, device=device, dtype=dtype) for n in (h, hkv, hkv))
        steps(cache, q, k, v, 20)
        sync()
        start = time.perf_counter()
        steps(cache, q, k, v, args.steps)
        host = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
        print(f"P {world}: {host / args.steps * 1e6:8.1f} µs per step on the host ({wall / args.steps * 1e6:8.1f} "
              "µs with the device's tail)")  # fmt: skip
        profile = cProfile.Profile()
        profile.enable()
        steps(cache, q, k, v, args.steps // 2)
        profile.disable()
        sync()
    op_floor(device, b, h, hkv, d, args.cached, dtype)
    if profile is not None:
        show(profile, args.top)
    if args.chunk and profile is not None:
        qc, kc, vc = (torch.randn(b, args.chunk, n, d, device=device, dtype=dtype) for n in (h, hkv, hkv))
        steps(cache, qc, kc, vc, 1)
        sync()
        start = time.perf_counter()
        steps(cache, qc, kc, vc, 2)
        sync()
        print(f"P {world}: chunk of {args.chunk}: {(time.perf_counter() - start) / 2 * 1e3:.2f} ms per chunk")
        profile = cProfile.Profile()
        profile.enable()
        steps(cache, qc, kc, vc, 2)
        sync()
        profile.disable()
        show(profile, args.top)


if __name__ == "__main__":
    main()
