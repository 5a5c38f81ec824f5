"""The ring schedule: which KV shard each rank works on at each step, and how.

Pure Python (no torch), so every property of the schedule can be checked exhaustively.

Rank r of P holds, at step i, the KV shard owned by ``src = (r - i) mod P``. While it computes on that
shard it sends it to ``next = (r + 1) mod P`` and receives the shard of step i + 1 from
``prev = (r - 1) mod P``. In the backward pass the dK/dV of a shard follow one step behind it and a final
hop brings them home.

A step's query and key sub-ranges are given in *halves* of the local shard (0..2), so that the same plan
serves any shard length: ``(0, 2)`` is the whole shard, ``(1, 2)`` its second half.

Placements (:data:`BALANCES`) cut the whole sequence; :data:`DOCUMENT_BALANCES` cut each document of a packed
sequence (``document_zigzag``: every document zigzagged over the ranks), so they take the documents'
boundaries (``cu_seqlens``) and give shards that may differ by one token (:func:`shard_lengths`).
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BALANCES = ("zigzag", "contiguous", "stripe")
"""Ways to place a whole sequence on ranks. ``zigzag`` is the default everywhere."""

DOCUMENT_BALANCES = ("document_zigzag",)
"""Ways to place each document of a packed sequence on ranks: they need the documents' boundaries
(``cu_seqlens``) wherever they are named (:func:`xcp.shard`, :func:`xcp.unshard`, :func:`xcp.attention`).
``document_zigzag`` cuts every document into 2P chunks as evenly as possible and gives rank r chunks r and
2P - 1 - r of each (:func:`chunk_slices`)."""

ALL_BALANCES = BALANCES + DOCUMENT_BALANCES

DEFAULT_BALANCE = "zigzag"

MASKS = ("none", "causal", "strict")
"""Block masks: no mask; causal (query i sees keys 0..i, top-left aligned); strict (keys 0..i-1)."""

# Block kinds and what they mean for a kernel call.
FULL = "full"  # every local query against every key of the shard, no mask
DIAGONAL = "diagonal"  # the rank's own shard under a causal mask
LOWER = "lower"  # zigzag, src < r: all queries against the first half of the keys, no mask
UPPER = "upper"  # zigzag, src > r: second half of the queries against all keys, no mask
STRIPE_CAUSAL = "stripe-causal"  # stripe, src <= r (src < r or the diagonal): causal mask
STRIPE_STRICT = "stripe-strict"  # stripe, src > r: strictly-causal mask
SKIP = "skip"  # contiguous causal, src > r: every key lies in the future, nothing to compute


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ValueError naming the argument ``name``,
    the choices and the value."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}; got {value!r}")
    return str(value)


def check_balance(balance: str, documents: bool = False) -> str:
    """Return ``balance`` if it is known, else raise a ValueError that lists the known ones. ``documents``:
    the caller takes the documents' boundaries too, so :data:`DOCUMENT_BALANCES` are known."""
    if documents and balance not in ALL_BALANCES:
        raise ValueError(
            f"balance: expected one of {', '.join(BALANCES)}; got {balance!r} (with cu_seqlens also "
            f"{', '.join(DOCUMENT_BALANCES)}, which place each document)"
        )
    if documents:
        return str(balance)
    if balance in DOCUMENT_BALANCES:
        raise ValueError(
            f"balance: expected one of {', '.join(BALANCES)} here ({balance!r} places the documents of a packed "
            f"sequence: only xcp.shard, xcp.unshard and xcp.attention, given cu_seqlens, take it); got {balance!r}"
        )
    return check_choice("balance", balance, BALANCES)


def check_mask(mask: str) -> str:
    """Return ``mask`` if known, else raise a ValueError listing the known masks."""
    return check_choice("mask", mask, MASKS)


_NO_RANK = object()


def is_integer(value: object) -> bool:
    """True for Python and numpy integers (anything registered as ``numbers.Integral``), never for bools."""
    return isinstance(value, numbers.Integral) and not is_bool(value)


def is_bool(value: object) -> bool:
    """True for ``bool`` and ``numpy.bool_``."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def check_world(world_size: int, rank: object = _NO_RANK) -> None:
    """Raise a ValueError unless ``world_size >= 1`` and (when a rank is given) ``0 <= rank < world_size``;
    numpy integers are integers too."""
    if not is_integer(world_size) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1; got {world_size!r} ({type(world_size).__name__})")
    if rank is not _NO_RANK and (not is_integer(rank) or not 0 <= rank < world_size):  # type: ignore[operator]
        raise ValueError(f"rank: expected an integer in [0, {world_size}); got {rank!r} ({type(rank).__name__})")


def check_ulysses(ulysses: Any) -> int:
    """``ulysses`` as an int; a TypeError or ValueError naming it unless a positive integer."""
    if type(ulysses) is int and ulysses >= 1:
        return ulysses
    if not is_integer(ulysses):
        raise TypeError(f"ulysses: expected a positive integer (head-parallel ranks); got {ulysses!r}")
    if int(ulysses) < 1:
        raise ValueError(f"ulysses: expected a positive integer (head-parallel ranks); got {ulysses!r}")
    return int(ulysses)


def check_ulysses_divides(ulysses: int, world_size: int, what: str = "the world size") -> int:
    """R = world_size // ulysses; a ValueError naming ulysses unless it divides ``world_size``."""
    if world_size % ulysses:
        raise ValueError(
            f"ulysses: expected a divisor of {what} {world_size} (P = ulysses x ring ranks); got {ulysses}"
        )
    return world_size // ulysses


@dataclass(frozen=True)
class Step:
    """What one rank does at one step of the ring.

    ``q_halves``/``k_halves`` are half-open ranges in halves of the local shard; ``work`` is the share of
    a full shard-by-shard block that the step computes (1.0 for an unmasked full block, 0.5 for a causal
    diagonal). ``send_to``/``recv_from`` are None where no KV transfer follows the step (the last step).
    ``dkv_send_to``/``dkv_recv_from`` route the dK/dV of ``src``: after computing, the rank sends the dKV
    of ``src`` to ``dkv_send_to``; before adding its contribution it received that dKV from
    ``dkv_recv_from`` (None at step 0, where the rank starts the accumulation of its own shard).
    """

    step: int
    rank: int
    src: int
    kind: str
    mask: str
    q_halves: tuple[int, int]
    k_halves: tuple[int, int]
    work: float
    send_to: int | None
    recv_from: int | None
    dkv_send_to: int
    dkv_recv_from: int | None

    @property
    def computes(self) -> bool:
        """True unless the block is empty (contiguous causal, future keys)."""
        return self.kind != SKIP

    def q_range(self, local_len: int) -> tuple[int, int]:
        """The query rows ``[start, stop)`` of a local shard of ``local_len`` tokens."""
        return _halves_to_range(self.q_halves, local_len)

    def k_range(self, local_len: int) -> tuple[int, int]:
        """The key rows ``[start, stop)`` of a KV shard of ``local_len`` tokens."""
        return _halves_to_range(self.k_halves, local_len)


@dataclass(frozen=True)
class Plan:
    """The steps of one rank, plus where its finished dKV comes home from (``dkv_home_from``)."""

    world_size: int
    rank: int
    causal: bool
    balance: str
    steps: tuple[Step, ...]

    @property
    def dkv_home_from(self) -> int:
        """The rank that sends this rank its own finished dK/dV after the last step (the last to use them)."""
        return (self.rank + len(self.steps) - 1) % self.world_size

    @property
    def dkv_home_to(self) -> int:
        """The owner of the dK/dV this rank holds after the last step (it sends them there)."""
        return self.steps[-1].src

    def dkv_recv_after(self, step: int) -> int:
        """The rank whose dK/dV message this rank receives during ``step``: the previous rank's running
        sum for the next step, or, during the last step, this rank's own finished dK/dV."""
        return self.dkv_home_from if step == len(self.steps) - 1 else (self.rank - 1) % self.world_size


def _halves_to_range(halves: tuple[int, int], local_len: int) -> tuple[int, int]:
    lo, hi = halves
    if (lo, hi) == (0, 2):
        return 0, local_len
    if local_len % 2:
        raise ValueError(f"local shard length: expected an even number for a half block; got {local_len}")
    return lo * local_len // 2, hi * local_len // 2


def _block(balance: str, causal: bool, rank: int, src: int) -> tuple[str, str, tuple, tuple, float]:
    """Kind, mask, query halves, key halves and work of the block (rank's queries, src's keys)."""
    whole = (0, 2)
    if not causal:
        return FULL, "none", whole, whole, 1.0
    if balance in ("zigzag", "document_zigzag"):  # document_zigzag: the same blocks inside every document
        if src == rank:
            return DIAGONAL, "causal", whole, whole, 0.5
        if src < rank:
            return LOWER, "none", whole, (0, 1), 0.5
        return UPPER, "none", (1, 2), whole, 0.5
    if balance == "stripe":
        if src <= rank:
            return STRIPE_CAUSAL, "causal", whole, whole, 0.5
        return STRIPE_STRICT, "strict", whole, whole, 0.5
    # contiguous
    if src == rank:
        return DIAGONAL, "causal", whole, whole, 0.5
    if src < rank:
        return FULL, "none", whole, whole, 1.0
    return SKIP, "none", (0, 0), (0, 0), 0.0


def plan(
    world_size: int, rank: int, causal: bool = False, balance: str = DEFAULT_BALANCE, steps: int | None = None
) -> Plan:
    """The per-step plan of ``rank`` in a ring of ``world_size`` ranks.

    :param world_size: number of ranks P (>= 1).
    :param rank: this rank, 0 <= rank < P.
    :param causal: whether the global attention is causal.
    :param balance: how the sequence is placed on ranks (one of :data:`ALL_BALANCES`; with documents the
        kernel calls come from :func:`xcp.documents.document_plan`, the steps' routes from here).
    :param steps: how many steps the ring runs (1..P; default P). A ring of m < P steps (a window that
        reaches only the shards of the m - 1 previous ranks) forwards each K/V shard m - 1 times, and the
        finished dK/dV of a shard go home from the last rank that used it in one hop, ``m - 1`` ranks back.
    :returns: a :class:`Plan` with one :class:`Step` per source shard, step 0 being the rank's own.
    """
    check_world(world_size, rank)
    check_balance(balance, documents=True)
    m = world_size if steps is None else steps
    if not is_integer(m) or not 1 <= m <= world_size:
        raise ValueError(f"steps: expected an integer in [1, {world_size}]; got {steps!r}")
    return _plan(int(world_size), int(rank), bool(causal), balance, int(m))


@functools.lru_cache(maxsize=1024)
def _plan(world_size: int, rank: int, causal: bool, balance: str, m: int) -> Plan:
    """The plan of checked arguments, made once (plans are frozen: every call may share one)."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    out = []
    for i in range(m):
        src = (rank - i) % world_size
        kind, mask, qh, kh, work = _block(balance, causal, rank, src)
        last = i == m - 1
        step = Step(step=i, rank=rank, src=src, kind=kind, mask=mask, q_halves=qh, k_halves=kh, work=work,
                    send_to=None if last else nxt, recv_from=None if last else prv,
                    dkv_send_to=src if last else nxt,  # the last hop goes home, to the shard's owner
                    dkv_recv_from=None if i == 0 else prv)  # fmt: skip
        out.append(step)
    return Plan(world_size, rank, causal, balance, tuple(out))


# ----------------------------------------------------------------------------------------------------
# Sharding index maps


def required_multiple(world_size: int, balance: str = DEFAULT_BALANCE) -> int:
    """The number the sequence length must be a multiple of for ``balance`` over ``world_size`` ranks (1 for
    :data:`DOCUMENT_BALANCES`, which split any length of at least ``world_size`` tokens, and for a world of
    one, whose one shard is the whole sequence under every balance)."""
    check_world(world_size)
    check_balance(balance, documents=True)
    if balance in DOCUMENT_BALANCES or world_size == 1:
        return 1
    return 2 * world_size if balance == "zigzag" else world_size


def check_seq_len(seq_len: int, world_size: int, balance: str = DEFAULT_BALANCE, what: str = "sequence length") -> None:
    """Raise a ValueError naming the multiple needed when ``seq_len`` cannot be split by ``balance``."""
    m = required_multiple(world_size, balance)
    if balance in DOCUMENT_BALANCES:
        if seq_len < world_size:
            raise ValueError(
                f"{what}: balance {balance!r} over {world_size} ranks needs at least {world_size} tokens (one per "
                f"rank); got {seq_len}"
            )
        return
    if seq_len < m or seq_len % m:
        raise ValueError(
            f"{what}: balance {balance!r} over {world_size} ranks needs a positive multiple of {m}; got {seq_len}"
        )


def shard_lengths(seq_len: int, world_size: int, balance: str = DEFAULT_BALANCE) -> tuple[int, ...]:
    """The tokens each rank's shard holds. S / P for a whole-sequence balance; for ``document_zigzag``
    ``S // P + (1 if r < S % P else 0)`` for rank r, whatever the documents: shards differ by one token at
    most, the longer ones first (the documents' uneven chunks hand their extra tokens round the ranks)."""
    check_world(world_size)
    check_seq_len(seq_len, world_size, balance)
    n, extra = divmod(seq_len, world_size)
    return tuple(n + (r < extra) for r in range(world_size))


def shard_indices(
    seq_len: int,
    world_size: int,
    rank: int,
    balance: str = DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
) -> list[int]:
    """Global token positions held by ``rank``, in local order.

    :param seq_len: global sequence length S (a multiple of :func:`required_multiple`).
    :param cu_seqlens: the documents' boundaries ``(0, ..., S)``: for :data:`DOCUMENT_BALANCES` only.
    :returns: the :func:`shard_lengths` positions of the rank; local token j of the rank is global token
        ``result[j]``.
    """
    return [i for a, b, c in chunk_slices(seq_len, world_size, rank, balance, cu_seqlens) for i in range(a, b, c)]


def chunk_slices(
    seq_len: int,
    world_size: int,
    rank: int,
    balance: str = DEFAULT_BALANCE,
    cu_seqlens: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """The same map as :func:`shard_indices`, as ``(start, stop, step)`` slices of the global sequence.

    Concatenating ``x[start:stop:step]`` over the slices gives the rank's shard; a tensor implementation
    uses these to avoid index tensors. ``document_zigzag`` (``cu_seqlens`` needed): each document of L
    tokens is cut into 2P chunks of ``L // 2P`` tokens, ``L % 2P`` of them one longer; rank r gets chunks r
    and 2P - 1 - r of every document, in document order (slices that meet are joined). The extra tokens go
    round the ranks across documents (the i-th extra token of the sequence to rank i mod P: to its first
    chunk of the document, or, where the document gives it two, to both), which keeps the shards within one
    token of each other (:func:`shard_lengths`).
    """
    check_world(world_size, rank)
    check_seq_len(seq_len, world_size, balance)
    if balance in DOCUMENT_BALANCES:
        return list(_document_zigzag(_document_boundaries(cu_seqlens, seq_len, balance), int(world_size))[rank])
    if cu_seqlens is not None:
        raise ValueError(
            f"cu_seqlens: expected None with balance {balance!r}, which places the whole sequence (only "
            f"{', '.join(DOCUMENT_BALANCES)} place by documents); got {list(cu_seqlens)}"
        )
    if balance == "contiguous" or world_size == 1:  # a world of one holds the whole sequence, in order
        n = seq_len // world_size
        return [(rank * n, (rank + 1) * n, 1)]
    if balance == "stripe":
        return [(rank, seq_len, world_size)]
    c = seq_len // (2 * world_size)
    second = 2 * world_size - 1 - rank
    return [(rank * c, (rank + 1) * c, 1), (second * c, (second + 1) * c, 1)]


def _document_boundaries(cu_seqlens: Sequence[int] | None, seq_len: int, balance: str) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints ``0 <= ... <= seq_len`` (the full check, with every message, is
    :func:`xcp.documents.check_cu_seqlens`; the entry points make it first)."""
    if cu_seqlens is None:
        raise ValueError(
            f"cu_seqlens: expected the documents' boundaries (0, ..., {seq_len}) with balance {balance!r}, which "
            "places each document over the ranks; got None"
        )
    cu = tuple(int(x) for x in cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing boundaries from 0 to {seq_len}; got {list(cu)}")
    return cu


@functools.lru_cache(maxsize=64)
def _document_zigzag(cu: tuple[int, ...], world: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every rank's ``document_zigzag`` slices of the documents ``cu`` (see :func:`chunk_slices`)."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    given = 0  # extra tokens handed out so far
    for start, stop in zip(cu, cu[1:]):
        base, extra = divmod(stop - start, 2 * world)
        sizes = [base] * (2 * world)
        for i in range(extra):  # i < P: rank (given + i) % P's first chunk; i >= P: that rank's second one
            r = (given + i) % world
            sizes[r if i < world else 2 * world - 1 - r] += 1
        given += extra
        bounds = list(itertools.accumulate(sizes, initial=start))
        for r, mine in enumerate(pieces):
            for c in (r, 2 * world - 1 - r):
                a, b = bounds[c], bounds[c + 1]
                if a < b and mine and mine[-1][1] == a:
                    mine[-1] = (mine[-1][0], b, 1)
                elif a < b:
                    mine.append((a, b, 1))
    return tuple(tuple(p) for p in pieces)
