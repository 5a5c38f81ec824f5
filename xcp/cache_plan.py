"""Where a sharded KV cache keeps each token, and the kernel calls of a rank's local partial. Pure Python.

**Placement.** A prefill keeps the shard :func:`xcp.shard` placed for the balance (positions from
:mod:`xcp.schedule`). An appended chunk of T tokens at global positions ``s0 .. s0 + T - 1`` is cut into P
contiguous pieces, in rank order: rank r keeps the piece whose size is the number of the chunk's positions
p with ``p % P == r`` (so sizes differ by at most 1, and the larger pieces rotate with ``s0``). For T = 1
this is rank ``position % P``, the convention of the public decode-parallel systems. Since a prefill of S0
tokens (a multiple of P) holds S0 / P per rank, rank r then always holds exactly as many tokens as dealing
the positions round-robin would give it: ``S // P + (r < S % P)`` of S, within one token of every other
rank (:func:`held`), which also bounds a preallocated cache (``capacity=N``: rank r needs ``held(N, P, r)``).

**Storage.** A rank stores its tokens in position order (a prefill's shard is in position order for every
balance, and appends come later), as :class:`PositionRun` s of evenly spaced positions. So the keys a query at
position s may see (``s - left <= p <= s + right``; ``right`` 0 when causal, unbounded without a window)
form one storage range ``[lo(s), hi(s))``, and both ends grow with s.

**Local partial.** The T queries of a call (positions ``S - T .. S - 1``) against the rank's storage:
consecutive rows whose ranges grow as a band does (each end flat, or rising one key per row: the first
flat then rising, the second rising then flat) form one :class:`xcp.documents.Segment` (full, square
causal or a bottom-right band: :func:`xcp.documents.diagonal_segment`); a row that sees nothing ends one
and gets nothing (lse -inf, out 0). Decode (T = 1) is one call over a storage range: all of it without a
window. The segments' rows never overlap, so nothing merges inside the rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .documents import PositionRun, Segment, diagonal_segment, position_runs, rows_at_most, runs
from .documents import Run as Call

_FAR = 1 << 62  # stands for an unbounded side in integer arithmetic


def held(seq_len: int, world_size: int, rank: int) -> int:
    """The tokens rank ``rank`` holds when the cache holds ``seq_len``: ``S // P + (rank < S % P)``."""
    return seq_len // world_size + int(rank < seq_len % world_size)


def chunk_pieces(start: int, count: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """The ``(first position, tokens)`` each rank keeps of the chunk of ``count`` tokens from ``start``,
    in rank order (see the module docstring)."""
    out, at = [], start
    for r in range(world_size):
        n = held(start + count, world_size, r) - held(start, world_size, r)
        out.append((at, n))
        at += n
    return tuple(out)


def combine_bytes(world_size: int, batch: int, queries: int, heads: int, head_dim: int, element_size: int = 4) -> int:
    """Bytes of the combine's receive buffer on each rank for one attention call: the P packed partials
    ``[out | lse]``, ``P x B x T x H x (D + 1)`` elements of the accumulator dtype (4 bytes; 8 for float64)."""
    return world_size * batch * queries * heads * (head_dim + 1) * element_size


def prefill_runs(seq_len: int, world_size: int, rank: int, balance: str) -> tuple[PositionRun, ...]:
    """The runs of the shard ``xcp.shard`` gives ``rank`` of a prompt of ``seq_len`` tokens."""
    return position_runs(seq_len, world_size, rank, balance)


def extend(stored: Sequence[PositionRun], first: int, count: int) -> tuple[PositionRun, ...]:
    """``stored`` with ``count`` contiguous positions from ``first`` appended (joining the last run where
    they continue it evenly: a rank's decode tokens form one run of stride P)."""
    if count == 0:
        return tuple(stored)
    out = list(stored)
    last = out[-1] if out else None
    if last is None:
        return (PositionRun(0, first, 1, count),)
    end = last.global0 + last.stride * (last.count - 1)
    if first <= end:
        raise AssertionError(f"xcp.cache_plan: position {first} stored after {end}")
    if count == 1 and (last.count == 1 or first == end + last.stride):
        stride = first - last.global0 if last.count == 1 else last.stride
        out[-1] = PositionRun(last.local0, last.global0, stride, last.count + 1)
    elif last.stride == 1 and first == end + 1:
        out[-1] = PositionRun(last.local0, last.global0, 1, last.count + count)
    else:
        out.append(PositionRun(last.local0 + last.count, first, 1, count))
    return tuple(out)


def extend_decoded(
    stored: Sequence[PositionRun], start: int, stop: int, world_size: int, rank: int
) -> tuple[PositionRun, ...]:
    """``stored`` after single-token appends of positions ``start .. stop - 1`` (decode steps: rank
    ``p % P`` keeps position p), as :func:`extend` one token at a time gives it, in O(1)."""
    out, position = tuple(stored), start + (rank - start) % world_size
    left = max(0, (stop - 1 - position) // world_size + 1)
    while left:  # at most three tokens one at a time, until the last run steps by P: the rest join it at once
        out, left, position = extend(out, position, 1), left - 1, position + world_size
        last = out[-1]
        if left and last.count > 1 and last.stride == world_size:
            return (*out[:-1], PositionRun(last.local0, last.global0, world_size, last.count + left))
    return out


def visible(stored: Sequence[PositionRun], position: int, window: tuple[int, int]) -> tuple[int, int]:
    """The storage range ``[lo, hi)`` a query at ``position`` sees under ``window`` (``(left, right)``,
    with :data:`_FAR` for an unbounded side)."""
    left, right = window
    return rows_at_most(stored, position - left - 1), rows_at_most(stored, position + right)


def _fits(prev: tuple[int, int], row: tuple[int, int], rising_lo: bool, flat_hi: bool) -> bool:
    dlo, dhi = row[0] - prev[0], row[1] - prev[1]
    if dlo not in (0, 1) or dhi not in (0, 1):
        return False
    if rising_lo and dlo == 0:  # a lower end that rose must keep rising
        return False
    return not (flat_hi and dhi == 1)  # an upper end that stopped must stay


def _segment(rows: list[tuple[int, int]], r0: int) -> Segment:
    k0, k1 = rows[0][0], rows[-1][1]
    sq = len(rows)
    lo = rows[-1][0] - k0 - (sq - 1)
    hi = rows[0][1] - 1 - k0
    return diagonal_segment((r0, r0 + sq), (k0, k1), lo, hi, False)


@functools.lru_cache(maxsize=256)
def partial_calls(
    stored: tuple[PositionRun, ...],
    seq_len: int,
    queries: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> tuple[Call, ...]:
    """The kernel calls of the local partial: the ``queries`` last positions of a cache of ``seq_len``
    tokens against the rank's ``stored`` runs, as :class:`xcp.documents.PositionRun` s over (query rows, storage
    rows). Rows no call covers see none of the rank's tokens."""
    left, right = window if window is not None else (None, None)
    sides = (_FAR if left is None else left, 0 if causal else (_FAR if right is None else right))
    segs: list[Segment] = []
    group: list[tuple[int, int]] = []
    r0 = 0
    rising_lo = flat_hi = False
    for i in range(queries):
        row = visible(stored, seq_len - queries + i, sides)
        if group and row[0] < row[1] and _fits(group[-1], row, rising_lo, flat_hi):
            rising_lo = rising_lo or row[0] > group[-1][0]
            flat_hi = flat_hi or row[1] == group[-1][1]
            group.append(row)
            continue
        if group:
            segs.append(_segment(group, r0))
        group, r0, rising_lo, flat_hi = ([row] if row[0] < row[1] else []), i, False, False
    if group:
        segs.append(_segment(group, r0))
    return runs(segs)
