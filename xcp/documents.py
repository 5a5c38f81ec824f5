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
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from . import schedule


@dataclass(frozen=True)
class Segment:
    """Query rows [q0, q1) of this rank against key rows [k0, k1) of the source shard, one document.

    ``causal``: square causal (q1 - q0 == k1 - k0, query q0 + m sees keys k0..k0 + m); else no mask.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    @property
    def pairs(self) -> int:
        """The (query, key) pairs the segment computes."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        return n * (n + 1) // 2 if self.causal else n * m


@dataclass(frozen=True)
class Run:
    """One kernel call: segments that tile query rows [q0, q1) and key rows [k0, k1) without gaps.

    ``cu_q``/``cu_k`` are the cumulative lengths relative to q0/k0 (``(0, ..., q1 - q0)``); one segment is
    a dense call with mask ``causal`` or ``none``.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]

    @property
    def segments(self) -> int:
        return len(self.cu_q) - 1

    @property
    def mask(self) -> str:
        """The block mask of a one-segment run (``causal`` or ``none``)."""
        return "causal" if self.causal else "none"


def check_cu_seqlens(cu: object, seq_len: int | None = None, name: str = "cu_seqlens") -> tuple[int, ...]:
    """``cu`` as a tuple of ints, checked: 1-D, integers, ``0 = cu[0] < cu[1] < ... < cu[-1] = seq_len``.

    Accepts a list/tuple of ints or anything with ``tolist()`` (a 1-D integer tensor or array); the
    caller checks the tensor's dtype. Raises a ValueError naming ``name``, the expected and the actual.
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
        if values[i] <= values[i - 1]:
            raise ValueError(
                f"{name}: expected strictly increasing boundaries (no empty document); got "
                f"cu_seqlens[{i - 1}] = {values[i - 1]} >= cu_seqlens[{i}] = {values[i]}"
            )
    if seq_len is not None and values[-1] != seq_len:
        raise ValueError(
            f"{name}: expected cu_seqlens[-1] == {seq_len} (the global sequence length: local length x ranks); "
            f"got {values[-1]}"
        )
    return values


# ---------------------------------------------------------------------------------------------- local maps
@dataclass(frozen=True)
class _Piece:
    """Local rows [local0, local0 + count) hold global positions global0 + stride * t."""

    local0: int
    global0: int
    stride: int
    count: int


def _pieces(seq_len: int, world: int, rank: int, balance: str) -> tuple[_Piece, ...]:
    out, local = [], 0
    for start, stop, step in schedule.chunk_slices(seq_len, world, rank, balance):
        count = len(range(start, stop, step))
        out.append(_Piece(local, start, step, count))
        local += count
    return tuple(out)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local_range(pieces: Sequence[_Piece], lo: int, hi: int) -> tuple[int, int]:
    """Local rows whose global position lies in [lo, hi): contiguous, since the map is monotone."""
    first = last = None
    for p in pieces:
        t0 = max(0, _ceil_div(lo - p.global0, p.stride))
        t1 = min(p.count, _ceil_div(hi - p.global0, p.stride))
        if t0 < t1:
            if first is None:
                first = p.local0 + t0
            last = p.local0 + t1
    return (first, last) if first is not None else (0, 0)


def _global(pieces: Sequence[_Piece], row: int) -> int:
    for p in pieces:
        if row < p.local0 + p.count:
            return p.global0 + p.stride * (row - p.local0)
    raise IndexError(row)


def _count_at_most(pieces: Sequence[_Piece], position: int) -> int:
    """How many local rows hold a global position <= ``position`` (a prefix, the map being monotone)."""
    n = 0
    for p in pieces:
        if position < p.global0:
            break
        n = p.local0 + min(p.count, (position - p.global0) // p.stride + 1)
    return n


def _doc_span(cu: tuple[int, ...], pieces: Sequence[_Piece]) -> tuple[int, int]:
    """The documents [d0, d1) that hold at least one of the rank's positions."""
    first = _global(pieces, 0)
    last = max(p.global0 + p.stride * (p.count - 1) for p in pieces)
    return bisect.bisect_right(cu, first) - 1, bisect.bisect_right(cu, last)


# ---------------------------------------------------------------------------------------------- segments
def segments(cu: tuple[int, ...], world: int, rank: int, src: int, balance: str, causal: bool) -> tuple[Segment, ...]:
    """The segments of the block of ``rank``'s queries against ``src``'s keys, in query order."""
    seq_len = cu[-1]
    qp, kp = _pieces(seq_len, world, rank, balance), _pieces(seq_len, world, src, balance)
    qd, kd = _doc_span(cu, qp), _doc_span(cu, kp)
    out = []
    for d in range(max(qd[0], kd[0]), min(qd[1], kd[1])):
        q0, q1 = _local_range(qp, cu[d], cu[d + 1])
        k0, k1 = _local_range(kp, cu[d], cu[d + 1])
        if q0 == q1 or k0 == k1:
            continue
        if not causal:
            out.append(Segment(q0, q1, k0, k1, False))
            continue
        # keys the last query sees; queries that see the first key
        k1 = min(k1, _count_at_most(kp, _global(qp, q1 - 1)))
        if k1 <= k0:
            continue
        q0 = max(q0, _count_at_most(qp, _global(kp, k0) - 1))
        if q0 >= q1:
            continue
        if _global(kp, k1 - 1) <= _global(qp, q0) and (q1 - q0, k1 - k0) != (1, 1):
            out.append(Segment(q0, q1, k0, k1, False))
            continue  # (a 1 x 1 segment is called causal: it then joins its neighbours' varlen call)
        if q1 - q0 != k1 - k0 or _count_at_most(kp, _global(qp, q0)) != k0 + 1:
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
            out.append(Run(a.q0, b.q1, a.k0, b.k1, a.causal, cu_q, cu_k))
            group.clear()

    for s in segs:
        if group and not (s.causal == group[-1].causal and s.q0 == group[-1].q1 and s.k0 == group[-1].k1):
            flush()
        group.append(s)
    flush()
    return tuple(out)


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

    def work(self, local_len: int) -> tuple[float, ...]:
        """Each step's pairs as a share of a full shard-by-shard block."""
        return tuple(p / (local_len * local_len) for p in self.pairs)


@functools.lru_cache(maxsize=64)
def document_plan(cu: tuple[int, ...], world_size: int, rank: int, causal: bool, balance: str) -> DocumentPlan:
    """The :class:`DocumentPlan` of ``rank`` for documents ``cu`` (checked, a tuple: it is the cache key)."""
    schedule.check_world(world_size, rank)
    schedule.check_balance(balance)
    schedule.check_seq_len(cu[-1], world_size, balance, what="cu_seqlens[-1]")
    steps, pairs = [], []
    for i in range(world_size):
        segs = segments(cu, world_size, rank, (rank - i) % world_size, balance, causal)
        steps.append(runs(segs))
        pairs.append(sum(s.pairs for s in segs))
    return DocumentPlan(world_size, rank, causal, balance, tuple(steps), tuple(pairs))
