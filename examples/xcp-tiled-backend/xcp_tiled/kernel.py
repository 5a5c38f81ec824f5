"""Block attention that walks the keys in tiles, never holding more than one tile of scores.

Forward keeps, per query row, the running maximum ``m``, the running sum ``l`` of exp(score - m) and the
running weighted sum of values, rescaled whenever ``m`` grows (the online softmax). Backward needs no
running state: given the log-sum-exp of the whole row (which the ring merges over all its blocks), the
probabilities of each tile are exp(score - lse), so every tile's share of dq, dk and dv is computed on
its own. Grouped-query K/V are broadcast over the query heads of their group, never repeated.
"""

import torch

TILE = 8
MASKS = ("none", "causal", "strict")


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped_rows(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, H, D] -> [B, Hkv, G, S, D]: query head h = j * G + g belongs to KV head j."""
    b, s, h, d = x.shape
    return x.to(dtype).reshape(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungroup_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, S, D] -> [B, S, H, D]."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d)


def _keys(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv, 1, S, D], broadcast over the heads of a group."""
    return x.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)


def _tiles(sq: int, sk: int, mask: str, tile: int):
    """Key ranges [k0, k1) of ``tile`` keys, skipping those no query may see."""
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {', '.join(MASKS)}; got {mask!r}")
    last_visible = {"none": sk - 1, "causal": sq - 1, "strict": sq - 2}[mask]
    for k0 in range(0, min(sk, last_visible + 1), tile):
        yield k0, min(k0 + tile, sk)


def _scores(qg: torch.Tensor, kt: torch.Tensor, k0: int, k1: int, mask: str, scale: float) -> torch.Tensor:
    """Scaled scores of every query against keys k0..k1-1, -inf where the mask forbids the pair."""
    s = torch.matmul(qg, kt[..., k0:k1, :].transpose(-1, -2)) * scale
    if mask != "none":
        qi = torch.arange(qg.shape[-2], device=s.device).unsqueeze(1)
        kj = torch.arange(k0, k1, device=s.device).unsqueeze(0)
        allowed = kj <= qi if mask == "causal" else kj < qi
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def tiled_forward(q, k, v, mask, scale, tile=TILE):
    """(out [B, Sq, H, Dv], lse [B, H, Sq]) in the accumulator dtype (Dv: v's head dim, which may differ from
    q's); rows without keys give 0 and -inf."""
    acc = _accumulator(q.dtype)
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg, kt, vt = _grouped_rows(q, hkv, acc), _keys(k, acc), _keys(v, acc)
    row_max = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    row_sum = torch.zeros(qg.shape[:-1], dtype=acc, device=q.device)
    weighted = torch.zeros((*qg.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)  # v's head dim
    for k0, k1 in _tiles(sq, k.shape[1], mask, tile):
        s = _scores(qg, kt, k0, k1, mask, scale)
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        shift = torch.where(torch.isneginf(new_max), 0.0, new_max)  # rows with no key so far stay at 0
        p = torch.exp(s - shift.unsqueeze(-1))
        rescale = torch.exp(row_max - shift)
        row_sum = row_sum * rescale + p.sum(dim=-1)
        weighted = weighted * rescale.unsqueeze(-1) + torch.matmul(p, vt[..., k0:k1, :])
        row_max = new_max
    seen = row_sum > 0
    out = torch.where(seen.unsqueeze(-1), weighted / torch.where(seen, row_sum, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)), float("-inf"))
    return _ungroup_rows(out), lse.reshape(b, h, sq)


def tiled_backward(dout, q, k, v, out, lse, mask, scale, tile=TILE):
    """(dq, dk, dv) in the accumulator dtype, from the row's merged ``out`` and ``lse``."""
    acc = _accumulator(q.dtype)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg, kt, vt = _grouped_rows(q, hkv, acc), _keys(k, acc), _keys(v, acc)
    dog, og = _grouped_rows(dout, hkv, acc), _grouped_rows(out, hkv, acc)
    row_lse = lse.to(acc).reshape(b, hkv, h // hkv, sq)
    row_lse = torch.where(torch.isneginf(row_lse), 0.0, row_lse)  # such rows have only -inf scores: p = 0
    delta = (dog * og).sum(dim=-1, keepdim=True)
    dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
    dk = torch.zeros((b, hkv, sk, d), dtype=acc, device=q.device)
    dv = torch.zeros((b, hkv, sk, v.shape[-1]), dtype=acc, device=q.device)
    for k0, k1 in _tiles(sq, sk, mask, tile):
        p = torch.exp(_scores(qg, kt, k0, k1, mask, scale) - row_lse.unsqueeze(-1))
        ds = p * (torch.matmul(dog, vt[..., k0:k1, :].transpose(-1, -2)) - delta)
        dv[:, :, k0:k1] = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)
        dk[:, :, k0:k1] = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * scale
        dq += torch.matmul(ds, kt[..., k0:k1, :]) * scale
    return _ungroup_rows(dq), dk.transpose(1, 2), dv.transpose(1, 2)
