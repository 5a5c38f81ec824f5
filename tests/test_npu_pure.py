"""xcp_npu on a CPU: the pure conversions, and the backend's methods against a stand-in torch_npu.

The stand-in (tests/npu_standin.py) follows what torch_npu's and CANN's sources state for npu_fusion_attention(_grad)
and refuses the rest as the op would: float16 / bfloat16 / float32 only, computed in float32; 1..256 query heads;
Dq = Dk >= Dv up to 768, the TND grad up to 512; BSND and TND (cumulative host lists without a leading 0, statistics
[T, N, 8] laid out per segment as the kernels write them, or token-major with softmax_layout="TND"); sparse_mode 0,
3 (the compressed 2048x2048 mask) and 4 (a band counted from each segment's bottom-right corner); no segment without
keys, no row without a key in TND; no call while capturing. References are float64 math on the whole block or segment.

Windows: a stand-in built with band_origin="top_left" shows the tests would catch a backend relying on the other
alignment. KV-cache ranges (forward_range): the one TND call against the base class's masked math; empty ranges, refused
head dims, float64 and graph capture go to that default without calling the op. Values of another head dim (MLA:
192/128, 128/64, 64/128, 576/512): dense blocks, packed segments and ranges against float64 math, dims above 768 against
the math fallback. Rings (documents, windows) run through xcp.attention over virtual ranks; the other public entry
points (KVCache, the transformers drop-in) and the op's limits are tested in tests/test_npu_public.py.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import installed
from npu_standin import FakeTorchNPU, NPUGlueOnCPU, NPUOnCPU, public_attention
from strategies import assert_close_to

from xcp.backends.base import Backend
from xcp.backends.fused import widen_head_dim
from xcp.kernels.math import allowed_keys, math_backward, math_forward
from xcp_npu import NPUBackend, convert

MASKS = ("none", "causal", "strict")
NEG_INF = float("-inf")


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _scores_bnss(q, k, scale, allowed):
    """Scaled scores [B, N, Sq, Sk] in float64 from BSND q, k (K heads repeated), masked to -inf."""
    groups = q.shape[2] // k.shape[2]
    s = torch.einsum("bqnd,bknd->bnqk", q.double(), k.double().repeat_interleave(groups, 2)) * scale
    return s.masked_fill(~allowed, NEG_INF)


def _npu_stats(s):
    """What the NPU returns for scores s: softmax_max (row max) and softmax_sum (Σ exp(s - max)), 8 copies."""
    m = s.amax(-1)
    total = torch.exp(s - torch.where(m == NEG_INF, 0.0, m).unsqueeze(-1)).sum(-1)
    widen = lambda x: x.unsqueeze(-1).expand(*x.shape, 8).float().contiguous()  # noqa: E731
    return widen(m), widen(total)


# ---------------------------------------------------------------------------------------------- lse conversion
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("groups", [1, 2])
def test_lse_round_trip_through_npu_statistics(mask, groups):
    """A block computed by xcp.kernels.math.math_forward; softmax statistics built as the NPU returns them; the
    converted lse must equal the true one (and -inf on rows that see no key, never NaN)."""
    b, s, n, d = 2, 6, 2 * groups, 8
    q, k = _rand(b, s, n, d, seed=1), _rand(b, s, 2, d, seed=2)
    v = _rand(b, s, 2, d, seed=3)
    scale = 1 / math.sqrt(d)
    _, true_lse = math_forward(q, k, v, mask, scale)
    allowed = allowed_keys(s, s, mask)
    allowed = torch.ones(s, s, dtype=torch.bool) if allowed is None else allowed
    smax, ssum = _npu_stats(_scores_bnss(q, k, scale, allowed))
    assert smax.shape == (b, n, s, 8) and smax.dtype == torch.float32
    lse = convert.lse_from_softmax_stats(smax, ssum)
    assert lse.shape == (b, n, s) and lse.dtype == torch.float32
    assert_close_to("lse", lse, true_lse, 1e-6)  # float32 statistics: a few ulps of values O(1)
    if mask == "strict":
        assert (lse[:, :, 0] == NEG_INF).all()


def test_softmax_stats_from_lse_reproduce_the_probabilities():
    s = _rand(1, 2, 3, 5, seed=4)
    s[0, 0, 1] = NEG_INF  # a row that sees no key
    lse = torch.logsumexp(s, -1).float()
    smax, ssum = convert.softmax_stats_from_lse(lse)
    assert smax.shape == ssum.shape == (1, 2, 3, 8) and smax.is_contiguous() and ssum.is_contiguous()
    assert (smax == smax[..., :1]).all() and (ssum == 1).all()
    assert smax[0, 0, 1, 0] == math.inf  # -inf lse: the kernel's exp(x - max) is 0, not NaN
    p = torch.exp(s - smax[..., :1].double()) / ssum[..., :1].double()
    ref = torch.softmax(s, -1).nan_to_num(0.0)
    assert not torch.isnan(p).any() and torch.allclose(p, ref, atol=1e-6)


def test_lse_conversion_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"softmax_max: expected shape \[B, N, Sq, 8\]; got \(1, 2, 3\)"):
        convert.lse_from_softmax_stats(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="softmax_sum: expected shape"):
        convert.lse_from_softmax_stats(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="lse: expected 3 dims"):
        convert.softmax_stats_from_lse(torch.zeros(1, 2, 3, 8))


def test_zero_sum_rows_give_minus_inf_not_nan():
    smax = torch.tensor([0.5, NEG_INF, 3.0]).reshape(1, 1, 3, 1).expand(1, 1, 3, 8)
    ssum = torch.tensor([2.0, 0.0, 0.0]).reshape(1, 1, 3, 1).expand(1, 1, 3, 8)
    lse = convert.lse_from_softmax_stats(smax, ssum)
    assert lse[0, 0, 0].item() == pytest.approx(0.5 + math.log(2.0)) and (lse[0, 0, 1:] == NEG_INF).all()


# ---------------------------------------------------------------------------------------------- mask arguments
def test_causal_mask_and_sparse_args():
    m = convert.causal_mask()
    assert m.shape == (2048, 2048) and m.dtype == torch.bool
    assert torch.equal(m, ~torch.ones(2048, 2048, dtype=torch.bool).tril())
    causal = convert.sparse_args(True, m)
    assert causal["sparse_mode"] == 3 and causal["atten_mask"] is m
    none = convert.sparse_args(False, None)
    assert none["sparse_mode"] == 0 and none["atten_mask"] is None
    assert none["pre_tockens"] == none["next_tockens"] == 2147483647
    with pytest.raises(ValueError, match=r"mask: expected a bool \[2048, 2048\] tensor"):
        convert.sparse_args(True, m[:16, :16])
    with pytest.raises(ValueError, match="mask: expected"):
        convert.sparse_args(True, None)


def test_output_and_square_checks():
    q, v = torch.zeros(2, 5, 4, 8), torch.zeros(2, 3, 2, 8)
    good = (torch.zeros(2, 5, 4, 8), torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 5, 8), torch.zeros(0), 0, 0, 0)
    assert convert.check_forward_outputs(q, v, good)[0] is good[0]
    with pytest.raises(ValueError, match=r"attention_out: expected shape \(2, 5, 4, 8\) \(BSND\)"):
        convert.check_forward_outputs(q, v, (torch.zeros(2, 4, 5, 8), *good[1:]))
    with pytest.raises(ValueError, match=r"softmax_sum: expected shape \(2, 4, 5, 8\)"):
        convert.check_forward_outputs(q, v, (good[0], good[1], torch.zeros(2, 4, 5, 1), *good[3:]))
    convert.check_square(q, q, True)
    with pytest.raises(ValueError, match="k: a causal kernel call needs as many keys as queries"):
        convert.check_square(q, v, True)


# ---------------------------------------------------------------------------------------------- stand-in torch_npu
@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def _npu_on_cpu(gqa="native"):
    return NPUOnCPU(gqa=gqa)  # the glue on CPU tensors, against the stand-in


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(6, 6), (7, 4), (4, 7), (1, 1)])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_against_math(fake_npu, mask, sq, sk, gqa, dtype, tol):
    """float32 (the stand-in computes in float32, as the device does: errors ~1e-7 of values O(1)) and bfloat16
    (inputs and outputs rounded to 8 bits: ~4e-3 relative) against float64 math; far below what a wrong mask, head
    mapping or lse would give (O(0.1))."""
    backend = _npu_on_cpu(gqa)
    h, hkv, d = 4, 2, 16
    q, k = _rand(2, sq, h, d, dtype=dtype, seed=1), _rand(2, sk, hkv, d, dtype=dtype, seed=2)
    v = _rand(2, sk, hkv, d, dtype=dtype, seed=3)
    scale = 1 / math.sqrt(d)
    out, lse = backend.forward(q, k, v, mask, scale)
    ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), mask, scale)
    assert_close_to("out", out, ref_out, tol)
    assert_close_to("lse", lse, ref_lse, tol)
    dout = _rand(*out.shape, dtype=dtype, seed=4)
    merged_lse = torch.where(lse == NEG_INF, 0.3, lse + 0.2)  # a merged lse: the row saw more keys elsewhere
    merged_out = _rand(*out.shape, dtype=dtype, seed=5)
    grads = backend.backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    ref = math_backward(dout.double(), q.double(), k.double(), v.double(), merged_out.double(), merged_lse, mask, scale)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert a.dtype in (dtype, torch.float32)  # two tiles adding into the same keys sum in float32
        assert_close_to(name, a, b, tol)
    assert fake_npu.calls or (mask == "strict" and sq == 1), "the kernel was never called"  # 1x1 strict: empty
    for _, csq, csk, kv_heads, sparse_mode in fake_npu.calls:
        assert sparse_mode in (0, 3) and (sparse_mode == 0 or csq == csk)  # causal only on square calls
        assert kv_heads == (hkv if gqa == "native" else h)


def test_backend_does_not_mutate_inputs(fake_npu):
    backend = _npu_on_cpu()
    f32 = torch.float32
    q, k, v = _rand(1, 5, 2, 16, dtype=f32, seed=1), _rand(1, 5, 1, 16, dtype=f32, seed=2), _rand(1, 5, 1, 16, seed=3)
    v, lse = v.float(), _rand(1, 2, 5, dtype=f32, seed=6)
    dout, out = _rand(1, 5, 2, 16, dtype=f32, seed=4), _rand(1, 5, 2, 16, dtype=f32, seed=5)
    before = [x.clone() for x in (q, k, v, dout, out, lse)]
    backend.forward(q, k, v, "strict", 0.25)
    backend.backward(dout, q, k, v, out, lse, "strict", 0.25)
    for x, y in zip((q, k, v, dout, out, lse), before):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------- availability
def test_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # "import torch_npu" raises ModuleNotFoundError
    backend = NPUBackend()
    ok, reason = backend.available()
    assert not ok and reason.startswith("torch_npu is not importable: ") and "torch_npu" in reason[28:]
    q = torch.zeros(1, 2, 1, 16)
    backend.device_type = "cpu"
    with pytest.raises(RuntimeError, match="xcp_npu needs torch_npu, which is not importable: "):
        backend.forward(q, q, q, "none", 1.0)


def test_reason_is_the_import_error(monkeypatch, tmp_path):
    """torch-npu installed without CANN: its import fails on a missing shared library."""
    (tmp_path / "torch_npu.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    backend = NPUBackend()
    assert backend.available() == (
        False,
        "torch_npu is not importable: libhccl.so: cannot open shared object file: No such file or directory",
    )
    assert backend.available()[0] is False  # remembered, asked again without raising


def test_available_never_raises_when_the_device_query_fails(fake_npu):
    ok, reason = NPUBackend().available()  # torch.npu does not exist on this torch: the query raises
    assert not ok and reason.startswith("no Ascend device: ")


def test_identity_and_gqa_flag(monkeypatch):
    b = NPUBackend()
    assert (b.name, b.device_type, b.dist_backend, b.handoff_policy) == ("npu", "npu", "hccl", "clone")
    monkeypatch.setenv("XCP_NPU_GQA", "repeat")
    assert NPUBackend().gqa == "repeat"
    with pytest.raises(ValueError, match="gqa: expected one of native, repeat; got 'x'"):
        NPUBackend(gqa="x")


# ---------------------------------------------------------------------------------------------- packed segments (TND)
def _segment_reference(q, k, v, cu_q, cu_k, causal, scale, dout=None, out=None, lse=None):
    """float64 math per segment, concatenated: (out, lse), or (dq, dk, dv) from the merged out/lse."""
    mask = "causal" if causal else "none"
    parts = []
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        q_, k_, v_ = q[:, qs].double(), k[:, ks].double(), v[:, ks].double()
        if dout is None:
            parts.append(math_forward(q_, k_, v_, mask, scale))
        else:
            do, o, x = dout[:, qs].double(), out[:, qs].double(), lse[:, :, qs]
            parts.append(math_backward(do, q_, k_, v_, o, x, mask, scale))
    if dout is None:
        return torch.cat([o for o, _ in parts], 1), torch.cat([x for _, x in parts], 2)
    return tuple(torch.cat([g[i] for g in parts], 1) for i in range(3))


def _packed(tq, tk, h, hkv, d, dtype, seed=1):
    """q [1, tq, h, d], k/v [1, tk, hkv, d]: non-contiguous views (heads-first storage, k and v interleaved)."""
    q = _rand(1, h, tq + 3, d, dtype=dtype, seed=seed)[:, :, 2 : 2 + tq].transpose(1, 2)
    kv = _rand(1, tk + 1, 2, hkv, d, dtype=dtype, seed=seed + 1)[:, 1:]
    k, v = kv[:, :, 0], kv[:, :, 1]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    return q, k, v


SEGMENTS = {  # (cu_q, cu_k) for unmasked runs; causal runs use cu_q for both
    "three": ((0, 1, 5, 12), (0, 3, 4, 10)),
    "ones": ((0, 1, 2, 3), (0, 1, 2, 3)),
    "one": ((0, 6), (0, 9)),
}


@pytest.mark.parametrize("layout", convert.TND_STATS_LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5)])
def test_varlen_against_float64_segments(monkeypatch, layout, causal, segments, gqa, dtype, tol):
    """One TND call per direction, in either stats layout, agreeing with float64 math per segment (the stand-in
    writes per segment, as the kernels do, or token-major when asked with softmax_layout="TND")."""
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    backend = NPUBackend(gqa=gqa, tnd_stats=layout)
    backend.device_type = "cpu"
    cu_q, cu_k = SEGMENTS[segments]
    cu_k = cu_q if causal else cu_k
    h, hkv, d = 4, 2, 16
    q, k, v = _packed(cu_q[-1], cu_k[-1], h, hkv, d, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    ref_out, ref_lse = _segment_reference(q, k, v, cu_q, cu_k, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, h, cu_q[-1]) and lse.dtype == torch.float32
    assert_close_to("out", out, ref_out, tol)
    assert_close_to("lse", lse, ref_lse, tol)

    dout = _rand(*out.shape, dtype=dtype, seed=4)
    merged_lse = ref_lse.float() + 0.2  # the rows saw more keys in other blocks
    merged_out = _rand(*out.shape, dtype=dtype, seed=5)
    grads = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    ref = _segment_reference(q, k, v, cu_q, cu_k, causal, scale, dout, merged_out, merged_lse.double())
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == dtype
        assert_close_to(name, got, want, tol)

    assert fake.calls == [], "packed segments must not fall back to dense calls"
    kv_heads = hkv if gqa == "native" else h
    sparse_mode = 3 if causal else 0
    softmax_layout = "TND" if layout == "tnd" else ""
    for op, call in zip(("fwd", "bwd"), fake.varlen_calls, strict=True):
        assert call == (op, list(cu_q[1:]), list(cu_k[1:]), kv_heads, sparse_mode, softmax_layout, *[2147483647] * 2)


def test_varlen_stats_layout_mismatch_is_visible(monkeypatch):
    """With several segments the per-segment and token-major layouts differ: a kernel writing token-major rows
    without being asked (not what the sources say it does) gives the backend's default a wrong lse, so the stand-in
    would catch a conversion that ignored the layout."""
    cu = (0, 2, 5, 9)
    q, k, v = _packed(9, 9, 4, 4, 16, torch.float32)
    ref_out, ref_lse = _segment_reference(q, k, v, cu, cu, False, 0.25)
    for hardware in ("segment", "tnd"):
        monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNPU(tnd_stats=hardware))
        out, lse = NPUOnCPU(tnd_stats="segment").forward_varlen(q, k, v, cu, cu, False, 0.25)
        assert_close_to("out", out, ref_out, 1e-5)  # the output ignores the statistics' layout
        err = (lse - ref_lse).abs().max().item()
        assert (err < 1e-5) == (hardware == "segment"), (hardware, err)


def test_varlen_argument_building():
    assert convert.actual_seq_lens((0, 3, 8, 12), 12) == [3, 8, 12]
    assert convert.actual_seq_lens((0, 1), 1) == [1] and type(convert.actual_seq_lens((0, 1), 1)[0]) is int
    mask = convert.causal_mask()
    causal = convert.varlen_args((0, 2, 5), (0, 2, 5), True, 5, 5, mask)
    assert causal["actual_seq_qlen"] == causal["actual_seq_kvlen"] == [2, 5]
    assert causal["sparse_mode"] == 3 and causal["atten_mask"] is mask
    none = convert.varlen_args((0, 2, 5), (0, 4, 6), False, 5, 6, None)
    assert none == {
        "actual_seq_qlen": [2, 5],
        "actual_seq_kvlen": [4, 6],
        "atten_mask": None,
        "sparse_mode": 0,
        "pre_tockens": 2147483647,
        "next_tockens": 2147483647,
    }
    assert convert.VARLEN_LAYOUT == "TND"
    assert convert.softmax_layout_args("tnd") == {"softmax_layout": "TND"}
    assert convert.softmax_layout_args("segment") == {}
    with pytest.raises(ValueError, match=r"cu_q: expected cumulative boundaries from 0 to 5; got \(1, 5\)"):
        convert.actual_seq_lens((1, 5), 5)
    with pytest.raises(ValueError, match=r"cu_k: expected cumulative boundaries from 0 to 6; got \(0, 5\)"):
        convert.varlen_args((0, 5), (0, 5), False, 5, 6, None)
    with pytest.raises(ValueError, match="cu_q: expected strictly increasing boundaries"):
        convert.actual_seq_lens((0, 2, 2, 5), 5)
    with pytest.raises(ValueError, match="cu_k: expected 2 segments"):
        convert.varlen_args((0, 2, 5), (0, 5), False, 5, 5, None)
    with pytest.raises(ValueError, match="cu_k: causal segments must be square"):
        convert.varlen_args((0, 2, 5), (0, 3, 5), True, 5, 5, mask)
    with pytest.raises(ValueError, match="mask: expected a bool"):
        convert.varlen_args((0, 5), (0, 5), True, 5, 5, None)
    with pytest.raises(ValueError, match="tnd_stats: expected one of segment, tnd; got 'global'"):
        convert.check_tnd_stats("global")


def test_segments_empty_on_both_sides_are_left_out():
    """The kernel's cumulative lists take no empty segment: one without queries and keys is dropped (at the start,
    several in a row, at the end); one empty on a single side is still refused, by name."""
    cu_q, cu_k = (0, 0, 2, 2, 2, 5, 5), (0, 0, 4, 4, 4, 6, 6)
    assert convert.nonempty_segments(cu_q, cu_k) == ((0, 2, 5), (0, 4, 6))
    assert convert.varlen_args(cu_q, cu_k, False, 5, 6, None) == convert.varlen_args(
        (0, 2, 5), (0, 4, 6), False, 5, 6, None
    )
    mask = convert.causal_mask()
    causal = convert.varlen_args((0, 0, 2, 2, 5), (0, 0, 2, 2, 5), True, 5, 5, mask)
    assert causal["actual_seq_qlen"] == causal["actual_seq_kvlen"] == [2, 5]
    with pytest.raises(ValueError, match=r"cu_q: expected strictly increasing boundaries \(no empty segment"):
        convert.varlen_args((0, 2, 2, 5), (0, 2, 4, 6), False, 5, 6, None)
    with pytest.raises(ValueError, match=r"cu_k: expected strictly increasing boundaries \(no empty segment"):
        convert.varlen_args((0, 2, 3, 5), (0, 4, 4, 6), False, 5, 6, None)
    with pytest.raises(ValueError, match=r"cu_k: expected 3 segments \(as cu_q\); got 2"):
        convert.nonempty_segments((0, 0, 2, 5), (0, 2, 5))


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_varlen_with_empty_segments_against_float64(strict_npu, causal):
    """Through the stand-in that refuses empty segments: the packed call with segments empty on both sides equals
    float64 math on the non-empty ones, forward and backward."""
    backend = _npu_on_cpu()
    given_q, given_k = ((0, 0, 3, 3, 3, 7, 7), (0, 0, 5, 5, 5, 9, 9))
    cu_q, cu_k = (0, 3, 7), (0, 5, 9)
    if causal:
        given_k, cu_k = given_q, cu_q
    q, k, v = _packed(cu_q[-1], cu_k[-1], 4, 2, 16, torch.float32)
    scale = 0.25
    out, lse = backend.forward_varlen(q, k, v, given_q, given_k, causal, scale)
    ref_out, ref_lse = _segment_reference(q, k, v, cu_q, cu_k, causal, scale)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-6)
    dout = _rand(*out.shape, dtype=torch.float32, seed=4)
    grads = backend.backward_varlen(dout, q, k, v, out, lse, given_q, given_k, causal, scale)
    ref = _segment_reference(q, k, v, cu_q, cu_k, causal, scale, dout, ref_out, ref_lse)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_close_to(name, got, want, 1e-5)
    assert [c[1:3] for c in strict_npu.varlen_calls] == [(list(cu_q[1:]), list(cu_k[1:]))] * 2


@pytest.mark.parametrize("layout", convert.TND_STATS_LAYOUTS)
def test_tnd_statistics_conversion(layout):
    """The merged lse goes in as softmax_max (+inf where -inf) with sum 1, each value on the stand-in's row for
    its (token, head); the stand-in's statistics come back as the true lse, -inf where the sum is 0."""
    fake, cu, n = FakeTorchNPU(), (0, 3, 4, 9), 2
    t = cu[-1]
    lse = _rand(1, n, t, seed=7).float()
    lse[0, 1, 3] = NEG_INF
    smax, ssum = convert.tnd_stats_from_lse(lse, cu, layout)
    assert smax.shape == ssum.shape == (t, n, 8) and smax.dtype == torch.float32 and smax.is_contiguous()
    assert (ssum == 1).all() and (smax == smax[..., :1]).all()
    rows = smax.reshape(t * n, 8)[:, 0]
    for q0, q1 in zip(cu, cu[1:]):
        for h in range(n):
            want = torch.where(lse[0, h, q0:q1] == NEG_INF, math.inf, lse[0, h, q0:q1])
            assert torch.equal(rows[fake.stat_rows(layout, t, n, q0, q1, h)], want)
    back = convert.lse_from_tnd_stats(smax, torch.where(smax.isinf(), 0.0, ssum), cu, layout)
    assert back.shape == (1, n, t) and torch.equal(back, lse)
    with pytest.raises(ValueError, match=r"softmax_max: expected shape \(9, 2, 8\) \(TND statistics\)"):
        convert.lse_from_tnd_stats(smax[:8], ssum[:8], cu, layout)
    with pytest.raises(ValueError, match=r"softmax_max: expected shape \[9, N, 8\]"):
        convert.lse_from_tnd_stats(smax[None], ssum[None], cu, layout)
    with pytest.raises(ValueError, match=r"lse: expected shape \[1, N, 9\]"):
        convert.tnd_stats_from_lse(lse[0], cu, layout)


def test_varlen_checks_kernel_outputs(fake_npu, monkeypatch):
    backend = _npu_on_cpu()
    q, k, v = _packed(5, 5, 4, 2, 16, torch.float32)
    good = fake_npu.npu_fusion_attention

    def returning(fix):
        monkeypatch.setattr(fake_npu, "npu_fusion_attention", lambda *a, **kw: fix(good(*a, **kw)))

    returning(lambda o: (o[0].unsqueeze(0), *o[1:]))  # a BSND output
    with pytest.raises(ValueError, match=r"attention_out: expected shape \(5, 4, 16\) \(TND\); got \(1, 5, 4, 16\)"):
        backend.forward_varlen(q, k, v, (0, 2, 5), (0, 2, 5), True, 0.25)
    returning(lambda o: (o[0], o[1].reshape(1, 4, 5, 8), *o[2:]))  # BNSD statistics
    with pytest.raises(ValueError, match=r"softmax_max: expected shape \(5, 4, 8\) \(TND statistics\)"):
        backend.forward_varlen(q, k, v, (0, 2, 5), (0, 2, 5), True, 0.25)
    returning(lambda o: o[0])
    with pytest.raises(ValueError, match="npu_fusion_attention: expected at least 3 outputs; got Tensor"):
        backend.forward_varlen(q, k, v, (0, 2, 5), (0, 2, 5), True, 0.25)


@pytest.mark.parametrize("case", ["batch2", "float64", "d784"])
def test_varlen_falls_back_to_dense_calls(fake_npu, case):
    """What the fused TND op does not take goes to Backend's per-segment default: batch > 1 (one dense call per
    segment and direction), float64 and head dims above 768 (the math, no op call at all)."""
    backend = _npu_on_cpu()
    cu_q = cu_k = (0, 2, 7)
    batch, d = (2, 16) if case == "batch2" else (1, 784 if case == "d784" else 16)
    dtype = torch.float64 if case == "float64" else torch.float32
    q, k = _rand(batch, 7, 4, d, dtype=dtype, seed=1), _rand(batch, 7, 2, d, dtype=dtype, seed=2)
    v = _rand(batch, 7, 2, d, dtype=dtype, seed=3)
    assert convert.varlen_unsupported(q, k)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, True, 0.3)
    ref_out, ref_lse = _segment_reference(q, k, v, cu_q, cu_k, True, 0.3)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    dout = _rand(*out.shape, dtype=dtype, seed=4)
    grads = backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, True, 0.3)
    ref = _segment_reference(q, k, v, cu_q, cu_k, True, 0.3, dout, out, lse.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_close_to(name, got, want, 1e-5)
    assert fake_npu.varlen_calls == [] and len(fake_npu.calls) == (4 if case == "batch2" else 0)


def test_varlen_supported_shapes():
    q, k = torch.zeros(1, 3, 8, 128), torch.zeros(1, 3, 2, 128)
    assert convert.varlen_unsupported(q, k) is None
    assert convert.varlen_unsupported(torch.zeros(1, 3, 8, 768), torch.zeros(1, 3, 8, 768)) is None  # the forward
    assert convert.varlen_unsupported(torch.zeros(1, 3, 8, 24), torch.zeros(1, 3, 8, 24)) is None  # D 1..768, any D
    assert "up to 768" in convert.varlen_unsupported(torch.zeros(1, 3, 8, 784), torch.zeros(1, 3, 8, 784))
    assert "float64" in convert.varlen_unsupported(q.double(), k.double())
    assert "3 K/V heads do not divide 8" in convert.varlen_unsupported(q, torch.zeros(1, 3, 3, 128))


def test_varlen_does_not_mutate_inputs(fake_npu):
    backend = _npu_on_cpu()
    cu = (0, 1, 5)
    q, k, v = _packed(5, 5, 2, 1, 16, torch.float64)
    dout, out, lse = _rand(1, 5, 2, 16, seed=4), _rand(1, 5, 2, 16, seed=5), _rand(1, 2, 5, seed=6).float()
    before = [x.clone() for x in (q, k, v, dout, out, lse)]
    backend.forward_varlen(q, k, v, cu, cu, True, 0.25)
    backend.backward_varlen(dout, q, k, v, out, lse, cu, cu, True, 0.25)
    for x, y in zip((q, k, v, dout, out, lse), before):
        assert torch.equal(x, y)


def test_tnd_stats_flag(monkeypatch):
    """``segment`` (what the kernels write) or ``tnd``; the former ``global`` reading is refused by name."""
    assert NPUBackend().tnd_stats == "segment"
    monkeypatch.setenv("XCP_NPU_TND_STATS", "tnd")
    assert NPUBackend().tnd_stats == "tnd" and NPUBackend(tnd_stats="segment").tnd_stats == "segment"
    with pytest.raises(ValueError, match="tnd_stats: expected one of segment, tnd; got 'global'"):
        NPUBackend(tnd_stats="global")
    monkeypatch.setenv("XCP_NPU_TND_STATS", "global")
    with pytest.raises(ValueError, match="XCP_NPU_TND_STATS: expected one of segment, tnd"):
        NPUBackend()


@pytest.mark.parametrize("balance", ["zigzag", "stripe"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
def test_ring_with_documents_uses_tnd_calls(fake_npu, balance, causal):
    """xcp.attention over P = 2 virtual ranks, packed documents: the ring's varlen runs go through one TND call each
    and the result is per-document float64 attention, forward and backward."""
    p, s, h, hkv, d = 2, 24, 4, 2, 16
    docs = (0, 3, 4, 13, 20, 24)
    scale = 1 / math.sqrt(d)
    q, k, v, dout = (_rand(1, s, n, d, dtype=torch.float32, seed=i) for i, n in enumerate((h, hkv, hkv, h)))
    with installed(NPUGlueOnCPU()):
        got = public_attention(p, q, k, v, dout, balance, causal=causal, cu_seqlens=torch.tensor(docs))
    ref_out, ref_lse = _segment_reference(q, k, v, docs, docs, causal, scale)
    ref = _segment_reference(q, k, v, docs, docs, causal, scale, dout, ref_out, ref_lse)
    assert_close_to("out", got[0], ref_out, 1e-5)
    for name, g, want in zip(("dq", "dk", "dv"), got[1:], ref):
        assert_close_to(name, g, want, 1e-5)
    assert fake_npu.varlen_calls, "the plan had no multi-segment run: pick other documents"


# ---------------------------------------------------------------------------------------------- windows (sparse_mode 4)
WINDOWS = [(0, 0), (2, 1), (5, 0), (1, 7)]
BAND_SEGMENTS = {  # (cu_q, cu_k); per segment sq - sk in the comment
    "wide": ((0, 2, 5, 9), (0, 6, 10, 17)),  # -4, -1, -3: sq < sk
    "tall": ((0, 4, 10, 13), (0, 3, 8, 11)),  # +1, +1, 0: sq > sk
    "mixed": ((0, 2, 7, 10, 11), (0, 5, 9, 12, 14)),  # -3, +1, 0, -1
    "steep": ((0, 9, 11), (0, 3, 8)),  # +6, -3
}


def _math_band(backend, q, k, v, cu_q, cu_k, scale, window, dout=None, out=None, lse=None):
    """The base class's per-segment math band (xcp.kernels.math) in float64: forward (out, lse) or (dq, dk, dv)."""
    q, k, v = (x.double() for x in (q, k, v))
    if dout is None:
        return Backend.forward_varlen(backend, q, k, v, cu_q, cu_k, False, scale, window)
    args = (dout.double(), q, k, v, out.double(), lse.double(), cu_q, cu_k, False, scale, window)
    return Backend.backward_varlen(backend, *args)


def _fused(cu_q, cu_k, window) -> bool:
    """Whether the backend serves the window with the fused op: every query of every segment sees a key."""
    return all((b - a) - (d - c) <= window[1] for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))


def test_band_arguments():
    mask = convert.causal_mask()
    band = convert.band_args((5, 0), mask)
    assert band["atten_mask"] is mask and (band["sparse_mode"], band["pre_tockens"], band["next_tockens"]) == (4, 5, 0)
    args = convert.varlen_args((0, 2, 5), (0, 4, 6), False, 5, 6, mask, (1, 7))
    assert (args["actual_seq_qlen"], args["actual_seq_kvlen"]) == ([2, 5], [4, 6])
    assert (args["sparse_mode"], args["pre_tockens"], args["next_tockens"]) == (4, 1, 7) and args["atten_mask"] is mask
    assert type(args["pre_tockens"]) is int and type(args["next_tockens"]) is int
    with pytest.raises(ValueError, match=r"window: a window goes with causal=False; got causal=True"):
        convert.varlen_args((0, 5), (0, 5), True, 5, 5, mask, (1, 0))
    for bad in [(-1, 0), (1,), (1.0, 2), (True, 0), None, "ab"]:
        with pytest.raises(ValueError, match=r"window: expected a pair \(left, right\) of ints >= 0"):
            convert.band_args(bad, mask)
    with pytest.raises(ValueError, match=r"mask: expected a bool \[2048, 2048\] tensor; got None"):
        convert.varlen_args((0, 5), (0, 5), False, 5, 5, None, (1, 0))
    assert convert.band_has_empty_rows((0, 2, 5), (0, 4, 6), (0, 1)) is None  # 2 x 4, then 3 x 2 ...
    why = convert.band_has_empty_rows((0, 2, 5), (0, 4, 6), (9, 0))  # ... whose first query needs right >= 1
    assert why == "segment 1 (3 queries, 2 keys): its first 1 queries see no key in (9, 0)"
    why = convert.band_has_empty_rows((0, 2, 7), (0, 4, 6), (3, 1))
    assert why == "segment 1 (5 queries, 2 keys): its first 2 queries see no key in (3, 1)"


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("segments", list(BAND_SEGMENTS))
@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5)])
def test_varlen_window_against_the_math_band(fake_npu, window, segments, gqa, dtype, tol):
    """A window on packed segments (sq < sk, sq > sk, square): one TND call per direction with sparse_mode 4,
    pre_tockens = left, next_tockens = right, agreeing with the base class's math band; a window under which some
    query sees no key (TND forbids such rows) goes to the base class and still agrees."""
    backend = _npu_on_cpu(gqa)
    cu_q, cu_k = BAND_SEGMENTS[segments]
    h, hkv, d = 4, 2, 16
    q, k, v = _packed(cu_q[-1], cu_k[-1], h, hkv, d, dtype)
    scale = 1 / math.sqrt(d)
    fused = _fused(cu_q, cu_k, window)
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, False, scale, window)
    ref_out, ref_lse = _math_band(backend, q, k, v, cu_q, cu_k, scale, window)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, h, cu_q[-1]) and lse.dtype == torch.float32
    assert_close_to("out", out, ref_out, tol)
    assert_close_to("lse", lse, ref_lse, tol)

    dout = _rand(*out.shape, dtype=dtype, seed=4)
    merged_lse = torch.where(ref_lse == NEG_INF, 0.3, ref_lse + 0.2).float()  # the rows saw more keys elsewhere
    merged_out = _rand(*out.shape, dtype=dtype, seed=5)
    grads = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, False, scale, window)
    ref = _math_band(backend, q, k, v, cu_q, cu_k, scale, window, dout, merged_out, merged_lse)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == dtype
        assert_close_to(name, got, want, tol)

    assert fake_npu.calls == [], "a window must not go to dense calls"
    kv_heads = hkv if gqa == "native" else h
    expected = [(op, list(cu_q[1:]), list(cu_k[1:]), kv_heads, 4, "", *window) for op in ("fwd", "bwd")]
    assert fake_npu.varlen_calls == (expected if fused else [])
    assert fused == (convert.band_has_empty_rows(cu_q, cu_k, window) is None)


def test_window_cases_cover_fused_and_fallback():
    """The cases above serve sq > sk with the fused op, and send a band with empty rows to the base class."""
    fused = {(name, w): _fused(*cu, w) for name, cu in BAND_SEGMENTS.items() for w in WINDOWS}
    assert all(fused["wide", w] for w in WINDOWS)
    assert fused["tall", (2, 1)] and fused["steep", (1, 7)] and fused["mixed", (1, 7)]
    assert not fused["tall", (0, 0)] and not fused["steep", (2, 1)] and not fused["mixed", (5, 0)]


def test_band_origin_mismatch_is_visible(monkeypatch):
    """A kernel counting pre_tockens/next_tockens from the top-left corner gives other outputs when sq != sk: the
    tests above would catch a backend relying on the wrong alignment (on square segments the two coincide)."""
    scale, window = 0.25, (2, 1)
    for name, differs in (("wide", True), ("square", False)):
        cu_q, cu_k = BAND_SEGMENTS["wide"] if name == "wide" else ((0, 4, 9), (0, 4, 9))
        q, k, v = _packed(cu_q[-1], cu_k[-1], 4, 2, 16, torch.float32)
        for origin in ("bottom_right", "top_left"):
            monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNPU(band_origin=origin))
            backend = _npu_on_cpu()
            out, _ = backend.forward_varlen(q, k, v, cu_q, cu_k, False, scale, window)
            ref_out, _ = _math_band(backend, q, k, v, cu_q, cu_k, scale, window)
            err = (out - ref_out).abs().max().item()
            assert (err < 1e-5) == (origin == "bottom_right" or not differs), (name, origin, err)


@pytest.mark.parametrize("balance", ["zigzag", "stripe"])
@pytest.mark.parametrize("causal,window", [(False, (3, 2)), (True, (5, None)), (False, (0, 6))], ids=str)
def test_ring_with_a_window_uses_band_calls(fake_npu, monkeypatch, balance, causal, window):
    """xcp.attention over P = 2 virtual ranks, packed documents and a sliding window: every banded run is one fused
    TND call per direction (sparse_mode 4; the ring never asks for a band with an empty row) and the result is
    per-document float64 attention under the window, forward and backward."""
    from xcp import documents

    empty = []
    check = convert.band_has_empty_rows
    monkeypatch.setattr(convert, "band_has_empty_rows", lambda *a: empty.append(check(*a)) or empty[-1])
    p, s, h, hkv, d = 2, 24, 4, 2, 16
    docs = (0, 3, 4, 13, 20, 24)
    scale = 1 / math.sqrt(d)
    win = documents.check_window(window, causal)
    q, k, v, dout = (_rand(1, s, n, d, dtype=torch.float32, seed=i) for i, n in enumerate((h, hkv, hkv, h)))
    with installed(NPUGlueOnCPU()):
        got = public_attention(p, q, k, v, dout, balance, causal=causal, cu_seqlens=torch.tensor(docs), window=window)
    band = (win[0], s if win[1] is None else win[1])  # each document is square: both alignments agree
    parts = []
    for a, b in zip(docs, docs[1:]):
        qd, kd, vd, dd = (x[:, a:b].double() for x in (q, k, v, dout))
        o, x = math_forward(qd, kd, vd, "none", scale, band)
        parts.append((o, *math_backward(dd, qd, kd, vd, o, x, "none", scale, band)))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_close_to(name, got[i], torch.cat([part[i] for part in parts], 1), 1e-5)
    bands = [c for c in fake_npu.varlen_calls if c[4] == 4]
    assert bands and empty and all(why is None for why in empty), "every window call must go to the fused op"
    assert all(c[6:] == (c[6], c[7]) and c[6] >= 0 and c[7] >= 0 for c in bands)


# ---------------------------------------------------------------------------------------------- KV-cache ranges
@pytest.fixture
def strict_npu(fake_npu):
    return fake_npu  # the stand-in is as strict as the sources everywhere


def _cache(b, t, room, h=4, hkv=2, d=16, dtype=torch.float32):
    """q [b, t, h, d] and contiguous storage k, v [b, room, hkv, d] (every row finite, as a cache's stale rows are)."""
    q = _rand(b, t, h, d, dtype=dtype, seed=1)
    k, v = (_rand(b, room, hkv, d, dtype=dtype, seed=i) for i in (2, 3))
    return q, k, v


def _range_reference(q, k, v, lo, hi, scale):
    """The base class's masked math in float64 (lse float64 too)."""
    return Backend.forward_range(Backend(), q.double(), k.double(), v.double(), lo, hi, scale)


RANGES = [  # (b, t, lo, hi, gqa, tnd_stats): T = 1 and T > 1, lo = 0 and lo > 0, B = 1 and B > 1, one key, the room
    (1, 1, 0, 7, "native", "segment"),
    (3, 1, 2, 9, "native", "tnd"),
    (2, 3, 4, 5, "repeat", "tnd"),
    (2, 2, 0, 12, "native", "segment"),
    (3, 2, 5, 11, "native", "segment"),
]


@pytest.mark.parametrize("b,t,lo,hi,gqa,layout", RANGES, ids=str)
def test_forward_range_against_the_math_default(monkeypatch, b, t, lo, hi, gqa, layout):
    """One TND call (B segments of T queries against their own copy of keys lo..hi-1, cumulative lists, no mask) that
    agrees with the base class's masked math, whatever the stats layout; out in q's dtype, lse float32 [B, H, T]."""
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    backend = NPUOnCPU(gqa=gqa, tnd_stats=layout)
    room, h, hkv = 12, 4, 2
    q, k, v = _cache(b, t, room)
    scale = 0.25
    before = [x.clone() for x in (q, k, v)]
    lo_t, hi_t = torch.tensor(lo), torch.tensor([hi])  # one element: a 0-d tensor or a 1-d one
    out, lse = backend.forward_range(q, k, v, lo_t, hi_t, scale)
    ref_out, ref_lse = _range_reference(q, k, v, lo_t, hi_t, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, t) and lse.dtype == torch.float32
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), before))
    n = hi - lo
    kv_heads = hkv if gqa == "native" else h
    softmax_layout = "TND" if layout == "tnd" else ""
    qlen, kvlen = [t * (i + 1) for i in range(b)], [n * (i + 1) for i in range(b)]
    assert fake.varlen_calls == [("fwd", qlen, kvlen, kv_heads, 0, softmax_layout, 2147483647, 2147483647)]
    assert fake.calls == []


@pytest.mark.parametrize("lo", [0, 5])
def test_forward_range_empty_range_gives_zeros_and_minus_inf(strict_npu, lo):
    """lo == hi: out exactly 0 and lse -inf on every row, never NaN, and no call of the op (which takes no segment
    without keys); the base class's default agrees."""
    backend = _npu_on_cpu()
    q, k, v = _cache(2, 3, 8)
    out, lse = backend.forward_range(q, k, v, torch.tensor(lo), torch.tensor(lo), 0.25)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, 3) and lse.dtype == torch.float32
    assert (out == 0).all() and (lse == NEG_INF).all()
    ref_out, ref_lse = _range_reference(q, k, v, torch.tensor(lo), torch.tensor(lo), 0.25)
    assert_close_to("out", out, ref_out, 0.0)
    assert_close_to("lse", lse, ref_lse, 0.0)
    assert strict_npu.varlen_calls == [] and strict_npu.calls == []


@pytest.mark.parametrize("case", ["d784", "float64", "capturing"])
def test_forward_range_falls_back_to_the_math_default(strict_npu, case):
    """Head dims the op refuses, float64, and a stream under graph capture (the op's host lengths would be frozen into
    the graph, and the op does not support aclgraph: the stand-in refuses any call then) go to the base class's masked
    math: no op call, no host read, the same result."""
    backend = _npu_on_cpu()
    d = 784 if case == "d784" else 16
    dtype = torch.float64 if case == "float64" else torch.float32
    q, k, v = _cache(2, 1, 9, d=d, dtype=dtype)
    if case == "capturing":
        strict_npu.capturing = True
    else:
        assert convert.range_unsupported(q, k, v)
    lo, hi = torch.tensor(3), torch.tensor(8)
    reads = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert, "range_bounds", lambda *a: reads.append(a))
        out, lse = backend.forward_range(q, k, v, lo, hi, 0.3)
    assert reads == [], "read lo/hi on the host"
    ref_out, ref_lse = _range_reference(q, k, v, lo, hi, 0.3)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if case == "float64" else torch.float32)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    assert strict_npu.varlen_calls == [] and strict_npu.calls == []


def test_forward_range_with_more_than_256_query_heads(strict_npu):
    """A KV cache's range with 300 query heads over 3 K/V heads: calls of at most 256 heads (whole GQA groups of
    100), the same result as the masked math."""
    backend = _npu_on_cpu()
    q, k, v = _cache(2, 1, 9, h=300, hkv=3)
    lo, hi = torch.tensor(2), torch.tensor(7)
    out, lse = backend.forward_range(q, k, v, lo, hi, 0.25)
    ref_out, ref_lse = _range_reference(q, k, v, lo, hi, 0.25)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    assert strict_npu.head_nums == [100, 200] and len(strict_npu.varlen_calls) == 2


def test_range_arguments():
    assert convert.range_cuts(3, 2) == (0, 2, 4, 6) and convert.range_cuts(2, 0) == (0, 0, 0)
    assert convert.range_bounds(torch.tensor(2), torch.tensor([7]), 7) == (2, 7)
    assert type(convert.range_bounds(torch.tensor(0), torch.tensor(0), 4)[0]) is int
    with pytest.raises(ValueError, match=r"lo, hi: expected 0 <= lo <= hi <= 7 \(the storage's room\); got 5, 3"):
        convert.range_bounds(torch.tensor(5), torch.tensor(3), 7)
    with pytest.raises(ValueError, match="lo, hi: expected 0 <= lo <= hi <= 7 .*; got 0, 8"):
        convert.range_bounds(torch.tensor(0), torch.tensor(8), 7)
    with pytest.raises(ValueError, match=r"hi: expected an integer tensor of one element; got torch.int64 \(2,\)"):
        convert.range_bounds(torch.tensor(0), torch.tensor([1, 2]), 7)
    with pytest.raises(ValueError, match="lo: expected an integer tensor of one element; got torch.float32"):
        convert.range_bounds(torch.tensor(0.0), torch.tensor(1), 7)
    q, k = torch.zeros(2, 1, 8, 128), torch.zeros(2, 9, 2, 128)
    assert convert.range_unsupported(q, k, k) is None
    assert "dtypes torch.float64" in convert.range_unsupported(q.double(), k.double(), k.double())
    assert convert.range_unsupported(q[..., :8], k[..., :8], k[..., :8]) is None  # D 1..768, not only multiples of 16
    wide_q, wide_k = torch.zeros(2, 1, 8, 784), torch.zeros(2, 9, 2, 784)
    assert "up to 768" in convert.range_unsupported(wide_q, wide_k, wide_k)
    assert "3 K/V heads do not divide 8" in convert.range_unsupported(q, k[:, :, :1].expand(2, 9, 3, 128), k)
    big_q, big_k = torch.zeros(1025, 1, 8, 16), torch.zeros(1025, 2, 8, 16)
    assert "batch 1025" in convert.range_unsupported(big_q, big_k, big_k)
    lse = torch.arange(2 * 3 * 4.0).reshape(1, 2, 12)  # N = 2 heads, B = 3 entries of T = 4 queries
    assert torch.equal(convert.range_lse(lse, 3), lse[0].reshape(2, 3, 4).transpose(0, 1))


# ---------------------------------------------------------------------------------------------- value head dims (MLA)
VALUE_DIMS = [(192, 128), (128, 64), (64, 128), (576, 512)]
"""(q/k head dim, v head dim), as tests/test_value_dim.py: DeepSeek-V3's, a smaller pair, the other way round (the op
refuses Dv > Dk: q and k go padded), absorbed MLA decode's (with one K/V head)."""


def _mla_heads(dqk, dv):
    """(H, Hkv): absorbed MLA decode has one K/V head; the others GQA."""
    return (2, 1) if (dqk, dv) == (576, 512) else (4, 2)


def _called_dims(dqk, dv):
    """(Dq, Dk, Dv) the op must be called with: as given when Dv < Dqk, q and k zero-padded to Dv when Dv > Dqk."""
    width = max(dqk, dv)
    return width, width, dv


def _mla(b, sq, sk, dqk, dv, dtype=torch.float32):
    """q [b, sq, H, dqk]; k [b, sk, Hkv, dqk] and v [b, sk, Hkv, dv], views of one [.., dqk + dv] tensor as the split
    of an MLA up-projection gives them (strided)."""
    h, hkv = _mla_heads(dqk, dv)
    q = _rand(b, sq, h, dqk, dtype=dtype, seed=1)
    kv = _rand(b, sk, hkv, dqk + dv, dtype=dtype, seed=2)
    return q, kv[..., :dqk], kv[..., dqk:]


@pytest.mark.parametrize("dims", VALUE_DIMS, ids=str)
@pytest.mark.parametrize("mask,sq,sk", [("causal", 5, 5), ("strict", 6, 4), ("none", 3, 7)])
def test_value_dims_dense_against_math(fake_npu, dims, mask, sq, sk):
    """Block forward and backward (the fused mask tiling, empty rows included) against float64 math: out and dv in v's
    head dim, dq and dk in q's; the op sees Dq = Dk >= Dv only (the stand-in refuses the rest, as the docs do)."""
    backend = _npu_on_cpu()
    dqk, dv = dims
    q, k, v = _mla(2, sq, sk, dqk, dv)
    scale = dqk**-0.5
    out, lse = backend.forward(q, k, v, mask, scale)
    ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), mask, scale)
    assert out.shape == (*q.shape[:3], dv) and out.dtype == q.dtype
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    dout, merged_out = _rand(*out.shape, seed=4), _rand(*out.shape, seed=5)
    merged_lse = torch.where(lse == NEG_INF, 0.3, lse + 0.2)  # the rows saw more keys elsewhere
    grads = backend.backward(dout.float(), q, k, v, merged_out.float(), merged_lse, mask, scale)
    ref = math_backward(dout, q.double(), k.double(), v.double(), merged_out, merged_lse.double(), mask, scale)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert_close_to(name, got, want, 1e-5)
    assert len(fake_npu.calls) >= 2 and set(fake_npu.head_dims) == {_called_dims(dqk, dv)}


def _packed_mla(tq, tk, dqk, dv):
    """q [1, tq, H, dqk], k / v [1, tk, Hkv, dqk / dv]: strided views (heads-first q; k and v split from one tensor)."""
    h, hkv = _mla_heads(dqk, dv)
    q = _rand(1, h, tq + 3, dqk, dtype=torch.float32, seed=1)[:, :, 2 : 2 + tq].transpose(1, 2)
    kv = _rand(1, tk + 1, hkv, dqk + dv, dtype=torch.float32, seed=2)[:, 1:]
    return q, kv[..., :dqk], kv[..., dqk:]


@pytest.mark.parametrize("dims", VALUE_DIMS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_value_dims_varlen_against_float64_segments(strict_npu, dims, causal):
    """Packed segments: one TND forward (576/512 too: the forward takes D up to 768) and one TND grad, except where the
    call's head dim is above the TND grad's 512 (576/512): one BSND grad call per segment; against float64 math per
    segment, through the stand-in that refuses a TND grad past 512."""
    backend = _npu_on_cpu()
    dqk, dv = dims
    cu_q, cu_k = SEGMENTS["three"]
    cu_k = cu_q if causal else cu_k
    q, k, v = _packed_mla(cu_q[-1], cu_k[-1], dqk, dv)
    scale = dqk**-0.5
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    ref_out, ref_lse = _segment_reference(q, k, v, cu_q, cu_k, causal, scale)
    assert out.shape == (*q.shape[:3], dv) and out.dtype == q.dtype
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    dout, merged_out = _rand(*out.shape, seed=4).float(), _rand(*out.shape, seed=5).float()
    merged_lse = ref_lse.float() + 0.2
    grads = backend.backward_varlen(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, causal, scale)
    ref = _segment_reference(q, k, v, cu_q, cu_k, causal, scale, dout, merged_out, merged_lse.double())
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert_close_to(name, got, want, 1e-5)
    per_segment = convert.tnd_grad_unsupported(dqk, dv) is not None
    assert per_segment == (dims == (576, 512))
    assert [c[0] for c in strict_npu.varlen_calls] == (["fwd"] if per_segment else ["fwd", "bwd"])
    segments = list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))
    want_dense = [("bwd", b - a, d - c, q.shape[2] // 2, 3 if causal else 0) for a, b, c, d in segments]
    assert strict_npu.calls == (want_dense if per_segment else [])
    assert set(strict_npu.head_dims) == {_called_dims(dqk, dv)}


@pytest.mark.parametrize("dims", [(576, 512), (576, 576), (64, 528)], ids=str)
def test_tnd_grad_past_512_under_a_window(strict_npu, dims):
    """A window on packed segments whose call head dim is above the TND grad's 512 (576/512, equal 576, 64/528 padded
    to 528): one TND forward (sparse_mode 4), then one BSND grad call per segment with the same band, counted from
    each segment's bottom-right corner (segments with sq < sk and sq > sk); against the math band in float64."""
    backend = _npu_on_cpu()
    dqk, dv = dims
    cu_q, cu_k, window = (0, 2, 7, 10), (0, 5, 9, 12), (2, 1)
    q, k, v = _packed_mla(cu_q[-1], cu_k[-1], dqk, dv)
    scale = 0.05
    out, lse = backend.forward_varlen(q, k, v, cu_q, cu_k, False, scale, window)
    ref_out, ref_lse = _math_band(backend, q, k, v, cu_q, cu_k, scale, window)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    dout = _rand(*out.shape, dtype=torch.float32, seed=4)
    grads = backend.backward_varlen(dout, q, k, v, ref_out.float(), ref_lse.float(), cu_q, cu_k, False, scale, window)
    ref = _math_band(backend, q, k, v, cu_q, cu_k, scale, window, dout, ref_out, ref_lse)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape, name
        assert_close_to(name, got, want, 1e-5)
    assert [c[0] for c in strict_npu.varlen_calls] == ["fwd"] and strict_npu.varlen_calls[0][4] == 4
    segments = list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))
    assert strict_npu.calls == [("bwd", b - a, d - c, q.shape[2] // 2, 4) for a, b, c, d in segments]


@pytest.mark.parametrize("dims", VALUE_DIMS, ids=str)
def test_value_dims_forward_range(strict_npu, dims):
    """A KV cache's range: one TND call (q/k padded where Dv > Dqk), out [B, T, H, Dv], against the masked math."""
    backend = _npu_on_cpu()
    dqk, dv = dims
    b, t, room, lo, hi = 2, (1 if dims == (576, 512) else 3), 9, torch.tensor(2), torch.tensor(7)
    q, k, v = _mla(b, t, room, dqk, dv)
    k, v = k.contiguous(), v.contiguous()  # a cache's storage
    out, lse = backend.forward_range(q, k, v, lo, hi, 0.1)
    ref_out, ref_lse = _range_reference(q, k, v, lo, hi, 0.1)
    assert out.shape == (*q.shape[:3], dv) and out.dtype == q.dtype and lse.shape == (b, q.shape[2], t)
    assert_close_to("out", out, ref_out, 1e-5)
    assert_close_to("lse", lse, ref_lse, 1e-5)
    assert len(strict_npu.varlen_calls) == 1 and strict_npu.head_dims == [_called_dims(dqk, dv)]


@pytest.mark.parametrize("dims", [(784, 16), (16, 784)], ids=str)
def test_value_dims_the_op_refuses_go_to_the_math(strict_npu, dims):
    """Dims above the documented 768 (even once padded): dense blocks, packed segments and ranges run the base class's
    math, with no op call; the same results, shapes and gradients."""
    backend = _npu_on_cpu()
    dqk, dv = dims
    assert "up to 768" in convert.value_dims_unsupported(dqk, dv)
    q, k, v = _mla(1, 5, 5, dqk, dv)
    out, lse = backend.forward(q, k, v, "strict", 0.05)
    ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), "strict", 0.05)
    assert out.shape == (1, 5, q.shape[2], dv) and out.dtype == q.dtype
    assert_close_to("out", out, ref_out, 1e-5)
    grads = backend.backward(out, q, k, v, out, lse, "strict", 0.05)
    ref = math_backward(out.double(), q.double(), k.double(), v.double(), out.double(), ref_lse, "strict", 0.05)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert got.shape == x.shape, name
        assert_close_to(name, got, want, 1e-5)
    cu = (0, 2, 5)
    assert "up to 768" in convert.varlen_unsupported(q, k, v)
    out, _ = backend.forward_varlen(q, k, v, cu, cu, True, 0.05)
    assert_close_to("varlen out", out, _segment_reference(q, k, v, cu, cu, True, 0.05)[0], 1e-5)
    assert "up to 768" in convert.range_unsupported(q, k.contiguous(), v.contiguous())
    out, _ = backend.forward_range(q, k.contiguous(), v.contiguous(), torch.tensor(1), torch.tensor(4), 0.05)
    assert_close_to("range out", out, _range_reference(q, k, v, torch.tensor(1), torch.tensor(4), 0.05)[0], 1e-5)
    assert strict_npu.calls == [] and strict_npu.varlen_calls == [] and strict_npu.head_dims == []


def test_value_dims_stand_in_refuses_what_the_docs_refuse(fake_npu, monkeypatch):
    """The stand-in fails as the op does (a RuntimeError of the aclnn call) on Dv > Dk, Dq != Dk and D above 768; a
    torch_npu that sizes attention_out like the query (older adapters) is named, not computed with."""
    q, k, v = _mla(1, 3, 3, 64, 128)
    with pytest.raises(RuntimeError, match="only support kD >= vD, but got kD=64 vD=128"):
        fake_npu.npu_fusion_attention(q, k.contiguous(), v.contiguous(), 4, "BSND", scale=0.1)
    with pytest.raises(RuntimeError, match="qD and kD should be same"):
        fake_npu.npu_fusion_attention(q[0], v[0].contiguous(), v[0].contiguous(), 4, "TND", actual_seq_qlen=[3],
                                      actual_seq_kvlen=[3])  # fmt: skip
    big = torch.zeros(1, 2, 2, 784)
    with pytest.raises(RuntimeError, match="D must be in 1..768"):
        fake_npu.npu_fusion_attention(big, big, big[..., :16].contiguous(), 2, "BSND")
    assert fake_npu.calls == fake_npu.varlen_calls == []
    good = fake_npu.npu_fusion_attention

    def like_query(*args, **kwargs):
        outputs = good(*args, **kwargs)
        return (widen_head_dim(outputs[0], args[0].shape[-1]), *outputs[1:])

    monkeypatch.setattr(fake_npu, "npu_fusion_attention", like_query)
    q, k, v = _mla(1, 3, 3, 192, 128)
    with pytest.raises(ValueError, match=r"got \(1, 3, 4, 192\): this torch_npu sizes attention_out like the query"):
        _npu_on_cpu().forward(q, k, v, "causal", 0.1)
    with pytest.raises(ValueError, match=r"\(TND\); got \(3, 4, 192\): this torch_npu sizes attention_out like"):
        _npu_on_cpu().forward_varlen(q, k, v, (0, 1, 3), (0, 1, 3), True, 0.1)


def test_value_dims_arguments():
    assert convert.value_dims_unsupported(192, 128) is None and convert.value_dims_unsupported(64, 768) is None
    assert "up to 768" in convert.value_dims_unsupported(800, 800)  # equal dims too: D 1..768
    assert convert.value_dims_unsupported(784, 16) == (
        "head dims q/k 784, v 16: npu_fusion_attention takes Dq = Dk >= Dv up to 768 (q/k padded to a larger Dv "
        "included)"
    )
    assert [convert.call_head_dim(*d) for d in VALUE_DIMS] == [192, 128, 128, 576]
    x = _rand(2, 3, 64)
    wide = widen_head_dim(x, 96)
    assert widen_head_dim(x, 64) is x and wide.shape == (2, 3, 96) and torch.equal(wide[..., :64], x)
    assert (wide[..., 64:] == 0).all()
    grad = convert.tnd_grad_unsupported
    assert all(grad(*d) is None for d in VALUE_DIMS[:3]) and grad(512, 512) is None and grad(200, 12) is None
    why = "head dim 576: the TND grad takes D up to 512 (the forward and BSND grad 768)"
    assert grad(576, 512) == grad(576, 576) == why
    assert grad(64, 528) == why.replace("576", "528")  # q, k padded to v's 528: a call of head dim 528
    q, k = torch.zeros(1, 3, 4, 192), torch.zeros(1, 3, 2, 192)
    assert convert.varlen_unsupported(q, k, torch.zeros(1, 3, 2, 128)) is None
    assert convert.varlen_unsupported(q, k, torch.zeros(1, 3, 2, 12)) is None
    assert convert.range_unsupported(q, k, torch.zeros(1, 3, 2, 128)) is None
    assert convert.range_unsupported(q, k[..., :64], k[..., :64]) == "k: head dim 64 differs from q's 192"


# ---------------------------------------------------------------------------------------------- on Ascend hardware
def test_device_varlen_stats_layout():
    """On an NPU: forward_varlen/backward_varlen of each stats layout against the per-segment dense calls (the
    base default). The default (per segment, as CANN's kernels write the statistics) must match; the message lists
    every layout's error (``tnd`` needs a torch_npu and CANN with softmax_layout; see xcp_npu.convert)."""
    probe = NPUBackend()
    ok, reason = probe.available()
    if not ok:
        pytest.skip(f"needs torch_npu ({reason})")
    device, dtype = torch.device("npu"), torch.bfloat16
    cu_q, cu_k = (0, 64, 80, 208), (0, 32, 96, 224)
    h, hkv, d, scale = 8, 2, 128, 128**-0.5
    q = _rand(1, cu_q[-1], h, d, dtype=dtype, seed=1).to(device)
    k, v = (_rand(1, cu_k[-1], hkv, d, dtype=dtype, seed=i).to(device) for i in (2, 3))
    dout = _rand(1, cu_q[-1], h, d, dtype=dtype, seed=4).to(device)
    errors = {}
    for causal in (False, True):
        ck = cu_q if causal else cu_k
        kk, vv = (x[:, : ck[-1]] for x in (k, v))
        ref_out, ref_lse = Backend.forward_varlen(probe, q, kk, vv, cu_q, ck, causal, scale)
        ref = Backend.backward_varlen(probe, dout, q, kk, vv, ref_out, ref_lse, cu_q, ck, causal, scale)
        for layout in convert.TND_STATS_LAYOUTS:
            backend = NPUBackend(tnd_stats=layout)
            try:
                out, lse = backend.forward_varlen(q, kk, vv, cu_q, ck, causal, scale)
                grads = backend.backward_varlen(dout, q, kk, vv, ref_out, ref_lse, cu_q, ck, causal, scale)
            except (RuntimeError, TypeError) as exc:  # softmax_layout="TND" needs a recent torch_npu and CANN
                errors[layout, causal] = f"unavailable: {str(exc)[:80]}"
                continue
            scale_of = lambda x: max(1.0, x.float().abs().max().item())  # noqa: E731
            errors[layout, causal] = max(
                (lse - ref_lse).abs().max().item(),
                (out.float() - ref_out.float()).abs().max().item() / scale_of(ref_out),
                *((g.float() - r.float()).abs().max().item() / scale_of(r) for g, r in zip(grads, ref)),
            )
    default = probe.tnd_stats
    for causal in (False, True):
        err = errors[default, causal]
        assert isinstance(err, float) and err < 4e-2, f"stats layout {default!r} does not match; errors: {errors}"


def test_device_varlen_window():
    """On an NPU: forward_varlen/backward_varlen with a window (sparse_mode 4) against the base class's math band,
    segments with sq < sk, sq == sk and sq > sk. This is what settles on hardware the alignment the docs state
    (pre_tockens/next_tockens from each segment's bottom-right corner; see xcp_npu.convert)."""
    probe = NPUBackend()
    ok, reason = probe.available()
    if not ok:
        pytest.skip(f"needs torch_npu ({reason})")
    device, dtype = torch.device("npu"), torch.bfloat16
    h, hkv, d, scale = 8, 2, 128, 128**-0.5
    cases = [
        (((0, 64, 80, 192), (0, 96, 112, 240)), [(0, 0), (16, 0), (7, 33), (200, 3)]),  # sq - sk: -32, 0, -16
        (((0, 64, 96, 224), (0, 32, 64, 160)), [(1, 40), (0, 32), (50, 50)]),  # sq - sk: +32, 0, +32
    ]
    errors = {}
    for (cu_q, cu_k), windows in cases:
        q = _rand(1, cu_q[-1], h, d, dtype=dtype, seed=1).to(device)
        k, v = (_rand(1, cu_k[-1], hkv, d, dtype=dtype, seed=i).to(device) for i in (2, 3))
        dout = _rand(1, cu_q[-1], h, d, dtype=dtype, seed=4).to(device)
        for window in windows:
            assert convert.band_has_empty_rows(cu_q, cu_k, window) is None  # the fused op serves it
            ref_out, ref_lse = Backend.forward_varlen(probe, q, k, v, cu_q, cu_k, False, scale, window)
            ref = Backend.backward_varlen(probe, dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, False, scale, window)
            out, lse = probe.forward_varlen(q, k, v, cu_q, cu_k, False, scale, window)
            grads = probe.backward_varlen(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, False, scale, window)
            scale_of = lambda x: max(1.0, x.float().abs().max().item())  # noqa: E731
            errors[cu_q, window] = max(
                (lse - ref_lse).abs().max().item(),
                (out.float() - ref_out.float()).abs().max().item() / scale_of(ref_out),
                *((g.float() - r.float()).abs().max().item() / scale_of(r) for g, r in zip(grads, ref)),
            )
    assert max(errors.values()) < 4e-2, f"the fused band does not match the math band: {errors}"


def test_device_forward_range():
    """On an NPU: forward_range (one TND call per step, the range read on the host) against the base class's masked
    math, GQA, B > 1, T = 1 and T > 1, lo > 0, and an empty range."""
    probe = NPUBackend()
    ok, reason = probe.available()
    if not ok:
        pytest.skip(f"needs torch_npu ({reason})")
    device, dtype = torch.device("npu"), torch.bfloat16
    h, hkv, d, room, scale = 8, 2, 128, 256, 128**-0.5
    errors = {}
    for b, t, lo, hi in [(1, 1, 0, 200), (3, 1, 17, 256), (2, 4, 64, 65), (2, 1, 9, 9)]:
        q = _rand(b, t, h, d, dtype=dtype, seed=1).to(device)
        k, v = (_rand(b, room, hkv, d, dtype=dtype, seed=i).to(device) for i in (2, 3))
        lo_t, hi_t = torch.tensor(lo, device=device), torch.tensor(hi, device=device)
        ref_out, ref_lse = Backend.forward_range(probe, q, k, v, lo_t, hi_t, scale)
        out, lse = probe.forward_range(q, k, v, lo_t, hi_t, scale)
        finite = ref_lse.isfinite()
        assert torch.equal(lse.isfinite(), finite) and not out.isnan().any()
        errors[b, t, lo, hi] = max(
            (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0,
            (out.float() - ref_out.float()).abs().max().item() / max(1.0, ref_out.float().abs().max().item()),
        )
    assert max(errors.values()) < 4e-2, f"forward_range does not match the math default: {errors}"


def test_device_value_dims():
    """On an NPU: values of another head dim (192/128 as they are, 64/128 with q and k padded) through dense blocks,
    packed segments and a KV-cache range, against float64 math on the CPU. This is what settles on hardware that the
    installed torch_npu serves Dv < Dqk (its adapter must size attention_out from value; see xcp_npu.convert)."""
    probe = NPUBackend()
    ok, reason = probe.available()
    if not ok:
        pytest.skip(f"needs torch_npu ({reason})")
    device, dtype, cu = torch.device("npu"), torch.bfloat16, (0, 48, 128)
    scale_of = lambda x: max(1.0, x.float().abs().max().item())  # noqa: E731
    rel = lambda got, want: (got.cpu().double() - want).abs().max().item() / scale_of(want)  # noqa: E731
    errors = {}
    for dqk, dv in [(192, 128), (64, 128)]:
        h, hkv, s, scale = 8, 2, cu[-1], dqk**-0.5
        q = _rand(1, s, h, dqk, dtype=dtype, seed=1)
        k, v = _rand(1, s, hkv, dqk, dtype=dtype, seed=2), _rand(1, s, hkv, dv, dtype=dtype, seed=3)
        dout = _rand(1, s, h, dv, dtype=dtype, seed=4)
        on = [x.to(device) for x in (q, k, v, dout)]
        ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), "causal", scale)
        ref = math_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, "causal", scale)
        out, lse = probe.forward(*on[:3], "causal", scale)
        grads = probe.backward(on[3], *on[:3], ref_out.to(device, dtype), ref_lse.float().to(device), "causal", scale)
        errors[dqk, dv, "dense"] = max(rel(out, ref_out), *(rel(g, r) for g, r in zip(grads, ref)))
        seg_out, _ = _segment_reference(q, k, v, cu, cu, True, scale)
        out, _ = probe.forward_varlen(*on[:3], cu, cu, True, scale)
        errors[dqk, dv, "varlen"] = rel(out, seg_out)
        lo, hi = torch.tensor(5), torch.tensor(100)
        range_out, _ = _range_reference(q[:, :1], k, v, lo, hi, scale)
        out, _ = probe.forward_range(on[0][:, :1], on[1], on[2], lo.to(device), hi.to(device), scale)
        errors[dqk, dv, "range"] = rel(out, range_out)
    assert max(errors.values()) < 4e-2, f"values of another head dim do not match the math: {errors}"
