"""The ``xcp`` command: run the checked demo, print or plot a ring plan, list backends."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import schedule


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {value}")
    return value


def _add_run(sub) -> None:
    from .demo import DTYPES, DemoConfig

    d = DemoConfig()
    p = sub.add_parser("run", help="ring attention on a LocalWorld (or under torchrun), checked against float64")
    p.add_argument("--world", type=_positive, default=d.world, help="virtual ranks (ignored under torchrun)")
    p.add_argument("--batch", type=_positive, default=d.batch)
    p.add_argument("--seq", type=_positive, default=d.seq, help="global sequence length")
    p.add_argument("--heads", type=_positive, default=d.heads)
    p.add_argument("--kv-heads", type=_positive, default=d.kv_heads)
    p.add_argument("--head-dim", type=_positive, default=d.head_dim)
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal)
    p.add_argument("--balance", choices=schedule.BALANCES, default=d.balance)
    p.add_argument("--device", default=d.device, help="backend name: cpu, cuda, npu, ...")
    p.add_argument("--seed", type=int, default=d.seed)


def _cmd_run(args) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(
        world=args.world,
        batch=args.batch,
        seq=args.seq,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        causal=args.causal,
        balance=args.balance,
        device=args.device,
        seed=args.seed,
    )
    result = run_demo(cfg)
    print(result.table())
    return 0 if result.ok else 1


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="print (or plot) the step x rank table of a ring plan")
    p.add_argument("--world", type=_positive, required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--balance", choices=schedule.BALANCES, default=schedule.DEFAULT_BALANCE)
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan into this file (needs matplotlib)")


def _cmd_plan(args) -> int:
    from .planview import plan_table, plot_plan

    print(plan_table(args.world, args.causal, args.balance))
    if args.plot:
        plot_plan(args.world, args.causal, args.balance, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _add_backends(sub) -> None:
    sub.add_parser("backends", help="list installed backends and whether each is usable here")


def _cmd_backends(args) -> int:
    from .plugins import backend_table

    rows = backend_table()
    head = ("name", "device", "collective", "hand-off", "plugin", "status")
    cells = [
        (
            r.name,
            r.device_type,
            r.dist_backend,
            r.handoff_policy,
            r.plugin,
            "available" if r.available else f"unavailable: {r.reason}",
        )
        for r in rows
    ]
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) for i in range(len(head) - 1)]
    for line in [head, *cells]:
        print("  ".join(f"{c:<{w}}" for c, w in zip(line, widths)) + "  " + line[-1])
    print()
    for r in rows:
        if r.kernel != "-":
            print(f"{r.name} kernel: {r.kernel}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1; got {text!r}")
    return values


def _add_bench(sub) -> None:
    from .bench import BenchConfig
    from .demo import DTYPES

    d = BenchConfig()
    p = sub.add_parser("bench", help="ring overhead vs one whole-sequence kernel, memory, graph capture")
    p.add_argument("--seqs", type=_ints, default=d.seqs, help="comma-separated sequence lengths")
    p.add_argument("--worlds", type=_ints, default=d.worlds, help="comma-separated virtual rank counts")
    p.add_argument("--mask", choices=("both", "causal", "full"), default="both")
    p.add_argument("--batch", type=_positive, default=d.batch)
    p.add_argument("--heads", type=_positive, default=d.heads)
    p.add_argument("--kv-heads", type=_positive, default=d.kv_heads)
    p.add_argument("--head-dim", type=_positive, default=d.head_dim)
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--reps", type=_positive, default=d.reps)
    p.add_argument("--memory-seq", type=_positive, default=d.memory_seq)
    p.add_argument("--memory-worlds", type=_ints, default=d.memory_worlds)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the graph-capture figure")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw ratio vs S and memory vs P")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--distributed", action="store_true", help="real ranks under torchrun, one device each")
    p.add_argument("--check-seq", type=_positive, default=32768, help="--distributed: length of the correctness check")
    p.add_argument("--reference-seq", type=_positive, default=65536, help="--distributed: whole-sequence reference")


def _cmd_bench(args) -> int:
    from .bench import BenchConfig, format_report, plot_report, run_bench, write_json

    if args.distributed:
        return _cmd_bench_distributed(args)

    cfg = BenchConfig(
        seqs=args.seqs,
        worlds=args.worlds,
        causal={"both": [False, True], "causal": [True], "full": [False]}[args.mask],
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device=args.device,
        warmup=args.warmup,
        reps=args.reps,
        memory_seq=args.memory_seq,
        memory_worlds=args.memory_worlds,
        graph=args.graph,
        check=args.check,
    )
    report = run_bench(cfg, progress=not args.quiet, checkpoint=args.json)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    failed = [r for r in report["timing"] if not all(r.get(f"{m}_check_ok", True) for m in ("fwd", "fwd_bwd"))]
    return 1 if failed else 0


def _cmd_bench_distributed(args) -> int:
    from .bench import write_json
    from .distbench import DistBenchConfig, format_distributed, run_distributed_bench

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("--distributed: expected to run under torchrun (RANK and WORLD_SIZE set); they are not")
    cfg = DistBenchConfig(
        check_seq=args.check_seq,
        seqs=args.seqs,
        reference_seq=args.reference_seq,
        memory_seq=args.memory_seq,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device=args.device,
        warmup=args.warmup,
        reps=args.reps,
    )
    try:
        report = run_distributed_bench(cfg)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if report is None:
        return 0
    print(format_distributed(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    return 0 if report["check"]["ok"] else 1


def _add_sanitize(sub) -> None:
    from .backend import HANDOFF_POLICIES
    from .demo import DTYPES
    from .lifetime import POLICIES

    p = sub.add_parser("sanitize", help="run the ring under the CPU lifetime sanitizer; exit 1 on any finding")
    p.add_argument("--world", type=_positive, default=4)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--balance", choices=schedule.BALANCES, default=schedule.DEFAULT_BALANCE)
    p.add_argument("--handoff", choices=HANDOFF_POLICIES, default=None, help="default: the sim backend's own")
    p.add_argument("--backward", action="store_true", help="also run the backward ring (bound: 4 shards)")
    p.add_argument("--policy", choices=POLICIES, default="bounded")
    p.add_argument("--dtype", choices=list(DTYPES), default="float64")
    p.add_argument("--heads", type=_positive, default=4)
    p.add_argument("--kv-heads", type=_positive, default=2)
    p.add_argument("--head-dim", type=_positive, default=8)
    p.add_argument("--seq", type=_positive, default=None, help="global length; default 4 tokens per rank")
    p.add_argument("--calls", type=_positive, default=1, help="calls per rank (more exercise the workspace)")


def _cmd_sanitize(args) -> int:
    from .demo import DTYPES
    from .testing.sanitizer import sanitize_ring

    report = sanitize_ring(
        world=args.world,
        causal=args.causal,
        balance=args.balance,
        handoff=args.handoff,
        backward=args.backward,
        dtype=DTYPES[args.dtype],
        heads=args.heads,
        kv_heads=args.kv_heads,
        seq=args.seq,
        head_dim=args.head_dim,
        policy=args.policy,
        calls=args.calls,
    )
    print(report.format())
    return 0 if report.ok else 1


COMMANDS = {
    "sanitize": (_add_sanitize, _cmd_sanitize),
    "run": (_add_run, _cmd_run),
    "plan": (_add_plan, _cmd_plan),
    "backends": (_add_backends, _cmd_backends),
    "bench": (_add_bench, _cmd_bench),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xcp`` command."""
    parser = argparse.ArgumentParser(prog="xcp", description="Context-parallel (ring) attention on any device.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xcp`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"xcp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
