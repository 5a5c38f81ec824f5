"""A paged cache's local partial on Ascend: one torch_npu.npu_fused_infer_attention_score call over the pool's blocks.

Source: torch_npu's page of the op (Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``, the
text of hiascend.com's "torch_npu.npu_fused_infer_attention_score"). What it states and this module keeps (quotes
abridged, translations ours):

- query, key, value float16 or bfloat16 (Atlas A2 / A3), contiguous ("不支持非连续的Tensor"); key and value of one
  shape ("参数key、value中对应tensor的shape需要完全一致"), so values of another head dim than the keys' are not taken;
- ``num_key_value_heads`` divides ``num_heads`` with a ratio of at most 64; N at most 256, D at most 512, B at most
  65536 (both branches); with more than one query per batch entry (the PromptFlashAttention branch) D a multiple of 16
  for float16 / bfloat16;
- page attention: ``block_table`` int32 [B, >= the most blocks an entry reads], ``block_size`` the rows of a block,
  ``actual_seq_lengths_kv`` required; with a BSND (or BSH) query the pools are (blocknum, blocksize, H) with
  KV_N * D at most 65535 ("超过64k" is refused); blocknum at least the sum of the blocks every entry reads; the block
  size a multiple of 16 for float16 / bfloat16 when Q_S is 1 (IncreFlashAttention), and 128..512 in multiples of 128
  when Q_S is above 1; Q_S 1 reads at most 262144 keys per entry;
- ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` are host int lists (``SymInt[]``), one per batch entry; a query
  of length 1 ignores ``sparse_mode`` (and ``actual_seq_lengths``); ``sparse_mode`` 3 is rightDownCausal with the
  compressed 2048x2048 mask, aligned per entry on its actual lengths (the page refuses, for int8 outputs, entries with
  ``actual_seq_lengths_kv - actual_seq_lengths < 0`` under it: rows without a key);
- ``softmax_lse_flag=True`` returns the lse, float32 (B, N, Q_S, 1), computed as log(softmax_sum) + softmax_max;
- the keyword of the scale is ``scale`` in torch_npu 7.0's page and ``scale_value`` in 6.0's (hiascend.com,
  Pytorch/600 and 60RC3 "ptaoplist" pages): :func:`scale_keyword` reads which one the installed op takes.

What the docs leave open is kept off the op: a batch entry without queries or without keys (neither is said to be
allowed) is left out of the call (its rows are 0 with lse -inf), and a causal entry with more queries than keys (rows
that see no key, which the page warns lose precision unless a row-invalid mode is on) goes to the base class. Rows of a
padded query beyond an entry's ``actual_seq_lengths`` are never read back.

The lengths are host lists, so a call reads ``cu_q`` and ``seqused_k`` to the host once (:func:`read_lengths`): not
capturable. Under graph capture the backend leaves the call to the base class's gather (lengths on the device).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .convert import MAX_QUERY_HEADS, MAX_TOKENS, SPARSE_NONE, SPARSE_RIGHT_DOWN_CAUSAL

OP = "npu_fused_infer_attention_score"
"""The torch_npu op of the paged partial."""
DTYPES = (torch.float16, torch.bfloat16)
"""The query / key / value dtypes the op takes (besides int8 and int4, which xcp does not pass)."""
LAYOUT = "BSND"
"""The query's layout: [B, Q_S, N, D]; the pools then are (blocknum, blocksize, KV_N * D)."""
MAX_HEAD_DIM = 512
PROMPT_HEAD_DIM_MULTIPLE = 16
"""Q_S above 1, float16 / bfloat16: D a multiple of 16."""
MAX_GROUP = 64
"""The most query heads per K/V head (num_heads / num_key_value_heads)."""
MAX_POOL_ROW = 65535
"""The most KV_N * D of a (blocknum, blocksize, H) pool."""
DECODE_BLOCK_MULTIPLE = 16
"""Q_S 1, float16 / bfloat16: the block size a multiple of 16."""
PROMPT_BLOCK_MULTIPLE, PROMPT_MAX_BLOCK = 128, 512
"""Q_S above 1: the block size 128..512 in multiples of 128."""
MAX_BATCH = 65536
DECODE_MAX_KEYS = 262144
"""Q_S 1: the most keys of one batch entry."""


def pool_unsupported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> str | None:
    """Why the op cannot read these pools for queries like q [T, H, D] in any branch; None when it can (the decode
    branch, Q_S 1, at least)."""
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.dim() != 4:
        return f"shapes {tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)} (q [T, H, D], pools 4-d)"
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k_pool.dtype}, {v_pool.dtype} (the op takes float16 or bfloat16)"
    if v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        return "key and value pools must be contiguous and of one shape (values of another head dim are not taken)"
    h, d = q.shape[1], q.shape[2]
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    if k_pool.shape[3] != d or not 0 < d <= MAX_HEAD_DIM:
        return f"head dims {d} / {k_pool.shape[3]} (equal, at most {MAX_HEAD_DIM})"
    if not 0 < h <= MAX_QUERY_HEADS or hkv == 0 or h % hkv or h // hkv > MAX_GROUP:
        return f"{h} query heads over {hkv} K/V heads (at most {MAX_QUERY_HEADS}, {MAX_GROUP} per K/V head)"
    if hkv * d > MAX_POOL_ROW:
        return f"K/V heads x head dim {hkv * d} above {MAX_POOL_ROW} (a (blocknum, blocksize, H) pool)"
    if block % DECODE_BLOCK_MULTIPLE:
        return f"block size {block} (a multiple of {DECODE_BLOCK_MULTIPLE})"
    return None


def prompt_unsupported(block_size: int, head_dim: int) -> str | None:
    """Why the op's branch of several queries per entry (PromptFlashAttention) cannot take these; None when it can."""
    if block_size % PROMPT_BLOCK_MULTIPLE or not PROMPT_BLOCK_MULTIPLE <= block_size <= PROMPT_MAX_BLOCK:
        return f"block size {block_size} (several queries per entry: {PROMPT_BLOCK_MULTIPLE}..{PROMPT_MAX_BLOCK} in " \
               f"multiples of {PROMPT_BLOCK_MULTIPLE})"  # fmt: skip
    if head_dim % PROMPT_HEAD_DIM_MULTIPLE:
        return f"head dim {head_dim} (several queries per entry: a multiple of {PROMPT_HEAD_DIM_MULTIPLE})"
    return None


def in_place_unsupported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> str | None:
    """Why the op cannot take every call a paged cache may make on these pools (decode rows and chunks alike)."""
    return pool_unsupported(q, k_pool, v_pool) or prompt_unsupported(k_pool.shape[1], q.shape[2])


def read_lengths(cu_q: torch.Tensor, seqused_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """``cu_q`` [B + 1] and ``seqused_k`` [B] as host lists, in ONE device-to-host copy (which waits for the work
    queued before it)."""
    b = seqused_k.shape[0]
    both = torch.cat((cu_q.reshape(-1).to(torch.int64), seqused_k.reshape(-1).to(torch.int64))).tolist()
    return both[: b + 1], both[b + 1 :]


@dataclasses.dataclass(frozen=True)
class Call:
    """One op call: the batch entries it takes (segments with queries and keys) and where their rows go."""

    segments: tuple[int, ...]
    """The segments of the call, in order (its batch entries)."""
    queries: tuple[int, ...]
    """Each entry's queries (``actual_seq_lengths``)."""
    keys: tuple[int, ...]
    """Each entry's keys (``actual_seq_lengths_kv``)."""
    width: int
    """Q_S: the most queries of an entry (1: the decode branch)."""
    rows: tuple[int, ...]
    """The packed query rows of the entries, entry by entry."""
    slots: tuple[int, ...]
    """Where each of ``rows`` sits in the call's [B * Q_S] query slots."""

    def gather(self, pad_row: int) -> list[int]:
        """For each of the call's query slots, the packed row it takes (``pad_row``, a zero row, for padding)."""
        where = [pad_row] * (len(self.segments) * self.width)
        for row, slot in zip(self.rows, self.slots):
            where[slot] = row
        return where


def plan(cu: list[int], used: list[int], block_size: int, num_blocks: int, table_width: int,
         causal: bool, head_dim: int) -> list[Call] | str:  # fmt: skip
    """The calls for segments ``cu`` (cumulative queries) with ``used`` keys each, or why the op cannot take them.

    The op needs a pool of at least the blocks its entries read together; segments of one sequence that share its
    blocks (a chunk's groups of queries on a rank of an interleaved world) may read more than the pool holds, so the
    entries are cut, in order, into as few calls as keep each within the pool (and :data:`MAX_BATCH`): every call
    reads the pool in place. A call whose entries have one query each takes the decode branch."""
    segments = [i for i in range(len(used)) if cu[i + 1] > cu[i] and used[i] > 0]
    if causal and any(cu[i + 1] - cu[i] > used[i] for i in segments):
        return "a causal entry with more queries than keys (rows that see no key)"
    blocks = {i: -(-used[i] // block_size) for i in segments}
    if max(blocks.values(), default=0) > min(num_blocks, table_width):
        return f"an entry reading {max(blocks.values())} blocks (the pool holds {num_blocks}, the table {table_width})"
    groups: list[list[int]] = [[]]
    for i in segments:
        if groups[-1] and (sum(blocks[j] for j in groups[-1]) + blocks[i] > num_blocks or len(groups[-1]) == MAX_BATCH):
            groups.append([])
        groups[-1].append(i)
    calls = []
    for group in groups if segments else []:
        queries = [cu[i + 1] - cu[i] for i in group]
        keys = [used[i] for i in group]
        width = max(queries)
        why = prompt_unsupported(block_size, head_dim) if width > 1 else None
        if width == 1 and max(keys) > DECODE_MAX_KEYS:
            why = f"{max(keys)} keys in one entry (one query per entry: at most {DECODE_MAX_KEYS})"
        if why is not None:
            return why
        rows = [cu[i] + m for i in group for m in range(cu[i + 1] - cu[i])]
        slots = [e * width + m for e, n in enumerate(queries) for m in range(n)]
        calls.append(Call(tuple(group), tuple(queries), tuple(keys), width, tuple(rows), tuple(slots)))
    return calls


def argument_names(op: Any) -> frozenset[str]:
    """The keyword names ``op`` takes: from its overloads' schemas (a torch op) or its Python signature; empty where
    neither."""
    overloads = getattr(op, "overloads", None)
    if callable(overloads):
        return frozenset(a.name for name in overloads() for a in getattr(op, name)._schema.arguments)
    try:
        return frozenset(inspect.signature(op).parameters)
    except (TypeError, ValueError):
        return frozenset()


def scale_keyword(op: Any) -> str:
    """``scale_value`` where the installed op names its scale so (torch_npu 6.0), else ``scale`` (7.0's page)."""
    names = argument_names(op)
    return "scale_value" if "scale_value" in names and "scale" not in names else "scale"


def call_args(call: Call, heads: int, kv_heads: int, block_size: int, causal: bool, mask: torch.Tensor | None,
              scale_name: str, scale: float) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of the op for ``call`` (besides query, key, value and block_table)."""
    masked = causal and call.width > 1  # one query per entry sees all its keys; the op ignores sparse_mode then
    return {
        "actual_seq_lengths": list(call.queries) if call.width > 1 else None,
        "actual_seq_lengths_kv": list(call.keys),
        "num_heads": heads,
        "num_key_value_heads": kv_heads,
        "input_layout": LAYOUT,
        scale_name: scale,
        "atten_mask": mask if masked else None,
        "sparse_mode": SPARSE_RIGHT_DOWN_CAUSAL if masked else SPARSE_NONE,
        "pre_tokens": MAX_TOKENS,
        "next_tokens": MAX_TOKENS,
        "block_size": block_size,
        "inner_precise": 0,
        "softmax_lse_flag": True,
    }


def check_outputs(outputs: Any, call: Call, heads: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_out [B, Q_S, N, Dv], lse [B, N, Q_S]) of the op's outputs, checked: a torch_npu whose op returns no
    lse (``softmax_lse_flag`` unknown to it) is named rather than merged as garbage."""
    b, width = len(call.segments), call.width
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 2:
        raise ValueError(f"{OP}: expected (attention_out, softmax_lse); got {type(outputs).__name__}")
    out, lse = outputs[0], outputs[1]
    if tuple(out.shape) != (b, width, heads, value_dim):
        raise ValueError(f"{OP} attention_out: expected shape {(b, width, heads, value_dim)}; got {tuple(out.shape)}")
    if tuple(lse.shape) != (b, heads, width, 1) or lse.dtype != torch.float32:
        raise ValueError(
            f"{OP} softmax_lse: expected float32 {(b, heads, width, 1)} (softmax_lse_flag=True needs a torch_npu and "
            f"CANN that return it); got {lse.dtype} {tuple(lse.shape)}"
        )
    return out, lse[..., 0]
