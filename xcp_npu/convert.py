"""Pure conversions between xcp's block convention and Ascend's npu_fusion_attention; no torch_npu here.

npu_fusion_attention (torch_npu docs, "torch_npu.npu_fusion_attention") returns, besides attention_out,
``softmax_max`` and ``softmax_sum``, float32 [B, N, Sq, 8]: the 8 entries of a row are copies of one value
(a layout the kernel's vector units like). With m the row max of the scaled scores and s = Σ exp(x - m),
the row's log-sum-exp is m + log(s). Its backward ``npu_fusion_attention_grad`` recomputes the
probabilities as exp(x - softmax_max) / softmax_sum, so the ring's merged lse L goes back in as
softmax_max = L (expanded to 8) with softmax_sum = 1.

Packed segments (documents) use the TND layout instead: see the section on them below, which also records what the
docs leave unclear about the TND softmax statistics. Values of another head dim than the queries' and keys' (MLA):
the section at the end.

Masks: xcp asks the dense kernel only for "none" or causal on a square block (:mod:`xcp.backends.fused` cuts
every other case, including strictly-causal, into those); packed segments may also carry a sliding window,
sparse_mode 4 (see the section on windows at the end). Square causal is sparse_mode 3 (rightDownCausal, the
mode Ascend recommends for causal training) with the compressed 2048×2048 mask whose True entries (the
strict upper triangle) are masked out; on a square block right-down and top-left alignment coincide.
For sparse modes 2 and 3 the kernel ignores pre_tockens and next_tockens.
"""

from __future__ import annotations

from typing import Any

import torch

from xcp.kernels.merge import NEG_INF

STAT_WIDTH = 8
"""Last dim of softmax_max / softmax_sum: 8 copies of the row's value."""
CAUSAL_MASK_SIZE = 2048
"""Side of the compressed causal mask that sparse_mode 2/3 take, whatever the sequence lengths."""
SPARSE_NONE, SPARSE_RIGHT_DOWN_CAUSAL, SPARSE_BAND = 0, 3, 4
MAX_TOKENS = 2147483647
"""The ops' default pre_tockens / next_tockens: no band limit."""
LAYOUT = "BSND"
"""xcp's [batch, seq, heads, head_dim] under Ascend's name: no transpose on the way in or out."""

# ---------------------------------------------------------------------------------------------- limits of the op
# What the sources state for every call (quotes abridged, translations ours):
#
# - Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md (the text of hiascend.com's
#   "torch_npu.npu_fusion_attention"), 约束说明: query/key/value dtypes float16, bfloat16, float32 (no float64);
#   "Nq取值范围1~256" (N_q 1..256, N_kv dividing it); "D：Head Dim必须满足Dq=Dk和Dk≥Dv，取值范围1~768";
#   "该接口暂不支持图模式，不支持aclgraph" (no graph mode, no aclgraph capture);
#   "支持actual_seq_qlen中某个Batch上的S长度为0" (a segment may have no queries; nothing is said of one without keys,
#   and TND allows no fully masked row).
# - CANN's grad pages (hicann/ops-transformer attention/flash_attention_score_grad/docs/):
#   aclnnFlashAttentionScoreGrad.md (the BSND grad) "N：取值范围为1~256", "D：取值范围为1~768";
#   aclnnFlashAttentionUnpaddingScoreGrad.md (the TND grad, V2..V4 alike) "N：取值范围为1~256", "D：取值范围为1~512".
#   The forward pages (aclnnFlashAttentionScore.md, aclnnFlashAttentionVarLenScore.md) say N 1..256, D 1..768.
#
# So: float64 goes to the base class's math; more than 256 query heads are split into calls of at most 256 with whole
# GQA groups (:func:`head_chunks`); packed segments whose call head dim is above 512 keep their TND forward and take
# their gradients per segment in BSND (:func:`tnd_grad_unsupported`); nothing calls the op while a graph is captured.

OP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes npu_fusion_attention(_grad) take; float64 goes to the base class's math."""
MAX_QUERY_HEADS = 256
"""The most query heads (head_num) of one call, forward and grad, BSND and TND."""
TND_GRAD_MAX_HEAD_DIM = 512
"""The largest head dim of the TND grad (aclnnFlashAttentionUnpaddingScoreGrad); the forward and the BSND grad take 768
(:data:`DOCUMENTED_MAX_HEAD_DIM`)."""


def dtype_unsupported(*tensors: torch.Tensor) -> str | None:
    """Why the op cannot take these tensors' dtypes (one dtype among :data:`OP_DTYPES`); None when it can."""
    dtypes = {x.dtype for x in tensors}
    if len(dtypes) != 1 or tensors[0].dtype not in OP_DTYPES:
        names = "/".join(str(x.dtype) for x in tensors)
        return f"dtypes {names} (the op takes one of float16, bfloat16, float32)"
    return None


def head_chunks(heads: int, kv_heads: int, limit: int = MAX_QUERY_HEADS) -> list[tuple[slice, slice]]:
    """The (query heads, K/V heads) of calls of at most ``limit`` query heads that together cover ``heads`` query heads
    reading ``kv_heads`` K/V heads (query head h reads K/V head h // (heads // kv_heads)); one chunk when ``heads <=
    limit``. Whole GQA groups stay together, in chunks of near-equal size; a group larger than ``limit`` is cut into
    equal parts of its largest divisor not above ``limit``, each part reading that group's one K/V head (whose
    gradients the caller then sums). E.g. (512, 8) -> 2 chunks of 256 query heads and 4 K/V heads each."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads = {heads}; got {kv_heads}")
    if heads <= limit:
        return [(slice(0, heads), slice(0, kv_heads))]
    group = heads // kv_heads
    if group > limit:
        part = max(d for d in range(1, limit + 1) if group % d == 0)
        return [(slice(h, h + part), slice(h // group, h // group + 1)) for h in range(0, heads, part)]
    per_call = limit // group  # K/V heads a call can take with their whole groups
    calls = -(-kv_heads // per_call)
    cuts = [kv_heads * i // calls for i in range(calls + 1)]
    return [(slice(a * group, b * group), slice(a, b)) for a, b in zip(cuts, cuts[1:])]


def lse_from_softmax_stats(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    """lse [B, N, Sq] float32 = softmax_max[..., 0] + log(softmax_sum[..., 0]); -inf where the sum is 0.

    A row with no visible key has sum 0 (whatever its max), so its lse is -inf, never NaN.
    """
    check_softmax_stats("softmax_max", softmax_max)
    if softmax_sum.shape != softmax_max.shape:
        raise ValueError(
            f"softmax_sum: expected shape {tuple(softmax_max.shape)} (that of softmax_max); "
            f"got {tuple(softmax_sum.shape)}"
        )
    m = softmax_max[..., 0].to(torch.float32)
    s = softmax_sum[..., 0].to(torch.float32)
    return torch.where(s > 0, m + torch.log(s), NEG_INF)


def softmax_stats_from_lse(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax_max, softmax_sum) for the backward, float32 [B, N, Sq, 8], from a merged lse [B, N, Sq].

    softmax_max = lse, softmax_sum = 1, so exp(x - max) / sum = exp(x - lse). Rows whose lse is -inf (no
    key anywhere) get max = +inf: exp(x - inf) = 0 makes their gradients 0 instead of inf - inf = NaN.
    """
    if lse.dim() != 3:
        raise ValueError(f"lse: expected 3 dims [B, N, Sq]; got shape {tuple(lse.shape)}")
    lse = lse.to(torch.float32)
    m = torch.where(lse == NEG_INF, float("inf"), lse)
    softmax_max = m.unsqueeze(-1).expand(*lse.shape, STAT_WIDTH).contiguous()
    softmax_sum = torch.ones_like(softmax_max)
    return softmax_max, softmax_sum


def check_softmax_stats(name: str, x: torch.Tensor, expected: tuple[int, int, int] | None = None) -> None:
    """Raise a ValueError unless ``x`` is [B, N, Sq, 8] (and [*expected, 8] when given)."""
    want = f"[B, N, Sq, {STAT_WIDTH}]" if expected is None else str((*expected, STAT_WIDTH))
    if x.dim() != 4 or x.shape[-1] != STAT_WIDTH or (expected is not None and tuple(x.shape[:3]) != tuple(expected)):
        raise ValueError(f"{name}: expected shape {want}; got {tuple(x.shape)}")


def causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The compressed causal mask of sparse_mode 2/3: bool [2048, 2048], True (masked) above the diagonal."""
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu(diagonal=1)


def sparse_args(causal: bool, mask: torch.Tensor | None) -> dict[str, Any]:
    """Keyword arguments of npu_fusion_attention(_grad) for a block that is square-causal or unmasked.

    :param causal: square causal (sparse_mode 3 with ``mask``) or no mask (sparse_mode 0, no atten_mask).
    :param mask: the tensor of :func:`causal_mask` on the block's device; required when ``causal``.
    """
    if not causal:
        return {
            "atten_mask": None,
            "sparse_mode": SPARSE_NONE,
            "pre_tockens": MAX_TOKENS,
            "next_tockens": MAX_TOKENS,
        }
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE):
        got = None if mask is None else (tuple(mask.shape), mask.dtype)
        raise ValueError(f"mask: expected a bool [{CAUSAL_MASK_SIZE}, {CAUSAL_MASK_SIZE}] tensor; got {got}")
    return {
        "atten_mask": mask,
        "sparse_mode": SPARSE_RIGHT_DOWN_CAUSAL,
        "pre_tockens": MAX_TOKENS,
        "next_tockens": MAX_TOKENS,
    }


def check_square(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """Raise unless a causal call is square (the only causal case that is the same in every alignment)."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"k: a causal kernel call needs as many keys as queries ({q.shape[1]}); got {k.shape[1]}")


def check_forward_outputs(q: torch.Tensor, v: torch.Tensor, outputs: Any) -> tuple[torch.Tensor, ...]:
    """(attention_out, softmax_max, softmax_sum) from npu_fusion_attention's 7 outputs, shapes checked.

    A clear error here beats a wrong lse later if a torch_npu version changes its outputs.
    """
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 3:
        raise ValueError(f"npu_fusion_attention: expected at least 3 outputs; got {type(outputs).__name__}")
    out, smax, ssum = outputs[0], outputs[1], outputs[2]
    b, sq, n, _ = q.shape
    expected_out = (b, sq, n, v.shape[3])
    if tuple(out.shape) != expected_out:
        raise ValueError(
            f"attention_out: expected shape {expected_out} (BSND); got {tuple(out.shape)}{_value_dim_hint(q, v, out)}"
        )
    check_softmax_stats("softmax_max", smax, (b, n, sq))
    check_softmax_stats("softmax_sum", ssum, (b, n, sq))
    return out, smax, ssum


# ---------------------------------------------------------------------------------------------- packed segments (TND)
# What the sources say (checked for this code; quotes abridged):
#
# - actual_seq_qlen / actual_seq_kvlen are host int lists of CUMULATIVE lengths WITHOUT a leading 0. The
#   parameter text of npu_fusion_attention as restated in Ascend/MindSpeed docs/ops/fusion_attention.md:
#   "Host侧的int array ... 表示query每个S的累加和长度 ... 比如真正的S长度列表为：2 2 2 2 2 则actual_seq_qlen传：
#   2 4 6 8 10" (lengths 2 2 2 2 2 -> pass 2 4 6 8 10); hiascend.com's "torch_npu.npu_fusion_attention" page
#   (PyTorch 6.0.RC3, ptaoplist_000445) lists "TND(actual_seq_qlen/actual_seq_kvlen需传值)". torch_npu's op-plugin
#   (the C++ adapter) agrees: for TND it counts dropout elements as ac_seq_qlen[0] * ac_seq_kvlen[0] plus the
#   products of the later differences, i.e. element 0 is the first segment's length, and it requires both lists
#   non-empty and of equal length. A segment with Sq > 0 and Skv == 0 is not supported (ours are never empty).
# - TND softmax_max / softmax_sum are allocated as float32 [T, N, 8] (op-plugin: "{T, N_local, 8} // [T, N, 8]"),
#   but CANN's aclnnFlashAttentionVarLenScoreV4 page (CANN 8.3.RC1 / 8.5.0 operator API) says the original varlen
#   kernel's softmax outputs, "虽然标注为 TND 格式，实际的数据排布为 NTD" (labelled TND, actually laid out NTD);
#   V4 adds softmaxOutLayout = "same_as_input" for a true TND layout, and aclnnFlashAttentionUnpaddingScoreGradV4
#   reads its softmax inputs the same way (softmaxInLayout "" = NTD data, "same_as_input" = TND). torch_npu exposes
#   this as softmax_layout="TND" (newer op-plugin only; it raises "The param softmax_layout is not supported"
#   where the CANN kernels lack V4).
# - What "NTD" means is settled by the kernels: PER SEGMENT. CANN's forward kernel (hicann/ops-transformer
#   attention/flash_attention_score/op_kernel/flash_attention_score_s1s2_bn2gs1.h) writes row r of head h of the segment
#   starting at token s1SizeAcc, of s1Size queries, at softmaxMaxOffset = (s1SizeAcc * N + h * s1Size + r) * 8 without
#   tndSoftmaxOut, and (s1SizeAcc * N + r * N + h) * 8 with it; the grad kernel
#   (attention/flash_attention_score_grad/op_kernel/flash_attention_score_grad_s1s2_bn2gs1s2.h) reads them back the same
#   way, and Ascend/MindSpeed's flatten_softmax / unflatten_softmax (mindspeed/core/context_parallel/utils.py, its TND
#   ring attention) agree. So segment i occupies rows [N * cu[i], N * cu[i+1]) of the [T * N, 8] view, as [N, s_i]
#   (head-major within the segment): the default "segment"; "tnd" passes softmax_layout="TND" (token-major). A global
#   [N, T] order is not what any kernel writes, so it is not offered.

VARLEN_LAYOUT = "TND"
"""Packed segments as [T, N, D] (batch 1 dropped), boundaries in actual_seq_qlen / actual_seq_kvlen."""
TND_STATS_LAYOUTS = ("segment", "tnd")
"""How the TND kernel lays out softmax_max / softmax_sum rows (see the notes above): ``segment`` (default, what the
kernels write without softmax_layout) per segment [N, s_i]; ``tnd`` [T, N] (passes softmax_layout="TND")."""


def check_tnd_stats(layout: str) -> str:
    """Return ``layout`` if it is one of :data:`TND_STATS_LAYOUTS`, else raise a ValueError listing them."""
    if layout not in TND_STATS_LAYOUTS:
        raise ValueError(f"tnd_stats: expected one of {', '.join(TND_STATS_LAYOUTS)}; got {layout!r}")
    return layout


def varlen_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> str | None:
    """Why the fused TND forward cannot take q [1, T, N, D] / k [1, T, N_kv, D] / v [1, T, N_kv, Dv] (v: k when
    None); None when it can. Its backward has a tighter head-dim limit: :func:`tnd_grad_unsupported`."""
    v = k if v is None else v
    n, n_kv = q.shape[2], k.shape[2]
    if q.shape[0] != 1 or k.shape[0] != 1:
        return f"batch {q.shape[0]} (TND packs batch 1)"
    why = dtype_unsupported(q, k, v) or value_dims_unsupported(q.shape[3], v.shape[3])
    if why is not None:
        return why
    if n_kv == 0 or n % n_kv:
        return f"{n_kv} K/V heads do not divide {n} query heads"
    return None


def nonempty_segments(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``cu_q`` and ``cu_k`` without the segments empty on both sides (no query and no key: nothing to compute; the
    kernel's cumulative lists take no empty segment). E.g. ``(0, 0, 2, 2)``, ``(0, 0, 3, 3)`` -> ``(0, 2)``,
    ``(0, 3)``. A segment empty on one side only is left for :func:`actual_seq_lens` to refuse. The ring's runs never
    hold an empty segment (``xcp.documents.check_cu_seqlens`` drops empty documents); this serves direct callers.
    """
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_k: expected {len(cu_q) - 1} segments (as cu_q); got {len(cu_k) - 1}")
    keep = [i for i in range(len(cu_q)) if i == 0 or (cu_q[i], cu_k[i]) != (cu_q[i - 1], cu_k[i - 1])]
    return tuple(cu_q[i] for i in keep), tuple(cu_k[i] for i in keep)


def actual_seq_lens(cu: tuple[int, ...] | list[int], total: int, name: str = "cu_q") -> list[int]:
    """``cu`` (``(0, ..., total)``, strictly increasing) as the kernel's cumulative list: ``list(cu[1:])``.

    E.g. ``(0, 3, 8, 12)`` -> ``[3, 8, 12]``. Raises a ValueError naming ``name`` unless ``cu`` starts at 0, ends at
    ``total`` (the tokens of the call) and has no empty segment (the kernel takes none: drop the segments empty in
    both queries and keys first, :func:`nonempty_segments`).
    """
    values = [int(x) for x in cu]
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name}: expected cumulative boundaries from 0 to {total}; got {tuple(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: expected strictly increasing boundaries (no empty segment); got {tuple(values)}")
    return values[1:]


def varlen_args(
    cu_q: tuple[int, ...],
    cu_k: tuple[int, ...],
    causal: bool,
    tq: int,
    tk: int,
    mask: torch.Tensor | None,
    window: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of npu_fusion_attention(_grad) for packed segments: the cumulative lists and the mask.

    Causal segments are square (``cu_q == cu_k``): sparse_mode 3 (right-down causal, per segment in TND) with the
    compressed 2048x2048 mask, which on a square segment is top-left causal. A ``window`` (only with
    ``causal=False``) is sparse_mode 4 with the same mask (:func:`band_args`). Otherwise sparse_mode 0, no mask.
    Segments empty in both queries and keys are left out (:func:`nonempty_segments`).
    """
    cu_q, cu_k = nonempty_segments(cu_q, cu_k)
    qlen, kvlen = actual_seq_lens(cu_q, tq, "cu_q"), actual_seq_lens(cu_k, tk, "cu_k")
    if window is not None:
        if causal:
            raise ValueError(f"window: a window goes with causal=False; got causal=True and window={window!r}")
        return {"actual_seq_qlen": qlen, "actual_seq_kvlen": kvlen, **band_args(window, mask)}
    if causal and qlen != kvlen:
        raise ValueError(f"cu_k: causal segments must be square (cu_k == cu_q = {tuple(cu_q)}); got {tuple(cu_k)}")
    return {"actual_seq_qlen": qlen, "actual_seq_kvlen": kvlen, **sparse_args(causal, mask)}


def softmax_layout_args(layout: str) -> dict[str, Any]:
    """``{"softmax_layout": "TND"}`` for the ``tnd`` stats layout; nothing otherwise (older torch_npu lacks it)."""
    return {"softmax_layout": "TND"} if check_tnd_stats(layout) == "tnd" else {}


def _stat_rows(lse_nt: torch.Tensor, cu: tuple[int, ...], layout: str) -> torch.Tensor:
    """[N, T] -> the T * N values in the order of the kernel's stat rows under ``layout``."""
    if layout == "tnd":
        return lse_nt.t().reshape(-1)
    return torch.cat([lse_nt[:, a:b].reshape(-1) for a, b in zip(cu, cu[1:])])


def _rows_to_nt(rows: torch.Tensor, cu: tuple[int, ...], layout: str, n: int) -> torch.Tensor:
    """The kernel's T * N stat rows under ``layout`` -> [N, T] (the inverse of :func:`_stat_rows`)."""
    t = rows.numel() // n
    if layout == "tnd":
        return rows.reshape(t, n).t()
    sizes = [n * (b - a) for a, b in zip(cu, cu[1:])]
    return torch.cat([part.reshape(n, -1) for part in rows.split(sizes)], dim=1)


def check_tnd_stats_shape(name: str, x: torch.Tensor, t: int, n: int) -> None:
    """Raise a ValueError unless ``x`` is [T, N, 8]."""
    if tuple(x.shape) != (t, n, STAT_WIDTH):
        raise ValueError(f"{name}: expected shape {(t, n, STAT_WIDTH)} (TND statistics); got {tuple(x.shape)}")


def lse_from_tnd_stats(
    softmax_max: torch.Tensor, softmax_sum: torch.Tensor, cu_q: tuple[int, ...], layout: str = "segment"
) -> torch.Tensor:
    """lse [1, N, T] float32 from TND statistics [T, N, 8] laid out as ``layout``; -inf where the sum is 0."""
    check_tnd_stats(layout)
    t = cu_q[-1]
    if softmax_max.dim() != 3:
        raise ValueError(f"softmax_max: expected shape [{t}, N, {STAT_WIDTH}]; got {tuple(softmax_max.shape)}")
    n = softmax_max.shape[1]
    check_tnd_stats_shape("softmax_max", softmax_max, t, n)
    check_tnd_stats_shape("softmax_sum", softmax_sum, t, n)
    m = _rows_to_nt(softmax_max.reshape(-1, STAT_WIDTH)[:, 0].to(torch.float32), cu_q, layout, n)
    s = _rows_to_nt(softmax_sum.reshape(-1, STAT_WIDTH)[:, 0].to(torch.float32), cu_q, layout, n)
    return torch.where(s > 0, m + torch.log(s), NEG_INF).unsqueeze(0)


def tnd_stats_from_lse(
    lse: torch.Tensor, cu_q: tuple[int, ...], layout: str = "segment"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax_max, softmax_sum) float32 [T, N, 8] laid out as ``layout``, from a merged lse [1, N, T].

    As :func:`softmax_stats_from_lse`: softmax_max = lse (+inf where lse is -inf), softmax_sum = 1.
    """
    check_tnd_stats(layout)
    if lse.dim() != 3 or lse.shape[0] != 1 or lse.shape[2] != cu_q[-1]:
        raise ValueError(f"lse: expected shape [1, N, {cu_q[-1]}]; got {tuple(lse.shape)}")
    n, t = lse.shape[1], lse.shape[2]
    lse = lse[0].to(torch.float32)
    m = torch.where(lse == NEG_INF, float("inf"), lse)
    rows = _stat_rows(m, cu_q, layout)
    softmax_max = rows.reshape(t, n, 1).expand(t, n, STAT_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def check_varlen_forward_outputs(q: torch.Tensor, v: torch.Tensor, outputs: Any) -> tuple[torch.Tensor, ...]:
    """(attention_out, softmax_max, softmax_sum) of a TND call, shapes checked: q [T, N, D], v [Tk, N_kv, Dv]."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 3:
        raise ValueError(f"npu_fusion_attention: expected at least 3 outputs; got {type(outputs).__name__}")
    out, smax, ssum = outputs[0], outputs[1], outputs[2]
    t, n = q.shape[0], q.shape[1]
    expected_out = (t, n, v.shape[2])
    if tuple(out.shape) != expected_out:
        raise ValueError(
            f"attention_out: expected shape {expected_out} (TND); got {tuple(out.shape)}{_value_dim_hint(q, v, out)}"
        )
    check_tnd_stats_shape("softmax_max", smax, t, n)
    check_tnd_stats_shape("softmax_sum", ssum, t, n)
    return out, smax, ssum


# ---------------------------------------------------------------------------------------------- windows (band)
# What the sources say about sparse_mode 4 (checked for this code; quotes abridged, translations ours):
#
# - torch_npu's own page, Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md (the text of hiascend.com's
#   "torch_npu.npu_fusion_attention"), sparse_mode table: "4 | band模式". Its reference section: "当sparse_mode为4时，
#   代表band场景，即计算pre_tockens和next_tockens之间的部分，参数起点为右下角，pre_tockens和next_tockens之间需要有交集。
#   atten_mask为优化后的压缩下三角矩阵（2048*2048）" -- band: the part between pre_tockens and next_tockens is
#   computed, the parameters' ORIGIN IS THE BOTTOM-RIGHT CORNER, the two must intersect, and atten_mask is the
#   compressed lower-triangular 2048x2048 mask (the same one as sparse_modes 2/3; its example builds the mask of
#   modes 2, 3 and 4 alike as np.triu(np.ones([2048, 2048]), k=1), True = masked). Constraints on the same page:
#   "sparse_mode配置为0、4时，需保证atten_mask与pre_tockens、next_tockens的范围一致" (modes 0 and 4 honour
#   pre/next, unlike 1, 2, 3, 5, 6), and in the varlen (TND) case "atten_mask中不能存在某一行全1的场景" (no row may
#   be fully masked). CANN's ops-transformer docs/zh/context/sparse_mode参数说明.md says the same of sparseMode 4.
# - The mapping onto a band, and that it is PER SEGMENT in TND, for Sq != Skv: the same page's sparse_mode 7 example
#   (TND, "pre_tockens和next_tockens（起点为右下顶点）") cuts a 4x6 right-down causal batch into two 2x6 halves; the
#   first half is the band pre_tockens=6, next_tockens=-2 of its own 2x6 batch with actual_seq_qlen {3, 5},
#   actual_seq_kvlen {3, 9}. Rows 0, 1 of that half see keys 0..2 and 0..3, which is exactly
#       query i of a segment (Sq queries, Skv keys) sees key j iff -pre_tockens <= j - i - (Skv - Sq) <= next_tockens
#   (and the sparse_mode 8 example, a 3x4 band pre=4, next=1, checks out the same way). CANN's varlen forward kernel
#   (ops-transformer attention/flash_attention_score/op_kernel/arch32/flash_attention_var_len_score.h,
#   GetS2LoopRange, case BAND_COMPRESS) bounds row i's keys by i - S1 + (S2 - preTokens) .. i + 1 + S2 - (S1 -
#   nextTokens) with S1, S2 that batch's actual lengths, and its compressed-mask offset (attention/common,
#   ComputeAttenMaskOffsetCompress) shifts nextTokens by s2Size - s1Size for BAND, "统一以左上角为原点" (converting
#   to a top-left origin). The grad kernel makes the same per-batch correction ("sparse_mode == band ... token以右下角
#   为基本，需要校正").
# - So xcp's window (left, right) -- query m sees keys m + sk - sq - left .. m + sk - sq + right of its segment,
#   aligned to each segment's bottom-right corner as flash aligns it -- is sparse_mode 4 with pre_tockens = left,
#   next_tockens = right, the compressed causal mask, in both npu_fusion_attention and its grad. Nothing about the
#   alignment is left open by the docs (square or not, one segment or many), so no window falls back for alignment.
#   The one fallback is the documented varlen restriction: a segment in which some query sees no key
#   (sq - sk > right; see :func:`band_has_empty_rows`) goes to the base class's math band. The ring never asks for
#   such bands, so on the ring's path every window is one fused call per direction. Only Ascend hardware can confirm
#   the reading: tests/test_npu_pure.py has a device test comparing the fused band with the math band.


def check_band(window: Any) -> tuple[int, int]:
    """``window`` as ``(left, right)`` ints >= 0; a ValueError naming ``window`` otherwise."""
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if not ok or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in window):
        raise ValueError(f"window: expected a pair (left, right) of ints >= 0; got {window!r}")
    return int(window[0]), int(window[1])


def band_args(window: tuple[int, int], mask: torch.Tensor | None) -> dict[str, Any]:
    """Keyword arguments of npu_fusion_attention(_grad) for a bottom-right band ``(left, right)``: sparse_mode 4,
    pre_tockens = left, next_tockens = right, and the compressed causal mask ``mask`` (:func:`causal_mask`)."""
    left, right = check_band(window)
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE):
        got = None if mask is None else (tuple(mask.shape), mask.dtype)
        raise ValueError(f"mask: expected a bool [{CAUSAL_MASK_SIZE}, {CAUSAL_MASK_SIZE}] tensor; got {got}")
    return {"atten_mask": mask, "sparse_mode": SPARSE_BAND, "pre_tockens": left, "next_tockens": right}


def band_has_empty_rows(cu_q: tuple[int, ...], cu_k: tuple[int, ...], window: tuple[int, int]) -> str | None:
    """Why some query of the packed segments sees no key under the band ``window``; None when every one sees one.

    Query m of a segment (sq queries, sk keys) sees ``m + sk - sq - left .. m + sk - sq + right``: its last key is
    below 0 for m = 0 exactly when ``sq - sk > right`` (its first is never past the end, as left >= 0). TND forbids
    fully masked rows, so such calls go to the base class.
    """
    _, right = check_band(window)
    for i, (q0, q1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        sq, sk = q1 - q0, k1 - k0
        if sq - sk > right:
            return f"segment {i} ({sq} queries, {sk} keys): its first {sq - sk - right} queries see no key in {window}"
    return None


# ---------------------------------------------------------------------------------------------- KV-cache ranges
# What the sources say about serving Backend.forward_range (every query row against key rows lo..hi-1 of a KV cache's
# storage; lo and hi live on the device) with torch_npu (checked for this code; translations ours):
#
# - npu_fusion_attention takes actual_seq_qlen / actual_seq_kvlen only as host int lists (``int[]?`` in the signature of
#   hiascend.com's "torch_npu.npu_fusion_attention"; ``List[int]`` in Ascend/op-plugin
#   docs/context/torch_npu-npu_fusion_attention.md). The same page says the op is for training and "暂不支持图模式" (not
#   yet in graph mode); Ascend/op-plugin merge request !4123 (npu_fusion_attention_v3) says its NPU-graph (aclgraph)
#   capture covers only the BNSD layout without actual_seq_qlen / actual_seq_kvlen. So the TND call needs the range
#   on the host: one host read of (lo, hi) per call, and a graph captured with it would replay the lengths of the
#   capture. Hence forward_range reads the range once per call and, while the stream is being captured, leaves the
#   call to the base class's masked math (built on the device, capturable).
# - npu_fused_infer_attention_score (Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md) is the
#   inference op; a query of S = 1 takes its IncreFlashAttention (decode) branch, the cache is read in place with
#   actual_seq_lengths_kv per batch, and softmax_lse_flag returns the lse itself. But actual_seq_lengths_kv is also a
#   host list (``SymInt[]?``); query dtypes are float16 / bfloat16 only; a range that does not start at row 0 needs the
#   kv left-padding mode (kv_padding_size), documented only by a formula. The device-tensor form of
#   actual_seq_lengths_kv exists in TorchAir's own npu_fused_infer_attention_score (hiascend.com TorchAir guide,
#   "npu_fused_infer_attention_score", torchair_00086) for torch.compile graphs with tiling sunk to the device, not
#   for eager calls or torch.npu.graph; torch.npu.graph captures can instead have the host lists patched before each
#   replay (NPUGraph.update(cpu_update_input=[{"actual_seq_lengths": ...}]) in Ascend/pytorch
#   test/npu/test_aclgraph_update.py), which needs the host to know the lengths at every step. Neither serves xcp's
#   device-only contract; this module uses the TND call, whose conversions the varlen path already has.
# - Packing: B sequences of T queries each against its own copy of the range: q [B * T, N, D], keys k[:, lo:hi]
#   flattened to [B * (hi - lo), N_kv, D] (a view when B == 1 and the storage is contiguous, else one copy of the
#   range), actual_seq_qlen = T, 2T, .., B*T and actual_seq_kvlen = L, 2L, .., B*L with L = hi - lo; no mask
#   (sparse_mode 0). The op's docs bound S to 1..1M, allow a batch with query length 0 but say nothing of a batch
#   whose query has no key (and TND forbids fully masked rows), so an empty range (lo == hi) never reaches the op:
#   its out is 0 and its lse -inf, made here. The varlen batch count is at most 1K ("varlen场景下长度最大支持1K"):
#   B above :data:`TND_MAX_SEGMENTS` goes to the base class, as do dtypes the op lacks (:data:`OP_DTYPES`) and head
#   dims it refuses (:func:`value_dims_unsupported`).

TND_MAX_SEGMENTS = 1024
"""The most segments (batch entries) of one TND call the docs allow."""


def range_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the fused TND call cannot serve a KV-cache range for q [B, T, N, D], k [B, room, N_kv, D], v [B, room,
    N_kv, Dv]; None when it can."""
    b, t, n, d = q.shape
    n_kv = k.shape[2]
    why = dtype_unsupported(q, k, v)
    if why is not None:
        return why
    if k.shape[3] != d:
        return f"k: head dim {k.shape[3]} differs from q's {d}"
    why = value_dims_unsupported(d, v.shape[3])
    if why is not None:
        return why
    if n_kv == 0 or n % n_kv or v.shape[2] != n_kv:
        return f"{n_kv} K/V heads do not divide {n} query heads"
    if not 0 < b <= TND_MAX_SEGMENTS or t == 0:
        return f"batch {b} of {t} queries (one TND call packs 1..{TND_MAX_SEGMENTS} non-empty batch entries)"
    return None


def range_bounds(lo: torch.Tensor, hi: torch.Tensor, room: int) -> tuple[int, int]:
    """``(lo, hi)`` as host ints, read in ONE device-to-host copy (which waits for the work queued before it).

    Raises a ValueError unless each is an integer tensor of one element with ``0 <= lo <= hi <= room``.
    """
    for name, x in (("lo", lo), ("hi", hi)):
        if x.numel() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor of one element; got {x.dtype} {tuple(x.shape)}")
    start, stop = (int(x) for x in torch.cat((lo.reshape(1), hi.reshape(1).to(lo.dtype))).tolist())
    if not 0 <= start <= stop <= room:
        raise ValueError(f"lo, hi: expected 0 <= lo <= hi <= {room} (the storage's room); got {start}, {stop}")
    return start, stop


def range_cuts(batch: int, length: int) -> tuple[int, ...]:
    """The boundaries of ``batch`` segments of ``length`` tokens each: ``(0, length, 2 * length, ...)``."""
    return tuple(range(0, batch * length + 1, length)) if length else (0,) * (batch + 1)


def empty_range(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries that see no key: out 0 [B, T, N, Dv] in q's dtype, lse -inf float32 [B, N, T]."""
    b, t, n, _ = q.shape
    out = torch.zeros(b, t, n, v.shape[3], dtype=q.dtype, device=q.device)
    return out, torch.full((b, n, t), NEG_INF, dtype=torch.float32, device=q.device)


def range_lse(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """The TND lse [1, N, B * T] (batch entries one after another) as the block's [B, N, T]."""
    n, total = lse.shape[1], lse.shape[2]
    return lse[0].reshape(n, batch, total // batch).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------------- value head dims (MLA)
# What the sources say about values of another head dim than the queries' and keys' (Dv != Dqk; checked for this code,
# quotes abridged, translations ours):
#
# - torch_npu's own page, Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md (the text of hiascend.com's
#   "torch_npu.npu_fusion_attention"; product: Atlas A2 training), constraints: "D：Head Dim必须满足Dq=Dk和Dk≥Dv，
#   取值范围1~768" -- Dq = Dk and Dk >= Dv, D in 1..768, in one sentence, for every input_layout (BSH, SBH, BSND, BNSD
#   and the varlen TND alike) and for the dtypes float16 / bfloat16 / float32 the page lists for all three inputs (none
#   is tied to Dv). The same list still says "输入key和value的shape必须一致" (k and v of one shape), a leftover: CANN's
#   pages say "输入key/value的shape除D外必须一致" (the same except D).
# - CANN's operator pages (Ascend ops-transformer, attention/flash_attention_score/docs/aclnnFlashAttentionScore.md and
#   aclnnFlashAttentionVarLenScore*.md; flash_attention_score_grad/docs/aclnnFlashAttentionScoreGrad.md and
#   aclnnFlashAttentionUnpaddingScoreGrad.md, which npu_fusion_attention(_grad) call for BSND and TND; on hiascend.com
#   e.g. CANN 8.5.0 "aclnnFlashAttentionScoreV2" / "aclnnFlashAttentionVarLenScoreV4"): "D：Head-Dim必须满足(qD == kD &&
#   kD >= vD)", D 1~768, forward and grad, BSND and TND; the grad adds "在query/key/value的D大小相同的情况下，query/dy的
#   shape必须一致" (dy is q-shaped only when the dims agree: otherwise it has v's dim, as attention_in does), and its
#   dq / dk / dv come out shaped like query / key / value. Products: Atlas A2 and A3 training (and Ascend 950PR/950DT).
# - No page names particular pairs: 192/128, 128/64 and absorbed MLA's 576/512 are all Dq = Dk > Dv <= 768, served;
#   64/128 (Dv > Dk) is refused by every page (a parameter error of the aclnn call, raised by torch_npu as a
#   RuntimeError).
# - The adapter must size attention_out from v: Ascend/op-plugin op_plugin/python/meta/_fake_registrations.py (26.0.0,
#   npu_fusion_attention_v3) derives the output's last dim from value ("D2 = value.size(3)" in BSND, value.size(2) in
#   TND), while an older op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp allocates it like the query
#   ("apply_tensor_without_format(format_query)"). Such a torch_npu cannot return Dv != Dqk; the output check names that
#   case (:func:`check_forward_outputs`) instead of computing with a wrong shape.
# - npu_fused_infer_attention_score is not called by this backend (forward_range uses the TND npu_fusion_attention).
#
# So this backend, for a block whose q / k head dim Dqk differs from v's Dv:
# - Dv < Dqk <= 768: calls the op with the tensors as they are (out, dout, attention_in and dv in Dv);
# - Dv > Dqk: pads q and k with zero channels up to Dv (zero channels add nothing to q.k; the scale is passed
#   explicitly, as always) and slices dq / dk back to Dqk: an equal-dims call, which every torch_npu serves, at the cost
#   of copying q and k at width Dv; chosen over the math fallback, which would leave the fused kernel altogether;
# - max(Dqk, Dv) > 768: the base class's math (no call the docs refuse is made).
# The same dims go to TND calls (forward 1..768); the TND grad takes D up to 512 only (see the limits at the top), so
# packed segments whose call is wider (absorbed MLA's 576/512) take their gradients per segment in BSND.

DOCUMENTED_MAX_HEAD_DIM = 768
"""The largest head dim npu_fusion_attention(_grad) documents, stated together with Dq = Dk >= Dv."""


def value_dims_unsupported(dqk: int, dv: int) -> str | None:
    """Why no npu_fusion_attention call serves q/k head dim ``dqk`` with v head dim ``dv`` (even padded, as
    :func:`call_head_dim` pads); None when one does: every dim of the call in 1..768."""
    if max(dqk, dv) <= DOCUMENTED_MAX_HEAD_DIM:
        return None
    return (
        f"head dims q/k {dqk}, v {dv}: npu_fusion_attention takes Dq = Dk >= Dv up to {DOCUMENTED_MAX_HEAD_DIM} "
        f"(q/k padded to a larger Dv included)"
    )


def call_head_dim(dqk: int, dv: int) -> int:
    """The q/k head dim of the op call for values of head dim ``dv``: ``dqk`` when ``dv <= dqk`` (the docs' Dk >= Dv),
    else ``dv`` (q and k padded with zero channels, :func:`xcp.backends.fused.widen_head_dim`)."""
    return max(dqk, dv)


def tnd_grad_unsupported(dqk: int, dv: int) -> str | None:
    """Why the TND grad (aclnnFlashAttentionUnpaddingScoreGrad, D 1..512) cannot take q/k head dim ``dqk`` with v
    head dim ``dv`` once padded as :func:`call_head_dim` pads; None when it can. The forward and the dense (BSND) grad
    take up to 768, so such packed segments keep their TND forward and take their gradients per segment in BSND."""
    width = call_head_dim(dqk, dv)
    if width > TND_GRAD_MAX_HEAD_DIM:
        return f"head dim {width}: the TND grad takes D up to {TND_GRAD_MAX_HEAD_DIM} (the forward and BSND grad 768)"
    return None


def _value_dim_hint(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> str:
    """A hint for an attention_out of q's head dim where v's differs: the torch_npu sizes it like the query."""
    if q.shape[-1] != v.shape[-1] and out.shape[-1] == q.shape[-1]:
        return (
            f": this torch_npu sizes attention_out like the query (head dim {q.shape[-1]}), so it does not serve "
            f"values of another head dim ({v.shape[-1]}); one whose npu_fusion_attention sizes it from value does"
        )
    return ""
