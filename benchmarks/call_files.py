"""Which of the repository's files one ``xcp.attention`` call runs code in, in the order first entered.

docs/architecture.md follows one call file by file; this lists the files the call really enters (Python
frames by ``sys.setprofile`` in every rank's thread), so the count there is
measured, not remembered. The first calls build the plugin registry, remember the backend chosen, plan and
cache; the call traced is the third of the same configuration, as in a training loop.

    python3 benchmarks/call_files.py --device cuda --world 2          # one forward on a GPU
    python3 benchmarks/call_files.py --device cpu --world 2 --backward
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

import xcp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xcp", "xcp_cuda", "xcp_npu")


def traced_files(device: str, world: int, backward: bool, dtype: torch.dtype) -> list[str]:
    """The repository files entered by the third of three equal calls, in order of first entry."""
    seen: dict[str, None] = {}
    tracing = threading.Event()

    def profile(frame, event, arg):  # noqa: ARG001 - the sys.setprofile signature
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
                seen.setdefault(str(path.relative_to(ROOT)), None)

    torch.manual_seed(0)
    q = torch.randn(1, 1024, 8, 64, device=device, dtype=dtype)
    k = torch.randn(1, 1024, 2, 64, device=device, dtype=dtype)
    v = torch.randn(1, 1024, 2, 64, device=device, dtype=dtype)
    shards = [[xcp.shard(x, world, r) for x in (q, k, v)] for r in range(world)]

    def rank(group):  # each rank traces its own thread while the flag is up
        q_l, k_l, v_l = (x.detach().clone().requires_grad_(backward) for x in shards[group.rank()])
        if tracing.is_set():
            sys.setprofile(profile)
        try:
            out = xcp.attention(q_l, k_l, v_l, causal=True, group=group)
            if backward:
                out.sum().backward()
        finally:
            sys.setprofile(None)
        return out.detach()

    with xcp.LocalWorld(world, device=device) as w:
        for _ in range(2):  # the first calls: registry, backend choice, plans, caches
            w.run(rank)
        tracing.set()
        w.run(rank)
    return list(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--backward",
        action="store_true",
        help="also .backward() (CPU: autograd on a GPU cannot run a waiting backward per virtual rank)",
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    files = traced_files(args.device, args.world, args.backward, dtype)
    what = "forward and backward" if args.backward else "forward"
    print(f"{len(files)} files, one {what} call on {args.device}, {args.world} virtual ranks, {dtype}:")
    for f in files:
        print(f"  {f}")


if __name__ == "__main__":
    main()
