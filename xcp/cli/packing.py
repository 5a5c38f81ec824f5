"""What the tools share about packed documents: the ``--documents`` flag, the boundaries it gives, and each
rank's share of the work.

``--documents`` takes either

- document **lengths**, ``3000,9000,4288``: the documents in sequence order; they sum to the global length
  S (so ``--seq``, where a tool has it, may be left out, and must equal the sum when given), or
- a **distribution**, ``longtail:MIN:MAX[:SEED]``: lengths drawn (seeded, default seed 0) log-uniformly
  between MIN and MAX until they fill S, the last one trimmed so that they sum to S exactly.

Either way S must be splittable by the balance (a multiple of 2P for zigzag, of P for contiguous and stripe;
at least P tokens for document_zigzag); the error names what is needed.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .. import schedule
from ..documents import document_plan

FLAG = "--documents"
LONGTAIL = "longtail"
SYNTAX = "comma-separated document lengths (integers >= 1, summing to S) or longtail:MIN:MAX[:SEED]"
DOCUMENT_BALANCE_HELP = f"document_zigzag (each packed document zigzagged over the ranks) with {FLAG}"
"""What ``--balance`` says of the balances that place each document, in every tool that takes them."""


@dataclass(frozen=True)
class DocumentSpec:
    """A parsed ``--documents``: explicit ``lengths``, or a long-tailed distribution ``low..high``."""

    text: str
    lengths: tuple[int, ...] | None = None
    low: int = 0
    high: int = 0
    seed: int = 0

    @property
    def total(self) -> int | None:
        """The sum of explicit lengths; None for a distribution (it fills whatever S is)."""
        return None if self.lengths is None else sum(self.lengths)

    def describe(self) -> str:
        if self.lengths is not None:
            return f"{len(self.lengths)} documents, lengths {abbreviate(self.lengths)}"
        return f"long-tailed (log-uniform) lengths in [{self.low}, {self.high}], seed {self.seed}"

    def draw(self, seq: int) -> tuple[int, ...]:
        """The document lengths for a sequence of ``seq`` tokens (explicit lengths must sum to it)."""
        if self.lengths is not None:
            if sum(self.lengths) != seq:
                raise ValueError(f"{FLAG}: expected lengths summing to {seq}; got {sum(self.lengths)}")
            return self.lengths
        return longtail_lengths(seq, self.low, self.high, self.seed)


def parse_documents(text: str) -> DocumentSpec:
    """argparse type of ``--documents`` (argparse prefixes the flag: ``--documents: expected ...``)."""
    if text.startswith(LONGTAIL + ":"):
        parts = text.split(":")[1:]
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3) or not 1 <= numbers[0] <= numbers[1] or (len(numbers) == 3 and numbers[2] < 0):
            raise argparse.ArgumentTypeError(
                f"expected {LONGTAIL}:MIN:MAX[:SEED] with integers 1 <= MIN <= MAX (and SEED >= 0); got {text!r}"
            )
        return DocumentSpec(text, None, numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 0)
    try:
        lengths = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {SYNTAX}; got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected {SYNTAX}; got {text!r} (a length below 1)")
    return DocumentSpec(text, lengths)


def add_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Declare ``--documents`` on ``parser``, parsed by :func:`parse_documents`."""
    parser.add_argument(FLAG, type=parse_documents, metavar="L1,L2,...|longtail:MIN:MAX[:SEED]", help=help_text)


def longtail_lengths(seq: int, low: int, high: int, seed: int = 0) -> tuple[int, ...]:
    """Lengths drawn log-uniformly from [low, high] (seeded) until they reach ``seq``; the last one is
    trimmed so that they sum to ``seq`` exactly (it may come out shorter than ``low``)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    left = seq
    while left > 0:
        n = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        n = min(max(n, low), high, left)
        lengths.append(n)
        left -= n
    return tuple(lengths)


def check_total(total: int, world: int, balance: str) -> None:
    """A ValueError naming ``--documents``, the multiple needed (or, for a balance that places each document,
    the ``world`` tokens at least) and ``total`` when ``total`` tokens of documents cannot be split by
    ``balance`` over ``world`` ranks."""
    if balance in schedule.DOCUMENT_BALANCES and total < world:
        raise ValueError(f"{FLAG}: expected lengths summing to at least {world} tokens (balance {balance!r} over "
                         f"{world} ranks places one on each at least); got a sum of {total}")  # fmt: skip
    m = schedule.required_multiple(world, balance)
    if total % m:
        below = total - total % m
        nearest = f"{below} or {below + m}" if below else f"{m}"
        raise ValueError(
            f"{FLAG}: expected lengths summing to a multiple of {m} (balance {balance!r} over {world} ranks "
            f"needs it); got a sum of {total} (nearest: {nearest})"
        )


def check_balance(balance: str, documents: bool) -> None:
    """A ValueError naming ``--balance`` where a balance that places each packed document (``document_zigzag``)
    comes without ``--documents``. (With ``--ulysses`` it needs S a multiple of P, as every balance does:
    :func:`xcp.cli.ulysses.check_seq`.)"""
    if balance in schedule.DOCUMENT_BALANCES and not documents:
        raise ValueError(f"--balance: {balance} places each packed document: expected {FLAG} too; got --balance "
                         f"{balance} without {FLAG}")  # fmt: skip


def resolve_lengths(spec: DocumentSpec, seq: int | None, world: int, balance: str, seq_flag: str = "--seq"):
    """The document lengths and the sequence length S of a run: checked against ``seq`` (None: the sum of
    explicit lengths; needed for a distribution) and against the balance. Raises a ValueError naming the
    flag, the expected and the actual value."""
    if spec.lengths is not None:
        total = sum(spec.lengths)
        if seq is not None and seq != total:
            raise ValueError(
                f"{FLAG}: expected lengths summing to {seq_flag} {seq}; got {len(spec.lengths)} lengths summing "
                f"to {total}"
            )
        check_total(total, world, balance)
        return spec.lengths, total
    if seq is None:
        raise ValueError(f"{FLAG}: {spec.text!r} draws lengths to fill the sequence; expected {seq_flag} too")
    schedule.check_seq_len(seq, world, balance, what=seq_flag)
    return spec.draw(seq), seq


def boundaries(lengths: Sequence[int]) -> tuple[int, ...]:
    """Document lengths as cumulative boundaries ``(0, l0, l0 + l1, ..., S)``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def lengths_of(cu: Sequence[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(cu, cu[1:]))


def abbreviate(values: Sequence[int], keep: int = 8) -> str:
    """``3000,9000,...`` with at most ``keep`` values shown."""
    shown = ",".join(map(str, values[:keep]))
    return shown if len(values) <= keep else f"{shown},... ({len(values)} in all)"


def rank_pairs(cu: tuple[int, ...], world: int, causal: bool, balance: str) -> list[int]:
    """The (query, key) pairs each rank computes over the whole ring."""
    return [sum(document_plan(cu, world, r, causal, balance).pairs) for r in range(world)]


def max_over_mean(values: Sequence[float]) -> float:
    """How unbalanced a share of work is: the largest over the mean (1.0 is balanced)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0
