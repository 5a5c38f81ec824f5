"""Where the GPU time of a ring goes: P virtual ranks on one GPU run one forward+backward (as ``xcp bench``
runs them) under torch.profiler, and the kernels' time is summed by kind (attention, merge, copies,
accumulations, casts, fills, other) next to one whole-sequence call of the same kernel.

    PYTHONPATH=. python3 benchmarks/ring_profile.py [--seq 65536] [--world 8] [--mask causal] [--balance zigzag]
        [--heads 32 --kv-heads 8 --head-dim 128 --value-head-dim 128]

The sum of kernel times of the ring minus that of the whole call is the device-side overhead; the wall
time minus the sum is where the device waited (host work, hand-overs, waits between streams).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from xcp.cli.bench import VirtualRing
from xcp.cli.common import Problem, add_problem_flags, problem_args, random_inputs, whole_kernel
from xcp.plugins import select_backend

KINDS = (
    ("attention", ("cudnn", "fmha", "flash", "attention", "sm90", "sm100")),
    ("merge", ("merge_kernel", "merge_pair_kernel")),
    ("copy", ("copy", "memcpy")),
    ("add", ("add", "sum", "reduce")),
    ("cast", ("to_copy", "convert", "cast")),
    ("fill", ("fill", "zero", "memset")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, words in KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def kernel_times(fn, device) -> tuple[float, dict[str, list[float]], dict[str, float]]:
    """Wall ms of ``fn`` under the profiler, and the device time (ms) and count of each kernel name."""
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) * 1e3
    names: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = names[ev.name]
            entry[0] += ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e3
            entry[1] += 1
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, (ms, _) in names.items():
        kinds[kind_of(name)] += ms
    return wall, names, kinds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mask", choices=("causal", "full"), default="causal")
    ap.add_argument("--top", type=int, default=12)
    add_problem_flags(ap, Problem(), ("heads", "kv_heads", "head_dim", "value_head_dim", "balance"))
    args = ap.parse_args()
    device = torch.device("cuda")
    backend = select_backend("cuda", "cuda")
    problem = Problem(**problem_args(args, ("heads", "kv_heads", "head_dim", "value_head_dim", "balance")))
    full = random_inputs(problem, args.seq, device)
    causal = args.mask == "causal"
    ring = VirtualRing(backend, args.world, full, causal, problem.balance)
    for _ in range(2):
        ring.run(True)
        whole_kernel(backend, full, causal, True)
    torch.cuda.synchronize(device)
    rows = []
    for label, fn in (("whole", lambda: whole_kernel(backend, full, causal, True)), ("ring", lambda: ring.run(True))):
        wall, names, kinds = kernel_times(fn, device)
        rows.append((label, wall, names, kinds))
    heads, dims = f"{problem.heads}/{problem.kv_heads}", f"{problem.head_dim}/{problem.value_dim}"
    print(f"S = {args.seq}, P = {args.world}, {args.mask}, {problem.balance}, {heads} heads, D = {dims}, bf16, "
          "fwd+bwd; device ms by kind")  # fmt: skip
    order = [k for k, _ in KINDS] + ["other"]
    print(f"{'':6} {'wall':>8} {'kernels':>8} | " + " ".join(f"{k:>9}" for k in order))
    for label, wall, _, kinds in rows:
        total = sum(kinds.values())
        print(f"{label:6} {wall:8.2f} {total:8.2f} | " + " ".join(f"{kinds.get(k, 0.0):9.2f}" for k in order))
    for label, _, names, _ in rows:
        print(f"\n{label}: the {args.top} kernels with the most device time (ms, calls, kind)")
        for name, (ms, n) in sorted(names.items(), key=lambda x: -x[1][0])[: args.top]:
            print(f"  {ms:9.2f} {n:6d}  {kind_of(name):9} {name[:110]}")


if __name__ == "__main__":
    main()
