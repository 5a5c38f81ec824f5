"""xcp.shard and xcp.unshard: inverse of each other for every balance and dim, placing the tokens that
xcp.schedule.shard_indices names, never touching or aliasing the input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import xcp
from xcp.schedule import BALANCES, required_multiple, shard_indices


def labelled(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A tensor whose entries along ``dim`` carry their own position (plus a distinct fraction elsewhere)."""
    x = torch.rand(shape, dtype=torch.float64)
    pos = torch.arange(shape[dim], dtype=torch.float64)
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return x + 10 * pos.reshape(view)


@given(
    world=st.integers(1, 8),
    balance=st.sampled_from(BALANCES),
    multiple=st.integers(1, 3),
    layout=st.sampled_from([((2, None, 3, 2), 1), ((None, 3), 0), ((2, 3, None), -1), ((1, None, 1, 4), -3)]),
)
def test_unshard_inverts_shard(world, balance, multiple, layout):
    shape, dim = layout
    seq = required_multiple(world, balance) * multiple
    shape = tuple(seq if s is None else s for s in shape)
    x = labelled(shape, dim)
    parts = [xcp.shard(x, world, r, dim=dim, balance=balance) for r in range(world)]
    for r, part in enumerate(parts):
        assert part.is_contiguous()
        assert part.dtype == x.dtype
        want = x.index_select(dim, torch.tensor(shard_indices(seq, world, r, balance)))
        assert torch.equal(part, want), f"rank {r} holds the wrong tokens"
    back = xcp.unshard(parts, dim=dim, balance=balance)
    assert torch.equal(back, x)


@pytest.mark.parametrize("balance", BALANCES)
def test_default_dim_is_the_sequence_of_the_attention_layout(balance):
    x = labelled((2, 8, 3, 4), 1)
    assert torch.equal(xcp.shard(x, 2, 1, balance=balance), xcp.shard(x, 2, 1, dim=1, balance=balance))
    parts = [xcp.shard(x, 2, r, balance=balance) for r in range(2)]
    assert parts[0].shape == (2, 4, 3, 4)
    assert torch.equal(xcp.unshard(parts, balance=balance), x)


def test_default_balance_is_zigzag():
    x = labelled((1, 8, 1, 1), 1)
    assert torch.equal(xcp.shard(x, 2, 0), xcp.shard(x, 2, 0, balance="zigzag"))
    assert torch.equal(xcp.shard(x, 2, 0)[0, :, 0, 0].floor() / 10, torch.tensor([0.0, 1, 6, 7]))


@pytest.mark.parametrize("balance", BALANCES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("shape", "dim"), [((1, 12, 2, 3), 1), ((12, 2), 0), ((2, 3, 12), -1)])
def test_shard_returns_a_new_tensor(balance, world, shape, dim):
    """Writing into a shard must never change the caller's sequence (and shard never writes into it)."""
    x = labelled(shape, dim)
    before = x.clone()
    part = xcp.shard(x, world, world - 1, dim=dim, balance=balance)
    assert torch.equal(x, before)
    shares = part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert not shares, f"shard aliases its input ({balance}, world {world}, dim {dim})"
    part.fill_(-1.0)
    assert torch.equal(x, before)


@pytest.mark.parametrize("balance", BALANCES)
def test_unshard_returns_a_new_tensor(balance):
    x = labelled((2, 6, 2), 1)
    parts = [xcp.shard(x, 1, 0, balance=balance)]
    kept = parts[0].clone()
    back = xcp.unshard(parts, balance=balance)
    back.fill_(0.0)
    assert torch.equal(parts[0], kept)


def test_shard_keeps_dtype_device_and_works_without_grad_tracking():
    x = labelled((1, 4, 1, 2), 1).to(torch.bfloat16).requires_grad_()
    part = xcp.shard(x, 2, 0)
    assert part.dtype == torch.bfloat16 and part.device == x.device
    part.sum().backward()  # shard is differentiable: the gradient lands on the rank's tokens
    assert x.grad[0, :, 0, 0].tolist() == [1, 0, 0, 1]


@pytest.mark.parametrize(
    ("world", "balance", "seq", "multiple"),
    [(2, "zigzag", 6, 4), (4, "zigzag", 4, 8), (3, "contiguous", 7, 3), (4, "stripe", 6, 4), (2, "zigzag", 0, 4)],
)
def test_shard_names_the_multiple_it_needs(world, balance, seq, multiple):
    x = torch.zeros(1, seq, 2, 2)
    with pytest.raises(
        ValueError,
        match=rf"x\.shape\[1\]: balance '{balance}' over {world} ranks needs a positive multiple of "
        rf"{multiple}; got {seq}",
    ):
        xcp.shard(x, world, 0, balance=balance)


def test_unshard_names_the_multiple_it_needs():
    # two stripe-free shards of odd length cannot be a zigzag sequence (each rank holds two equal chunks)
    parts = [torch.zeros(1, 3, 1, 1)] * 2
    with pytest.raises(ValueError, match=r"2 shards of length 3 along dim 1: .* multiple of 4; got 6"):
        xcp.unshard(parts)
    assert xcp.unshard(parts, balance="contiguous").shape == (1, 6, 1, 1)
