"""Properties of the pure ring schedule (docs/design.md, "The ring schedule"), over P in 1..16, every balance,
causal or not. Everything here is plain Python: no tensors, so the checks are exact and exhaustive."""

from __future__ import annotations

import re
from collections import Counter

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xcp import schedule
from xcp.schedule import BALANCES, plan, shard_indices

worlds = st.integers(1, 16)
balances = st.sampled_from(BALANCES)
causals = st.booleans()
chunk_lengths = st.integers(1, 3)  # tokens per chunk of the zigzag cut; the local length is twice that


def all_plans(p: int, causal: bool, balance: str) -> list[schedule.Plan]:
    return [plan(p, r, causal, balance) for r in range(p)]


def block_pairs(step: schedule.Step, q_index: list[int], k_index: list[int]) -> list[tuple[int, int]]:
    """The global (query, key) pairs one block computes.

    Block semantics: local rows ``Step.q_range`` of the rank's queries against rows ``Step.k_range`` of the
    source's keys; within the block, ``causal`` lets block query i see block keys j <= i (top-left) and
    ``strict`` only j < i.
    """
    if not step.computes:
        return []
    n = len(q_index)
    q0, q1 = step.q_range(n)
    k0, k1 = step.k_range(n)
    pairs = []
    for i in range(q1 - q0):
        for j in range(k1 - k0):
            if step.mask == "causal" and j > i or step.mask == "strict" and j >= i:
                continue
            pairs.append((q_index[q0 + i], k_index[k0 + j]))
    return pairs


def allowed_pairs(seq: int, causal: bool) -> Counter:
    return Counter((a, b) for a in range(seq) for b in range(seq) if not causal or b <= a)


@given(worlds, causals, balances)
def test_each_rank_meets_every_source_exactly_once(p, causal, balance):
    for r, pl in enumerate(all_plans(p, causal, balance)):
        assert (pl.world_size, pl.rank, pl.causal, pl.balance) == (p, r, causal, balance)
        assert [s.step for s in pl.steps] == list(range(p))
        assert all(s.rank == r for s in pl.steps)
        assert pl.steps[0].src == r, "step 0 must read the rank's own KV"
        assert sorted(s.src for s in pl.steps) == list(range(p))
        for s in pl.steps:
            assert s.src == (r - s.step) % p


@given(worlds, causals, balances)
def test_what_a_rank_sends_is_what_its_neighbour_receives(p, causal, balance):
    plans = all_plans(p, causal, balance)
    for r, pl in enumerate(plans):
        for s in pl.steps:
            if s.step == p - 1:
                assert s.send_to is None and s.recv_from is None, "no KV transfer after the last step"
                continue
            assert s.send_to == (r + 1) % p and s.recv_from == (r - 1) % p
            peer = plans[s.send_to].steps[s.step]
            assert peer.recv_from == r, f"rank {r} sends to {s.send_to} at step {s.step}, which does not receive"
            # the shard sent at step i is the one the receiver computes on at step i + 1
            assert plans[s.send_to].steps[s.step + 1].src == s.src


@given(worlds, causals, balances, chunk_lengths)
def test_blocks_cover_the_global_mask_exactly_once(p, causal, balance, chunk):
    seq = 2 * p * chunk
    index = [shard_indices(seq, p, r, balance) for r in range(p)]
    covered = Counter()
    for r, pl in enumerate(all_plans(p, causal, balance)):
        for s in pl.steps:
            covered.update(block_pairs(s, index[r], index[s.src]))
    want = allowed_pairs(seq, causal)
    missing = want - covered
    extra = covered - want
    assert not missing, f"pairs never computed: {sorted(missing)[:5]}"
    assert not extra, f"pairs computed twice or not allowed: {sorted(extra)[:5]}"


@pytest.mark.parametrize("balance", BALANCES)
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_cover_the_global_mask_for_every_world_size(balance, causal):
    """The same coverage property, exhaustively over P = 1..16 with the smallest sequence."""
    for p in range(1, 17):
        seq = 2 * p
        index = [shard_indices(seq, p, r, balance) for r in range(p)]
        covered = Counter()
        for r, pl in enumerate(all_plans(p, causal, balance)):
            for s in pl.steps:
                covered.update(block_pairs(s, index[r], index[s.src]))
        assert covered == allowed_pairs(seq, causal), f"P={p}"


@given(worlds, causals, balances, chunk_lengths)
def test_step_work_matches_the_pairs_computed(p, causal, balance, chunk):
    """``Step.work`` is the share of an n x n block; it is off by at most half a diagonal (n/2 pairs)."""
    seq = 2 * p * chunk
    n = seq // p
    index = [shard_indices(seq, p, r, balance) for r in range(p)]
    for r, pl in enumerate(all_plans(p, causal, balance)):
        for s in pl.steps:
            pairs = len(block_pairs(s, index[r], index[s.src]))
            assert abs(pairs - s.work * n * n) <= n / 2, (r, s)
            assert (pairs == 0) == (not s.computes)


@given(worlds, causals, st.sampled_from(["zigzag", "stripe"]), chunk_lengths)
def test_zigzag_and_stripe_balance_every_step(p, causal, balance, chunk):
    seq = 2 * p * chunk
    n = seq // p
    index = [shard_indices(seq, p, r, balance) for r in range(p)]
    plans = all_plans(p, causal, balance)
    for i in range(p):
        steps = [plans[r].steps[i] for r in range(p)]
        assert len({s.work for s in steps}) == 1, f"step {i}: work {[s.work for s in steps]}"
        pairs = [len(block_pairs(s, index[s.rank], index[s.src])) for s in steps]
        # zigzag blocks hold exactly equal numbers of pairs; a stripe block differs from another only by
        # its diagonal (causal includes it, strict does not): at most n pairs apart.
        slack = 0 if balance == "zigzag" or not causal else n
        assert max(pairs) - min(pairs) <= slack, f"step {i}: pairs {pairs}"
    totals = [sum(s.work for s in pl.steps) for pl in plans]
    assert max(totals) == min(totals)


@pytest.mark.parametrize("p", [2, 3, 8])
def test_contiguous_causal_is_unbalanced(p):
    """The balance measure above can fail: contiguous causal gives the last rank the most work."""
    totals = [sum(s.work for s in pl.steps) for pl in all_plans(p, True, "contiguous")]
    assert totals == [0.5 + r for r in range(p)]


def test_a_skipped_block_reads_no_rows():
    skipped = [s for pl in all_plans(4, True, "contiguous") for s in pl.steps if not s.computes]
    assert len(skipped) == 6  # the future shards of ranks 0..2: 3 + 2 + 1
    assert all((s.q_range(8), s.k_range(8), s.work, s.mask) == ((0, 0), (0, 0), 0.0, "none") for s in skipped)


def test_ulysses_is_a_positive_integer_of_any_integer_type():
    assert [schedule.check_ulysses(u) for u in (1, 4, numpy.int64(1), numpy.int32(3))] == [1, 4, 1, 3]
    assert type(schedule.check_ulysses(numpy.int64(2))) is int
    for bad in (0, -2, numpy.int64(0)):
        with pytest.raises(ValueError, match=r"ulysses: expected a positive integer \(head-parallel ranks\); got"):
            schedule.check_ulysses(bad)
    for bad in (2.0, True, "2", None):
        with pytest.raises(TypeError, match=r"ulysses: expected a positive integer"):
            schedule.check_ulysses(bad)


@given(worlds, causals, balances)
def test_every_dkv_returns_home_after_visiting_each_rank_once(p, causal, balance):
    plans = all_plans(p, causal, balance)
    for owner in range(p):
        rank, visited = owner, []
        for i in range(p):
            s = plans[rank].steps[i]
            assert s.src == owner, f"dKV of {owner} is at rank {rank} at step {i}, which computes on {s.src}"
            if i == 0:
                assert s.dkv_recv_from is None, "the owner starts its own dKV"
            else:
                assert s.dkv_recv_from == visited[-1]
            visited.append(rank)
            rank = s.dkv_send_to
        assert rank == owner, f"dKV of {owner} ends at rank {rank}"
        assert plans[owner].dkv_home_from == visited[-1]
        assert plans[visited[-1]].dkv_home_to == owner
        assert sorted(visited) == list(range(p))


@given(worlds, balances, chunk_lengths)
def test_shard_indices_partition_the_sequence(p, balance, chunk):
    seq = 2 * p * chunk
    seen = []
    for r in range(p):
        idx = shard_indices(seq, p, r, balance)
        assert len(idx) == seq // p
        assert idx == sorted(idx), "local order follows global order"
        slices = schedule.chunk_slices(seq, p, r, balance)
        assert [t for a, b, c in slices for t in range(a, b, c)] == idx
        seen += idx
    assert sorted(seen) == list(range(seq))


def test_zigzag_places_chunks_head_and_tail():
    assert shard_indices(8, 2, 0) == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1) == [2, 3, 4, 5]
    assert shard_indices(6, 3, 1, "stripe") == [1, 4]
    assert shard_indices(6, 3, 1, "contiguous") == [2, 3]


@pytest.mark.parametrize(
    ("p", "balance", "multiple"),
    [(1, "zigzag", 1), (1, "stripe", 1), (4, "zigzag", 8), (4, "contiguous", 4), (3, "stripe", 3)],
)
def test_required_multiple(p, balance, multiple):
    """A world of one holds the whole sequence under every balance: any length."""
    assert schedule.required_multiple(p, balance) == multiple


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, "zigzag"), r"world_size: expected an integer >= 1; got 0"),
        ((2, "ring"), r"balance: expected one of zigzag, contiguous, stripe"),
    ],
)
def test_required_multiple_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        schedule.required_multiple(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((7, 2, "zigzag"), r"balance 'zigzag' over 2 ranks needs a positive multiple of 4; got 7"),
        ((2, 3, "document_zigzag"), r"balance 'document_zigzag' over 3 ranks needs at least 3 tokens"),
        ((8, 0, "stripe"), r"world_size: expected an integer >= 1; got 0"),
    ],
)
def test_shard_lengths_reject_a_length_the_balance_cannot_split(args, match):
    with pytest.raises(ValueError, match=match):
        schedule.shard_lengths(*args)
    assert schedule.shard_lengths(7, 3, "document_zigzag") == (3, 2, 2)


def test_a_plan_is_not_causal_unless_asked():
    """plan(P, r): every block full (no mask), as plan(P, r, causal=False) gives it."""
    default = plan(3, 1)
    assert default == plan(3, 1, causal=False) and not default.causal
    assert all((s.kind, s.mask, s.work) == (schedule.FULL, "none", 1.0) for s in default.steps)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0), r"world_size: expected an integer >= 1; got 0"),
        ((-2, 0), r"world_size: expected an integer >= 1; got -2"),
        ((2.0, 0), r"world_size: expected an integer >= 1; got 2\.0"),
        ((True, 0), r"world_size: expected an integer >= 1; got True"),
        ((2, 2), r"rank: expected an integer in \[0, 2\); got 2"),
        ((2, -1), r"rank: expected an integer in \[0, 2\); got -1"),
        ((2, "0"), r"rank: expected an integer in \[0, 2\); got '0'"),
        ((2, 0, True, "diagonal"), r"balance: expected one of zigzag, contiguous, stripe; got 'diagonal'"),
    ],
)
def test_plan_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        plan(*args)


@pytest.mark.parametrize("steps", [0, -1, 5, 2.5, 4.0, True, "2"])
def test_plan_rejects_steps_outside_one_to_p(steps):
    with pytest.raises(ValueError, match=rf"steps: expected an integer in \[1, 4\]; got {re.escape(repr(steps))}$"):
        plan(4, 0, steps=steps)


@pytest.mark.parametrize("balance", ["zigzag", "contiguous", "stripe"])
def test_a_short_ring_is_the_first_steps_of_the_full_one_and_sends_dkv_home_in_one_hop(balance):
    p = 5
    for m in range(1, p + 1):
        for r in range(p):
            full, short = plan(p, r, True, balance), plan(p, r, True, balance, steps=m)
            assert [s.src for s in short.steps] == [(r - i) % p for i in range(m)]
            assert [s.kind for s in short.steps] == [s.kind for s in full.steps[:m]]
            assert [(s.send_to, s.recv_from) for s in short.steps] == [((r + 1) % p, (r - 1) % p)] * (m - 1) + [
                (None, None)
            ]
            assert short.steps[-1].dkv_send_to == (r - m + 1) % p  # home: the shard's owner, m - 1 ranks back
            assert [s.dkv_recv_from for s in short.steps] == [None] + [(r - 1) % p] * (m - 1)  # none at step 0
            assert short.dkv_home_from == (r + m - 1) % p
            assert short.dkv_recv_after(m - 1) == short.dkv_home_from
            if m > 1:
                assert short.dkv_recv_after(0) == (r - 1) % p
                assert plan(p, short.steps[-1].dkv_send_to, True, balance, steps=m).dkv_home_from == r


@pytest.mark.parametrize(
    ("balance", "cu", "match"),
    [
        ("zigzag", (0, 8), r"cu_seqlens: expected None with balance 'zigzag', which places the whole sequence"),
        ("document_zigzag", None, r"cu_seqlens: expected the documents' boundaries \(0, \.\.\., 8\) with balance"),
        ("document_zigzag", (8,), r"cu_seqlens: expected non-decreasing boundaries from 0 to 8; got \[8\]"),
        ("document_zigzag", (1, 8), r"from 0 to 8; got \[1, 8\]"),
        ("document_zigzag", (0, 9), r"from 0 to 8; got \[0, 9\]"),
        ("document_zigzag", (0, 5, 3, 8), r"from 0 to 8; got \[0, 5, 3, 8\]"),
    ],
)
def test_chunk_slices_take_documents_exactly_with_a_document_balance(balance, cu, match):
    with pytest.raises(ValueError, match=match):
        schedule.chunk_slices(8, 2, 0, balance, cu)
    held = [i for r in range(2) for a, b, c in schedule.chunk_slices(8, 2, r, "document_zigzag", (0, 3, 3, 8))
            for i in range(a, b, c)]  # fmt: skip
    assert sorted(held) == list(range(8))  # boundaries may repeat (an empty document): still a partition
    for r in range(3):  # documents shorter than 2P leave chunks empty: no slice is empty
        assert all(a < b for a, b, _ in schedule.chunk_slices(9, 3, r, "document_zigzag", (0, 3, 3, 4, 9)))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((6, 2, 0, "zigzag"), r"sequence length: balance 'zigzag' over 2 ranks needs a positive multiple of 4; got 6"),
        ((0, 2, 0, "contiguous"), r"needs a positive multiple of 2; got 0"),
        ((7, 3, 0, "stripe"), r"balance 'stripe' over 3 ranks needs a positive multiple of 3; got 7"),
        ((8, 2, 5, "zigzag"), r"rank: expected an integer in \[0, 2\); got 5"),
        ((8, 0, 0, "zigzag"), r"world_size: expected an integer >= 1; got 0"),
        ((8, 2, 0, "ring"), r"balance: expected one of zigzag, contiguous, stripe; got 'ring'"),
    ],
)
def test_shard_indices_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        shard_indices(*args)
    with pytest.raises(ValueError, match=match):
        schedule.chunk_slices(*args)


def test_odd_local_length_has_no_halves():
    upper = plan(2, 0, causal=True).steps[1]
    assert upper.kind == schedule.UPPER
    assert upper.q_range(4) == (2, 4)
    with pytest.raises(ValueError, match=r"local shard length: expected an even number .*; got 3"):
        upper.q_range(3)
