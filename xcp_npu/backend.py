"""The Ascend backend: torch_npu.npu_fusion_attention and its grad, torch.npu streams, HCCL, clone hand-off.

torch_npu is imported at the first call that needs it (``available()``, a kernel, a stream), once; a
failed import is remembered and reported, never raised during discovery. Installing torch-npu without
Ascend's CANN makes the import fail with e.g. "libhccl.so: cannot open shared object file", which then is
the reason ``xcp backends`` shows.

What the op takes, from its docs (sources in :mod:`xcp_npu.convert`, "limits of the op"), and what this backend does
with the rest: float16 / bfloat16 / float32 (float64 goes to the base class's math); 1..256 query heads a call (more are
split into calls of whole GQA groups, :mod:`xcp_npu.heads`); head dims Dq = Dk >= Dv up to 768 (values of another head
dim below), the TND grad only up to 512 (wider packed segments take their gradients per segment in BSND); no graph
capture (aclgraph): every op call refuses to run while the current stream is captured, and the tool hooks offer no
graph (:meth:`NPUBackend.new_graph`).

Hand-off is ``clone``: a tensor given to the comm stream is copied with that stream current, so the copy belongs to it
and no cross-stream allocator mark is involved. It is not forced by the allocator: torch_npu's NPUCachingAllocator
honours ``record_stream`` marks as CUDA's does, and ProcessGroupHCCL's ``WorkHCCL::synchronizeInternal`` (called by
``work.wait()``) erases only the mark the process group itself put on its inputs for its own HCCL stream, and only for
blocks allocated on the stream current at the wait (``eraseStream(ptr, hcclStream)`` in NPUCachingAllocator.cpp checks
``block->stream`` against the current stream and erases that one stream from ``stream_uses``); a batched P2P
(``batch_isend_irecv``, coalesced) records no inputs on its work, so its wait erases nothing. So ``record_stream`` on
the comm stream, which xcp's hand-off would add, survives every wait: ``handoff="record_stream"`` is safe too and saves
the copy. ``clone`` stays the default because it is what Ascend deployments run (vllm-ascend's fix for a tensor made on
the main stream and read on a comm stream) and its cost, an on-device copy of each sent tensor, is small next to the
transfer; neither policy has run on Ascend hardware here. Sources: Ascend/pytorch
``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp`` (``synchronizeInternal``, ``pointToPoint``, ``endCoalescing``) and
``torch_npu/csrc/core/npu/NPUCachingAllocator.cpp`` (``eraseStream``).

Waits: ``WorkHCCL::wait(timeout)`` uses its timeout only with ``TORCH_HCCL_BLOCKING_WAIT=1`` and then logs and breaks
instead of raising (``synchronizeInternal``), so ``poll_comm_waits`` is True: a wait bounded by ``timeout=`` /
``XCP_TIMEOUT`` polls ``work.is_completed()`` against the deadline on the host and raises ``xcp.CommTimeout``
(:mod:`xcp.comm.dist`).

Packed segments (``forward_varlen`` / ``backward_varlen``) go to one npu_fusion_attention(_grad) call in the TND
layout with the cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen``; its softmax statistics are laid out per segment
(``tnd_stats``: ``segment``, or ``tnd`` for softmax_layout="TND"). A sliding window ``(left, right)`` on packed segments
is the band sparse_mode 4 (pre_tockens = left, next_tockens = right, aligned to each segment's bottom-right corner, as
the docs state; sources in :mod:`xcp_npu.convert`).

A KV cache's range (``forward_range``, the decode step of ``xcp.KVCache(capacity=...)``) is one TND call too, but the
op takes its lengths only as host lists: the call reads ``lo`` / ``hi`` to the host once, so on Ascend it is not
capturable into a graph (under capture it leaves the step to the base class's masked math).

A paged cache's partial (``forward_paged``) is one npu_fused_infer_attention_score call with ``block_table`` over the
pool in place, its lengths host lists too (one host read a call, not capturable; :mod:`xcp_npu.paged`).

Values of another head dim than the queries' and keys' (MLA, Dv != Dqk; ``value_head_dims``): the op takes Dq = Dk >= Dv
up to 768, so Dv < Dqk goes to it as is; Dv > Dqk goes with q and k padded with zero channels to Dv (dq, dk sliced
back); dims above 768 go to the base class's math (sources in :mod:`xcp_npu.convert`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from xcp.backends.fused import FusedKernelBackend, repeat_kv, sum_kv_groups, widen_head_dim
from xcp.kernels.math import math_backward, math_forward

from . import convert, heads, paged
from . import settings as npu_settings

CAPTURE_REFUSED = (
    "npu: torch_npu.npu_fusion_attention(_grad) cannot be captured into an NPU graph (its docs: no graph mode, no "
    "aclgraph); run xcp's attention eagerly, outside torch.npu.graph (under capture only a KV cache's decode step "
    "runs, through the masked math of forward_range)"
)
"""The RuntimeError of an op call while the current stream is captured, and of :meth:`NPUBackend.capture_graph`."""


class NPUBackend(FusedKernelBackend):
    """Huawei Ascend NPUs through torch_npu.

    Each argument left at None takes its ``XCP_NPU_*`` setting (:mod:`xcp_npu.settings`), read here.

    :param gqa: ``native`` (default): K/V with fewer heads go to npu_fusion_attention as they are (it allows
        N_kv dividing N); or ``repeat``.
    :param tnd_stats: how the TND (varlen) kernel lays out softmax_max / softmax_sum: ``segment`` (default, what the
        kernels write) or ``tnd`` (softmax_layout="TND", newer torch_npu and CANN; see
        :data:`xcp_npu.convert.TND_STATS_LAYOUTS`).
    """

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    handoff_policy = "clone"
    kernel = (
        "torch_npu.npu_fusion_attention (+ _grad), BSND; packed segments TND; causal as sparse_mode 3, "
        "windows as sparse_mode 4; KV-cache ranges TND (host lengths); v's head dim below q's as is, above it with "
        "q/k zero-padded; over 256 query heads split per GQA group; TND grads past head dim 512 per segment in BSND; "
        "float64 and graph capture not taken by the op; paged pools through npu_fused_infer_attention_score "
        "(block_table, host lengths, lse)"
    )
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    value_head_dims = True
    poll_comm_waits = True  # WorkHCCL::wait(timeout) does not raise when the timeout passes: xcp polls is_completed()
    gqa_setting = npu_settings.GQA
    settings = npu_settings.ALL

    def __init__(self, gqa: str | None = None, tnd_stats: str | None = None) -> None:
        super().__init__(gqa)
        if tnd_stats is None:
            tnd_stats = npu_settings.TND_STATS.read()
        self.tnd_stats = convert.check_tnd_stats(tnd_stats)
        self._vendor: Any = None
        self._vendor_error: str | None = None
        self._masks: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ vendor module
    def vendor(self) -> Any:
        """The torch_npu module (imported once); RuntimeError with the import error when it cannot load."""
        if self._vendor is None and self._vendor_error is None:
            try:
                self._vendor = importlib.import_module("torch_npu")
            except Exception as exc:  # noqa: BLE001 - ImportError, OSError, RuntimeError all mean "absent"
                self._vendor_error = str(exc) or type(exc).__name__
        if self._vendor is None:
            raise RuntimeError(f"xcp_npu needs torch_npu, which is not importable: {self._vendor_error}")
        return self._vendor

    def _op(self, name: str) -> Callable[..., Any]:
        """torch_npu's ``name`` (npu_fusion_attention or its grad), refused with :data:`CAPTURE_REFUSED` while the
        current stream is captured: the op does not support aclgraph, and a captured call would replay wrongly."""
        if self.is_capturing():
            raise RuntimeError(CAPTURE_REFUSED)
        return getattr(self.vendor(), name)

    # ------------------------------------------------------------------ identity
    def available(self) -> tuple[bool, str]:
        """(True, "") when torch_npu loads and sees a device; otherwise the reason. Never raises."""
        try:
            self.vendor()
        except RuntimeError:
            return False, f"torch_npu is not importable: {self._vendor_error}"
        try:
            if not self._module().is_available():
                return False, "no Ascend device: torch.npu.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - a broken driver must not break discovery
            return False, f"no Ascend device: querying torch.npu raised {type(exc).__name__}: {exc}"
        return True, ""

    # ------------------------------------------------------------------ streams, events, memory
    def _module(self) -> Any:
        """torch.npu, which exists once torch_npu is imported (streams and events come from it)."""
        self.vendor()
        return torch.get_device_module(self.device_type)

    def is_capturing(self) -> bool:
        """True while the current NPU stream is captured into an NPU graph (False where torch_npu lacks it)."""
        capturing = getattr(self._module(), "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def new_graph(self) -> None:
        """None: xcp's tools capture rings and whole-sequence calls, and on Ascend both run npu_fusion_attention, which
        does not support aclgraph (``xcp bench --replay`` is refused, ``--decode`` runs eagerly). Users may still
        capture a KV cache's decode step with torch.npu.graph themselves (its forward_range runs the masked math
        then)."""
        return None

    def capture_graph(self, graph: Any) -> Any:
        """Refused (RuntimeError :data:`CAPTURE_REFUSED`): see :meth:`new_graph`."""
        raise RuntimeError(CAPTURE_REFUSED)

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        """Bytes held by tensors now (``allocated``) and at most since the last reset (``peak``)."""
        module = self._module()
        return {"allocated": module.memory_allocated(device), "peak": module.max_memory_allocated(device)}

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        self._module().reset_peak_memory_stats(device)

    # ------------------------------------------------------------------ block kernel
    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """The compressed causal mask on ``device``, built once per device."""
        if device not in self._masks:
            self._masks[device] = convert.causal_mask(device)
        return self._masks[device]

    def _sparse(self, causal: bool, device: torch.device) -> dict[str, Any]:
        return convert.sparse_args(causal, self._causal_mask(device) if causal else None)

    def _varlen(self, cu_q, cu_k, causal: bool, tq: int, tk: int, device: torch.device, window=None) -> dict[str, Any]:
        mask = self._causal_mask(device) if causal or window is not None else None  # modes 3 and 4 share the mask
        args = convert.varlen_args(cu_q, cu_k, causal, tq, tk, mask, window)
        return {**args, **convert.softmax_layout_args(self.tnd_stats)}

    @staticmethod
    def _varlen_fallback(q, k, v, cu_q, cu_k, window) -> str | None:
        """Why the fused TND call cannot take these packed segments (None when it can): a dtype or shape it does not
        take, or a window under which some query sees no key (TND forbids fully masked rows; the ring never asks for
        one)."""
        why = convert.varlen_unsupported(q, k, v)
        if why is None and window is not None:
            why = convert.band_has_empty_rows(cu_q, cu_k, window)
        return why

    def forward(self, q, k, v, mask, scale):
        """(out, lse) of the block under ``mask`` (see :meth:`FusedKernelBackend.forward`); out in v's head dim. More
        than 256 query heads: one block per chunk of heads. Dtypes or head dims the op refuses: the math. Values of a
        larger head dim than q/k's go with q and k zero-padded to it."""
        if heads.too_many(q):
            return heads.split_forward(lambda *x: self.forward(*x, mask, scale), q, k, v)
        dqk, dv = q.shape[3], v.shape[3]
        if convert.dtype_unsupported(q, k, v) or convert.value_dims_unsupported(dqk, dv):
            out, lse = math_forward(q, k, v, mask, scale)
            return (out.to(q.dtype) if q.dtype != torch.float64 else out), lse
        width = convert.call_head_dim(dqk, dv)
        return super().forward(widen_head_dim(q, width), widen_head_dim(k, width), v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        """(dq, dk, dv) of the block from the merged out and lse, shaped like q, k, v (dv in v's head dim), the way
        :meth:`forward` went: per chunk of heads, as is, with q and k padded (dq, dk sliced back), or the math."""
        if heads.too_many(q):
            return heads.split_backward(lambda *x: self.backward(*x, mask, scale), dout, q, k, v, out, lse)
        dqk, dv = q.shape[3], v.shape[3]
        if convert.dtype_unsupported(q, k, v) or convert.value_dims_unsupported(dqk, dv):
            return math_backward(dout, q, k, v, out, lse, mask, scale)
        width = convert.call_head_dim(dqk, dv)
        wide_q, wide_k = widen_head_dim(q, width), widen_head_dim(k, width)
        dq, dk, dv_ = super().backward(dout, wide_q, wide_k, v, out, lse, mask, scale)
        return dq[..., :dqk], dk[..., :dqk], dv_

    def square_forward(self, q, k, v, causal: bool, scale: float):
        convert.check_square(q, k, causal)
        groups = self.kv_groups(q, k)
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        outputs = self._op("npu_fusion_attention")(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            q.shape[2],  # head_num: the query heads; K/V may have fewer (GQA)
            convert.LAYOUT,
            scale=scale,
            keep_prob=1.0,
            **self._sparse(causal, q.device),
        )
        out, softmax_max, softmax_sum = convert.check_forward_outputs(q, v, outputs)
        return out, convert.lse_from_softmax_stats(softmax_max, softmax_sum)

    def square_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        convert.check_square(q, k, causal)
        return self._dense_grad(dout, q, k, v, out, lse, self._sparse(causal, q.device), scale)

    def _dense_grad(self, dout, q, k, v, out, lse, sparse: dict[str, Any], scale: float):
        """(dq, dk, dv) of one BSND npu_fusion_attention_grad call under the mask arguments ``sparse``, from the merged
        out and lse; q and k padded to v's head dim where it is larger (dq, dk sliced back)."""
        dqk = q.shape[3]
        width = convert.call_head_dim(dqk, v.shape[3])
        groups = self.kv_groups(q, k)
        qw = widen_head_dim(q, width)
        kr, vr = widen_head_dim(repeat_kv(k, groups), width), repeat_kv(v, groups)
        softmax_max, softmax_sum = convert.softmax_stats_from_lse(lse)
        grads = self._op("npu_fusion_attention_grad")(
            qw.contiguous(),
            kr.contiguous(),
            vr.contiguous(),
            dout.to(q.dtype).contiguous(),
            q.shape[2],
            convert.LAYOUT,
            softmax_max=softmax_max,
            softmax_sum=softmax_sum,
            softmax_in=None,  # the forward's softmax_in output is a reserved, empty tensor
            attention_in=out.to(q.dtype).contiguous(),  # the merged out: the kernel's rowsum(dO * O)
            scale_value=scale,  # named scale_value here, scale in the forward
            keep_prob=1.0,
            **sparse,
        )
        dq, dk, dv = grads[0][..., :dqk], grads[1][..., :dqk], grads[2]
        return dq, sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)

    # ------------------------------------------------------------------ packed segments
    def forward_varlen(self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=None):
        """All segments in one TND npu_fusion_attention call (per-segment sparse_mode 3 when causal, sparse_mode 4
        with pre_tockens/next_tockens = ``window``); a block the fused op cannot take (dtype, head dims, batch, a
        window with a query that sees no key) goes to the per-segment default, more than 256 query heads to one call
        per chunk of heads. Values of a larger head dim than q/k's go with q and k zero-padded to it."""
        if heads.too_many(q):
            call = lambda q_, k_, v_: self.forward_varlen(q_, k_, v_, cu_q, cu_k, causal, scale, window)  # noqa: E731
            return heads.split_forward(call, q, k, v)
        if self._varlen_fallback(q, k, v, cu_q, cu_k, window):
            return super().forward_varlen(q, k, v, cu_q, cu_k, causal, scale, window)
        groups = self.kv_groups(q, k)
        width = convert.call_head_dim(q.shape[3], v.shape[3])
        qt = widen_head_dim(q[0], width).contiguous()  # [T, N, D]: batch 1 dropped
        kt = widen_head_dim(repeat_kv(k, groups)[0], width).contiguous()
        vt = repeat_kv(v, groups)[0].contiguous()
        outputs = self._op("npu_fusion_attention")(
            qt,
            kt,
            vt,
            qt.shape[1],  # head_num: the query heads; K/V may have fewer (GQA)
            convert.VARLEN_LAYOUT,
            scale=scale,
            keep_prob=1.0,
            **self._varlen(cu_q, cu_k, causal, q.shape[1], k.shape[1], q.device, window),
        )
        out, softmax_max, softmax_sum = convert.check_varlen_forward_outputs(qt, vt, outputs)
        return out.unsqueeze(0), convert.lse_from_tnd_stats(softmax_max, softmax_sum, cu_q, self.tnd_stats)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, window=None):
        """Gradients of all segments in one TND npu_fusion_attention_grad call, from the merged out and lse (the same
        sparse_mode, mask, pre_tockens/next_tockens and q/k padding as the forward; dq, dk sliced back). Where the
        call's head dim is above the TND grad's 512, one BSND grad call per segment with the same mask arguments."""
        if heads.too_many(q):

            def chunk(do, q_, k_, v_, o, x):  # noqa: ANN001, ANN202 - one chunk of heads, same arguments
                return self.backward_varlen(do, q_, k_, v_, o, x, cu_q, cu_k, causal, scale, window)

            return heads.split_backward(chunk, dout, q, k, v, out, lse)
        if self._varlen_fallback(q, k, v, cu_q, cu_k, window):
            return super().backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
        if convert.tnd_grad_unsupported(q.shape[3], v.shape[3]):
            return self._segment_grads(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
        groups = self.kv_groups(q, k)
        dqk = q.shape[3]
        width = convert.call_head_dim(dqk, v.shape[3])
        qt = widen_head_dim(q[0], width).contiguous()
        kt = widen_head_dim(repeat_kv(k, groups)[0], width).contiguous()
        vt = repeat_kv(v, groups)[0].contiguous()
        softmax_max, softmax_sum = convert.tnd_stats_from_lse(lse, cu_q, self.tnd_stats)
        grads = self._op("npu_fusion_attention_grad")(
            qt,
            kt,
            vt,
            dout[0].to(q.dtype).contiguous(),
            qt.shape[1],
            convert.VARLEN_LAYOUT,
            softmax_max=softmax_max,
            softmax_sum=softmax_sum,
            softmax_in=None,
            attention_in=out[0].to(q.dtype).contiguous(),  # the merged out
            scale_value=scale,
            keep_prob=1.0,
            **self._varlen(cu_q, cu_k, causal, q.shape[1], k.shape[1], q.device, window),
        )
        dq, dk, dv = grads[0][..., :dqk].unsqueeze(0), grads[1][..., :dqk].unsqueeze(0), grads[2].unsqueeze(0)
        return dq, sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)

    def _segment_grads(self, dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, window):
        """(dq, dk, dv) of packed segments from one BSND grad call per segment (batch 1), under the mask arguments the
        TND call would have had: square causal sparse_mode 3, the band sparse_mode 4 (counted from the segment's
        bottom-right corner in BSND as in TND), else none. Rows of a segment without keys get dq 0, keys of one without
        queries dk = dv = 0."""
        mask = self._causal_mask(q.device)
        sparse = convert.band_args(window, mask) if window is not None else self._sparse(causal, q.device)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
            if a == b or c == d:
                continue
            rows, keys = slice(a, b), slice(c, d)
            args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows])
            dq[:, rows], dk[:, keys], dv[:, keys] = self._dense_grad(*args, sparse, scale)
        return dq, dk, dv

    # ------------------------------------------------------------------ KV-cache ranges
    def forward_range(self, q, k, v, lo, hi, scale: float):
        """Every query row against key rows ``lo .. hi - 1`` of the cache's storage, in one TND npu_fusion_attention
        call: B segments of T queries, each against its own copy of the range (see :mod:`xcp_npu.convert`).

        Not capturable on Ascend; one host read per step: the op takes actual_seq_qlen / actual_seq_kvlen only as host
        lists, so ``lo`` and ``hi`` are read to the host once per call (which waits for the device work queued before
        it). While the current stream is being captured into a graph the call goes to the base class's masked math
        instead (lengths on the device, capturable, reads the whole room). An empty range (``lo == hi``) gives out 0
        and lse -inf without calling the op; dtypes, head dims or batches the op does not take go to the base class,
        more than 256 query heads to one call per chunk of heads. Values of a larger head dim than q/k's go with q and
        k zero-padded to it; out is in v's head dim.
        """
        if convert.range_unsupported(q, k, v) or self.is_capturing():
            return super().forward_range(q, k, v, lo, hi, scale)
        if heads.too_many(q):
            return heads.split_forward(lambda q_, k_, v_: self.forward_range(q_, k_, v_, lo, hi, scale), q, k, v)
        start, stop = convert.range_bounds(lo, hi, k.shape[1])  # the one host read
        length = stop - start
        if length == 0:
            return convert.empty_range(q, v)
        b, t, n, _ = q.shape
        groups = self.kv_groups(q, k)
        width = convert.call_head_dim(q.shape[3], v.shape[3])  # v's head dim above q/k's: q, k zero-padded to it
        qt = widen_head_dim(q, width).reshape(b * t, n, width).contiguous()
        kt, vt = (
            widen_head_dim(repeat_kv(x[:, start:stop], groups), w).reshape(b * length, -1, w).contiguous()
            for x, w in ((k, width), (v, v.shape[3]))
        )
        cu_q, cu_k = convert.range_cuts(b, t), convert.range_cuts(b, length)
        outputs = self._op("npu_fusion_attention")(
            qt,
            kt,
            vt,
            n,  # head_num: the query heads; K/V may have fewer (GQA)
            convert.VARLEN_LAYOUT,
            scale=scale,
            keep_prob=1.0,
            **self._varlen(cu_q, cu_k, False, b * t, b * length, q.device),
        )
        out, softmax_max, softmax_sum = convert.check_varlen_forward_outputs(qt, vt, outputs)
        lse = convert.lse_from_tnd_stats(softmax_max, softmax_sum, cu_q, self.tnd_stats)
        return out.reshape(b, t, n, -1), convert.range_lse(lse, b)

    # ------------------------------------------------------------------ paged KV pools
    def paged_in_place(self, q, k_pool, v_pool, max_q: int | None = None) -> bool:
        """Whether :meth:`forward_paged` reads these pools in place for every call a paged cache makes (decode rows
        and chunks; the same answer for any ``max_q``): float16 / bfloat16, values of the keys' shape, both
        contiguous, head dims up to 512 (a multiple of 16), at most 256 query heads and 64 per K/V head, blocks of
        128..512 rows in multiples of 128, and ``gqa="native"`` (repeating would copy the pool); see
        :mod:`xcp_npu.paged`."""
        return (self.gqa == "native" or q.shape[-2] == k_pool.shape[-2]) and paged.in_place_unsupported(
            q, k_pool, v_pool
        ) is None

    def forward_paged(self, q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal=False):
        """npu_fused_infer_attention_score over the pool's blocks (BSND query, ``block_table``,
        ``actual_seq_lengths_kv``, ``num_key_value_heads``, ``softmax_lse_flag``): no block copied. One call, or as
        few as keep the blocks each call reads within the pool (the op's limit; segments of one sequence share its
        blocks): :func:`paged.plan`.

        Not capturable; one host read per call: the op takes its lengths as host lists, so ``cu_q`` and ``seqused_k``
        are read to the host once. Under graph capture, for pools the op does not take (:func:`paged.pool_unsupported`)
        and for calls it does not (several queries per entry on blocks other than 128..512 rows, a causal entry
        with more queries than keys: :func:`paged.plan`) the base class's gather runs instead. Segments without
        queries or keys are left out of the call: their rows are 0 with lse -inf."""
        args = (q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal)
        native = self.gqa == "native" or q.shape[-2] == k_pool.shape[-2]
        if not native or paged.pool_unsupported(q, k_pool, v_pool) or self.is_capturing():
            return super().forward_paged(*args)
        cu, used = paged.read_lengths(cu_q, seqused_k)  # the one host read
        n, block, hkv, d = k_pool.shape
        calls = paged.plan(cu, used, block, n, block_table.shape[1], causal, d)
        if isinstance(calls, str):
            return super().forward_paged(*args)
        t, h = q.shape[0], q.shape[1]
        out = q.new_zeros((t, h, d))
        lse = torch.full((h, t), float("-inf"), dtype=torch.float32, device=q.device)
        if calls:
            padded = torch.cat((q, q.new_zeros((1, h, d))))  # a zero row for the padded query slots
            op = self._op(paged.OP)
            for call in calls:
                self._paged_call(op, call, padded, k_pool, v_pool, block_table, scale, causal, out, lse)
        return out, lse

    def _paged_call(self, op, call: paged.Call, padded, k_pool, v_pool, block_table, scale: float, causal: bool,
                    out: torch.Tensor, lse: torch.Tensor) -> None:  # fmt: skip
        """One op call over ``call``'s entries, its rows written into ``out`` [T, H, D] and ``lse`` [H, T]."""
        n, block, hkv, d = k_pool.shape
        h, dev = out.shape[1], out.device
        where = torch.tensor(call.gather(padded.shape[0] - 1), dtype=torch.int64, device=dev)
        queries = padded.index_select(0, where).view(-1, call.width, h, d)
        table = block_table.index_select(0, torch.tensor(call.segments, dtype=torch.int64, device=dev))
        mask = self._causal_mask(dev) if causal else None
        outputs = op(
            queries,
            k_pool.view(n, block, hkv * d),  # (blocknum, blocksize, H): what a BSND query reads
            v_pool.view(n, block, hkv * d),
            block_table=table.to(torch.int32).contiguous(),
            **paged.call_args(call, h, hkv, block, causal, mask, paged.scale_keyword(op), scale),
        )
        o, entry_lse = paged.check_outputs(outputs, call, h, d)
        rows = torch.tensor(call.rows, dtype=torch.int64, device=dev)
        slots = torch.tensor(call.slots, dtype=torch.int64, device=dev)
        out.index_copy_(0, rows, o.reshape(-1, h, d).index_select(0, slots).to(out.dtype))
        lse.index_copy_(1, rows, entry_lse.transpose(0, 1).reshape(h, -1).index_select(1, slots))
