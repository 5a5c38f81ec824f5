"""Probe: can the work of every virtual rank of a cooperative LocalWorld (threads, each on its own stream)
be captured into one CUDA graph from the calling thread? Tries each capture error mode; prints whether the
capture worked, whether the replay equals eager, and replay vs eager times at one size.

Run on a CUDA machine: PYTHONPATH=. python3 benchmarks/world_graph_probe.py [SEQ] [P]
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from xcp.cli.bench import VirtualRing
from xcp.cli.common import random_inputs, tool_backend, whole_kernel


class _Problem:
    batch, heads, kv_heads, head_dim, dtype = 1, 32, 8, 128, "bfloat16"


def _time(fn, reps=10):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    backend, _ = tool_backend("cuda", 0)
    full = random_inputs(_Problem(), seq, torch.device("cuda"))
    for causal in (False, True):
        for mode in ("thread_local", "relaxed", "global"):
            ring = VirtualRing(backend, world, full, causal, "zigzag")
            for _ in range(3):
                eager = ring.run(True)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, capture_error_mode=mode):
                    captured = ring.run(True)
                graph.replay()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a probe reports every failure
                print(f"causal={causal} mode={mode}: capture FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=3)
                torch.cuda.synchronize()
                continue
            eager = ring.run(True)
            torch.cuda.synchronize()
            same = all(torch.equal(a[1], b[1]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
                       for a, b in zip(eager, captured))  # fmt: skip
            t_eager = _time(lambda r=ring: r.run(True))
            t_replay = _time(graph.replay)
            wg = torch.cuda.CUDAGraph()
            whole_kernel(backend, full, causal, True)
            torch.cuda.synchronize()
            with torch.cuda.graph(wg):
                whole_kernel(backend, full, causal, True)
            t_whole = _time(lambda c=causal: whole_kernel(backend, full, c, True))
            t_whole_replay = _time(wg.replay)
            print(
                f"S={seq} P={world} causal={causal} mode={mode}: captured ok, replay equals eager: {same}; fwd+bwd "
                f"eager {t_eager * 1e3:.2f} ms, replay {t_replay * 1e3:.2f} ms, whole {t_whole * 1e3:.2f} ms, "
                f"whole replay {t_whole_replay * 1e3:.2f} ms; ratio eager {t_eager / t_whole:.3f}, "
                f"replay {t_replay / t_whole_replay:.3f}",
                flush=True,
            )
            del graph, wg, captured
            break


if __name__ == "__main__":
    main()
