"""The Triton kernels of the CUDA backend's paged decode (:mod:`xcp_cuda.paged`): one query per segment against
its keys in a paged KV pool, read in place through the block table, split along the keys (flash-decoding), then
the splits combined.

Everything a step changes (the block table, the lengths, where each segment's query is) is read on the device,
so a captured graph replays the same two launches over whatever the tables hold. Like
:mod:`xcp_cuda.merge_kernels`, this module imports triton and is imported at the first launch.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, cu_q_ptr, used_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, dim, split_len,
    q_st, q_sh, k_sn, k_sb, k_sh, v_sn, v_sb, v_sh, t_sb, p_sb, p_sh, p_ss, l_sb, l_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (segment b, K/V head g, split s): the GROUP query heads of g for b's query (row ``cu_q[b]``, if b has
    one) against b's keys ``s * split_len .. min(seqused_k[b], (s + 1) * split_len) - 1``, keys of BLOCK_N at a
    time, each key row at row ``pos % PAGE`` of block ``table[b, pos // PAGE]``; float32 online softmax in base 2.
    Writes the split's lse (natural log; -inf where it has no key) and, where it has keys, its normalised out."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    row = tl.load(cu_q_ptr + b).to(tl.int64)
    has_query = tl.load(cu_q_ptr + b + 1) > row
    used = tl.load(used_ptr + b)
    start = s * split_len
    end = tl.where(has_query, tl.minimum(used, start + split_len), start)  # no query: nothing to read
    heads = tl.arange(0, BLOCK_G)
    hmask = heads < GROUP
    heads = g * GROUP + heads
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    qmask = hmask[:, None] & dmask[None, :] & (end > start)  # a split past its segment's keys reads nothing
    q = tl.load(q_ptr + row * q_st + heads[:, None] * q_sh + d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < end
        block = tl.load(table_ptr + b * t_sb + pos // PAGE, mask=kmask, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (block * k_sn + slot * k_sb + g * k_sh)[:, None] + d[None, :], mask=lmask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(kmask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile holds a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (block * v_sn + slot * v_sb + g * v_sh)[:, None] + d[None, :], mask=lmask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0.0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(part_lse_ptr + b * l_sb + heads * l_sh + s, lse, mask=hmask & has_query)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = part_out_ptr + b * p_sb + heads[:, None] * p_sh + s * p_ss + d[None, :]
    tl.store(o_ptrs, out, mask=(hmask & seen)[:, None] & dmask[None, :])  # a split without keys: its lse says so


@triton.jit
def paged_decode_combine_kernel(
    part_out_ptr, part_lse_ptr, cu_q_ptr, out_ptr, lse_ptr,
    n_splits, dim, p_sb, p_sh, p_ss, l_sb, l_sh, o_st, o_sh, lse_sh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (segment b, query head h): where b has a query, its out row (q's dtype) and lse (float32) from the
    n_splits partials, each weighed by exp(lse_s - max); out 0 and lse -inf where no split saw a key. Splits
    without keys are never read past their lse (their outs were not written)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(cu_q_ptr + b).to(tl.int64)
    has_query = tl.load(cu_q_ptr + b + 1) > row
    s = tl.arange(0, BLOCK_S)
    lses = tl.load(part_lse_ptr + b * l_sb + h * l_sh + s, mask=(s < n_splits) & has_query, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - top)  # 0 for a split without keys
    total = tl.sum(weights, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    read = (lses > float("-inf"))[:, None] & dmask[None, :]
    parts = tl.load(part_out_ptr + b * p_sb + h * p_sh + s[:, None] * p_ss + d[None, :], mask=read, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * o_st + h * o_sh + d, out.to(out_ptr.dtype.element_ty), mask=dmask & has_query)
    lse = tl.where(total > 0.0, top + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + h * lse_sh + row, lse, mask=has_query)
