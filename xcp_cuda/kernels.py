"""The CUDA kernels: which one serves a block, thin wrappers over PyTorch's fused attention ops, and the
launch of the one-pass Triton merges (:mod:`xcp_cuda.merge_kernels`).

Every wrapper takes and returns xcp's layout, q [B, Sq, H, D] and k, v [B, Sk, Hkv, D], and is only asked
for ``causal=False`` or causal on a square block (:mod:`xcp.backends.fused` cuts the rest), so the kernels'
own alignment of a non-square causal mask never matters.

The ops (schemas as registered in PyTorch's native_functions.yaml, checked against torch 2.13):

``aten._scaled_dot_product_flash_attention(query, key, value, dropout_p=0., is_causal=False,
return_debug_mask=False, *, scale=None)``
    -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask).
    Inputs [B, H, S, D]; logsumexp float32 [B, H, Sq]; cum_seq_* are None for dense inputs. fp16/bf16,
    head_dim a multiple of 8 up to 256 (the SDPA front end pads other head dims; the op does not),
    sm80 or newer. Accepts k/v with fewer heads (GQA) and returns dk/dv with those heads.

``aten._scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp,
cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None)``
    -> (grad_query, grad_key, grad_value). The RNG state is read only when dropout_p > 0.

``aten._scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp,
dropout_p=0., is_causal=False, *, scale=None)`` -> (output, log_sumexp, philox_seed, philox_offset).
    fp16/bf16/fp32; log_sumexp is float32 [B, H, ceil(Sq/32)*32] (padded rows are not ours); head_dim a
    multiple of 8 (fp16/bf16) or 4 (fp32) on sm80+. Needs as many K/V heads as query heads.

``aten._scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias, out,
logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None)``
    -> (grad_query, grad_key, grad_value, grad_bias).

``aten._scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.,
is_causal=False, return_debug_mask=False, *, scale=None)``
    -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask).
    Inputs [B, H, S, D]; output laid out like query; logsumexp float32 [B, H, Sq, 1]; seed and offset
    int64 scalars. Accepts k/v with fewer heads (GQA). Which shapes, dtypes, head dims and GPUs it serves
    depends on the cuDNN build; torch's SDPA dispatcher knows (``torch._fused_sdp_choice``), so xcp asks it.

``aten._scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp,
philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
scale=None)`` -> (grad_query, grad_key, grad_value). Like flash's, it recomputes the probabilities from the
    lse and out it is given, so the merged ones work (checked on an H200 against float64 with a causal and
    a full block merged: the same errors as flash's, benchmarks/device_kernel_probe.py).

``aten._flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
is_causal, return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, ...)``
    -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask). The varlen form of the flash op:
    packed inputs [total, H, D], cum_seq_* int32 device tensors of cumulative lengths (segment i is
    queries [cum_seq_q[i], cum_seq_q[i+1]) against keys [cum_seq_k[i], cum_seq_k[i+1])), max_* the
    longest segment; logsumexp float32 [H, total_q]. Same dtypes, head dims, GPUs and native GQA as the
    dense op; causal is bottom-right per segment (ours are square, so top-left alike). With ``seqused_k``
    (int32 [B], on the device) key segment i is keys [cum_seq_k[i], cum_seq_k[i] + seqused_k[i]): the op
    then reads cum_seq_k only for where each segment starts, and max_k bounds the lengths. A row whose
    segment has no key comes back with out 0 and lse +inf (flash-attn's convention for empty rows, also
    after its split-KV combine), not -inf. With max_q == 1 and GQA the op runs the query heads of a KV head
    as rows ("seqlenq_ngroups_swapped") and still returns lse [H, total_q].

``aten._flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
window_size_right=None)`` -> (grad_query, grad_key, grad_value), packed like the forward. The dense
    flash backward above forwards its philox seed and offset here as rng_state and unused.

``flash_attn.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, ..., return_attn_probs)``
    (the flash-attn package, when installed) takes our [B, S, H, D] layout and GQA directly and, with
    return_attn_probs=True, returns (out, softmax_lse [B, H, Sq] float32, S_dmask). Only its forward is
    used: the block backward needs the *merged* out and lse, which the aten flash backward takes as
    plain arguments, whereas flash-attn's backward is private API that changed between versions.

Backward with the merged log-sum-exp: each backward recomputes P = exp(scale·q·kᵀ - lse) from the lse it
is given, so passing the ring's merged lse (and merged out, from which it computes rowsum(dO·O)) yields
the gradient of the whole row's softmax restricted to this block. A row whose merged lse is -inf (it saw
no key anywhere) would make exp(s - lse) = inf; flash-attn's own convention for such rows is lse = +inf,
which makes P = 0 and every gradient of the row 0, so :func:`lse_for_backward` maps -inf to +inf.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from xcp.backends.base import Block
from xcp.backends.fused import op_takes_argument, repeat_kv, sum_kv_groups, widen_head_dim

ATEN: Any = torch.ops.aten
"""The op namespace the wrappers call (tests on CPU substitute a stand-in with the same signatures)."""

FLASH, CUDNN, EFFICIENT, MATH = "flash", "cudnn", "efficient", "math"

SDPA_CHOICE: Any = getattr(torch, "_fused_sdp_choice", None)
"""torch's SDPA dispatcher: which fused kernel it would run for given q, k, v (tests substitute one)."""

EFFICIENT_LSE_ALIGN = 32
"""The memory-efficient kernel writes its log-sum-exp in rows padded to a multiple of 32."""


def choose_kernel(dtype: torch.dtype, head_dim: int, capability: tuple[int, int], value_dim: int | None = None) -> str:
    """The fastest aten kernel that serves a block: ``flash``, ``efficient`` or ``math``.

    flash: fp16/bf16, head_dim % 8 == 0 and <= 256, sm80+ (what PyTorch's SDPA dispatcher accepts for
    the flash op without padding), and values of the same head dim (flash takes one: "q, k, v must have
    the same last dimension"). efficient: fp16/bf16 with head dims % 8 == 0, or fp32 with head dims % 4
    == 0 (its GEMM alignment on sm80+; sm50+ otherwise runs it too, alignment 8/4 kept); it takes a value
    head dim of its own. math: everything else (float64, odd head dims), in float32/float64 through
    :func:`xcp.kernels.math.math_forward`. ``value_dim`` is v's head dim (default: head_dim).
    """
    dims = (head_dim, head_dim if value_dim is None else value_dim)
    half = dtype in (torch.float16, torch.bfloat16)
    if half and dims[0] == dims[1] and head_dim % 8 == 0 and head_dim <= 256 and capability >= (8, 0):
        return FLASH
    if (half and all(d % 8 == 0 for d in dims)) or (dtype == torch.float32 and all(d % 4 == 0 for d in dims)):
        return EFFICIENT
    return MATH


def native_gqa(kernel: str) -> bool:
    """Whether ``kernel`` reads K/V with fewer heads than q itself (flash and cuDNN do; efficient needs
    repeats)."""
    return kernel in (FLASH, CUDNN)


def sdpa_picks_cudnn(q: torch.Tensor, k: torch.Tensor, causal: bool, v: torch.Tensor | None = None) -> bool:
    """Whether torch's SDPA would run a block shaped like (q, k) on cuDNN (``enable_gqa``, with gradients).

    SDPA's dispatcher holds the rules of the cuDNN build at hand (its version, the GPU, head dims,
    sequence lengths, the ``torch.nn.attention.sdpa_kernel`` context in force); asking it keeps xcp on
    cuDNN exactly where PyTorch itself trusts cuDNN. Never raises: a torch without the dispatcher, or
    one that rejects the question, means no.
    """
    if SDPA_CHOICE is None:
        return False
    try:
        from torch.nn.attention import SDPBackend

        grads = not torch.is_inference_mode_enabled()  # the ring's backward needs cuDNN's too
        views = [heads_second(x).detach().requires_grad_(grads) for x in (q, k, k if v is None else v)]
        choice = SDPA_CHOICE(*views, None, 0.0, causal, scale=None, enable_gqa=q.shape[2] != k.shape[2])
        return int(choice) == SDPBackend.CUDNN_ATTENTION.value
    except Exception:  # noqa: BLE001 - any doubt: the flash op serves
        return False


def heads_second(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> the [B, H, S, D] view the aten ops take, over a contiguous [B, S, H, D] buffer.

    This is the layout SDPA callers pass (q.transpose(1, 2)); the ops transpose back internally, so the
    buffer they read is dense. Ring slices of a batch > 1 are copied once here.
    """
    return x.contiguous().transpose(1, 2)


def _backward_views(dout, q, k, v, out) -> tuple[torch.Tensor, ...]:
    """dout, q, k, v, out as the dense backward ops take them: [B, H, S, D] views, dout and out in q's dtype."""
    return tuple(heads_second(x) for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """The merged lse as the backward kernels read it: float32, contiguous, -inf rows mapped to +inf."""
    # one kernel (a fresh contiguous tensor); NaN, which no kernel writes, is left as it is
    return torch.nan_to_num(lse.to(torch.float32), nan=math.nan, neginf=math.inf)


def pad_lse(lse: torch.Tensor, align: int = EFFICIENT_LSE_ALIGN) -> torch.Tensor:
    """[B, H, Sq] -> [B, H, ceil(Sq/align)*align], padded with +inf (rows that do not exist see nothing).

    The memory-efficient backward is given the lse in the shape its forward returns.
    """
    sq = lse.shape[-1]
    padded = math.ceil(sq / align) * align
    if padded == sq:
        return lse
    return torch.nn.functional.pad(lse, (0, padded - sq), value=float("inf"))


def _dense_lengths(q: torch.Tensor, k: torch.Tensor) -> tuple[None, None, int, int]:
    """The backward ops' ``cum_seq_q, cum_seq_k, max_q, max_k`` for a dense batch: no cumulative lengths,
    and the block's query and key lengths."""
    return None, None, q.shape[1], k.shape[1]


def _rng_placeholders(device: torch.device, flash: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed and offset tensors shaped and typed as the forward returns them. Uninitialised on purpose: the
    backward reads them only when dropout_p > 0, and ``empty`` launches no kernel (a fill of uint64, which
    CUDA supports only barely, is not needed)."""
    key = (device, flash)
    pair = _RNG_PLACEHOLDERS.get(key)
    if pair is None:  # made once per device and reused: nothing ever writes them, so no stream orders them
        if flash:
            pair = torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)
        else:
            pair = torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)
        if not (pair[0].is_cuda and torch.cuda.is_current_stream_capturing()):  # not from a graph's pool
            _RNG_PLACEHOLDERS[key] = pair
    return pair


_RNG_PLACEHOLDERS: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


# ---------------------------------------------------------------------------------------------- flash
def flash_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """aten flash forward: out [B, Sq, H, D] in q's dtype and lse float32 [B, H, Sq]. K/V may be GQA."""
    res = ATEN._scaled_dot_product_flash_attention(
        heads_second(q), heads_second(k), heads_second(v), 0.0, causal, False, scale=scale
    )
    return res[0].transpose(1, 2), res[1]


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """aten flash backward from the merged out/lse: dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D] (inputs' dtype)."""
    seed, offset = _rng_placeholders(q.device, flash=True)
    dq, dk, dv = ATEN._scaled_dot_product_flash_attention_backward(
        *_backward_views(dout, q, k, v, out),
        lse_for_backward(lse),
        *_dense_lengths(q, k),
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- cuDNN
def cudnn_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """aten cuDNN forward: out [B, Sq, H, D] in q's dtype and lse float32 [B, H, Sq]. K/V may be GQA."""
    res = ATEN._scaled_dot_product_cudnn_attention(
        heads_second(q), heads_second(k), heads_second(v), None, True, 0.0, causal, False, scale=scale
    )
    b, sq, h, _ = q.shape
    return res[0].transpose(1, 2), res[1].reshape(b, h, sq)


def cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """aten cuDNN backward from the merged out/lse: dq [B, Sq, H, D], dk, dv [B, Sk, Hkv, D]."""
    seed, offset = _rng_placeholders(q.device, flash=False)
    dq, dk, dv = ATEN._scaled_dot_product_cudnn_attention_backward(
        *_backward_views(dout, q, k, v, out),
        lse_for_backward(lse).unsqueeze(-1),  # [B, H, Sq, 1], as the forward returns it
        seed,  # read only when dropout_p > 0
        offset,
        None,  # attn_bias
        *_dense_lengths(q, k),
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- efficient
def efficient_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """aten memory-efficient forward: out in q's dtype, lse float32 [B, H, Sq] (its padding sliced off).

    K/V must have q's number of heads (the caller repeats them for GQA).
    """
    res = ATEN._scaled_dot_product_efficient_attention(
        heads_second(q), heads_second(k), heads_second(v), None, True, 0.0, causal, scale=scale
    )
    return res[0].transpose(1, 2), res[1][..., : q.shape[1]]


def efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """aten memory-efficient backward from the merged out/lse: dq, dk, dv shaped like q, k, v."""
    seed, offset = _rng_placeholders(q.device, flash=False)
    d_bhsd, q_bhsd, k_bhsd, v_bhsd, out_bhsd = _backward_views(dout, q, k, v, out)
    res = ATEN._scaled_dot_product_efficient_attention_backward(
        d_bhsd,
        q_bhsd,
        k_bhsd,
        v_bhsd,
        None,  # attn_bias
        out_bhsd,
        pad_lse(lse_for_backward(lse)),
        seed,
        offset,
        0.0,
        [True, True, True, False],  # grad_input_mask: q, k, v, no bias
        causal,
        scale=scale,
    )
    return res[0].transpose(1, 2), res[1].transpose(1, 2), res[2].transpose(1, 2)


# ---------------------------------------------------------------------------------------------- flash varlen
CU_CACHE_SIZE = 64
"""How many (boundaries, device) pairs :func:`cu_seqlens` keeps on the device: documents change with
every batch, so only the recent ones (the ranks' steps and the backward repeat them) are worth keeping."""

_CU_CACHE: OrderedDict[tuple[tuple[int, ...], torch.device], torch.Tensor] = OrderedDict()
_CU_GRAPHS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_CU_LANDED: dict[tuple[tuple[int, ...], torch.device], tuple[Any, torch.Tensor]] = {}
"""Per cached CUDA entry: the event recorded after its upload, and its pinned source."""
_CU_LOCK = threading.Lock()  # LocalWorld ranks are threads sharing one backend


def cu_seqlens(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``cu`` as an int32 tensor on ``device``, uploaded once and then served from a small LRU cache.

    The upload never waits on the host: a copy from pageable memory would wait for the current stream
    (in a cooperative LocalWorld that stalls every virtual rank behind this one's kernels), so it goes
    from pinned memory, asynchronously, and an event recorded after it orders every later use: each use
    on a stream makes that stream wait for it (another virtual rank's stream read an entry unordered once:
    PyTorch's CUDA sanitizer caught the race), and records the stream (the allocator then waits for that
    work before reusing the memory of an evicted entry). One used during graph capture is kept for good:
    the graph reads its address at every replay; capture waits on no event recorded outside it, so warm
    up before capturing, as for any CUDA graph.
    """
    key = (cu, device)
    with _CU_LOCK:
        t = _CU_CACHE.get(key)
        if t is None:
            host = torch.tensor(cu, dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()
                t = host.to(device, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(torch.cuda.current_stream(t.device))
                _CU_LANDED[key] = (landed, host)  # the pinned source stays alive until the cache drops the entry
            else:
                t = host.to(device)
            _CU_CACHE[key] = t
            if len(_CU_CACHE) > CU_CACHE_SIZE:
                _CU_LANDED.pop(_CU_CACHE.popitem(last=False)[0], None)
        else:
            _CU_CACHE.move_to_end(key)
        if t.is_cuda:
            stream = torch.cuda.current_stream(t.device)
            if torch.cuda.is_current_stream_capturing():
                _CU_GRAPHS[key] = t
            else:
                landed_at = _CU_LANDED.get(key)
                if landed_at is not None:
                    stream.wait_event(landed_at[0])
                t.record_stream(stream)
    return t


def max_seqlen(cu: tuple[int, ...]) -> int:
    """The longest segment of cumulative boundaries ``cu``."""
    return max(b - a for a, b in zip(cu, cu[1:]))


def varlen_served(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> bool:
    """Whether the flash varlen op serves these segments: every one has queries or keys. Filler segments
    (:func:`xcp.documents.join_runs`) are served: on the H200 a segment without queries gives its keys dK = dV
    = 0 (``benchmarks/flash_empty_segments.py``), and the rows of a segment without keys come back out 0 and
    lse +inf, which :func:`flash_varlen_forward` turns into -inf."""
    return all(b > a or d > c for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))


def keyless_rows(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> bool:
    """Whether some segment has queries and no keys (a filler's rows, which flash leaves with lse +inf)."""
    return any(b > a and d == c for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))


def batch_cuts(cu: tuple[int, ...], length: int, batch: int) -> tuple[int, ...]:
    """The cumulative boundaries of ``cu`` (segments tiling ``length`` rows) repeated for each of ``batch``
    rows laid end to end: a batch of packed blocks as one packed block of ``batch * length`` rows."""
    return tuple(i * length + c for i in range(batch) for c in cu[:-1]) + (batch * length,)


def _window_sizes(window: tuple[int, int] | None) -> dict[str, int]:
    """The op's keyword arguments for a sliding window (both sides measured, as xcp's bands are, from
    each segment's bottom-right corner, which is where flash aligns its window)."""
    return {} if window is None else {"window_size_left": int(window[0]), "window_size_right": int(window[1])}


def _max_keys(cu_q: tuple[int, ...], cu_k: tuple[int, ...], window: tuple[int, int] | None) -> int:
    """``max_seqlen_k`` for the op. Flash turns a window side >= max_seqlen_k into unbounded and then
    into max_seqlen_k itself, measured from the bottom-right corner: for a segment with more queries than
    keys that bound cuts keys off its first rows (seen on the H200: the rows of a 300 x 81 band lost their
    last keys). An upper bound of at least every segment's query count keeps such a side unbounded in
    effect; the op reads the true lengths from the cumulative ones."""
    longest = max_seqlen(cu_k)
    return longest if window is None else max(longest, max_seqlen(cu_q))


def _varlen_lengths(
    device: torch.device, cu_q: tuple[int, ...], cu_k: tuple[int, ...], window: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The varlen ops' ``cum_seq_q, cum_seq_k, max_q, max_k``: the boundaries on ``device`` (cached) and
    the longest segment's queries and keys (see :func:`_max_keys`)."""
    return cu_seqlens(cu_q, device), cu_seqlens(cu_k, device), max_seqlen(cu_q), _max_keys(cu_q, cu_k, window)


def _packed_lse(lse: torch.Tensor, heads: int, total_q: int) -> torch.Tensor:
    """The varlen op's logsumexp, checked to be [H, total_q] (older flash kernels padded it per segment)."""
    if tuple(lse.shape) != (heads, total_q):
        raise RuntimeError(
            f"aten._flash_attention_forward: expected logsumexp [H, total_q] = {(heads, total_q)}; "
            f"got {tuple(lse.shape)} (torch {torch.__version__})"
        )
    return lse


def _causal_band(
    cu_k: tuple[int, ...], causal: bool, window: tuple[int, int] | None
) -> tuple[bool, tuple[int, int] | None]:
    """``(causal, window)`` for the op: a band ``(left, 0)`` whose left side reaches every segment's first key
    is the causal mask (both aligned at the bottom-right corner), which flash runs in its causal form; its
    windowed form checks both sides of every block (on the H200 a chunk of 4096 queries over 135K cached
    keys took 30.9 ms as a band, against 28.2 ms for the causal call)."""
    if window is not None and window[1] == 0 and window[0] >= max_seqlen(cu_k) - 1:
        return True, None
    return causal, window


def flash_varlen_forward(
    q, k, v, cu_q, cu_k, causal: bool, scale: float, window: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """aten flash varlen forward of packed segments (batch 1): out [1, Tq, H, D] in q's dtype and lse
    float32 [1, H, Tq]. K/V may be GQA; ``window`` a band ``(left, right)`` per segment."""
    banded = window is not None
    causal, window = _causal_band(cu_k, causal, window)
    res = ATEN._flash_attention_forward(
        q[0].contiguous(),
        k[0].contiguous(),
        v[0].contiguous(),
        *_varlen_lengths(q.device, cu_q, cu_k, window),
        0.0,
        causal,
        False,
        scale=scale,
        **_window_sizes(window),
    )
    out, lse = res[0], _packed_lse(res[1], q.shape[2], q.shape[1])
    if banded or keyless_rows(cu_q, cu_k):  # a row without keys comes back +inf (flash's empty row)
        lse = torch.where(lse == float("inf"), float("-inf"), lse)
    return out.unsqueeze(0), lse.unsqueeze(0)


def flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, window=None):
    """aten flash varlen backward from the merged out/lse: dq [1, Tq, H, D], dk, dv [1, Tk, Hkv, D]."""
    causal, window = _causal_band(cu_k, causal, window)
    seed, offset = _rng_placeholders(q.device, flash=True)
    dq, dk, dv = ATEN._flash_attention_backward(
        dout[0].to(q.dtype).contiguous(),
        q[0].contiguous(),
        k[0].contiguous(),
        v[0].contiguous(),
        out[0].to(q.dtype).contiguous(),
        lse_for_backward(lse[0]),
        *_varlen_lengths(q.device, cu_q, cu_k, window),
        0.0,
        causal,
        seed,  # rng_state: read only when dropout_p > 0, as in flash_backward
        offset,  # unused
        scale=scale,
        **_window_sizes(window),
    )
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


# ---------------------------------------------------------------------------------------------- flash range
def check_range_ends(lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor) -> None:
    """Raise unless ``lo`` and ``hi`` are int64 tensors of one element on k's device (their metadata
    alone: the host never reads their values, which may change between replays of a captured graph)."""
    for name, end in (("lo", lo), ("hi", hi)):
        if isinstance(end, torch.Tensor):
            if end.dtype == torch.int64 and end.numel() == 1 and end.device == k.device:
                continue
            got = f"a {end.dtype} tensor of shape {tuple(end.shape)} on {end.device}"
        else:
            got = type(end).__name__
        raise ValueError(f"{name}: expected an int64 tensor of one element on {k.device}; got {got}")


def range_lengths(
    batch: int, queries: int, room: int, lo: torch.Tensor, hi: torch.Tensor, launch: Launcher | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen op's ``cum_seq_q, cum_seq_k, seqused_k`` (int32) for ``batch`` rows of ``queries`` queries,
    each against keys lo..hi-1 of its own ``room`` rows of the packed storage: query segment i is rows
    [i*T, (i+1)*T), key segment i starts at i*room + lo and holds hi - lo keys.

    Made on lo's device alone, anew at every call: the host never reads lo or hi (no sync), and a graph that
    captured the call recomputes them from the values lo and hi hold at each replay. With ``launch`` one
    Triton kernel writes the three (allocated with ``torch.empty``); without, about seven torch ops do.
    """
    if launch is not None:
        cum_q = torch.empty(batch + 1, dtype=torch.int32, device=lo.device)
        cum_k = torch.empty(batch + 1, dtype=torch.int32, device=lo.device)
        used = torch.empty(batch, dtype=torch.int32, device=lo.device)
        block = min(RANGE_LENGTHS_BLOCK, 1 << batch.bit_length())  # >= batch + 1 up to the cap
        args = (lo, hi, cum_q, cum_k, used, batch, queries, room, block)
        launch("range_lengths", (-(-(batch + 1) // block),), args)
        return cum_q, cum_k, used
    steps = torch.arange(batch + 1, dtype=torch.int32, device=lo.device)
    lo32 = lo.reshape(1).to(torch.int32)
    cum_k = torch.add(lo32, steps, alpha=room)  # cum_seq_k[batch] is never read: seqused_k gives the lengths
    used = (hi.reshape(1) - lo.reshape(1)).to(torch.int32).expand(batch).contiguous()  # the op wants it dense
    return steps * queries, cum_k, used


RANGE_LENGTHS_BLOCK = 1024
"""The most (batch + 1) entries one program of the range-lengths kernel writes."""
RANGE_MAX_DIM = 256
"""The largest head_dim the blind-rows kernel serves (the flash op's own bound)."""


def fused_range_supported(q: torch.Tensor) -> bool:
    """True where the Triton kernels of :func:`flash_range_forward` apply: head_dim <= :data:`RANGE_MAX_DIM`
    (the flash op serves no more)."""
    return 1 <= q.shape[-1] <= RANGE_MAX_DIM


def blind_rows_(
    out: torch.Tensor, lse: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, launch: Launcher | None
) -> None:
    """In place on the varlen op's out [N, H, D] and lse [H, N]: every (row, head) whose lse is +inf (flash's
    rows without keys) or whose range is empty (hi <= lo, read on the device) gets lse -inf and out 0. With
    ``launch`` one Triton kernel (out's head_dim must have unit stride), without, about five torch ops."""
    if launch is None or out.stride(-1) != 1:
        blind = (lse == math.inf) | (hi.reshape(1) <= lo.reshape(1))  # [H, N]
        lse.masked_fill_(blind, -math.inf)  # both are the op's own fresh tensors
        out.masked_fill_(blind.transpose(0, 1).unsqueeze(-1), 0.0)
        return
    n, heads, dim = out.shape
    n_rows = n * heads
    if n_rows == 0:
        return
    block_d = 1 << (dim - 1).bit_length()
    block_r = max(1, 2048 // block_d)
    args = (
        out, lse, lo, hi,
        n_rows, heads, dim, out.stride(0), out.stride(1), *lse.stride(),
        block_r, block_d,
    )  # fmt: skip
    launch("range_blind", (-(-n_rows // block_r),), args)


def flash_range_forward(
    q, k, v, lo, hi, scale: float, launch: Launcher | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row against keys lo..hi-1 of the storage, in one aten flash varlen call: out [B, T, H, D]
    in q's dtype and lse float32 [B, H, T]. K/V may be GQA (read as they are).

    The batch is packed as varlen segments, one per batch row, whose key lengths (``seqused_k``) and starts
    live on the device. An empty range (lo == hi) comes back from flash with lse +inf: those rows, and any
    +inf row, get lse -inf and out exactly 0 through device ops, so nothing here waits for the device.
    With ``launch`` (a :class:`Launcher`; the backend passes its own only where triton is importable, its
    fused kernels are on and :func:`fused_range_supported` holds) the lengths and that fix are one Triton
    kernel each, so a call launches three kernels; without, a dozen tiny torch ops do the same, with the same
    results.
    """
    b, t, h, d = q.shape
    room, hkv = k.shape[1], k.shape[2]
    cum_q, cum_k, used = range_lengths(b, t, room, lo, hi, launch)
    res = ATEN._flash_attention_forward(
        q.contiguous().view(b * t, h, d),
        k.contiguous().view(b * room, hkv, d),
        v.contiguous().view(b * room, hkv, d),
        cum_q,
        cum_k,
        t,
        room,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=used,
    )
    out, lse = res[0], _packed_lse(res[1], h, b * t)
    blind_rows_(out, lse, lo, hi, launch)
    return out.reshape(b, t, h, d), lse.reshape(h, b, t).transpose(0, 1)


# ---------------------------------------------------------------------------------------------- flash paged
PAGED_BLOCK_MULTIPLE = 256
"""FlashAttention-2's paged form (the flash varlen op with ``block_table``) takes blocks whose size is a multiple
of 256 rows: ``mha_varlen_fwd`` in torch's ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``
checks ``page_block_size % 256 == 0`` ("Paged KV cache block size must be divisible by 256"), as flash-attn's
own ``csrc/flash_attn/flash_api.cpp`` does; it also requires v of k's head dim and shape."""


def paged_block_served(block_size: int) -> bool:
    """Whether the flash op's paged form takes blocks of ``block_size`` rows (:data:`PAGED_BLOCK_MULTIPLE`)."""
    return block_size > 0 and block_size % PAGED_BLOCK_MULTIPLE == 0


def flash_takes_block_table() -> bool:
    """Whether this torch's ``aten._flash_attention_forward`` has the paged form at all: torch 2.13's schema ends
    ``seqused_k, alibi_slopes, block_table, num_splits``; torch 2.11's (checked on an H100 with torch 2.11+cu130)
    ends ``seqused_k, alibi_slopes`` and refuses ``block_table`` as an unexpected keyword. Asked of the op
    itself (:func:`xcp.backends.fused.op_takes_argument`)."""
    return op_takes_argument(ATEN._flash_attention_forward, "block_table")


def flash_paged_forward(
    q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q: int, max_k: int, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries q [T, H, D] of B segments against the first ``seqused_k[i]`` rows of each segment's blocks
    of the pools [N, block_size, Hkv, D], in one aten flash varlen call with ``block_table``: the blocks read in
    place, GQA native, the lengths and the table on the device (nothing read on the host). Returns out [T, H, D]
    in q's dtype and lse float32 [H, T]; flash's rows without keys (lse +inf) come back 0 and -inf.

    Flash runs a call whose ``max_q`` is 1 under GQA with the query heads of a KV head as rows, reading q as one
    query per segment; a call with segments without queries (T != B) goes with ``max_q`` 2 (an upper bound
    still), which keeps that path off."""
    t, h, d = q.shape
    b = block_table.shape[0]
    if max_q == 1 and t != b:
        max_q = 2
    cum_k = torch.zeros(b + 1, dtype=torch.int32, device=q.device)  # not read: seqused_k gives the lengths
    res = ATEN._flash_attention_forward(
        q.contiguous(), k_pool, v_pool, cu_q, cum_k, max_q, max_k, 0.0, causal, False, scale=scale,
        seqused_k=seqused_k, block_table=block_table,
    )  # fmt: skip
    out, lse = res[0], _packed_lse(res[1], h, t)
    blind = lse == math.inf  # a segment without keys (seqused_k 0), or a causal row before its first key
    lse.masked_fill_(blind, -math.inf)  # both are the op's own fresh tensors
    out.masked_fill_(blind.transpose(0, 1).unsqueeze(-1), 0.0)
    return out, lse


# ---------------------------------------------------------------------------------------------- flash_attn
def flash_attn_forward(module: Any, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash-attn package's forward: out [B, Sq, H, D] in q's dtype, lse float32 [B, H, Sq]; GQA native."""
    with torch.no_grad():
        res = module.flash_attn_func(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
    return res[0], res[1][..., : q.shape[1]]


# ---------------------------------------------------------------------------------------------- GQA wrappers
def with_repeated_kv(forward_op):
    """A forward that takes GQA K/V by repeating them per query head (for kernels without GQA). The
    arguments after q, k, v (``causal, scale``, ``cu_q, cu_k, causal, scale`` or ``lo, hi, scale``) pass
    through."""

    def run(q, k, v, *args):
        groups = q.shape[2] // k.shape[2]
        return forward_op(q, repeat_kv(k, groups), repeat_kv(v, groups), *args)

    return run


def with_repeated_kv_backward(backward_op):
    """The backward matching :func:`with_repeated_kv`: repeat K/V, then sum dK/dV over each group."""

    def run(dout, q, k, v, out, lse, *args):
        groups = q.shape[2] // k.shape[2]
        dq, dk, dv = backward_op(dout, q, repeat_kv(k, groups), repeat_kv(v, groups), out, lse, *args)
        return dq, sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)

    return run


# ---------------------------------------------------------------------------------------------- value head dims
def common_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head dim a kernel that takes one (flash) runs q/k and v at: the larger of the two."""
    return max(q.shape[-1], v.shape[-1])


def with_common_head_dim(forward_op):
    """A forward for values of another head dim than q/k's, through a kernel that takes one head dim: the
    narrower side padded with zeros to the wider (zero channels of q and k add nothing to a score, and the
    scale is passed as it is; zero channels of v give zero channels of out, sliced off)."""

    def run(q, k, v, *args):
        width, dv = common_head_dim(q, v), v.shape[-1]
        out, lse = forward_op(*(widen_head_dim(x, width) for x in (q, k, v)), *args)
        return out[..., :dv], lse

    return run


def with_common_head_dim_backward(backward_op):
    """The backward matching :func:`with_common_head_dim`: dout and out padded like v (their zero channels
    add nothing to rowsum(dout * out)), the gradients sliced back to each input's own head dim."""

    def run(dout, q, k, v, out, lse, *args):
        width = common_head_dim(q, v)
        wide = (widen_head_dim(x, width) for x in (dout, q, k, v, out))
        dq, dk, dv = backward_op(*wide, lse, *args)
        return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]

    return run


# ---------------------------------------------------------------------------------------------- merge
def _triton_kernels() -> Any:
    """:mod:`xcp_cuda.merge_kernels`, imported at the first launch (it imports triton)."""
    return importlib.import_module("xcp_cuda.merge_kernels")


def _range_kernels() -> Any:
    """:mod:`xcp_cuda.range_kernels`, imported at the first launch (it imports triton)."""
    return importlib.import_module("xcp_cuda.range_kernels")


def _paged_kernels() -> Any:
    """:mod:`xcp_cuda.paged_kernels`, imported at the first launch (it imports triton)."""
    return importlib.import_module("xcp_cuda.paged_kernels")


BUILDERS: dict[str, Callable[[], Any]] = {
    "merge": lambda: _triton_kernels().merge_kernel,
    "pair": lambda: _triton_kernels().merge_pair_kernel,
    "add_pair": lambda: _triton_kernels().add_pair_kernel,
    "partials": lambda: _triton_kernels().merge_partials_kernel,
    "range_lengths": lambda: _range_kernels().range_lengths_kernel,
    "range_blind": lambda: _range_kernels().range_blind_rows_kernel,
    "paged_split": lambda: _paged_kernels().paged_decode_split_kernel,
    "paged_combine": lambda: _paged_kernels().paged_decode_combine_kernel,
}
"""The Triton kernels by name, each returned by a function called at its first launch."""
_CONSTEXPRS = {
    "merge": ("BLOCK_R", "BLOCK_D"),
    "pair": ("BLOCK_R", "BLOCK_D", "FRESH"),
    "add_pair": ("BLOCK_R", "BLOCK_D", "PAIR"),
    "partials": ("BLOCK_R", "BLOCK_D", "N_PARTS", "UNROLL", "LSE_WORDS"),
    "range_lengths": ("BLOCK",),
    "range_blind": ("BLOCK_R", "BLOCK_D"),
    "paged_split": ("GROUP", "BLOCK_G", "BLOCK_N", "BLOCK_D", "PAGE", "IEEE"),
    "paged_combine": ("BLOCK_S", "BLOCK_D"),
}
"""Each kernel's constexpr parameters, last in its launch arguments."""
_TENSORS = {
    "merge": 4,
    "pair": 6,
    "add_pair": 3,
    "partials": 4,
    "range_lengths": 5,
    "range_blind": 4,
    "paged_split": 8,
    "paged_combine": 5,
}
"""How many tensors each kernel's launch arguments start with."""


class Launcher:
    """Launches the Triton kernels of :data:`BUILDERS` and keeps what Triton compiled, per launch signature.

    Triton's ``kernel[grid](...)`` binds and specialises every argument on each call, about as long as the
    rest of a ring step's host work. A compiled kernel depends only on the argument values (ints equal to 1
    or divisible by 16 are specialised), the tensors' dtypes and the pointers' 16-byte alignment, so the
    key of :meth:`__call__`, which holds the ints exactly, never maps two launches that Triton would
    compile apart to one kernel; with ``fast``, a key seen before launches that kernel directly
    (``CompiledKernel[grid]``). The first launch of a key, a Triton that returns no compiled kernel, or
    ``fast=False`` take Triton's own path.

    :param fast: launch a signature seen before directly (the CUDA backend's ``fast_launch``, default from
        ``XCP_CUDA_FAST_LAUNCH``).
    :param builders: the kernels by name (default :data:`BUILDERS`; tests pass stand-ins).
    """

    def __init__(self, fast: bool = True, builders: dict[str, Callable[[], Any]] | None = None) -> None:
        self.fast = bool(fast)
        self.builders = dict(BUILDERS if builders is None else builders)
        self.jit: dict[str, Any] = {}
        """The kernels by name, built at their first launch."""
        self.compiled: dict[tuple, Any] = {}
        """The kernels as Triton compiled them, per launch signature."""

    def __call__(self, kind: str, grid: tuple[int, ...], args: tuple) -> None:
        """Launch the kernel ``kind`` (``merge``, ``pair``, ``add_pair``, ``partials``, ``range_lengths``,
        ``range_blind``, ``paged_split``, ``paged_combine``) on ``args`` over ``grid`` (one to three dims): its
        parameters in order, then its constexprs (the block sizes; FRESH for ``pair``, N_PARTS, UNROLL and
        LSE_WORDS for ``partials``, ...: :data:`_CONSTEXPRS`)."""
        n_tensors = _TENSORS[kind]
        tensors = args[:n_tensors]
        key = (
            kind,
            tensors[0].device.index,
            *(t.dtype for t in tensors),
            *(t.data_ptr() % 16 == 0 for t in tensors),
            *args[n_tensors:],
        )
        compiled = self.compiled.get(key) if self.fast else None
        if compiled is not None:
            compiled[(*grid, 1, 1)[:3]](*args)  # a compiled kernel takes the grid in three dims
            return
        kernel = self.jit.get(kind)
        if kernel is None:
            kernel = self.jit[kind] = self.builders[kind]()
        names = _CONSTEXPRS[kind]
        params, constexprs = args[: -len(names)], args[-len(names) :]
        compiled = kernel[grid](*params, **dict(zip(names, constexprs)))
        if self.fast and hasattr(compiled, "__getitem__") and len(self.compiled) < 1024:
            self.compiled[key] = compiled


LAUNCHER = Launcher()
"""The launcher of calls that name none (scripts calling these functions directly); a backend has its own."""


def _tiling(bsz: int, seq: int, heads: int, dim: int) -> tuple[int, tuple[int], int, int]:
    """How the row-wise kernels here cover [bsz, seq, heads, dim]: the number of (b, i, h) rows, the grid,
    the rows per program and the head_dim tile (the next power of 2)."""
    n_rows = bsz * seq * heads
    block_d = 1 << (dim - 1).bit_length()
    block_r = max(1, 4096 // block_d)
    return n_rows, (-(-n_rows // block_r),), block_r, block_d


def fused_merge_supported(out: torch.Tensor, block_out: torch.Tensor) -> bool:
    """True where the Triton kernel applies: fp32 accumulators, unit stride on head_dim, D <= 256."""
    return (
        out.dtype == torch.float32
        and out.stride(-1) == 1
        and block_out.stride(-1) == 1
        and out.shape[-1] <= 256
        and block_out.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def fused_merge_(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    rows: slice = slice(None),
    launch: Launcher | None = None,
) -> None:
    """In-place merge of (block_out, block_lse) into (out, lse) on query rows ``rows`` (one kernel)."""
    o = out[:, rows]
    lo = lse[:, :, rows]
    bsz, seq, heads, dim = o.shape
    if block_out.shape != o.shape or tuple(block_lse.shape) != (bsz, heads, seq):
        raise ValueError(
            f"block_out: expected shape {tuple(o.shape)} and block_lse {(bsz, heads, seq)}; "
            f"got {tuple(block_out.shape)} and {tuple(block_lse.shape)}"
        )
    block_lse = block_lse.float()
    n_rows, grid, block_r, block_d = _tiling(bsz, seq, heads, dim)
    args = (
        o, lo, block_out, block_lse,
        n_rows, seq, heads, dim,
        *o.stride()[:3], *lo.stride(), *block_out.stride()[:3], *block_lse.stride()[:3],
        block_r, block_d,
    )  # fmt: skip
    (launch or LAUNCHER)("merge", grid, args)


def fused_merge_pair_(
    out: torch.Tensor,
    lse: torch.Tensor,
    first: Block,
    second: Block,
    rows: slice,
    fresh: bool,
    launch: Launcher | None = None,
) -> None:
    """In-place merge of two blocks ``(block_out, block_lse)`` into (out, lse) on query rows ``rows`` in one
    kernel: the running output is read and written once for both (with ``fresh``, not read at all: out and lse
    are then written from the two blocks alone)."""
    o = out[:, rows]
    lo = lse[:, :, rows]
    bsz, seq, heads, dim = o.shape
    for name, (block_out, block_lse) in (("first", first), ("second", second)):
        if block_out.shape != o.shape or tuple(block_lse.shape) != (bsz, heads, seq):
            raise ValueError(
                f"{name}: expected block_out of shape {tuple(o.shape)} and block_lse {(bsz, heads, seq)}; "
                f"got {tuple(block_out.shape)} and {tuple(block_lse.shape)}"
            )
    a_out, a_lse = first[0], first[1].float()
    b_out, b_lse = second[0], second[1].float()
    n_rows, grid, block_r, block_d = _tiling(bsz, seq, heads, dim)
    args = (
        o, lo, a_out, a_lse, b_out, b_lse,
        n_rows, seq, heads, dim,
        *o.stride()[:3], *lo.stride(), *a_out.stride()[:3], *a_lse.stride()[:3], *b_out.stride()[:3],
        *b_lse.stride()[:3],
        block_r, block_d, int(bool(fresh)),
    )  # fmt: skip
    (launch or LAUNCHER)("pair", grid, args)


def fused_add_pair_supported(acc: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None = None) -> bool:
    """True where the add-pair kernel applies: a float32 [B, S, H, D] accumulator, addends of its shape (one
    or two), unit stride on head_dim, D <= 256."""
    return (
        acc.dtype == torch.float32
        and acc.dim() == 4
        and acc.shape[-1] <= 256
        and all(
            x.shape == acc.shape and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            for x in (first, second if second is not None else first)
        )
        and acc.stride(-1) == 1
    )


def fused_add_pair_(
    acc: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None, launch: Launcher | None = None
) -> None:
    """``acc += first + second`` in one kernel (the sum in float32): acc read and written once for two. With
    ``second`` None, ``acc += first``: torch's add of a 16-bit tensor into a float32 one takes its
    unvectorised mixed-dtype path (on the H200 about 2.3 TB/s), this kernel reads and writes each value once."""
    bsz, seq, heads, dim = acc.shape
    n_rows, grid, block_r, block_d = _tiling(bsz, seq, heads, dim)
    pair = second is not None
    other = second if second is not None else first  # not read without a pair
    args = (
        acc, first, other,
        n_rows, seq, heads, dim,
        *acc.stride()[:3], *first.stride()[:3], *other.stride()[:3],
        block_r, block_d, int(pair),
    )  # fmt: skip
    (launch or LAUNCHER)("add_pair", grid, args)


PARTIALS_MAX_DIM = 1024
"""The largest head_dim the partials merge serves (one program holds BLOCK_R x next_pow2(D) floats)."""
PARTIALS_MIN_PROGRAMS = 256
"""The partials merge halves its rows per program until it has at least this many programs (or one row
each): a decode step's few rows (B * H) would otherwise leave most of the GPU's SMs idle."""
PARTIALS_TILE = 2048
"""Values of a program's tile in the partials merge (BLOCK_R x BLOCK_D, at least one row)."""
PARTIALS_IN_FLIGHT = 32
"""Loads of out values per thread that the partials merge keeps in flight (the partials unrolled together
times the tile's values per thread). With this tile and bound, ptxas -v for sm90 (Triton 3.6 and 3.9) shows
no spill at any head_dim or P; a 4096 tile or 64 in flight spill at some."""
_THREADS = 128
"""Threads of a program: Triton's default four warps."""


@functools.cache
def triton_importable() -> bool:
    """Whether triton can be imported here (asked once)."""
    return importlib.util.find_spec("triton") is not None


def partials_tiling(n_rows: int, dim: int, parts: int) -> tuple[tuple[int], int, int, int]:
    """How the partials merge covers ``n_rows`` rows of ``dim`` values from ``parts`` partials: the grid, the
    rows per program (:data:`PARTIALS_TILE` values, fewer rows where the grid would have fewer than
    :data:`PARTIALS_MIN_PROGRAMS` programs), the head_dim tile (the next power of 2), and how many partials
    are unrolled together (their loads in flight at once, :data:`PARTIALS_IN_FLIGHT` a thread)."""
    block_d = 1 << (dim - 1).bit_length()
    block_r = max(1, PARTIALS_TILE // block_d)
    while block_r > 1 and -(-n_rows // block_r) < PARTIALS_MIN_PROGRAMS:
        block_r //= 2
    per_thread = max(1, block_r * block_d // _THREADS)
    unroll = max(1, min(parts, PARTIALS_IN_FLIGHT // per_thread))
    return (-(-n_rows // block_r),), block_r, block_d, unroll


PARTIALS_16BIT = (torch.bfloat16, torch.float16)
"""The 16-bit dtypes of the packing [P, B, T, H, D + 2]: outs in that dtype, the float32 lse in the last two."""


def partials_lse_words(out: torch.Tensor, parts: torch.Tensor) -> int:
    """How many channels of ``parts`` hold each partial's lse where the partials kernel serves (out, parts):
    1 for float32 parts [P, B, T, H, D + 1], 2 for bfloat16/float16 parts [P, B, T, H, D + 2] (D even, the
    float32 lse's bits in channels D and D + 1); 0 where it does not serve them."""
    if (
        out.dtype != torch.float32
        or out.dim() != 4
        or parts.dim() != 5
        or tuple(parts.shape[1:4]) != tuple(out.shape[:3])
        or not 1 <= out.shape[3] <= PARTIALS_MAX_DIM
        or parts.device != out.device
        or not out.is_contiguous()
        or not parts.is_contiguous()
    ):
        return 0
    dim = out.shape[3]
    if parts.dtype == torch.float32 and parts.shape[4] == dim + 1:
        return 1
    if (
        parts.dtype in PARTIALS_16BIT
        and dim % 2 == 0
        and parts.shape[4] == dim + 2
        and parts.storage_offset() % 2 == 0  # viewable as float32
    ):
        return 2
    return 0


def fused_merge_partials_supported(out: torch.Tensor, parts: torch.Tensor) -> bool:
    """True where the partials kernel applies: float32 out [B, T, H, D] and, on its device, parts
    [P, B, T, H, D + 1] float32 or [P, B, T, H, D + 2] bfloat16/float16 with D even (the lse's float32 bits in
    the last two channels); both contiguous, 1 <= D <= :data:`PARTIALS_MAX_DIM` (float64 and the rest: the
    eager merge)."""
    return partials_lse_words(out, parts) > 0


def fused_merge_partials_(out: torch.Tensor, parts: torch.Tensor, launch: Launcher | None = None) -> torch.Tensor:
    """Merge P ranks' packed partials ``parts`` into ``out`` [B, T, H, D] (float32, contiguous, written whole)
    in one kernel on the current stream; return the merged lse [B, H, T] (float32, contiguous, allocated here
    with ``torch.empty``: nothing else is allocated and the host reads nothing from the device, so a CUDA
    graph can capture it). Rows no rank saw get out 0 and lse -inf. ``parts`` (contiguous) is either
    [P, B, T, H, D + 1] float32, rank r's out in ``[..., :D]`` and its lse in ``[..., D]``, or
    [P, B, T, H, D + 2] bfloat16/float16 (D even), rank r's out in ``[..., :D]`` and its float32 lse bit for
    bit in ``[..., D:]`` (``parts[..., D:].view(torch.float32)[..., 0]``); outs are summed in float32."""
    words = partials_lse_words(out, parts)
    if not words:
        raise ValueError(
            f"out, parts: expected float32 contiguous out [B, T, H, D] (1 <= D <= {PARTIALS_MAX_DIM}) and "
            f"contiguous parts on its device, [P, B, T, H, D + 1] float32 or [P, B, T, H, D + 2] bfloat16/float16 "
            f"with D even; got out {tuple(out.shape)} {out.dtype} and parts {tuple(parts.shape)} {parts.dtype}"
        )
    bsz, seq, heads, dim = out.shape
    lse = torch.empty((bsz, heads, seq), dtype=torch.float32, device=out.device)
    n_rows = bsz * seq * heads
    if n_rows == 0:
        return lse
    grid, block_r, block_d, unroll = partials_tiling(n_rows, dim, parts.shape[0])
    lses = parts if words == 1 else parts.view(torch.float32)  # rows of (D + 2) / 2, the lse at column D / 2
    args = (
        out, lse, parts, lses,
        n_rows, seq, heads, dim, parts.stride(0), lses.stride(0),
        *lse.stride(),
        block_r, block_d, parts.shape[0], unroll, words,
    )  # fmt: skip
    (launch or LAUNCHER)("partials", grid, args)
    return lse
