"""The built-in CPU backend: the math block kernel with its log-sum-exp, no asynchrony, gloo."""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from ..kernels.math import SCORE_MODS, math_backward, math_forward
from .base import SynchronousBackend


class CPUBackend(SynchronousBackend):
    """Runs on CPU tensors; no asynchrony, so hand-off is ``none``; collectives through gloo."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    kernel = "math (matmul-softmax, fp32 accumulation)"
    value_head_dims = True
    score_mods = SCORE_MODS

    def forward(self, q, k, v, mask, scale, **mods):
        return math_forward(q, k, v, mask, scale, **mods)

    def backward(self, dout, q, k, v, out, lse, mask, scale, **mods):
        return math_backward(dout, q, k, v, out, lse, mask, scale, **mods)

    def forward_range(self, q, k, v, lo, hi, scale):
        """The math kernel on the range's rows alone: the CPU has no graphs to replay, so reading the ends on
        the host costs nothing, and the work follows the tokens held instead of the cache's capacity."""
        return math_forward(q, k[:, int(lo) : int(hi)], v[:, int(lo) : int(hi)], "none", scale)


@hookimpl
def xcp_register_backends(register) -> None:
    """The built-in CPU backend registers through the same hook as every third-party backend."""
    register(CPUBackend())
