"""Input generators shared by the tests: random tensors, every Hypothesis strategy the tests draw from
(ring configurations, packed-document layouts, windows, sanitizer runs), and the error measure the numerical
tests use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import xcp
from xcp import schedule


def random_inputs(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random (q, k, v, dout) in ``dtype``, [B, S, H, D] (k and v with ``kv_heads`` heads).

    Drawn in float64 from a seeded generator and rounded once to ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(batch, seq, h, head_dim, generator=gen, dtype=torch.float64).to(dtype)

    return rnd(heads), rnd(kv_heads), rnd(kv_heads), rnd(heads)


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64: the worst error relative to the tensor's scale."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


@dataclass(frozen=True)
class RingCase:
    """One configuration of a ring call on tiny shapes."""

    world: int
    balance: str
    causal: bool
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    seed: int


@st.composite
def ring_cases(draw: st.DrawFn, max_world: int = 6) -> RingCase:
    """A ring configuration whose sequence every balance can split (a multiple of 2·P)."""
    world = draw(st.integers(1, max_world))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    return RingCase(
        world=world,
        balance=draw(st.sampled_from(xcp.BALANCES)),
        causal=draw(st.booleans()),
        batch=draw(st.integers(1, 2)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.integers(1, 12)),
        seq=2 * world * draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _packed(draw: st.DrawFn, worlds: tuple[int, ...], max_chunks: int, max_cuts: int) -> tuple:
    """(world, balance, causal, cu): up to ``max_cuts`` document boundaries on a sequence the balance can split."""
    world = draw(st.sampled_from(worlds))
    balance = draw(st.sampled_from(xcp.BALANCES))
    causal = draw(st.booleans())
    seq = schedule.required_multiple(world, balance) * draw(st.integers(1, max_chunks))
    cuts = draw(st.sets(st.integers(1, seq - 1), max_size=min(seq - 1, max_cuts))) if seq > 1 else set()
    return world, balance, causal, (0, *sorted(cuts), seq)


@st.composite
def layouts(draw: st.DrawFn, worlds=(1, 2, 3, 4, 8), max_chunks: int = 4) -> tuple:
    """(world, balance, causal, cu): documents of any length >= 1 on a sequence the balance can split."""
    return _packed(draw, worlds, max_chunks, 8)


@st.composite
def windowed(draw: st.DrawFn, worlds=(1, 2, 3, 4, 8), max_chunks: int = 4) -> tuple:
    """(world, balance, causal, cu, window): windows from 0 tokens to beyond S, any documents."""
    world, balance, causal, cu = _packed(draw, worlds, max_chunks, 5)
    seq = cu[-1]
    side = st.one_of(st.none(), st.integers(0, 2 * seq + 2))
    left = draw(side)
    right = draw(st.sampled_from([0, None])) if causal else draw(side)
    if left is None and (right is None or causal):
        left = draw(st.integers(0, seq))  # keep a window: the dense case is tested elsewhere
    return world, balance, causal, cu, (left, right)


@st.composite
def sanitizer_configs(draw: st.DrawFn) -> dict:
    """Keyword arguments of :func:`xcp.testing.sanitizer.sanitize_ring`: a small ring on the sim device, any
    balance, hand-off, direction and dtype."""
    world = draw(st.integers(1, 8))
    kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        world=world,
        causal=draw(st.booleans()),
        balance=draw(st.sampled_from(xcp.BALANCES)),
        handoff=draw(st.sampled_from([None, "record_stream", "clone", "event", "none"])),
        backward=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16])),
        kv_heads=kv_heads,
        heads=kv_heads * draw(st.sampled_from([1, 2])),
        seq=world * draw(st.sampled_from([2, 4])),
        head_dim=4,
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def sanitizer_document_configs(draw: st.DrawFn) -> dict:
    """:func:`sanitizer_configs` with packed documents: 1 to S of them on S = P x (2, 4 or 6) tokens."""
    cfg = draw(sanitizer_configs())
    cfg["seq"] = cfg["world"] * draw(st.sampled_from([2, 4, 6]))
    cfg["documents"] = draw(st.integers(1, cfg["seq"]))
    return cfg


def assert_close_to(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``got`` (any device, dtype) against ``ref``: same shape, no NaN, the same infinite entries, and
    finite entries within ``tol`` x max(1, max|ref|)."""
    got, ref = got.detach().cpu().to(torch.float64), ref.to(torch.float64)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], ref[inf]), f"{name}: infinite rows differ"
    if (~inf).any():
        err = (got[~inf] - ref[~inf]).abs().max().item()
        bound = tol * max(1.0, ref[~inf].abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
