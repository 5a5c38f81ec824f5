"""The CUDA backend: PyTorch's fused attention ops (cuDNN, flash, memory-efficient) with their log-sum-exp,
torch.cuda streams, NCCL.

Importing this module touches no GPU and imports no vendor package: the device is first queried by
:meth:`CUDABackend.available` or by a kernel call, and flash-attn is imported at the first block that
could use it (once; a failed import is remembered and the aten ops serve instead).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from xcp.backends.base import add_into
from xcp.backends.fused import FusedKernelBackend, backward_as_causal
from xcp.kernels.math import math_backward, math_forward
from xcp.kernels.recurrent import RecurrentKernel
from xcp.settings import Setting

from . import kernels, paged, recurrent
from . import settings as cuda_settings


def _given(value: bool | None, setting: Setting, default: bool | None = None) -> bool:
    """A constructor argument, else its setting's value (``default`` where the variable is unset)."""
    return bool(setting.read(default)) if value is None else bool(value)


_GET_STREAM: Any = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM: Any = getattr(torch._C, "_cuda_setStream", None)
_GET_DEVICE: Any = getattr(torch._C, "_cuda_getDevice", None)
"""torch's own C calls behind ``torch.cuda.current_stream`` / ``set_stream`` (None in a torch without them)."""


class _StreamSwitch:
    """Make ``stream`` current on its device for a ``with`` block, then restore that device's previous one."""

    __slots__ = ("stream", "previous", "device")

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        s = self.stream
        self.device = _GET_DEVICE()  # setting a stream makes its device current: put the caller's back after
        self.previous = _GET_STREAM(s.device_index)  # (stream_id, device_index, device_type)
        _SET_STREAM(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return s

    def __exit__(self, *exc: Any) -> None:
        stream_id, device_index, device_type = self.previous
        _SET_STREAM(stream_id=stream_id, device_index=device_index, device_type=device_type)
        if device_index != self.device:
            torch.cuda.set_device(self.device)


FUSED_ADD_MIN_VALUES = 1 << 25
"""The fewest values of an addition the Triton add takes. On the H200 (``benchmarks/accumulate_probe.py``) it
beat torch's add from 2^25 values (8192 rows x 32 heads x 128: 113 against 128 µs; x 192: 162 against 191)
and tied or lost below (8192 x 8 heads x 128: 58 against 41 µs)."""

CAUSAL_BACKWARD_MIN = 8192
"""The fewest rows of the squares an unmasked block's backward is cut into before it runs as causal calls."""


PAGED_FLASH, PAGED_TRITON, PAGED_GATHER = "flash", "triton", "gather"
"""The kernels of :meth:`CUDABackend.forward_paged`: flash's paged form, xcp's Triton paged decode
(:mod:`xcp_cuda.paged`), the base class's gather and math."""


def _one_row(x: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] as one batch row [1, B * S, ...] (a copy where the rows are strided)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


class CUDABackend(FusedKernelBackend):
    """NVIDIA GPUs (any device torch calls ``cuda``).

    Kernel per block, by :meth:`block_kernel`: fp16/bf16 with head_dim % 8 == 0 and <= 256 (sm80+) run on the
    aten cuDNN op where torch's SDPA would run the block on cuDNN (on Hopper 1.7-1.9x faster than the flash
    op), else on the aten flash op (the flash-attn package's forward instead when it is installed); the
    aten memory-efficient op serves fp32 and the other aligned head dims, the math kernel the rest (float64,
    unaligned head dims). Masks beyond none / square causal are cut by the base class. Packed documents
    (:meth:`forward_varlen`) take one call of the aten flash varlen op where the flash op serves the block,
    else one block call per segment (the base class); so does a KV cache's storage range given on the device
    (:meth:`forward_range`), else the base class's math kernel over the whole room. A world of one runs torch's SDPA
    (:meth:`whole_attention`). Each argument left at None takes its ``XCP_CUDA_*`` setting
    (:mod:`xcp_cuda.settings`), read here.

    :param gqa: ``native`` (default) or ``repeat``, see :data:`xcp.backends.fused.GQA_MODES`.
    :param use_flash_attn: use flash-attn's forward when importable (default True).
    :param use_cudnn: run blocks on cuDNN where SDPA would (default True; ``torch.nn.attention.sdpa_kernel``
        without ``CUDNN_ATTENTION`` turns it off too).
    :param fused_merge: merge blocks with the one-pass Triton kernel, and a KV cache's P ranks' partials with
        another (:meth:`fused_merge_partials_`; default: where triton is installed).
    :param pair_merge: with ``fused_merge``, fold two blocks (and add two dQ) at once (default True).
    :param fast_launch: launch a Triton kernel seen before directly (default True; see
        :class:`xcp_cuda.kernels.Launcher`).
    :param causal_backward: run the backward of an unmasked cuDNN block whose values have another head dim
        (multi-head latent attention's 192/128) as causal calls (:func:`xcp.backends.fused.backward_as_causal`)
        where its squares have at least :data:`CAUSAL_BACKWARD_MIN` rows (default True).
    :param use_fla: run recurrent layers on fla's Triton kernels where fla is installed
        (:meth:`recurrent_kernels`, :mod:`xcp_cuda.recurrent`; default True).
    :param triton_decode: which kernel runs a paged decode call (:meth:`paged_kernel`): ``auto``, ``triton``
        or ``off`` (default: the Triton kernel has run only under Triton's interpreter so far), see
        :data:`xcp_cuda.settings.TRITON_DECODE`.
    """

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    handoff_policy = "record_stream"
    kernel = (
        "fp16/bf16: aten cuDNN where SDPA picks it, else aten flash (flash-attn's fwd if installed) | "
        "fp32: mem-efficient | float64, odd head dims: math | one rank: torch SDPA | "
        "paged decode: flash's paged form (block_table), else xcp's Triton paged decode"
    )
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    value_head_dims = True  # cuDNN and efficient take them; flash calls run padded (kernels.with_common_head_dim)
    varlen_fillers = True  # the flash varlen op serves segments without queries or keys (kernels.varlen_served)
    gqa_setting = cuda_settings.GQA
    settings = cuda_settings.ALL

    def __init__(
        self,
        gqa: str | None = None,
        use_flash_attn: bool | None = None,
        use_cudnn: bool | None = None,
        fused_merge: bool | None = None,
        pair_merge: bool | None = None,
        fast_launch: bool | None = None,
        causal_backward: bool | None = None,
        use_fla: bool | None = None,
        triton_decode: str | None = None,
    ) -> None:
        super().__init__(gqa)
        self.use_fla = _given(use_fla, cuda_settings.FLA)
        self.use_flash_attn = _given(use_flash_attn, cuda_settings.FLASH_ATTN)
        self.use_cudnn = _given(use_cudnn, cuda_settings.CUDNN)
        triton = importlib.util.find_spec("triton") is not None
        self.fused_merge = _given(fused_merge, cuda_settings.FUSED_MERGE, triton)
        self.folds_pairs = self.fused_merge and _given(pair_merge, cuda_settings.PAIR_MERGE)
        self.launcher = kernels.Launcher(fast=_given(fast_launch, cuda_settings.FAST_LAUNCH))
        self.causal_backward = _given(causal_backward, cuda_settings.CAUSAL_BACKWARD)
        self.triton_decode = cuda_settings.TRITON_DECODE.read() if triton_decode is None else triton_decode
        if self.triton_decode not in cuda_settings.TRITON_DECODES:
            raise ValueError(f"triton_decode: expected one of {', '.join(cuda_settings.TRITON_DECODES)}; got "
                             f"{self.triton_decode!r}")  # fmt: skip
        self._cudnn_blocks: dict[tuple, bool] = {}  # block signature -> SDPA's answer (asked once each)
        self._flash_attn: Any = None
        self._flash_attn_error: str | None = None
        self._capabilities: dict[int, tuple[int, int]] = {}
        self._streams: dict[tuple, Any] = {}  # current_stream's Stream objects, by (stream_id, device, type)

    def recurrent_kernels(self) -> dict[str, RecurrentKernel]:
        """fla's Triton chunk kernels where fla is installed (:func:`xcp_cuda.recurrent.fla_kernels`), else none."""
        return recurrent.fla_kernels() if self.use_fla else {}

    # ------------------------------------------------------------------ identity
    def available(self) -> tuple[bool, str]:
        """(True, "") when a CUDA device is visible; otherwise the reason. Never raises."""
        try:
            if torch.cuda.is_available():
                return True, ""
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                return False, f"no CUDA device: torch {torch.__version__} was built without CUDA"
            return False, "no CUDA device: torch.cuda.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - a broken driver must not break discovery
            return False, f"no CUDA device: querying CUDA raised {type(exc).__name__}: {exc}"

    def stream_context(self, stream: Any) -> Any:
        """``stream`` current for the block, like ``torch.cuda.stream(stream)`` at a fraction of its host
        cost (a ring switches to its comm stream once or twice per step): the current stream is read and
        restored through the two C calls ``torch.cuda.current_stream`` / ``set_stream`` themselves use."""
        if _GET_STREAM is None or _SET_STREAM is None or _GET_DEVICE is None:
            return torch.cuda.stream(stream)
        return _StreamSwitch(stream)

    def current_stream(self, device: Any = None) -> Any:
        """``torch.cuda.current_stream(device)``, its Stream objects kept per stream: torch builds a new
        one and normalises the device on every call, several times a ring step's cost of this lookup."""
        if _GET_STREAM is None or _GET_DEVICE is None:
            return torch.cuda.current_stream(device)
        if device is None:
            index = _GET_DEVICE()
        elif isinstance(device, torch.device) and device.type == "cuda":
            index = _GET_DEVICE() if device.index is None else device.index
        else:
            return torch.cuda.current_stream(device)
        key = _GET_STREAM(index)  # (stream_id, device_index, device_type), as torch.cuda.current_stream reads it
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= 1024:  # streams made and dropped by a caller: never grow without bound
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def is_capturing(self) -> bool:
        """True while the current CUDA stream is being captured into a CUDA graph."""
        return torch.cuda.is_current_stream_capturing()

    def new_graph(self) -> Any:
        """A CUDA graph (``torch.cuda.CUDAGraph``)."""
        return torch.cuda.CUDAGraph()

    def capture_graph(self, graph: Any) -> Any:
        """``torch.cuda.graph(graph)``: capture on a side stream the context makes current, in the
        ``thread_local`` error mode: the capturing thread is still checked for calls a capture forbids, while
        other threads may issue work onto streams that joined the capture (a LocalWorld's virtual ranks, which
        ``xcp bench --replay`` captures into one graph); the default ``global`` mode would fail their calls."""
        return torch.cuda.graph(graph, capture_error_mode="thread_local")

    # ------------------------------------------------------------------ memory
    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        """Bytes held by tensors now (``allocated``) and at most since the last reset (``peak``)."""
        return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    # ------------------------------------------------------------------ block kernel
    def fused_merge_(self, out, lse, block_out, block_lse, rows) -> bool:
        """One Triton kernel where it applies (fp32 accumulators); False lets the ring merge eagerly."""
        if self.fused_merge and kernels.fused_merge_supported(out, block_out):
            kernels.fused_merge_(out, lse, block_out, block_lse, rows, self.launcher)
            return True
        return False

    def fused_merge_pair_(self, out, lse, first, second, rows, fresh) -> bool:
        """Both blocks in one Triton kernel where it applies (fp32 accumulators); False lets the ring fold
        them one at a time."""
        if self.folds_pairs and all(kernels.fused_merge_supported(out, block[0]) for block in (first, second)):
            kernels.fused_merge_pair_(out, lse, first, second, rows, fresh, self.launcher)
            return True
        return False

    def fused_add_pair_(self, acc, first, second) -> bool:
        """Both additions in one Triton kernel where it applies (a float32 accumulator); False lets the ring
        add one at a time."""
        if self.folds_pairs and kernels.fused_add_pair_supported(acc, first, second):
            kernels.fused_add_pair_(acc, first, second, self.launcher)
            return True
        return False

    def fused_add_(self, acc, grad) -> bool:
        """One Triton kernel where it applies (a float32 [B, S, H, D] ``acc`` of at least
        :data:`FUSED_ADD_MIN_VALUES` values, unit stride on head_dim, D <= 256): torch's add of a 16-bit tensor
        into a float32 one takes its unvectorised mixed-dtype path. False lets the ring add with torch."""
        if (
            self.fused_merge
            and acc.is_cuda
            and acc.numel() >= FUSED_ADD_MIN_VALUES
            and kernels.fused_add_pair_supported(acc, grad)
        ):
            kernels.fused_add_pair_(acc, grad, None, self.launcher)
            return True
        return False

    def fused_merge_partials_(self, out, parts):
        """A KV cache's P-way merge of packed partials in one Triton kernel where it applies: contiguous CUDA
        tensors, a float32 ``out`` [B, T, H, D] with head_dim <= :data:`kernels.PARTIALS_MAX_DIM`, and
        ``parts`` either [P, B, T, H, D + 1] float32 (lse in channel D) or [P, B, T, H, D + 2] bfloat16/float16
        with D even (the float32 lse's bits in channels D, D + 1); ``fused_merge`` on and triton importable.
        Returns the merged lse [B, H, T]; else None, and the cache merges eagerly (float64 among others)."""
        if (
            self.fused_merge
            and out.is_cuda
            and kernels.fused_merge_partials_supported(out, parts)
            and kernels.triton_importable()
        ):
            return kernels.fused_merge_partials_(out, parts, self.launcher)
        return None

    def kernel_for(self, q: torch.Tensor, v: torch.Tensor | None = None) -> str:
        """The aten kernel that serves blocks shaped and typed like ``q`` (and values like ``v``: flash takes
        one head dim) on its device."""
        value_dim = None if v is None else v.shape[-1]
        return kernels.choose_kernel(q.dtype, q.shape[-1], self._capability(q.device), value_dim)

    def block_kernel(self, q: torch.Tensor, k: torch.Tensor, causal: bool, v: torch.Tensor | None = None) -> str:
        """The kernel of one square-or-unmasked block: :meth:`kernel_for`, with ``flash`` upgraded to
        ``cudnn`` where torch's SDPA would run this block on cuDNN (asked once per block signature); values
        of another head dim, which flash does not take, go to cuDNN where SDPA would, else ``efficient``."""
        kind = self.kernel_for(q, v)
        other_dim = v is not None and v.shape[-1] != q.shape[-1]
        upgradable = kind == kernels.FLASH or (other_dim and kind == kernels.EFFICIENT)
        if not upgradable or not self.use_cudnn or not torch.backends.cuda.cudnn_sdp_enabled():
            return kind
        key = (q.device, q.dtype, *q.shape, k.shape[1], k.shape[2], causal, None if v is None else v.shape[-1])
        cudnn = self._cudnn_blocks.get(key)
        if cudnn is None:
            if len(self._cudnn_blocks) >= 4096:  # shapes are few in practice; never grow without bound
                self._cudnn_blocks.clear()
            cudnn = self._cudnn_blocks[key] = kernels.sdpa_picks_cudnn(q, k, causal, v)
        return kernels.CUDNN if cudnn else kind

    # ------------------------------------------------------------------ internals
    def _capability(self, device: torch.device) -> tuple[int, int]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._capabilities:
            major, minor = torch.cuda.get_device_capability(index)
            self._capabilities[index] = (major, minor)
        return self._capabilities[index]

    def flash_attn_module(self) -> Any:
        """The flash_attn module when enabled and importable, else None (the import is tried once)."""
        if not self.use_flash_attn:
            return None
        if self._flash_attn is None and self._flash_attn_error is None:
            try:
                module = importlib.import_module("flash_attn")
                module.flash_attn_func  # noqa: B018 - the one entry point used
                self._flash_attn = module
            except Exception as exc:  # noqa: BLE001 - any failure means: use the aten ops
                self._flash_attn_error = f"{type(exc).__name__}: {exc}"
        return self._flash_attn

    def square_forward(self, q, k, v, causal: bool, scale: float):
        kind = self.block_kernel(q, k, causal, v)
        if kind == kernels.MATH:
            return math_forward(q, k, v, "causal" if causal else "none", scale)
        if kind == kernels.CUDNN:
            op = kernels.cudnn_forward
        elif kind == kernels.FLASH:
            module = self.flash_attn_module()
            op = kernels.flash_forward if module is None else functools.partial(kernels.flash_attn_forward, module)
        else:
            op = kernels.efficient_forward
        if self.kv_groups(q, k, kernels.native_gqa(kind)) > 1:
            op = kernels.with_repeated_kv(op)
        return op(q, k, v, causal, scale)

    def square_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        kind = self.block_kernel(q, k, causal, v)
        if kind == kernels.MATH:
            return math_backward(dout, q, k, v, out, lse, "causal" if causal else "none", scale)
        op = {kernels.CUDNN: kernels.cudnn_backward, kernels.FLASH: kernels.flash_backward}.get(
            kind, kernels.efficient_backward
        )
        if self.kv_groups(q, k, kernels.native_gqa(kind)) > 1:
            op = kernels.with_repeated_kv_backward(op)
        if self._backward_as_causal(kind, q, k, v, causal):
            return backward_as_causal(op, dout, q, k, v, out, lse, scale, functools.partial(add_into, self))
        return op(dout, q, k, v, out, lse, causal, scale)

    def _backward_as_causal(self, kind: str, q, k, v, causal: bool) -> bool:
        """Whether an unmasked block's backward runs as causal calls: cuDNN, values of another head dim, squares
        of at least :data:`CAUSAL_BACKWARD_MIN` rows, and ``causal_backward`` on. On the H200 at q/k 192, v 128,
        32 heads: 9.3 against 11.6 ms for 8192 x 8192, 32.0 against 45.3 ms for 16384 x 16384, reversals
        included (``benchmarks/mla_masks.py``); at equal head dims the two forms cost alike per pair."""
        return (
            self.causal_backward
            and not causal
            and kind == kernels.CUDNN
            and v.shape[-1] != q.shape[-1]
            and min(q.shape[1], k.shape[1]) >= CAUSAL_BACKWARD_MIN
        )

    def whole_attention(self, q, k, v, causal: bool, scale: float):
        """torch SDPA (its own choice of kernel, cuDNN on Hopper; its backward native), where the
        block kernel would be one of the fused ones; None for the math kernel's cases and ``repeat`` GQA."""
        if self.kernel_for(q, v) == kernels.MATH or (self.gqa == "repeat" and q.shape[2] != k.shape[2]):
            return None
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )  # fmt: skip
        return out.transpose(1, 2).contiguous()

    def varlen_kernel(
        self, q: torch.Tensor, cu_q: tuple[int, ...], cu_k: tuple[int, ...], v: torch.Tensor | None = None
    ) -> bool:
        """Whether packed segments like these take one aten flash varlen call: the flash op serves q at the
        head dim q/k and v run at (:func:`kernels.common_head_dim`: values of another head dim are padded,
        as no varlen kernel takes two) and every segment has queries or keys. A batch of B > 1 rows goes
        as one packed block of B times the segments (:func:`kernels.batch_cuts`), so its segments must tile
        q's rows from 0 to the end."""
        width = q.shape[-1] if v is None else kernels.common_head_dim(q, v)
        kind = kernels.choose_kernel(q.dtype, width, self._capability(q.device))
        if kind != kernels.FLASH or not kernels.varlen_served(cu_q, cu_k):
            return False
        return q.shape[0] == 1 or (cu_q[0] == 0 and cu_q[-1] == q.shape[1] and cu_k[0] == 0)

    def forward_varlen(self, q, k, v, cu_q, cu_k, causal: bool, scale: float, window=None):
        """One flash varlen call for all segments (of every batch row) where it serves them (a window too:
        the op's window_size_left/right; values of another head dim padded to the common one), else one
        call per segment (the base class)."""
        op = self._varlen_op(q, k, v, cu_q, cu_k, backward=False)
        if op is None:
            return super().forward_varlen(q, k, v, cu_q, cu_k, causal, scale, window)
        b, sq, h, _ = q.shape
        if b == 1:
            return op(q, k, v, cu_q, cu_k, causal, scale, window)
        cuts = kernels.batch_cuts(cu_q, sq, b), kernels.batch_cuts(cu_k, k.shape[1], b)
        out, lse = op(_one_row(q), _one_row(k), _one_row(v), *cuts, causal, scale, window)
        return out.reshape(b, sq, h, out.shape[3]), lse.view(h, b, sq).transpose(0, 1).contiguous()

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, window=None):
        """One flash varlen backward from the merged out/lse where it serves, else one call per segment."""
        op = self._varlen_op(q, k, v, cu_q, cu_k, backward=True)
        if op is None:
            return super().backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
        b, sq, h, _ = q.shape
        if b == 1:
            return op(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
        cuts = kernels.batch_cuts(cu_q, sq, b), kernels.batch_cuts(cu_k, k.shape[1], b)
        lse_row = lse.transpose(0, 1).reshape(1, h, b * sq)
        rows = _one_row(dout), _one_row(q), _one_row(k), _one_row(v), _one_row(out)
        grads = op(*rows, lse_row, *cuts, causal, scale, window)
        return tuple(g.reshape(b, -1, *g.shape[2:]) for g in grads)

    def _varlen_op(self, q, k, v, cu_q, cu_k, backward: bool):
        """The flash varlen op, forward or backward, that :meth:`forward_varlen` and :meth:`backward_varlen`
        call for these tensors: wrapped to repeat K/V heads (``gqa="repeat"``) and to pad values of another head
        dim to the common one. None where it does not serve them (then the base class's one call per
        segment): :meth:`varlen_kernel` says no, or a batch of rows whose keys are not all of k's rows."""
        if not self.varlen_kernel(q, cu_q, cu_k, v) or (q.shape[0] > 1 and cu_k[-1] != k.shape[1]):
            return None
        op: Callable[..., Any]
        repeated: Callable[[Callable[..., Any]], Callable[..., Any]]
        common: Callable[[Callable[..., Any]], Callable[..., Any]]
        if backward:
            op, repeated, common = (
                kernels.flash_varlen_backward,
                kernels.with_repeated_kv_backward,
                kernels.with_common_head_dim_backward,
            )
        else:
            op, repeated, common = kernels.flash_varlen_forward, kernels.with_repeated_kv, kernels.with_common_head_dim
        if self.kv_groups(q, k) > 1:
            op = repeated(op)
        if v.shape[-1] != q.shape[-1]:
            op = common(op)
        return op

    def forward_range(self, q, k, v, lo, hi, scale: float):
        """One flash varlen call where the flash op serves q (:func:`kernels.flash_range_forward`: each batch
        row a segment whose key start and length are computed on the device from lo and hi, GQA native; with
        the fused kernels on, three launches a call: :meth:`_range_launcher`),
        else the base class (the math kernel over the whole room under a mask built on the device). The
        choice depends on q's dtype, head dim and GPU alone, never on lo or hi, so a captured graph replays
        the same kernels whatever the range."""
        kernels.check_range_ends(lo, hi, k)
        if self.kernel_for(q, v) != kernels.FLASH:  # values of another head dim too: padding the storage per step
            return super().forward_range(q, k, v, lo, hi, scale)  # would copy the cache; the masked math reads it
        op = kernels.flash_range_forward
        if self.kv_groups(q, k) > 1:  # gqa="repeat": the storage repeated per query head
            op = kernels.with_repeated_kv(op)
        return op(q, k, v, lo, hi, scale, self._range_launcher(q))

    def paged_in_place(self, q, k_pool, v_pool, max_q: int | None = None) -> bool:
        """Whether :meth:`forward_paged` reads these pools in place for every call (``max_q`` None: chunks of many
        queries too; where flash's paged form serves them, :meth:`_flash_paged`), or for calls of at most ``max_q``
        queries per segment (:meth:`paged_kernel` names flash's paged form or the Triton paged decode)."""
        if max_q is None:
            return self._flash_paged(q, k_pool, v_pool)
        return self.paged_kernel(q, k_pool, v_pool, max_q) != PAGED_GATHER

    def _flash_paged(self, q, k_pool, v_pool) -> bool:
        """Whether flash's paged form serves these pools: the flash op serves q (fp16/bf16, head dim a multiple of
        8 up to 256, sm80+), v has q's head dim, the blocks hold a multiple of 256 rows
        (:data:`kernels.PAGED_BLOCK_MULTIPLE`), GQA is native (``gqa="repeat"`` would copy the pool) and this
        torch's flash op has the paged form (:func:`kernels.flash_takes_block_table`: torch 2.11's has not)."""
        if q.dim() != 3 or k_pool.dim() != 4 or v_pool.dim() != 4 or not kernels.flash_takes_block_table():
            return False
        native = self.gqa == "native" or q.shape[1] == k_pool.shape[2]
        return (
            native
            and v_pool.shape[-1] == q.shape[-1] == k_pool.shape[-1]
            and k_pool.stride(-1) == 1
            and v_pool.stride(-1) == 1
            and kernels.paged_block_served(k_pool.shape[1])
            and self.kernel_for(q, v_pool) == kernels.FLASH
        )

    def _triton_decode_serves(self, q, k_pool, v_pool) -> bool:
        """Whether xcp's Triton paged decode (:mod:`xcp_cuda.paged`) serves these tensors: triton importable, q
        on this backend's device type, an sm80+ GPU, and :func:`paged.unsupported` finds nothing (bf16, fp16 or
        fp32; one head dim up to 256; GQA read as it is, whatever ``gqa`` says: nothing is repeated)."""
        return (
            q.device.type == self.device_type
            and kernels.triton_importable()
            and paged.unsupported(q, k_pool, v_pool) is None
            and self._capability(q.device) >= (8, 0)
        )

    def paged_kernel(self, q, k_pool, v_pool, max_q: int) -> str:
        """The kernel :meth:`forward_paged` runs for a call like this: ``flash`` (flash's paged form), ``triton``
        (xcp's Triton paged decode, for one query per segment, ``max_q == 1``) or ``gather`` (the base class's
        gather and math). With ``triton_decode="auto"`` a decode call takes flash's paged form where it serves,
        else the Triton kernel where that serves; ``triton``: the Triton kernel first; ``off``: never it. A
        function of shapes, dtypes, the GPU and ``max_q`` alone (never of the lengths or the tables), so a captured
        graph replays the same kernels whatever they hold."""
        flash = self._flash_paged(q, k_pool, v_pool)
        decode = max_q == 1 and self.triton_decode != "off" and not (flash and self.triton_decode == "auto")
        if decode and self._triton_decode_serves(q, k_pool, v_pool):
            return PAGED_TRITON
        return PAGED_FLASH if flash else PAGED_GATHER

    def forward_paged(self, q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal=False):
        """The kernel :meth:`paged_kernel` names: one aten flash varlen call with ``block_table`` and ``seqused_k``
        (:func:`kernels.flash_paged_forward`), or two Triton launches (:func:`paged.paged_decode`: any block size;
        causal or not alike, one query seeing all its keys); both read the blocks in place, GQA native, nothing
        read on the host, capturable. Else the base class's gather and math."""
        kind = self.paged_kernel(q, k_pool, v_pool, max_q)
        if kind == PAGED_TRITON:
            return paged.paged_decode(q, k_pool, v_pool, block_table, cu_q, seqused_k, max_k, scale, self.launcher)
        if kind == PAGED_GATHER:
            return super().forward_paged(q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal)
        return kernels.flash_paged_forward(q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale,
                                           causal)  # fmt: skip

    def _range_launcher(self, q: torch.Tensor) -> kernels.Launcher | None:
        """The launcher of :func:`kernels.flash_range_forward`'s two Triton kernels (its lengths and its empty
        rows' fix, in place of a dozen tiny torch ops): this backend's own where ``fused_merge`` is on, triton
        importable, q on this backend's device type and its head dim served; else None (the torch ops)."""
        if (
            self.fused_merge
            and q.device.type == self.device_type
            and kernels.fused_range_supported(q)
            and kernels.triton_importable()
        ):
            return self.launcher
        return None
