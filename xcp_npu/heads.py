"""Calls of npu_fusion_attention(_grad) over at most 256 query heads: a block with more is run as several calls, one per
chunk of :func:`xcp_npu.convert.head_chunks`, and the results put back together exactly.

Each chunk is an independent attention of its query heads against the K/V heads they read, so outputs, lse and dq are
concatenated along the heads; dk and dv are concatenated too where every K/V head belongs to one chunk (whole GQA
groups), and summed in float32 (float64 for float64) where a group larger than 256 query heads was cut into parts that
read the same K/V head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xcp.kernels.merge import accumulator_dtype

from .convert import MAX_QUERY_HEADS, head_chunks

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``call(q, k, v) -> (out, lse)`` on one chunk's heads: q [B, S, h, D], k / v [B, Sk, h_kv, D], lse [B, h, S]."""
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``call(dout, q, k, v, out, lse) -> (dq, dk, dv)`` on one chunk's heads."""


def too_many(q: torch.Tensor) -> bool:
    """Whether q [B, S, H, D] has more query heads than one call takes."""
    return q.shape[2] > MAX_QUERY_HEADS


def split_forward(
    call: Forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of all heads from one ``call`` per chunk: out concatenated along dim 2, lse along dim 1."""
    parts = [call(q[:, :, hq], k[:, :, hk], v[:, :, hk]) for hq, hk in head_chunks(q.shape[2], k.shape[2])]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([x for _, x in parts], dim=1)


def split_backward(
    call: Backward, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of all heads from one ``call`` per chunk: dq concatenated along the heads; dk, dv concatenated per
    K/V head, or summed where several chunks read one K/V head."""
    dqs: list[torch.Tensor] = []
    dkv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for hq, hk in head_chunks(q.shape[2], k.shape[2]):
        gq, gk, gv = call(dout[:, :, hq], q[:, :, hq], k[:, :, hk], v[:, :, hk], out[:, :, hq], lse[:, hq])
        dqs.append(gq)
        dkv.setdefault(hk.start, []).append((gk, gv))
    dks, dvs = [], []
    for start in sorted(dkv):
        parts = dkv[start]
        if len(parts) == 1:
            gk, gv = parts[0]
        else:  # parts of one group larger than a call: they read the same K/V head
            acc = accumulator_dtype(q.dtype)
            gk = torch.stack([p[0].to(acc) for p in parts]).sum(0).to(parts[0][0].dtype)
            gv = torch.stack([p[1].to(acc) for p in parts]).sum(0).to(parts[0][1].dtype)
        dks.append(gk)
        dvs.append(gv)
    return torch.cat(dqs, dim=2), torch.cat(dks, dim=2), torch.cat(dvs, dim=2)
