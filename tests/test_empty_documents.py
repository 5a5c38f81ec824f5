"""Empty documents in ``cu_seqlens``: repeated boundaries (``cu[i] == cu[i + 1]``), as packed batches from
data loaders hold them.

They are accepted wherever cu_seqlens is, hold no token and cost nothing: xcp.documents.check_cu_seqlens drops
the repeats where it checks the boundaries, so the plan, the kernels and the agreement between ranks see only
non-empty documents. Checked here:

- the boundaries as checked (repeats dropped, the input untouched) and what is still refused, by name;
- the ring in float64 (every balance, causal and not, windows, sinks, GQA; the hybrid) against the tests' own
  whole-sequence reference, which finds each token's document by bisecting the boundaries WITH the repeats, for
  out and every gradient; and bit for bit against the same call with the empty documents removed;
- no kernel call for them: the CPU kernels' calls counted with and without them;
- transformers' shard_batch and attention interface (cu_seq_lens_q/k with repeats).
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from helpers import NAMES, independent_masked_reference, ring_with_documents, run_sharded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import assert_close_to, layouts, random_inputs, windowed

import xcp
from xcp import documents
from xcp.backends.cpu import CPUBackend
from xcp.checks import check_documents

TOL = 1e-10
WORLD, S = 3, 24  # every balance splits 24 tokens over 3 ranks (zigzag: a multiple of 6)
WITH_EMPTIES = (0, 0, 0, 5, 9, 9, 9, 9, 17, 24, 24, 24)  # empties at the start, three in a row, at the end
WITHOUT = (0, 5, 9, 17, 24)  # the same documents, the empty ones removed


def with_repeats(cu: tuple[int, ...], repeats: list[int]) -> tuple[int, ...]:
    """``cu`` with boundary i given ``repeats[i]`` more times: each repeat one more empty document."""
    return tuple(b for b, r in zip(cu, repeats) for _ in range(1 + r))


def sinks_for(heads: int, seed: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_matches_reference(got, q, k, v, dout, cu, causal, sinks, window=None) -> None:
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks, window=window)
    assert len(got) == len(want)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g, w, TOL)


def assert_equal(got, removed) -> None:
    for name, g, r in zip(NAMES, got, removed):
        assert torch.equal(g, r), f"{name} differs from the call without the empty documents"


# ---------------------------------------------------------------------------------------------- the boundaries


@settings(max_examples=20, deadline=None)
@given(layout=layouts(), data=st.data())
def test_repeats_are_dropped_and_the_input_is_untouched(layout, data):
    cu = layout[3]
    given_cu = with_repeats(cu, data.draw(st.lists(st.integers(0, 3), min_size=len(cu), max_size=len(cu))))
    for form in (list(given_cu), given_cu, torch.tensor(given_cu), torch.tensor(given_cu, dtype=torch.int32)):
        before = form.clone() if isinstance(form, torch.Tensor) else list(form)
        assert documents.check_cu_seqlens(form, cu[-1]) == cu
        assert torch.equal(form, before) if isinstance(form, torch.Tensor) else list(form) == before


@pytest.mark.parametrize(
    ("cu", "error", "message"),
    [
        ([0, 5, 3, 8], ValueError, "expected non-decreasing boundaries (a repeat is an empty document); got "
         "cu_seqlens[1] = 5 > cu_seqlens[2] = 3"),
        ([0, 4, 4, 2, 8], ValueError, "got cu_seqlens[2] = 4 > cu_seqlens[3] = 2"),
        ([1, 1, 8], ValueError, "expected cu_seqlens[0] == 0; got 1"),
        ([0, 4, 4, 6], ValueError, "expected cu_seqlens[-1] == 8 (the global sequence length: local length x "
         "ranks); got 6"),
        ([0, 8, 8, 9], ValueError, "expected cu_seqlens[-1] == 8"),
        ([0, 0], ValueError, "expected cu_seqlens[-1] == 8"),
        ([0, 0.0, 8], ValueError, "expected integer boundaries; got 0.0"),
        (torch.tensor([0.0, 4.0, 4.0, 8.0]), TypeError, "expected an integer dtype (int32 or int64); got "
         "torch.float32"),
    ],
)  # fmt: skip
def test_what_is_still_refused(cu, error, message):
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(error, match=r"^cu_seqlens: .*" + re.escape(message)):
        xcp.attention(q, q, q, causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens: expected at least one token (cu_seqlens[-1] > 0)")):
        documents.check_cu_seqlens([0, 0, 0])


@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_empty_documents_make_no_kernel_call(monkeypatch, balance, causal):
    """The CPU kernels' calls (dense and varlen, forward and backward) are those of the call without them, and
    the documents the ring is planned on are the same (hence its steps)."""
    calls: list[str] = []  # list.append is atomic: the rank threads share it

    def counting(name):
        original = getattr(CPUBackend, name)

        def counted(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name in ("forward", "backward", "forward_varlen", "backward_varlen"):
        monkeypatch.setattr(CPUBackend, name, counting(name))
    q, k, v, dout = random_inputs(1, S, 2, 1, 4, seed=7)
    counts = []
    for cu in (WITH_EMPTIES, WITHOUT):
        calls.clear()
        ring_with_documents(q, k, v, dout, WORLD, balance, causal, cu)
        counts.append(collections.Counter(calls))
    assert counts[0] == counts[1] and counts[0]["forward"] + counts[0]["forward_varlen"] > 0
    local = xcp.shard(q, WORLD, 0, balance=balance)
    assert check_documents(torch.tensor(WITH_EMPTIES), local, WORLD, balance, None) == WITHOUT
    assert check_documents(torch.tensor((0, 0, S, S)), local, WORLD, balance, None) is None  # the dense path


def test_choose_balance_ignores_empty_documents():
    for causal, window in ((True, None), (False, (4, 2)), (True, (2, 0))):
        kw = dict(causal=causal, window=window)
        assert xcp.choose_balance(WORLD, cu_seqlens=torch.tensor(WITH_EMPTIES), **kw) == xcp.choose_balance(
            WORLD, cu_seqlens=WITHOUT, **kw
        )


# ---------------------------------------------------------------------------------------------- the ring


@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [False, True], ids=["no-window", "window"])
def test_ring_with_empty_documents(balance, causal, window):
    seed = xcp.BALANCES.index(balance) * 4 + 2 * causal + window
    band = ((3, 0) if causal else (4, 2)) if window else None
    q, k, v, dout = random_inputs(1, S, 4, 2, 4, seed=seed)
    sinks = sinks_for(4, seed)
    got = ring_with_documents(q, k, v, dout, WORLD, balance, causal, WITH_EMPTIES, sinks, window=band)
    assert_matches_reference(got, q, k, v, dout, WITH_EMPTIES, causal, sinks, band)
    assert_equal(got, ring_with_documents(q, k, v, dout, WORLD, balance, causal, WITHOUT, sinks, window=band))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.one_of(layouts(max_chunks=3).map(lambda c: (*c, None)), windowed(max_chunks=3)),
    data=st.data(),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_float64_ring_with_empty_documents_anywhere(case, data, with_sinks, seed):
    world, balance, causal, cu, window = case
    cu = with_repeats(cu, data.draw(st.lists(st.integers(0, 2), min_size=len(cu), max_size=len(cu))))
    q, k, v, dout = random_inputs(1, cu[-1], 2, 1, 4, seed=seed)
    sinks = sinks_for(2, seed) if with_sinks else None
    got = ring_with_documents(q, k, v, dout, world, balance, causal, cu, sinks, window=window)
    assert_matches_reference(got, q, k, v, dout, cu, causal, sinks, window)


def test_one_document_among_empties_is_the_dense_path():
    q, k, v, dout = random_inputs(1, 16, 2, 2, 4, seed=3)
    got = run_sharded(q, k, v, dout, 2, causal=True, cu_seqlens=torch.tensor([0, 0, 16, 16, 16]))
    assert_equal(got, run_sharded(q, k, v, dout, 2, causal=True))


@pytest.mark.parametrize("balance", xcp.BALANCES)
def test_hybrid_with_empty_documents(balance):
    """P = 4 ranks as U = 2 head groups over a ring of R = 2: causal with sinks, non-causal under a window."""
    for causal, window, with_sinks in ((True, None, True), (False, (4, 2), False)):
        seed = 20 + xcp.BALANCES.index(balance) * 2 + causal
        q, k, v, dout = random_inputs(1, S, 4, 2, 4, seed=seed)
        sinks = sinks_for(4, seed) if with_sinks else None

        def run(cu, sinks=sinks, window=window, causal=causal, q=q, k=k, v=v, dout=dout):
            kw = dict(balance=balance, ulysses=2, sinks=sinks, causal=causal, window=window)
            return run_sharded(q, k, v, dout, 4, cu_seqlens=torch.tensor(cu), timeout=30, **kw)

        got = run(WITH_EMPTIES)
        assert_matches_reference(got, q, k, v, dout, WITH_EMPTIES, causal, sinks, window)
        assert_equal(got, run(WITHOUT))


# ---------------------------------------------------------------------------------------------- transformers


def test_shard_batch_drops_empty_documents():
    from xcp.integrations.transformers import shard_batch

    ids = torch.arange(S).reshape(1, S) + 100
    given_cu = torch.tensor(WITH_EMPTIES)

    def rank(group):
        with xcp.context(group):
            return shard_batch(ids, cu_seqlens=given_cu), shard_batch(ids, cu_seqlens=list(WITHOUT))

    for got, removed in xcp.LocalWorld(WORLD).run(rank):
        assert torch.equal(got.position_ids, removed.position_ids)
        assert got.cu_seqlens.tolist() == list(WITHOUT) and got.cu_seqlens.dtype == torch.int32
        assert got.model_kwargs()["max_length_q"] == 8
    assert torch.equal(given_cu, torch.tensor(WITH_EMPTIES))
    assert shard_batch(ids, cu_seqlens=[0, 0, S, S]).cu_seqlens is None  # one document
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing boundaries from 0 to 24 .*got \["):
        shard_batch(ids, cu_seqlens=[0, 9, 9, 5, S])


def test_the_attention_interface_takes_boundaries_with_repeats():
    """cu_seq_lens_q/k with empty documents, and the positions restarting in each document: the output of the
    whole sequence, and bit for bit that of the boundaries without the repeats."""
    from xcp.integrations.transformers import attention_forward, prepare, shard_batch

    q, k, v, dout = random_inputs(1, S, 4, 2, 4, seed=5)
    module = prepare(torch.nn.Module())  # causal: transformers' default

    def rank(group):
        with xcp.context(group) as ctx:
            positions = shard_batch(torch.zeros(1, S, dtype=torch.long), cu_seqlens=WITH_EMPTIES).position_ids
            ql, kl, vl = (ctx.shard(x).transpose(1, 2) for x in (q, k, v))  # [B, H, S_local, D]
            outs = []
            for cu in (torch.tensor(WITH_EMPTIES), list(WITH_EMPTIES), torch.tensor(WITHOUT)):
                kw = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
                outs.append(attention_forward(module, ql, kl, vl, None, scaling=0.5, **kw)[0])
            return outs

    per_rank = xcp.LocalWorld(WORLD).run(rank)
    got = [xcp.unshard([r[i] for r in per_rank]) for i in range(3)]
    want = independent_masked_reference(q, k, v, dout, WITH_EMPTIES, True, scale=0.5)[0]
    assert_close_to("out", got[0], want, TOL)
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2])
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected non-decreasing boundaries"):
        bad = [0, 9, 5, S]
        attention_forward(module, *(x.transpose(1, 2) for x in (q, k, v)), None, cu_seq_lens_q=bad, cu_seq_lens_k=bad)
