"""xcp_cuda on a CPU: mask tiling, the pieces wrapper, kernel choice, GQA fallback, lse helpers, and the
glue to the aten ops through stand-ins that follow the ops' documented signatures and layouts.

The reference everywhere is xcp.kernels.math.math_forward / math_backward in float64 on the whole block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import subprocess
import sys
import types
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import xcp
from xcp.backends import fused
from xcp.backends import fused as pieces  # the mask tiling lives in the fused-kernel base
from xcp.checks import check_qkv
from xcp.kernels.math import allowed_keys, math_backward, math_forward, math_forward_range
from xcp.testing import conformance
from xcp_cuda import CUDABackend, kernels
from xcp_cuda import backend as backend_module

MASKS = ("none", "causal", "strict")
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------- helpers
def covered(tiling: pieces.Tiling) -> torch.Tensor:
    """The boolean [Sq, Sk] matrix of (query, key) pairs the tiling's pieces let through."""
    m = torch.zeros(tiling.sq, tiling.sk, dtype=torch.bool)
    for p in tiling.pieces:
        block = torch.ones(p.stop - p.start, p.keys, dtype=torch.bool)
        m[p.start : p.stop, : p.keys] = block.tril() if p.causal else block
    return m


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _block(b, sq, sk, h, hkv, d, dtype=torch.float64, seed=0):
    return (
        _rand(b, sq, h, d, dtype=dtype, seed=seed),
        _rand(b, sk, hkv, d, dtype=dtype, seed=seed + 1),
        _rand(b, sk, hkv, d, dtype=dtype, seed=seed + 2),
    )


def _merged(lse_block, seed=7):
    """A 'merged' lse as the ring passes it: >= the block's own, finite even on rows the block leaves empty."""
    extra = _rand(*lse_block.shape, seed=seed).abs().to(lse_block.dtype)
    return torch.where(lse_block == NEG_INF, extra, lse_block + torch.log1p(extra))


def _reference(q, k, v, mask, scale, dout, out, lse):
    """float64 math on the whole block: (out, lse) of the block and (dq, dk, dv) for the given merged out/lse."""
    f64 = [x.to(torch.float64) for x in (q, k, v)]
    ref_out, ref_lse = math_forward(*f64, mask, scale)
    grads = math_backward(dout.double(), *f64, out.double(), lse.double(), mask, scale)
    return ref_out, ref_lse, grads


def _close(name, got, ref, tol):
    got, ref = got.to(torch.float64), ref.to(torch.float64)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf), f"{name}: -inf rows differ"
    if inf.any():
        assert torch.equal(got[inf], ref[inf]), f"{name}: infinite entries differ"
    err = (got[~inf] - ref[~inf]).abs().max().item() if (~inf).any() else 0.0
    bound = tol * max(1.0, ref[~inf].abs().max().item() if (~inf).any() else 1.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _close_all(got, ref, tol):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        _close(name, a, b, tol)


def _bhsd_attention(q, k, v, allowed, scale):
    """Independent float64 attention in the aten layout [B, H, S, D]; GQA by head index h // groups."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    s = s.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse == NEG_INF, 0.0, lse).unsqueeze(-1))
    return torch.einsum("bhqk,bhkd->bhqd", p, v), lse


def _bhsd_grads(dout, q, k, v, out, lse, allowed, scale):
    """Independent float64 gradients from a given lse (+inf/-inf rows get zero probability)."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kr) * scale
    s = s.masked_fill(~allowed, NEG_INF)
    finite = torch.isfinite(lse)
    p = torch.where(finite.unsqueeze(-1), torch.exp(s - torch.where(finite, lse, 0.0).unsqueeze(-1)), 0.0)
    do = dout.double()
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
    ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, vr) - (do * out.double()).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, kr) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q.double()) * scale
    b, h, sk, d = dk.shape
    dv = dv.reshape(b, h // groups, groups, sk, dv.shape[-1]).sum(2)
    return dq, dk.reshape(b, h // groups, groups, sk, d).sum(2), dv


def _square_math_kernels(calls):
    """A (forward, backward) pair that refuses what fused kernels cannot do: causal on non-square blocks,
    empty blocks. Records each call's (Sq, Sk, causal)."""

    def check(q, k, causal):
        assert q.shape[1] >= 1 and k.shape[1] >= 1, "empty block reached the kernel"
        assert not causal or q.shape[1] == k.shape[1], f"non-square causal {q.shape[1]}x{k.shape[1]}"
        calls.append((q.shape[1], k.shape[1], causal))

    def fwd(q, k, v, causal, scale):
        check(q, k, causal)
        return math_forward(q, k, v, "causal" if causal else "none", scale)

    def bwd(dout, q, k, v, out, lse, causal, scale):
        check(q, k, causal)
        return math_backward(dout, q, k, v, out, lse, "causal" if causal else "none", scale)

    return fwd, bwd


# ---------------------------------------------------------------------------------------------- tiling
@pytest.mark.parametrize("mask", MASKS)
def test_tiling_covers_exactly_the_allowed_pairs(mask):
    for sq in range(0, 8):
        for sk in range(0, 8):
            t = pieces.tile(sq, sk, mask)
            expected = allowed_keys(sq, sk, mask)
            expected = torch.ones(sq, sk, dtype=torch.bool) if expected is None else expected
            assert torch.equal(covered(t), expected), (sq, sk, mask, t)
            rows = t.empty
            for p in t.pieces:  # contiguous, ordered, each causal piece square
                assert p.start == rows and p.stop > p.start and 1 <= p.keys <= sk
                assert not p.causal or p.stop - p.start == p.keys
                rows = p.stop
            assert rows == sq
            assert not expected[: t.empty].any()  # the empty rows really see nothing


def test_tiling_of_ring_blocks_is_one_call():
    assert pieces.tile(16, 16, "causal").whole and pieces.tile(16, 16, "causal").pieces[0].causal
    assert pieces.tile(16, 8, "none").whole and pieces.tile(8, 16, "none").whole
    strict = pieces.tile(16, 16, "strict")
    assert not strict.whole and strict.empty == 1
    assert strict.pieces == (pieces.Piece(1, 16, 15, True),)  # = causal on q[1:] against k[:-1]


def test_tiling_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mask: expected one of"):
        pieces.tile(4, 4, "diagonal")
    with pytest.raises(ValueError, match="sq, sk"):
        pieces.tile(-1, 4, "none")


# ---------------------------------------------------------------------------------------------- pieces wrapper
SHAPES = [(6, 6), (6, 4), (4, 6), (1, 1), (1, 5), (5, 1), (2, 2), (7, 3)]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_pieces_match_whole_block_math(mask, sq, sk, hkv):
    q, k, v = _block(2, sq, sk, 4, hkv, 8, seed=sq * 10 + sk)
    scale = 0.3
    calls = []
    fwd, bwd = _square_math_kernels(calls)
    out, lse = pieces.forward(fwd, q, k, v, mask, scale)
    dout = _rand(*out.shape, seed=3)
    merged_lse = _merged(lse)
    merged_out = _rand(*out.shape, seed=4)
    dq, dk, dv = pieces.backward(bwd, dout, q, k, v, merged_out, merged_lse, mask, scale)
    ref_out, ref_lse, (rq, rk, rv) = _reference(q, k, v, mask, scale, dout, merged_out, merged_lse)
    _close_all((out, lse, dq, dk, dv), (ref_out, ref_lse, rq, rk, rv), 1e-12)
    assert len(calls) <= 4  # at most two pieces, forward and backward


def test_pieces_never_mutate_inputs():
    q, k, v = _block(1, 5, 3, 2, 1, 4)
    dout, out = _rand(1, 5, 2, 4, seed=5), _rand(1, 5, 2, 4, seed=6)
    lse = _rand(1, 2, 5, seed=8)
    before = [x.clone() for x in (q, k, v, dout, out, lse)]
    fwd, bwd = _square_math_kernels([])
    pieces.forward(fwd, q, k, v, "strict", 0.5)
    pieces.backward(bwd, dout, q, k, v, out, lse, "strict", 0.5)
    for x, y in zip((q, k, v, dout, out, lse), before):
        assert torch.equal(x, y)


@settings(max_examples=25, deadline=None)
@given(
    sq=st.integers(1, 9),
    sk=st.integers(1, 9),
    mask=st.sampled_from(MASKS),
    groups=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_pieces_property(sq, sk, mask, groups, seed):
    q, k, v = _block(1, sq, sk, 2 * groups, 2, 4, seed=seed)
    fwd, bwd = _square_math_kernels([])
    out, lse = pieces.forward(fwd, q, k, v, mask, 0.7)
    ref_out, ref_lse = math_forward(q, k, v, mask, 0.7)
    _close("out", out, ref_out, 1e-12)
    _close("lse", lse, ref_lse, 1e-12)
    dout = _rand(*out.shape, seed=seed + 1)
    got = pieces.backward(bwd, dout, q, k, v, out, lse, mask, 0.7)
    ref = math_backward(dout, q, k, v, ref_out, ref_lse, mask, 0.7)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        _close(name, a, b, 1e-12)


def test_check_qkv_names_the_argument():
    q, k, v = _block(1, 4, 4, 4, 2, 8)
    assert check_qkv(q, k, v) == 2
    with pytest.raises(ValueError, match=r"k: expected a number of heads that divides the 4 heads of q; got 3"):
        check_qkv(q, _rand(1, 4, 3, 8), _rand(1, 4, 3, 8))
    with pytest.raises(ValueError, match=r"v: expected shape \(1, 4, 2, Dv\)"):
        check_qkv(q, k, _rand(1, 5, 2, 8))
    assert check_qkv(q, k, _rand(1, 4, 2, 16)) == 2  # values of another head dim
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        check_qkv(q[0], k, v)
    with pytest.raises(ValueError, match="k: expected head_dim 8"):
        check_qkv(q, _rand(1, 4, 2, 4), _rand(1, 4, 2, 4))


# ---------------------------------------------------------------------------------------------- GQA fallback
def test_sum_kv_groups_is_the_adjoint_of_repeat_kv():
    x = _rand(2, 5, 3, 4, seed=1)
    y = _rand(2, 5, 6, 4, seed=2)
    lhs = (fused.repeat_kv(x, 2) * y).sum()
    rhs = (x * fused.sum_kv_groups(y, 2)).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-12, atol=0)
    assert torch.equal(fused.repeat_kv(x, 2)[:, :, 2], x[:, :, 1])  # head h reads K/V head h // groups
    assert fused.repeat_kv(x, 1) is x and fused.sum_kv_groups(x, 1) is x


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_kv_wrappers_match_native_gqa(causal):
    q, k, v = _block(2, 6, 6, 6, 2, 4, seed=11)
    calls = []
    fwd, bwd = _square_math_kernels(calls)

    def no_gqa_fwd(q, k, v, c, s):
        assert q.shape[2] == k.shape[2], "K/V were not repeated"
        return fwd(q, k, v, c, s)

    def no_gqa_bwd(dout, q, k, v, out, lse, c, s):
        assert q.shape[2] == k.shape[2], "K/V were not repeated"
        return bwd(dout, q, k, v, out, lse, c, s)

    mask = "causal" if causal else "none"
    out, lse = kernels.with_repeated_kv(no_gqa_fwd)(q, k, v, causal, 0.5)
    ref_out, ref_lse = math_forward(q, k, v, mask, 0.5)
    _close("out", out, ref_out, 1e-12)
    _close("lse", lse, ref_lse, 1e-12)
    dout = _rand(*out.shape, seed=12)
    got = kernels.with_repeated_kv_backward(no_gqa_bwd)(dout, q, k, v, out, lse, causal, 0.5)
    ref = math_backward(dout, q, k, v, out, lse, mask, 0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape
        _close(name, a, b, 1e-12)


# ---------------------------------------------------------------------------------------------- kernel choice, lse
@pytest.mark.parametrize(
    "dtype,head_dim,capability,expected",
    [
        (torch.bfloat16, 128, (9, 0), "flash"),
        (torch.float16, 256, (8, 0), "flash"),
        (torch.bfloat16, 264, (9, 0), "efficient"),  # too wide for flash, aligned for efficient
        (torch.float16, 128, (7, 5), "efficient"),  # pre-Ampere: no flash
        (torch.bfloat16, 20, (9, 0), "math"),  # not a multiple of 8
        (torch.float32, 128, (9, 0), "efficient"),
        (torch.float32, 20, (9, 0), "efficient"),
        (torch.float32, 6, (9, 0), "math"),
        (torch.float64, 64, (9, 0), "math"),
    ],
)
def test_choose_kernel(dtype, head_dim, capability, expected):
    assert kernels.choose_kernel(dtype, head_dim, capability) == expected


def test_lse_helpers():
    lse = torch.tensor([[[1.0, NEG_INF, -2.0]]])
    back = kernels.lse_for_backward(lse.double())
    assert back.dtype == torch.float32 and back.is_contiguous()
    assert back.tolist() == [[[1.0, math.inf, -2.0]]]
    padded = kernels.pad_lse(torch.zeros(2, 3, 33))
    assert padded.shape == (2, 3, 64) and torch.isinf(padded[..., 33:]).all() and (padded[..., :33] == 0).all()
    same = torch.zeros(1, 1, 64)
    assert kernels.pad_lse(same) is same
    view = kernels.heads_second(_rand(2, 5, 3, 4)[:, 1:4])
    assert view.shape == (2, 3, 3, 4) and view.transpose(1, 2).is_contiguous()


# ---------------------------------------------------------------------------------------------- glue with stand-in ops
class FakeAten:
    """Stand-ins for the four aten ops with their schemas, layouts and limits as documented in
    xcp_cuda.kernels: [B, H, S, D] views with unit last stride; flash takes GQA and aligns a non-square
    causal mask bottom-right (as flash-attn >= 2.1 does); efficient needs equal heads, pads its lse to a
    multiple of 32 (filled with NaN here, so an unsliced pad shows) and wants it padded back. Every
    computation is float64, rounded to the input dtype like a kernel's output."""

    def __init__(self):
        self.calls = []
        self.lengths = []  # (cum_seq_q, cum_seq_k, seqused_k, max_q, max_k) of each varlen call with seqused_k

    @staticmethod
    def _layout(*xs):
        for x in xs:
            assert x.dim() == 4 and x.stride(-1) == 1, "aten attention ops take [B, H, S, D] with unit last stride"

    @staticmethod
    def _one_head_dim(q, k, v):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "q, k, v must have the same last dimension (flash)"

    @staticmethod
    def _flash_window(left, right, max_k):
        """What flash makes of a window: a side >= max_seqlen_k becomes unbounded, and an unbounded side
        facing a bounded one becomes max_seqlen_k (from the bottom-right corner, as the window)."""
        if left is None and right is None:
            return None, None
        left = -1 if left is None or left >= max_k else left
        right = -1 if right is None or right >= max_k else right
        if left < 0 and right >= 0:
            left = max_k
        if left >= 0 and right < 0:
            right = max_k
        return left, right

    @staticmethod
    def _mask(sq, sk, causal, bottom_right, device=None, window=(None, None)):
        m = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            m = m.tril(sk - sq if bottom_right else 0)
        left, right = window  # flash's window: sizes from the bottom-right corner, None (or -1) unbounded
        if left is not None and left >= 0:
            m &= torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq - left)
        if right is not None and right >= 0:
            m &= torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq + right)
        return m

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        self._layout(q, k, v)
        self._one_head_dim(q, k, v)
        assert q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0 and not return_debug_mask
        assert q.shape[1] % k.shape[1] == 0
        self.calls.append(("flash_fwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        out, lse = _bhsd_attention(q, k, v, self._mask(q.shape[2], k.shape[2], is_causal, True), scale)
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # BSHD storage, as the op
        lse = torch.where(lse == NEG_INF, math.inf, lse).float()  # flash-attn writes +inf on empty rows
        return out, lse, None, None, q.shape[2], k.shape[2], torch.zeros(2), torch.zeros(()), torch.empty(0)

    def _scaled_dot_product_flash_attention_backward(
        self, dout, q, k, v, out, lse, cq, ck, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale
    ):
        self._layout(dout, q, k, v, out)
        self._one_head_dim(q, k, v)
        assert cq is None and ck is None and (max_q, max_k) == (q.shape[2], k.shape[2]) and dropout_p == 0.0
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()
        assert out.dtype == q.dtype and dout.dtype == q.dtype
        self.calls.append(("flash_bwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        m = self._mask(q.shape[2], k.shape[2], is_causal, True)
        dq, dk, dv = _bhsd_grads(dout, q, k, v, out, lse.double(), m, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
        self._layout(q, k, v)
        assert bias is None and compute_lse and dropout_p == 0.0
        assert q.shape[1] == k.shape[1], "memory-efficient attention needs as many K/V heads as query heads"
        self.calls.append(("efficient_fwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        out, lse = _bhsd_attention(q, k, v, self._mask(q.shape[2], k.shape[2], is_causal, False), scale)
        padded = torch.full((*lse.shape[:2], math.ceil(q.shape[2] / 32) * 32), math.nan)
        padded[..., : q.shape[2]] = lse
        return out.to(q.dtype), padded.float(), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def _scaled_dot_product_efficient_attention_backward(
        self, dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, *, scale
    ):
        self._layout(dout, q, k, v, out)
        assert bias is None and dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
        assert q.shape[1] == k.shape[1], "memory-efficient attention needs as many K/V heads as query heads"
        assert lse.shape[-1] == math.ceil(q.shape[2] / 32) * 32, "lse not padded as the forward returns it"
        self.calls.append(("efficient_bwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        m = self._mask(q.shape[2], k.shape[2], is_causal, False)
        dq, dk, dv = _bhsd_grads(dout, q, k, v, out, lse[..., : q.shape[2]].double(), m, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    # The cuDNN ops: [B, H, S, D] views, GQA native, a non-square causal mask aligned top-left (the ring
    # never asks for one), lse float32 [B, H, Sq, 1] and int64 seed/offset scalars.
    def _scaled_dot_product_cudnn_attention(
        self, q, k, v, bias, compute_lse, dropout_p, is_causal, return_debug_mask, *, scale
    ):  # fmt: skip
        self._layout(q, k, v)
        assert q.dtype in (torch.float16, torch.bfloat16) and bias is None and compute_lse and dropout_p == 0.0
        assert q.shape[1] % k.shape[1] == 0 and not return_debug_mask
        self.calls.append(("cudnn_fwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        out, lse = _bhsd_attention(q, k, v, self._mask(q.shape[2], k.shape[2], is_causal, False), scale)
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # laid out like query
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return out, lse.float().unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None

    def _scaled_dot_product_cudnn_attention_backward(
        self, dout, q, k, v, out, lse, seed, offset, bias, cq, ck, max_q, max_k, dropout_p, is_causal, *, scale
    ):  # fmt: skip
        self._layout(dout, q, k, v, out)
        assert bias is None and cq is None and ck is None and dropout_p == 0.0
        assert (max_q, max_k) == (q.shape[2], k.shape[2]) and seed.dtype == offset.dtype == torch.int64
        assert lse.dtype == torch.float32 and lse.shape == (*q.shape[:3], 1), f"lse shape {tuple(lse.shape)}"
        assert out.dtype == q.dtype and dout.dtype == q.dtype
        self.calls.append(("cudnn_bwd", q.shape[2], k.shape[2], k.shape[1], is_causal))
        m = self._mask(q.shape[2], k.shape[2], is_causal, False)
        dq, dk, dv = _bhsd_grads(dout, q, k, v, out, lse[..., 0].double(), m, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # The varlen flash ops: packed [total, H, D], int32 cumulative lengths, each segment attended on its
    # own (causal bottom-right per segment, +inf lse on rows without keys), lse float32 [H, total_q]. With
    # seqused_k (int32 [B]) the forward reads cum_seq_k for the starts of the key segments alone.
    @staticmethod
    def _packed(*xs):
        for x in xs:
            assert x.dim() == 3 and x.is_contiguous(), "the varlen flash ops take contiguous [total, H, D]"

    @staticmethod
    def _segments(q, k, cq, ck, max_q, max_k, used=None):
        tiled = (("q", cq, q.shape[0], max_q), ("k", ck, k.shape[0], max_k))
        for name, c, total, longest in tiled if used is None else tiled[:1]:
            assert c.dtype == torch.int32 and c.dim() == 1 and c.device == q.device, f"cum_seq_{name}: int32 1-D"
            bounds = c.tolist()
            assert bounds[0] == 0 and bounds[-1] == total, f"cum_seq_{name} {bounds} does not tile {total} rows"
            true_longest = max(b - a for a, b in zip(bounds, bounds[1:]))
            assert longest == true_longest or (name == "k" and longest > true_longest), f"max_{name}: {longest}"
        assert cq.shape == ck.shape, "as many query segments as key segments"
        qb, kb = cq.tolist(), ck.tolist()
        if used is None:
            return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(qb, qb[1:], kb, kb[1:])]
        assert ck.dtype == torch.int32 and ck.dim() == 1 and ck.device == q.device, "cum_seq_k: int32 1-D"
        assert used.dtype == torch.int32 and used.shape == (len(qb) - 1,) and used.device == q.device
        assert used.is_contiguous(), "seqused_k must be contiguous"
        lengths = used.tolist()
        assert all(0 <= c and 0 <= n <= max_k and c + n <= k.shape[0] for c, n in zip(kb, lengths)), (kb, lengths)
        return [(slice(a, b), slice(c, c + n)) for a, b, c, n in zip(qb, qb[1:], kb, lengths)]

    def _paged_forward(self, q, k, v, cq, max_q, max_k, is_causal, scale, seqused_k, block_table):
        """The paged form, as torch's ``mha_varlen_fwd`` checks it: pools [N, block_size, Hkv, D] with blocks of a
        multiple of 256 rows and v shaped like k, an int32 table [B, max_blocks] with a contiguous last dim,
        seqused_k int32 [B]; with max_q == 1 under GQA it reads q as one query per segment (its reshape needs
        T == B). Segment i's keys are its first seqused_k[i] rows through the table; rows without keys +inf."""
        assert q.dim() == 3 and q.is_contiguous() and k.dim() == 4 and k.shape == v.shape, "paged pools [N, bs, H, D]"
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[-1] == q.shape[-1]
        assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.stride(-1) == 1
        assert seqused_k is not None and seqused_k.dtype == torch.int32 and seqused_k.is_contiguous()
        b, bs = block_table.shape[0], k.shape[1]
        assert cq.shape == (b + 1,) and seqused_k.shape == (b,)
        if max_q == 1 and q.shape[1] > k.shape[2]:
            assert q.shape[0] == b, "flash's one-query GQA path reshapes q to [B, Hkv, groups, D]"
        qb, used, table = cq.tolist(), seqused_k.tolist(), block_table.tolist()
        assert all(0 <= n <= max_k for n in used) and all(b1 - a <= max_q for a, b1 in zip(qb, qb[1:]))
        self.calls.append(("flash_paged_fwd", q.shape[0], bs, k.shape[2], is_causal, b))
        out = torch.empty(q.shape, dtype=q.dtype)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for a, b1, n, row in zip(qb, qb[1:], used, table):
            rows = [row[j // bs] * bs + j % bs for j in range(n)]
            keys = [x.flatten(0, 1)[rows].transpose(0, 1).unsqueeze(0) for x in (k, v)]
            seg_q = q[a:b1].transpose(0, 1).unsqueeze(0)
            o, seg_lse = _bhsd_attention(seg_q, *keys, self._mask(b1 - a, n, is_causal, True), scale)
            out[a:b1] = torch.where(seg_lse[0].transpose(0, 1).unsqueeze(-1) == NEG_INF, math.nan,
                                    o[0].transpose(0, 1)).to(q.dtype)  # fmt: skip
            lse[:, a:b1] = torch.where(seg_lse[0] == NEG_INF, math.inf, seg_lse[0]).float()
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0)

    def _flash_attention_forward(
        self, q, k, v, cq, ck, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
        window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
        num_splits=None,
    ):  # fmt: skip
        if block_table is not None:
            assert dropout_p == 0.0 and not return_debug_mask and window_size_left is None and alibi_slopes is None
            assert ck.dtype == torch.int32 and ck.shape == cq.shape
            return self._paged_forward(q, k, v, cq, max_q, max_k, is_causal, scale, seqused_k, block_table)
        self._packed(q, k, v)
        self._one_head_dim(q, k, v)
        assert q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0 and not return_debug_mask
        assert q.shape[1] % k.shape[1] == 0
        window = self._flash_window(window_size_left, window_size_right, max_k)
        segs = self._segments(q, k, cq, ck, max_q, max_k, seqused_k)
        if seqused_k is not None:
            self.lengths.append((cq.tolist(), ck.tolist(), seqused_k.tolist(), max_q, max_k))
        self.calls.append(("flash_varlen_fwd", q.shape[0], k.shape[0], k.shape[1], is_causal, len(segs)))
        out = torch.empty(q.shape, dtype=q.dtype)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for qs, ks in segs:
            seg = [x[s].transpose(0, 1).unsqueeze(0) for x, s in ((q, qs), (k, ks), (v, ks))]  # [1, H, S, D]
            mask = self._mask(seg[0].shape[2], seg[1].shape[2], is_causal, True, window=window)
            o, seg_lse = _bhsd_attention(*seg, mask, scale)
            out[qs] = o[0].transpose(0, 1).to(q.dtype)
            lse[:, qs] = torch.where(seg_lse[0] == NEG_INF, math.inf, seg_lse[0]).float()
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0)

    def _flash_attention_backward(
        self, dout, q, k, v, out, lse, cq, ck, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
        scale=None, window_size_left=None, window_size_right=None,
    ):  # fmt: skip
        self._packed(dout, q, k, v, out)
        self._one_head_dim(q, k, v)
        assert dropout_p == 0.0
        window = self._flash_window(window_size_left, window_size_right, max_k)
        assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,) and unused.dtype == torch.uint64
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        assert out.dtype == q.dtype and dout.dtype == q.dtype
        segs = self._segments(q, k, cq, ck, max_q, max_k)
        self.calls.append(("flash_varlen_bwd", q.shape[0], k.shape[0], k.shape[1], is_causal, len(segs)))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qs, ks in segs:
            seg = [x[s].transpose(0, 1).unsqueeze(0) for x, s in ((dout, qs), (q, qs), (k, ks), (v, ks), (out, qs))]
            m = self._mask(seg[1].shape[2], seg[2].shape[2], is_causal, True, window=window)
            g = _bhsd_grads(*seg, lse[:, qs].unsqueeze(0).double(), m, scale)
            for acc, x, s in zip((dq, dk, dv), g, (qs, ks, ks)):
                acc[s] = x[0].transpose(0, 1).to(acc.dtype)
        return dq, dk, dv


def _cpu_backend(monkeypatch, **kwargs):
    fake = FakeAten()
    monkeypatch.setattr(kernels, "ATEN", fake)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it raises ImportError
    kwargs.setdefault("fused_merge", False)  # the Triton merge takes CUDA tensors only (a GPU machine has triton)
    kwargs.setdefault("triton_decode", "off")  # so does the Triton paged decode (tests/test_paged_triton.py: its own)
    backend = CUDABackend(**kwargs)
    backend.device_type = "cpu"  # run the glue on CPU tensors
    monkeypatch.setattr(backend, "_capability", lambda device: (9, 0))
    return backend, fake


# dtype -> (head_dim, expected kernel, tolerance). fp16 outputs are rounded once (eps 2^-11, values O(1):
# 4e-3 leaves room for the rounded inputs of the backward); fp32 rounding is ~1e-7; float64 is exact math.
GLUE_CASES = {
    torch.float16: (16, "flash", 4e-3),
    torch.float32: (12, "efficient", 1e-5),
    torch.float64: (6, "math", 1e-12),
}


@pytest.mark.parametrize("dtype", list(GLUE_CASES))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(6, 6), (7, 4), (4, 7)])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
def test_backend_glue_against_math(monkeypatch, dtype, mask, sq, sk, gqa):
    head_dim, kind, tol = GLUE_CASES[dtype]
    backend, fake = _cpu_backend(monkeypatch, gqa=gqa)
    q, k, v = _block(2, sq, sk, 4, 2, head_dim, dtype=dtype, seed=sq + 3 * sk)
    assert backend.kernel_for(q) == kind
    scale = 1 / math.sqrt(head_dim)
    out, lse = backend.forward(q, k, v, mask, scale)
    dout = _rand(*out.shape, dtype=dtype, seed=9)
    merged_out = _rand(*out.shape, dtype=dtype, seed=10)
    merged_lse = _merged(lse.double()).float() if dtype != torch.float64 else _merged(lse)
    dq, dk, dv = backend.backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    ref_out, ref_lse, (rq, rk, rv) = _reference(q, k, v, mask, scale, dout, merged_out, merged_lse)
    assert out.dtype in (dtype, torch.float32, torch.float64) and lse.dtype in (torch.float32, torch.float64)
    _close_all((out, lse, dq, dk, dv), (ref_out, ref_lse, rq, rk, rv), tol)
    if kind == "math":
        assert fake.calls == []
    else:
        assert fake.calls and all(c[0].startswith(kind) for c in fake.calls)
        assert all(sq_ == sk_ for _, sq_, sk_, _, causal in fake.calls if causal)  # only square causal calls
        kv_heads = {c[3] for c in fake.calls}
        assert kv_heads == ({2} if kind == "flash" and gqa == "native" else {4})


# ---------------------------------------------------------------------------------------------- cuDNN
def _sdpa_choice(answer, asked):
    """A stand-in for torch._fused_sdp_choice that answers ``answer`` and records each question."""
    from torch.nn.attention import SDPBackend

    def choice(q, k, v, mask, dropout_p, causal, *, scale=None, enable_gqa=False):
        assert q.dim() == 4 and mask is None and dropout_p == 0.0 and scale is None
        asked.append((tuple(q.shape), tuple(k.shape), causal, enable_gqa, q.requires_grad))
        if isinstance(answer, Exception):
            raise answer
        return int(getattr(SDPBackend, answer))

    return choice


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(6, 6), (7, 4), (4, 7)])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cudnn_serves_blocks_where_sdpa_picks_it(monkeypatch, mask, sq, sk, gqa, dtype):
    """Where SDPA would run a block on cuDNN, the cuDNN op serves its forward and its backward from a
    merged out/lse, GQA native, only ever square when causal; results equal float64 math."""
    backend, fake = _cpu_backend(monkeypatch, gqa=gqa)
    asked = []
    monkeypatch.setattr(kernels, "SDPA_CHOICE", _sdpa_choice("CUDNN_ATTENTION", asked))
    q, k, v = _block(2, sq, sk, 4, 2, 16, dtype=dtype, seed=sq + 5 * sk)
    scale = 0.25
    out, lse = backend.forward(q, k, v, mask, scale)
    assert lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    dout = _rand(*out.shape, dtype=dtype, seed=9)
    merged_out = _rand(*out.shape, dtype=dtype, seed=10)
    merged_lse = _merged(lse.double()).float()
    dq, dk, dv = backend.backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    ref_out, ref_lse, (rq, rk, rv) = _reference(q, k, v, mask, scale, dout, merged_out, merged_lse)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    _close_all((out, lse, dq, dk, dv), (ref_out, ref_lse, rq, rk, rv), tol)
    assert fake.calls and all(c[0].startswith("cudnn") for c in fake.calls)
    assert all(a == b for _, a, b, _, causal in fake.calls if causal)
    assert {c[3] for c in fake.calls} == ({2} if gqa == "native" else {4})
    assert all(grad for *_, grad in asked) and all(gqa_ for *_, gqa_, _ in asked)


def test_the_kernel_choice_is_asked_once_per_block_signature_and_can_be_turned_off(monkeypatch):
    backend, fake = _cpu_backend(monkeypatch)
    asked = []
    monkeypatch.setattr(kernels, "SDPA_CHOICE", _sdpa_choice("CUDNN_ATTENTION", asked))
    q, k, v = _block(1, 8, 8, 4, 4, 16, dtype=torch.bfloat16)
    for _ in range(3):
        backend.forward(q, k, v, "causal", 0.3)
        backend.forward(q, k, v, "none", 0.3)
    assert len(asked) == 2 and [c[0] for c in fake.calls] == ["cudnn_fwd"] * 6
    assert asked[0][3] is False  # MHA: no GQA asked for
    fake.calls.clear()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):  # cuDNN not allowed
        backend.forward(q, k, v, "causal", 0.3)
    assert fake.calls[-1][0] == "flash_fwd"
    off, fake_off = _cpu_backend(monkeypatch, use_cudnn=False)
    off.forward(q, k, v, "causal", 0.3)
    assert fake_off.calls[0][0] == "flash_fwd"
    monkeypatch.setenv("XCP_CUDA_CUDNN", "0")
    assert CUDABackend().use_cudnn is False


@pytest.mark.parametrize("answer", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", RuntimeError("no kernel")])
def test_flash_serves_where_sdpa_would_not_use_cudnn(monkeypatch, answer):
    """Any other answer of SDPA's dispatcher, or a dispatcher that raises, leaves the block on flash."""
    backend, fake = _cpu_backend(monkeypatch)
    asked = []
    monkeypatch.setattr(kernels, "SDPA_CHOICE", _sdpa_choice(answer, asked))
    q, k, v = _block(1, 6, 6, 4, 2, 16, dtype=torch.float16)
    out, _ = backend.forward(q, k, v, "causal", 0.3)
    assert asked and [c[0] for c in fake.calls] == ["flash_fwd"]
    _close("out", out, math_forward(q.double(), k.double(), v.double(), "causal", 0.3)[0], 4e-3)
    monkeypatch.setattr(kernels, "SDPA_CHOICE", None)  # a torch without the dispatcher
    assert kernels.sdpa_picks_cudnn(q, k, True) is False


# ---------------------------------------------------------------------------------------------- varlen
VARLEN_LAYOUTS = {  # name: (cu_q, cu_k, causal); segments of length 1 next to longer ones
    "causal": ((0, 1, 6, 7, 12), (0, 1, 6, 7, 12), True),
    "full": ((0, 1, 6, 9), (0, 4, 5, 12), False),
    "one-segment": ((0, 7), (0, 7), True),
}

# Outputs rounded once to the input dtype (everything else is float64 in the stand-in): half an ulp,
# 2^-11 (fp16) and 2^-8 (bf16) relative to values of at most max|ref|; twice that for room.
VARLEN_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _strided(x):
    """The same values as a non-contiguous [B, S, H, D] view (heads-first storage)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _block_diagonal(cu_q, cu_k, causal):
    """Boolean [Tq, Tk]: segment i's queries see segment i's keys (square causal when ``causal``)."""
    m = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        block = torch.ones(b - a, d - c, dtype=torch.bool)
        m[a:b, c:d] = block.tril() if causal else block
    return m


def _varlen_reference(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    """float64 attention over the whole packed block under its block-diagonal mask: (out, lse) and the
    gradients from the given merged out/lse, in xcp's layout."""
    bhsd = [x.transpose(1, 2) for x in (q, k, v)]
    allowed = _block_diagonal(cu_q, cu_k, causal)
    ref_out, ref_lse = _bhsd_attention(*bhsd, allowed, scale)
    grads = _bhsd_grads(dout.transpose(1, 2), *bhsd, out.transpose(1, 2), lse.double(), allowed, scale)
    return (ref_out.transpose(1, 2), ref_lse, *(g.transpose(1, 2) for g in grads))


def _varlen_block(cu_q, cu_k, h, hkv, d, dtype, seed):
    q, k, v = _block(1, cu_q[-1], cu_k[-1], h, hkv, d, dtype=dtype, seed=seed)
    return _strided(q), _strided(k), v


@pytest.mark.parametrize("dtype", list(VARLEN_TOL))
@pytest.mark.parametrize("layout", list(VARLEN_LAYOUTS))
@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
def test_varlen_flash_against_float64(monkeypatch, dtype, layout, hkv, gqa):
    """One flash varlen call forward and one backward (from a merged out/lse) for all segments."""
    cu_q, cu_k, causal = VARLEN_LAYOUTS[layout]
    backend, fake = _cpu_backend(monkeypatch, gqa=gqa)
    q, k, v = _varlen_block(cu_q, cu_k, 4, hkv, 16, dtype, seed=len(cu_q) + hkv)
    scale = 0.3
    assert backend.varlen_kernel(q, cu_q, cu_k)
    before = [x.clone() for x in (q, k, v)]
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, 4, cu_q[-1]) and lse.dtype == torch.float32
    dout = _rand(*out.shape, dtype=dtype, seed=9)
    merged_out = _rand(*out.shape, dtype=dtype, seed=10)
    merged_lse = torch.cat([_merged(lse.double()).float(), lse], dim=2)[:, :, : cu_q[-1]]  # strided, as the ring's
    dq, dk, dv = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    ref = _varlen_reference(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    _close_all((out, lse, dq, dk, dv), ref, VARLEN_TOL[dtype])
    for x, y in zip((q, k, v), before):
        assert torch.equal(x, y)
    kv_heads = hkv if gqa == "native" else 4
    segments = len(cu_q) - 1
    assert fake.calls == [
        ("flash_varlen_fwd", cu_q[-1], cu_k[-1], kv_heads, causal, segments),
        ("flash_varlen_bwd", cu_q[-1], cu_k[-1], kv_heads, causal, segments),
    ]


# The per-segment loop through the dense stand-ins: outputs rounded once, dK/dV of a GQA group summed from
# rounded terms where K/V are repeated (efficient): up to four half-ulps of the dtype; float64 is exact.
FALLBACK_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize(
    "dtype,head_dim,capability,kind",
    [
        (torch.float64, 16, (9, 0), "math"),
        (torch.bfloat16, 20, (9, 0), "math"),  # head_dim not a multiple of 8
        (torch.float32, 16, (9, 0), "efficient"),
        (torch.float16, 16, (7, 5), "efficient"),  # pre-Ampere: no flash
        (torch.bfloat16, 264, (9, 0), "efficient"),  # too wide for flash
    ],
)
@pytest.mark.parametrize("layout", ["causal", "full"])
def test_varlen_falls_back_to_one_call_per_segment(monkeypatch, dtype, head_dim, capability, kind, layout):
    """Where flash does not serve the block the base class's loop runs: one dense call per segment."""
    cu_q, cu_k, causal = VARLEN_LAYOUTS[layout]
    backend, fake = _cpu_backend(monkeypatch)
    monkeypatch.setattr(backend, "_capability", lambda device: capability)
    q, k, v = _varlen_block(cu_q, cu_k, 4, 2, head_dim, dtype, seed=5)
    assert not backend.varlen_kernel(q, cu_q, cu_k) and backend.kernel_for(q) == kind
    scale = 1 / math.sqrt(head_dim)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    dout, merged_out = _rand(*out.shape, dtype=dtype, seed=3), _rand(*out.shape, dtype=dtype, seed=4)
    merged_lse = _merged(lse.double()).to(lse.dtype)
    grads = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    base_fwd = xcp.Backend.forward_varlen(backend, q, k, v, cu_q, cu_k, causal, scale)
    base_bwd = xcp.Backend.backward_varlen(backend, dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    for got, want in zip((out, lse, *grads), (*base_fwd, *base_bwd)):
        assert torch.equal(got, want)
    ref = _varlen_reference(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    _close_all((out, lse, *grads), ref, FALLBACK_TOL[dtype])
    assert not any(c[0].startswith("flash_varlen") for c in fake.calls)
    if kind == "efficient":  # forward and backward, once per segment each, twice (ours and the base's)
        assert len(fake.calls) == 4 * (len(cu_q) - 1)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_serves_filler_segments_in_one_flash_call(monkeypatch, causal):
    """Filler segments (no keys: rows out 0, lse -inf, dq 0; no queries: keys dK = dV = 0) go to one flash
    varlen call, flash's +inf lse of rows without keys turned into -inf; against the per-segment loop. A
    segment with neither is not served."""
    assert kernels.varlen_served((0, 2, 5), (0, 1, 4)) and kernels.varlen_served((0, 2, 5), (0, 0, 4))
    assert kernels.varlen_served((0, 0, 5), (0, 1, 4)) and not kernels.varlen_served((0, 0, 5), (0, 0, 4))
    backend, fake = _cpu_backend(monkeypatch)
    cu_q, cu_k = ((0, 3, 3, 5, 7), (0, 0, 2, 4, 6)) if causal else ((0, 2, 2, 5, 6), (0, 0, 3, 5, 9))
    q, k, v = _varlen_block(cu_q, cu_k, 2, 2, 16, torch.float16, seed=1)
    assert backend.varlen_fillers and backend.varlen_kernel(q, cu_q, cu_k)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, 0.25)
    dout = _rand(*out.shape, dtype=torch.float16, seed=2)
    grads = backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, 0.25)
    assert [c[0] for c in fake.calls] == ["flash_varlen_fwd", "flash_varlen_bwd"]
    rows = slice(cu_q[0], cu_q[1])  # the first segment has no keys
    assert (out[:, rows] == 0).all() and torch.isneginf(lse[:, :, rows]).all() and (grads[0][:, rows] == 0).all()
    base = xcp.Backend
    want_fwd = base.forward_varlen(backend, q, k, v, cu_q, cu_k, causal, 0.25)
    want_bwd = base.backward_varlen(backend, dout, q, k, v, out, lse, cu_q, cu_k, causal, 0.25)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*want_fwd, *want_bwd)):
        _close(name, got, want, 4e-3)


@pytest.mark.parametrize(("layout", "window"), [("causal", None), ("full", None), ("full", (2, 1))])
def test_varlen_folds_a_batch_into_one_packed_call(monkeypatch, layout, window):
    """B > 1 rows go as one packed block of B times the segments (a KV cache's chunk of a batch): one flash
    call forward and one backward, equal to the base class's per-segment loop on each row (which runs the
    math kernel under a window)."""
    cu_q, cu_k, causal = VARLEN_LAYOUTS[layout]
    backend, fake = _cpu_backend(monkeypatch)
    rows = [_varlen_block(cu_q, cu_k, 4, 2, 16, torch.float16, seed=s) for s in (1, 2, 3)]
    q, k, v = (torch.cat([r[i] for r in rows]) for i in range(3))
    assert backend.varlen_kernel(q, cu_q, cu_k)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, 0.3, window=window)
    dout, merged_out = _rand(*out.shape, dtype=q.dtype, seed=3), _rand(*out.shape, dtype=q.dtype, seed=4)
    merged_lse = _merged(lse.double()).to(lse.dtype)
    grads = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, 0.3, window=window)
    assert [c[:3] for c in fake.calls] == [
        ("flash_varlen_fwd", 3 * cu_q[-1], 3 * cu_k[-1]),
        ("flash_varlen_bwd", 3 * cu_q[-1], 3 * cu_k[-1]),
    ]
    for i in range(3):
        one = (q[i : i + 1], k[i : i + 1], v[i : i + 1])
        want = xcp.Backend.forward_varlen(backend, *one, cu_q, cu_k, causal, 0.3, window=window)
        merged = merged_out[i : i + 1], merged_lse[i : i + 1]
        want_grads = xcp.Backend.backward_varlen(backend, dout[i : i + 1], *one, *merged, cu_q, cu_k, causal, 0.3,
                                                 window=window)  # fmt: skip
        got = (out[i : i + 1], lse[i : i + 1], *(g[i : i + 1] for g in grads))
        _close_all(got, (*want, *want_grads), VARLEN_TOL[torch.float16])


def test_varlen_blocks_the_flash_path_does_not_serve_go_to_the_base_class(monkeypatch):
    """Packed segments the flash varlen op does not serve (here fp32) run the base class's method with the
    contract's arguments, the window included; those it serves never reach the base class."""
    seen = []

    def base_forward(self, q, k, v, cu_q, cu_k, causal, scale, window=None):
        seen.append(("forward", window))
        return torch.zeros_like(q), torch.zeros(1, q.shape[2], q.shape[1])

    def base_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=None):
        seen.append(("backward", window))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(xcp.Backend, "forward_varlen", base_forward)
    monkeypatch.setattr(xcp.Backend, "backward_varlen", base_backward)
    backend, fake = _cpu_backend(monkeypatch)
    cu_q, cu_k, _ = VARLEN_LAYOUTS["full"]
    q, k, v = _varlen_block(cu_q, cu_k, 2, 2, 16, torch.float32, seed=4)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, False, 0.3, window=(1, 10))
    backend.backward_varlen(out, q, k, v, out, lse, cu_q, cu_k, False, 0.3, window=(1, 10))
    assert seen == [("forward", (1, 10)), ("backward", (1, 10))] and fake.calls == []
    q, k, v = _varlen_block(cu_q, cu_k, 2, 2, 16, torch.float16, seed=4)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, False, 0.3, window=(1, 10))
    backend.backward_varlen(out, q, k, v, out, lse, cu_q, cu_k, False, 0.3, window=(1, 10))
    assert len(seen) == 2 and [c[0] for c in fake.calls] == ["flash_varlen_fwd", "flash_varlen_bwd"]


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "window"),
    [
        (*VARLEN_LAYOUTS["full"][:2], (0, 0)),
        (*VARLEN_LAYOUTS["full"][:2], (2, 1)),
        (*VARLEN_LAYOUTS["full"][:2], (1, 5)),
        (*VARLEN_LAYOUTS["full"][:2], (40, 0)),
        ((0, 30), (0, 9), (0, 30)),  # more queries than keys, a right side past the last key (the H200 case)
        ((0, 30, 34), (0, 9, 20), (3, 25)),
        ((0, 30, 34), (0, 9, 20), (10, 0)),  # the left side reaches every key: flash's causal form
        ((0, 30), (0, 9), (8, 0)),  # ... with more queries than keys: rows that see nothing
    ],
)
def test_a_window_takes_the_flash_window_and_matches_the_banded_math_kernel(monkeypatch, cu_q, cu_k, window):
    """Flash aligns its window to each segment's bottom-right corner, as xcp's bands are: the op's
    window_size_left/right give what the math kernel gives with the band as a mask, also where flash
    would turn a side past max_seqlen_k into max_seqlen_k (the stand-in models that). A band (left, 0)
    whose left side reaches every segment's first key goes as flash's causal call, without a window."""
    backend, fake = _cpu_backend(monkeypatch)
    q, k, v = _varlen_block(cu_q, cu_k, 4, 2, 16, torch.bfloat16, seed=6)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, False, 0.25, window=window)
    dout = _rand(*out.shape, dtype=q.dtype, seed=7)
    grads = backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, False, 0.25, window=window)
    assert [c[0] for c in fake.calls] == ["flash_varlen_fwd", "flash_varlen_bwd"]
    longest = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    assert [c[4] for c in fake.calls] == [window[1] == 0 and window[0] >= longest - 1] * 2  # is_causal
    base = xcp.Backend
    want_fwd = base.forward_varlen(backend, q, k, v, cu_q, cu_k, False, 0.25, window=window)
    want_bwd = base.backward_varlen(backend, dout, q, k, v, out, lse, cu_q, cu_k, False, 0.25, window=window)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*want_fwd, *want_bwd)):
        assert torch.allclose(got.double(), want.double(), atol=2e-2, rtol=2e-2), name


def test_cu_seqlens_are_uploaded_once_and_evicted_oldest_first(monkeypatch):
    monkeypatch.setattr(kernels, "CU_CACHE_SIZE", 2)
    monkeypatch.setattr(kernels, "_CU_CACHE", OrderedDict())
    cpu = torch.device("cpu")
    a = kernels.cu_seqlens((0, 3, 5), cpu)
    assert a.dtype == torch.int32 and a.tolist() == [0, 3, 5]
    assert kernels.cu_seqlens((0, 3, 5), cpu) is a
    b = kernels.cu_seqlens((0, 5), cpu)
    assert kernels.cu_seqlens((0, 3, 5), cpu) is a  # now the most recent: (0, 5) goes first
    kernels.cu_seqlens((0, 1, 5), cpu)
    assert list(kernels._CU_CACHE) == [((0, 3, 5), cpu), ((0, 1, 5), cpu)]
    assert kernels.cu_seqlens((0, 5), cpu) is not b
    assert kernels.max_seqlen((0, 3, 5)) == 3 and kernels.max_seqlen((0, 1)) == 1


def test_varlen_call_reuses_the_uploaded_boundaries(monkeypatch):
    monkeypatch.setattr(kernels, "_CU_CACHE", OrderedDict())
    backend, fake = _cpu_backend(monkeypatch)
    cu_q, cu_k, causal = VARLEN_LAYOUTS["full"]
    q, k, v = _varlen_block(cu_q, cu_k, 2, 2, 16, torch.bfloat16, seed=2)
    uploads = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: uploads.append(a[0]) or real(*a, **kw))
    for _ in range(3):
        out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, 0.3)
        backend.backward_varlen(out, q, k, v, out, lse, cu_q, cu_k, causal, 0.3)
    assert uploads == [cu_q, cu_k] and len(fake.calls) == 6


# The conformance suite's varlen checks, on the stand-in ops (fp16/bf16: the flash varlen path; fp32 and
# float64: the per-segment fallback) and, where there is one, on a GPU.
VARLEN_CASES = [c for c in conformance.cases(CUDABackend()) if c.id.startswith("varlen-")]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_conformance_on_the_stand_in(monkeypatch, case):
    backend, _ = _cpu_backend(monkeypatch)
    case.run(backend)


class _IgnoresSegments(FakeAten):
    """A varlen forward that attends across document boundaries (one segment over everything)."""

    def _flash_attention_forward(self, q, k, v, cq, ck, max_q, max_k, *args, **kwargs):
        whole_q, whole_k = cq[[0, -1]].contiguous(), ck[[0, -1]].contiguous()
        return super()._flash_attention_forward(q, k, v, whole_q, whole_k, q.shape[0], k.shape[0], *args, **kwargs)


class _RecomputesLse(FakeAten):
    """A varlen backward that renormalises by its own block's lse instead of the merged one."""

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cq, ck, max_q, max_k, p, causal, *args, **kwargs):
        own = super()._flash_attention_forward(q, k, v, cq, ck, max_q, max_k, 0.0, causal, False, scale=kwargs["scale"])
        own_out, own_lse = own[0], own[1]
        return super()._flash_attention_backward(
            dout, q, k, v, own_out, own_lse, cq, ck, max_q, max_k, p, causal, *args, **kwargs
        )


@pytest.mark.parametrize(
    "fake,check,kwargs,message",
    [
        (_IgnoresSegments, conformance.check_forward_varlen, {"layout": "full", "heads": "gqa"}, "varlen forward out"),
        (_IgnoresSegments, conformance.check_forward_varlen, {"layout": "causal", "heads": "mha"}, "varlen forward"),
        (_RecomputesLse, conformance.check_split_keys_varlen, {}, "varlen split-key backward"),
    ],
)
def test_varlen_conformance_catches_a_broken_kernel(monkeypatch, fake, check, kwargs, message):
    backend, _ = _cpu_backend(monkeypatch)
    monkeypatch.setattr(kernels, "ATEN", fake())
    with pytest.raises(AssertionError, match=message):
        check(backend, torch.bfloat16, **kwargs)


# ---------------------------------------------------------------------------------------------- paged pools
PAGED_CASES = {  # name: (block size, H, Hkv, [(queries, keys, blocks)], causal)
    "decode-gqa": (256, 4, 2, [(1, 300, [3, 0]), (1, 0, []), (1, 256, [1])], False),
    "chunk-and-decodes-causal": (256, 4, 2, [(3, 700, [2, 4, 1]), (1, 5, [0]), (0, 9, [5])], True),
    "mha-512": (512, 2, 2, [(2, 600, [1, 0]), (1, 1, [2])], False),
}


def _paged_inputs(block, h, hkv, segments, dtype, seed=0):
    """q [T, H, D], the pools (6 blocks, random tokens in every row), and the int32 table (padded with block 5,
    never listed: a kernel reading past a segment's length mixes its tokens in), cu_q and seqused_k."""
    g = torch.Generator().manual_seed(seed)
    t = sum(n for n, _, _ in segments)
    q = torch.randn(t, h, 16, generator=g, dtype=torch.float64).to(dtype)
    k_pool, v_pool = (torch.randn(6, block, hkv, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    width = max(len(blocks) for _, _, blocks in segments)
    table = torch.tensor([blocks + [5] * (width - len(blocks)) for _, _, blocks in segments], dtype=torch.int32)
    cu = torch.tensor([0] + [sum(n for n, _, _ in segments[: i + 1]) for i in range(len(segments))], dtype=torch.int32)
    used = torch.tensor([n for _, n, _ in segments], dtype=torch.int32)
    bounds = (max(n for n, _, _ in segments), max(n for _, n, _ in segments))
    return (q, k_pool, v_pool, table, cu, used), bounds


def _paged_reference(q, k_pool, v_pool, segments, causal, scale):
    """float64 attention of each segment's queries over its first rows gathered by hand (bottom-right causal)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, dtype=torch.float64)
    at = 0
    for n, keys, blocks in segments:
        k, v = (x[blocks].flatten(0, 1)[None, :keys].double() if blocks else x[:0, 0][None].double()
                for x in (k_pool, v_pool))  # fmt: skip
        mask = torch.ones(n, keys, dtype=torch.bool).tril(keys - n) if causal else None
        o, seg_lse = math_forward(q[None, at : at + n].double(), k, v, "none", scale, allowed=mask)
        out[at : at + n], lse[:, at : at + n] = o[0], seg_lse[0]
        at += n
    return out, lse


@pytest.mark.parametrize("dtype", list(VARLEN_TOL))
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_forward_paged_is_one_flash_call_reading_the_blocks_in_place(monkeypatch, dtype, case):
    """One aten flash varlen call with block_table and seqused_k: the pools as they are (no gather, GQA native),
    the host reading no value; against float64 attention on each segment's rows gathered by hand and the base
    class's gather. A segment without keys is out 0 and lse -inf, never NaN (the stand-in leaves NaN there)."""
    block, h, hkv, segments, causal = PAGED_CASES[case]
    backend, fake = _cpu_backend(monkeypatch)
    fake.on_device = False
    args, (max_q, max_k) = _paged_inputs(block, h, hkv, segments, dtype, seed=block + len(segments))
    before = [x.clone() for x in args]
    assert backend.paged_in_place(*args[:3])
    monkeypatch.setattr(xcp.Backend, "forward_paged", lambda *a, **k: pytest.fail("the gather ran"))
    with _host_reads_refused(_PagedAten(fake)):
        out, lse = backend.forward_paged(*args, max_q, max_k, 0.3, causal)
    monkeypatch.undo()
    assert out.shape == args[0].shape and out.dtype == dtype and lse.shape == (h, args[0].shape[0])
    assert lse.dtype == torch.float32 and not out.isnan().any()
    assert [c[0] for c in fake.calls] == ["flash_paged_fwd"]
    ref_out, ref_lse = _paged_reference(*args[:3], segments, causal, 0.3)
    _close("out", out, ref_out, VARLEN_TOL[dtype])
    _close("lse", lse, ref_lse, VARLEN_TOL[dtype])
    gathered = xcp.Backend.forward_paged(backend, *args, max_q, max_k, 0.3, causal)
    _close("out vs the gather", out, gathered[0], VARLEN_TOL[dtype])
    for x, y in zip(args, before):
        assert torch.equal(x, y)


class _PagedAten:
    """Marks the stand-in's op as the device's side (its reads of the lengths are the kernel's)."""

    def __init__(self, fake):
        self.fake = fake
        self.on_device = False
        original = fake._paged_forward

        def on_device(*a, **k):
            self.on_device = True
            try:
                return original(*a, **k)
            finally:
                self.on_device = False

        fake._paged_forward = on_device


@pytest.mark.parametrize(
    "why,dtype,block,hkv,dv,kwargs",
    [
        ("blocks of 16 rows", torch.bfloat16, 16, 2, 16, {}),
        ("blocks of 128 rows", torch.float16, 128, 2, 16, {}),
        ("float32", torch.float32, 256, 2, 16, {}),
        ("values of another head dim", torch.bfloat16, 256, 2, 8, {}),
        ('gqa="repeat" would copy the pool', torch.bfloat16, 256, 2, 16, {"gqa": "repeat"}),
    ],
)
def test_forward_paged_gathers_where_flash_paged_does_not_serve(monkeypatch, why, dtype, block, hkv, dv, kwargs):
    backend, fake = _cpu_backend(monkeypatch, **kwargs)
    (q, k_pool, v_pool, table, cu, used), (max_q, max_k) = _paged_inputs(
        block, 4, hkv, [(1, 20, [1, 3]), (2, 5, [0])], dtype
    )  # fmt: skip
    v_pool = v_pool[..., :dv]
    assert not backend.paged_in_place(q, k_pool, v_pool), why
    got = backend.forward_paged(q, k_pool, v_pool, table, cu, used, max_q, max_k, 0.3)
    want = xcp.Backend.forward_paged(backend, q, k_pool, v_pool, table, cu, used, max_q, max_k, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and fake.calls == []


class FakeAtenOfTorch211(FakeAten):
    """torch 2.11's flash varlen op: its schema ends ``seqused_k, alibi_slopes`` (no ``block_table``)."""

    def _flash_attention_forward(
        self, q, k, v, cq, ck, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
        window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    ):  # fmt: skip
        return super()._flash_attention_forward(
            q, k, v, cq, ck, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale,
            window_size_left=window_size_left, window_size_right=window_size_right, seqused_k=seqused_k,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip


def test_forward_paged_gathers_on_a_torch_whose_flash_op_has_no_block_table(monkeypatch):
    """Blocks of 256 rows in bf16 would go in place, but torch 2.11's op refuses ``block_table``: the gather."""
    backend, _ = _cpu_backend(monkeypatch)
    fake = FakeAtenOfTorch211()
    monkeypatch.setattr(kernels, "ATEN", fake)
    args, (max_q, max_k) = _paged_inputs(256, 4, 2, [(1, 20, [1, 3]), (2, 5, [0])], torch.bfloat16)
    assert kernels.flash_takes_block_table() is False
    assert not backend.paged_in_place(*args[:3])
    got = backend.forward_paged(*args, max_q, max_k, 0.3)
    want = xcp.Backend.forward_paged(backend, *args, max_q, max_k, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and fake.calls == []
    monkeypatch.setattr(kernels, "ATEN", FakeAten())
    assert kernels.flash_takes_block_table() and backend.paged_in_place(*args[:3])


def test_the_installed_torch_flash_op_is_asked_for_block_table():
    """The real op answers from its schema, whatever this torch's version."""
    names = [a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments]
    assert fused.op_takes_argument(torch.ops.aten._flash_attention_forward, "block_table") == ("block_table" in names)
    assert fused.op_takes_argument(torch.ops.aten._flash_attention_forward, "seqused_k")


def test_forward_paged_keeps_flash_off_its_one_query_path_when_a_segment_has_no_query(monkeypatch):
    """max_q 1 with a segment without queries (T < B): flash's GQA path would read q as one query per segment,
    so the call goes with max_q 2 (the stand-in asserts T == B on that path)."""
    backend, fake = _cpu_backend(monkeypatch)
    args, _ = _paged_inputs(256, 4, 2, [(1, 10, [0]), (0, 4, [1]), (1, 3, [2])], torch.bfloat16)
    out, lse = backend.forward_paged(*args, 1, 10, 0.3)
    ref_out, ref_lse = _paged_reference(*args[:3], [(1, 10, [0]), (0, 4, [1]), (1, 3, [2])], False, 0.3)
    _close("out", out, ref_out, VARLEN_TOL[torch.bfloat16])
    assert fake.calls == [("flash_paged_fwd", 2, 256, 2, False, 3)]


PAGED_CONFORMANCE = [c for c in conformance.cases(CUDABackend()) if c.id.startswith("paged-")]


@pytest.mark.parametrize("case", PAGED_CONFORMANCE, ids=str)
def test_paged_conformance_on_the_stand_in(monkeypatch, case):
    backend, _ = _cpu_backend(monkeypatch)
    case.run(backend)


# ---------------------------------------------------------------------------------------------- storage range
RANGE_CASES = {  # name: (B, T, H, Hkv, room, lo, hi)
    "decode-gqa": (1, 1, 4, 2, 9, 0, 5),
    "batch-mqa-inner": (2, 3, 4, 1, 10, 3, 8),
    "batch-decode-whole-room": (3, 1, 4, 2, 6, 0, 6),
    "empty": (2, 2, 4, 2, 7, 4, 4),
    "empty-at-the-end": (2, 1, 2, 2, 5, 5, 5),
}
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")
"""The Python ways the host reads a tensor's value (each a device sync on a GPU, and a value frozen into a
captured graph)."""


class _RangeAten(FakeAten):
    """The stand-in varlen forward as the device runs it for forward_range: it reads the lengths (the kernel's
    side, ``on_device``), and it leaves NaN in the output of rows without keys next to flash's +inf lse, so
    only the wrapper's own masking can make those rows exactly 0."""

    def __init__(self):
        super().__init__()
        self.on_device = False

    def _flash_attention_forward(self, *args, **kwargs):
        self.on_device = True
        try:
            out, lse, *rest = super()._flash_attention_forward(*args, **kwargs)
            out[(lse == math.inf).transpose(0, 1)] = math.nan
        finally:
            self.on_device = False
        return out, lse, *rest


@contextlib.contextmanager
def _host_reads_refused(fake):
    """Within: any Python read of a tensor's value (:data:`HOST_READS`) fails, except inside the stand-in op."""

    def refusing(name):
        real = getattr(torch.Tensor, name)

        def refuse(self, *args, **kwargs):
            assert getattr(fake, "on_device", False), f"the host read a tensor's value ({name}) outside the kernel"
            return real(self, *args, **kwargs)

        return refuse

    with pytest.MonkeyPatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, refusing(name))
        yield


def _range_inputs(b, t, h, hkv, room, lo, hi, dtype, head_dim=16, seed=0):
    """q (a strided view), k and v (a cache's contiguous storage, every row random) and lo, hi (int64 on the
    CPU; 0-d for a batch of one, [1] otherwise: both are tensors of one element)."""
    q, k, v = _block(b, t, room, h, hkv, head_dim, dtype=dtype, seed=seed)
    ends = [torch.tensor(x) if b == 1 else torch.tensor([x]) for x in (lo, hi)]
    return _strided(q), k, v, *ends


def _range_reference(q, k, v, lo, hi, scale):
    """float64 math of every query against key rows lo..hi-1 alone (sliced on the host: the test may read them)."""
    return math_forward(q.double(), k[:, lo:hi].double(), v[:, lo:hi].double(), "none", scale)


@pytest.mark.parametrize("dtype", list(VARLEN_TOL))
@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_forward_range_is_one_flash_varlen_call_with_lengths_made_on_the_device(monkeypatch, dtype, case):
    """The batch packed as one varlen segment per row: cum_seq_q i*T, cum_seq_k i*room + lo, seqused_k hi - lo,
    K/V heads as they are (GQA native), the host reading no value; against float64 math of rows lo..hi-1
    and the base class's math default. An empty range is out 0 and lse -inf on every row, never NaN."""
    b, t, h, hkv, room, lo, hi = RANGE_CASES[case]
    backend, _ = _cpu_backend(monkeypatch)
    fake = _RangeAten()
    monkeypatch.setattr(kernels, "ATEN", fake)
    q, k, v, lo_t, hi_t = _range_inputs(b, t, h, hkv, room, lo, hi, dtype, seed=room + lo)
    before = [x.clone() for x in (q, k, v, lo_t, hi_t)]
    with _host_reads_refused(fake):
        out, lse = backend.forward_range(q, k, v, lo_t, hi_t, 0.3)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, t) and lse.dtype == torch.float32
    assert fake.calls == [("flash_varlen_fwd", b * t, b * room, hkv, False, b)]
    cum_q, cum_k = [i * t for i in range(b + 1)], [i * room + lo for i in range(b + 1)]
    assert fake.lengths == [(cum_q, cum_k, [hi - lo] * b, t, room)]
    ref_out, ref_lse = _range_reference(q, k, v, lo, hi, 0.3)
    default_out, default_lse = xcp.Backend.forward_range(backend, q, k, v, lo_t, hi_t, 0.3)
    for want_out, want_lse in ((ref_out, ref_lse), (default_out, default_lse)):
        _close("out", out, want_out, VARLEN_TOL[dtype])
        _close("lse", lse, want_lse, VARLEN_TOL[dtype])
    if lo == hi:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for x, y in zip((q, k, v, lo_t, hi_t), before):
        assert torch.equal(x, y)


def test_forward_range_repeats_the_storage_under_gqa_repeat(monkeypatch):
    backend, fake = _cpu_backend(monkeypatch, gqa="repeat")
    q, k, v, lo, hi = _range_inputs(2, 1, 4, 2, 8, 1, 6, torch.bfloat16, seed=3)
    out, lse = backend.forward_range(q, k, v, lo, hi, 0.3)
    assert fake.calls == [("flash_varlen_fwd", 2, 16, 4, False, 2)]
    ref_out, ref_lse = _range_reference(q, k, v, 1, 6, 0.3)
    _close("out", out, ref_out, VARLEN_TOL[torch.bfloat16])
    _close("lse", lse, ref_lse, VARLEN_TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "dtype,head_dim,capability",
    [
        (torch.float64, 16, (9, 0)),
        (torch.float32, 16, (9, 0)),  # the efficient op takes no lengths on the device
        (torch.bfloat16, 20, (9, 0)),  # head_dim not a multiple of 8
        (torch.float16, 16, (7, 5)),  # pre-Ampere: no flash
    ],
)
def test_forward_range_falls_back_to_the_math_default_where_flash_does_not_serve(
    monkeypatch, dtype, head_dim, capability
):
    backend, fake = _cpu_backend(monkeypatch)
    monkeypatch.setattr(backend, "_capability", lambda device: capability)
    q, k, v, lo, hi = _range_inputs(2, 2, 4, 2, 7, 2, 6, dtype, head_dim=head_dim, seed=4)
    with _host_reads_refused(fake):
        got = backend.forward_range(q, k, v, lo, hi, 0.3)
    want = xcp.Backend.forward_range(backend, q, k, v, lo, hi, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and fake.calls == []


def test_forward_range_checks_its_range_ends(monkeypatch):
    backend, _ = _cpu_backend(monkeypatch)
    q, k, v, lo, hi = _range_inputs(2, 1, 2, 2, 5, 0, 3, torch.bfloat16)
    expected = "expected an int64 tensor of one element on cpu; got"
    with pytest.raises(ValueError, match=rf"hi: {expected} a torch.int32 tensor of shape \(1,\) on cpu"):
        backend.forward_range(q, k, v, lo, hi.int(), 0.3)
    with pytest.raises(ValueError, match=rf"lo: {expected} a torch.int64 tensor of shape \(2,\) on cpu"):
        backend.forward_range(q, k, v, torch.tensor([0, 1]), hi, 0.3)
    with pytest.raises(ValueError, match=rf"lo: {expected} int"):
        backend.forward_range(q, k, v, 0, hi, 0.3)


class _RangeKernel:
    """Stands in for one of forward_range's Triton kernels: records ``kernel[grid](...)`` and does its work with
    the torch-op path (``inside`` set meanwhile, so that a counter can leave those ops out)."""

    inside = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        def run(*params, **constexprs):
            self.calls.append((grid, params, constexprs))
            _RangeKernel.inside = True
            try:
                if self.name == "range_lengths":
                    lo, hi, cum_q, cum_k, used, batch, queries, room = params
                    for out, want in zip((cum_q, cum_k, used), kernels.range_lengths(batch, queries, room, lo, hi)):
                        out.copy_(want)
                else:
                    out, lse, lo, hi, n_rows, heads, dim, o_sn, o_sh, l_sh, l_sn = params
                    assert (n_rows, heads, dim) == (out.shape[0] * out.shape[1], *out.shape[1:])
                    assert (o_sn, o_sh, l_sh, l_sn) == (*out.stride()[:2], *lse.stride())
                    kernels.blind_rows_(out, lse, lo, hi, None)
            finally:
                _RangeKernel.inside = False

        return run


class _DeviceOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the torch ops that would launch a kernel (neither a view nor an allocation with ``empty``), leaving
    out those inside the stand-in flash op and the stand-in Triton kernels."""

    def __init__(self, fake) -> None:
        super().__init__()
        self.fake = fake
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inside = self.fake.on_device or _RangeKernel.inside
        if not (inside or func.is_view or func is torch.ops.aten.empty.memory_format):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["batch-mqa-inner", "empty", "decode-gqa"])
def test_the_fused_forward_range_is_two_triton_launches_and_the_flash_op(monkeypatch, case):
    """With the fused kernels on (and triton importable), forward_range launches the lengths kernel, the flash
    varlen op and the empty-rows kernel, and no torch kernel besides (only views and ``torch.empty``); the
    host reads no value; its results are the torch-op path's bit for bit (shapes, dtypes and strides too)."""
    b, t, h, hkv, room, lo, hi = RANGE_CASES[case]
    q, k, v, lo_t, hi_t = _range_inputs(b, t, h, hkv, room, lo, hi, torch.bfloat16, seed=room + lo)
    q = q.contiguous()  # a strided q is copied once (one more kernel, the caller's layout)
    fakes = {name: _RangeKernel(name) for name in ("range_lengths", "range_blind")}
    results = {}
    for on in (False, True):
        backend, _ = _cpu_backend(monkeypatch, fused_merge=on)
        monkeypatch.setattr(kernels, "triton_importable", lambda: True)
        backend.launcher = kernels.Launcher(builders={name: (lambda f=f: f) for name, f in fakes.items()})
        fake = _RangeAten()
        monkeypatch.setattr(kernels, "ATEN", fake)
        counter = _DeviceOps(fake)
        with _host_reads_refused(fake), counter:
            results[on] = backend.forward_range(q, k, v, lo_t, hi_t, 0.3)
        assert fake.calls == [("flash_varlen_fwd", b * t, b * room, hkv, False, b)]
        cum_q, cum_k = [i * t for i in range(b + 1)], [i * room + lo for i in range(b + 1)]
        assert fake.lengths == [(cum_q, cum_k, [hi - lo] * b, t, room)]
        if on:
            assert counter.ops == [], counter.ops
        else:
            assert len(counter.ops) >= 10 and not any(f.calls for f in fakes.values()), counter.ops
    lengths, blind = fakes["range_lengths"].calls, fakes["range_blind"].calls
    assert len(lengths) == 1 and len(blind) == 1
    assert lengths[0][0] == (1,) and lengths[0][2] == {"BLOCK": 1 << b.bit_length()}
    block_d = 16
    assert blind[0][0] == (-(-(b * t * h) // (2048 // block_d)),) and blind[0][2] == {"BLOCK_R": 128, "BLOCK_D": 16}
    for got, want in zip(results[True], results[False]):
        assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.equal(got, want)
    if lo == hi:
        assert torch.equal(results[True][0], torch.zeros_like(q)) and torch.isneginf(results[True][1]).all()


def test_the_forward_range_kernels_are_off_without_triton_or_the_fused_kernels(monkeypatch):
    """The torch-op path serves where triton is missing, the fused kernels are off, or head_dim > 256."""
    backend, _ = _cpu_backend(monkeypatch, fused_merge=True)
    q = torch.empty(1, 1, 2, 16)
    monkeypatch.setattr(kernels, "triton_importable", lambda: False)
    assert backend._range_launcher(q) is None
    monkeypatch.setattr(kernels, "triton_importable", lambda: True)
    assert backend._range_launcher(q) is backend.launcher
    assert backend._range_launcher(torch.empty(1, 1, 2, 264)) is None
    backend.fused_merge = False
    assert backend._range_launcher(q) is None


# The conformance suite's range checks on the stand-in ops (fp16/bf16: the flash varlen op with seqused_k;
# fp32 and float64: the math default) and, where there is one, on a GPU.
RANGE_CONFORMANCE = [c for c in conformance.cases(CUDABackend()) if c.id.startswith("range-")]


@pytest.mark.parametrize("case", RANGE_CONFORMANCE, ids=str)
def test_range_conformance_on_the_stand_in(monkeypatch, case):
    backend, _ = _cpu_backend(monkeypatch)
    monkeypatch.setattr(kernels, "ATEN", _RangeAten())
    case.run(backend)


class _FromTheFirstKey(_RangeAten):
    """A range kernel that ignores lo: every batch row attends its keys 0..hi-1."""

    def _flash_attention_forward(self, q, k, v, cq, ck, *args, seqused_k=None, **kwargs):
        lo = ck[:1]
        return super()._flash_attention_forward(q, k, v, cq, ck - lo, *args, seqused_k=seqused_k + lo, **kwargs)


def test_range_conformance_catches_a_kernel_that_reads_outside_the_range(monkeypatch):
    backend, _ = _cpu_backend(monkeypatch)
    monkeypatch.setattr(kernels, "ATEN", _FromTheFirstKey())
    with pytest.raises(AssertionError, match=r"range forward out \(inner: key rows \[4, 11\)\)"):
        conformance.check_forward_range(backend, torch.bfloat16, ends="inner", heads="gqa")


@pytest.mark.parametrize("case", [*VARLEN_CASES, *RANGE_CONFORMANCE], ids=str)
def test_varlen_and_range_conformance_on_a_gpu(case):
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    case.run(backend)


def test_flash_attn_package_serves_the_forward(monkeypatch):
    """With flash_attn importable its forward is used ([B, S, H, D], GQA as is); the backward stays aten."""
    seen = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        assert dropout_p == 0.0 and return_attn_probs and q.is_contiguous()
        seen.append((q.shape[1], k.shape[1], k.shape[2], causal))
        bhsd = [x.transpose(1, 2) for x in (q, k, v)]
        m = FakeAten._mask(q.shape[1], k.shape[1], causal, True)  # flash-attn: bottom-right when non-square
        out, lse = _bhsd_attention(*bhsd, m, softmax_scale)
        return out.transpose(1, 2).to(q.dtype), lse.float(), None

    backend, fake = _cpu_backend(monkeypatch)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    q, k, v = _block(1, 7, 5, 4, 2, 16, dtype=torch.float16, seed=2)
    for mask in MASKS:
        out, lse = backend.forward(q, k, v, mask, 0.25)
        ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), mask, 0.25)
        _close("out", out, ref_out, 4e-3)
        _close("lse", lse, ref_lse, 1e-5)
    assert seen and all(kv == 2 for *_, kv, _ in seen) and all(a == b for a, b, _, c in seen if c)
    assert not any(c[0] == "flash_fwd" for c in fake.calls)
    off, fake_off = _cpu_backend(monkeypatch, use_flash_attn=False)
    seen.clear()
    off.forward(q, k, v, "causal", 0.25)
    assert seen == [] and fake_off.calls[0][0] == "flash_fwd"


def test_unimportable_flash_attn_falls_back_to_aten(monkeypatch):
    backend, fake = _cpu_backend(monkeypatch)
    q, k, v = _block(1, 4, 4, 2, 2, 8, dtype=torch.bfloat16)
    backend.forward(q, k, v, "causal", 0.3)
    assert backend.flash_attn_module() is None and "flash_attn" in backend._flash_attn_error
    assert fake.calls[0][0] == "flash_fwd"


def test_backend_checks_arguments(monkeypatch):
    """q/k/v are checked once per call, by xcp.attention (xcp.checks.check_qkv), not in every block; the
    block kernel still refuses a mask it does not know."""
    backend, _ = _cpu_backend(monkeypatch)
    q, k, v = _block(1, 4, 4, 4, 3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="divides the 4 heads"):
        check_qkv(q, k, v)
    with pytest.raises(ValueError, match="mask: expected one of"):
        backend.forward(q, k[:, :, :2], v[:, :, :2], "upper", 0.3)
    with pytest.raises(ValueError, match="gqa: expected one of native, repeat; got 'sometimes'"):
        CUDABackend(gqa="sometimes")


def test_env_flags(monkeypatch):
    monkeypatch.setenv("XCP_CUDA_GQA", "repeat")
    monkeypatch.setenv("XCP_CUDA_FLASH_ATTN", "0")
    b = CUDABackend()
    assert b.gqa == "repeat" and b.use_flash_attn is False and b.flash_attn_module() is None
    monkeypatch.setenv("XCP_CUDA_FLASH_ATTN", "yes")
    with pytest.raises(ValueError, match="XCP_CUDA_FLASH_ATTN: expected 0 or 1; got 'yes'"):
        CUDABackend()


def test_every_setting_is_read_when_the_backend_is_built_and_a_constructor_argument_overrides_it(monkeypatch):
    flags = (("CUDNN", "0"), ("FUSED_MERGE", "1"), ("PAIR_MERGE", "0"), ("FAST_LAUNCH", "0"), ("CAUSAL_BACKWARD", "0"))
    for name, value in flags:
        monkeypatch.setenv(f"XCP_CUDA_{name}", value)
    b = CUDABackend()
    read = (b.use_cudnn, b.fused_merge, b.folds_pairs, b.launcher.fast, b.causal_backward)
    assert read == (False, True, False, False, False)
    b = CUDABackend(use_cudnn=True, fused_merge=True, pair_merge=True, fast_launch=True, causal_backward=True)
    assert (b.use_cudnn, b.fused_merge, b.folds_pairs, b.launcher.fast, b.causal_backward) == (True,) * 5
    assert not CUDABackend(fused_merge=False, pair_merge=True).folds_pairs  # pairs need the fused merge
    monkeypatch.setenv("XCP_CUDA_FAST_LAUNCH", "2")
    with pytest.raises(ValueError, match="XCP_CUDA_FAST_LAUNCH: expected 0 or 1; got '2'"):
        CUDABackend()
    assert {s.name for s in CUDABackend.settings} == {
        "XCP_CUDA_GQA", "XCP_CUDA_FLASH_ATTN", "XCP_CUDA_CUDNN", "XCP_CUDA_FUSED_MERGE", "XCP_CUDA_PAIR_MERGE",
        "XCP_CUDA_FAST_LAUNCH", "XCP_CUDA_CAUSAL_BACKWARD", "XCP_CUDA_FLA", "XCP_CUDA_TRITON_DECODE",
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- identity, plugin
def test_identity_and_availability_without_a_gpu():
    b = CUDABackend()
    assert (b.name, b.device_type, b.dist_backend, b.handoff_policy) == ("cuda", "cuda", "nccl", "record_stream")
    ok, reason = b.available()
    assert ok == torch.cuda.is_available()
    if not ok:
        assert reason.startswith("no CUDA device: ")


def test_importing_the_plugin_touches_no_vendor_module():
    code = (
        "import sys, xcp_cuda.plugin, xcp_npu.plugin\n"
        "bad = [m for m in ('flash_attn', 'torch_npu') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("kind", ["flash", "cudnn"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_and_cudnn_blocks_merge_on_a_gpu(monkeypatch, kind, head_dim):
    """A ring step on a GPU with each kernel forced: a square causal block and a full block of keys
    merged, each block's backward from the merged out/lse, against float64 attention of the whole row
    (bf16: relative 2-norm error 2e-2, about 5 bf16 ulps; flash and cuDNN both measure about 2.4e-3)."""
    backend = CUDABackend(use_cudnn=kind == "cudnn")
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    if kind == "cudnn":
        from torch.nn.attention import SDPBackend

        if not torch.backends.cudnn.is_available():
            pytest.skip("needs cuDNN (torch.backends.cudnn.is_available() is False)")
        monkeypatch.setattr(kernels, "SDPA_CHOICE", lambda *a, **kw: int(SDPBackend.CUDNN_ATTENTION))
    if backend.kernel_for(torch.empty(1, 1, 1, head_dim, dtype=torch.bfloat16, device="cuda")) != "flash":
        pytest.skip("needs an sm80+ GPU (the flash class of kernels)")
    n, h, hkv = 256, 8, 2
    g = torch.Generator(device="cuda").manual_seed(head_dim)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, dout = (
        rand(1, n, h, head_dim),
        rand(1, 2 * n, hkv, head_dim),
        rand(1, 2 * n, hkv, head_dim),
        rand(1, n, h, head_dim),
    )
    scale = head_dim**-0.5
    blocks = [(slice(0, n), "causal"), (slice(n, 2 * n), "none")]
    parts = [backend.forward(q, k[:, ks], v[:, ks], mask, scale) for ks, mask in blocks]
    lse = torch.logaddexp(parts[0][1].float(), parts[1][1].float())
    out = sum(o.float() * torch.exp(b_lse.float() - lse).transpose(1, 2).unsqueeze(-1) for o, b_lse in parts)
    dq = torch.zeros(q.shape, device="cuda")
    dks, dvs = [], []
    for ks, mask in blocks:
        gq, gk, gv = backend.backward(dout, q, k[:, ks], v[:, ks], out.to(q.dtype), lse, mask, scale)
        dq += gq.float()
        dks.append(gk)
        dvs.append(gv)
    allowed = torch.ones(n, 2 * n, dtype=torch.bool, device="cuda")
    allowed[:, :n] = allowed[:, :n].tril()
    groups = h // hkv
    q64, k64, v64 = (
        x.double().requires_grad_() for x in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2))
    )
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    ref = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v64)
    ref.backward(dout.double())

    def fold(x):
        return x.reshape(1, 2 * n, hkv, groups, head_dim).sum(3)

    got = {"out": out, "dq": dq, "dk": torch.cat(dks, 1), "dv": torch.cat(dvs, 1)}
    want = {"out": ref.detach(), "dq": q64.grad, "dk": fold(k64.grad), "dv": fold(v64.grad)}
    for name in got:
        err = ((got[name].double() - want[name]).norm() / want[name].norm()).item()
        assert err < 2e-2, f"{kind} {name}: relative error {err:.2e}"
    assert backend.block_kernel(q, k[:, :n], True) == kind


def test_the_stream_switch_restores_the_stream_and_the_device_on_a_gpu():
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    before, device = torch.cuda.current_stream(), torch.cuda.current_device()
    side = torch.cuda.Stream()
    with backend.stream_context(side):
        assert torch.cuda.current_stream() == side
        inner = torch.cuda.Stream()
        with backend.stream_context(inner):
            assert torch.cuda.current_stream() == inner
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == before and torch.cuda.current_device() == device
    if torch.cuda.device_count() > 1:  # a stream of another device: that device's stream and ours restored
        other = torch.cuda.Stream(device=1 - device)
        with backend.stream_context(other):
            assert torch.cuda.current_stream(1 - device) == other
        assert torch.cuda.current_device() == device and torch.cuda.current_stream() == before


class _FakeJit:
    """Stands in for the Triton merge kernel: records ``kernel[grid](...)`` (Triton's own path) and returns a
    compiled kernel that records its direct launches."""

    def __init__(self) -> None:
        self.jit_calls: list[tuple] = []
        self.direct_calls: list[tuple] = []

    def __getitem__(self, grid):
        def run(*params, BLOCK_R, BLOCK_D, **fresh):  # noqa: N803 - Triton's constexpr names
            self.jit_calls.append((grid, *params, BLOCK_R, BLOCK_D, *fresh.values()))
            fake = self

            class Compiled:
                def __getitem__(self, g):
                    assert len(g) == 3, f"a compiled Triton kernel takes a grid of three dims; got {g}"
                    return lambda *args: fake.direct_calls.append((g, *args))

            return Compiled()

        return run


def _merge_inputs(rows: int = 12, offset: int = 0, dtype=torch.bfloat16):
    out = torch.zeros(1, rows + offset, 4, 16)
    lse = torch.full((1, 4, rows + offset), -math.inf)
    block_out = torch.randn(1, rows, 4, 16).to(dtype)
    block_lse = torch.randn(1, 4, rows)
    return out, lse, block_out, block_lse, slice(offset, offset + rows)


def test_the_merge_launches_a_signature_seen_before_directly_and_a_new_one_through_triton(monkeypatch):
    """The key of a compiled merge holds every int argument exactly, the dtypes and the pointers' 16-byte
    alignment: a repeat goes straight to the compiled kernel with the same arguments; a different stride,
    dtype or alignment goes through Triton, which specialises on them; XCP_CUDA_FAST_LAUNCH=0 always does."""
    fake = _FakeJit()
    launch = kernels.Launcher(fast=True, builders={"merge": lambda: fake})
    kernels.fused_merge_(*_merge_inputs(), launch)
    assert len(fake.jit_calls) == 1 and not fake.direct_calls
    kernels.fused_merge_(*_merge_inputs(), launch)  # same shapes, strides, dtypes; fresh tensors, 16-byte aligned
    assert len(fake.jit_calls) == 1 and len(fake.direct_calls) == 1
    assert fake.direct_calls[0][0] == (*fake.jit_calls[0][0], 1, 1)  # the grid
    assert fake.direct_calls[0][5:] == fake.jit_calls[0][5:]  # the ints, then the block sizes
    kernels.fused_merge_(*_merge_inputs(rows=20), launch)  # other ints: Triton
    kernels.fused_merge_(*_merge_inputs(dtype=torch.float32), launch)  # another dtype: Triton
    kernels.fused_merge_(*_merge_inputs(offset=1), launch)  # rows from 1: other strides and a misaligned pointer
    assert len(fake.jit_calls) == 4 and len(fake.direct_calls) == 1
    out, lse, bo, bl, rows = _merge_inputs(offset=1)
    unaligned = torch.empty(bo.numel() + 1, dtype=bo.dtype)[1:].view_as(bo).copy_(bo)
    assert unaligned.data_ptr() % 16 and unaligned.stride() == bo.stride()
    kernels.fused_merge_(out, lse, unaligned, bl, rows, launch)  # same ints and dtypes, block_out misaligned: Triton
    assert len(fake.jit_calls) == 5
    slow = kernels.Launcher(fast=False, builders={"merge": lambda: fake})
    kernels.fused_merge_(*_merge_inputs(), slow)
    assert len(fake.jit_calls) == 6 and len(fake.direct_calls) == 1
    kernels.fused_merge_(*_merge_inputs(), slow)  # a signature seen before, still through Triton
    assert len(fake.jit_calls) == 7 and len(fake.direct_calls) == 1 and not slow.compiled
    assert CUDABackend(fast_launch=False).launcher.fast is False and CUDABackend(fast_launch=True).launcher.fast


def test_a_pair_merge_launches_like_a_merge_with_fresh_in_its_signature(monkeypatch):
    """The pair kernel goes through Triton the first time a signature is seen (FRESH among its constexprs)
    and directly after; fresh and not fresh are two signatures, and a pair never takes a merge's kernel."""
    fake, single = _FakeJit(), _FakeJit()
    launch = kernels.Launcher(fast=True, builders={"pair": lambda: fake, "merge": lambda: single})

    def pair(fresh: bool) -> None:
        out, lse, bo, bl, rows = _merge_inputs()
        kernels.fused_merge_pair_(out, lse, (bo, bl), (bo.clone(), bl.clone()), rows, fresh, launch)

    pair(False)
    assert len(fake.jit_calls) == 1 and fake.jit_calls[0][-1] == 0 and not fake.direct_calls
    pair(False)
    assert len(fake.jit_calls) == 1 and len(fake.direct_calls) == 1
    assert fake.direct_calls[0][7:] == fake.jit_calls[0][7:]  # the ints, then BLOCK_R, BLOCK_D, FRESH
    pair(True)
    assert len(fake.jit_calls) == 2 and fake.jit_calls[1][-1] == 1
    kernels.fused_merge_(*_merge_inputs(), launch)
    assert len(single.jit_calls) == 1 and len(fake.jit_calls) == 2
    out, lse, bo, bl, rows = _merge_inputs()
    with pytest.raises(ValueError, match="second: expected block_out of shape"):
        kernels.fused_merge_pair_(out, lse, (bo, bl), (bo[:, 1:], bl[:, :, 1:]), rows, False, launch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("fresh", [False, True])
def test_the_pair_merge_equals_two_eager_merges_on_a_gpu(dtype, offset, fresh):
    """On a GPU: the pair kernel writes what two eager merges write (float32: to 1e-6), rows that no block
    reached staying 0 / -inf; fresh (nothing folded yet, every row) equals merging into zeros / -inf, and
    reads nothing of the uninitialised accumulators (NaN there)."""
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    from xcp.kernels.merge import merge_

    offset = 0 if fresh else offset
    g = torch.Generator(device="cuda").manual_seed(offset + 7 * fresh)
    n = 333
    if fresh:
        out = torch.full((2, n, 8, 64), math.nan, device="cuda")
        lse = torch.full((2, 8, n), math.nan, device="cuda")
        want_out, want_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    else:
        out = torch.randn(2, n + offset, 8, 64, device="cuda", generator=g)
        lse = torch.randn(2, 8, n + offset, device="cuda", generator=g)
        lse[:, :, :5] = -math.inf
        out[:, :5] = 0.0
        want_out, want_lse = out.clone(), lse.clone()
    blocks = []
    for _ in range(2):
        bo = torch.randn(2, n, 8, 64, device="cuda", generator=g)
        bl = torch.randn(2, 8, n, device="cuda", generator=g)
        bl[:, :, :5] = -math.inf  # rows that saw no key in either block
        bo[:, :5] = 0.0
        blocks.append((bo.to(dtype), bl))
    rows = slice(offset, offset + n)
    assert backend.fused_merge_pair_(out, lse, blocks[0], blocks[1], rows, fresh)
    for bo, bl in blocks:
        merge_(want_out, want_lse, bo, bl, rows)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_dq_add_pair_equals_two_adds_on_a_gpu(monkeypatch, dtype, offset):
    """On a GPU: ``acc[rows] += a + b`` in one kernel equals two in-place adds (float32: to 1e-6), for a view
    of rows from ``offset`` and addends laid out as cuDNN returns them (heads before sequence in memory);
    rows outside the view are untouched. ``acc[rows] += a`` alone (``fused_add_``) equals torch's add."""
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    g = torch.Generator(device="cuda").manual_seed(offset)
    n = 333
    acc = torch.randn(2, n + offset, 8, 64, device="cuda", generator=g)
    a = torch.randn(2, 8, n, 64, device="cuda", generator=g).to(dtype).transpose(1, 2)  # [B, S, H, D] view
    monkeypatch.setattr(backend_module, "FUSED_ADD_MIN_VALUES", 1)  # the kernel at these small sizes too
    b = torch.randn(2, n, 8, 64, device="cuda", generator=g).to(dtype)
    want = acc.clone()
    want[:, offset:].add_(a).add_(b)
    got = acc.clone()
    assert backend.fused_add_pair_(got[:, offset:], a, b)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, :offset], acc[:, :offset])
    assert not backend.fused_add_pair_(got[:, offset:].double(), a, b)  # not float32: the ring adds eagerly
    one, want = acc.clone(), acc.clone()
    want[:, offset:].add_(a)
    assert backend.fused_add_(one[:, offset:], a)  # one addend: the same kernel, the second not read
    assert torch.equal(one, want)  # c + float(a) in float32 either way: the same bits
    assert not backend.fused_add_(one[:, offset:].double(), a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_direct_merge_launch_equals_tritons_own_on_a_gpu(dtype, offset):
    """On a GPU: the merge launched directly (a signature seen before) writes exactly what Triton's own
    launch writes, and both equal the eager merge (float32 accumulators: to 1e-6)."""
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    from xcp.kernels.merge import merge_

    g = torch.Generator(device="cuda").manual_seed(offset)
    n = 333
    out = torch.randn(2, n + offset, 8, 64, device="cuda", generator=g)
    lse = torch.randn(2, 8, n + offset, device="cuda", generator=g)
    lse[:, :, :5] = -math.inf  # rows nothing was merged into yet
    blocks = [
        (torch.randn(2, n, 8, 64, device="cuda", generator=g).to(dtype), torch.randn(2, 8, n, device="cuda"))
        for _ in range(3)
    ]
    rows = slice(offset, offset + n)
    results, launchers = [], []
    for fast in (False, True):
        fused = CUDABackend(fused_merge=True, fast_launch=fast)
        o, lo = out.clone(), lse.clone()
        for bo, bl in blocks:  # the second and third launches of the fast run go direct
            assert fused.fused_merge_(o, lo, bo, bl, rows)
        results.append((o, lo))
        launchers.append(fused.launcher)
    assert [len(launch.compiled) for launch in launchers] == [0, 1]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    o, lo = out.clone(), lse.clone()
    for bo, bl in blocks:
        merge_(o, lo, bo, bl, rows)
    torch.testing.assert_close(results[1][0], o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], lo, rtol=1e-6, atol=1e-6)


def test_current_stream_is_torchs_current_stream_on_a_gpu():
    """The backend's cached current_stream answers what torch.cuda.current_stream answers: by default, under
    torch.cuda.stream, under the backend's own stream_context, for a device given with or without index."""
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    cases = [None, torch.device("cuda"), torch.device("cuda", torch.cuda.current_device())]

    def same() -> None:
        for device in cases:
            got, want = backend.current_stream(device), torch.cuda.current_stream(device)
            assert got == want and got.cuda_stream == want.cuda_stream, (device, got, want)

    same()
    with torch.cuda.stream(side):
        same()
        with backend.stream_context(other):
            same()
        same()
    same()
    assert backend.current_stream() is backend.current_stream()  # one object per stream, kept


@pytest.mark.parametrize("causal", [False, True])
def test_every_rank_of_a_localworld_replays_from_one_graph_on_a_gpu(causal):
    """On a GPU: the ring forward and backward of all 4 virtual ranks of a LocalWorld (threads taking turns,
    each on its own stream), captured into one graph from the calling thread, replay on new inputs written
    into the same tensors and match float64 SDPA on them (bf16's tolerance); the capture allocated no ring
    buffer (rule 4: the slots came from the workspace) and kept 2 K/V + 2 dK/dV shards per rank."""
    backend = CUDABackend()
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU ({reason})")
    from xcp.cli.bench import VirtualRing
    from xcp.cli.common import REL_TOLERANCE, error, reference

    g = torch.Generator(device="cuda").manual_seed(int(causal))
    shapes = ((1, 256, 4, 64), (1, 256, 2, 64), (1, 256, 2, 64), (1, 256, 4, 64))  # q, k, v, dout
    full = tuple(torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes)
    ring = VirtualRing(backend, 4, full, causal, "zigzag")
    for _ in range(2):  # warm-up: builds the kernels and fills every rank's workspace
        ring.run(True)
    graph = backend.new_graph()
    with backend.capture_graph(graph):
        captured = ring.run(True)
    assert all(led.allocations == 0 and led.peak_kv_shards == 4 for led in ring.ledgers)
    for shards in ring.shards:
        for x in shards:
            x.copy_(torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    inputs = [xcp.unshard([s[i] for s in ring.shards], balance="zigzag") for i in range(4)]
    want = reference(*inputs, causal)
    got = [xcp.unshard([r[1] for r in captured], balance="zigzag")]
    got += [xcp.unshard([r[2][i] for r in captured], balance="zigzag") for i in range(3)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert error(a, b).rel <= REL_TOLERANCE[torch.bfloat16], name


def _flash_on_this_gpu(**kwargs) -> CUDABackend:
    """A CUDA backend (built with ``kwargs``) whose bf16 blocks of head_dim 64 and 128 run on the flash op, or a
    skip."""
    backend = CUDABackend(**kwargs)
    if backend.kernel_for(torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")) != "flash":
        pytest.skip("needs an sm80+ GPU (the flash op)")
    return backend


def _range_error(out, lse, q, k, v, lo: int, hi: int, scale: float) -> tuple[float, float]:
    """forward_range's (relative 2-norm error of out, max abs error of lse) against float64 math of rows
    lo..hi-1; an empty range must be out 0 and lse -inf exactly (both errors then 0)."""
    if lo == hi:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        return 0.0, 0.0
    ref_out, ref_lse = _range_reference(q, k, v, lo, hi, scale)
    rel = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    return rel, (lse.double() - ref_lse).abs().max().item()


def _range_backend_on_this_gpu(on: bool) -> CUDABackend:
    """:func:`_flash_on_this_gpu` with forward_range's Triton kernels on (default ``fused_merge`` where triton is
    importable: a skip otherwise) or off."""
    if on and not kernels.triton_importable():
        pytest.skip("needs triton")
    backend = _flash_on_this_gpu() if on else _flash_on_this_gpu(fused_merge=False)
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    assert (backend._range_launcher(q) is backend.launcher) == on, "XCP_CUDA_FUSED_MERGE turned the default off?"
    return backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "b,t,hkv,lo,hi",
    [
        (1, 1, 2, 0, 300),  # decode, GQA: flash runs the query heads of a KV head as rows
        (3, 1, 2, 17, 1000),  # the same with a batch: its lse comes back in another order inside the op
        (2, 4, 8, 5, 1024),  # MHA, several queries, the range up to the room's end
        (2, 3, 1, 100, 100),  # empty
    ],
)
@pytest.mark.parametrize("fused_kernels", [True, False], ids=["triton", "torch-ops"])
def test_forward_range_matches_float64_math_on_a_gpu(b, t, hkv, lo, hi, fused_kernels):
    """bf16 forward_range (one flash varlen call) against float64 math of key rows lo..hi-1 on random inputs:
    out within a relative 2-norm error of 2e-2 (about 5 bf16 ulps, as the block test), lse within 1e-3
    (computed in float32 from the same bf16 inputs); the lengths and the empty rows' fix by the two Triton
    kernels (the fused kernels on, as by default where triton is installed) and by the torch ops."""
    backend = _range_backend_on_this_gpu(fused_kernels)
    room, h, d = 1024, 8, 128
    g = torch.Generator(device="cuda").manual_seed(b * 100 + lo)
    q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, room, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    lo_t, hi_t = (torch.tensor([x], device="cuda") for x in (lo, hi))
    out, lse = backend.forward_range(q, k, v, lo_t, hi_t, d**-0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (b, h, t)
    rel, lse_err = _range_error(out, lse, q, k, v, lo, hi, d**-0.5)
    assert rel <= 2e-2 and lse_err <= 1e-3, (rel, lse_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_kernels", [True, False], ids=["triton", "torch-ops"])
def test_forward_range_replays_from_a_cuda_graph_as_the_range_changes_on_the_device(fused_kernels):
    """forward_range captured once into a CUDA graph (with an empty range) replays right after lo and hi
    are changed on the device (fill_, copy_), and after q is: the lengths are recomputed at every replay,
    nothing of the range was frozen into the graph, and the capture itself read no value on the host. Both
    with the two Triton kernels (the default where triton is installed) and with the torch ops."""
    backend = _range_backend_on_this_gpu(fused_kernels)
    b, t, h, hkv, d, room = 2, 1, 8, 2, 64, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, room, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    lo, hi = torch.tensor([3], device="cuda"), torch.tensor([3], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        backend.forward_range(q, k, v, lo, hi, d**-0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = backend.new_graph()
    with backend.capture_graph(graph):
        out, lse = backend.forward_range(q, k, v, lo, hi, d**-0.5)
    for step, (new_lo, new_hi) in enumerate(((3, 3), (3, 4), (3, 200), (0, room), (40, 40), (40, 41))):
        lo.fill_(new_lo)
        hi.copy_(torch.tensor([new_hi], device="cuda"))
        if step == 4:
            q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        rel, lse_err = _range_error(out, lse, q, k, v, new_lo, new_hi, d**-0.5)
        assert rel <= 2e-2 and lse_err <= 1e-3, (new_lo, new_hi, rel, lse_err)


# ---------------------------------------------------------------------------------------------- P-way merge
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _partials(p, b, t, h, d, device="cpu", seed=0, dtype=torch.float32):
    """Packed partials [P, B, T, H, D + 1] as a KV cache gathers them: outs N(0, 1), lse 4 N(0, 1); about a
    third of the (rank, row) pairs saw nothing (lse -inf, out 0), and row (t 0, h 0) of every batch no rank
    saw at all."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(p, b, t, h, d + 1, generator=g, dtype=torch.float64)
    parts[..., d] *= 4
    unseen = torch.rand(p, b, t, h, generator=g) < 0.3
    unseen[:, :, :1, :1] = True
    parts[..., d][unseen] = NEG_INF
    parts[..., :d][unseen] = 0.0
    return parts.to(device=device, dtype=dtype)


PARTIAL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
"""The packings the fused merge serves: float32 [P, B, T, H, D + 1], and 16-bit [P, B, T, H, D + 2]."""


def _pack16(parts, dtype):
    """Float32 packed partials [P, B, T, H, D + 1] in the 16-bit packing [P, B, T, H, D + 2] of ``dtype``: the
    outs rounded to it (as a 16-bit attention kernel gives them), the float32 lse's bits in the last two."""
    d = parts.shape[-1] - 1
    packed = torch.empty((*parts.shape[:-1], d + 2), dtype=dtype, device=parts.device)
    packed[..., :d] = parts[..., :d]
    packed[..., d:].view(torch.float32)[..., 0] = parts[..., d]
    return packed


def _packed_partials(p, b, t, h, d, device="cpu", seed=0, dtype=torch.float32):
    """:func:`_partials` in the packing of ``dtype``: float32 [D + 1], or 16-bit [D + 2] (D even)."""
    parts = _partials(p, b, t, h, d, device=device, seed=seed)
    return parts if dtype == torch.float32 else _pack16(parts, dtype)


def _unpack(parts):
    """The (outs [P, B, T, H, D], lses [P, B, T, H]) of packed partials, both float32: channel D of a float32
    (or float64) packing, channels D, D + 1 viewed as float32 of a 16-bit one."""
    if parts.element_size() == 2:
        d = parts.shape[-1] - 2
        return parts[..., :d].float(), parts[..., d:].view(torch.float32)[..., 0]
    d = parts.shape[-1] - 1
    return parts[..., :d], parts[..., d]


def _float64_merge(parts):
    """float64 (out [B, T, H, D], lse [B, H, T]) of packed partials, written independently of the core's."""
    outs, lses = (x.double() for x in _unpack(parts))
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(lse == NEG_INF, 0.0, lse))
    return torch.einsum("pbth,pbthd->bthd", weights, outs), lse.transpose(1, 2)


def test_the_16_bit_packing_holds_the_float32_lse_bit_for_bit():
    """The test helpers' 16-bit packing: outs rounded once to the dtype, the float32 lse (-inf included) read
    back exactly through the float32 view of the last two channels."""
    parts = _partials(3, 2, 5, 4, 72)
    for dtype in (torch.bfloat16, torch.float16):
        packed = _pack16(parts, dtype)
        assert packed.shape == (3, 2, 5, 4, 74) and packed.dtype == dtype
        outs, lses = _unpack(packed)
        assert torch.equal(outs, parts[..., :72].to(dtype).float()) and torch.equal(lses, parts[..., 72])


def test_the_partials_merge_is_not_served_on_the_cpu_in_float64_or_when_the_fused_merge_is_off():
    """None (the cache's eager merge) for CPU tensors, with the fused merge off, for float64; the kernel's own
    check refuses float64, a non-contiguous buffer, mismatched shapes and too large a head_dim."""
    parts, out = _partials(3, 2, 5, 4, 16), torch.empty(2, 5, 4, 16)
    assert kernels.fused_merge_partials_supported(out, parts)
    for fused_merge in (True, False):
        assert CUDABackend(fused_merge=fused_merge).fused_merge_partials_(out, parts) is None
    assert CUDABackend(fused_merge=True).fused_merge_partials_(out.double(), parts.double()) is None
    big = kernels.PARTIALS_MAX_DIM + 1
    refused = [
        (out.double(), parts.double()),
        (out, parts.double()),
        (out, parts.transpose(1, 2).contiguous().transpose(1, 2)),  # right shape, not contiguous
        (out.transpose(1, 2).contiguous().transpose(1, 2), parts),
        (torch.empty(2, 5, 4, 15), parts),  # D + 1 != 17
        (torch.empty(2, 5, 3, 16), parts),
        (torch.empty(2, 5, 4, 16, 1), parts),
        (torch.empty(1, 1, 1, big), torch.empty(2, 1, 1, 1, big + 1)),
    ]
    for o, p in refused:
        assert not kernels.fused_merge_partials_supported(o, p)
        with pytest.raises(ValueError, match="out, parts: expected float32 contiguous"):
            kernels.fused_merge_partials_(o, p, kernels.Launcher(builders={}))
    assert kernels.fused_merge_partials_supported(torch.empty(1, 1, 1, 1024), torch.empty(2, 1, 1, 1, 1025))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_partials_merge_is_served_only_for_its_layout(dtype):
    """The 16-bit packing [P, B, T, H, D + 2] (D even) with a float32 out is the kernel's (two lse channels), on
    the CPU still not the backend's; refused: odd D, the float32 packing's D + 1 channels in 16 bits, a 16-bit
    out, mismatched dtypes, strided buffers, and a buffer that cannot be viewed as float32 (odd offset)."""
    parts, out = _packed_partials(3, 2, 5, 4, 16, dtype=dtype), torch.empty(2, 5, 4, 16)
    assert kernels.fused_merge_partials_supported(out, parts) and kernels.partials_lse_words(out, parts) == 2
    assert kernels.partials_lse_words(out, _partials(3, 2, 5, 4, 16)) == 1
    assert CUDABackend(fused_merge=True).fused_merge_partials_(out, parts) is None
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    odd = torch.empty(3 * 2 * 5 * 4 * 18 + 1, dtype=dtype)[1:].view(3, 2, 5, 4, 18)
    assert odd.is_contiguous() and odd.storage_offset() == 1
    refused = [
        (torch.empty(2, 5, 4, 15), torch.empty(3, 2, 5, 4, 17, dtype=dtype)),  # odd D: the lse not 4-byte aligned
        (out, torch.empty(3, 2, 5, 4, 17, dtype=dtype)),  # D + 1 channels in 16 bits
        (out, torch.empty(3, 2, 5, 4, 18)),  # D + 2 channels in float32
        (out.to(dtype), parts),  # out is the float32 accumulator
        (out.to(other), parts),
        (out.double(), parts),
        (out, parts.transpose(1, 2).contiguous().transpose(1, 2)),  # right shape, not contiguous
        (out.transpose(1, 2).contiguous().transpose(1, 2), parts),
        (out, odd),
        (torch.empty(2, 5, 3, 16), parts),
    ]
    for o, p in refused:
        assert not kernels.fused_merge_partials_supported(o, p) and kernels.partials_lse_words(o, p) == 0
        with pytest.raises(ValueError, match="out, parts: expected float32 contiguous"):
            kernels.fused_merge_partials_(o, p, kernels.Launcher(builders={}))


@pytest.mark.parametrize(
    "p,b,t,h,d,block_r,block_d,unroll,programs",
    [
        (8, 8, 1, 32, 128, 1, 128, 8, 256),  # decode: one row a program (8 programs would idle the GPU), P unrolled
        (8, 1, 4096, 32, 128, 16, 128, 2, 8192),  # a chunk: 2048 values a program, 16 a thread
        (1, 2, 3, 4, 72, 1, 128, 1, 24),  # D not a power of 2: the tile padded and masked
        (4, 1, 1024, 8, 576, 2, 1024, 2, 4096),
        (64, 1, 64, 8, 16, 2, 16, 32, 256),
        (64, 4, 1, 8, 512, 1, 512, 8, 32),
    ],
)
@pytest.mark.parametrize("dtype", PARTIAL_DTYPES)
def test_the_partials_merge_is_one_launch_writing_out_and_a_b_h_t_lse(
    p, b, t, h, d, block_r, block_d, unroll, programs, dtype
):
    """One launch of the partials kernel with the grid, tiles and unroll of :func:`kernels.partials_tiling`
    (at most 32 loads of out in flight a thread), the P partials' strides, and a fresh float32 lse [B, H, T]
    (contiguous) it writes and returns; a signature seen before launches directly; no rows: no launch. The
    outs are read through the buffer itself, the lses through it as float32: for the float32 packing the
    same tensor (one lse word, rows of D + 1), for a 16-bit one its float32 view (two words: rows of D + 2
    16-bit values, (D + 2) / 2 float32 ones)."""
    fake = _FakeJit()
    launch = kernels.Launcher(fast=True, builders={"partials": lambda: fake})
    words = 1 if dtype == torch.float32 else 2
    parts = torch.empty(p, b, t, h, d + words, dtype=dtype)
    out = torch.empty(b, t, h, d)
    lse = kernels.fused_merge_partials_(out, parts, launch)
    assert lse.shape == (b, h, t) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert len(fake.jit_calls) == 1 and not fake.direct_calls
    grid, o, lo, outs, lses, *ints = fake.jit_calls[0]
    assert grid == (programs,) and o is out and lo is lse and outs is parts
    if words == 1:
        assert lses is parts
    else:
        assert lses.dtype == torch.float32 and lses.shape == (p, b, t, h, (d + 2) // 2) and lses.is_contiguous()
        assert lses.data_ptr() == parts.data_ptr()
    row = b * t * h * (d + words)
    assert ints == [b * t * h, t, h, d, row, row // words, *lse.stride(), block_r, block_d, p, unroll, words]
    assert kernels.partials_tiling(b * t * h, d, p) == ((programs,), block_r, block_d, unroll)
    assert unroll * max(1, block_r * block_d // 128) <= kernels.PARTIALS_IN_FLIGHT or unroll == 1
    kernels.fused_merge_partials_(out, parts, launch)
    assert len(fake.jit_calls) == 1 and len(fake.direct_calls) == 1 and fake.direct_calls[0][0] == (programs, 1, 1)
    empty = torch.empty(p, b, 0, h, d + words, dtype=dtype)
    none = kernels.fused_merge_partials_(torch.empty(b, 0, h, d), empty, launch)
    assert none.shape == (b, h, 0) and len(fake.jit_calls) + len(fake.direct_calls) == 2


def test_the_partials_packings_compile_apart():
    """The float32, bfloat16 and float16 packings of one shape are three signatures (each its own compile, the
    launcher's key holding the outs' dtype and the lse words); each seen again launches directly."""
    fake = _FakeJit()
    launch = kernels.Launcher(fast=True, builders={"partials": lambda: fake})
    out = torch.empty(1, 4, 2, 16)
    for _ in range(2):
        for dtype in PARTIAL_DTYPES:
            kernels.fused_merge_partials_(out, _packed_partials(3, 1, 4, 2, 16, dtype=dtype), launch)
    assert len(fake.jit_calls) == 3 and len(fake.direct_calls) == 3
    assert [call[3].dtype for call in fake.jit_calls] == PARTIAL_DTYPES
    assert [call[-1] for call in fake.jit_calls] == [1, 2, 2]


_INTERPRETED = """
import math, torch
from xcp.inference.partials import merge_into as _merge_into
from xcp_cuda import kernels
SHAPES = ((1, 2, 3, 4, 64), (3, 1, 5, 3, 72), (5, 2, 64, 4, 16), (5, 1, 2, 2, 576), (40, 1, 3, 2, 8), (2, 1, 3, 2, 128))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for p, b, t, h, d in SHAPES:
        g = torch.Generator().manual_seed(p)
        outs = torch.randn(p, b, t, h, d, generator=g).to(dtype)
        lses = torch.randn(p, b, t, h, generator=g) * 4
        unseen = torch.rand(p, b, t, h, generator=g) < 0.3
        unseen[:, :, :1, :1] = True
        lses[unseen] = -math.inf
        outs[unseen] = 0.0
        if dtype == torch.float32:  # [D + 1]: the lse in channel D
            parts = torch.cat([outs, lses.unsqueeze(-1)], dim=-1)
        else:  # [D + 2]: the float32 lse's bits in channels D, D + 1
            parts = torch.empty(p, b, t, h, d + 2, dtype=dtype)
            parts[..., :d] = outs
            parts[..., d:].view(torch.float32)[..., 0] = lses
        out = torch.full((b, t, h, d), math.nan)
        lse = kernels.fused_merge_partials_(out, parts)
        want = torch.empty_like(out)
        want_lse = _merge_into(want, outs.float(), lses)
        assert not out.isnan().any() and not lse.isnan().any(), (dtype, p, d)
        assert (out[:, 0, 0] == 0).all() and torch.isneginf(lse[:, 0, 0]).all(), (dtype, p, d)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
        if p == 1:  # one rank's partial comes back as it is
            assert torch.equal(out, outs[0].float()) and torch.equal(lse, lses[0].transpose(1, 2))
print("interpreted ok")
"""


@NEEDS_TRITON
def test_the_partials_kernel_under_tritons_interpreter_equals_the_eager_merge():
    """The kernel itself, run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1, in a fresh process:
    triton reads it at import), against the cache's eager merge (float32, to 1e-6), for the float32 packing
    [D + 1] and the bfloat16 and float16 ones [D + 2] (outs converted in registers, the lse read through the
    float32 view): P = 1 (its partial back as it is), D 72 and 576 (padded tiles) and 128, several rows a
    program, partials left over after the unrolled groups (P 5 by 4) and groups looped over (P 40 by 32),
    rows some ranks or no rank saw (out 0, lse -inf, no NaN)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "interpreted ok" in run.stdout, run.stdout + run.stderr


_RANGE_INTERPRETED = """
import math, torch
from xcp_cuda import kernels
launch = kernels.Launcher()
CASES = ((1, 1, 5, 0, 0), (3, 2, 7, 2, 5), (4, 1, 9, 9, 9), (2, 3, 6, 0, 6), (1, 4, 8, 3, 3), (6, 1, 16, 5, 4),
         (1500, 1, 4, 1, 3))
for b, t, room, lo, hi in CASES:  # the lengths kernel against the torch ops (lo > hi too: hi - lo < 0 as they give it)
    for shape in ((), (1,)):
        lo_t, hi_t = torch.tensor(lo).reshape(shape), torch.tensor(hi).reshape(shape)
        want = kernels.range_lengths(b, t, room, lo_t, hi_t)
        got = kernels.range_lengths(b, t, room, lo_t, hi_t, launch)
        for w, g in zip(want, got):
            assert g.dtype == torch.int32 and g.shape == w.shape and torch.equal(g, w), (b, t, room, lo, hi)


class Op:  # the varlen op's results: random out, lse +inf on some rows (out NaN there, as nothing wrote them)
    def __init__(self, seed, dtype):
        self.seed, self.dtype = seed, dtype

    def _flash_attention_forward(self, q, k, v, cq, ck, max_q, max_k, *args, scale, seqused_k):
        g = torch.Generator().manual_seed(self.seed)
        n, h, d = q.shape
        out = torch.randn(n, h, d, generator=g).to(self.dtype)
        lse = torch.randn(h, n, generator=g)
        unseen = torch.rand(h, n, generator=g) < 0.3
        unseen[0, 0] = True
        lse[unseen] = math.inf
        out[unseen.transpose(0, 1)] = math.nan
        return out, lse, None, None, None


for b, t, room, lo, hi in CASES[:6]:
    for h, hkv, d in ((4, 2, 8), (2, 2, 72), (8, 1, 128), (2, 1, 256)):
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.randn(b, t, h, d).to(dtype)
            k = v = torch.randn(b, room, hkv, d).to(dtype)
            lo_t, hi_t = torch.tensor([lo]), torch.tensor([hi])
            kernels.ATEN = Op(b * 1000 + d, dtype)
            want_out, want_lse = kernels.flash_range_forward(q, k, v, lo_t, hi_t, 0.3)
            got_out, got_lse = kernels.flash_range_forward(q, k, v, lo_t, hi_t, 0.3, launch)
            for got, want in ((got_out, want_out), (got_lse, want_lse)):
                assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride()
                assert torch.equal(got, want), (b, t, room, lo, hi, h, d, dtype)
            assert not got_out.isnan().any() and torch.isneginf(got_lse).any()
            if hi <= lo:
                assert torch.equal(got_out, torch.zeros_like(got_out)) and torch.isneginf(got_lse).all()
# a strided lse [H, N] (the kernel takes its strides)
out = torch.randn(6, 3, 40)
lse = torch.randn(6, 3).transpose(0, 1)
lse[1, 2] = math.inf
want_out, want_lse = out.clone(), lse.clone()
kernels.blind_rows_(want_out, want_lse, torch.tensor(2), torch.tensor(5), None)
kernels.blind_rows_(out, lse, torch.tensor(2), torch.tensor(5), launch)
assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and want_lse[1, 2] == -math.inf
print("interpreted ok")
"""


@NEEDS_TRITON
def test_the_forward_range_kernels_under_tritons_interpreter_equal_the_torch_ops():
    """forward_range's two Triton kernels, run on CPU tensors by Triton's interpreter, against the torch-op path
    bit for bit: the lengths for several B (1500: more than one program), T, room, lo and hi (lo == hi, lo > 0,
    lo > hi), lo and hi 0-d or [1]; and flash_range_forward around a stand-in varlen op whose lse is +inf (out
    NaN) on some rows: those rows, and every row of an empty range, out 0 and lse -inf, the rest untouched,
    head_dim 8 to 256 (72: a padded tile), bfloat16 and float16, results' shapes, dtypes and strides alike."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _RANGE_INTERPRETED
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "interpreted ok" in run.stdout, run.stdout + run.stderr


PARTIAL_SHAPES = [
    (1, 2, 3, 4, 64),  # one rank: its partial as it is
    (2, 1, 5, 3, 72),  # D not a power of 2
    (8, 8, 1, 32, 128),  # decode
    (8, 1, 512, 32, 128),  # a chunk: 32 rows a program
    (5, 2, 7, 4, 576),  # D > 512
    (3, 1, 33, 2, 512),
    (64, 1, 2, 4, 128),  # many ranks
]


@NEEDS_TRITON
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", PARTIAL_DTYPES)
@pytest.mark.parametrize("p,b,t,h,d", PARTIAL_SHAPES)
def test_the_partials_merge_equals_the_eager_merge_and_float64_on_a_gpu(p, b, t, h, d, dtype):
    """On a GPU, for the float32 packing and the 16-bit ones: the fused P-way merge writes every element of
    out (NaN before) and returns lse [B, H, T] equal to the cache's eager merge of the unpacked partials
    (float32, to 1e-5) and to float64 math (to 1e-5 of the largest value); rows no rank saw are out 0 and
    lse -inf, nothing is NaN, and the partials are left as they were (bit for bit)."""
    from xcp.inference.partials import merge_into as _merge_into

    backend = CUDABackend(fused_merge=True)
    parts = _packed_partials(p, b, t, h, d, device="cuda", seed=p + d, dtype=dtype)
    before = parts.clone()
    out = torch.full((b, t, h, d), math.nan, device="cuda")
    lse = backend.fused_merge_partials_(out, parts)
    assert lse is not None and lse.shape == (b, h, t) and lse.dtype == torch.float32 and lse.is_contiguous()
    outs, lses = _unpack(parts)
    want = torch.empty_like(out)
    want_lse = _merge_into(want, outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, 0, 0], torch.zeros_like(out[:, 0, 0])) and torch.isneginf(lse[:, 0, 0]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    # float32 sums of P weighted terms in another order, with the GPU's exp and log: a few ulps per term
    # (2e-6 relative seen on the H200 at P = 8, D = 128): 1e-5, i.e. about 80 ulps
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    ref_out, ref_lse = _float64_merge(parts)
    _close("out", out, ref_out, 1e-5)
    _close("lse", lse, ref_lse, 1e-5)
    assert torch.equal(parts.view(torch.uint8), before.view(torch.uint8))
    if p == 1:  # one rank's partial comes back as it is
        assert torch.equal(out, outs[0]) and torch.equal(lse, lses[0].transpose(1, 2))


@NEEDS_TRITON
@NEEDS_CUDA
def test_the_partials_merge_is_not_served_for_float64_or_strided_buffers_on_a_gpu():
    """On a GPU too: float64 partials and buffers that are not contiguous go to the eager merge (None), and so
    does everything with the fused merge turned off; of the 16-bit packings, odd D, D + 1 channels, a 16-bit
    out and strided buffers."""
    parts, out = _partials(3, 2, 5, 4, 16, device="cuda"), torch.empty(2, 5, 4, 16, device="cuda")
    backend = CUDABackend(fused_merge=True)
    assert backend.fused_merge_partials_(out.double(), parts.double()) is None
    assert backend.fused_merge_partials_(out, parts.transpose(1, 2).contiguous().transpose(1, 2)) is None
    assert CUDABackend(fused_merge=False).fused_merge_partials_(out, parts) is None
    assert backend.fused_merge_partials_(out, parts) is not None
    for dtype in (torch.bfloat16, torch.float16):
        packed = _pack16(parts, dtype)
        assert backend.fused_merge_partials_(out, packed) is not None
        assert CUDABackend(fused_merge=False).fused_merge_partials_(out, packed) is None
        odd_out = torch.empty(2, 5, 4, 15, device="cuda")
        assert backend.fused_merge_partials_(odd_out, torch.empty(3, 2, 5, 4, 17, device="cuda", dtype=dtype)) is None
        assert backend.fused_merge_partials_(out, parts.to(dtype)) is None  # D + 1 channels in 16 bits
        assert backend.fused_merge_partials_(out.to(dtype), packed) is None
        assert backend.fused_merge_partials_(out, packed.transpose(1, 2).contiguous().transpose(1, 2)) is None


@NEEDS_TRITON
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", PARTIAL_DTYPES)
def test_the_partials_merge_replays_from_a_cuda_graph_on_a_gpu(dtype):
    """Captured once into a CUDA graph (the current stream then is the capture's side stream: a launch on any
    other stream would fail the capture or be missing from the replays), the merge replays on partials
    written in place, each replay equal to the eager merge; the lse it returned is the graph's output."""
    from xcp.inference.partials import merge_into as _merge_into

    p, b, t, h, d = 8, 4, 1, 8, 128
    backend = CUDABackend(fused_merge=True)
    parts = _packed_partials(p, b, t, h, d, device="cuda", dtype=dtype)
    out = torch.empty(b, t, h, d, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: the kernel compiled before the capture
        backend.fused_merge_partials_(out, parts)
    torch.cuda.current_stream().wait_stream(side)
    graph = backend.new_graph()
    with backend.capture_graph(graph):
        lse = backend.fused_merge_partials_(out, parts)
    assert lse is not None
    for seed in (1, 2, 3):
        parts.copy_(_packed_partials(p, b, t, h, d, device="cuda", seed=seed, dtype=dtype))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.empty_like(out)
        want_lse = _merge_into(want, *_unpack(parts))
        assert not out.isnan().any() and torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # as in the test above
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- value head dims


@pytest.mark.parametrize(
    ("dtype", "dims", "kind"),
    [
        (torch.bfloat16, (128, 128), "flash"),
        (torch.bfloat16, (192, 128), "efficient"),  # flash takes one head dim; cuDNN is asked per block
        (torch.bfloat16, (128, 64), "efficient"),
        (torch.bfloat16, (576, 512), "efficient"),
        (torch.bfloat16, (192, 100), "math"),  # a value dim off the 8-alignment
        (torch.float32, (12, 8), "efficient"),
        (torch.float32, (12, 6), "math"),
        (torch.float64, (12, 8), "math"),
    ],
)
def test_choose_kernel_with_values_of_another_head_dim(dtype, dims, kind):
    assert kernels.choose_kernel(dtype, dims[0], (9, 0), dims[1]) == kind


@pytest.mark.parametrize("dims", [(24, 16), (16, 24)])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
def test_dense_blocks_with_values_of_another_head_dim(monkeypatch, dims, mask, gqa):
    """A dense block whose values have another head dim: not flash (one head dim); efficient here (the
    stand-in's SDPA dispatcher is not asked on CPU tensors), out and dv in v's dim, against the math kernel."""
    backend, fake = _cpu_backend(monkeypatch, gqa=gqa)
    q, k, _ = _block(2, 6, 6, 4, 2, dims[0], dtype=torch.float16, seed=11)
    v = _rand(2, 6, 2, dims[1], dtype=torch.float16, seed=12)
    assert backend.block_kernel(q, k, mask == "causal", v) == "efficient"
    out, lse = backend.forward(q, k, v, mask, 0.2)
    want_out, want_lse = math_forward(q, k, v, mask, 0.2)
    assert out.shape == (2, 6, 4, dims[1])
    _close("out", out, want_out, 4e-3)
    _close("lse", lse, want_lse, 4e-3)
    dout = _rand(*out.shape, dtype=torch.float16, seed=13)
    grads = backend.backward(dout, q, k, v, out, lse, mask, 0.2)
    wants = math_backward(dout, q, k, v, out, lse, mask, 0.2)
    for name, got, want in zip(("dq", "dk", "dv"), grads, wants):
        assert got.shape == want.shape
        _close(name, got, want, 1e-2)
    assert {c[0] for c in fake.calls} == {"efficient_fwd", "efficient_bwd"}


@pytest.mark.parametrize("dims", [(24, 16), (16, 24)])
@pytest.mark.parametrize("layout", ["causal", "full"])
def test_varlen_pads_values_of_another_head_dim_to_one_flash_call(monkeypatch, dims, layout):
    """Packed segments with values of another head dim: the narrower side padded with zeros to the wider
    for one flash varlen call (flash takes one head dim), the results sliced back; against the math kernel."""
    cu_q, cu_k, causal = VARLEN_LAYOUTS[layout]
    backend, fake = _cpu_backend(monkeypatch)
    q, k, _ = _varlen_block(cu_q, cu_k, 4, 2, dims[0], torch.bfloat16, seed=14)
    v = _rand(1, cu_k[-1], 2, dims[1], dtype=torch.bfloat16, seed=15)
    before = [x.clone() for x in (q, k, v)]
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, 0.3)
    dout = _rand(*out.shape, dtype=torch.bfloat16, seed=16)
    grads = backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, 0.3)
    assert [c[0] for c in fake.calls] == ["flash_varlen_fwd", "flash_varlen_bwd"]
    base = xcp.Backend
    want_fwd = base.forward_varlen(backend, q, k, v, cu_q, cu_k, causal, 0.3)
    want_bwd = base.backward_varlen(backend, dout, q, k, v, out, lse, cu_q, cu_k, causal, 0.3)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*want_fwd, *want_bwd)):
        assert got.shape == want.shape, name
        _close(name, got, want, 2e-2)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), before))


def test_varlen_and_ranges_too_wide_for_flash_take_the_base_class(monkeypatch):
    """576/512 (absorbed MLA decode): no flash call at that width; one dense call per segment, and the KV
    cache's range through the masked math; both right."""
    backend, fake = _cpu_backend(monkeypatch)
    cu = (0, 3, 7)
    q, k, _ = _varlen_block(cu, cu, 2, 1, 576, torch.bfloat16, seed=17)
    v = _rand(1, 7, 1, 512, dtype=torch.bfloat16, seed=18)
    out, lse = backend.forward_varlen(q, k, v, cu, cu, True, 0.05)
    assert out.shape == (1, 7, 2, 512) and "flash_varlen_fwd" not in [c[0] for c in fake.calls]
    want_out, want_lse = xcp.Backend.forward_varlen(backend, q, k, v, cu, cu, True, 0.05)
    _close("out", out, want_out, 2e-2)
    rq, rk, _, lo, hi = _range_inputs(2, 1, 2, 1, 8, 1, 5, torch.bfloat16, head_dim=576, seed=19)
    rv = _rand(2, 8, 1, 512, dtype=torch.bfloat16, seed=20)
    fake.calls.clear()
    out, lse = backend.forward_range(rq, rk, rv, lo, hi, 0.05)
    assert fake.calls == [] and out.shape == (2, 1, 2, 512)
    want_out, want_lse = math_forward_range(rq, rk, rv, lo, hi, 0.05)
    _close("out", out, want_out, 2e-2)


@pytest.mark.parametrize(("sq", "sk", "squares", "rest"), [(12, 6, 2, 0), (6, 12, 2, 0), (6, 6, 1, 0), (7, 3, 2, 1)])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
def test_an_unmasked_cudnn_backward_with_values_of_another_head_dim_runs_as_causal_calls(
    monkeypatch, sq, sk, squares, rest, gqa
):
    """192/128's unmasked cuDNN backward costs more per pair than its causal one: such a block's backward is
    cut into squares, each a causal call and a causal call on its reversed rows and keys (a rest that is not
    square one unmasked call); the gradients equal the math kernel's. Equal head dims, or causal_backward
    off, keep one unmasked call."""
    monkeypatch.setattr(backend_module, "CAUSAL_BACKWARD_MIN", 2)
    monkeypatch.setattr(kernels, "SDPA_CHOICE", _sdpa_choice("CUDNN_ATTENTION", []))
    q, k, _ = _block(2, sq, sk, 4, 2, 24, dtype=torch.bfloat16, seed=21)
    for dv, on, split in ((16, True, True), (16, False, False), (24, True, False)):
        backend, fake = _cpu_backend(monkeypatch, gqa=gqa, causal_backward=on)
        v = _rand(2, sk, 2, dv, dtype=torch.bfloat16, seed=22)
        out, lse = backend.forward(q, k, v, "none", 0.2)
        dout = _rand(*out.shape, dtype=torch.bfloat16, seed=23)
        before = [x.clone() for x in (dout, q, k, v, out, lse)]
        fake.calls.clear()
        grads = backend.backward(dout, q, k, v, out, lse, "none", 0.2)
        calls = [(c[1], c[2], c[4]) for c in fake.calls]
        if split:
            side = min(sq, sk)
            causal = [c for c in calls if c[2]]
            assert len(causal) == 2 * squares and all(a == b for a, b, _ in causal), calls
            assert {a for a, _, _ in causal} == {side, side - 1}
            assert len(calls) - len(causal) == rest
            assert all(g.dtype == torch.float32 for g in grads)
        else:
            assert calls == [(sq, sk, False)]
        wants = math_backward(dout, q, k, v, out, lse, "none", 0.2)
        for name, got, want in zip(("dq", "dk", "dv"), grads, wants):
            assert got.shape == want.shape
            _close(name, got, want, 2e-2)
        assert all(torch.equal(x, y) for x, y in zip((dout, q, k, v, out, lse), before))
