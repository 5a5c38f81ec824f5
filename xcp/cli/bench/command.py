"""The ``xcp bench`` subcommand: its flags, the defaults that depend on other flags, the refusals of what a
mode does not measure, and the dispatch to the distributed bench or to :func:`.runner.run_bench`."""

from __future__ import annotations

import argparse
from typing import Any

from .. import decode as decode_flags
from .. import packing, ulysses, windows
from ..common import (
    DEVICE_DEFAULT,
    FLAGS,
    MEASUREMENT_FLAGS,
    add_problem_flags,
    apply_size_defaults,
    default_device,
    measurement_args,
    positive,
    size_help,
    tool_backend,
    write_json,
)
from . import distributed, recurrent, serve
from .config import HOST_MIN_REPS, REPLAY_FLAG, REPLAY_HELP, SIZE_FLAGS, BenchConfig
from .decode import format_decode, rows_failed, run_decode
from .dense import plot_report
from .host import HOST_TARGETS_US
from .report import row_ok
from .runner import format_report, run_bench
from .world_of_one import WORLD_OF_ONE_SEQS


def add_parser(sub) -> argparse.ArgumentParser:
    """Declare ``xcp bench`` and its flags (the ``--distributed`` ones too) on the subparsers ``sub``."""
    d = BenchConfig()
    p = sub.add_parser(
        "bench",
        help="ring overhead vs one whole-sequence kernel, memory, graph capture",
        description="Sizes default to the device: the H200 grid on a device, a small grid when the backend's "
        "device type is cpu. A run whose estimated memory exceeds what the machine has is refused up front.",
    )
    p.add_argument(
        "--seqs", type=positive_list, default=None, help=size_help("seqs", "comma-separated sequence lengths")
    )
    p.add_argument("--worlds", type=positive_list, default=d.worlds, help="comma-separated virtual rank counts")
    p.add_argument(
        "--mask",
        choices=tuple(MASKS),
        default=None,
        help="which masks to time (default: both; with --window, causal when R is 0 or none, else full)",
    )
    add_problem_flags(p, d, [n for n in MEASUREMENT_FLAGS if n not in (*SIZE_FLAGS, "value_head_dim", "device")])
    p.add_argument("--device", default=None, help=f"{FLAGS['device']['help']} (default: {DEVICE_DEFAULT})")
    p.add_argument("--balance", choices=windows.DOCUMENT_BALANCE_CHOICES, default=d.balance,
                   help=f"{windows.BALANCE_HELP}; {packing.DOCUMENT_BALANCE_HELP}")  # fmt: skip
    for name in ("heads", "kv_heads", "head_dim", "dtype"):
        p.add_argument("--" + name.replace("_", "-"), default=None, **_size_flag(name))
        if name == "head_dim":
            add_problem_flags(p, d, ["value_head_dim"])
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed runs before the timed ones")
    p.add_argument("--reps", type=positive, default=d.reps, help="timed runs (the median is reported)")
    p.add_argument(
        "--memory-seq", type=positive, default=None, help=size_help("memory_seq", "length of the memory figure")
    )
    p.add_argument(
        "--memory-worlds", type=positive_list, default=d.memory_worlds, help="rank counts of the memory figure"
    )
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the graph-capture figure")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument(
        "--documents", type=packing.parse_documents, metavar="L1,L2,...|longtail:MIN:MAX[:SEED]",
        help="time the ring over packed documents against one whole-sequence varlen call instead of the dense "
        "figures: document lengths summing to S (then --seqs may be left out), or lengths drawn log-uniformly "
        "in [MIN, MAX] (seeded, default seed 0) to fill each of --seqs, the last one trimmed",
    )  # fmt: skip
    p.add_argument(
        windows.FLAG, type=windows.parse_window, metavar="L,R",
        help="time the ring under a sliding window (query i sees keys i-L..i+R; none: unbounded; with a causal "
        "mask R is 0 or none), over --documents if given, against one whole-sequence windowed varlen call, with "
        "the steps the ring runs and the K/V and dK/dV bytes each rank sends beside the dense ring's",
    )  # fmt: skip
    p.add_argument("--compare-dense", action="store_true",
                   help="with --documents or --window: also time the dense ring at the same S, P, masks")  # fmt: skip
    p.add_argument(
        "--host", action="store_true",
        help="instead of the dense grid: the host µs per forward and per backward ring step of one rank, for "
        "each of --worlds (>= 2; LocalWorld virtual ranks running xcp.ring_forward/ring_backward on "
        "--host-tokens tokens per rank with kernels that return outputs computed once beforehand, so only host "
        "work remains: Python, checks, the merge and accumulation launches, hand-offs, events, exchanges); a "
        "step is the time between a rank's consecutive kernel calls on its thread's CPU clock, the mean over "
        f"ranks, median of at least {HOST_MIN_REPS}; beside it the same gaps on the wall clock and rank 0's loop "
        "run alone (one thread, loopback exchanges, wall clock), and the targets (forward ≤ "
        f"{HOST_TARGETS_US['fwd']:g} µs, backward ≤ {HOST_TARGETS_US['bwd']:g} µs); then the --world-of-one "
        "figure in the same run",
    )  # fmt: skip
    p.add_argument(
        "--world-of-one", action="store_true",
        help="xcp.attention(q, k, v, causal=...) without a group against torch SDPA (q, k, v as [B, H, S, D] "
        "views, enable_gqa=True), forward and forward+backward, each checked against the other (tolerance by "
        f"dtype) before it is timed, median of at least {HOST_MIN_REPS}, interleaved; --seqs default "
        f"{','.join(map(str, WORLD_OF_ONE_SEQS))} here, heads, head dim and dtype the device's (part of --host)",
    )  # fmt: skip
    p.add_argument("--host-tokens", type=positive, default=d.host_tokens,
                   help="tokens per rank of the --host figure (even for zigzag)")  # fmt: skip
    p.add_argument(
        ulysses.FLAG, type=positive_list, metavar="U[,U...]",
        help=ulysses.HELP + ". Instead of the dense grid: for each U (dividing every --worlds value and --heads), "
        "the hybrid's fwd and fwd+bwd over P virtual ranks against one whole-sequence kernel call, checked against "
        "it before it is timed, with the bytes each rank sends (all-to-alls, ring K/V and dK/dV) counted and "
        "checked against the formula",
    )  # fmt: skip
    p.add_argument(REPLAY_FLAG, action="store_true", help=REPLAY_HELP)
    p.add_argument(recurrent.FLAG, action="store_true", help=recurrent.HELP)
    p.add_argument(recurrent.STACK_FLAG, action="store_true", help=recurrent.STACK_HELP)
    serve.add_flags(p)
    p.add_argument(
        decode_flags.FLAG, action="store_true",
        help="instead of the ring figures: a decode step over a sharded KV cache (xcp.KVCache with capacity) of L "
        "= each of --seqs tokens of --batch sequences over P = each of --worlds virtual ranks on one device, "
        "prefilled from xcp.shard of a random whole K/V: xcp's step (every rank's append, attention and combine) "
        "eager and captured as one device graph holding every rank's work and replayed (each replay appends a "
        "token), against one whole-cache call (torch SDPA, default dispatch, enable_gqa; and the aten flash varlen "
        "op with seqused_k on CUDA) eager and replayed, every output checked first; the bytes each rank's cache "
        "holds beside the whole cache's / P, and the host µs of one rank's step; --no-graph leaves the replays out "
        "(no graphs on cpu)",
    )  # fmt: skip
    p.add_argument(
        decode_flags.CHUNK_FLAG, type=nonnegative, default=0, metavar="T",
        help=f"with {decode_flags.FLAG}: also a chunk of T tokens appended after the cached ones, xcp over P ranks "
        "(eager) against one whole-cache call with the same causal mask (bottom-right: flash varlen on CUDA), "
        "checked first; 0: decode only",
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw ratio vs S and memory vs P")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    distributed.add_flags(p)
    return p


def _size_flag(name: str) -> dict[str, Any]:
    """The keyword arguments of a problem flag whose default depends on the device: its help says both."""
    flag = dict(FLAGS[name])
    flag["help"] = size_help(name, flag["help"])
    return flag


MASKS = {"both": [False, True], "causal": [True], "full": [False]}
"""``--mask``: the masks each figure is timed with."""


def nonnegative(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}")
    return value


def positive_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1; got {text!r}")
    return values


def _document_sizes(args: argparse.Namespace) -> None:
    """With --documents: --seqs defaults to the sum of explicit lengths (and must be it when given), and the
    memory figure's length, which documents and windows do not use, is left out of the size defaults. With
    --window, --mask defaults to causal where R is 0 or none, else to full."""
    spec = args.documents
    if args.mask is None:
        right = None if args.window is None else args.window[1]
        args.mask = "both" if args.window is None else "causal" if right in (0, None) else "full"
    if args.compare_dense is True and spec is None and args.window is None:
        raise ValueError(
            "--compare-dense: expected together with --documents or --window (the dense bench is the default)"
        )
    if spec is None:
        if args.window is not None and args.memory_seq is None:
            args.memory_seq = max(args.seqs or [1])
        return
    if spec.lengths is not None:
        if args.seqs is None:
            args.seqs = [spec.total]
        elif len(args.seqs) != 1:
            raise ValueError(
                f"--seqs: expected one length, the sum of the --documents lengths ({spec.total}), or none; got "
                f"{','.join(map(str, args.seqs))}"
            )
        elif args.seqs[0] != spec.total:
            raise ValueError(
                f"{packing.FLAG}: expected lengths summing to --seqs {args.seqs[0]}; got {len(spec.lengths)} "
                f"lengths summing to {spec.total}"
            )
    if args.memory_seq is None:
        args.memory_seq = max(args.seqs or [1])


def _host_args(args: argparse.Namespace) -> str | None:
    """With --host or --world-of-one: refuse what does not apply, and default --seqs to the world-of-one's;
    returns a note of that default (None when --seqs was given or neither flag was)."""
    host = getattr(args, "host", False)
    if not (host or getattr(args, "world_of_one", False)):
        return None
    flag = "--host" if host else "--world-of-one"
    if args.documents is not None:
        raise ValueError(f"{packing.FLAG}: not measured with {flag}; got {args.documents.text!r}")
    if args.window is not None:
        raise ValueError(f"{windows.FLAG}: not measured with {flag}; got {windows.text_of(args.window)!r}")
    if args.compare_dense:
        raise ValueError(f"--compare-dense: expected together with --documents or --window, not {flag}")
    if args.plot:
        raise ValueError(f"--plot: draws the dense grid, not measured with {flag}; got {args.plot!r}")
    if args.mask is None:
        args.mask = "both"
    if args.memory_seq is None:
        args.memory_seq = 1  # no memory figure here: kept out of the size defaults and their note
    if args.seqs is not None:
        return None
    args.seqs = list(WORLD_OF_ONE_SEQS)
    return f"seqs {','.join(map(str, WORLD_OF_ONE_SEQS))} (the world of one's, on any device)"


def _decode_args(args: argparse.Namespace) -> None:
    """With --decode: refuse the ring figures' flags (a causal mask only), keep the memory figure's length out
    of the size defaults; without it, refuse --chunk."""
    if not args.decode:
        if args.chunk:
            raise ValueError(f"{decode_flags.CHUNK_FLAG}: expected together with {decode_flags.FLAG}; got {args.chunk}")
        return
    if args.mask not in (None, "causal"):
        raise ValueError(f"--mask: {decode_flags.FLAG} attends causally (a step's queries see every cached token up "
                         f"to their own); got {args.mask!r}")  # fmt: skip
    for flag, value in (("--plot", args.plot), (packing.FLAG, args.documents and args.documents.text),
                        (windows.FLAG, args.window and windows.text_of(args.window))):  # fmt: skip
        if value is not None:
            raise ValueError(f"{flag}: not measured with {decode_flags.FLAG}; got {value!r}")
    for flag, on in (("--host", args.host), ("--world-of-one", args.world_of_one), (ulysses.FLAG, args.ulysses),
                     ("--compare-dense", args.compare_dense)):  # fmt: skip
        if on:
            raise ValueError(f"{flag}: not measured with {decode_flags.FLAG}")
    args.mask = "causal"
    if args.memory_seq is None:
        args.memory_seq = 1  # no memory figure here: kept out of the size defaults and their note


def _ulysses_args(args: argparse.Namespace) -> None:
    """With --ulysses: refuse what it does not measure; the memory figure's length stays out of the size
    defaults (there is no memory figure)."""
    if args.ulysses is None:
        return
    given = " ".join(map(str, args.ulysses))
    for flag, on, value in (
        (packing.FLAG, args.documents is not None, args.documents and args.documents.text),
        (windows.FLAG, args.window is not None, args.window and windows.text_of(args.window)),
        ("--host", args.host, None),
        ("--world-of-one", args.world_of_one, None),
        ("--compare-dense", args.compare_dense, None),
        ("--plot", args.plot is not None, args.plot),
    ):
        if on:
            raise ValueError(f"{flag}: not measured with {ulysses.FLAG} {given.replace(' ', ',')} yet"
                             + (f"; got {value!r}" if value is not None else ""))  # fmt: skip
    if args.memory_seq is None:
        args.memory_seq = 1


def command(args: argparse.Namespace) -> int:
    """``xcp bench``: over real ranks with ``--distributed``, else in this process; the exit status is 1 when
    a check failed."""
    if args.distributed:
        _distributed_args(args)
        return distributed.command(args)
    if args.recurrent:
        return recurrent.command(args)
    if args.stack:
        raise ValueError(f"{recurrent.STACK_FLAG}: expected only with {recurrent.FLAG}; got it without")
    if args.serve:
        return serve.command(args)
    device_note = default_device(args)
    backend, _ = tool_backend(args.device, 0)  # an unknown or unusable backend: the error and the table, first
    _decode_args(args)
    host_note = _host_args(args)
    _ulysses_args(args)
    _document_sizes(args)
    notes = (device_note, apply_size_defaults(args, backend, SIZE_FLAGS), host_note)
    note = ", ".join(n for n in notes if n) or None
    cfg = BenchConfig(
        sizes_note=note,
        worlds=args.worlds,
        causal=MASKS[args.mask],
        memory_worlds=args.memory_worlds,
        graph=args.graph,
        check=args.check,
        documents=None if args.documents is None else args.documents.text,
        compare_dense=args.compare_dense,
        window=None if args.window is None else windows.text_of(args.window),
        balance=args.balance,
        host=args.host,
        world_of_one=args.host or args.world_of_one,
        host_tokens=args.host_tokens,
        ulysses=args.ulysses,
        replay=args.replay,
        decode=args.decode,
        chunk=args.chunk,
        **measurement_args(args),
    )
    if cfg.decode:
        report = run_decode(cfg, progress=not args.quiet, checkpoint=args.json)
        print(format_decode(report))
    else:
        report = run_bench(cfg, progress=not args.quiet, checkpoint=args.json)
        print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    rows = report["timing"] + report.get("documents", []) + (report.get("host") or [])
    rows += (report.get("world_of_one") or []) + (report.get("ulysses") or [])
    failed = [r for r in rows if not row_ok(r)] + rows_failed(report)
    return 1 if failed else 0


def _distributed_args(args: argparse.Namespace) -> None:
    """With --distributed: refuse what is measured in one process only, or not yet over real ranks."""
    if args.documents is not None:
        raise ValueError(f"--documents: not measured with --distributed yet; got {args.documents.text!r}")
    if args.window is not None:
        raise ValueError(f"--window: not measured with --distributed yet; got {windows.text_of(args.window)!r}")
    if args.host or args.world_of_one:
        raise ValueError(f"{'--host' if args.host else '--world-of-one'}: measured in one process (LocalWorld "
                         "virtual ranks, a world of one), not with --distributed")  # fmt: skip
    if args.ulysses is not None:
        raise ValueError(f"{ulysses.FLAG}: measured in one process (LocalWorld virtual ranks), not with --distributed "
                         f"yet; got {','.join(map(str, args.ulysses))}")  # fmt: skip
    if args.decode or args.chunk:
        raise ValueError(f"{decode_flags.FLAG}: measured in one process (LocalWorld virtual ranks on one device), not "
                         "with --distributed yet")  # fmt: skip
    if args.replay:
        raise ValueError(f"{REPLAY_FLAG}: measured in one process (every virtual rank's work in one graph), not "
                         "with --distributed yet")  # fmt: skip
    if args.balance != "zigzag":
        raise ValueError(f"--balance: --distributed measures zigzag only yet; got {args.balance!r}")
