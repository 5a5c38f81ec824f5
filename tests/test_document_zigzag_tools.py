"""balance="document_zigzag" beyond the ring alone: with the hybrid (``ulysses > 1``), in the lifetime sanitizer
(``xcp sanitize``) and in ``xcp.choose_balance(..., ulysses=U)``.

Each against something independent of it:
- the hybrid in float64 against one softmax over the whole sequence under the document mask (tests/helpers.py):
  out, dq, dk, dv, dsinks and lse, P in {2, 4, 8} and every U > 1 dividing P;
- its placement against the ring's: rank r holds piece r % U of ring shard r // U, equal pieces;
- the sanitizer: clean and exact on uneven shards, its byte bound that of the longest shard (each travels as
  long), and its numerics and bound findings fire where the reference or the slots are wrong;
- choose_balance(P, ulysses=U): the rings' choice, and the hybrid runs what it recommends.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re

import pytest
import torch
from helpers import NAMES, independent_masked_reference, rank_errors, ring_with_documents
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import assert_close_to

import xcp
from xcp.cli import main
from xcp.testing import sanitizer
from xcp.testing.sanitizer import sanitize_ring

DZ = "document_zigzag"


def boundaries(lengths) -> tuple[int, ...]:
    return tuple(itertools.accumulate(lengths, initial=0))


def raises(exc, message: str):
    return pytest.raises(exc, match="^" + re.escape(message))


# ---------------------------------------------------------------------------------------------- the hybrid

HYBRID_CASES = [  # world, ulysses, documents' lengths (S a multiple of P; empty and 1-token ones), causal
    (2, 2, [5, 0, 1, 10], True),
    (4, 2, [1, 7, 0, 30, 3, 3], True),
    (4, 4, [2, 11, 11], False),
    (8, 2, [40, 1, 7, 15, 0, 9], True),
    (8, 4, [5, 33, 2], False),
    (8, 8, [17, 1, 30], True),
]


@pytest.mark.parametrize(("world", "ulysses", "lengths", "causal"), HYBRID_CASES)
def test_hybrid_float64_matches_the_masked_reference(world, ulysses, lengths, causal):
    """out, dq, dk, dv and dsinks to 1e-10; 8 query heads over 2 K/V heads, or over 1 (replicated for U)."""
    cu = boundaries(lengths)
    gen = torch.Generator().manual_seed(world * 10 + ulysses)
    kv_heads = 1 + (world + ulysses) % 2
    q, dout = (torch.randn(1, cu[-1], 8, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, cu[-1], kv_heads, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(8, generator=gen, dtype=torch.float64) if causal else None
    got = ring_with_documents(q, k, v, dout, world, DZ, causal, cu, sinks, ulysses=ulysses)
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)


def test_hybrid_with_a_window_and_its_lse():
    """A banded causal window over the documents; lse [B, H, n] of each rank's rows, unsharded along dim 2,
    against the log-sum-exp of the masked scores."""
    world, ulysses, window = 4, 2, (5, 0)
    cu = boundaries([3, 20, 1, 8])
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, cu[-1], 4, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    got = ring_with_documents(q, k, v, dout, world, DZ, True, cu, ulysses=ulysses, window=window)
    want = independent_masked_reference(q, k, v, dout, cu, True, window=window)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, 1e-10)

    place = {"balance": DZ, "ulysses": ulysses, "cu_seqlens": cu}

    def rank_fn(group):
        local = [xcp.shard(t, world, group.rank(), **place) for t in (q, k, v)]
        return xcp.attention(*local, group=group, causal=True, window=window, return_lse=True, **place)[1]

    lse = xcp.unshard(xcp.LocalWorld(world).run(rank_fn), dim=2, **place)
    i, j = torch.arange(cu[-1])[:, None], torch.arange(cu[-1])[None, :]
    doc = torch.tensor([bisect.bisect_right(cu, t) - 1 for t in range(cu[-1])])
    allowed = (doc[:, None] == doc[None, :]) & (j <= i) & (j >= i - window[0])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(4)
    assert_close_to("lse", lse, torch.logsumexp(scores.masked_fill(~allowed, -math.inf), -1), 1e-10)


@st.composite
def hybrid_layouts(draw) -> tuple[int, int, tuple[int, ...]]:
    """(world, ulysses, cu): U > 1 dividing P, up to 5 documents (empty and 1-token ones among them), S a
    positive multiple of P."""
    world = draw(st.sampled_from([2, 4, 8]))
    ulysses = draw(st.sampled_from([u for u in (2, 4, 8) if world % u == 0]))
    lengths = draw(st.lists(st.sampled_from([0, 1, 3, world, 2 * world + 1, 19]), min_size=1, max_size=5))
    total = sum(lengths)
    return world, ulysses, boundaries([*lengths, (-total) % world + (world if total == 0 else 0)])


@settings(max_examples=15, deadline=None)
@given(hybrid_layouts())
def test_hybrid_shards_are_equal_pieces_of_the_rings_document_zigzag(layout):
    world, ulysses, cu = layout
    rings, seq = world // ulysses, cu[-1]
    x = torch.arange(seq, dtype=torch.float64).reshape(1, seq, 1, 1).expand(1, seq, 2, 1).contiguous()
    shards = [xcp.shard(x, world, r, balance=DZ, ulysses=ulysses, cu_seqlens=cu) for r in range(world)]
    for r, s in enumerate(shards):
        ring_shard = xcp.shard(x, rings, r // ulysses, balance=DZ, cu_seqlens=cu)
        piece = seq // world
        assert s.shape[1] == piece and torch.equal(s, ring_shard[:, (r % ulysses) * piece :][:, :piece])
    assert torch.equal(xcp.unshard(shards, balance=DZ, ulysses=ulysses, cu_seqlens=torch.tensor(cu)), x)


def test_hybrid_errors_name_cu_seqlens_ulysses_and_the_balance():
    cu = [0, 5, 18]  # 18 tokens: not a multiple of 4 ranks
    x = torch.randn(1, 18, 4, 2)
    with raises(ValueError, "x.shape[1]: expected a multiple of world_size 4 with ulysses=2 (each of 2 ring "
                "shards splits into 2 pieces; balance 'document_zigzag' splits any length only with ulysses=1); "
                "got 18"):  # fmt: skip
        xcp.shard(x, 4, 0, balance=DZ, cu_seqlens=cu, ulysses=2)
    ragged = [xcp.shard(x, 4, r, balance=DZ, cu_seqlens=cu) for r in range(4)]  # 5, 5, 4, 4 tokens
    with raises(ValueError, "cu_seqlens: expected cu_seqlens[-1] a multiple of the 4 ranks with ulysses=2 (each "
                "ring shard is cut into 2 equal pieces; balance 'document_zigzag' splits any length only with "
                "ulysses=1); got 18"):  # fmt: skip
        xcp.unshard(ragged, balance=DZ, ulysses=2, cu_seqlens=cu)
    with raises(ValueError, "shards[0]: expected 4 tokens along the sequence dim (S / P of the 16 tokens of "
                "cu_seqlens over 4 ranks with ulysses=2); got 5"):  # fmt: skip
        xcp.unshard(ragged, balance=DZ, ulysses=2, cu_seqlens=[0, 16])

    def uneven(group):  # ring-alone shards under the hybrid
        mine = ragged[group.rank()]
        xcp.attention(mine, mine, mine, group=group, balance=DZ, cu_seqlens=cu, ulysses=2)

    assert all(m.startswith("cu_seqlens: expected cu_seqlens[-1] a multiple of the 4 ranks with ulysses=2")
               for m in rank_errors(4, uneven))  # fmt: skip

    def short(group):  # 3 tokens a rank, where 16 tokens over 4 ranks are 4 a rank
        mine = x[:, :3]
        xcp.attention(mine, mine, mine, group=group, balance=DZ, cu_seqlens=[0, 16], ulysses=2)

    assert all(m.startswith("q: expected 4 tokens along the sequence dim (S / P of the 16 tokens of cu_seqlens "
                            "over 4 ranks with ulysses=2); got 3") for m in rank_errors(4, short))  # fmt: skip


# ---------------------------------------------------------------------------------------------- choose_balance


def test_choose_balance_with_ulysses_weighs_the_rings():
    """Over 8 ranks zigzag cannot split 40 tokens (it needs 16 | S) and document_zigzag is chosen; with
    ulysses=4 the plan runs over rings of 2, where zigzag splits them; the choice is the rings' always."""
    for cu in ([0, 40], [0, 3, 40], [0, 8, 9, 40], boundaries([4096, 512, 256, 31, 7, 1, 2048, 640, 3, 598])):
        for u in (2, 4, 8):
            assert xcp.choose_balance(8, causal=True, cu_seqlens=cu, ulysses=u) == xcp.choose_balance(
                8 // u, causal=True, cu_seqlens=cu
            )
    assert xcp.choose_balance(8, causal=True, cu_seqlens=[0, 40]) == DZ
    assert xcp.choose_balance(8, causal=True, cu_seqlens=[0, 40], ulysses=4) == "zigzag"
    assert xcp.choose_balance(8, causal=True, window=(4, 0), seq_len=64, ulysses=2) == xcp.choose_balance(
        4, causal=True, window=(4, 0), seq_len=64
    )


@settings(max_examples=8, deadline=None)
@given(hybrid_layouts(), st.booleans())
def test_the_hybrid_runs_what_choose_balance_recommends_for_its_ulysses(layout, causal):
    """Never a balance the hybrid refuses: the recommendation shards and runs, exact in float64."""
    world, ulysses, cu = layout
    balance = xcp.choose_balance(world, causal=causal, cu_seqlens=cu, ulysses=ulysses)
    gen = torch.Generator().manual_seed(cu[-1])
    q, k, v = (torch.randn(1, cu[-1], 8, 2, generator=gen, dtype=torch.float64) for _ in range(3))
    got = ring_with_documents(q, k, v, None, world, balance, causal, cu, ulysses=ulysses)[0]
    assert_close_to("out", got, independent_masked_reference(q, k, v, q, cu, causal)[0], 1e-10)


def test_choose_balance_ulysses_errors():
    with raises(ValueError, "ulysses: expected a positive integer (head-parallel ranks); got 0"):
        xcp.choose_balance(8, causal=True, cu_seqlens=[0, 64], ulysses=0)
    with raises(TypeError, "ulysses: expected a positive integer (head-parallel ranks); got 2.0"):
        xcp.choose_balance(8, causal=True, cu_seqlens=[0, 64], ulysses=2.0)
    with raises(ValueError, "ulysses: expected a divisor of world_size 8 (P = ulysses x ring ranks); got 3"):
        xcp.choose_balance(8, causal=True, cu_seqlens=[0, 64], ulysses=3)
    with raises(ValueError, "cu_seqlens: expected a multiple of world_size 8 tokens with ulysses=2 (each ring "
                "shard is cut into 2 equal pieces, under every balance); got 8193"):  # fmt: skip
        xcp.choose_balance(8, causal=True, cu_seqlens=[0, 4000, 8193], ulysses=2)
    with raises(ValueError, "seq_len: expected a multiple of world_size 8 tokens with ulysses=2"):
        xcp.choose_balance(8, causal=True, window=(4, 0), seq_len=68, ulysses=2)
    assert xcp.choose_balance(8, causal=True, cu_seqlens=[0, 4000, 8193]) == DZ  # the ring alone splits it


def test_plan_auto_with_ulysses_prints_the_rings_choice(capsys):
    """--balance auto --ulysses 4 over 8 ranks: xcp.choose_balance(8, ulysses=4), zigzag over rings of 2 (the
    ring alone over 8 would take document_zigzag); a sum P does not divide names --documents and --ulysses."""
    assert main(["plan", "--world", "8", "--ulysses", "4", "--heads", "8", "--causal", "--documents", "40",
                 "--balance", "auto"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert text.startswith("--balance auto: xcp.choose_balance recommends zigzag\n")
    assert "balance: xcp.choose_balance recommends zigzag (ulysses=4: weighed over rings of 2 ranks)" in text
    assert re.search(r"^  zigzag +busiest \S+ even, .*2/2 steps  <- recommended, this plan$", text, re.M), text
    assert main(["plan", "--world", "4", "--ulysses", "2", "--causal", "--documents", "9,9", "--balance", DZ]) == 2
    assert "xcp plan: error: --documents: expected a multiple of 4 ranks with --ulysses 2" in capsys.readouterr().err


def test_run_document_zigzag_with_ulysses_passes(capsys):
    args = ["run", "--world", "4", "--ulysses", "2", "--balance", DZ, "--documents", "5,1,13,21,8", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "8", "--dtype", "float64"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "balance document_zigzag" in text and "hybrid: world 4 = ulysses 2 x ring 2" in text
    assert text.endswith("PASS\n")


# ---------------------------------------------------------------------------------------------- the sanitizer


@pytest.mark.parametrize(("world", "seq", "causal"), [(3, 14, False), (4, 19, True)])
def test_sanitizer_checks_uneven_shards_exactly_and_within_the_longest_shards_bound(world, seq, causal):
    """S not a multiple of P: shards differ by a token, the shorter ones travel padded to the longest, so the
    byte bound is two K/V + two dK/dV messages of ceil(S/P) tokens; the slots reach it (a bound of S // P
    tokens would report them), and out and every gradient are exact against the document-masked reference."""
    report = sanitize_ring(world=world, seq=seq, causal=causal, balance=DZ, documents=3, backward=True, seed=world)
    assert report.ok, report.format()
    assert sum(report.document_lengths) == seq and len(report.document_lengths) == 3
    assert set(report.max_error) == {"out", "dq", "dk", "dv"} and max(report.max_error.values()) <= 1e-10
    shard = 2 * 2 * 8 * 8  # K and V of 2 heads of 8 float64 per token (dK/dV alike, float64 accumulators)
    assert report.bound_comm_bytes == 2 * 2 * shard * -(-seq // world)
    assert max(report.peak_comm_bytes.values()) == report.bound_comm_bytes > 2 * 2 * shard * (seq // world)
    assert report.config["balance"] == DZ and report.config["seq"] == seq


def test_sanitizer_document_zigzag_findings_fire():
    """The same run reports numerics against a reference that ignores the documents, and a bound under
    keep_all: what it checks is checked."""
    kw = dict(world=4, seq=19, balance=DZ, documents=4, backward=True)
    whole = sanitizer.document_mask
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sanitizer, "document_mask", lambda cu, causal: whole((0, cu[-1]), causal))
        wrong = sanitize_ring(**kw)
    assert wrong.kinds() == {"numerics"} and "out: error" in wrong.format()
    kept = sanitize_ring(**kw, slots="keep_all")
    assert kept.kinds() == {"bound"} and max(kept.max_error.values()) <= 1e-10


def test_sanitizer_document_zigzag_with_ulysses():
    report = sanitize_ring(world=4, ulysses=2, seq=24, balance=DZ, documents=4, backward=True)
    assert report.ok and max(report.max_error.values()) <= 1e-10, report.format()
    assert report.config["ulysses"] == 2 and report.ring_steps <= 2


def test_sanitizer_document_zigzag_errors():
    with raises(ValueError, "documents: expected a number of documents with balance 'document_zigzag' (it places "
                "each document over the ranks); got None"):  # fmt: skip
        sanitize_ring(balance=DZ)
    with raises(ValueError, "seq: expected a multiple of world=4 with ulysses=2"):
        sanitize_ring(world=4, ulysses=2, seq=18, balance=DZ, documents=2)
    with raises(ValueError, "seq: balance 'document_zigzag' over 4 ranks needs at least 4 tokens"):
        sanitize_ring(world=4, seq=3, balance=DZ, documents=2)


def test_sanitize_command_runs_document_zigzag(capsys):
    assert main(["sanitize", "--world", "3", "--balance", DZ, "--documents", "4", "--seq", "14", "--backward"]) == 0
    text = capsys.readouterr().out
    assert "balance=document_zigzag" in text and "seq=14" in text and "documents: 4 packed" in text
    assert "with the document mask" in text and "no finding" in text
    for extra, flag in ((["--documents", "3"], "--documents"), (["--ulysses", "2"], "--ulysses")):
        assert main(["sanitize", "--world", "2", "--decode", "2", *extra]) == 2
        assert f"xcp sanitize: error: --decode: expected no {flag} (a KV cache" in capsys.readouterr().err
