"""A CPU stand-in for torch_npu's npu_fusion_attention(_grad), as strict as its sources, and NPUBackend glue on CPU.

What the stand-in takes and refuses (each refusal a RuntimeError, as torch_npu raises the aclnn call's parameter
errors); the sources are cited in xcp_npu/convert.py ("limits of the op") and docs/backends.md:

- dtypes float16, bfloat16, float32 (one dtype for q, k, v); float64 refused. It computes in float32, as the device does
  (statistics float32 [B, N, Sq, 8] / [T, N, 8], eight equal copies);
- head_num = N_q in 1..256, N_kv dividing it; Dq = Dk >= Dv with D in 1..768, except the TND grad, D in 1..512;
- BSND and TND only (what xcp calls); TND with cumulative host int lists without a leading 0, at most 1024 segments, a
  segment may have no queries (the docs allow it) but not no keys (the docs never say it may), and no query row may see
  no key (TND's "no fully masked row");
- sparse_mode 0 (no mask), 3 (right-down causal with the compressed 2048x2048 mask) and 4 (band from each segment's
  bottom-right corner with that mask);
- no call while ``capturing`` is True (the op does not support aclgraph).

The TND statistics' rows follow ``tnd_stats`` (``segment``: per segment [N, s_i], what the kernels write; ``tnd``: token
major), or token major when called with softmax_layout="TND". ``band_origin="top_left"`` makes sparse_mode 4 count from
the top-left corner, to show that the tests would catch a backend relying on that alignment.
"""

from __future__ import annotations

import functools
import importlib.machinery
import threading
import types

import torch

import xcp
from xcp.backends.base import SynchronousBackend
from xcp.testing.sim_backend import SimBackend
from xcp_npu import NPUBackend

NEG_INF = float("-inf")
MAX_TOKENS = 2147483647
OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def compressed_causal_mask() -> torch.Tensor:
    """The documented sparse_mode 2/3/4 mask: 2048x2048 bool, True (masked) strictly above the diagonal."""
    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _stats(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_max (row max) and softmax_sum (sum of exp(s - max)) of float32 scores s, 8 copies each."""
    m = s.amax(-1)
    total = torch.exp(s - torch.where(m == NEG_INF, 0.0, m).unsqueeze(-1)).sum(-1)
    return (x.unsqueeze(-1).expand(*x.shape, 8).contiguous() for x in (m, total))  # type: ignore[return-value]


class FakeTorchNPU(types.ModuleType):
    """npu_fusion_attention and npu_fusion_attention_grad as torch_npu documents them, computed in float32."""

    def __init__(self, tnd_stats: str = "segment", band_origin: str = "bottom_right") -> None:
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # find_spec (transformers) reads it
        self.calls: list[tuple] = []  # BSND: (op, Sq, Sk, N_kv, sparse_mode)
        self.varlen_calls: list[tuple] = []  # TND: (op, qlen, kvlen, N_kv, sparse_mode, softmax_layout, pre, next)
        self.head_dims: list[tuple[int, int, int]] = []  # (Dq, Dk, Dv) of every call
        self.head_nums: list[int] = []  # head_num of every call
        self.infer_calls: list[tuple] = []  # npu_fused_infer_attention_score: (Q_S, qlens, kvlens, N_kv, sparse, block)
        self._capture = threading.local()  # ``capturing``: per thread, as the current stream is (virtual ranks)
        self.checked_mask = None
        self.tnd_stats = tnd_stats
        self.band_origin = band_origin

    @property
    def capturing(self) -> bool:
        """Whether this thread's current stream is being captured into a graph (set by the tests)."""
        return getattr(self._capture, "on", False)

    @capturing.setter
    def capturing(self, value: bool) -> None:
        self._capture.on = bool(value)

    # ------------------------------------------------------------------ what every call must satisfy
    def _check_call(self, query, key, value, head_num, grad_tnd=False):
        if self.capturing:
            raise RuntimeError("npu_fusion_attention does not support graph mode (aclgraph): called while capturing")
        if query.dtype not in OP_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: dtypes {query.dtype}/{key.dtype}/{value.dtype} not supported")
        n_kv = key.shape[-2]
        if not 0 < head_num <= 256 or head_num != query.shape[-2] or n_kv == 0 or head_num % n_kv:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: Nq must be in 1..256 and a multiple of Nkv; got {head_num}")
        dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
        if dq != dk:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: qD and kD should be same, but got qD={dq} kD={dk}")
        if dk < dv:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: only support kD >= vD, but got kD={dk} vD={dv}")
        limit = 512 if grad_tnd else 768
        if not all(0 < d <= limit for d in (dq, dk, dv)):
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: D must be in 1..{limit}, got qD={dq} vD={dv}")
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
        assert key.shape[:-1] == value.shape[:-1]  # k and v alike but for D
        self.head_dims.append((dq, dk, dv))
        self.head_nums.append(head_num)

    def _check_compressed_mask(self, atten_mask):
        assert atten_mask is not None and atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
        if atten_mask is not self.checked_mask:  # the backend caches its mask: compare it once
            assert torch.equal(atten_mask, compressed_causal_mask()), "not the causal mask"
            self.checked_mask = atten_mask

    def _allowed(self, sq, sk, atten_mask, sparse_mode, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS):
        if sparse_mode == 0:
            assert atten_mask is None, "xcp passes no mask with sparse_mode 0"
            return torch.ones(sq, sk, dtype=torch.bool)
        if sparse_mode == 3:  # rightDownCausal: query i sees keys j <= i + (Sk - Sq)
            self._check_compressed_mask(atten_mask)
            return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        if sparse_mode == 4:  # band from the bottom-right corner: -pre <= j - i - (Sk - Sq) <= next
            self._check_compressed_mask(atten_mask)
            assert type(pre_tockens) is int and type(next_tockens) is int and pre_tockens + next_tockens >= 0
            off = sk - sq if self.band_origin == "bottom_right" else 0
            d = torch.arange(sk).unsqueeze(0) - torch.arange(sq).unsqueeze(1) - off
            return (d >= -pre_tockens) & (d <= next_tockens)
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled")

    # ------------------------------------------------------------------ one block in float32
    @staticmethod
    def _scores(q, k, scale, allowed):
        """Scaled float32 scores [B, N, Sq, Sk] of BSND q, k (K heads repeated), masked to -inf."""
        groups = q.shape[2] // k.shape[2]
        s = torch.einsum("bqnd,bknd->bnqk", q.float(), k.float().repeat_interleave(groups, 2)) * scale
        return s.masked_fill(~allowed, NEG_INF)

    def _block_forward(self, q, k, v, scale, allowed):
        """(out float32 [B, Sq, N, Dv], softmax_max, softmax_sum [B, N, Sq, 8]) of one BSND block."""
        s = self._scores(q, k, scale, allowed)
        smax, ssum = _stats(s)
        p = torch.exp(s - smax[..., :1]) / ssum[..., :1]  # xcp never asks for a row that sees no key
        groups = q.shape[2] // k.shape[2]
        return torch.einsum("bnqk,bknd->bqnd", p, v.float().repeat_interleave(groups, 2)), smax, ssum

    def _block_backward(self, q, k, v, dy, o, smax, ssum, scale, allowed):
        """float32 (dq, dk, dv) of one BSND block from the given statistics [B, N, Sq, 1] and attention_in."""
        groups = q.shape[2] // k.shape[2]
        kr, vr = (x.float().repeat_interleave(groups, 2) for x in (k, v))
        p = torch.exp(self._scores(q, k, scale, allowed) - smax) / ssum
        do, o = dy.float(), o.float()
        dv = torch.einsum("bnqk,bqnd->bknd", p, do)
        ds = p * (torch.einsum("bqnd,bknd->bnqk", do, vr) - (do * o).sum(-1).transpose(1, 2).unsqueeze(-1))
        dq = torch.einsum("bnqk,bknd->bqnd", ds, kr) * scale
        dk = torch.einsum("bnqk,bqnd->bknd", ds, q.float()) * scale
        b, sk, n, _ = dk.shape
        return dq, dk.reshape(b, sk, n // groups, groups, -1).sum(3), dv.reshape(b, sk, n // groups, groups, -1).sum(3)

    # ------------------------------------------------------------------ the two ops
    def npu_fusion_attention(
        self, query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
        keep_prob=1.0, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
        softmax_layout="",
    ):  # fmt: skip
        assert keep_prob == 1.0 and pse is None and padding_mask is None and prefix is None
        if input_layout == "TND":
            return self._tnd_forward(
                query, key, value, head_num, atten_mask, scale, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                softmax_layout, pre_tockens, next_tockens,
            )  # fmt: skip
        assert input_layout == "BSND" and actual_seq_qlen is None and actual_seq_kvlen is None and softmax_layout == ""
        self._check_call(query, key, value, head_num)
        self.calls.append(("fwd", query.shape[1], key.shape[1], key.shape[2], sparse_mode))
        allowed = self._allowed(query.shape[1], key.shape[1], atten_mask, sparse_mode, pre_tockens, next_tockens)
        out, smax, ssum = self._block_forward(query, key, value, scale, allowed)
        return out.to(query.dtype), smax, ssum, torch.zeros(0), 0, 0, 0

    def npu_fusion_attention_grad(
        self, query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
        softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0,
        pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
        softmax_layout="",
    ):  # fmt: skip
        assert keep_prob == 1.0 and pse is None and softmax_in is None
        assert dy.dtype == attention_in.dtype == query.dtype
        assert softmax_max.dtype == softmax_sum.dtype == torch.float32
        if input_layout == "TND":
            return self._tnd_backward(
                query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum, attention_in, scale_value,
                actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, pre_tockens, next_tockens,
            )  # fmt: skip
        assert input_layout == "BSND" and actual_seq_qlen is None and actual_seq_kvlen is None and softmax_layout == ""
        self._check_call(query, key, value, head_num)
        assert dy.shape == attention_in.shape == (*query.shape[:3], value.shape[3])  # dy, out in v's head dim
        assert softmax_max.shape == softmax_sum.shape == (query.shape[0], head_num, query.shape[1], 8)
        self.calls.append(("bwd", query.shape[1], key.shape[1], key.shape[2], sparse_mode))
        allowed = self._allowed(query.shape[1], key.shape[1], atten_mask, sparse_mode, pre_tockens, next_tockens)
        stats = softmax_max[..., :1], softmax_sum[..., :1]
        dq, dk, dv = self._block_backward(query, key, value, dy, attention_in, *stats, scale_value, allowed)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None

    # ------------------------------------------------------------------ TND (packed segments)
    def _tnd_segments(self, query, key, value, head_num, actual_seq_qlen, actual_seq_kvlen, softmax_layout, grad=False):
        """[(q0, q1, k0, k1)] from the documented host lists: cumulative lengths without a leading 0."""
        assert query.dim() == key.dim() == value.dim() == 3
        self._check_call(query, key, value, head_num, grad_tnd=grad)
        for lens, total in ((actual_seq_qlen, query.shape[0]), (actual_seq_kvlen, key.shape[0])):
            assert isinstance(lens, list) and all(type(x) is int for x in lens), "host int lists"
            assert 0 < len(lens) <= 1024 and lens[-1] == total, "cumulative, without the leading 0, at most 1K"
        assert len(actual_seq_qlen) == len(actual_seq_kvlen) and softmax_layout in ("", "TND")
        cq, ck = [0, *actual_seq_qlen], [0, *actual_seq_kvlen]
        segs = [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(actual_seq_qlen))]
        assert all(q1 >= q0 and k1 > k0 for q0, q1, k0, k1 in segs), "a segment without keys (or decreasing lists)"
        return segs

    def _tnd_allowed(self, sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens):
        """One segment's mask; the docs forbid a fully masked row in TND."""
        allowed = self._allowed(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens)
        assert allowed.any(-1).all(), "TND: a row that sees no key"
        return allowed

    def stat_rows(self, layout, t_total, n, q0, q1, h):
        """Rows of the [T * N, 8] view that hold head h of the segment's queries [q0, q1) under ``layout``."""
        j = torch.arange(q0, q1)
        if layout == "tnd":
            return j * n + h
        return n * q0 + h * (q1 - q0) + (j - q0)  # segment: [N, s_i] blocks, one per segment

    def _tnd_forward(
        self, query, key, value, head_num, atten_mask, scale, qlen, kvlen, sparse_mode, softmax_layout, pre, nxt
    ):
        segs = self._tnd_segments(query, key, value, head_num, qlen, kvlen, softmax_layout)
        layout = "tnd" if softmax_layout == "TND" else self.tnd_stats
        t, n = query.shape[0], head_num
        self.varlen_calls.append(("fwd", list(qlen), list(kvlen), key.shape[1], sparse_mode, softmax_layout, pre, nxt))
        out = torch.zeros(t, n, value.shape[2], dtype=torch.float32)
        smax, ssum = torch.zeros(t * n, 8), torch.zeros(t * n, 8)
        for q0, q1, k0, k1 in segs:
            if q0 == q1:
                continue
            allowed = self._tnd_allowed(q1 - q0, k1 - k0, atten_mask, sparse_mode, pre, nxt)
            o, m, total = self._block_forward(*(x.unsqueeze(0) for x in (query[q0:q1], key[k0:k1], value[k0:k1])),
                                              scale, allowed)  # fmt: skip
            out[q0:q1] = o[0]
            for h in range(n):
                rows = self.stat_rows(layout, t, n, q0, q1, h)
                smax[rows], ssum[rows] = m[0, h], total[0, h]
        return out.to(query.dtype), smax.reshape(t, n, 8), ssum.reshape(t, n, 8), torch.zeros(0), 0, 0, 0

    def _tnd_backward(
        self, query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum, attention_in, scale,
        qlen, kvlen, sparse_mode, softmax_layout, pre, nxt,
    ):  # fmt: skip
        segs = self._tnd_segments(query, key, value, head_num, qlen, kvlen, softmax_layout, grad=True)
        t, n = query.shape[0], head_num
        assert softmax_max.shape == softmax_sum.shape == (t, n, 8)
        assert dy.shape == attention_in.shape == (t, n, value.shape[2])  # dy, out in v's head dim
        layout = "tnd" if softmax_layout == "TND" else self.tnd_stats
        self.varlen_calls.append(("bwd", list(qlen), list(kvlen), key.shape[1], sparse_mode, softmax_layout, pre, nxt))
        dq, dk, dv = (torch.zeros(x.shape) for x in (query, key, value))
        mrows, srows = softmax_max.reshape(t * n, 8), softmax_sum.reshape(t * n, 8)
        for q0, q1, k0, k1 in segs:
            if q0 == q1:
                continue
            allowed = self._tnd_allowed(q1 - q0, k1 - k0, atten_mask, sparse_mode, pre, nxt)
            m, s = (torch.stack([x[self.stat_rows(layout, t, n, q0, q1, h), 0] for h in range(n)])[None, ..., None]
                    for x in (mrows, srows))  # fmt: skip
            parts = (query[q0:q1], key[k0:k1], value[k0:k1], dy[q0:q1], attention_in[q0:q1])
            gq, gk, gv = self._block_backward(*(x.unsqueeze(0) for x in parts), m, s, scale, allowed)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = gq[0], gk[0], gv[0]
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None

    # ------------------------------------------------------------------ the inference op over a paged pool
    def npu_fused_infer_attention_score(
        self, query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, block_table=None, query_padding_size=None, kv_padding_size=None, num_heads=1,
        scale=1.0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS, input_layout="BSH", num_key_value_heads=0,
        sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0, softmax_lse_flag=False,
    ):  # fmt: skip
        """Page attention with a BSND query, as torch_npu's page of the op states it (xcp_npu/paged.py): float16 /
        bfloat16, contiguous, key and value of one shape (blocknum, blocksize, KV_N * D) with KV_N * D <= 65535;
        N <= 256, D <= 512, num_heads / num_key_value_heads <= 64, B <= 65536; Q_S 1: blocks a multiple of 16, at most
        262144 keys; Q_S > 1: blocks 128..512 in multiples of 128, D a multiple of 16, actual_seq_lengths a host list;
        actual_seq_lengths_kv a host list (required), blocknum >= the blocks the entries read, the table [B, >= the
        most blocks an entry reads]; sparse_mode 0 or 3 (rightDownCausal on each entry's actual lengths, the
        compressed mask), no row without a key; an entry without queries or keys refused (the page never says one
        may be). Computed in float32; padded query rows come back NaN (never to be read); the lse (B, N, Q_S, 1)
        float32 with softmax_lse_flag, else a [1] zero."""
        if self.capturing:
            raise RuntimeError("npu_fused_infer_attention_score: called while capturing (xcp never captures it)")
        if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: dtypes {query.dtype}/{key.dtype}/{value.dtype} not supported")
        if input_layout != "BSND" or block_table is None:
            raise NotImplementedError(f"only page attention with a BSND query is modelled; got {input_layout}")
        assert pse_shift is None and query_padding_size is None and kv_padding_size is None and antiquant_mode == 0
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous(), "non-contiguous tensors"
        if key.shape != value.shape or key.dim() != 3:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: key {tuple(key.shape)} / value {tuple(value.shape)}: one "
                               "(blocknum, blocksize, H) shape")  # fmt: skip
        b, sq, n, d = query.shape
        n_kv = num_key_value_heads or num_heads
        if n != num_heads or not 0 < n <= 256 or n % n_kv or n // n_kv > 64 or key.shape[2] != n_kv * d:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: heads {num_heads}/{n_kv}, query {tuple(query.shape)}, "
                               f"key {tuple(key.shape)}")  # fmt: skip
        if not 0 < d <= 512 or key.shape[2] > 65535 or not 0 < b <= 65536:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: D {d}, KV_N * D {key.shape[2]}, B {b}")
        blocknum, bs = key.shape[0], key.shape[1]
        if bs != block_size:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: block_size {block_size}; the pools' blocks hold {bs}")
        if sq == 1:
            if bs % 16 or inner_precise not in (0, 1):
                raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: Q_S 1: block_size {bs} (16-aligned), inner_precise")
            assert actual_seq_lengths is None, "xcp passes no actual_seq_lengths with one query per entry"
            qlens = [1] * b
        else:
            if bs % 128 or not 128 <= bs <= 512 or d % 16:
                raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: Q_S > 1 with page attention: block_size {bs} (128..512, "
                                   f"multiples of 128), D {d} (16-aligned)")  # fmt: skip
            qlens = self._host_lengths("actual_seq_lengths", actual_seq_lengths, b, sq)
        kvlens = self._host_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, b, 262144 if sq == 1 else None)
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == b
        blocks = [-(-x // bs) for x in kvlens]
        if max(blocks) > block_table.shape[1] or sum(blocks) > blocknum:
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: blocks {blocks}, table {tuple(block_table.shape)}, "
                               f"blocknum {blocknum}")  # fmt: skip
        ids = block_table.tolist()
        assert all(0 <= ids[e][j] < blocknum for e in range(b) for j in range(blocks[e])), "a block id outside the pool"
        self.infer_calls.append((sq, None if sq == 1 else list(qlens), list(kvlens), n_kv, sparse_mode, bs))
        out = torch.full((b, sq, n, d), float("nan"))
        lse = torch.full((b, n, sq, 1), float("nan"))
        pool_k, pool_v = (x.view(blocknum, bs, n_kv, d) for x in (key, value))
        for e in range(b):
            sk, sqe = kvlens[e], qlens[e]
            rows = torch.tensor(ids[e][: blocks[e]], dtype=torch.int64)
            k, v = (x.index_select(0, rows).flatten(0, 1)[None, :sk] for x in (pool_k, pool_v))
            if sq == 1 or sparse_mode == 0:
                assert sq == 1 or atten_mask is None, "sparse_mode 0: xcp passes no mask"
                allowed = torch.ones(sqe, sk, dtype=torch.bool)
            elif sparse_mode == 3:
                self._check_compressed_mask(atten_mask)
                allowed = torch.ones(sqe, sk, dtype=torch.bool).tril(sk - sqe)
            else:
                raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled")
            assert allowed.any(-1).all(), "a row that sees no key"
            o, m, total = self._block_forward(query[e : e + 1, :sqe], k, v, scale, allowed)
            out[e, :sqe] = o[0]
            lse[e, :, :sqe, 0] = m[0, :, :, 0] + torch.log(total[0, :, :, 0])
        return out.to(query.dtype), lse if softmax_lse_flag else torch.zeros(1)

    @staticmethod
    def _host_lengths(name, lengths, batch, limit):
        """The documented host list of one length per batch entry, each in 1..limit (0 is never said to be allowed)."""
        if not isinstance(lengths, list) or not all(type(x) is int for x in lengths) or len(lengths) != batch:
            raise RuntimeError(f"{name}: expected a host int list of {batch} lengths; got {lengths!r}")
        if not all(0 < x <= (limit or x) for x in lengths):
            raise RuntimeError(f"ACLNN_ERR_PARAM_INVALID: {name} {lengths} (1..{limit})")
        return lengths


class FakeTorchNPU6(FakeTorchNPU):
    """torch_npu 6.0's op, whose scale is named ``scale_value``."""

    def npu_fused_infer_attention_score(self, query, key, value, *, scale_value=1.0, **options):  # type: ignore[override]
        return super().npu_fused_infer_attention_score(query, key, value, scale=scale_value, **options)


class NPUOnCPU(NPUBackend):
    """NPUBackend's glue on CPU tensors against the stand-in, whose ``capturing`` it reports as is_capturing()."""

    device_type = "cpu"

    def is_capturing(self) -> bool:
        return bool(getattr(self.vendor(), "capturing", False))


class NPUGlueOnCPU(SynchronousBackend, NPUOnCPU):
    """NPUBackend's kernels (on the stand-in) with the CPU's no-op streams: a registrable backend for LocalWorld rings,
    xcp.attention, KVCache and the transformers drop-in; value_head_dims, dtypes and the rest are NPUBackend's."""

    name = "npu-glue"

    def is_capturing(self) -> bool:
        return NPUOnCPU.is_capturing(self)


class NPUOnSim(NPUOnCPU):
    """NPUBackend's kernels (on the stand-in) and hand-off policy (``clone``) with the simulated device's streams,
    events and allocator marks (:class:`xcp.testing.sim_backend.SimBackend`'s): what the lifetime sanitizer checks
    the ring, the combine and the recurrent exchanges of the Ascend backend on. Tensors stay on the CPU."""

    name = "npu-sim"
    current_stream = SimBackend.current_stream
    new_stream = SimBackend.new_stream
    stream_context = SimBackend.stream_context
    new_event = SimBackend.new_event
    record_event = SimBackend.record_event
    wait_event = SimBackend.wait_event
    wait_stream = SimBackend.wait_stream
    synchronize_event = SimBackend.synchronize_event
    label = SimBackend.label
    record_stream = SimBackend.record_stream
    memory_stats = SimBackend.memory_stats

    def __init__(self, model, gqa: str | None = None) -> None:
        super().__init__(gqa)
        self.model = model
        cpu = torch.device("cpu")  # the causal masks made here, outside the model's threads: kept on purpose, no leak
        self._masks[cpu] = compressed_causal_mask().to(cpu)

    def synchronize(self, device=None) -> None:
        return None

    def set_device(self, device) -> None:
        return None


def public_attention(world, q, k, v, dout, balance="zigzag", **kwargs):
    """xcp.attention over ``world`` virtual ranks on the registered ``npu-glue`` backend (the public entry point),
    backward through autograd: the unsharded out, dq, dk, dv."""

    def rank(group):
        r = group.rank()
        leaves = [xcp.shard(x, world, r, balance=balance).detach().requires_grad_() for x in (q, k, v)]
        out = xcp.attention(*leaves, group=group, device="npu-glue", balance=balance, **kwargs)
        out.backward(xcp.shard(dout, world, r, balance=balance))
        return out.detach(), *(x.grad for x in leaves)

    results = xcp.LocalWorld(world).run(rank)
    return [xcp.unshard([r[i] for r in results], balance=balance) for i in range(4)]
