"""The math block kernel: scores materialised per block, softmax with its log-sum-exp, gradients by hand.

It is the CPU backend's kernel and the fallback of device backends for what their fused kernels do not
serve (float64, odd head dims). It favours clarity: scores are computed in float32 (float64 for float64
inputs) and grouped-query K/V are expanded only inside the block.

Two score modifications (:data:`SCORE_MODS`, docs/design.md "Score modifications") change the scores before
the mask and the softmax, in this order: logit soft-capping, ``s = softcap * tanh(scale * q.k / softcap)``
(Gemma-2), whose backward goes through the tanh, ``ds_raw = ds * (1 - (s / softcap)^2)``; then ALiBi,
``s -= slope_h * |i - j|`` over the GLOBAL positions ``i`` of the query row and ``j`` of the key row
(:class:`Alibi`: the block's rows carry their positions, so any placement, strided or cut in pieces, gives
the bias of the whole sequence). The bias depends on no input, so it adds nothing to the gradients.
"""

from __future__ import annotations

from typing import NamedTuple

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


SCORE_MODS = ("softcap", "alibi")
"""The score modifications a backend may serve (``Backend.score_mods``): keyword arguments ``softcap=`` (a
float > 0) and ``alibi=`` (an :class:`Alibi`) of its block kernels."""


class Alibi(NamedTuple):
    """ALiBi of one block: ``slopes`` [H] (float, one per query head) and the global positions of its query
    rows, ``q_pos`` [Sq], and of its key rows, ``k_pos`` [Sk] (int64, on the block's device)."""

    slopes: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    def rows(self, qs: slice, ks: slice) -> Alibi:
        """The ALiBi of the sub-block of query rows ``qs`` and key rows ``ks``."""
        return Alibi(self.slopes, self.q_pos[qs], self.k_pos[ks])

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``-slope_h * |i - j|`` as [H, Sq, Sk] in ``dtype``."""
        distance = (self.q_pos.unsqueeze(1) - self.k_pos.unsqueeze(0)).abs().to(dtype)
        return -self.slopes.to(dtype).view(-1, 1, 1) * distance


def _heads_first(x: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """[B, S, H, D] -> [B, H * groups, S, D] in ``dtype``, each head repeated ``groups`` times."""
    x = x.to(dtype).transpose(1, 2)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _probabilities(q, k, mask: str, scale: float, lse=None, window=None, allowed=None, softcap=None, alibi=None):
    """Scores' softmax probabilities [B, H, Sq, Sk], lse [B, H, Sq] (given or computed) and the soft-cap's
    derivative ``1 - tanh^2`` (None without ``softcap``); ``allowed``, a boolean matrix broadcasting to
    [Sq, Sk], replaces the one ``mask`` and ``window`` give."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        slope = 1.0 - capped * capped
        scores = capped * softcap
    if alibi is not None:
        scores = scores + alibi.bias(scores.dtype)
    if allowed is None:
        allowed = allowed_keys(q.shape[-2], k.shape[-2], mask, q.device, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(lse == NEG_INF, 0.0, lse)  # rows with no key: exp(-inf - 0) = 0, never NaN
    return torch.exp(scores - safe.unsqueeze(-1)), lse, slope


def math_forward(
    q, k, v, mask: str, scale: float, window=None, allowed=None, *, softcap=None, alibi=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block attention in the accumulator dtype: out [B, Sq, H, Dv] (v's head dim) and lse [B, H, Sq];
    ``softcap`` and ``alibi`` modify the scores (module docstring)."""
    acc = accumulator_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    qh = _heads_first(q, acc)
    p, lse, _ = _probabilities(
        qh, _heads_first(k, acc, groups), mask, scale, window=window, allowed=allowed, softcap=softcap, alibi=alibi
    )
    out = torch.matmul(p, _heads_first(v, acc, groups))
    return out.transpose(1, 2), lse


def math_forward_range(
    q, k, v, lo: torch.Tensor, hi: torch.Tensor, scale: float, *, softcap=None, alibi=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`math_forward` of every query row against keys ``lo .. hi - 1`` alone, ``lo`` and ``hi`` int
    tensors of one element on k's device: the mask is built there, so the host never reads them."""
    cols = torch.arange(k.shape[1], device=k.device)
    allowed = ((cols >= lo) & (cols < hi)).unsqueeze(0)
    return math_forward(q, k, v, "none", scale, allowed=allowed, softcap=softcap, alibi=alibi)


def paged_rows(block_table: torch.Tensor, block_size: int, keys: int) -> torch.Tensor:
    """The flat pool rows (``block * block_size + offset``) of key rows ``0 .. keys - 1`` of every segment of a
    block table [B, max_blocks]: [B, keys] int64, made on the table's device (no host read)."""
    j = torch.arange(keys, device=block_table.device)
    return block_table.to(torch.int64).index_select(1, j // block_size) * block_size + j % block_size


def math_forward_paged(
    q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q: int, max_k: int, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries q [T, H, D] of B segments (rows ``cu_q[i] .. cu_q[i + 1] - 1``) against the first
    ``seqused_k[i]`` key rows of each segment's blocks in the pools [N, block_size, Hkv, D] (``block_table``
    [B, max_blocks]); causal: bottom-right aligned. Every segment's blocks are gathered into [B, max_k, ...] and
    its queries padded to ``max_q``, the masks built on the device from the lengths, so the host reads no length
    (capturable). Returns out [T, H, Dv] and lse [H, T] in the accumulator dtype; a row that sees no key 0 / -inf."""
    t, dev = q.shape[0], q.device
    b = block_table.shape[0]
    rows = paged_rows(block_table, k_pool.shape[1], max_k).flatten()  # [B * max_k]
    k = k_pool.flatten(0, 1).index_select(0, rows).view(b, max_k, *k_pool.shape[2:])
    v = v_pool.flatten(0, 1).index_select(0, rows).view(b, max_k, *v_pool.shape[2:])
    starts, counts = cu_q[:-1].to(torch.int64), (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    m = torch.arange(max_q, device=dev)
    real = m.view(1, -1) < counts.view(-1, 1)  # [B, max_q]: the padded query slots that hold a query
    where = torch.where(real, starts.view(-1, 1) + m.view(1, -1), t)  # slot -> packed row (t: a scratch row)
    q_pad = torch.cat([q, q.new_zeros((1, *q.shape[1:]))]).index_select(0, where.flatten()).view(b, max_q, *q.shape[1:])
    used = seqused_k.to(torch.int64).view(-1, 1, 1)
    cols = torch.arange(max_k, device=dev).view(1, 1, -1)
    allowed = (cols < used) & real.unsqueeze(-1)
    if causal:  # query m of sq sees keys up to sk - sq + m
        allowed = allowed & (cols <= used - counts.view(-1, 1, 1) + m.view(1, -1, 1))
    out, lse = math_forward(q_pad, k, v, "none", scale, allowed=allowed.unsqueeze(1))
    flat = where.flatten()
    packed = out.new_zeros((t + 1, *out.shape[2:])).index_copy_(0, flat, out.flatten(0, 1))
    packed_lse = lse.new_full((lse.shape[1], t + 1), NEG_INF).index_copy_(1, flat, lse.transpose(0, 1).flatten(1))
    return packed[:t], packed_lse[:, :t]


def math_backward(dout, q, k, v, out, lse, mask: str, scale: float, window=None, *, softcap=None, alibi=None):
    """Block gradients (dq, dk, dv) in the accumulator dtype, from the merged out and lse of the rows."""
    acc = accumulator_dtype(q.dtype)
    b, sk, hkv, d = k.shape
    groups = q.shape[2] // hkv
    qh, do = _heads_first(q, acc), _heads_first(dout, acc)
    kh, vh = _heads_first(k, acc, groups), _heads_first(v, acc, groups)
    p, _, slope = _probabilities(qh, kh, mask, scale, lse.to(acc), window, softcap=softcap, alibi=alibi)
    delta = (do * _heads_first(out, acc)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, vh.transpose(-1, -2)) - delta)
    if slope is not None:  # through the cap: d(softcap * tanh(x / softcap))/dx = 1 - tanh^2
        ds = ds * slope
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
    if groups > 1:
        dk = dk.reshape(b, hkv, groups, sk, d).sum(2)
        dv = dv.reshape(b, hkv, groups, sk, v.shape[3]).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
