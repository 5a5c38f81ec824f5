"""Why a ring step costs more host time among P virtual ranks than alone: the same loop (ring_forward then
ring_backward, kernels returning cached outputs as in ``xcp bench --host``) run by rank 0 alone with a
loopback exchange, then by every rank of a cooperative LocalWorld, each under cProfile. Prints the wall
µs per rank-step of both, and the functions whose own time per rank-step grew the most.

    PYTHONPATH=. python3 benchmarks/world_profile.py [--device cuda] [--world 8] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import sys
import time

import torch

from xcp.api import shard
from xcp.comm import LocalWorld
from xcp.plugins import select_backend
from xcp.ring import RingConfig, ring_backward, ring_forward
from xcp.testing.doubles import LoopbackCommunicator, NullKernels


def own_times(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Own (tottime) µs per rank-step of each function."""
    out = {}
    for (file, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        out[f"{file.split('/')[-1]}:{line}({name})"] = tottime / steps * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = select_backend(args.device, device.type)
    null = NullKernels(backend)
    p, n, h, hkv, d = args.world, args.tokens, 32, 8, 128
    if device.type == "cpu":
        h, hkv, d = 4, 2, 8
    full = [torch.randn(1, n * p, x, d, device=device, dtype=dtype) for x in (h, hkv, hkv, h)]
    shards = [tuple(shard(x, p, r) for x in full) for r in range(p)]
    scale = 1 / math.sqrt(d)
    steps = args.calls * p  # rank-steps of one rank: calls x P steps (each step one forward and one backward)

    def loop(cfg, q, k, v, dout, calls):
        for _ in range(calls):
            out, lse = ring_forward(q, k, v, cfg)
            ring_backward(dout, q, k, v, out, lse, cfg)

    # alone: rank 0 with a loopback exchange
    cfg0 = RingConfig(LoopbackCommunicator(p, 0), null, True, scale, "zigzag")  # type: ignore[arg-type]
    loop(cfg0, *shards[0], 3)
    backend.synchronize(device)
    t0 = time.perf_counter()
    loop(cfg0, *shards[0], args.calls)
    backend.synchronize(device)
    alone_wall = (time.perf_counter() - t0) / steps * 1e6
    prof = cProfile.Profile()
    prof.enable()
    loop(cfg0, *shards[0], args.calls)
    prof.disable()
    backend.synchronize(device)
    alone = own_times(pstats.Stats(prof), steps)

    # the world: every rank, one at a time (cooperative), each on its own stream
    world = LocalWorld(p, device=device, cooperative=True)
    streams = [backend.new_stream(device) for _ in range(p)]
    profs: dict[int, cProfile.Profile] = {}

    # Python >= 3.12 profiles through sys.monitoring, which sees every thread: one profiler around the run;
    # before, a profiler sees its own thread: one per rank
    per_thread = sys.version_info < (3, 12)

    def rank(group, calls, profiled):
        r = group.rank()
        cfg = RingConfig(group, null, True, scale, "zigzag")
        with null.stream_context(streams[r]):
            if profiled and per_thread:
                profs[r] = pr = cProfile.Profile()
                pr.enable()
            loop(cfg, *shards[r], calls)
            if profiled and per_thread:
                pr.disable()

    world.run(rank, 3, False)
    backend.synchronize(device)
    t0 = time.perf_counter()
    world.run(rank, args.calls, False)
    backend.synchronize(device)
    world_wall = (time.perf_counter() - t0) / steps / p * 1e6
    if per_thread:
        world.run(rank, args.calls, True)
    else:
        profs[0] = pr = cProfile.Profile()
        pr.enable()
        world.run(rank, args.calls, True)
        pr.disable()
    backend.synchronize(device)
    stats = pstats.Stats(profs[0])
    for r in range(1, len(profs)):
        stats.add(profs[r])
    in_world = {k: v / p for k, v in own_times(stats, steps).items()}

    print(
        f"{args.device}: P = {p}, {n} tokens per rank, causal zigzag, kernels not run: wall µs per rank-step "
        f"(forward + backward) alone {alone_wall:.0f}, in the world {world_wall:.0f} (unprofiled)"
    )
    print(f"own µs per rank-step under cProfile: alone {sum(alone.values()):.0f}, world {sum(in_world.values()):.0f}")
    print(f"\n{'world':>8} {'alone':>8} {'grew':>8}  function (own time per rank-step, µs; blocking waits included)")
    rows = sorted(in_world, key=lambda k: -(in_world[k] - alone.get(k, 0.0)))
    for k in rows[: args.top]:
        print(f"{in_world[k]:8.1f} {alone.get(k, 0.0):8.1f} {in_world[k] - alone.get(k, 0.0):8.1f}  {k}")


if __name__ == "__main__":
    main()
