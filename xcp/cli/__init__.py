"""The ``xcp`` command: run the checked demo, print or plot a ring plan, list backends, run the lifetime
sanitizer, benchmark. Each tool lives in its own module; this one only assembles their subcommands, and
nothing in the library imports it."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Sequence

from .. import __version__, schedule
from . import bench, decode, packing, plan, recurrent, run, serve, ulysses, windows
from .common import DTYPES, FLAGS, HelpFormatter, Problem, add_problem_flags, check_heads, positive, quiet_rank

__all__ = ["build_parser", "main"]


def _add_backends(sub) -> None:
    p = sub.add_parser("backends", help="list installed backends and whether each is usable here")
    p.add_argument("--settings", action="store_true",
                   help="list every XCP_* environment variable of xcp and of the installed backends instead: "
                        "kind, default, current value, meaning and when it is read")  # fmt: skip


def _print_settings() -> int:
    """Every declared setting (xcp's, then each installed backend's), then the plugins that failed: their
    settings are unknown (a bad value of one of them is a common reason)."""
    from ..plugins import backend_table, list_backends
    from ..settings import declared, describe

    for setting in declared(list_backends()):
        row = describe(setting)
        print(f"{row['name']}  ({row['kind']}; default {row['default']}; now {row['current']})")
        for text in (row["meaning"], f"read {row['read']}"):
            print(textwrap.fill(text, 110, initial_indent="  ", subsequent_indent="  "))
    for failed in (r for r in backend_table() if r.kernel == "-"):
        print(f"{failed.reason} (its settings are not listed)")
    return 0


def _cmd_backends(args) -> int:
    from ..plugins import backend_table

    if args.settings:
        return _print_settings()
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
    _print_recurrent_kernels()
    return 0


def _print_recurrent_kernels() -> None:
    """Which kernel runs each recurrence (xcp.recurrent) on each backend: its own, else the models' torch one."""
    from ..plugins import list_backends
    from ..recurrent.kernels import kernel_labels

    print()
    for backend in list_backends():
        try:
            labels = kernel_labels(backend)
        except Exception as exc:  # noqa: BLE001 - a plugin's broken hook is reported, not fatal here
            print(f"{backend.name} recurrent kernels: unknown ({type(exc).__name__}: {exc})")
            continue
        for recurrence, label in labels.items():
            print(f"{backend.name} recurrent {recurrence}: {label}")


# the sanitizer's defaults: a problem small enough to check every access of every rank
SANITIZE_DEFAULTS = Problem(heads=4, kv_heads=2, head_dim=8, dtype="float64")
SANITIZE_POLICY, SANITIZE_CALLS, SANITIZE_CHUNK = "bounded", 1, 5
"""The defaults of ``--policy`` and ``--calls`` (the ring's alone) and of ``--chunk`` (the decode path's)."""


def _add_sanitize(sub) -> None:
    from ..lifetime import HANDOFF_POLICIES, SLOT_POLICIES

    p = sub.add_parser("sanitize", help="run the ring under the CPU lifetime sanitizer; exit 1 on any finding")
    p.add_argument("--world", type=positive, default=4, help="virtual ranks")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    p.add_argument("--balance", choices=schedule.ALL_BALANCES, default=SANITIZE_DEFAULTS.balance,
                   help=f"{FLAGS['balance']['help']}; {packing.DOCUMENT_BALANCE_HELP}")  # fmt: skip
    p.add_argument("--handoff", choices=HANDOFF_POLICIES, default=None, help="default: the sim backend's own")
    p.add_argument("--backward", action="store_true", help="also run the backward ring (bound: 4 shards)")
    p.add_argument("--policy", choices=SLOT_POLICIES, default=SANITIZE_POLICY, help="ring buffer slot policy")
    add_problem_flags(p, SANITIZE_DEFAULTS, ["dtype", "heads", "kv_heads", "head_dim", "value_head_dim"])
    p.add_argument("--seq", type=positive, default=None,
                   help="global length; default 4 tokens per rank (with --documents N, at least N); under "
                   "document_zigzag any length >= --world (shards differ by a token; a multiple of --world with "
                   "--ulysses)")  # fmt: skip
    p.add_argument("--calls", type=positive, default=SANITIZE_CALLS,
                   help="calls per rank (more exercise the workspace)")  # fmt: skip
    p.add_argument("--documents", type=positive, default=None, metavar="N",
                   help="pack the sequence with N documents of random lengths (some of 1 token, drawn from --seed); "
                   "checked against float64 attention under the document mask, within the same bounds")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and of the document lengths")
    p.add_argument(windows.FLAG, type=windows.parse_window, metavar="L,R",
                   help="sliding window: query i sees keys i-L..i+R (none: unbounded; with --causal, the default, R "
                   "is 0 or none); with --documents too if given. The ring runs only the steps the window needs and "
                   "is checked against float64 attention under the banded mask, within the same bounds")  # fmt: skip
    p.add_argument(ulysses.FLAG, type=positive, default=1,
                   help=ulysses.HELP + ". Runs the hybrid (xcp.hybrid.hybrid_forward/hybrid_backward) on --world "
                   "ranks; the bounds are the ring's, for its K/V shards (S/R tokens, H_kv'/U heads); reports of two "
                   "peers writing their own rows of one all-to-all receive buffer (U >= 3) are set aside and "
                   "counted")  # fmt: skip
    p.add_argument("--decode", type=int, default=None, metavar="N",
                   help="sanitize the decode path instead: an xcp.KVCache per rank, a prompt of --seq tokens "
                   "(default: the fewest the balance splits) prefilled, N decode steps and one chunk of --chunk "
                   "tokens, each followed by the cache's attention and its all-gather combine (causal; with "
                   "--window, banded; the ring's own flags --backward, --policy, --calls, --no-causal, --documents "
                   "and --ulysses are refused)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=SANITIZE_CHUNK, help="with --decode: the chunk's tokens (0: none)")
    p.add_argument("--capacity", action="store_true",
                   help="with --decode: preallocated caches (KVCache(capacity=...)), whose decode steps keep their "
                   "lengths on the device")  # fmt: skip
    recurrent.add_flag(p)
    serve.add_flags(
        p,
        "each rank's xcp.PagedKVCache on the simulated device: the combine's hand-off, the pool audited "
        "after every step (every block free or in one table; all back at the end), float64 checks",
    )


def _cmd_sanitize_decode(args) -> int:
    from ..testing.decode_sanitizer import sanitize_decode

    decode.check_flags(args.decode, args.chunk)
    why_ring = "a KV cache's attention runs no ring"
    decode.check_alone(((packing.FLAG, args.documents, None, None), (ulysses.FLAG, args.ulysses, 1, None),
                        ("--backward", args.backward, False, "a KV cache's attention is inference: no backward pass"),
                        ("--policy", args.policy, SANITIZE_POLICY, f"the ring's slot policy; {why_ring}"),
                        ("--calls", args.calls, SANITIZE_CALLS, f"the ring's calls per rank; {why_ring}: its calls "
                         f"are the steps {decode.FLAG} and {decode.CHUNK_FLAG} give")))  # fmt: skip
    decode.check_causal(args.causal)
    window = windows.check(args.window, True)
    if args.seq is not None:
        schedule.check_seq_len(args.seq, args.world, args.balance, what="--seq")
    report = sanitize_decode(world=args.world, balance=args.balance, handoff=args.handoff, decode=args.decode,
                             chunk=args.chunk, prompt=args.seq, dtype=DTYPES[args.dtype], heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim, seed=args.seed,
                             preallocated=args.capacity, value_head_dim=args.value_head_dim,
                             window=window)  # fmt: skip
    print(report.format())
    return 0 if report.ok else 1


def _check_sanitize_seq(args) -> None:
    """``--seq`` (and ``--documents`` against it) checked as the user typed them, before the sanitizer's own
    checks, which name its arguments (``seq``)."""
    if args.ulysses > 1:
        ulysses.check_seq(args.seq, args.world, args.ulysses, args.balance)
    else:
        schedule.check_seq_len(args.seq, args.world, args.balance, what="--seq")
    if args.documents is not None and args.documents > args.seq:
        raise ValueError(f"{packing.FLAG}: expected at most --seq {args.seq} documents (each at least 1 token); got "
                         f"{args.documents}")  # fmt: skip


def _cmd_sanitize(args) -> int:
    from ..testing.sanitizer import sanitize_ring

    check_heads(args.heads, args.kv_heads)
    if args.recurrent:
        return recurrent.sanitize_command(args)
    packing.check_balance(args.balance, args.documents is not None)
    if args.serve is not None:
        return serve.sanitize_command(args)
    serve.check_needs_serve(args)
    if args.decode is not None:
        return _cmd_sanitize_decode(args)
    decode.check_needs_decode(((decode.CHUNK_FLAG, args.chunk, SANITIZE_CHUNK), ("--capacity", args.capacity, False)))
    window = windows.check(args.window, args.causal)
    if args.ulysses > 1:
        ulysses.check_flag(args.ulysses, args.world, args.heads)
    if args.seq is not None:
        _check_sanitize_seq(args)
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
        slots=args.policy,
        calls=args.calls,
        seed=args.seed,
        documents=args.documents,
        window=window,
        ulysses=args.ulysses,
        value_head_dim=args.value_head_dim,
    )
    print(report.format())
    return 0 if report.ok else 1


COMMANDS = {
    "sanitize": (_add_sanitize, _cmd_sanitize),
    "run": (run.add_parser, run.command),
    "plan": (plan.add_parser, plan.command),
    "backends": (_add_backends, _cmd_backends),
    "bench": (bench.add_parser, bench.command),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xcp`` command."""
    parser = argparse.ArgumentParser(
        prog="xcp", description="Context-parallel (ring) attention on any device.", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"xcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    for name, p in sub.choices.items():
        p.prog = f"{parser.prog} {name}"  # errors show the subcommand's usage
        p.formatter_class = HelpFormatter  # --help shows the defaults
        p.add_argument("--all-ranks", action="store_true",
                       help="under torchrun, print on every rank (default: rank 0 only)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xcp`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    quiet = quiet_rank() and not args.all_ranks
    try:
        with contextlib.ExitStack() as stack:
            if quiet:  # rank 0 prints the report; the other ranks' errors still reach stderr
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            return COMMANDS[args.command][1](args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"xcp {args.command}: error: {exc}", file=sys.stderr)
        return 2
