"""Where a recurrent layer's state crosses ranks: the pieces of the global sequence in order.

Pure Python. A balance gives every rank a few contiguous stretches of the sequence (contiguous: one,
zigzag: two, document_zigzag: two per document, joined where they meet); laid end to end in global order
they are the *pieces* a state is passed along. Documents split a piece into *segments* (a recurrence never
crosses a document boundary), so a piece either carries the state entering it through to its end, or
starts the state afresh inside (it *resets*). stripe's pieces are single tokens: refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .. import schedule
from ..documents import check_cu_seqlens

RECURRENT_BALANCES = ("zigzag", "contiguous", "document_zigzag")
"""The balances a recurrent layer runs under (stripe gives a rank every P-th token: refused)."""


@dataclass(frozen=True)
class Piece:
    """One contiguous stretch ``[start, stop)`` of the global sequence, held by rank ``owner`` at local
    position ``local`` (its offset in the owner's shard).

    :param segments: ``(start, stop)`` global stretches of the piece, cut at document boundaries.
    :param carries_in: the state entering the piece is used (its start is not a document's start).
    :param resets: a document starts strictly inside the piece: the state leaving it does not depend on
        the one entering (the leaving state is the last segment's, from zero).
    """

    owner: int
    index: int
    start: int
    stop: int
    local: int
    segments: tuple[tuple[int, int], ...]
    carries_in: bool
    resets: bool


def check_recurrent_balance(balance: object) -> str:
    """``balance`` if a recurrent layer runs under it; else a ValueError naming the balance."""
    if balance == "stripe":
        raise ValueError(
            f"balance: expected one of {', '.join(RECURRENT_BALANCES)} for a recurrent layer (stripe gives each "
            "rank every P-th token, so the state would cross ranks at every token); got 'stripe'"
        )
    return schedule.check_choice("balance", balance, RECURRENT_BALANCES)


def plan_pieces(
    seq_len: int,
    world_size: int,
    balance: str = schedule.DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
    ulysses: int = 1,
) -> tuple[Piece, ...]:
    """Every rank's pieces of a sequence of ``seq_len`` tokens, in global order (see :class:`Piece`).

    :param cu_seqlens: the documents' boundaries ``(0, ..., seq_len)`` (None: one document); every balance
        takes them, document_zigzag needs them.
    :param ulysses: U, as ``xcp.shard(..., ulysses=U)`` places the tokens: the balance shards the sequence
        over the P / U ring positions and rank r holds the ``r % U``-th of U equal contiguous parts of ring
        shard ``r // U`` (a part may span the two chunks of a zigzag shard: two pieces).
    """
    check_recurrent_balance(balance)
    u = schedule.check_ulysses(ulysses)
    schedule.check_ulysses_divides(u, int(world_size))
    if u != 1 and seq_len % world_size:
        raise ValueError(
            f"seq_len: expected a multiple of the world size {world_size} with ulysses {u} (each ring shard splits "
            f"into {u} equal parts); got {seq_len}"
        )
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len)
    return _plan(int(seq_len), int(world_size), str(balance), cu, u)


def _stretches(
    seq_len: int, world: int, rank: int, balance: str, placed: tuple[int, ...] | None, ulysses: int
) -> list[tuple[int, int]]:
    """The ``(start, stop)`` global stretches ``rank`` holds, in its local order (``xcp.shard``'s placement)."""
    if ulysses == 1:
        return [(a, b) for a, b, _ in schedule.chunk_slices(seq_len, world, rank, balance, placed)]
    rings = world // ulysses
    part = seq_len // world  # xcp.shard with ulysses: S a multiple of P, every part S / P tokens
    lo, hi = (rank % ulysses) * part, (rank % ulysses + 1) * part  # local range within the ring shard
    held: list[tuple[int, int]] = []
    local = 0
    for a, b, _ in schedule.chunk_slices(seq_len, rings, rank // ulysses, balance, placed):
        x, y = max(lo, local), min(hi, local + b - a)
        if x < y:
            held.append((a + x - local, a + y - local))
        local += b - a
    return held


@functools.lru_cache(maxsize=64)
def _plan(seq_len: int, world: int, balance: str, cu: tuple[int, ...] | None, ulysses: int) -> tuple[Piece, ...]:
    placed = cu if balance in schedule.DOCUMENT_BALANCES else None
    starts = set(cu) if cu is not None else {0}
    found: list[tuple[int, int, int, int, int]] = []
    for rank in range(world):
        local = 0
        for index, (a, b) in enumerate(_stretches(seq_len, world, rank, balance, placed, ulysses)):
            found.append((a, b, rank, index, local))
            local += b - a
    pieces = []
    for a, b, rank, index, local in sorted(found):
        cuts = sorted({a, b} | {s for s in starts if a < s < b})
        pieces.append(
            Piece(
                owner=rank,
                index=index,
                start=a,
                stop=b,
                local=local,
                segments=tuple(zip(cuts, cuts[1:])),
                carries_in=a not in starts,
                resets=len(cuts) > 2,
            )
        )
    return tuple(pieces)


def held_pieces(
    name: str,
    local_len: int,
    seq_dim: int,
    world_size: int,
    rank: int,
    balance: str,
    cu_seqlens: Sequence[int] | None,
    ulysses: int,
) -> tuple[tuple[Piece, ...], list[Piece]]:
    """Every rank's pieces and this rank's, checked against the ``local_len`` tokens the rank's argument
    ``name`` holds at ``seq_dim`` (the whole sequence is ``cu_seqlens[-1]`` tokens, else ``local_len`` a rank)."""
    seq_len = int(cu_seqlens[-1]) if cu_seqlens is not None else local_len * world_size
    pieces = plan_pieces(seq_len, world_size, balance, cu_seqlens, ulysses)
    mine = rank_pieces(pieces, rank)
    held = sum(p.stop - p.start for p in mine)
    if held != local_len:
        raise ValueError(
            f"{name}: expected {held} tokens at dim {seq_dim} (rank {rank}'s shard of {seq_len} under balance "
            f"{balance!r}); got {local_len}"
        )
    return pieces, mine


def rank_pieces(pieces: Sequence[Piece], rank: int) -> list[Piece]:
    """``rank``'s pieces in its local order (ascending global order: every balance keeps it)."""
    return sorted((p for p in pieces if p.owner == rank), key=lambda p: p.index)


def most_pieces(pieces: Sequence[Piece], world_size: int) -> int:
    """The largest number of pieces a rank holds: the length every rank's summaries are padded to."""
    return max(sum(p.owner == r for p in pieces) for r in range(world_size))


def exchange_bytes(
    pieces: Sequence[Piece], world_size: int, heads: int, state_numel: int, transition_numel: int,
    state_itemsize: int, halo: int = 0, channels: int = 0, itemsize: int = 0,
) -> dict[str, int]:  # fmt: skip
    """The bytes one rank sends per layer (every rank alike: the buffers are padded to the most pieces).

    ``state``: its packed summaries, one ``(T, S)`` per piece and head (``transition_numel`` numbers of ``T``
    per head: ``d_k x d_k`` for a delta rule, 1 for a scalar decay per head, a channel's count for a
    per-channel one; ``state_numel`` of ``S``), sent to each of the P - 1 others by the all-gather;
    ``dstate``: their gradients, the same bytes back by the all-to-all; ``halo`` / ``dhalo``: a causal
    convolution's last ``halo`` inputs of ``channels`` per piece (``itemsize`` bytes each, the inputs'), and
    their gradients. States are kept in ``state_itemsize`` (float32 in the families' kernels for 16-bit
    inputs)."""
    n, others = most_pieces(pieces, world_size), world_size - 1
    state = n * heads * (transition_numel + state_numel) * state_itemsize * others
    conv = n * halo * channels * itemsize * others
    return {"state": state, "dstate": state, "halo": conv, "dhalo": conv}
