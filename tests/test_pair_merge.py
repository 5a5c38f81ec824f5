"""The forward folds blocks two at a time where the backend has a pair kernel (``_Running`` in xcp/ring.py),
and the backward adds two blocks' dQ at a time (``_PairedAdds``).

A block is held until the next: two blocks of the same rows fold in one ``backend.fused_merge_pair_`` call
(``fresh`` when nothing was folded yet and the rows are the whole shard), else the held one folds alone. A
backend that answers False folds one block at a time from its first pair on. The CPU backend below folds a
pair with the eager merge and records each call; the results are checked against float64 attention on the
whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches, independent_masked_reference, installed, ring_with_documents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import layouts, random_inputs, ring_cases

import xcp
from xcp.backends.cpu import CPUBackend
from xcp.kernels.merge import merge_


class PairCPU(CPUBackend):
    """CPU blocks; pairs folded by two eager merges (or refused with ``answer=False``), every call recorded."""

    folds_pairs = True

    def __init__(self, name: str, answer: bool = True) -> None:
        super().__init__()
        self.name, self.answer = name, answer
        self.calls: list[tuple[int, int, bool, int]] = []  # rows start, stop, fresh, shard length
        self.adds: list[int] = []  # rows of each dQ pair offered

    def fused_merge_pair_(self, out, lse, first, second, rows, fresh) -> bool:
        self.calls.append((rows.start, rows.stop, fresh, out.shape[1]))
        if not self.answer:
            return False
        if fresh:
            assert rows.start == 0 and rows.stop == out.shape[1], "fresh accumulators for rows that are not all"
            out.copy_(first[0])  # out and lse are uninitialised here: written, never read
            lse.copy_(first[1])
        else:
            merge_(out, lse, *first, rows)
        merge_(out, lse, *second, rows)
        return True

    def fused_add_pair_(self, acc, first, second) -> bool:
        self.adds.append(acc.shape[1])
        if not self.answer:
            return False
        acc.add_(first)
        acc.add_(second)
        return True


@pytest.mark.parametrize("balance", xcp.BALANCES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_pairs_fold_like_single_blocks(reference, ring, world, causal, balance):
    """With a pair kernel the ring matches float64 attention; without a mask every block covers the whole
    shard, so each rank folds P // 2 pairs (the first fresh) and, for odd P, one block alone."""
    seq = 2 * world * 3
    q, k, v, dout = random_inputs(2, seq, 4, 2, 6, seed=world)
    with installed(PairCPU(f"cpu-pairs-{world}-{causal}-{balance}")) as backend:
        got = ring(q, k, v, dout, world, causal, balance, device=backend.name)
    assert_matches(got, reference(q, k, v, dout, causal))
    assert backend.calls, "no pair was folded"
    assert backend.adds, "no dQ pair was added"
    if not causal:
        assert len(backend.calls) == world * (world // 2)
        assert sum(fresh for _, _, fresh, _ in backend.calls) == world  # one fresh start per rank
        assert len(backend.adds) == world * (world // 2)


@given(case=ring_cases())
def test_pairs_fold_like_single_blocks_in_random_configurations(reference, ring, case):
    q, k, v, dout = random_inputs(case.batch, case.seq, case.heads, case.kv_heads, case.head_dim, seed=case.seed)
    with installed(PairCPU(f"cpu-pairs-random-{case.seed}")) as backend:
        got = ring(q, k, v, dout, case.world, case.causal, case.balance, device=backend.name)
    assert_matches(got, reference(q, k, v, dout, case.causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_backend_without_a_pair_kernel_folds_one_at_a_time_after_its_first_answer(reference, ring, causal):
    """The first pair (of blocks, and of dQ) is offered once per rank and pass; after False every block folds
    (and adds) alone, and the result is the same."""
    world = 4
    q, k, v, dout = random_inputs(1, 48, 4, 2, 8, seed=7)
    with installed(PairCPU(f"cpu-no-pairs-{causal}", answer=False)) as backend:
        got = ring(q, k, v, dout, world, causal, "zigzag", device=backend.name)
    assert_matches(got, reference(q, k, v, dout, causal))
    assert len(backend.calls) == world and len(backend.adds) == world


def test_pairs_in_low_precision_match_the_reference(reference, ring):
    """bf16 inputs: the accumulators are float32 and the pair kernel folds into them."""
    q, k, v, dout = (t.to(torch.bfloat16) for t in random_inputs(1, 64, 4, 2, 16, seed=3))
    with installed(PairCPU("cpu-pairs-bf16")) as backend:
        got = ring(q, k, v, dout, 4, True, "zigzag", device=backend.name)
    want = reference(q, k, v, dout, True)
    for name in ("out", "dq", "dk", "dv"):
        g, w = getattr(got, name).double(), getattr(want, name)
        assert (g - w).abs().max().item() <= 4 * 2**-8 * w.abs().max().item(), name
    assert backend.calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_chunks=3), with_sinks=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_pairs_over_packed_documents_match_the_masked_reference(layout, with_sinks, seed):
    """Documents give blocks of partial rows (several kernel calls per step): pairs form only where two
    consecutive calls cover the same rows, the first fold of partial rows merges into zeros, never fresh."""
    world, balance, causal, cu = layout
    gen = torch.Generator().manual_seed(seed)
    seq = cu[-1]
    q, k, v, dout = (torch.randn(1, seq, h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64) if with_sinks else None
    with installed(PairCPU(f"cpu-pairs-docs-{seed}")) as backend:
        got = ring_with_documents(q, k, v, dout, world, balance, causal, cu, sinks, device=backend.name)
    want = independent_masked_reference(q, k, v, dout, cu, causal, sinks)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if w is not None:
            err = (g - w).abs().max().item()
            assert err <= 1e-10, f"{name}: max abs error {err:.3e}"


def _blocks(rows_list, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(1, n, 2, 4, dtype=torch.float64)
    blocks = []
    for rows in rows_list:
        m = rows.stop - rows.start
        lse = torch.randn(1, 2, m, generator=gen, dtype=torch.float64)
        out = torch.randn(1, m, 2, 4, generator=gen, dtype=torch.float64)
        lse[:, :, 0] = float("-inf")  # a row that saw no key in this block: zeros, as a kernel gives
        out[:, 0] = 0.0
        blocks.append((out, lse, rows))
    return q, blocks


@pytest.mark.parametrize(
    "rows_list",
    [
        [slice(0, 6), slice(0, 6), slice(0, 6)],  # a fresh pair, then one alone
        [slice(2, 6), slice(2, 6), slice(0, 6), slice(0, 6)],  # the first pair on partial rows: into zeros
        [slice(0, 6), slice(3, 6), slice(3, 6), slice(0, 3)],  # the first block alone (a copy), then a pair
    ],
)
def test_running_folds_equal_one_merge_per_block(rows_list):
    """``_Running`` against one eager merge per block into zeros / -inf: the same accumulators; fresh only
    where nothing was folded and the rows are the whole shard."""
    from xcp.kernels.merge import new_accumulators
    from xcp.ring import _Running

    q, blocks = _blocks(rows_list)
    backend = PairCPU("unused")
    running = _Running(backend, q, q.shape[3])
    for bo, bl, rows in blocks:
        running.add(rows, bo, bl)
    out, lse = running.result()
    want_out, want_lse = new_accumulators(q)
    for bo, bl, rows in blocks:
        merge_(want_out, want_lse, bo, bl, rows)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    first_pair_whole = rows_list[0] == rows_list[1] == slice(0, 6)
    assert [fresh for *_, fresh, _ in backend.calls][:1] == [first_pair_whole]


def test_a_backend_that_folds_no_pairs_gets_no_block_held(reference, ring):
    """``folds_pairs`` False (every backend's default): no pair is offered, nothing is held."""
    backend = PairCPU("cpu-folds-none")
    backend.folds_pairs = False
    q, k, v, dout = random_inputs(1, 48, 4, 2, 8, seed=11)
    with installed(backend):
        got = ring(q, k, v, dout, 4, True, "zigzag", device=backend.name)
    assert_matches(got, reference(q, k, v, dout, True))
    assert backend.calls == [] and backend.adds == []


def test_blocks_over_the_limit_are_folded_and_added_at_once(reference, ring, monkeypatch):
    """A block output or dQ larger than PAIR_MAX_BYTES is not held (the pass's memory peak stays), so no
    pair is offered; one at the limit is held."""
    from xcp import ring as ring_module

    q, k, v, dout = random_inputs(1, 48, 4, 2, 8, seed=12)  # 12 rows per rank, 4 heads of 8, float64
    block = 12 * 4 * 8 * 8  # bytes of one block's output (and dQ) here
    for limit, pairs in ((block - 1, 0), (block, 4 * 2)):
        monkeypatch.setattr(ring_module, "PAIR_MAX_BYTES", limit)
        with installed(PairCPU(f"cpu-pairs-limit-{limit}")) as backend:
            got = ring(q, k, v, dout, 4, False, "zigzag", device=backend.name)
        assert_matches(got, reference(q, k, v, dout, False))
        assert len(backend.calls) == pairs and len(backend.adds) == pairs


class AddCPU(CPUBackend):
    """CPU blocks; every single addition offered to ``fused_add_`` done here (or refused with ``answer=False``)
    and recorded by the accumulator's dims."""

    def __init__(self, name: str, answer: bool = True) -> None:
        super().__init__()
        self.name, self.answer = name, answer
        self.adds: list[tuple[int, int]] = []  # (rows, head dim) of each addition offered

    def fused_add_(self, acc, grad) -> bool:
        assert acc.shape == grad.shape and acc.dtype == torch.float64
        self.adds.append((acc.shape[1], acc.shape[3]))
        if self.answer:
            acc.add_(grad)
        return self.answer


@pytest.mark.parametrize("answer", [True, False], ids=["served", "refused"])
@pytest.mark.parametrize("balance", xcp.BALANCES)
def test_every_gradient_addition_is_offered_to_the_backend(reference, ring, balance, answer):
    """The backward offers each block's dQ, dK and dV addition to ``backend.fused_add_`` (values of another
    head dim show which is which); served or refused, the ring matches float64 attention."""
    world, seq = 4, 24
    q, k, _, dout = random_inputs(2, seq, 4, 2, 6, seed=3)
    v = torch.randn(2, seq, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    dout = torch.randn(2, seq, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with installed(AddCPU(f"cpu-add-{balance}-{answer}", answer)) as backend:
        got = ring(q, k, v, dout, world, True, balance, device=backend.name)
    assert_matches(got, reference(q, k, v, dout, True))
    dims = [d for _, d in backend.adds]
    assert dims.count(5) > 0 and dims.count(6) == 2 * dims.count(5)  # dQ and dK in q's dim, dV in v's
