"""xcp_npu on a CPU: the pure conversions, and the backend end to end against a stand-in torch_npu.

The stand-in follows torch_npu's documented contract for npu_fusion_attention(_grad) (BSND layout,
head_num = query heads, K/V heads dividing them, softmax_max/softmax_sum float32 [B, N, Sq, 8], sparse_mode
0 and the right-down causal sparse_mode 3 with the compressed 2048×2048 mask, ``scale`` in the forward and
``scale_value`` in the grad). References are float64 math (xcp.cpu) on the whole block.
"""

from __future__ import annotations

import functools
import math
import sys
import types

import pytest
import torch
from strategies import assert_close_to

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
@functools.cache
def _compressed_causal_mask():
    """The documented sparse_mode 2/3 mask: 2048×2048 bool, True (masked) strictly above the diagonal."""
    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


class FakeTorchNPU(types.ModuleType):
    """npu_fusion_attention and npu_fusion_attention_grad as torch_npu documents them, in float64."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.checked_mask = None

    def _allowed(self, sq, sk, atten_mask, sparse_mode):
        if sparse_mode == 0:
            if atten_mask is None:
                return torch.ones(sq, sk, dtype=torch.bool)
            return ~atten_mask.bool()  # True = masked out
        if sparse_mode == 3:  # rightDownCausal: query i sees keys j <= i + (Sk - Sq)
            assert atten_mask is not None and atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
            if atten_mask is not self.checked_mask:  # the backend caches its mask: compare it once
                assert torch.equal(atten_mask, _compressed_causal_mask()), "not the causal mask"
                self.checked_mask = atten_mask
            return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled")

    def _check(self, query, key, value, head_num, input_layout):
        assert input_layout == "BSND" and head_num == query.shape[2]
        assert key.shape == value.shape and query.shape[2] % key.shape[2] == 0
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()

    def npu_fusion_attention(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
    ):
        self._check(query, key, value, head_num, input_layout)
        assert keep_prob == 1.0 and pse is None
        self.calls.append(("fwd", query.shape[1], key.shape[1], key.shape[2], sparse_mode))
        s = _scores_bnss(query, key, scale, self._allowed(query.shape[1], key.shape[1], atten_mask, sparse_mode))
        smax, ssum = _npu_stats(s)
        p = torch.exp(s - smax[..., :1].double()) / ssum[..., :1].double()
        groups = query.shape[2] // key.shape[2]
        out = torch.einsum("bnqk,bknd->bqnd", p, value.double().repeat_interleave(groups, 2))
        return out.to(query.dtype), smax, ssum, torch.zeros(0), 0, 0, 0

    def npu_fusion_attention_grad(
        self,
        query,
        key,
        value,
        dy,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        softmax_max=None,
        softmax_sum=None,
        softmax_in=None,
        attention_in=None,
        scale_value=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        seed=0,
        offset=0,
        numels=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
    ):
        self._check(query, key, value, head_num, input_layout)
        assert dy.dtype == attention_in.dtype == query.dtype and keep_prob == 1.0
        assert softmax_max.shape == softmax_sum.shape == (query.shape[0], head_num, query.shape[1], 8)
        self.calls.append(("bwd", query.shape[1], key.shape[1], key.shape[2], sparse_mode))
        groups = query.shape[2] // key.shape[2]
        kr, vr = (x.double().repeat_interleave(groups, 2) for x in (key, value))
        s = _scores_bnss(query, key, scale_value, self._allowed(query.shape[1], key.shape[1], atten_mask, sparse_mode))
        p = torch.exp(s - softmax_max[..., :1].double()) / softmax_sum[..., :1].double()
        do, o = dy.double(), attention_in.double()
        dv = torch.einsum("bnqk,bqnd->bknd", p, do)
        dp = torch.einsum("bqnd,bknd->bnqk", do, vr)
        ds = p * (dp - (do * o).sum(-1).transpose(1, 2).unsqueeze(-1))
        dq = torch.einsum("bnqk,bknd->bqnd", ds, kr) * scale_value
        dk = torch.einsum("bnqk,bqnd->bknd", ds, query.double()) * scale_value
        b, sk, n, d = dk.shape
        dk = dk.reshape(b, sk, n // groups, groups, d).sum(3)
        dv = dv.reshape(b, sk, n // groups, groups, d).sum(3)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def _npu_on_cpu(gqa="native"):
    backend = NPUBackend(gqa=gqa)
    backend.device_type = "cpu"  # run the glue on CPU tensors
    return backend


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(6, 6), (7, 4), (4, 7), (1, 1)])
@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_backend_against_math(fake_npu, mask, sq, sk, gqa, dtype, tol):
    """float64 is exact up to the float32 statistics (converted lse ~1e-7 relative); float32 adds output
    rounding (~1e-7). Both far below what a wrong mask, head mapping or lse would give (O(0.1))."""
    backend = _npu_on_cpu(gqa)
    h, hkv, d = 4, 2, 16
    q, k = _rand(2, sq, h, d, dtype=dtype, seed=1), _rand(2, sk, hkv, d, dtype=dtype, seed=2)
    v = _rand(2, sk, hkv, d, dtype=dtype, seed=3)
    scale = 1 / math.sqrt(d)
    out, lse = backend.forward(q, k, v, mask, scale)
    ref_out, ref_lse = math_forward(q.double(), k.double(), v.double(), mask, scale)
    assert_close_to("out", out, ref_out, max(tol, 1e-6))
    assert_close_to("lse", lse, ref_lse, 1e-6)
    dout = _rand(*out.shape, dtype=dtype, seed=4)
    merged_lse = torch.where(lse == NEG_INF, 0.3, lse + 0.2)  # a merged lse: the row saw more keys elsewhere
    merged_out = _rand(*out.shape, dtype=dtype, seed=5)
    grads = backend.backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    ref = math_backward(dout.double(), q.double(), k.double(), v.double(), merged_out.double(), merged_lse, mask, scale)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert a.dtype == dtype
        assert_close_to(name, a, b, max(tol, 1e-6))
    assert fake_npu.calls or (mask == "strict" and sq == 1), "the kernel was never called"  # 1x1 strict: empty
    for _, csq, csk, kv_heads, sparse_mode in fake_npu.calls:
        assert sparse_mode in (0, 3) and (sparse_mode == 0 or csq == csk)  # causal only on square calls
        assert kv_heads == (hkv if gqa == "native" else h)


def test_backend_does_not_mutate_inputs(fake_npu):
    backend = _npu_on_cpu()
    q, k, v = _rand(1, 5, 2, 16, seed=1), _rand(1, 5, 1, 16, seed=2), _rand(1, 5, 1, 16, seed=3)
    dout, out, lse = _rand(1, 5, 2, 16, seed=4), _rand(1, 5, 2, 16, seed=5), _rand(1, 2, 5, seed=6)
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
