"""What the tools share about sliding windows: the ``--window`` flag, the steps a ring runs, the bytes each
rank sends, and which balance :func:`xcp.choose_balance` recommends and why.

``--window L,R``: query i sees key j iff ``i - L <= j <= i + R`` (global positions); ``none`` leaves a side
unbounded; with a causal mask R must be 0 or none. A window needs batch 1 (the ring plans it as one packed
sequence, ``(0, S)``, or over ``--documents``).

The bytes a rank sends, for a ring that runs m of P steps: :func:`xcp.traffic.ring_traffic` (K/V shards of
S/P tokens), or :func:`xcp.traffic.ring_bytes` where v has another head dim or ``document_zigzag`` shards
differ by a token.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence

import torch

from .. import schedule
from ..documents import balance_costs, check_window, choose_balance, document_plan, ring_segments
from ..kernels.merge import accumulator_dtype
from ..traffic import RingTraffic
from .common import human_bytes

FLAG = "--window"
AUTO = "auto"
BALANCE_CHOICES = (*schedule.BALANCES, AUTO)
DOCUMENT_BALANCE_CHOICES = (*schedule.ALL_BALANCES, AUTO)
"""``--balance`` where packed documents may be given: the balances that place each document too."""
BALANCE_HELP = (
    "how the sequence is cut into shards; auto: what xcp.choose_balance recommends for the configuration "
    "(the busiest rank's work first, then the fewest ring steps)"
)

Window = tuple  # (left, right): ints >= 0 or None


def parse_window(text: str) -> tuple[int | None, int | None]:
    """argparse type of ``--window``: ``L,R``, each an integer >= 0 or ``none`` (argparse prefixes the flag)."""
    parts = text.split(",")
    sides: list[int | None] = []
    for part in parts:
        part = part.strip().lower()
        if part == "none":
            sides.append(None)
            continue
        try:
            side = int(part)
        except ValueError:
            sides = []
            break
        if side < 0:
            sides = []
            break
        sides.append(side)
    if len(parts) != 2 or len(sides) != 2:
        raise argparse.ArgumentTypeError(
            f"expected L,R: keys i-L..i+R for query i, each an integer >= 0 or none (unbounded); got {text!r}"
        )
    return sides[0], sides[1]


def check(window: tuple | None, causal: bool) -> tuple[int | None, int | None] | None:
    """A parsed ``--window`` checked against the mask: None stays None; a window that bounds nothing (the
    dense ring) or a right side with a causal mask is a ValueError naming ``--window``."""
    if window is None:
        return None
    if causal and window[1] not in (0, None):
        raise ValueError(
            f"{FLAG}: with a causal mask R must be 0 or none (no query sees a later key); got {text_of(window)}"
        )
    try:
        checked = check_window(window, causal)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{FLAG}: {str(exc).replace('window: ', '', 1)}") from None
    if checked is None:
        raise ValueError(
            f"{FLAG}: {text_of(window)} with {'a causal' if causal else 'no'} mask bounds nothing: it is the dense "
            "ring; leave --window out, or give L a number"
        )
    return checked


def text_of(window: Sequence[int | None]) -> str:
    """``4096,0`` / ``none,8``: the flag's syntax."""
    return ",".join("none" if x is None else str(x) for x in window)


def describe(window: Sequence[int | None]) -> str:
    """``window 4096,0 (query i sees keys i-4096..i)``."""
    left, right = window
    lo = "the start" if left is None else ("i" if left == 0 else f"i-{left}")
    hi = "the end" if right is None else ("i" if right == 0 else f"i+{right}")
    return f"window {text_of(window)} (query i sees keys {lo}..{hi})"


def ring_steps(cu: tuple[int, ...], world: int, causal: bool, balance: str, window: tuple | None) -> int:
    """The steps m the ring runs: P, or fewer where the window (or short documents) leave every later block
    empty (:func:`xcp.documents.ring_segments`)."""
    if window is None and cu == (0, cu[-1]):
        return world
    return ring_segments(cu, world, causal, balance, window)[0]


def rank_pairs(cu: tuple[int, ...], world: int, causal: bool, balance: str, window: tuple | None) -> list[int]:
    """The (query, key) pairs each rank computes over the whole ring."""
    return [sum(document_plan(cu, world, r, causal, balance, window).pairs) for r in range(world)]


def formula_lines(t: RingTraffic, local: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  value_head_dim: int | None = None, padded: bool = False) -> list[str]:  # fmt: skip
    """How the bytes are counted, with the problem's numbers in (``local``: S/P, or with ``padded`` the
    longest shard's tokens, ⌈S/P⌉; ``value_head_dim``: v's head dim, None: ``head_dim``)."""
    name, acc = (str(x).replace("torch.", "") for x in (dtype, accumulator_dtype(dtype)))
    item = torch.empty((), dtype=dtype).element_size()
    acc_item = torch.empty((), dtype=accumulator_dtype(dtype)).element_size()
    n = "⌈S/P⌉" if padded else "S/P"
    if value_head_dim is None or value_head_dim == head_dim:
        shape, numbers = f"2·({n})·Hkv·D", f"2·{local}·{kv_heads}·{head_dim}"
    else:  # K in q/k's head dim, V in v's
        shape, numbers = f"({n})·Hkv·(D+Dv)", f"{local}·{kv_heads}·({head_dim}+{value_head_dim})"
    return [
        f"a K/V shard is {shape}·itemsize = {numbers}·{item} ({name}) = {human_bytes(t.kv_shard)}",
        f"a dK/dV message is {shape}·{acc_item} ({acc} accumulators) = {human_bytes(t.dkv_message)}",
        "a ring of m steps sends, per rank: forward m-1 K/V shards; backward m-1 K/V shards and m dK/dV",
        "messages (a ring of 1 step sends nothing)",
        *([f"the shards differ by a token: each travels as long as the longest, {n} = {local} tokens"] * padded),
    ]


def balance_lines(cu: tuple[int, ...], world: int, causal: bool, window: tuple | None, current: str,
                  ulysses: int = 1) -> list[str]:  # fmt: skip
    """Which balance xcp.choose_balance recommends, and how it weighs each (xcp.documents.balance_costs; with
    documents, the balances that place each document too; with ``ulysses``, over the rings of P/U ranks)."""
    documents = None if cu == (0, cu[-1]) else cu
    chosen = choose_balance(world, causal=causal, window=window, cu_seqlens=documents, seq_len=cu[-1], ulysses=ulysses)
    world //= ulysses  # the ranks of the ring the balances are weighed over
    balances = schedule.BALANCES if documents is None else schedule.ALL_BALANCES
    costs = {c.balance: c for c in balance_costs(cu, world, causal, window, balances)}
    order = ", ".join(("zigzag", "contiguous", *(schedule.DOCUMENT_BALANCES if documents else ()), "stripe"))
    how = (f"(it weighs the busiest rank's pairs plus a per-call cost of 2^24 pairs, in 10% steps of the even share; "
           f"then the fewest ring steps; then {order} in that order):")  # fmt: skip
    lines = [
        f"balance: xcp.choose_balance recommends {chosen}"
        + (f" (ulysses={ulysses}: weighed over rings of {world} ranks)" if ulysses > 1 else ""),
        *textwrap.wrap(how, 100, initial_indent="  ", subsequent_indent="  "),
    ]
    width = max(map(len, balances))
    for balance in balances:
        c = costs.get(balance)
        if c is None:
            text = f"cannot split S = {cu[-1]} (needs a multiple of {schedule.required_multiple(world, balance)})"
        else:
            text = f"busiest {c.busiest:.2f}x even, {c.calls} calls, cost {c.cost:.2f}, {c.steps}/{world} steps"
        marks = [m for m, on in (("recommended", balance == chosen), ("this plan", balance == current)) if on]
        lines.append(f"  {balance:<{width}} {text}" + (f"  <- {', '.join(marks)}" if marks else ""))
    return lines


def resolve_balance(balance: str, world: int, causal: bool, window: tuple | None, cu: tuple[int, ...] | None,
                    seq: int | None = None, ulysses: int = 1) -> str:  # fmt: skip
    """``balance`` itself, or for ``auto`` what :func:`xcp.choose_balance` recommends (``cu``: documents;
    ``seq``: S when there are none; ``ulysses``: U of the hybrid over ``world`` ranks)."""
    if balance != AUTO:
        return balance
    return choose_balance(world, causal=causal, window=window, cu_seqlens=cu, seq_len=None if cu else seq,
                          ulysses=ulysses)  # fmt: skip


def check_balance(balance: str, documents: bool = False) -> str:
    """The balance whose split rule an ``auto`` configuration must meet at least: with packed ``documents``
    ``document_zigzag``'s (any length of at least P tokens, as :func:`xcp.choose_balance` weighs it there),
    else a multiple of P (``contiguous``'s)."""
    if balance != AUTO:
        return balance
    return schedule.DOCUMENT_BALANCES[0] if documents else "contiguous"
