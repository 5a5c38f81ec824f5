"""What ``xcp bench`` measures (:class:`BenchConfig`) and the checks that refuse, before anything runs, a
configuration that cannot be measured; the constants the modes and the flags share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ... import schedule
from .. import packing, ulysses, windows
from ..common import DTYPES, Measurement
from ..decode import CHUNK_FLAG as DECODE_CHUNK_FLAG
from ..decode import FLAG as DECODE_FLAG

T = TypeVar("T")

HOST_TOKENS = 16
"""Tokens per rank of the host figure's default problem."""
HOST_MIN_REPS = 5
"""The host and world-of-one figures are medians of at least this many repetitions, whatever ``--reps``."""

REPLAY_FLAG = "--replay"
REPLAY_HELP = (
    "besides the eager times, replay each ring as one device graph that holds every rank's work (the ranks' "
    "threads issue it on their streams, which fork from the capture stream and join it) against the "
    "whole-sequence call replayed as a graph too, checked first: the ring's device time without the host, "
    "what ranks whose host keeps ahead of the device (or that replay captured step loops) would see"
)

DECODE_REPLAYS = " (it replays its steps as device graphs wherever the backend has them; --no-graph leaves them out)"
"""Why ``--replay`` is not a flag of ``--decode``."""


@dataclass
class BenchConfig(Measurement):
    """What to measure; the defaults are the H200 grid."""

    worlds: list[int] = field(default_factory=lambda: [2, 4, 8])
    causal: list[bool] = field(default_factory=lambda: [False, True])
    memory_worlds: list[int] = field(default_factory=lambda: [2, 4, 8])
    graph: bool = True
    check: bool = True
    sizes_note: str | None = None  # which device-dependent size defaults were used, for the header
    documents: str | None = None
    """``--documents`` as given (lengths, or ``longtail:MIN:MAX[:SEED]``): time the ring over packed documents
    against one whole-sequence varlen call instead of the dense figures; None: the dense bench."""
    compare_dense: bool = False
    """With ``documents`` or ``window``: also time the dense ring at the same S, P and masks (its ratio is
    printed beside)."""
    window: str | None = None
    """``--window`` as given (``L,R``): time the ring under the sliding window (over ``documents`` if given)
    against one whole-sequence windowed varlen call, with the steps and bytes sent per rank; None: no window."""
    host: bool = False
    """``--host``: instead of the dense grid, the host microseconds per forward and backward ring step of one
    rank for each of ``worlds`` (kernels that compute nothing), then the world-of-one figure."""
    world_of_one: bool = False
    """``--world-of-one`` (implied by ``host``): xcp.attention without a group against torch SDPA at ``seqs``."""
    host_tokens: int = HOST_TOKENS
    """Tokens per rank of the host figure (tiny: the figure is about the host, not the kernels)."""
    ulysses: list[int] | None = None
    """``--ulysses``: instead of the dense grid, the hybrid all-to-all + ring for each U (dividing every P of
    ``worlds`` and ``heads``) against one whole-sequence kernel call, with the bytes each rank sends."""
    replay: bool = False
    """``--replay``: besides the eager times, each ring row replayed as one device graph holding every rank's
    work, against the whole-sequence call replayed as a graph too (the ring's device time without the host)."""
    decode: bool = False
    """``--decode``: instead of the ring figures, a decode step over a sharded KV cache of L = each of ``seqs``
    tokens over P = each of ``worlds`` virtual ranks (eager, and replayed as one device graph where the backend
    has graphs and ``graph`` is on) against one whole-cache call (:mod:`.decode`)."""
    chunk: int = 0
    """With ``decode``: T > 0 also times a chunk of T tokens appended after the cached ones; 0: decode only."""

    def window_sides(self) -> tuple[int | None, int | None] | None:
        """``window`` parsed (None: no window); a ValueError naming ``--window`` where it does not parse."""
        return None if self.window is None else _parsed(windows.parse_window, self.window, windows.FLAG)

    def balance_for(self, world: int, causal: bool, cu: tuple[int, ...] | None = None, seq: int | None = None) -> str:
        """The balance of one figure: ``balance``, or with ``auto`` what xcp.choose_balance recommends for it
        (``cu``: the documents, if any; ``seq``: S, with a window)."""
        window = windows.check(self.window_sides(), causal)
        return windows.resolve_balance(self.balance, world, causal, window, cu, seq)

    def document_spec(self) -> packing.DocumentSpec | None:
        """``documents`` parsed (None: none); a ValueError naming ``--documents`` where it does not parse."""
        return None if self.documents is None else _parsed(packing.parse_documents, self.documents, packing.FLAG)

    def validate(self) -> None:
        """Raise a ValueError naming the first field that cannot be measured."""
        if self.decode:
            return self._validate_decode()
        if self.chunk:
            raise ValueError(f"{DECODE_CHUNK_FLAG}: expected together with {DECODE_FLAG}; got {self.chunk!r}")
        if self.replay and (self.host or self.world_of_one):
            flag = "--host" if self.host else "--world-of-one"
            raise ValueError(f"{REPLAY_FLAG}: applies to the ring timings, not to {flag} (a replay has no host "
                             "work to measure)")  # fmt: skip
        if self.host or self.world_of_one:
            return self._validate_host()
        if self.ulysses is not None and (self.documents is not None or self.window is not None):
            name = packing.FLAG if self.documents is not None else windows.FLAG
            raise ValueError(f"{name}: not measured with {ulysses.FLAG} yet; got {self.documents or self.window!r}")
        if self.balance not in windows.DOCUMENT_BALANCE_CHOICES:
            choices = ", ".join(windows.DOCUMENT_BALANCE_CHOICES)
            raise ValueError(f"--balance: expected one of {choices}; got {self.balance!r}")
        if self.balance in schedule.DOCUMENT_BALANCES and (self.documents is None or self.window is not None):
            raise ValueError(f"--balance: {self.balance} places each packed document: expected --documents (and "
                             f"no --window in the bench); got balance {self.balance!r} without them")  # fmt: skip
        split_by = windows.check_balance(self.balance)  # auto: at least a multiple of P
        window = self.window_sides()
        if window is not None:
            for causal in self.causal:
                windows.check(window, causal)
            if self.batch != 1:
                raise ValueError(f"--batch: expected 1 with --window (the ring plans it as one packed sequence); "
                                 f"got {self.batch}")  # fmt: skip
        spec = self.document_spec()
        if spec is not None:  # first, so that a sum the balance cannot split is named by --documents
            if self.batch != 1:
                raise ValueError(f"--batch: expected 1 with --documents (the packed layout); got {self.batch}")
            for s in self.seqs:
                for p in self.worlds:
                    packing.resolve_lengths(spec, s, p, split_by, "--seqs")
        for name in ("seqs", "worlds", "memory_worlds"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}: expected a non-empty list of integers >= 1; got {values!r}")
        self._validate_problem("memory_seq")
        if self.ulysses is not None:
            return self._validate_ulysses()
        for s in self.seqs:
            for p in self.worlds:
                if split_by == "zigzag" and s % (2 * p):
                    raise ValueError(f"seqs: {s} is not a multiple of 2 x world {p} (zigzag needs it)")
                if s % schedule.required_multiple(p, split_by):
                    multiple = schedule.required_multiple(p, split_by)
                    raise ValueError(f"seqs: {s} is not a multiple of {multiple} (balance {self.balance!r} over {p} "
                                     "ranks needs it)")  # fmt: skip

    def _validate_problem(self, size: str) -> None:
        """The checks every figure makes: the sizes (and ``size``, the figure's own length, and the value head
        dim where given) are >= 1, the warm-up >= 0, the K/V heads divide the heads, the dtype is known."""
        for name in ("batch", "heads", "kv_heads", "head_dim", "reps", size):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1; got {getattr(self, name)!r}")
        if self.value_head_dim is not None and (not isinstance(self.value_head_dim, int) or self.value_head_dim < 1):
            raise ValueError(
                f"value_head_dim: expected a positive integer (None: head_dim); got {self.value_head_dim!r}"
            )
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an integer >= 0; got {self.warmup!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads={self.heads}; got {self.kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}; got {self.dtype!r}")

    def _validate_ulysses(self) -> None:
        """The checks of ``--ulysses``: every U divides every P and the heads, and every S can be placed by
        ``xcp.shard(..., ulysses=U)`` (split by the balance over R = P/U, and by P)."""
        values = self.ulysses
        if not values or any(not isinstance(u, int) or u < 1 for u in values):
            raise ValueError(f"{ulysses.FLAG}: expected a non-empty list of integers >= 1; got {values!r}")
        for u in values:
            for p in self.worlds:
                if p % u:
                    raise ValueError(
                        f"{ulysses.FLAG}: expected divisors of every --worlds value (P = U x R); {u} does not divide "
                        f"{p} (give --worlds with multiples of {u}, or leave {u} out)"
                    )
            if self.heads % u:
                raise ValueError(f"{ulysses.FLAG}: expected divisors of --heads {self.heads} (each rank of a head "
                                 f"group takes heads / U of them); got {u}")  # fmt: skip
        for s in self.seqs:
            for p in self.worlds:
                for u in values:
                    balance = windows.resolve_balance(self.balance, p, True, None, None, ulysses=u)
                    ulysses.check_seq(s, p, u, balance, "--seqs")

    def _validate_decode(self) -> None:
        """The checks of ``--decode``: the ring figures' flags are refused, the sizes are >= 1, the chunk >= 0,
        and every L of ``seqs`` is split by the balance over every P of ``worlds`` (the prefill's shards)."""
        refused = ((REPLAY_FLAG, self.replay), ("--host", self.host), ("--world-of-one", self.world_of_one),
                   (packing.FLAG, self.documents is not None), (windows.FLAG, self.window is not None),
                   (ulysses.FLAG, self.ulysses is not None), ("--compare-dense", self.compare_dense))  # fmt: skip
        for flag, on in refused:
            if on:
                why = DECODE_REPLAYS if flag == REPLAY_FLAG else ""
                raise ValueError(f"{flag}: not measured with {DECODE_FLAG}{why}")
        self._validate_problem("batch")
        for name in ("seqs", "worlds"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}: expected a non-empty list of integers >= 1; got {values!r}")
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ValueError(f"{DECODE_CHUNK_FLAG}: expected an integer >= 0 (0: decode only); got {self.chunk!r}")
        if self.balance not in windows.BALANCE_CHOICES:
            raise ValueError(f"--balance: expected one of {', '.join(windows.BALANCE_CHOICES)}; got {self.balance!r}")
        for seq in self.seqs:
            for world in self.worlds:
                balance = windows.resolve_balance(self.balance, world, True, None, None)
                schedule.check_seq_len(seq, world, balance, what="--seqs")

    def _validate_host(self) -> None:
        """The checks of ``--host`` / ``--world-of-one``: the dense grid's flags that do not apply are refused,
        and every world must shard ``host_tokens`` per rank with a balance where each rank computes a block at
        every step (the per-step figure is the time between a rank's kernel calls)."""
        flag = "--host" if self.host else "--world-of-one"
        if self.documents is not None or self.window is not None:
            name = packing.FLAG if self.documents is not None else windows.FLAG
            raise ValueError(f"{name}: not measured with {flag}; got {self.documents or self.window!r}")
        self._validate_problem("host_tokens")
        if not self.seqs or any(not isinstance(v, int) or v < 1 for v in self.seqs):
            raise ValueError(f"seqs: expected a non-empty list of integers >= 1; got {self.seqs!r}")
        if not self.host:
            return
        if not self.worlds or any(not isinstance(v, int) or v < 2 for v in self.worlds):
            raise ValueError(f"--worlds: expected integers >= 2 with --host (a ring of one rank has no steps); "
                             f"got {self.worlds!r}")  # fmt: skip
        for p in self.worlds:
            balance = windows.resolve_balance(self.balance, p, True, None, None)
            if balance == "contiguous" and True in self.causal:
                raise ValueError("--balance: expected zigzag or stripe with --host and a causal mask (contiguous "
                                 "ranks skip steps, the figure times every step); got 'contiguous'")  # fmt: skip
            multiple = schedule.required_multiple(p, balance)
            if (self.host_tokens * p) % multiple:
                raise ValueError(f"--host-tokens: expected a multiple of {multiple // math.gcd(multiple, p)} "
                                 f"(balance {balance!r} over {p} ranks); got {self.host_tokens}")  # fmt: skip


def _parsed(parse: Callable[[str], T], text: str, flag: str) -> T:
    """``parse(text)`` (an argparse type), its refusal a ValueError naming ``flag``."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{flag}: {exc}") from None


SIZE_FLAGS = ("seqs", "memory_seq", "heads", "kv_heads", "head_dim", "dtype")
"""The flags whose default depends on the device (see :data:`xcp.cli.common.CPU_SIZES`)."""
