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


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(FLAG, action="store_true", help=HELP)


def sanitize_command(args: argparse.Namespace) -> int:
    """``xcp sanitize --recurrent``."""
    from ..testing.recurrent_sanitizer import sanitize_recurrent

    if args.ulysses != 1:
        raise ValueError(
            f"{FLAG}: expected no --ulysses (recurrent layers run over the ring's ranks); got {args.ulysses}"
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
