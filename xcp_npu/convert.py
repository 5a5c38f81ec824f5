"""Pure conversions between xcp's block convention and Ascend's npu_fusion_attention; no torch_npu here.

npu_fusion_attention (torch_npu docs, "torch_npu.npu_fusion_attention") returns, besides attention_out,
``softmax_max`` and ``softmax_sum``, float32 [B, N, Sq, 8]: the 8 entries of a row are copies of one value
(a layout the kernel's vector units like). With m the row max of the scaled scores and s = Σ exp(x - m),
the row's log-sum-exp is m + log(s). Its backward ``npu_fusion_attention_grad`` recomputes the
probabilities as exp(x - softmax_max) / softmax_sum, so the ring's merged lse L goes back in as
softmax_max = L (expanded to 8) with softmax_sum = 1.

Masks: xcp asks the kernel only for "none" or causal on a square block (:mod:`xcp.kernels.fused` cuts every
other case, including strictly-causal, into those). Square causal is sparse_mode 3 (rightDownCausal, the
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
SPARSE_NONE, SPARSE_RIGHT_DOWN_CAUSAL = 0, 3
MAX_TOKENS = 2147483647
"""The ops' default pre_tockens / next_tockens: no band limit."""
LAYOUT = "BSND"
"""xcp's [batch, seq, heads, head_dim] under Ascend's name: no transpose on the way in or out."""


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
        raise ValueError(f"attention_out: expected shape {expected_out} (BSND); got {tuple(out.shape)}")
    check_softmax_stats("softmax_max", smax, (b, n, sq))
    check_softmax_stats("softmax_sum", ssum, (b, n, sq))
    return out, smax, ssum
