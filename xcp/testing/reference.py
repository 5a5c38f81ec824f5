"""A float64 reference attention that shares no code with xcp's kernels.

Backends are checked against it, so it is written for obviousness, not speed: scores are materialised,
masks are built from index comparisons, grouped K/V heads are repeated, and gradients come from autograd.
Rows that see no key give out = 0 and lse = -inf, and their gradients are 0 (never NaN).
"""

from __future__ import annotations

from typing import Any

import torch

MASKS = ("none", "causal", "strict")


def allowed_pairs(sq: int, sk: int, mask: str) -> torch.Tensor:
    """Boolean [Sq, Sk]: which key each query may see (top-left aligned; ``strict`` excludes the diagonal)."""
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {', '.join(MASKS)}; got {mask!r}")
    qi = torch.arange(sq).unsqueeze(1)
    kj = torch.arange(sk).unsqueeze(0)
    if mask == "causal":
        return kj <= qi
    if mask == "strict":
        return kj < qi
    return torch.ones(sq, sk, dtype=torch.bool)


def to_reference(x: torch.Tensor) -> torch.Tensor:
    """A float64 CPU leaf copy of ``x`` that records gradients."""
    return x.detach().to("cpu", torch.float64).requires_grad_(True)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float, softcap: float | None = None,
    alibi: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention in float64 on the CPU, differentiable.

    :param q: [B, Sq, H, D]; k, v: [B, Sk, Hkv, D] with H % Hkv == 0 (query head h uses KV head
        h // (H // Hkv)).
    :param softcap: scores become ``softcap * tanh(scores / softcap)``.
    :param alibi: ``(slopes [H], query positions [Sq], key positions [Sk])``: scores get ``-slope_h * |i - j|``
        after the cap.
    :returns: ``(out, lse)``: out [B, Sq, H, D] and lse [B, H, Sq], both float64.
    """
    q64, k64, v64 = (x.to("cpu", torch.float64) for x in (q, k, v))
    groups = q64.shape[2] // k64.shape[2]
    qh = q64.permute(0, 2, 1, 3)
    kh = k64.permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    vh = v64.permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", qh, kh) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        slopes, qi, kj = (x.detach().to("cpu", torch.float64) for x in alibi)
        scores = scores - slopes.view(-1, 1, 1) * (qi.view(-1, 1) - kj.view(1, -1)).abs()
    allowed = allowed_pairs(q64.shape[1], k64.shape[1], mask)
    seen = allowed.any(dim=1)  # [Sq]: rows with at least one key
    # Rows without keys get harmless scores of 0 and are zeroed afterwards, so autograd never meets -inf - -inf.
    scores = torch.where(allowed, scores, float("-inf"))
    scores = torch.where(seen.unsqueeze(1), scores, 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)) * seen.unsqueeze(1)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, vh).permute(0, 2, 1, 3)
    lse = torch.where(seen, lse, float("-inf"))
    return out, lse


def reference_gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float, **mods: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, dq, dk, dv)`` in float64 on the CPU, for the given output gradient ``dout`` (``mods``:
    :func:`reference_attention`'s ``softcap`` and ``alibi``)."""
    q64, k64, v64 = to_reference(q), to_reference(k), to_reference(v)
    with torch.enable_grad():
        out, lse = reference_attention(q64, k64, v64, mask, scale, **mods)
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.detach().to("cpu", torch.float64))
    return out.detach(), lse.detach(), dq, dk, dv


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """Whole-sequence attention through torch's own SDPA in float64 on the CPU, differentiable.

    A second, independent reference (torch's math kernel rather than this module's einsum) for the
    ring's end-to-end checks: K/V heads are repeated for GQA; ``scale`` defaults to 1/sqrt(head_dim).
    :returns: out [B, S, H, D] float64.
    """
    qd, kd, vd = (x.to("cpu", torch.float64).transpose(1, 2) for x in (q, k, v))
    groups = qd.shape[1] // kd.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        qd, kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1), is_causal=causal, scale=scale
    )
    return out.transpose(1, 2)
