"""The recurrences xcp runs by name, and the convention of each one's chunk kernel.

A backend may serve any of them with its own kernel (:meth:`xcp.Backend.recurrent_kernels`, e.g. CUDA's
Triton kernels); else xcp runs the models' own torch kernels (:func:`xcp.recurrent.recurrent_kernel`).
Every kernel takes its per-token inputs sequence-major (``[B, T, H, ...]``) and returns ``(out,
final_state)`` with the ``initial_state`` / ``output_final_state`` convention of transformers' and fla's
kernels; states are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RECURRENCES: dict[str, str] = {
    "gated_delta_rule": "kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, *, scale=None, "
    "use_qk_l2norm_in_kernel=False): q, k [B, T, H, K], v [B, T, H, V], g (log decay) and beta [B, T, H]; "
    "state [B, H, K, V] (Qwen3-Next, Qwen3.5, OLMo-hybrid)",
    "kda": "kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, *, scale=None, "
    "use_qk_l2norm_in_kernel=False): as gated_delta_rule with g [B, T, H, K] (a log decay per key channel; "
    "Kimi Linear)",
    "simple_gla": "kernel(q, k, v, g, initial_state=None, output_final_state=False, *, scale=None): g [B, T, H] "
    "a log decay per head (lightning attention, RetNet-like); state [B, H, K, V]",
    "mamba2": "kernel(x, dt, B, C, initial_state=None, output_final_state=False, *, A): Mamba2's SSD scan, "
    "x [B, T, H, P], dt [B, T, H] (the step, after its bias and softplus), B, C [B, T, G, N], A [H] (negative); "
    "out without the D skip; state [B, H, P, N] (transformers' layout)",
}
"""Each recurrence xcp knows by name, with its kernel's convention."""


@dataclass(frozen=True)
class RecurrentKernel:
    """A chunk kernel of one of :data:`RECURRENCES`, and what it is (shown by ``xcp backends``)."""

    fn: Callable[..., tuple[Any, Any]]
    label: str
