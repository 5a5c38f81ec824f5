"""Packed documents across the ring: which (query, key) rows of each block may attend, as kernel calls.

Pure Python (no torch). A packed sequence of S tokens holds documents ``[cu[d], cu[d + 1])``; query i may
see key j iff both lie in the same document (and j <= i when causal). Shards are placed by the balance
(xcp.schedule); every balance maps a rank's local rows to global positions *monotonically*, so each
document is one contiguous range of local rows on every rank. Hence a block (this rank's queries against
the keys of ``src``) holds at most one segment per document, and:

- after trimming the queries that see no key and the keys no query sees, every segment is either
  **full** (every query sees every key) or **square causal** (query m of the segment sees keys 0..m).
  For zigzag and contiguous, the blocks of two different ranks give at most one segment, and it is full;
  the rank's own block gives one causal segment per local document. For stripe, rank r's positions
  ``jP + r`` against src's ``jP + s`` are interleaved: the trimmed segment is square causal (tested
  exhaustively in tests/test_documents.py, and checked as each segment is built).
- consecutive segments whose query rows and key rows both follow on without a gap, and that share the
  mask, form one :class:`Run`: one varlen kernel call (cumulative lengths ``cu_q`` and ``cu_k``). A run of
  one segment is a dense call on sub-slices.

The rows a block does not cover get nothing from it (the merge leaves them alone; their dK/dV stay 0).

**Chunked attention** (Llama-4's ``attention_chunk_size``): a query sees only keys of its own chunk of
``chunk`` tokens, chunks aligned at global position 0. That is documents again: the mask's documents are the
boundaries ``cu`` together with every multiple of ``chunk`` (:func:`chunk_bounds`, the intersection of the
two partitions), while the placement stays that of ``cu`` (under ``document_zigzag`` the shards are cut by
the caller's documents, not by the chunks). Each chunk-document is a range of positions inside one placed
document, so it is a contiguous range of local rows on every rank, and everything above holds for it.
"""

from __future__ import annotations

import bisect
import functools
import numbers
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from . import schedule


@dataclass(frozen=True)
class Segment:
    """Query rows [q0, q1) of this rank against key rows [k0, k1) of the source shard, one document.

    ``causal``: square causal (q1 - q0 == k1 - k0, query q0 + m sees keys k0..k0 + m); else no mask,
    unless ``band`` is set: a sliding window ``(left, right)`` aligned to the segment's bottom-right corner,
    as flash kernels align theirs: query m sees keys ``m + (sk - sq) - left .. m + (sk - sq) + right``.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    band: tuple[int, int] | None = None

    @property
    def pairs(self) -> int:
        """The (query, key) pairs the segment computes."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        if self.band is not None:
            return band_pairs(n, m, *self.band)
        return n * (n + 1) // 2 if self.causal else n * m


@dataclass(frozen=True)
class Run:
    """One kernel call: segments that tile query rows [q0, q1) and key rows [k0, k1) without gaps.

    ``cu_q``/``cu_k`` are the cumulative lengths relative to q0/k0 (``(0, ..., q1 - q0)``); one segment is
    a dense call with mask ``causal`` or ``none``. A run made by :func:`join_runs` may hold filler segments,
    without queries or without keys, over the rows between its documents.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    band: tuple[int, int] | None = None

    @property
    def segments(self) -> int:
        return len(self.cu_q) - 1

    @property
    def mask(self) -> str:
        """The block mask of a one-segment run (``causal`` or ``none``)."""
        return "causal" if self.causal else "none"


def check_chunk(chunk: object) -> int | None:
    """``chunk`` (chunked attention: tokens per chunk) as an int >= 1, or None. Raises a TypeError or
    ValueError naming ``chunk``, the expected and the actual."""
    if chunk is None:
        return None
    if not isinstance(chunk, numbers.Integral) or schedule.is_bool(chunk):
        raise TypeError(
            f"chunk: expected a positive int (tokens per chunk) or None; got {chunk!r} ({type(chunk).__name__})"
        )
    if int(chunk) < 1:
        raise ValueError(f"chunk: expected a positive int (tokens per chunk) or None; got {chunk}")
    return int(chunk)


@functools.lru_cache(maxsize=256)
def chunk_bounds(cu: tuple[int, ...], chunk: int | None) -> tuple[int, ...]:
    """The boundaries of the mask's documents: ``cu`` with every multiple of ``chunk`` below ``cu[-1]`` (the
    documents cut into chunks of ``chunk`` global positions, aligned at 0); ``cu`` itself without a chunk."""
    if chunk is None or chunk >= cu[-1]:
        return cu
    return tuple(sorted(set(cu).union(range(chunk, cu[-1], chunk))))


def check_cu_seqlens(cu: object, seq_len: int | None = None, name: str = "cu_seqlens") -> tuple[int, ...]:
    """``cu`` as a tuple of ints, checked: 1-D, integers, ``0 = cu[0] <= cu[1] <= ... <= cu[-1] = seq_len``.

    Repeated boundaries are empty documents (packed batches from data loaders hold them): they have no
    token, so they are dropped here and the tuple returned is strictly increasing (``(0, 0, 3, 3, 8)`` ->
    ``(0, 3, 8)``). Everything downstream sees only non-empty documents; the result of a call is that of the
    same call with the empty documents removed. Accepts a list/tuple of ints or anything with ``tolist()``
    (a 1-D integer tensor or array); the caller checks the tensor's dtype. Raises a ValueError naming
    ``name``, the expected and the actual.
    """
    values = cu.tolist() if hasattr(cu, "tolist") else cu
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: expected a 1-D sequence of document boundaries; got {type(cu).__name__}")
    if any(isinstance(x, (list, tuple)) for x in values):
        raise ValueError(f"{name}: expected 1 dim [documents + 1]; got a nested sequence")
    if len(values) < 2:
        raise ValueError(f"{name}: expected at least 2 boundaries (0 and the sequence length); got {list(values)}")
    if not all(schedule.is_integer(x) for x in values):
        bad = next(x for x in values if not schedule.is_integer(x))
        raise ValueError(f"{name}: expected integer boundaries; got {bad!r}")
    values = tuple(int(x) for x in values)
    if values[0] != 0:
        raise ValueError(f"{name}: expected cu_seqlens[0] == 0; got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name}: expected non-decreasing boundaries (a repeat is an empty document); got "
                f"cu_seqlens[{i - 1}] = {values[i - 1]} > cu_seqlens[{i}] = {values[i]}"
            )
    if seq_len is not None and values[-1] != seq_len:
        raise ValueError(
            f"{name}: expected cu_seqlens[-1] == {seq_len} (the global sequence length: local length x ranks); "
            f"got {values[-1]}"
        )
    if values[-1] == 0:
        raise ValueError(f"{name}: expected at least one token (cu_seqlens[-1] > 0); got {list(values)}")
    return tuple(x for i, x in enumerate(values) if i == 0 or x != values[i - 1])


# ---------------------------------------------------------------------------------------------- local maps
@dataclass(frozen=True)
class PositionRun:
    """Local rows [local0, local0 + count) hold global positions global0 + stride * t."""

    local0: int
    global0: int
    stride: int
    count: int


def position_runs(
    seq_len: int, world: int, rank: int, balance: str, cu: tuple[int, ...] | None = None
) -> tuple[PositionRun, ...]:
    """The runs of the shard :func:`xcp.shard` gives ``rank`` of a sequence of ``seq_len`` tokens (documents
    ``cu``, for :data:`~xcp.schedule.DOCUMENT_BALANCES` only: two runs a document at most)."""
    out, local = [], 0
    for start, stop, step in schedule.chunk_slices(seq_len, world, rank, balance, cu):
        count = len(range(start, stop, step))
        out.append(PositionRun(local, start, step, count))
        local += count
    return tuple(out)


@functools.lru_cache(maxsize=256)
def placed_runs(cu: tuple[int, ...], world: int, rank: int, balance: str) -> tuple[PositionRun, ...]:
    """:func:`position_runs` of ``rank`` in a packed sequence of documents ``cu`` (which only
    :data:`~xcp.schedule.DOCUMENT_BALANCES` place by)."""
    return position_runs(cu[-1], world, rank, balance, cu if balance in schedule.DOCUMENT_BALANCES else None)


@functools.lru_cache(maxsize=256)
def _document_rows(
    bounds: tuple[int, ...], world: int, rank: int, balance: str, cu: tuple[int, ...]
) -> tuple[int, ...]:
    """The local rows of ``rank`` before each boundary of ``bounds`` (the mask's documents; the shards placed
    by the documents ``cu``): document d is local rows ``[t[d], t[d + 1])``."""
    runs = placed_runs(cu, world, rank, balance)
    return tuple(rows_at_most(runs, b - 1) for b in bounds)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local_range(pieces: Sequence[PositionRun], lo: int, hi: int) -> tuple[int, int]:
    """Local rows whose global position lies in [lo, hi): contiguous, since the map is monotone."""
    first, last = rows_at_most(pieces, lo - 1), rows_at_most(pieces, hi - 1)
    return (first, last) if first < last else (0, 0)


def _global(pieces: Sequence[PositionRun], row: int) -> int:
    p = pieces[max(bisect.bisect_right(pieces, row, key=_LOCAL0) - 1, 0)]
    if not p.local0 <= row < p.local0 + p.count:
        raise IndexError(row)
    return p.global0 + p.stride * (row - p.local0)


def rows_at_most(pieces: Sequence[PositionRun], position: int) -> int:
    """How many local rows hold a global position <= ``position`` (a prefix, the map being monotone: the
    runs in increasing order of positions, as every placement's are)."""
    i = bisect.bisect_right(pieces, position, key=_GLOBAL0) - 1
    if i < 0:
        return 0
    p = pieces[i]
    return p.local0 + min(p.count, (position - p.global0) // p.stride + 1)


_LOCAL0, _GLOBAL0 = operator.attrgetter("local0"), operator.attrgetter("global0")


def _doc_span(cu: tuple[int, ...], pieces: Sequence[PositionRun]) -> tuple[int, int]:
    """The documents [d0, d1) that hold at least one of the rank's positions."""
    first = _global(pieces, 0)
    last = max(p.global0 + p.stride * (p.count - 1) for p in pieces)
    return bisect.bisect_right(cu, first) - 1, bisect.bisect_right(cu, last)


# ---------------------------------------------------------------------------------------------- segments
def segments(
    cu: tuple[int, ...], world: int, rank: int, src: int, balance: str, causal: bool, chunk: int | None = None
) -> tuple[Segment, ...]:
    """The segments of the block of ``rank``'s queries against ``src``'s keys, in query order (the
    documents cut into chunks of ``chunk`` positions, where given)."""
    bounds = chunk_bounds(cu, chunk)
    qp, kp = placed_runs(cu, world, rank, balance), placed_runs(cu, world, src, balance)
    qd, kd = _doc_span(bounds, qp), _doc_span(bounds, kp)
    q_rows = _document_rows(bounds, world, rank, balance, cu)
    k_rows = _document_rows(bounds, world, src, balance, cu)
    out = []
    for d in range(max(qd[0], kd[0]), min(qd[1], kd[1])):
        q0, q1, k0, k1 = q_rows[d], q_rows[d + 1], k_rows[d], k_rows[d + 1]
        if q0 == q1 or k0 == k1:
            continue
        if not causal:
            out.append(Segment(q0, q1, k0, k1, False))
            continue
        # keys the last query sees; queries that see the first key
        k1 = min(k1, rows_at_most(kp, _global(qp, q1 - 1)))
        if k1 <= k0:
            continue
        q0 = max(q0, rows_at_most(qp, _global(kp, k0) - 1))
        if q0 >= q1:
            continue
        if _global(kp, k1 - 1) <= _global(qp, q0) and (q1 - q0, k1 - k0) != (1, 1):
            out.append(Segment(q0, q1, k0, k1, False))
            continue  # (a 1 x 1 segment is called causal: it then joins its neighbours' varlen call)
        if q1 - q0 != k1 - k0 or rows_at_most(kp, _global(qp, q0)) != k0 + 1:
            raise AssertionError(  # the module docstring's claim; tests check it for every balance
                f"xcp.documents: document {d} of rank {rank} against rank {src} ({balance}) is neither full "
                f"nor square causal: queries [{q0}, {q1}), keys [{k0}, {k1})"
            )
        out.append(Segment(q0, q1, k0, k1, True))
    return tuple(out)


def runs(segs: Sequence[Segment]) -> tuple[Run, ...]:
    """Group consecutive segments into kernel calls (see :class:`Run`)."""
    out: list[Run] = []
    group: list[Segment] = []

    def flush() -> None:
        if group:
            a, b = group[0], group[-1]
            cu_q = (0, *(s.q1 - a.q0 for s in group))
            cu_k = (0, *(s.k1 - a.k0 for s in group))
            out.append(Run(a.q0, b.q1, a.k0, b.k1, a.causal, cu_q, cu_k, a.band))
            group.clear()

    for s in segs:
        last = group[-1] if group else None
        if last is not None and not (
            (s.causal, s.band) == (last.causal, last.band) and s.q0 == last.q1 and s.k0 == last.k1
        ):
            flush()
        group.append(s)
    flush()
    return tuple(out)


def join_runs(calls: Sequence[Run]) -> tuple[Run, ...]:
    """Consecutive runs of full segments (no mask, no band) as one run: the query rows between two runs become
    a segment without keys (its rows see nothing: out 0, lse -inf), the key rows between them a segment
    without queries (no row sees them: dK/dV 0). A block whose documents are not contiguous in the shards
    (``document_zigzag``: each document's two chunks lie together, its keys of one chunk are followed by
    those of the other) then takes one varlen call a step instead of one per document, on a backend whose
    varlen kernel serves such filler segments (``Backend.varlen_fillers``)."""
    out: list[Run] = []
    for r in calls:
        last = out[-1] if out else None
        if last is None or not (_full(r) and _full(last)) or r.q0 < last.q1 or r.k0 < last.k1:
            out.append(r)
            continue
        cu_q, cu_k = list(last.cu_q), list(last.cu_k)
        if r.q0 > last.q1:  # rows between: a segment without keys
            cu_q.append(r.q0 - last.q0)
            cu_k.append(cu_k[-1])
        if r.k0 > last.k1:  # keys between: a segment without queries
            cu_q.append(cu_q[-1])
            cu_k.append(r.k0 - last.k0)
        cu_q += [r.q0 - last.q0 + c for c in r.cu_q[1:]]
        cu_k += [r.k0 - last.k0 + c for c in r.cu_k[1:]]
        out[-1] = Run(last.q0, r.q1, last.k0, r.k1, False, tuple(cu_q), tuple(cu_k))
    return tuple(out)


def _full(run: Run) -> bool:
    """Whether every query of each segment of ``run`` sees every key of it: no band, and no mask or only
    1 x 1 segments (which :func:`segments` calls causal so that they join causal neighbours)."""
    ones = all(b - a == 1 for a, b in zip(run.cu_q, run.cu_q[1:])) and run.cu_q == run.cu_k
    return run.band is None and (not run.causal or ones)


# ---------------------------------------------------------------------------------------------- windows

_FAR = 1 << 62  # stands for an unbounded side in integer arithmetic


def check_window(window: object, causal: bool) -> tuple[int | None, int | None] | None:
    """``window`` as ``(left, right)`` (None for ``None`` or ``(None, None)``: no window), checked.

    Query i sees key j iff ``i - left <= j <= i + right``; None is unbounded. With ``causal``, ``right``
    must be 0 or None. Raises a TypeError or ValueError naming ``window``, the expected and the actual.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of ints >= 0 or None; got {window!r}")
    sides = []
    for name, x in zip(("left", "right"), window):
        if x is not None and not schedule.is_integer(x):
            raise TypeError(f"window: expected {name} to be an int >= 0 or None; got {x!r} ({type(x).__name__})")
        if x is not None and x < 0:
            raise ValueError(f"window: expected {name} >= 0 or None; got {x}")
        sides.append(None if x is None else int(x))
    left, right = sides
    if causal and right not in (None, 0):
        raise ValueError(f"window: with causal=True the right side must be 0 or None; got right={right}")
    if left is None and (right is None or causal):
        return None  # unbounded on both sides: the dense case
    return left, (0 if causal else right)


def band_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """(query, key) pairs of an sq x sk block under a bottom-right aligned band ``(left, right)`` in which
    every row sees at least one key (a trimmed segment): row i sees keys
    ``max(0, i + off - left) .. min(sk - 1, i + off + right)``, ``off = sk - sq``."""
    off = sk - sq
    hi_split = min(max(sk - off - right, 0), sq)  # rows below it end at i + off + right, the rest at sk - 1
    lo_split = min(max(left - off, 0), sq)  # rows below it start at key 0, the rest at i + off - left
    ends = _arith(0, hi_split, off + right) + (sq - hi_split) * (sk - 1)
    starts = _arith(lo_split, sq, off - left)
    return ends - starts + sq


def _arith(a: int, b: int, c: int) -> int:
    """sum of (i + c) for a <= i < b."""
    n = max(b - a, 0)
    return n * c + (a + b - 1) * n // 2 if n else 0


def _window_segments(
    placed: tuple[int, ...], world: int, rank: int, src: int, balance: str, causal: bool, window: tuple,
    chunk: int | None = None,
) -> tuple[Segment, ...]:  # fmt: skip
    """The segments of a block under a window: one per (query chunk, key chunk, document), since the
    window depends on distances, which are linear only inside a chunk (stride 1, or P under stripe). The
    shards are placed by the documents ``placed``; the mask's documents are those cut into ``chunk``s."""
    left, right = window
    far_left = _FAR if left is None else left
    far_right = _FAR if right is None else right
    out = []
    cu = chunk_bounds(placed, chunk)
    key_runs = placed_runs(placed, world, src, balance)
    for a in placed_runs(placed, world, rank, balance):
        for b in _runs_in_documents_of(cu, a, key_runs):
            t = a.stride
            first = bisect.bisect_right(cu, max(a.global0, b.global0)) - 1
            last_q = a.global0 + t * (a.count - 1)
            last_k = b.global0 + t * (b.count - 1)
            stop = bisect.bisect_right(cu, min(last_q, last_k))
            diff = a.global0 - b.global0
            # piece-relative band: key j of b is visible to query i of a iff lo <= j - i <= hi
            lo = -_FAR if left is None else _ceil_div(diff - far_left, t)
            hi = _FAR if right is None else (diff + far_right) // t
            if lo > hi:  # the window holds no key of this chunk for any query of that one
                continue
            for d in range(max(first, 0), stop):
                qa, qb = _local_range((PositionRun(0, a.global0, t, a.count),), cu[d], cu[d + 1])
                ka, kb = _local_range((PositionRun(0, b.global0, t, b.count),), cu[d], cu[d + 1])
                if qa == qb or ka == kb:
                    continue
                q0, q1 = max(qa, ka - hi), min(qb, kb - lo)
                if q0 >= q1:
                    continue
                k0, k1 = max(ka, q0 + lo), min(kb, q1 + hi)
                if k0 >= k1:
                    continue
                lo_r, hi_r = q0 + lo - k0, q0 + hi - k0  # segment-relative: lo_r <= j' - i' <= hi_r
                seg_q, seg_k = (a.local0 + q0, a.local0 + q1), (b.local0 + k0, b.local0 + k1)
                out.append(diagonal_segment(seg_q, seg_k, lo_r, hi_r, causal))
    return tuple(sorted(out, key=lambda seg: (seg.q0, seg.k0)))


def _runs_in_documents_of(cu: tuple[int, ...], a: PositionRun, runs: Sequence[PositionRun]) -> Iterator[PositionRun]:
    """The runs of ``runs`` that hold a position of a document ``a`` holds a position of (all of a
    whole-sequence balance's few runs; under document_zigzag, those of a's documents alone)."""
    lo = cu[bisect.bisect_right(cu, a.global0) - 1]
    hi = cu[bisect.bisect_right(cu, a.global0 + a.stride * (a.count - 1))]
    for j in range(max(bisect.bisect_right(runs, lo, key=_GLOBAL0) - 1, 0), len(runs)):
        if runs[j].global0 >= hi:
            return
        yield runs[j]


def diagonal_segment(q: tuple[int, int], k: tuple[int, int], lo: int, hi: int, causal: bool) -> Segment:
    """The segment of query rows ``q`` against key rows ``k`` in which query i' sees key j' (both relative
    to the segment) iff ``lo <= j' - i' <= hi``, trimmed so that every query sees a key and every key is
    seen: full, square causal (with ``causal``, a 1 x 1 one too, so that it joins its neighbours' varlen
    call) or a band aligned to the bottom-right corner, as the kernels take it."""
    sq, sk = q[1] - q[0], k[1] - k[0]
    full = hi >= sk - 1 and sq - 1 + lo <= 0
    square_causal = sq == sk and hi == 0 and sq - 1 + lo <= 0
    if full and not (square_causal and causal):
        return Segment(*q, *k, False)
    if square_causal:
        return Segment(*q, *k, True)
    off = sk - sq
    band = (min(off - lo, sk + sq), min(hi - off, sk + sq))
    if band[0] < 0 or band[1] < 0:
        raise AssertionError(f"xcp.documents: negative band {band} after trimming")
    return Segment(*q, *k, False, band)


class _Blocks:
    """The segments of the blocks of one configuration, made as they are first asked for (a rank needs its
    own blocks and the ring's length, not every rank's blocks)."""

    def __init__(
        self, cu: tuple[int, ...], world: int, causal: bool, balance: str, window: tuple | None, chunk: int | None
    ) -> None:
        self.cu, self.world, self.causal, self.balance, self.window = cu, world, causal, balance, window
        self.chunk = chunk
        self._made: dict[tuple[int, int], tuple[Segment, ...]] = {}
        self._steps: int | None = None

    def block(self, rank: int, step: int) -> tuple[Segment, ...]:
        """The segments of ``rank``'s queries against the keys it holds at ``step``."""
        segs = self._made.get((rank, step))
        if segs is None:
            src = (rank - step) % self.world
            if self.window is None:
                segs = segments(self.cu, self.world, rank, src, self.balance, self.causal, self.chunk)
            else:
                segs = _window_segments(
                    self.cu, self.world, rank, src, self.balance, self.causal, self.window, self.chunk
                )
            self._made[rank, step] = segs
        return segs

    @property
    def steps(self) -> int:
        """``m``: one more than the largest step at which any rank has a pair (see :func:`ring_segments`)."""
        if self._steps is None:
            last = (i for i in reversed(range(1, self.world)) if any(self.block(r, i) for r in range(self.world)))
            self._steps = 1 + next(last, 0)
        return self._steps


@functools.lru_cache(maxsize=64)
def _blocks(
    cu: tuple[int, ...], world: int, causal: bool, balance: str, window: tuple | None, chunk: int | None = None
) -> _Blocks:
    return _Blocks(cu, world, causal, balance, window, chunk)


def ring_segments(
    cu: tuple[int, ...], world_size: int, causal: bool, balance: str, window: tuple | None = None,
    chunk: int | None = None,
) -> tuple[int, tuple[tuple[tuple[Segment, ...], ...], ...]]:  # fmt: skip
    """Every rank's segments, step by step, and the ring length they need: ``(m, per_rank[rank][step])``.

    ``m`` is one more than the largest step at which any rank sees a key of the shard it holds: no needed
    step is dropped and no unneeded one is run (for a one-directional ring of the same length on every
    rank, which each rank computes alike from the global layout). Documents short enough, or a window,
    end the ring early.
    """
    blocks = _blocks(cu, world_size, bool(causal), balance, window, chunk)
    m = blocks.steps
    return m, tuple(tuple(blocks.block(r, i) for i in range(m)) for r in range(world_size))


@dataclass(frozen=True)
class DocumentPlan:
    """The kernel calls of every step of one rank: ``steps[i]`` for the shard of ``(rank - i) mod P``."""

    world_size: int
    rank: int
    causal: bool
    balance: str
    steps: tuple[tuple[Run, ...], ...]
    pairs: tuple[int, ...]
    """(query, key) pairs each step computes."""
    window: tuple | None = None
    chunk: int | None = None

    def work(self, local_len: int) -> tuple[float, ...]:
        """Each step's pairs as a share of a full shard-by-shard block."""
        return tuple(p / (local_len * local_len) for p in self.pairs)


@functools.lru_cache(maxsize=64)
def document_plan(
    cu: tuple[int, ...], world_size: int, rank: int, causal: bool, balance: str, window: tuple | None = None,
    chunk: int | None = None,
) -> DocumentPlan:  # fmt: skip
    """The :class:`DocumentPlan` of ``rank`` for documents ``cu`` (checked, a tuple: it is the cache key;
    ``(0, S)`` for one sequence) under an optional ``window`` (checked by :func:`check_window`) and an
    optional ``chunk`` (chunked attention, checked by :func:`check_chunk`: the documents cut into chunks of
    that many positions). The plan may have fewer than P steps (:func:`ring_segments`)."""
    schedule.check_world(world_size, rank)
    schedule.check_balance(balance, documents=True)
    schedule.check_seq_len(cu[-1], world_size, balance, what="cu_seqlens[-1]")
    made = _blocks(cu, world_size, bool(causal), balance, None if window is None else tuple(window), chunk)
    blocks = [made.block(rank, i) for i in range(made.steps)]
    steps = tuple(runs(segs) for segs in blocks)
    pairs = tuple(sum(s.pairs for s in segs) for segs in blocks)
    return DocumentPlan(world_size, rank, causal, balance, steps, pairs, window, chunk)


CALL_COST_PAIRS = 1 << 24
"""What one kernel call costs beyond its pairs, counted in (query, key) pairs: launch, merge and host work,
about 20 us on an H200, where flash computes some 8e11 pairs/s in bf16 at head_dim 128. It keeps a balance
that cuts documents into many small calls from winning on evenness alone: on the H200, 17 long-tailed
documents in 128K tokens over 8 ranks took 4.3x one varlen call under stripe (up to 84 calls per rank,
work even) and 1.15x under zigzag (4 calls, the busiest rank 1.47x the even share)."""


@dataclass(frozen=True)
class BalanceCost:
    """How :func:`choose_balance` weighs one balance: the busiest rank's pairs and calls, and the steps."""

    balance: str
    busiest: float  # the busiest rank's pairs over the even share (1.0: balanced)
    calls: int  # kernel calls of the rank with the most
    steps: int
    cost: float  # max over ranks of (pairs + CALL_COST_PAIRS x calls), over the even share


def balance_costs(
    cu: tuple[int, ...],
    world_size: int,
    causal: bool,
    window: tuple | None,
    balances: Sequence[str] = schedule.BALANCES,
    chunk: int | None = None,
) -> list[BalanceCost]:
    """Each of ``balances`` that can split ``cu[-1]`` tokens over ``world_size`` ranks, weighed (see
    :func:`choose_balance`; :data:`~xcp.schedule.ALL_BALANCES` weighs ``document_zigzag`` too; ``chunk``:
    chunked attention)."""
    out = []
    for balance in balances:
        if cu[-1] < world_size or cu[-1] % schedule.required_multiple(world_size, balance):
            continue
        m, per_rank = ring_segments(cu, world_size, bool(causal), balance, window, chunk)
        work = [sum(s.pairs for step in blocks for s in step) for blocks in per_rank]
        calls = [sum(len(runs(step)) for step in blocks) for blocks in per_rank]
        even = max(sum(work) / world_size, 1)
        cost = max(w + CALL_COST_PAIRS * c for w, c in zip(work, calls)) / even
        out.append(BalanceCost(balance, max(work) / even, max(calls), m, cost))
    return out


def choose_balance(
    world_size: int,
    *,
    causal: bool = False,
    window: object = None,
    cu_seqlens: object = None,
    seq_len: int | None = None,
    ulysses: int = 1,
    chunk: int | None = None,
) -> str:
    """The balance to shard with (pass it to :func:`xcp.shard`, :func:`xcp.attention` and
    :func:`xcp.unshard` alike) for this configuration.

    Ranks compute at the pace of the busiest, so what decides first is the busiest rank's (query, key)
    pairs plus :data:`CALL_COST_PAIRS` per kernel call (in steps of 10% of the even share); then the
    fewest ring steps (a window, or short documents, end the ring early under ``contiguous``, where each
    shard's neighbours hold the nearby tokens); then zigzag, contiguous, document_zigzag, stripe in that
    order. ``document_zigzag`` is weighed only with ``cu_seqlens`` (it places by them): it balances every
    rank's total over causal documents of any lengths, as stripe does, and like stripe makes one call per
    document in a causal block of two ranks (docs/architecture.md); where the two cost alike it comes first,
    its calls being unmasked blocks of contiguous tokens (stripe's are causal, every P-th token), and it
    splits any length of at least P tokens. Without a window, chunks or documents this is ``zigzag``.
    :func:`balance_costs` shows the figures.

    :param seq_len: the global sequence length, needed with a window or a chunk when ``cu_seqlens`` is not
        given.
    :param chunk: chunked attention (``xcp.attention(..., chunk=)``): chunks of that many positions end the
        ring early as short documents do.
    :param ulysses: U of the hybrid (``xcp.attention(..., ulysses=U)``): the balances are weighed over its
        rings of P / U ranks, which run the plan (a head group's ranks share each ring shard's heads evenly),
        and S must be a multiple of P, as the hybrid needs under every balance.
    """
    schedule.check_world(world_size)
    u = schedule.check_ulysses(ulysses)
    ring = schedule.check_ulysses_divides(u, int(world_size), "world_size")
    window = check_window(window, causal)
    chunk = check_chunk(chunk)
    if window is None and cu_seqlens is None and chunk is None:
        return schedule.DEFAULT_BALANCE
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, seq_len)
    elif seq_len is None or not schedule.is_integer(seq_len) or seq_len < 1:
        raise ValueError(
            f"seq_len: expected the global sequence length (or cu_seqlens) to compare balances; got {seq_len!r}"
        )
    else:
        cu = (0, int(seq_len))
    if u > 1 and cu[-1] % world_size:
        raise ValueError(
            f"{'seq_len' if cu_seqlens is None else 'cu_seqlens'}: expected a multiple of world_size {world_size} "
            f"tokens with ulysses={u} (each ring shard is cut into {u} equal pieces, under every balance); got "
            f"{cu[-1]}"
        )
    balances = schedule.BALANCES if cu_seqlens is None else schedule.ALL_BALANCES
    order = {b: i for i, b in enumerate(("zigzag", "contiguous", *schedule.DOCUMENT_BALANCES, "stripe"))}
    costs = balance_costs(cu, ring, bool(causal), window, balances, chunk)
    if not costs:
        raise ValueError(
            f"seq_len: no balance can split {cu[-1]} tokens over {ring} ranks (a multiple of {ring} is needed)"
        )
    return min(costs, key=lambda c: (int(10 * c.cost + 1e-9), c.steps, order[c.balance])).balance
