"""What the tools share about recurrent layers (:mod:`xcp.recurrent`): the ``--recurrent`` flag of
``xcp sanitize`` (state passing and halos on the simulated device under the lifetime sanitizer)."""

from __future__ import annotations

import argparse

from ..testing.sanitizer import random_document_lengths

FLAG = "--recurrent"
HELP = (
    "sanitize recurrent layers instead: a gated delta rule through xcp.recurrent.state_passing and a short "
    "convolution through xcp.recurrent.causal_conv, forward and backward, each rank on the simulated device; "
    "every output and gradient checked against the same kernels on the whole sequence (float64). Takes "
    "--world, --balance (not stripe), --handoff, --seq, --documents, --heads, --head-dim, --value-head-dim, --seed"
)


PLAN_HELP = (
    "the plan of a recurrent layer instead (--layer: a gated delta rule, as Qwen3-Next's, or a Mamba2 SSD scan; "
    "each with a short convolution of width 4 in front): each rank's pieces of --seq tokens in global order "
    "(documents' resets marked) and the bytes each rank sends per layer, forward and backward (independent of S); "
    "with --heads, --head-dim, --value-head-dim (gated delta), --state-dim (Mamba2), --dtype, --balance (not "
    "stripe), --documents"
)

LAYERS = ("gated-delta", "mamba2")
"""The layers ``xcp plan --recurrent --layer`` describes."""


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """``--recurrent`` with ``--layer`` and ``--state-dim`` (``xcp plan``)."""
    add_flag(p, PLAN_HELP)
    p.add_argument("--layer", choices=LAYERS, default=None,
                   help="with --recurrent: the layer (default gated-delta: state d_k x d_v per head, T d_k x d_k; "
                   "mamba2: state head_dim x d_state per head, T one decay per head)")  # fmt: skip
    p.add_argument("--state-dim", type=int, default=None, metavar="N",
                   help="with --recurrent --layer mamba2: d_state (B's and C's size; default 128)")  # fmt: skip


def check_plan_flags(args: argparse.Namespace) -> None:
    """``--layer`` and ``--state-dim`` only with ``--recurrent``; ``--state-dim`` only for Mamba2."""
    for flag, value in (("--layer", args.layer), ("--state-dim", args.state_dim)):
        if value is not None and not args.recurrent:
            raise ValueError(f"{flag}: expected only with {FLAG}; got {value} without it")
    if args.state_dim is not None and args.layer != "mamba2":
        raise ValueError(f"--state-dim: expected only with --layer mamba2; got --layer {args.layer or 'gated-delta'}")


def add_flag(p: argparse.ArgumentParser, help: str = HELP) -> None:
    p.add_argument(FLAG, action="store_true", help=help)


def plan_command(args: argparse.Namespace) -> int:
    """``xcp plan --recurrent``: the pieces and the bytes of state passing."""
    from ..recurrent import plan_pieces
    from ..recurrent.layout import exchange_bytes
    from . import packing
    from .common import DTYPES, human_bytes

    if args.seq is None and args.documents is None:
        raise ValueError(f"{FLAG}: expected --seq (or --documents): the pieces depend on S; got neither")
    cu = None
    if args.documents is not None:
        lengths, _ = packing.resolve_lengths(args.documents, args.seq, args.world, args.balance)
        cu = list(packing.boundaries(lengths))
    seq = cu[-1] if cu is not None else args.seq
    pieces = plan_pieces(seq, args.world, args.balance, cu, args.ulysses)
    itemsize = DTYPES[args.dtype].itemsize
    h, d, layer = args.heads, args.head_dim, args.layer or "gated-delta"
    if layer == "mamba2":
        n = 128 if args.state_dim is None else args.state_dim
        if n < 1:
            raise ValueError(f"--state-dim: expected a positive d_state; got {n}")
        shape = f"head_dim={d} d_state={n} (state {d} x {n} per head, T one decay per head)"
        state, transition, channels = d * n, 1, h * d + 2 * n  # the conv runs over x, B and C (one group)
    else:
        v = args.value_head_dim or d
        shape = f"d_k={d} d_v={v} (state {d} x {v} per head, T {d} x {d})"
        state, transition, channels = d * v, d * d, h * (2 * d + v)  # the conv runs over q, k and v
    hybrid = f" ulysses={args.ulysses}" if args.ulysses != 1 else ""
    print(f"xcp plan {FLAG} --layer {layer}: S={seq} P={args.world}{hybrid} balance={args.balance} heads={h} "
          f"{shape} {args.dtype}")  # fmt: skip
    print("pieces in global order (rank: [start, stop), * where a document starts inside, | where one starts at it):")
    for p in pieces:
        mark = ("*" if p.resets else "") + ("" if p.carries_in else "|")
        print(f"  rank {p.owner}: [{p.start}, {p.stop}){mark}")
    state_itemsize = max(itemsize, 4)  # the kernels keep states in float32 for 16-bit inputs
    sent = exchange_bytes(pieces, args.world, h, state, transition, state_itemsize,
                          halo=3, channels=channels, itemsize=itemsize)  # fmt: skip
    print("bytes each rank sends per layer (states in float32 where the inputs are 16-bit): "
          + ", ".join(f"{k} {human_bytes(v)}" for k, v in sent.items()))  # fmt: skip
    return 0


def sanitize_command(args: argparse.Namespace) -> int:
    """``xcp sanitize --recurrent``."""
    from ..testing.recurrent_sanitizer import sanitize_recurrent

    if args.ulysses != 1:
        raise ValueError(
            f"{FLAG}: expected no --ulysses (the sanitizer runs the ring's layout alone); got {args.ulysses}"
        )
    documents = None
    if args.documents is not None:
        seq = args.seq if args.seq is not None else 4 * args.world
        lengths = random_document_lengths(seq, args.documents, args.seed)
        documents = [0]
        for n in lengths:
            documents.append(documents[-1] + n)
        args.seq = seq
    report = sanitize_recurrent(world=args.world, balance=args.balance, handoff=args.handoff, seq=args.seq,
                                documents=documents, heads=args.heads, head_dim=args.head_dim,
                                value_head_dim=args.value_head_dim or args.head_dim + 1, seed=args.seed)  # fmt: skip
    print(report.format())
    return 0 if report.ok else 1
