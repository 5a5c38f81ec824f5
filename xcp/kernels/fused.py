"""A base for backends whose block kernel is a fused vendor op (CUDA flash, Ascend npu_fusion_attention).

Such ops serve two masks safely, none and causal on a square block, and some of them read grouped-query
K/V natively. The base turns any (mask, Sq, Sk) into those calls through :mod:`xcp.kernels.tiling` and
repeats K/V per query head where the kernel (or the user's ``gqa="repeat"``) asks for it, so a backend
writes only its two square kernels.
"""

from __future__ import annotations

import os

import torch

from ..backend import Backend, required
from . import tiling

GQA_MODES = ("native", "repeat")
"""``native``: a kernel that reads K/V with fewer heads gets them as they are; ``repeat``: K/V are always
repeated per query head and dK/dV summed over each group (slower, more memory; the fallback when a
kernel's own GQA fails)."""


def check_gqa(mode: str) -> str:
    """Return ``mode`` if it is a GQA mode, else raise a ValueError listing them."""
    if mode not in GQA_MODES:
        raise ValueError(f"gqa: expected one of {', '.join(GQA_MODES)}; got {mode!r}")
    return mode


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * groups, D]: query head h reads K/V head h // groups (as SDPA's GQA)."""
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def sum_kv_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv * groups, D] -> [B, S, Hkv, D]: the gradient of :func:`repeat_kv` (sum over each group)."""
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.reshape(b, s, h // groups, groups, d).sum(3)


class FusedKernelBackend(Backend):
    """Backend base: ``forward``/``backward`` of any mask from the subclass's square kernels.

    :param gqa: ``native`` or ``repeat`` (:data:`GQA_MODES`); default from the environment variable named
        by :attr:`gqa_env`, else ``native``.
    """

    gqa_env: str = ""
    """Environment variable that sets the default GQA mode (e.g. ``XCP_CUDA_GQA``)."""

    def __init__(self, gqa: str | None = None) -> None:
        if gqa is None:
            gqa = os.environ.get(self.gqa_env, "native") if self.gqa_env else "native"
        self.gqa = check_gqa(gqa)

    def forward(self, q, k, v, mask, scale):
        """(out, lse) of the block under ``mask``; rows that see no key give out 0 and lse -inf."""
        return tiling.forward(self.square_forward, q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        """(dq, dk, dv) of the block from the merged out and lse of its rows, shaped like q, k, v."""
        return tiling.backward(self.square_backward, dout, q, k, v, out, lse, mask, scale)

    def kv_groups(self, q: torch.Tensor, k: torch.Tensor, native: bool = True) -> int:
        """How many times K/V are repeated before a kernel call: 1 unless the block is GQA and the kernel
        lacks native GQA (``native=False``) or the mode is ``repeat``."""
        h, hkv = q.shape[2], k.shape[2]
        return h // hkv if h != hkv and (self.gqa == "repeat" or not native) else 1

    @required
    def square_forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of one block with no mask, or causal on a square block (Sq == Sk)."""
        raise NotImplementedError

    @required
    def square_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """(dq, dk, dv) of one block with no mask, or causal on a square block, from the merged out/lse."""
        raise NotImplementedError
