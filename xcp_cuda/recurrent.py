"""fla's Triton chunk kernels (package ``fla``, distribution ``fla-core``) in the conventions of
:data:`xcp.kernels.recurrent.RECURRENCES`, for :meth:`xcp_cuda.CUDABackend.recurrent_kernels`.

fla's states are ``[N, H, K, V]`` float32, the layout of xcp's :class:`xcp.recurrent.DeltaRule` (``T`` acts on
the rows, the key dim), so gated_delta_rule, kda and simple_gla pass through. fla has no Mamba2 op; Mamba2's
SSD scan is simple GLA with one decay per head: ``h <- exp(A dt) h + B (dt x)^T`` (fla's ``[N, P]`` state, the
transpose of transformers' ``[P, N]``) and ``y = C^T h``, so it runs as ``chunk_simple_gla(q=C, k=B, v=dt x,
g=A dt, scale=1)`` with B and C repeated from their groups to the heads and the states transposed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from xcp.kernels.recurrent import RecurrentKernel


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:  # noqa: BLE001 - a missing distribution record is not an error here
        return "?"


@functools.cache
def fla_kernels() -> dict[str, RecurrentKernel]:
    """fla's kernels by recurrence, or none where fla (or triton) is not importable."""
    if importlib.util.find_spec("fla") is None:
        return {}
    try:
        gdr = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        kda = importlib.import_module("fla.ops.kda").chunk_kda
        gla = importlib.import_module("fla.ops.simple_gla").chunk_simple_gla
    except Exception:  # noqa: BLE001 - fla present but unusable (no triton, no GPU driver): the torch kernels run
        return {}
    tag = f"fla {_version()}"
    return {
        "gated_delta_rule": RecurrentKernel(_delta(gdr), f"{tag} chunk_gated_delta_rule (Triton)"),
        "kda": RecurrentKernel(_delta(kda), f"{tag} chunk_kda (Triton)"),
        "simple_gla": RecurrentKernel(_gla(gla), f"{tag} chunk_simple_gla (Triton)"),
        "mamba2": RecurrentKernel(_mamba2(gla), f"{tag} chunk_simple_gla as Mamba2's SSD (Triton)"),
    }


def _delta(fn: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, scale=None, **kwargs):
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  **kwargs)  # fmt: skip

    return kernel


def _gla(fn: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(q, k, v, g, initial_state=None, output_final_state=False, scale=None):
        return fn(q, k, v, g=g.float(), scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state)  # fmt: skip

    return kernel


def _mamba2(fn: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(x, dt, b, c, initial_state=None, output_final_state=False, *, A: torch.Tensor):
        heads, groups = x.shape[2], b.shape[2]
        if heads % groups:
            raise ValueError(f"B: expected groups dividing the {heads} heads; got {groups}")
        b, c = (t.repeat_interleave(heads // groups, dim=2) for t in (b, c))
        v = (x * dt[..., None].to(x.dtype)).to(x.dtype)
        g = A.float() * dt.float()
        h0 = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
        out, state = fn(c, b, v, g=g, scale=1.0, initial_state=h0, output_final_state=output_final_state)
        return out, (None if state is None else state.transpose(-1, -2))

    return kernel
