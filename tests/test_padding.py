"""Sequences of any length (xcp.pad_to_balance): padded with a document of their own, sharded, attended
and cut back, they give the output and gradients of the unpadded sequence on one device (float64)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import NAMES, independent_masked_reference, ring_with_documents
from strategies import assert_close_to

import xcp
from xcp import schedule
from xcp.padding import padded_length


def _splits(seq_len: int, world: int, balance: str, ulysses: int) -> bool:
    try:
        xcp.shard(torch.zeros(1, seq_len), world, 0, balance=balance, ulysses=ulysses)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padded_length_is_the_shortest_that_shard_takes(world):
    for balance in schedule.BALANCES:
        for ulysses in [u for u in range(1, world + 1) if world % u == 0]:
            for seq_len in range(1, 4 * world + 4):
                got = padded_length(seq_len, world, balance, ulysses)
                assert _splits(got, world, balance, ulysses), (seq_len, world, balance, ulysses, got)
                shorter = [n for n in range(seq_len, got) if _splits(n, world, balance, ulysses)]
                assert not shorter, (seq_len, world, balance, ulysses, got, shorter)


def _pad_all(tensors, world, balance, cu, **kw):
    """Each tensor padded; the boundaries and pad of the first (all agree)."""
    padded = [xcp.pad_to_balance(t, world, balance=balance, cu_seqlens=cu, value=3.0, **kw) for t in tensors]
    assert len({(p[2], None if p[1] is None else tuple(p[1].tolist())) for p in padded}) == 1
    return [p[0] for p in padded], padded[0][1], padded[0][2]


@pytest.mark.parametrize("balance", schedule.BALANCES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_any_length_padded_equals_the_unpadded_reference(world, balance):
    multiple = schedule.required_multiple(world, balance)
    for seq_len in range(1, 4 * world + 4):
        gen = torch.Generator().manual_seed(seq_len)
        q, k, v, dout = (torch.randn(1, seq_len, h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
        before = [t.clone() for t in (q, k, v, dout)]
        cu = None if seq_len % 2 else [0, seq_len // 3, seq_len // 3, seq_len]  # one document, or some
        (qp, kp, vp, dp), bounds, pad = _pad_all((q, k, v, dout), world, balance, cu)
        assert 0 <= pad < multiple and (seq_len + pad) % multiple == 0
        assert all(torch.equal(t, b) for t, b in zip((q, k, v, dout), before)), "the inputs are not modified"
        assert pad == 0 or all(p.data_ptr() != t.data_ptr() for p, t in zip((qp, kp, vp, dp), (q, k, v, dout)))
        documents = [0, seq_len] if cu is None else sorted(set(cu))  # the real ones, empty ones dropped
        if pad:
            assert bounds.dtype == torch.int32 and bounds.tolist() == [*documents, seq_len + pad]
        else:
            assert (bounds is None) == (cu is None) and (bounds is None or bounds.tolist() == documents)
        for causal in (False, True):
            padded = documents if bounds is None else bounds.tolist()
            got = ring_with_documents(qp, kp, vp, dp, world, balance, causal, padded)
            want = independent_masked_reference(q, k, v, dout, documents, causal)
            for name, g, w in zip(NAMES, got, want):
                assert_close_to(f"{name} S={seq_len} causal={causal}", g.narrow(1, 0, seq_len), w, 1e-10)


def test_the_hybrid_takes_the_padded_length():
    world, ulysses, seq_len = 4, 2, 5
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq_len, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    (qp, kp, vp, dp), bounds, pad = _pad_all((q, k, v, dout), world, "zigzag", None, ulysses=ulysses)
    assert (pad, bounds.tolist()) == (3, [0, 5, 8])
    got = ring_with_documents(qp, kp, vp, dp, world, "zigzag", True, bounds.tolist(), ulysses=ulysses)
    want = independent_masked_reference(q, k, v, dout, (0, seq_len), True)
    for name, g, w in zip(NAMES, got, want):
        assert_close_to(name, g[:, :seq_len], w, 1e-10)


def test_other_dims_dtypes_and_boundaries():
    x = torch.arange(2 * 3 * 5).reshape(2, 3, 5)
    padded, bounds, pad = xcp.pad_to_balance(x, 2, dim=-1, value=-100, cu_seqlens=torch.tensor([0, 2, 5]))
    assert pad == 3 and padded.shape == (2, 3, 8) and torch.equal(padded[..., :5], x)
    assert bool((padded[..., 5:] == -100).all()) and bounds.dtype == torch.int64 and bounds.tolist() == [0, 2, 5, 8]
    same, none, zero = xcp.pad_to_balance(x, 1, balance="contiguous")  # 3 tokens split over one rank
    assert same is x and none is None and zero == 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda x: xcp.pad_to_balance([1, 2], 2), TypeError, "x: expected a torch.Tensor; got list"),
        (lambda x: xcp.pad_to_balance(x, 0), ValueError, "world_size: expected an integer >= 1; got 0"),
        (lambda x: xcp.pad_to_balance(x, 2, balance="even"), ValueError, "balance: expected one of"),
        (lambda x: xcp.pad_to_balance(x, 2, dim=3), ValueError, "dim: expected an integer in [-3, 3); got 3"),
        (lambda x: xcp.pad_to_balance(x, 2, value="0"), TypeError, "value: expected a number"),
        (lambda x: xcp.pad_to_balance(x, 2, cu_seqlens=[0, 4]), ValueError, "cu_seqlens: expected cu_seqlens[-1] == 5"),
        (lambda x: xcp.pad_to_balance(x, 4, ulysses=3), ValueError, "ulysses: expected a divisor of world_size 4"),
        (lambda x: xcp.pad_to_balance(x[:, :0], 2), ValueError, "x.shape[1]: expected at least one token"),
        (lambda x: padded_length(0, 2), ValueError, "seq_len: expected an integer >= 1"),
    ],
)
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        call(torch.zeros(1, 5, 2))
