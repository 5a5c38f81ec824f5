"""Causal convolutions over ranks: each piece of a rank's shard needs the ``width - 1`` tokens before it
(its halo), held by the owners of the pieces before it; their gradients go back the same way.

The halos travel in one all-gather of every piece's last ``width - 1`` inputs (a few tokens per piece:
latency, not bandwidth); the backward is the all-to-all of their gradients (:mod:`xcp.recurrent.exchange`).
A halo never crosses a document boundary: positions before the document's first token are zeros, as the
convolution's own padding at the start of a sequence.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm.dist import resolve_group
from ..lifetime import check_handoff
from ..plugins import select_backend
from ..schedule import DEFAULT_BALANCE, check_world
from .exchange import gather_differentiable, tie
from .layout import Piece, held_pieces, most_pieces


def causal_conv(
    conv: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    width: int,
    group: Any = None,
    balance: str = DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
    seq_dim: int = 1,
    device: str | None = None,
    handoff: str | None = None,
    ulysses: int = 1,
) -> torch.Tensor:
    """``conv`` (a causal convolution of kernel ``width``, any activation after it) over this rank's shard
    ``x`` of a sequence sharded by ``balance``, as if run on the whole sequence.

    ``conv`` is called on each stretch with its halo before it (sequence-major at ``seq_dim``, zeros where
    the halo would cross the start of the sequence or of a document) and must return as many positions as
    it was given; the halo's positions are dropped from its result. ``device``, ``handoff`` and ``ulysses``
    as :func:`xcp.recurrent.state_passing`'s.
    """
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width: expected an integer >= 1 (the convolution's kernel size); got {width!r}")
    halo = width - 1
    xs, pieces, mine, rank, gathered = _exchange_tails(
        x, halo, group, balance, cu_seqlens, seq_dim, device, handoff, ulysses
    )
    starts = sorted(set(cu_seqlens) if cu_seqlens is not None else {0})
    outs = []
    for piece in mine:
        for i, (a, b) in enumerate(piece.segments):
            part = xs[piece.local + a - piece.start : piece.local + b - piece.start]
            if halo:
                before = (
                    _halo(xs, gathered, pieces, rank, piece.start, halo, starts)
                    if i == 0 and piece.carries_in
                    else None
                )
                if before is None:
                    before = part.new_zeros((halo, *part.shape[1:]))
                part = torch.cat((before, part))
            y = conv(part.movedim(0, seq_dim)).movedim(seq_dim, 0)
            outs.append(y[halo:])
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).movedim(0, seq_dim)
    return out if gathered is None else tie(out, gathered)


def last_inputs(
    x: torch.Tensor,
    count: int,
    group: Any = None,
    balance: str = DEFAULT_BALANCE,
    seq_dim: int = 1,
    device: str | None = None,
    handoff: str | None = None,
    ulysses: int = 1,
) -> torch.Tensor:
    """The last ``count`` inputs of the whole sequence whose shard ``x`` is (zeros before its start), on every
    rank: what a causal convolution's cache keeps after a prompt, to go on one token at a time. They live on
    the owners of the last pieces (contiguous: the last rank; zigzag: rank 0's second chunk); every piece's
    last ``count`` inputs travel in one all-gather. ``device``, ``handoff`` and ``ulysses`` as
    :func:`causal_conv`'s."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count: expected an integer >= 1 (how many of the last inputs); got {count!r}")
    xs, pieces, _, rank, gathered = _exchange_tails(x, count, group, balance, None, seq_dim, device, handoff, ulysses)
    out = _halo(xs, gathered, pieces, rank, pieces[-1].stop, count, [0]).movedim(0, seq_dim)
    return out if gathered is None else tie(out, gathered)


def _exchange_tails(
    x: torch.Tensor,
    count: int,
    group: Any,
    balance: str,
    cu_seqlens: Sequence[int] | None,
    seq_dim: int,
    device: str | None,
    handoff: str | None,
    ulysses: int,
) -> tuple[torch.Tensor, Sequence[Piece], list[Piece], int, torch.Tensor | None]:
    """``x`` sequence-first, the pieces (all, this rank's), this rank, and every rank's pieces' last ``count``
    inputs gathered in one all-gather (None: nothing to exchange, ``count`` 0 or a world of one)."""
    comm = resolve_group(group)
    size, rank = comm.size(), comm.rank()
    check_world(size, rank)
    pieces, mine = held_pieces("x", x.shape[seq_dim], seq_dim, size, rank, balance, cu_seqlens, ulysses)
    xs = x.movedim(seq_dim, 0)
    if not count or size == 1:
        return xs, pieces, mine, rank, None
    if handoff is not None:
        check_handoff(handoff)
    tails = [_tail(xs, p, count) for p in mine]
    backend = select_backend(device, x.device.type)
    return (
        xs,
        pieces,
        mine,
        rank,
        gather_differentiable(comm, backend, handoff, tails, most_pieces(pieces, size), "halo"),
    )


def _tail(xs: torch.Tensor, piece: Piece, halo: int) -> torch.Tensor:
    """The last ``halo`` inputs of ``piece`` (zeros before its start where it is shorter)."""
    n = min(halo, piece.stop - piece.start)
    end = piece.local + piece.stop - piece.start
    tail = xs[end - n : end]
    if n < halo:
        tail = torch.cat((tail.new_zeros((halo - n, *tail.shape[1:])), tail))
    return tail


def _halo(
    xs: torch.Tensor,
    gathered: torch.Tensor | None,
    pieces: Sequence[Piece],
    rank: int,
    start: int,
    halo: int,
    starts: Sequence[int],
) -> torch.Tensor:
    """The ``halo`` inputs before global position ``start``: from the pieces holding them, zeros before its
    document's start."""
    doc_start = starts[bisect_right(starts, start - 1) - 1]
    first = [p.start for p in pieces]
    rows = []
    for t in range(start - halo, start):
        if t < doc_start:
            rows.append(xs.new_zeros(xs.shape[1:]))
            continue
        q = pieces[bisect_right(first, t) - 1]
        if q.owner == rank:
            rows.append(xs[q.local + t - q.start])
        else:
            assert gathered is not None
            rows.append(gathered[q.owner, q.index, t - (q.stop - halo)])
    return torch.stack(rows)
