"""The KV cache's device-side counts (xcp.inference.state) against brute force: after a prefill placed by a
balance and decode appends owned by residue, each rank's lengths, positions and the storage range the newest
token's query sees (window, chunk) are what the positions it holds say."""

from __future__ import annotations

import warnings

import torch
from hypothesis import given
from hypothesis import strategies as st

from xcp import documents
from xcp.inference.state import DeviceCounts


@given(
    st.integers(1, 4),
    st.sampled_from(["contiguous", "stripe"]),
    st.integers(1, 3),
    st.integers(0, 6),
    st.one_of(st.none(), st.integers(0, 9)),
    st.one_of(st.none(), st.integers(1, 7)),
)
def test_counts_positions_and_visible_rows_match_the_positions_held(world, balance, per_rank, appends, left, chunk):
    prefill = world * per_rank
    room = per_rank + appends  # enough for every append (a rank owns at most all of them)
    for rank in range(world):
        counts = DeviceCounts(room, prefill + appends, world, rank, torch.device("cpu"))
        runs = documents.position_runs(prefill, world, rank, balance)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # each run's rows written in place, nothing resized
            counts.record(runs, prefill, per_rank)
        held = [r.global0 + r.stride * t for r in runs for t in range(r.count)]
        k_store = torch.zeros(1, room + 1, 1, 2)
        for position in range(prefill, prefill + appends):
            counts.append_token(k_store, torch.full((1, 1, 1, 2), float(position)), None)
            if position % world == rank:  # decode tokens go round the ranks by residue
                held.append(position)
        seq = prefill + appends
        assert counts.read() == (seq, len(held), 0)
        assert counts.positions[: len(held)].tolist() == held  # rows past the held ones: scratch
        assert k_store[0, per_rank : len(held), 0, 0].tolist() == [float(p) for p in held[per_rank:]]
        assert counts.newest().tolist() == [seq - 1]
        lo, hi = counts.visible(left, chunk)
        starts = ([] if left is None else [seq - 1 - left]) + ([] if chunk is None else [(seq - 1) // chunk * chunk])
        want_lo = sum(p < max(starts) for p in held) if starts else 0  # the held rows before the first seen
        assert (lo.tolist(), hi.tolist()) == ([want_lo], [len(held)])
