"""Small rules of the KV cache's host plan (xcp.inference.plan) at their boundaries."""

from __future__ import annotations

from xcp.documents import PositionRun
from xcp.inference.plan import HEADS_COMBINE_MIN_QUERIES, combine_over_heads, extend


def test_combine_over_heads_only_between_ranks_for_long_chunks_of_divisible_heads():
    n = HEADS_COMBINE_MIN_QUERIES
    assert combine_over_heads(2, n, 8) and combine_over_heads(4, n + 1, 8)
    assert not combine_over_heads(1, n, 8)  # one rank: nothing to combine
    assert not combine_over_heads(2, n - 1, 8)  # a short chunk: one all-gather costs less
    assert not combine_over_heads(3, n, 8)  # heads not divisible by P


def test_extend_joins_what_continues_the_last_run():
    prefill = (PositionRun(0, 0, 1, 4),)
    assert extend(prefill, 4, 3) == (PositionRun(0, 0, 1, 7),)  # a contiguous chunk: one run
    assert extend(prefill, 6, 2) == (PositionRun(0, 0, 1, 4), PositionRun(4, 6, 1, 2))  # a gap: a new run
    decode = extend(extend((PositionRun(0, 1, 1, 1),), 5, 1), 9, 1)  # one token every P = 4 positions
    assert decode == (PositionRun(0, 1, 4, 3),)
    assert extend(prefill, 9, 0) == prefill
