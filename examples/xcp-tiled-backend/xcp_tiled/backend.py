"""The ``tiled`` backend: CPU tensors, no asynchrony (streams are no-ops), gloo for collectives."""

import torch

import xcp

from .kernel import TILE, tiled_backward, tiled_forward


class TiledBackend(xcp.SynchronousBackend):
    name = "tiled"
    device_type = "cpu"
    dist_backend = "gloo"
    handoff_policy = "none"
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    masks = ("none", "causal", "strict")
    value_head_dims = True  # the kernel takes values of another head dim than q/k's

    def __init__(self, tile: int = TILE) -> None:
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile: expected a positive int; got {tile!r}")
        self.tile = tile
        self.kernel = f"key tiles of {tile} with an online softmax (fp32 accumulation)"

    def forward(self, q, k, v, mask, scale):
        return tiled_forward(q, k, v, mask, scale, self.tile)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        return tiled_backward(dout, q, k, v, out, lse, mask, scale, self.tile)
