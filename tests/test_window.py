"""Sliding windows across the ring: only the steps a window reaches run, and they compute exactly the pairs
the window allows.

The plan is checked against a brute-force list of allowed pairs (global positions from
xcp.schedule.shard_indices; window, documents and causality applied to them); the float64 ring against one
softmax over the whole sequence with the explicit banded mask (tests/helpers.py's independent_masked_reference).
"""

from __future__ import annotations

import pytest
import torch
from helpers import NAMES, allowed_pairs, independent_masked_reference, pairs_of_runs, ring_with_documents
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from strategies import assert_close_to, windowed

import xcp
from xcp import documents
from xcp.comm import LocalGroup


@settings(max_examples=300, deadline=None)
@given(windowed())
@example((2, "zigzag", False, (0, 3, 8), (None, 3)))  # one side unbounded, either side
@example((3, "contiguous", False, (0, 12), (2, None)))
@example((2, "stripe", True, (0, 6, 14, 24), (3, 0)))
def test_the_plan_computes_each_allowed_pair_once_and_runs_the_fewest_steps(case):
    world, balance, causal, cu, window = case
    window = documents.check_window(window, causal)
    needed = 0
    plans = [documents.document_plan(cu, world, r, causal, balance, window) for r in range(world)]
    for rank, plan in enumerate(plans):
        for i in range(world):
            want = allowed_pairs(cu, world, rank, (rank - i) % world, balance, causal, window)
            if want:
                needed = max(needed, i + 1)
            if i >= len(plan.steps):
                assert not want, f"step {i} of rank {rank} was dropped but has {len(want)} pairs"
                continue
            got = pairs_of_runs(plan.steps[i])
            assert len(got) == len(set(got)), "no pair is computed twice"
            assert set(got) == want
            spans = [
                (r.cu_q[a + 1] - r.cu_q[a], r.cu_k[a + 1] - r.cu_k[a]) for r in plan.steps[i] for a in range(r.segments)
            ]
            assert all(sq > 0 and sk > 0 for sq, sk in spans), "no kernel segment without queries or keys"
            assert sorted(pairs_of_runs(documents.join_runs(plan.steps[i]))) == sorted(got)
            assert plan.pairs[i] == len(want)
    assert {len(p.steps) for p in plans} == {max(needed, 1)}, "every rank runs the fewest steps that serve all"


@given(st.integers(1, 7), st.integers(1, 7), st.integers(-9, 7), st.integers(-7, 9), st.booleans())
@example(3, 2, -2, 0, False)  # not square, the band ends on the diagonal: a band, never "causal"
@example(3, 3, -2, 0, False)  # the lower triangle of a square: causal
@example(2, 2, 0, 0, False)  # the diagonal alone: a band
@example(1, 1, 0, 0, True)  # 1 x 1 on the diagonal under causal: causal, to join its causal neighbours' call
@example(1, 1, -1, 2, True)  # 1 x 1 off the diagonal: full
def test_a_diagonal_segment_takes_the_plainest_form_of_exactly_its_pairs(sq, sk, lo, hi, causal):
    """Query i sees key j iff lo <= j - i <= hi, on rows where every query sees a key and every key is
    seen: the segment is full, square causal or a band, each only where it holds exactly those pairs."""
    want = {(i, j) for i in range(sq) for j in range(sk) if lo <= j - i <= hi}
    assume({i for i, _ in want} == set(range(sq)) and {j for _, j in want} == set(range(sk)))
    seg = documents.diagonal_segment((2, 2 + sq), (5, 5 + sk), lo, hi, causal)
    got = pairs_of_runs(documents.runs([seg]))
    assert sorted(got) == sorted((2 + i, 5 + j) for i, j in want)
    triangle = sq == sk and hi == 0 and want == {(i, j) for i in range(sq) for j in range(i + 1)}
    if triangle and (sq > 1 or causal):
        assert (seg.causal, seg.band) == (True, None)
    elif len(want) == sq * sk:
        assert (seg.causal, seg.band) == (False, None)
    else:
        assert seg.band is not None and not seg.causal


def test_contiguous_serves_a_causal_window_in_two_steps_zigzag_in_all():
    seq, world = 1024, 8
    for left in (1, 64, 128):  # up to the local length S / P
        assert len(documents.document_plan((0, seq), world, 3, True, "contiguous", (left, 0)).steps) == 2
        assert len(documents.document_plan((0, seq), world, 3, True, "zigzag", (left, 0)).steps) == world
    assert len(documents.document_plan((0, seq), world, 3, True, "contiguous", (129, 0)).steps) == 3
    assert len(documents.document_plan((0, seq), world, 3, True, "contiguous", (0, 0)).steps) == 1


def test_choose_balance_picks_the_fewest_steps():
    assert xcp.choose_balance(8, causal=True, window=(256, 0), seq_len=8192) == "contiguous"
    assert xcp.choose_balance(8, causal=True, seq_len=8192) == "zigzag"
    assert xcp.choose_balance(8, causal=False, window=(None, None), seq_len=8192) == "zigzag"
    with pytest.raises(ValueError, match="seq_len: expected the global sequence length"):
        xcp.choose_balance(8, causal=True, window=(256, 0))


# ---------------------------------------------------------------------------------------------- the ring


def ring(q, k, v, dout, world, balance, causal, cu, window, sinks=None):
    """tests/helpers.py's ring_with_documents with a window; ``cu`` None is one document."""
    cu = (0, q.shape[1]) if cu is None else cu
    return ring_with_documents(q, k, v, dout, world, balance, causal, cu, sinks, window=window)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=windowed(max_chunks=3),
    with_documents=st.booleans(),
    with_sinks=st.booleans(),
    groups=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_float64_ring_with_a_window_matches_the_banded_reference(case, with_documents, with_sinks, groups, seed):
    world, balance, causal, cu, window = case
    cu = cu if with_documents else (0, cu[-1])
    gen = torch.Generator().manual_seed(seed)
    seq = cu[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, dout = rnd(1, seq, 2 * groups, 4), rnd(1, seq, 2, 4), rnd(1, seq, 2, 4), rnd(1, seq, 2 * groups, 4)
    sinks = rnd(2 * groups) if with_sinks else None
    got = ring(q, k, v, dout, world, balance, causal, cu if with_documents else None, window, sinks)
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks, window=window)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


@pytest.mark.parametrize(
    ("left", "right", "causal"),
    [(0, 0, True), (5, 0, True), (40, 0, True), (200, None, True), (3, 3, False), (0, 9, False), (None, 2, False)],
)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_windows_of_every_size_on_every_world(left, right, causal, world):
    """1 token, less than a chunk, several ranks, beyond S; contiguous (the window's balance)."""
    seq = 8 * world
    gen = torch.Generator().manual_seed(world)
    q, k, v, dout = (torch.randn(1, seq, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    got = ring(q, k, v, dout, world, "contiguous", causal, None, (left, right))
    want = independent_masked_reference(q, k, v, dout, (0, seq), causal, window=(left, right))
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_low_precision_window(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 64, h, 16, generator=gen, dtype=torch.float64).to(dtype) for h in (4, 2, 2, 4))
    got = ring(q, k, v, dout, 4, "contiguous", True, (0, 10, 64), (12, 0))
    want = independent_masked_reference(q, k, v, dout, (0, 10, 64), True, window=(12, 0))
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype
        assert_close_to(name, g, w, tol)


def test_a_short_ring_sends_only_what_the_window_needs(monkeypatch):
    """Count the K/V messages: a causal window within one shard under contiguous placement sends each
    shard once (2 steps), where the dense ring sends it P - 1 times; the dK/dV still all come home."""
    sent: list[tuple[int, str]] = []
    real = LocalGroup.exchange

    def counting(self, sends, recvs, tag, backend, step=None):
        sent.extend((self.rank(), tag) for _ in sends)
        return real(self, sends, recvs, tag, backend, step)

    monkeypatch.setattr(LocalGroup, "exchange", counting)
    world, seq = 4, 64
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(1, seq, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    got = ring(q, k, v, dout, world, "contiguous", True, None, (8, 0))
    kv = sum(1 for _, tag in sent if tag == "kv")
    dkv = sum(1 for _, tag in sent if tag == "dkv")
    assert kv == 2 * world * 2  # K and V (step 0 sends the caller's own apart), one hop per rank, fwd and bwd
    assert dkv == 2 * world  # one buffer of dK then dV: one step behind, then the hop home
    want = independent_masked_reference(q, k, v, dout, (0, seq), True, window=(8, 0))
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


@pytest.mark.parametrize(
    ("window", "causal", "exc", "message"),
    [
        ((-1, 0), True, ValueError, "window: expected left >= 0 or None; got -1"),
        ((4, -2), False, ValueError, "window: expected right >= 0 or None; got -2"),
        ((4, 3), True, ValueError, "window: with causal=True the right side must be 0 or None; got right=3"),
        (4, True, TypeError, "window: expected a pair (left, right) of ints >= 0 or None; got 4"),
        ((1, 2, 3), False, TypeError, "window: expected a pair (left, right)"),
        ((1.5, 0), True, TypeError, "window: expected left to be an int >= 0 or None; got 1.5 (float)"),
        (("4", 0), True, TypeError, "window: expected left to be an int >= 0 or None; got '4' (str)"),
    ],
)
def test_bad_windows_are_named(window, causal, exc, message):
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        xcp.attention(q, q, q, causal=causal, window=window)


def test_the_dense_window_is_the_dense_path():
    assert documents.check_window((None, None), False) is None
    assert documents.check_window((None, 0), True) is None
    assert documents.check_window((None, None), True) is None
    assert documents.check_window((3, None), True) == (3, 0)


def test_choose_balance_when_the_sequence_is_one_token_a_rank():
    # S == P: contiguous and stripe split it (zigzag needs 2P), cost the same in 2 steps; contiguous first
    assert [c.balance for c in documents.balance_costs((0, 4), 4, True, (1, 0))] == ["contiguous", "stripe"]
    assert xcp.choose_balance(4, causal=True, window=(1, 0), seq_len=4) == "contiguous"


def test_choose_balance_follows_its_rule_over_small_sequences():
    """choose_balance(seq_len=S) is balance_costs((0, S))'s least by (cost in whole steps of 10% of the even
    share, steps, then zigzag, contiguous, stripe), over small sequences where the buckets' edges and the
    first token matter; a tiny balanced split weighs busiest 1.0; a length no balance splits is named."""
    order = ("zigzag", "contiguous", "stripe")
    for world in (2, 3):
        for seq_len in range(world, 19):
            for causal, window in [(True, (1, 0)), (True, (2, 0)), (True, (3, 0)), (False, (2, 1)), (False, (3, 2))]:
                costs = documents.balance_costs((0, seq_len), world, causal, window)
                if not costs:
                    with pytest.raises(ValueError, match=f"^seq_len: no balance can split {seq_len} tokens over"):
                        xcp.choose_balance(world, causal=causal, window=window, seq_len=seq_len)
                    continue
                rule = min(costs, key=lambda c: (int(round(c.cost * 10, 6)), c.steps, order.index(c.balance)))
                assert xcp.choose_balance(world, causal=causal, window=window, seq_len=seq_len) == rule.balance
    assert [c.busiest for c in documents.balance_costs((0, 2), 2, True, (0, 0))] == [1.0, 1.0]  # 1 pair a rank


def test_a_document_plan_names_a_rank_outside_the_world():
    """A rank past the world, and a bool (never a rank, though Python counts it an int), named at once."""
    with pytest.raises(ValueError, match=r"^rank: expected an integer in \[0, 2\); got 2"):
        documents.document_plan((0, 8), 2, 2, True, "document_zigzag")
    with pytest.raises(ValueError, match=r"^rank: expected an integer in \[0, 2\); got True \(bool\)"):
        documents.document_plan((0, 8), 2, True, True, "stripe")


def test_choose_balance_at_its_edges():
    """Not causal unless told (a two-sided window is then allowed); zigzag where nothing needs weighing;
    a sequence of one token weighed like any; world_size and seq_len named when wrong."""
    assert xcp.choose_balance(4) == "zigzag"
    assert xcp.choose_balance(2, window=(1, 1), seq_len=8) in ("zigzag", "contiguous", "stripe")
    assert xcp.choose_balance(1, causal=True, window=(1, 0), seq_len=1) in ("zigzag", "contiguous", "stripe")
    with pytest.raises(ValueError, match="world_size: expected an integer >= 1; got 0"):
        xcp.choose_balance(0)
    with pytest.raises(ValueError, match="seq_len: expected the global sequence length"):
        xcp.choose_balance(2, window=(1, 0), seq_len=0)
