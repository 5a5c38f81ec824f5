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

**Chunked attention** (``chunk``: a query sees only keys of its own chunk of positions, chunks aligned at
0): the queries of each chunk are planned on their own, against the storage rows of that chunk alone
(:func:`chunked_calls`), so within a chunk the plan above holds unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from ..documents import PositionRun, Segment, diagonal_segment, position_runs, rows_at_most, runs
from ..documents import Run as Call
from ..kernels.merge import accumulator_dtype, packed_layout

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


def combine_bytes(world_size: int, batch: int, queries: int, heads: int, channels: int, element_size: int) -> int:
    """Bytes of the combine's receive buffer on each rank for one attention call: the P packed partials
    ``[out | lse]``, ``P x B x T x H x channels`` elements (``xcp.kernels.merge.packed_layout``: D + 2
    16-bit channels for bfloat16/float16 inputs, D + 1 of the accumulator dtype otherwise)."""
    return world_size * batch * queries * heads * channels * element_size


HEADS_COMBINE_MIN_QUERIES = 64
"""Chunks of at least this many queries combine over heads (:func:`combine_over_heads`); shorter steps, whose
combine is a few kilobytes a rank, make one collective rather than three."""


COMBINES = ("auto", "gather", "heads")
"""How a KV cache combines a long chunk's partials (:class:`xcp.KVCache`'s ``combine``): ``gather`` one
all-gather of the packed partials; ``heads`` over heads where :func:`combine_over_heads` allows; ``auto``
over heads between processes (the bytes cross links) and one all-gather between the virtual ranks of a
LocalWorld (its copies stay on one device, where the fewer, larger copies were faster: a chunk of 4096 after
128K over 8 ranks of one H200 took 1.107x one whole-cache call with the all-gather, 1.150x over heads)."""


def check_combine(combine: object) -> str:
    if combine not in COMBINES:
        raise ValueError(f"combine: expected one of {', '.join(map(repr, COMBINES))}; got {combine!r}")
    return str(combine)


def combine_over_heads(world_size: int, queries: int, heads: int) -> bool:
    """Whether a step's combine may go over heads rather than as one all-gather of the P partials.

    Over heads: an all-gather of the lse alone, then each rank weighs its partial by ``exp(L_r - L)`` and an
    all-to-all gives rank j the weighted partials of its H/P heads, which it sums; an all-gather of the merged
    head slices ends it. A rank sends about ``(P - 1) x B x T x H x (lse + 2 D / P)`` elements instead of
    ``(P - 1) x B x T x H x (D + 2)``: about P/2 times fewer bytes for long chunks, for three collectives
    instead of one. Needs H divisible by P."""
    return world_size > 1 and queries >= HEADS_COMBINE_MIN_QUERIES and heads % world_size == 0


def combine_traffic(
    world_size: int, batch: int, queries: int, heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int]:
    """``(sent, received)``: the bytes each rank sends in one attention call's combine for inputs of
    ``dtype``, and the bytes of its receive buffers; over heads where :func:`combine_over_heads` says so
    (lse in the accumulator dtype, weighted partials and merged slices in the packed dtype), else one
    all-gather of the packed partials. A world of one sends nothing."""
    if world_size == 1:
        return 0, 0
    packed, channels = packed_layout(dtype, head_dim)
    item = packed.itemsize
    if not combine_over_heads(world_size, queries, heads):
        shape = (batch, queries, heads, channels, item)
        return combine_bytes(world_size - 1, *shape), combine_bytes(world_size, *shape)
    rows, lse = batch * queries * heads, accumulator_dtype(dtype).itemsize
    slices = rows * head_dim * item // world_size  # one rank's share of the weighted partial, or its merged heads
    return (world_size - 1) * (rows * lse + 2 * slices), world_size * (rows * lse + 2 * slices)


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
        raise AssertionError(f"xcp.inference.plan: position {first} stored after {end}")
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


def _stretch(stored: Sequence[PositionRun], at: int, x: int) -> tuple[int, int, int]:
    """Whether position ``x`` is stored (0 or 1), for how many consecutive positions from ``x`` that stays
    so (unbounded past the last run: :data:`_FAR`), and the index of the run to search from next (``x``
    only grows)."""
    while at < len(stored) and (
        stored[at].count < 1 or stored[at].global0 + stored[at].stride * (stored[at].count - 1) < x
    ):
        at += 1
    if at == len(stored):
        return 0, _FAR, at
    p = stored[at]
    if x < p.global0:
        return 0, p.global0 - x, at
    t, off = divmod(x - p.global0, p.stride)
    if off:
        return 0, p.stride - off, at
    return 1, (p.count - t if p.stride == 1 else 1), at


def _segment(first: tuple[int, int], last: tuple[int, int], r0: int, r1: int) -> Segment:
    """The segment of rows ``[r0, r1)`` whose ranges run from ``first`` to ``last`` as a band does."""
    k0, sq = first[0], r1 - r0
    return diagonal_segment((r0, r1), (k0, last[1]), last[0] - k0 - (sq - 1), first[1] - 1 - k0, False)


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
    rows). Rows no call covers see none of the rank's tokens.

    Row i sees ``[lo(i), hi(i))`` (:func:`visible`); from one row to the next each end rises by 1 exactly
    when the position it newly passes is stored, else stays. Rows are grouped as they come (a group takes
    the next row while both its ends move as a band's do: a lower end that rose keeps rising, and the upper
    end keeps one step, rising or not; an empty row ends a group and gets nothing). The upper end's one
    step makes a chunk's rows over its own piece a causal block and the rows after it a full one, where
    a band over both would take a kernel's slower windowed form. Both steps are constant over a
    stretch of rows in which neither newly passed position changes between stored and not (a part of one
    run, or a gap), and so is the slope of the width ``hi - lo``: after at most two rows of a stretch, every
    row joins the group until the width reaches 0. So the plan walks stretches, not rows: its cost grows
    with the runs and the segments, not with ``queries``."""
    if queries < 1:
        return ()
    left, right = window if window is not None else (None, None)
    lside, rside = (_FAR if left is None else left), (0 if causal else (_FAR if right is None else right))
    first_at = seq_len - queries
    lo, hi = visible(stored, first_at, (lside, rside))
    segs: list[Segment] = []
    # the open group: rows [r0, i), first row's range; empty when r0 is None
    r0: int | None = 0 if lo < hi else None
    first = (lo, hi)
    rising_lo = rising_hi = flat_hi = False
    at_lo = at_hi = 0
    i = 1
    while i < queries:
        # row i's steps: is the position its lower end newly passes (s - left - 1) stored, and its upper (s + right)?
        dlo, nlo, at_lo = _stretch(stored, at_lo, first_at + i - lside - 1)
        dhi, nhi, at_hi = _stretch(stored, at_hi, first_at + i + rside)
        end = min(queries, i + nlo, i + nhi)  # rows [i, end) step alike
        slope = dhi - dlo
        while i < end:
            lo, hi = lo + dlo, hi + dhi
            width = hi - lo
            steady_hi = not (flat_hi and dhi) and not (rising_hi and not dhi)
            if r0 is not None and width > 0 and not (rising_lo and not dlo) and steady_hi:
                rising_lo, rising_hi, flat_hi = rising_lo or dlo == 1, rising_hi or dhi == 1, flat_hi or dhi == 0
                # every further row of the stretch fits too, while it sees something
                n = end - i - 1 if slope >= 0 else min(end - i - 1, width - 1)
            else:
                if r0 is not None:
                    segs.append(_segment(first, (lo - dlo, hi - dhi), r0, i))
                if width > 0:
                    r0, first, rising_lo, rising_hi, flat_hi = i, (lo, hi), False, False, False
                    n = 0
                else:  # a row that sees nothing: width 0 and a slope <= 0 (the row before saw >= 0 rows), so
                    r0 = None  # the rest of the stretch sees nothing either
                    n = end - i - 1
            lo, hi, i = lo + n * dlo, hi + n * dhi, i + 1 + n
    if r0 is not None:
        segs.append(_segment(first, (lo, hi), r0, queries))
    return runs(segs)


def _within(stored: Sequence[PositionRun], lo: int, hi: int) -> tuple[tuple[PositionRun, ...], int]:
    """The runs of the positions of ``stored`` in ``[lo, hi)``, their storage rows counted from the first of
    them, and that first row (the rows before it hold positions below ``lo``)."""
    skip, out = rows_at_most(stored, lo - 1), []
    for p in stored:
        t0 = max(0, -(-(lo - p.global0) // p.stride))
        t1 = min(p.count, -(-(hi - p.global0) // p.stride))
        if t1 > t0:
            out.append(PositionRun(p.local0 + t0 - skip, p.global0 + p.stride * t0, p.stride, t1 - t0))
    return tuple(out), skip


@functools.lru_cache(maxsize=256)
def chunked_calls(
    stored: tuple[PositionRun, ...],
    seq_len: int,
    queries: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    chunk: int | None,
) -> tuple[Call, ...]:
    """:func:`partial_calls` where a query sees only the keys of its own chunk of ``chunk`` positions (none:
    :func:`partial_calls` itself): the queries of each chunk against the storage rows of that chunk, each
    call's rows moved back to the whole call's query rows and storage rows."""
    if chunk is None:
        return partial_calls(stored, seq_len, queries, causal, window)
    first, out = seq_len - queries, []
    for c in range(first // chunk * chunk, seq_len, chunk):
        a, b = max(first, c), min(seq_len, c + chunk)  # the queries' positions in this chunk
        runs_in, skip = _within(stored, c, c + chunk)
        for call in partial_calls(runs_in, b, b - a, causal, window):
            dq = a - first
            out.append(
                dataclasses.replace(call, q0=call.q0 + dq, q1=call.q1 + dq, k0=call.k0 + skip, k1=call.k1 + skip)
            )
    return tuple(out)
