"""The one-pass Triton kernels of the CUDA backend: the log-sum-exp merge of one block, of two blocks at once,
the backward's additions of a block's gradients (and of two blocks' dQ), and a KV cache's merge of P ranks'
packed partials.

This module imports triton, so :mod:`xcp_cuda.kernels` imports it only at the first launch (importing the
plugin touches no vendor package). Each kernel covers a [B, S, H, D] tensor as ``n_rows = B * S * H`` rows
of ``dim`` values, ``BLOCK_R`` rows per program (see :class:`xcp_cuda.kernels.Launcher`).
"""

import triton
import triton.language as tl


@triton.jit
def row_coordinates(n_rows, seq, heads, BLOCK_R: tl.constexpr):
    """This program's rows (int64, BLOCK_R of them) as ``(in range, b, i, h)`` of a [B, S, H, ...] tensor."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    t = rows // heads
    return rows < n_rows, t // seq, t % seq, rows % heads


# One-pass log-sum-exp merge for CUDA, as a Triton kernel.
#
# The eager merge (xcp.kernels.merge.merge_) launches about six kernels and reads the running output several
# times; an eager three-kernel version measured on an H200 took about 12% of a 16K x 8K flash block. This
# kernel reads the running output (fp32), the block output (any float dtype) and both log-sum-exps once, and
# writes the running output and log-sum-exp once: the least traffic a merge can have.
#
# Math (same as xcp/kernels/merge.py, written with the row maximum so that nothing overflows):
#     m = max(L, L_b);  e = exp(L - m), e_b = exp(L_b - m)
#     L' = m + log(e + e_b);  O' = O + (e_b / (e + e_b)) * (O_b - O)
# and rows where both are -inf stay at L = -inf, O unchanged (0).
@triton.jit
def merge_kernel(
    out_ptr, lse_ptr, bo_ptr, bl_ptr,
    n_rows, seq, heads, dim,
    o_sb, o_ss, o_sh, l_sb, l_sh, l_ss, b_sb, b_ss, b_sh, bl_sb, bl_sh, bl_ss,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rmask, b, i, h = row_coordinates(n_rows, seq, heads, BLOCK_R)
    neg_inf = float("-inf")
    lo = tl.load(lse_ptr + b * l_sb + h * l_sh + i * l_ss, mask=rmask, other=neg_inf)
    lb = tl.load(bl_ptr + b * bl_sb + h * bl_sh + i * bl_ss, mask=rmask, other=neg_inf)
    m = tl.maximum(lo, lb)
    empty = m == neg_inf
    m_safe = tl.where(empty, 0.0, m)
    e_old = tl.exp(lo - m_safe)
    e_blk = tl.exp(lb - m_safe)
    total = e_old + e_blk
    new_l = tl.where(empty, neg_inf, m_safe + tl.log(tl.where(empty, 1.0, total)))
    w = tl.where(empty, 0.0, e_blk / tl.where(empty, 1.0, total))
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    mask2 = rmask[:, None] & dmask[None, :]
    o_ptrs = out_ptr + (b * o_sb + i * o_ss + h * o_sh)[:, None] + d[None, :]
    b_ptrs = bo_ptr + (b * b_sb + i * b_ss + h * b_sh)[:, None] + d[None, :]
    o = tl.load(o_ptrs, mask=mask2, other=0.0)
    ob = tl.load(b_ptrs, mask=mask2, other=0.0).to(tl.float32)
    o = o + w[:, None] * (ob - o)
    tl.store(o_ptrs, o, mask=mask2)
    tl.store(lse_ptr + b * l_sb + h * l_sh + i * l_ss, new_l, mask=rmask)


@triton.jit
def merge_pair_kernel(
    out_ptr, lse_ptr, ao_ptr, al_ptr, bo_ptr, bl_ptr,
    n_rows, seq, heads, dim,
    o_sb, o_ss, o_sh, l_sb, l_sh, l_ss, a_sb, a_ss, a_sh, al_sb, al_sh, al_ss, b_sb, b_ss, b_sh, bl_sb, bl_sh, bl_ss,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FRESH: tl.constexpr,
):  # fmt: skip
    rmask, b, i, h = row_coordinates(n_rows, seq, heads, BLOCK_R)
    neg_inf = float("-inf")
    la = tl.load(al_ptr + b * al_sb + h * al_sh + i * al_ss, mask=rmask, other=neg_inf)
    lb = tl.load(bl_ptr + b * bl_sb + h * bl_sh + i * bl_ss, mask=rmask, other=neg_inf)
    l_ptrs = lse_ptr + b * l_sb + h * l_sh + i * l_ss
    if FRESH:
        lo = tl.full([BLOCK_R], neg_inf, tl.float32)
    else:
        lo = tl.load(l_ptrs, mask=rmask, other=neg_inf)
    m = tl.maximum(tl.maximum(lo, la), lb)
    empty = m == neg_inf
    m_safe = tl.where(empty, 0.0, m)
    e_old = tl.exp(lo - m_safe)
    e_a = tl.exp(la - m_safe)
    e_b = tl.exp(lb - m_safe)
    total = tl.where(empty, 1.0, e_old + e_a + e_b)
    new_l = tl.where(empty, neg_inf, m_safe + tl.log(total))
    w_a = tl.where(empty, 0.0, e_a / total)
    w_b = tl.where(empty, 0.0, e_b / total)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    mask2 = rmask[:, None] & dmask[None, :]
    o_ptrs = out_ptr + (b * o_sb + i * o_ss + h * o_sh)[:, None] + d[None, :]
    oa = tl.load(ao_ptr + (b * a_sb + i * a_ss + h * a_sh)[:, None] + d[None, :], mask=mask2, other=0.0)
    ob = tl.load(bo_ptr + (b * b_sb + i * b_ss + h * b_sh)[:, None] + d[None, :], mask=mask2, other=0.0)
    o = w_a[:, None] * oa.to(tl.float32) + w_b[:, None] * ob.to(tl.float32)
    if not FRESH:  # rows where all three are -inf keep the running output (zeros)
        old = tl.load(o_ptrs, mask=mask2, other=0.0)
        w_old = tl.where(empty, 1.0, e_old / total)
        o = o + w_old[:, None] * old
    tl.store(o_ptrs, o, mask=mask2)
    tl.store(l_ptrs, new_l, mask=rmask)


@triton.jit
def add_pair_kernel(
    acc_ptr, a_ptr, b_ptr,
    n_rows, seq, heads, dim,
    c_sb, c_ss, c_sh, a_sb, a_ss, a_sh, b_sb, b_ss, b_sh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    rmask, b, i, h = row_coordinates(n_rows, seq, heads, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d < dim)[None, :]
    c_ptrs = acc_ptr + (b * c_sb + i * c_ss + h * c_sh)[:, None] + d[None, :]
    x = tl.load(a_ptr + (b * a_sb + i * a_ss + h * a_sh)[:, None] + d[None, :], mask=mask2, other=0.0)
    x = x.to(tl.float32)
    if PAIR:  # else acc += a alone: b_ptr is not read
        y = tl.load(b_ptr + (b * b_sb + i * b_ss + h * b_sh)[:, None] + d[None, :], mask=mask2, other=0.0)
        x = x + y.to(tl.float32)
    c = tl.load(c_ptrs, mask=mask2, other=0.0)
    tl.store(c_ptrs, c + x, mask=mask2)


# A KV cache's combine (xcp.inference.cache.KVCache._combine): P ranks' partials, gathered as one packed buffer, merged
# into out [B, T, H, D] (float32) and the merged lse [B, H, T] (float32) in one kernel. Two packings:
#     LSE_WORDS = 1: parts [P, B, T, H, D + 1] float32, rank r's out in [..., :D], its lse in [..., D];
#     LSE_WORDS = 2: parts [P, B, T, H, D + 2] bfloat16 or float16 (D even), rank r's out in [..., :D] as the
#                    attention kernel gave it, its float32 lse stored bit for bit in channels D and D + 1.
# The kernel reads the outs through ``outs_ptr`` (the buffer in its own dtype: rows of D + LSE_WORDS values)
# and the lses through ``lses_ptr`` (the same buffer viewed as float32: rows of (D + LSE_WORDS) / LSE_WORDS
# values, the lse at column D / LSE_WORDS); for LSE_WORDS = 1 the two are one tensor. Outs are converted to
# float32 in registers, so both packings share the math below. Each program takes BLOCK_R rows
# (n_rows = B * T * H):
#     pass 1, over the P lse only: the running max m and sum s = sum_r exp(L_r - m), rescaled as m grows;
#             L = m + log(s), or -inf on a row no rank saw (m = -inf);
#     pass 2, over the P outs: O = sum_r exp(L_r - L) O_r (a -inf partial weighs exp(-inf) = 0);
# so every partial's out is read once (its lse twice, the second time from cache) and out and lse are
# written once. The weights are the eager merge's (xcp.inference.partials.merge_into): w_r = exp(L_r - L). A row no
# rank saw gets L = -inf and, with L taken as 0 in the weights, O = 0: never NaN.
# P is a constexpr (one compile per world size) and the loops over it run UNROLL partials at a time
# unrolled, so that many loads are in flight together: a decode step has few rows (B * H), so few
# programs, and P loads one after another would be P memory latencies. UNROLL is bounded by the tile's
# values per thread (xcp_cuda.kernels.partials_tiling) so that nothing spills.
@triton.jit
def _partial_lse(m, s, lses, lse_offs, rmask):
    """Pass 1's step: fold one partial's lse into the running max ``m`` and sum ``s = sum exp(L_r - m)``."""
    neg_inf = float("-inf")
    lr = tl.load(lses + lse_offs, mask=rmask, other=neg_inf)
    m_new = tl.maximum(m, lr)
    m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
    s = s * tl.exp(m - m_safe) + tl.exp(lr - m_safe)  # both exp(-inf) = 0 while no rank saw the row
    return m_new, s


@triton.jit
def _partial_out(acc, outs, lses, lse_offs, o_offs, rmask, mask2, lse_safe):
    """Pass 2's step: add one partial's out (as float32), weighted ``exp(L_r - L)``, to ``acc``."""
    w = tl.exp(tl.load(lses + lse_offs, mask=rmask, other=float("-inf")) - lse_safe)
    o = tl.load(outs + o_offs, mask=mask2, other=0.0).to(tl.float32)
    return acc + w[:, None] * o


@triton.jit
def merge_partials_kernel(
    out_ptr, lse_ptr, outs_ptr, lses_ptr,
    n_rows, seq, heads, dim, outs_stride, lses_stride,
    l_sb, l_sh, l_ss,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, N_PARTS: tl.constexpr, UNROLL: tl.constexpr,
    LSE_WORDS: tl.constexpr,
):  # fmt: skip
    rmask, b, i, h = row_coordinates(n_rows, seq, heads, BLOCK_R)
    neg_inf = float("-inf")
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d < dim)[None, :]
    o_row = dim + LSE_WORDS  # a packed row, in values of the outs' dtype
    l_row = o_row // LSE_WORDS  # the same row, in float32 values
    l_col = dim // LSE_WORDS  # the lse's float32 column (D is even where LSE_WORDS = 2)
    # An int64 base per partial, int32 offsets in the tile shared by the P partials: the loads in flight
    # cost a base each, not a tile of 64-bit pointers each. The bases step one partial on at a time (no
    # int32 product r * stride to overflow).
    outs_base = outs_ptr + row0 * o_row  # this program's first packed row of rank 0, as outs and as lses
    lses_base = lses_ptr + row0 * l_row
    lse_offs = r * l_row + l_col
    o_offs = (r * o_row)[:, None] + d[None, :]
    m = tl.full([BLOCK_R], neg_inf, tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    lses = lses_base
    for _ in range(N_PARTS // UNROLL):
        for _ in tl.static_range(UNROLL):
            m, s = _partial_lse(m, s, lses, lse_offs, rmask)
            lses += lses_stride
    for _ in tl.static_range(N_PARTS % UNROLL):
        m, s = _partial_lse(m, s, lses, lse_offs, rmask)
        lses += lses_stride
    empty = m == neg_inf
    lse = tl.where(empty, neg_inf, m + tl.log(tl.where(empty, 1.0, s)))
    lse_safe = tl.where(empty, 0.0, lse)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    outs = outs_base
    lses = lses_base
    for _ in range(N_PARTS // UNROLL):
        for _ in tl.static_range(UNROLL):
            acc = _partial_out(acc, outs, lses, lse_offs, o_offs, rmask, mask2, lse_safe)
            outs += outs_stride
            lses += lses_stride
    for _ in tl.static_range(N_PARTS % UNROLL):
        acc = _partial_out(acc, outs, lses, lse_offs, o_offs, rmask, mask2, lse_safe)
        outs += outs_stride
        lses += lses_stride
    tl.store(out_ptr + row0 * dim + (r * dim)[:, None] + d[None, :], acc, mask=mask2)
    tl.store(lse_ptr + b * l_sb + h * l_sh + i * l_ss, lse, mask=rmask)
