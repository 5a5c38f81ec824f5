"""The Triton kernels of the CUDA backend's ``forward_range`` (:func:`xcp_cuda.kernels.flash_range_forward`):
the varlen op's lengths made from lo and hi, and the empty rows' fix after the op, one launch each.

A KV cache's decode step runs ``forward_range`` every token inside a CUDA graph, where each tiny torch op
(about seven for the lengths, five for the fix) is one more launch on the step's critical path. Both
kernels read lo and hi (int64, one element each) on the device, so a captured graph recomputes everything
from the values they hold at each replay. Like :mod:`xcp_cuda.merge_kernels`, this module imports triton
and is imported at the first launch.
"""

import triton
import triton.language as tl


@triton.jit
def range_lengths_kernel(
    lo_ptr, hi_ptr, cum_q_ptr, cum_k_ptr, used_ptr,
    batch, queries, room,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """cum_seq_q[i] = i*T and cum_seq_k[i] = i*room + lo for i in 0..B, seqused_k[i] = hi - lo for i < B
    (int32, computed in int64 and truncated, as the torch ops' int32 arithmetic wraps)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    lo = tl.load(lo_ptr)
    hi = tl.load(hi_ptr)
    ends = i <= batch
    tl.store(cum_q_ptr + i, (i * queries).to(tl.int32), mask=ends)
    tl.store(cum_k_ptr + i, (i * room + lo).to(tl.int32), mask=ends)
    tl.store(used_ptr + i, tl.zeros([BLOCK], tl.int32) + (hi - lo).to(tl.int32), mask=i < batch)


@triton.jit
def range_blind_rows_kernel(
    out_ptr, lse_ptr, lo_ptr, hi_ptr,
    n_rows, heads, dim, o_sn, o_sh, l_sh, l_sn,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """For each (packed query row n, head h) of out [N, H, D] and lse [H, N] (n_rows = N * H) whose lse is
    +inf (flash's row without keys) or whose range is empty (hi <= lo): lse = -inf and the out row zeroed.
    Other rows are neither read past their lse nor written."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < n_rows
    n = rows // heads
    h = rows % heads
    lo = tl.load(lo_ptr)
    hi = tl.load(hi_ptr)
    l_ptrs = lse_ptr + h * l_sh + n * l_sn
    lse = tl.load(l_ptrs, mask=rmask, other=0.0)
    lse = tl.where(hi <= lo, float("inf"), lse)  # an empty range: every row blind
    blind = (lse == float("inf")) & rmask
    tl.store(l_ptrs, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=blind)
    d = tl.arange(0, BLOCK_D)
    mask2 = blind[:, None] & (d < dim)[None, :]
    o_ptrs = out_ptr + (n * o_sn + h * o_sh)[:, None] + d[None, :]
    tl.store(o_ptrs, tl.zeros([BLOCK_R, BLOCK_D], out_ptr.dtype.element_ty), mask=mask2)
