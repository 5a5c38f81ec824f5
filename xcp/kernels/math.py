"""The math block kernel: scores materialised per block, softmax with its log-sum-exp, gradients by hand.

It is the CPU backend's kernel and the fallback of device backends for what their fused kernels do not
serve (float64, odd head dims). It favours clarity: scores are computed in float32 (float64 for float64
inputs) and grouped-query K/V are expanded only inside the block.
"""

from __future__ import annotations

import torch

from ..schedule import check_mask
from .merge import NEG_INF, accumulator_dtype


def allowed_keys(
    sq: int, sk: int, mask: str, device: torch.device | None = None, window: tuple[int, int] | None = None
) -> torch.Tensor | None:
    """Boolean [Sq, Sk] matrix of the (query, key) pairs ``mask`` allows, or None for no mask.

    ``causal`` is top-left aligned: query i sees keys 0..i; ``strict`` sees keys 0..i-1. A ``window``
    ``(left, right)`` (with mask ``none``) is a band aligned to the bottom-right corner, as flash kernels
    align theirs: query i sees keys ``i + (sk - sq) - left .. i + (sk - sq) + right``.
    """
    check_mask(mask)
    if window is not None:
        if mask != "none":
            raise ValueError(f"mask: a window goes with mask 'none'; got {mask!r}")
        rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
        cols = torch.arange(sk, device=device).unsqueeze(0)
        return (cols >= rows - window[0]) & (cols <= rows + window[1])
    if mask == "none":
        return None
    diagonal = 0 if mask == "causal" else -1
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal)


def _heads_first(x: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """[B, S, H, D] -> [B, H * groups, S, D] in ``dtype``, each head repeated ``groups`` times."""
    x = x.to(dtype).transpose(1, 2)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _probabilities(q, k, mask: str, scale: float, lse=None, window=None, allowed=None):
    """Scores' softmax probabilities [B, H, Sq, Sk] and lse [B, H, Sq] (given or computed); ``allowed``, a
    boolean matrix broadcasting to [Sq, Sk], replaces the one ``mask`` and ``window`` give."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is None:
        allowed = allowed_keys(q.shape[-2], k.shape[-2], mask, q.device, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(lse == NEG_INF, 0.0, lse)  # rows with no key: exp(-inf - 0) = 0, never NaN
    return torch.exp(scores - safe.unsqueeze(-1)), lse


def math_forward(q, k, v, mask: str, scale: float, window=None, allowed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block attention in the accumulator dtype: out [B, Sq, H, Dv] (v's head dim) and lse [B, H, Sq]."""
    acc = accumulator_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    qh = _heads_first(q, acc)
    p, lse = _probabilities(qh, _heads_first(k, acc, groups), mask, scale, window=window, allowed=allowed)
    out = torch.matmul(p, _heads_first(v, acc, groups))
    return out.transpose(1, 2), lse


def math_forward_range(q, k, v, lo: torch.Tensor, hi: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`math_forward` of every query row against keys ``lo .. hi - 1`` alone, ``lo`` and ``hi`` int
    tensors of one element on k's device: the mask is built there, so the host never reads them."""
    cols = torch.arange(k.shape[1], device=k.device)
    return math_forward(q, k, v, "none", scale, allowed=((cols >= lo) & (cols < hi)).unsqueeze(0))


def math_backward(dout, q, k, v, out, lse, mask: str, scale: float, window=None):
    """Block gradients (dq, dk, dv) in the accumulator dtype, from the merged out and lse of the rows."""
    acc = accumulator_dtype(q.dtype)
    b, sk, hkv, d = k.shape
    groups = q.shape[2] // hkv
    qh, do = _heads_first(q, acc), _heads_first(dout, acc)
    kh, vh = _heads_first(k, acc, groups), _heads_first(v, acc, groups)
    p, _ = _probabilities(qh, kh, mask, scale, lse.to(acc), window)
    delta = (do * _heads_first(out, acc)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, vh.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
    if groups > 1:
        dk = dk.reshape(b, hkv, groups, sk, d).sum(2)
        dv = dv.reshape(b, hkv, groups, sk, v.shape[3]).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
