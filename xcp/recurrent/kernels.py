"""Which kernel runs each recurrence of :data:`xcp.kernels.recurrent.RECURRENCES` on a device: the
backend's own (:meth:`xcp.Backend.recurrent_kernels`) where it serves one, else the models' own torch
kernels (transformers', imported when first asked for), and the :class:`Transition` each takes."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..kernels.recurrent import RECURRENCES, RecurrentKernel
from ..plugins import select_backend
from .state import Decay, DeltaRule, Transition

_TORCH = {
    "gated_delta_rule": ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule"),
    "kda": ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
    "mamba2": ("transformers.models.mamba2.modeling_mamba2", "mamba2_chunk_scan"),
}
"""The models' own torch kernels (transformers 5.24) behind each recurrence; simple_gla has none there (its
families compute it inside the mixer): xcp's :func:`torch_simple_gla` serves it."""


def _check(recurrence: str) -> None:
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence: expected one of {', '.join(RECURRENCES)}; got {recurrence!r}")


def _delta(fn: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, scale=None, **kwargs):
        if scale is not None and scale != q.shape[-1] ** -0.5:
            raise ValueError(f"scale: expected None or 1/sqrt(K) for the torch kernel; got {scale}")
        return fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                  **kwargs)  # fmt: skip

    return kernel


def _mamba2(fn: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(x, dt, b, c, initial_state=None, output_final_state=False, *, A):
        out, state = fn(x, dt, A, b, c, chunk_size=64, initial_states=initial_state, return_final_states=True)
        return out, (state if output_final_state else None)

    return kernel


def torch_kernel(recurrence: str) -> RecurrentKernel | None:
    """The models' own torch kernel of ``recurrence`` in xcp's convention (the torch path even where
    transformers would route it to an installed package), or None (none, or transformers missing)."""
    _check(recurrence)
    if recurrence == "simple_gla":
        return RecurrentKernel(torch_simple_gla, "xcp torch_simple_gla (torch)")
    if recurrence not in _TORCH:
        return None
    module, name = _TORCH[recurrence]
    try:
        fn = inspect.unwrap(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError):
        return None
    wrap = _mamba2 if recurrence == "mamba2" else _delta
    return RecurrentKernel(wrap(fn), f"transformers {name} (torch)")


def recurrent_kernel(recurrence: str, device: str | torch.device | None = None) -> RecurrentKernel:
    """The kernel of ``recurrence`` on ``device`` (a backend name or a device type; default cpu): the
    backend's own, else the models' torch kernel; a ValueError naming the recurrence where there is none."""
    _check(recurrence)
    kind = device.type if isinstance(device, torch.device) else device
    served = select_backend(kind, kind or "cpu").recurrent_kernels()
    found = served.get(recurrence) or torch_kernel(recurrence)
    if found is None:
        raise ValueError(
            f"recurrence: expected one with a kernel on {kind or 'cpu'} (the backend serves "
            f"{', '.join(served) or 'none'}; torch kernels exist for {', '.join(_TORCH)}); got {recurrence!r}"
        )
    return found


def kernel_labels(backend: Any) -> dict[str, str]:
    """What runs each recurrence on ``backend`` (``xcp backends``): its kernel's label, else the torch
    kernel's, else ``none``."""
    served = backend.recurrent_kernels()
    labels = {}
    for name in RECURRENCES:
        found = served.get(name) or torch_kernel(name)
        labels[name] = found.label if found is not None else "none"
    return labels


def transition(recurrence: str) -> Transition:
    """The :class:`Transition` of ``recurrence``'s kernel (inputs in its convention's order)."""
    _check(recurrence)
    if recurrence in ("gated_delta_rule", "kda"):
        return DeltaRule(value=2)
    if recurrence == "simple_gla":
        return Decay(_gla_decay, _gla_carry)
    return Decay(_mamba2_decay, _mamba2_carry)


def _gla_decay(q, k, v, g, **kwargs: Any) -> torch.Tensor:
    return g.float().sum(dim=1).exp()[..., None, None]


def _gla_carry(h: torch.Tensor, q, k, v, g, scale=None, **kwargs: Any) -> torch.Tensor:
    """What the state h [B, H, K, V] entering a stretch adds to its outputs: ``scale exp(G_t) q_t^T h``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weighted = q.to(h.dtype) * (scale * g.to(h.dtype).cumsum(dim=1).exp())[..., None]
    return torch.einsum("bthk,bhkv->bthv", weighted, h)


def _mamba2_decay(x, dt, b, c, *, A: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return torch.exp((A.float() * dt.float()).sum(dim=1))[..., None, None]


def _mamba2_carry(h: torch.Tensor, x, dt, b, c, *, A: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """What the state h [B, H, P, N] entering a stretch adds to its outputs: ``exp(A sum dt) (h C_t)``."""
    c = c.to(h.dtype).repeat_interleave(x.shape[2] // c.shape[2], dim=2)  # groups to heads
    decay = torch.exp(A.to(h.dtype) * dt.to(h.dtype).cumsum(dim=1))  # [B, T, H]
    return torch.einsum("bthn,bhpn->bthp", c, h) * decay[..., None]


def torch_simple_gla(q, k, v, g, initial_state=None, output_final_state=False, scale=None, chunk_size=64):
    """Simple GLA in torch, chunk by chunk: ``h_t = exp(g_t) h_{t-1} + k_t v_t^T``, ``o_t = scale q_t^T h_t``
    (q, k [B, T, H, K], v [B, T, H, V], g [B, T, H]; state [B, H, K, V] float32, float64 for float64)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qs, ks, vs = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    gs = g.to(dtype).transpose(1, 2)  # [B, H, T]
    h = qs.new_zeros((*qs.shape[:2], qs.shape[-1], vs.shape[-1])) if initial_state is None else initial_state.to(dtype)
    outs = []
    for a in range(0, qs.shape[2], chunk_size):
        qc, kc, vc = (x[:, :, a : a + chunk_size] for x in (qs, ks, vs))
        cum = gs[:, :, a : a + chunk_size].cumsum(-1)  # log decay from the chunk's start to each token
        n = cum.shape[-1]
        later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        weights = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
        outs.append(scale * ((qc @ kc.transpose(-1, -2)) * weights @ vc + (qc * cum.exp()[..., None]) @ h))
        tail = (cum[..., -1:] - cum).exp()[..., None]  # each token's decay to the chunk's end
        h = cum[..., -1].exp()[..., None, None] * h + (kc * tail).transpose(-1, -2) @ vc
    out = torch.cat(outs, dim=2).transpose(1, 2).to(v.dtype)
    return out, (h if output_final_state else None)
