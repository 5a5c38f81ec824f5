"""The CUDA backend's paged decode on Triton (:mod:`xcp_cuda.paged_kernels`): one query per segment against its
first ``seqused_k`` rows of a paged KV pool of any block size, read in place through the block table, GQA native.

It serves the decode calls (``max_q == 1``) that flash's paged form does not: a torch whose flash op has no
``block_table`` (torch 2.11's), blocks that are not a multiple of 256 rows (the default 16). Two launches a
call: the splits (grid ``(B, Hkv, n_splits)``, ``n_splits`` a function of the host's ``max_k`` alone, so a
captured graph keeps its grid whatever the lengths; a program past its segment's length writes lse -inf), then
their combine (grid ``(B, H)``). The host reads nothing from the device.
"""

from __future__ import annotations

import math

import torch

from . import kernels

TILE = 64
"""Keys a program reads at a time (BLOCK_N) up to head dim 128; half as many above (:func:`keys_per_tile`), so that
the pipelined K and V tiles of head dim 256 stay within a Hopper SM's shared memory. Splits are multiples of it."""
MIN_SPLIT = 512
"""The fewest keys of a split: shorter ones would spend more on the combine than they save."""
MAX_SPLITS = 64
"""The most splits of a segment's keys (the combine holds all of a row's in one tile)."""
MAX_DIM = 256
"""The largest head dim served (q, k and v of one head dim)."""
MAX_GROUP = 64
"""The most query heads per K/V head (a program holds them all: BLOCK_G x head dim float32 values)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes served (float32 scores, sums and outs in every case; float32's products without TF32)."""


def decode_splits(max_k: int) -> tuple[int, int]:
    """How the keys of every segment are split for at most ``max_k`` of them: ``(n_splits, split_len)``, split_len
    a multiple of :data:`TILE` of at least :data:`MIN_SPLIT` keys, at most :data:`MAX_SPLITS` splits (one where
    ``max_k`` is 0). A function of host ints only: a captured graph's grid."""
    split = max(MIN_SPLIT, -(-max(max_k, 1) // MAX_SPLITS))
    split = -(-split // TILE) * TILE
    return max(1, -(-max_k // split)), split


def unsupported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> str | None:
    """Why the Triton paged decode does not serve queries like ``q`` [T, H, D] over these pools
    [N, block_size, Hkv, D]; None where it does: a dtype of :data:`DTYPES` for all three, one head dim up to
    :data:`MAX_DIM` for q, k and v, H a multiple of Hkv with at most :data:`MAX_GROUP` query heads per K/V head,
    pools of unit stride on the head dim, all on one device."""
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.dim() != 4:
        return "q [T, H, D] and pools [N, block_size, Hkv, D]"
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k_pool.dtype}, {v_pool.dtype}: one of bfloat16, float16, float32 for all"
    d = q.shape[-1]
    if not 1 <= d <= MAX_DIM or k_pool.shape[-1] != d or v_pool.shape[-1] != d:
        return f"head dims {d}, {k_pool.shape[-1]}, {v_pool.shape[-1]}: one, up to {MAX_DIM}"
    h, hkv = q.shape[1], k_pool.shape[2]
    if hkv == 0 or h % hkv or h // hkv > MAX_GROUP or v_pool.shape[2] != hkv or v_pool.shape[:2] != k_pool.shape[:2]:
        return f"{h} query heads over {hkv} K/V heads: a multiple, at most {MAX_GROUP} per K/V head"
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        return "pools of unit stride on the head dim"
    if k_pool.device != q.device or v_pool.device != q.device:
        return "q and the pools on one device"
    return None


def keys_per_tile(block_d: int) -> int:
    """BLOCK_N for a head-dim tile of ``block_d``: :data:`TILE`, or half of it above 128."""
    return TILE if block_d <= 128 else TILE // 2


def _pow2(n: int, least: int = 16) -> int:
    """The next power of 2 from ``n``, at least ``least`` (tl.dot's smallest side)."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def paged_decode(
    q, k_pool, v_pool, block_table, cu_q, seqused_k, max_k: int, scale: float, launch: kernels.Launcher | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries q [T, H, D] of B segments of at most one query each (segment i's in row ``cu_q[i]`` where
    ``cu_q[i + 1] > cu_q[i]``) against the first ``seqused_k[i]`` (<= ``max_k``) rows of its blocks of the pools:
    out [T, H, D] in q's dtype, lse float32 [H, T] (natural log); a segment without keys: out 0, lse -inf. Causal
    or not alike (one query sees all its keys, causal being aligned bottom-right). Capturable: only
    ``torch.empty`` and two launches; ``block_table``, ``cu_q`` and ``seqused_k`` are read by the kernels."""
    t, h, d = q.shape
    b, hkv = block_table.shape[0], k_pool.shape[2]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    if t == 0 or b == 0:
        return out, lse
    q, block_table, cu_q, seqused_k = (x.contiguous() for x in (q, block_table, cu_q, seqused_k))  # unit strides
    n_splits, split = decode_splits(max_k)
    part_out = torch.empty((b, h, n_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, h, n_splits), dtype=torch.float32, device=q.device)
    group, block_d = h // hkv, _pow2(d)
    run = launch or kernels.LAUNCHER
    run("paged_split", (b, hkv, n_splits), (
        q, k_pool, v_pool, block_table, cu_q, seqused_k, part_out, part_lse,
        scale * math.log2(math.e), d, split,
        q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], block_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        group, _pow2(group), keys_per_tile(block_d), block_d, k_pool.shape[1], q.dtype == torch.float32,
    ))  # fmt: skip
    run("paged_combine", (b, h), (
        part_out, part_lse, cu_q, out, lse,
        n_splits, d, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), lse.stride(0),
        _pow2(n_splits, 2), block_d,
    ))  # fmt: skip
    return out, lse
