"""The Backend contract: everything the core needs that differs by device, in three groups.

required device primitives  identity (``name``, ``device_type``, ``dist_backend``, ``handoff_policy``,
                            ``kernel``, ``dtypes``, ``masks``, ``available``), streams and events, ``label``,
                            the block ``forward`` / ``backward``: what the ring runs on. ``forward`` and
                            ``backward`` have no default (a class without them is refused at registration);
                            the rest default to torch's device module.
optional fast paths         ``whole_attention``, ``forward_varlen`` / ``backward_varlen``, ``forward_range``,
                            ``forward_paged`` / ``paged_in_place``,
                            ``fused_merge_``, ``fused_merge_pair_``, ``fused_add_``, ``fused_add_pair_``,
                            ``fused_merge_partials_``, ``folds_pairs``, ``varlen_fillers``,
                            ``recurrent_kernels``: the
                            defaults are correct (not served, or one block call per segment), only slower.
tool hooks                  ``new_graph``, ``capture_graph``, ``memory_stats``, ``reset_peak_memory``,
                            ``settings``: used by the CLI, the bench and the tests, never by the ring.

:data:`REQUIRED_PRIMITIVES`, :data:`FAST_PATHS` and :data:`TOOL_HOOKS` name the members of each group.
What to do with the primitives (when to wait, how to hand a tensor to another stream, when to merge) is the
core's business (:mod:`xcp.ring`, :mod:`xcp.lifetime`); the core calls nothing device-specific except
through a backend. Stream and event defaults come from ``torch.get_device_module(device_type)``, which
serves any device that follows torch's accelerator conventions (cuda, npu, xpu, ...), so a backend for such
a device overrides only what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels.math import SCORE_MODS, Alibi, math_backward, math_forward, math_forward_paged, math_forward_range
from ..kernels.merge import NEG_INF, accumulator_dtype
from ..kernels.recurrent import RecurrentKernel
from ..lifetime import HANDOFF_POLICIES
from ..schedule import MASKS
from ..settings import Setting

REQUIRED_PRIMITIVES = (
    "name", "device_type", "dist_backend", "handoff_policy", "kernel", "dtypes", "masks", "value_head_dims",
    "score_mods", "poll_comm_waits", "available",
    "current_stream", "new_stream", "stream_context", "new_event", "record_event", "wait_event", "wait_stream",
    "synchronize_event", "synchronize", "set_device", "is_capturing", "record_stream", "label",
    "forward", "backward",
)  # fmt: skip
"""What every backend gives (``forward`` and ``backward`` without a default: see :func:`required`)."""

FAST_PATHS = (
    "whole_attention", "forward_varlen", "backward_varlen", "forward_range", "forward_paged", "paged_in_place",
    "fused_merge_", "fused_merge_pair_", "fused_add_", "fused_add_pair_", "fused_merge_partials_", "folds_pairs",
    "varlen_fillers", "recurrent_kernels",
)  # fmt: skip
"""What a backend may override to run faster; the defaults are correct."""

TOOL_HOOKS = ("new_graph", "capture_graph", "memory_stats", "reset_peak_memory", "settings")
"""What the tools (``xcp bench``, ``xcp backends``, the conformance suite) use and the ring never does."""

Block = tuple[Tensor, Tensor]
"""One block's ``(out, lse)``: out [B, Sq, H, D], lse [B, H, Sq]."""
Cuts = tuple[int, ...]
"""Cumulative boundaries of packed segments, from 0 to the total length (see :meth:`Backend.forward_varlen`)."""
Band = tuple[int, int] | None
"""A sliding window ``(left, right)`` of packed segments, or None (see :meth:`Backend.forward_varlen`)."""

_REQUIRED = "__xcp_required__"


def required(method: Callable) -> Callable:
    """Mark ``method`` as one every concrete backend class must define (checked at registration)."""
    setattr(method, _REQUIRED, True)
    return method


def missing_methods(cls: type) -> list[str]:
    """The required methods that ``cls`` (a Backend subclass) leaves undefined, sorted."""
    return sorted(name for name in dir(cls) if getattr(getattr(cls, name, None), _REQUIRED, False))


def _segments(cu_q: Sequence[int], cu_k: Sequence[int]) -> Iterator[tuple[slice, slice]]:
    """The (query rows, key rows) of each packed segment."""
    for i in range(len(cu_q) - 1):
        yield slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])


def score_mods(softcap: float | None, alibi: Alibi | None) -> dict[str, Any]:
    """The keyword arguments of a block kernel call for these score modifications: none where there are
    none, so a backend that serves none (``Backend.score_mods`` empty) is called as it always was."""
    mods: dict[str, Any] = {}
    if softcap is not None:
        mods["softcap"] = softcap
    if alibi is not None:
        mods["alibi"] = alibi
    return mods


def _per_segment(
    kernel: Callable[..., tuple[torch.Tensor, ...]],
    banded: Callable[..., tuple[torch.Tensor, ...]],
    args: Callable[[slice, slice], tuple[torch.Tensor, ...]],
    empty: Callable[[slice, slice], tuple[torch.Tensor, ...]],
    cu_q: Sequence[int],
    cu_k: Sequence[int],
    causal: bool,
    scale: float,
    window: tuple[int, int] | None,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """The results of one call per packed segment: ``kernel(*args(rows, keys), mask, scale)``, or the math
    kernel ``banded(*args(...), "none", scale, window)`` under a window (no block mask serves a band). A
    filler segment (no queries, or no keys: :func:`xcp.documents.join_runs`) calls nothing: ``empty(rows,
    keys)`` gives its results. ``softcap`` and ``alibi`` (the whole call's rows) go to each segment's call."""
    mask = "causal" if causal else "none"
    parts = []
    for qs, ks in _segments(cu_q, cu_k):
        if qs.start == qs.stop or ks.start == ks.stop:
            parts.append(empty(qs, ks))
            continue
        mods = score_mods(softcap, None if alibi is None else alibi.rows(qs, ks))
        if window is not None:
            parts.append(banded(*args(qs, ks), "none", scale, window, **mods))
        else:
            parts.append(kernel(*args(qs, ks), mask, scale, **mods))
    return parts


def segments_forward(
    backend: Backend, q: Tensor, k: Tensor, v: Tensor, cu_q: Cuts, cu_k: Cuts, causal: bool, scale: float,
    window: Band = None, **mods: Any,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:meth:`Backend.forward_varlen` by one ``backend.forward`` call per segment (the math kernel under a
    window), the score modifications ``mods`` passed to each for its rows."""

    def banded(*args: Any, **mods: Any) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = math_forward(*args, **mods)
        return (o.to(q.dtype) if q.dtype != torch.float64 else o), lse

    def unseen(qs: slice, ks: slice) -> tuple[torch.Tensor, torch.Tensor]:  # rows of no key: out 0, lse -inf
        n = qs.stop - qs.start
        lse = torch.full((q.shape[0], q.shape[2], n), NEG_INF, dtype=accumulator_dtype(q.dtype), device=q.device)
        return q.new_zeros((q.shape[0], n, q.shape[2], v.shape[3])), lse

    parts = _per_segment(
        backend.forward, banded, lambda qs, ks: (q[:, qs], k[:, ks], v[:, ks]), unseen, cu_q, cu_k, causal, scale,
        window, **mods,
    )  # fmt: skip
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=2)


def segments_backward(
    backend: Backend, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Cuts,
    cu_k: Cuts, causal: bool, scale: float, window: Band = None, **mods: Any,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """:meth:`Backend.backward_varlen` by one ``backend.backward`` call per segment, as
    :func:`segments_forward`."""

    def args(qs: slice, ks: slice) -> tuple[torch.Tensor, ...]:
        return dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs]

    def nothing(qs: slice, ks: slice) -> tuple[torch.Tensor, ...]:  # a filler's rows and keys: gradient 0
        return tuple(x.new_zeros((x.shape[0], s.stop - s.start, *x.shape[2:])) for x, s in zip((q, k, v), (qs, ks, ks)))

    parts = _per_segment(backend.backward, math_backward, args, nothing, cu_q, cu_k, causal, scale, window, **mods)
    dq, dk, dv = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    return dq, dk, dv


def varlen_forward(
    backend: Backend, q: Tensor, k: Tensor, v: Tensor, cu_q: Cuts, cu_k: Cuts, causal: bool, scale: float,
    window: Band = None, **mods: Any,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ring's packed call: the backend's :meth:`Backend.forward_varlen` (``window`` passed only where
    given, as a backend written before windows expects), or with score modifications :func:`segments_forward`."""
    if mods:
        return segments_forward(backend, q, k, v, cu_q, cu_k, causal, scale, window, **mods)
    if window is None:
        return backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale)
    return backend.forward_varlen(q, k, v, cu_q, cu_k, causal, scale, window=window)


def varlen_backward(
    backend: Backend, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Cuts,
    cu_k: Cuts, causal: bool, scale: float, window: Band = None, **mods: Any,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward of :func:`varlen_forward`."""
    if mods:
        return segments_backward(backend, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window, **mods)
    if window is None:
        return backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    return backend.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=window)


def _math_range(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float, **mods: Any):
    out, lse = math_forward_range(q, k, v, lo, hi, scale, **mods)
    return (out.to(q.dtype) if q.dtype != torch.float64 else out), lse


def range_forward(
    backend: Backend, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float, **mods: Any
) -> tuple[Tensor, Tensor]:
    """A decode step's range call: the backend's :meth:`Backend.forward_range`, or with score modifications
    the math kernel's (on the device, the host reading neither end)."""
    if mods:
        return _math_range(q, k, v, lo, hi, scale, **mods)
    return backend.forward_range(q, k, v, lo, hi, scale)


class Backend:
    """Base class of every backend: the three groups of the module docstring.

    Required device primitives
        Identity: ``name`` (what users pass as ``device=``), ``device_type`` (torch's device type of its
        tensors), ``dist_backend`` (the torch.distributed backend for its collectives), ``handoff_policy``
        (the default hand-off), ``kernel`` (a short description of the block kernels that run, for
        ``xcp backends``), ``dtypes`` (the dtypes its kernel serves), ``masks`` (the block masks it serves;
        the ring needs ``none`` always and ``causal`` for causal attention; it runs stripe's strictly causal
        blocks as causal calls on shifted views, so ``strict`` serves direct callers), ``value_head_dims``
        (whether its kernels take values of another head dim than q and k, as multi-head latent attention
        has: out and dv then in v's dim; False, the default, makes such a call a ValueError before any
        kernel runs), ``score_mods`` (the score modifications its kernels serve: soft-capping, ALiBi; none by
        default), ``poll_comm_waits`` (whether a wait on its process group's work that ``timeout=`` /
        ``XCP_TIMEOUT`` bounds polls ``work.is_completed()`` against the deadline, for process groups whose
        ``work.wait(timeout)`` does not raise when the timeout passes; False, the default, passes the timeout
        to ``wait``), :meth:`available`. Then streams and events, and the
        block :meth:`forward` / :meth:`backward`, which every subclass defines.
    Optional fast paths
        ``folds_pairs``: whether :meth:`fused_merge_pair_` and :meth:`fused_add_pair_` may fold two blocks
        at once; only then does the ring hold a block for the next (which costs one block's output). The
        methods of this group return a "not served" answer (False, None) or run the block kernel per
        segment by default.
    Tool hooks
        ``settings``: the :class:`xcp.settings.Setting` objects the backend reads when it is built (its
        ``XCP_*`` variables), for ``xcp backends --settings``; graphs and memory statistics.

    Every backend must accept grouped-query K/V (``H % Hkv == 0``) and strided (non-contiguous) views
    along the sequence, which is what the ring passes; :func:`check_backend` validates the identity and
    ``xcp.testing`` checks the rest.
    """

    # ================================================================== required device primitives
    name: str = "base"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    handoff_policy: str = "event"
    kernel: str = "none"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    masks: tuple[str, ...] = MASKS
    value_head_dims: bool = False
    score_mods: tuple[str, ...] = ()
    """The score modifications its kernels serve, of :data:`xcp.kernels.math.SCORE_MODS`: ``softcap``
    (logit soft-capping) and ``alibi``. A backend that names one takes it as a keyword argument of its
    block :meth:`forward` and :meth:`backward` (``softcap=`` a float > 0, ``alibi=`` an
    :class:`xcp.kernels.math.Alibi`, the global positions of the block's rows), passed only where the call
    has it; a call that needs one the backend does not name is refused before any kernel runs. Packed calls
    with a modification go segment by segment through those two (:func:`varlen_forward`), a storage range
    through the math kernel (:func:`range_forward`): the fast paths keep their signatures."""
    poll_comm_waits: bool = False

    # ------------------------------------------------------------------ identity
    def available(self) -> tuple[bool, str]:
        """Whether the backend can run here: ``(True, "")`` or ``(False, reason)``."""
        return True, ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({self.device_type}, {self.dist_backend})>"

    # ------------------------------------------------------------------ streams and events
    def _module(self) -> Any:
        return torch.get_device_module(self.device_type)

    def current_stream(self, device: torch.device | None = None) -> Any:
        """The stream work is issued on now (the caller's stream C)."""
        return self._module().current_stream(device)

    def new_stream(self, device: torch.device | None = None) -> Any:
        """A new side stream on ``device`` (compute X or comm M)."""
        return self._module().Stream(device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context in which ``stream`` is the current stream."""
        return self._module().stream(stream)

    def new_event(self) -> Any:
        """A new event, to be recorded on one stream and waited for on another."""
        return self._module().Event()

    def record_event(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``: it completes when the work issued there so far does."""
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``."""
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Make later work on ``stream`` wait for the work issued on ``other`` so far."""
        stream.wait_stream(other)

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        event.synchronize()

    def synchronize(self, device: torch.device | None = None) -> None:
        """Block the host until all work issued on ``device`` has completed."""
        sync = getattr(self._module(), "synchronize", None)
        if sync is not None:
            sync(device)

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process (one device per rank under torchrun)."""
        setter = getattr(self._module(), "set_device", None)
        if setter is not None and device.index is not None:
            setter(device)

    def is_capturing(self) -> bool:
        """True while the current stream is being captured into a graph (never, where the device has no
        graphs)."""
        capturing = getattr(self._module(), "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` reads ``tensor``: its memory is not reused before that work."""
        tensor.record_stream(stream)

    def label(self, text: str) -> contextlib.AbstractContextManager:
        """A context naming the device work issued inside (profilers, the simulated device); default none."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ block kernel
    @required
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one block.

        :param q: queries [B, Sq, H, D].
        :param k: keys [B, Sk, Hkv, D], H % Hkv == 0.
        :param v: values [B, Sk, Hkv, D].
        :param mask: ``none``, ``causal`` (query i sees keys 0..i) or ``strict`` (keys 0..i-1).
        :param scale: the factor applied to q·k.
        :returns: ``(out, lse)``: out [B, Sq, H, D] in q's dtype or float32, zeros on rows that see no
            key; lse [B, H, Sq] float32 (float64 for float64 inputs), -inf on such rows.
        """
        raise NotImplementedError(f"backend {self.name!r} has no forward kernel")

    @required
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: str, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one block given the *merged* output and log-sum-exp of the whole row.

        :param dout: gradient of the output [B, Sq, H, D].
        :param out: the final (merged) output [B, Sq, H, D].
        :param lse: the final (merged) log-sum-exp [B, H, Sq].
        :returns: ``(dq, dk, dv)`` shaped like q, k, v, in their dtype or float32.
        """
        raise NotImplementedError(f"backend {self.name!r} has no backward kernel")

    # ================================================================== optional fast paths
    folds_pairs: bool = False
    varlen_fillers: bool = False
    """Whether :meth:`forward_varlen` / :meth:`backward_varlen` serve filler segments, without queries or
    without keys (a row of no key gets out 0 and lse -inf, and dq 0; a key of no row dk = dv = 0): then the
    ring joins a step's runs of full segments across the rows between them into one call
    (:func:`xcp.documents.join_runs`). The default loop serves them; a backend that overrides the two with
    a kernel says True only where that kernel does."""

    def whole_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> torch.Tensor | None:
        """The attention of a world of one (no documents, window or sinks) through the vendor's own
        differentiable front end, or None (the default) to let xcp run :meth:`forward` / :meth:`backward`
        under its autograd Function.

        A world of one is what a model with context parallelism off runs, so it should cost nothing over
        the vendor's fused attention: a front end whose backward is native (no Python on the backward
        path) costs less host time per call than any wrapper can.

        :param q: [B, S, H, D]; ``k``, ``v`` [B, S, Hkv, D], Hkv dividing H (GQA).
        :param causal: square causal (query i sees keys 0..i) or no mask.
        :param scale: the factor on q·k.
        :returns: out [B, S, H, D] in q's dtype, differentiable in q, k and v like the inputs are; or None.
        """
        return None

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Cuts, cu_k: Cuts, causal: bool, scale: float, window: Band = None
    ) -> tuple[Tensor, Tensor]:
        """Attention of packed segments (documents): segment i is queries ``[cu_q[i], cu_q[i + 1])``
        against keys ``[cu_k[i], cu_k[i + 1])``, no mask, or square causal when ``causal`` (then
        ``cu_q == cu_k``). The segments tile q and k (batch 1) without gaps. Where :attr:`varlen_fillers` is
        True, unmasked calls may hold filler segments, without queries or without keys.

        :param window: a sliding window ``(left, right)`` (ints >= 0, only with ``causal=False``) aligned,
            as flash kernels align theirs, to each segment's bottom-right corner: query m of a segment of
            sq queries and sk keys sees keys ``m + sk - sq - left .. m + sk - sq + right``. The ring only
            asks for bands in which every query sees at least one key.
        :returns: ``(out, lse)`` shaped and typed as :meth:`forward`'s. The default makes one
            :meth:`forward` call per segment (the math kernel for a window); a backend with a varlen
            kernel overrides it.
        """
        return segments_forward(self, q, k, v, cu_q, cu_k, causal, scale, window)

    def backward_varlen(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Cuts, cu_k: Cuts,
        causal: bool, scale: float, window: Band = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients of packed segments (see :meth:`forward_varlen`) from the merged out and lse.

        :returns: ``(dq, dk, dv)`` shaped like q, k, v. The default makes one :meth:`backward` call per
            segment (the math kernel for a window); a backend with a varlen kernel overrides it.
        """
        return segments_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)

    def forward_range(
        self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        """Attention of every query row against the keys of one storage range whose ends live on the device:
        what a KV cache's decode step runs (:class:`xcp.KVCache` with ``capacity``), captured once into a
        device graph and replayed while the range grows, so the host must never read ``lo`` or ``hi``.

        :param q: queries [B, T, H, D].
        :param k: the cache's key storage [B, room, Hkv, D] (contiguous; rows outside the range hold stale or
            zeroed tokens, finite), H % Hkv == 0.
        :param v: the value storage, as k.
        :param lo: int64 tensor of one element on k's device: the first key row every query sees.
        :param hi: int64 tensor of one element: one past the last; ``0 <= lo <= hi <= room``. ``lo == hi``
            is an empty range: out 0 and lse -inf on every row, never NaN.
        :param scale: the factor on q·k.
        :returns: ``(out, lse)`` shaped and typed as :meth:`forward`'s. The default runs the math kernel over
            the whole storage under a mask built on the device (correct, reads every row of the room); a
            backend with a kernel that takes lengths on the device (flash's ``seqused_k``) overrides it.
        """
        return _math_range(q, k, v, lo, hi, scale)

    def forward_paged(
        self, q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, cu_q: Tensor, seqused_k: Tensor,
        max_q: int, max_k: int, scale: float, causal: bool = False,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Packed queries of B segments, each against the first ``seqused_k[i]`` key rows of its blocks in a
        paged KV pool: a paged cache's local partial (:class:`xcp.PagedKVCache`), whose lengths and block
        tables live on the device so that a decode step can be captured once and replayed.

        :param q: [T, H, D], packed (THD), contiguous; segment i's queries are rows ``cu_q[i] .. cu_q[i+1]-1``.
        :param k_pool: the key pool [N, block_size, Hkv, D], H % Hkv == 0 (GQA: read as it is, never repeated).
        :param v_pool: the value pool [N, block_size, Hkv, Dv] (possibly a view of k_pool's first Dv channels).
        :param block_table: int32 [B, max_blocks] on q's device: segment i's key row j is row ``j % block_size``
            of block ``block_table[i, j // block_size]``; entries past its blocks hold any valid block index.
        :param cu_q: int32 [B + 1] on the device, 0 .. T.
        :param seqused_k: int32 [B] on the device: segment i sees its first ``seqused_k[i]`` key rows; 0 gives
            its rows out 0 and lse -inf, never NaN.
        :param max_q: host int >= every segment's query count; ``max_k``: host int >= every ``seqused_k[i]``
            and <= ``max_blocks * block_size`` (bounds fixed at capture: the host never reads the lengths; an
            op that takes them only as host lists may read them where nothing is captured, and under
            :meth:`is_capturing` returns this default).
        :param causal: False: every query of a segment sees all its keys; True: bottom-right aligned, query m
            of a segment of sq queries and sk keys sees keys ``0 .. sk - sq + m``.
        :returns: ``(out [T, H, Dv], lse [H, T])``: out in q's dtype (or float32), lse float32 (float64 for
            float64), natural log. The default gathers every segment's blocks (``[B, max_k]`` rows: a copy) and
            runs the math kernel under masks made on the device: correct and capturable, not fast; a backend
            whose kernel reads the blocks in place overrides it and says so in :meth:`paged_in_place`."""
        out, lse = math_forward_paged(q, k_pool, v_pool, block_table, cu_q, seqused_k, max_q, max_k, scale, causal)
        return (out.to(q.dtype) if q.dtype != torch.float64 else out), lse

    def paged_in_place(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, max_q: int | None = None) -> bool:
        """Whether :meth:`forward_paged` reads these pools in place for queries like ``q`` (its own kernel, no
        copy of any block): for every call (``max_q`` None), or for calls of at most ``max_q`` queries per segment
        (a paged cache asks ``max_q=1`` for its decode rows where the answer for every call is False). False (the
        default): a paged cache gathers each sequence's blocks once itself on the host-planned path, and calls
        :meth:`forward_paged` only where the lengths must stay on the device. An override written without
        ``max_q`` is asked for every call only."""
        return False

    def fused_merge_(
        self, out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice
    ) -> bool:
        """Fold a block into the running (out, lse) with a fused kernel, if the backend has one that serves
        these tensors; return False to let the ring use its generic merge (the default)."""
        return False

    def fused_merge_pair_(
        self, out: torch.Tensor, lse: torch.Tensor, first: Block, second: Block, rows: slice, fresh: bool
    ) -> bool:
        """Fold two blocks of the same query rows into the running (out, lse) in one pass over them, if the
        backend has a kernel that serves these tensors; return False (the default) to let the ring fold
        the blocks one at a time from then on.

        :param first: ``(block_out, block_lse)`` of the earlier block; ``second`` of the later one.
        :param rows: the query rows both blocks cover.
        :param fresh: True when ``out`` and ``lse`` hold nothing yet (uninitialised memory, every row covered
            by ``rows``): the result is the two blocks' merge alone, and nothing of ``out`` may be read.
        :returns: True when the blocks were folded in.
        """
        return False

    def fused_add_(self, acc: torch.Tensor, grad: torch.Tensor) -> bool:
        """``acc += grad`` (the backward's additions of a block's dQ, dK or dV into a float32 or float64
        accumulator, a view of its rows) in one kernel, if the backend has one that serves these tensors;
        return False (the default) to let the ring add them with torch.

        :returns: True when ``grad`` was added.
        """
        return False

    def fused_add_pair_(self, acc: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
        """``acc += first + second`` in one pass over ``acc`` (the backward's dQ accumulator, a view of its
        rows, float32 or float64; ``first`` and ``second`` two blocks' dQ of those rows), if the backend has a
        kernel that serves these tensors; return False (the default) to let the ring add one at a time from
        then on.

        :returns: True when both were added.
        """
        return False

    def fused_merge_partials_(self, out: torch.Tensor, parts: torch.Tensor) -> torch.Tensor | None:
        """Merge P ranks' packed partials into ``out`` in one pass over them, if the backend has a kernel that
        serves these tensors (a KV cache's combine, :class:`xcp.KVCache`); return None (the default) to let
        the core merge eagerly.

        :param out: [B, T, H, D], float32 or float64, contiguous, written whole: ``sum_r exp(L_r - L) O_r``.
        :param parts: contiguous, laid out as :func:`xcp.kernels.merge.packed_layout` says: [P, B, T, H, D + 1]
            in out's dtype, rank r's out in ``[..., :D]`` and its natural-log lse in ``[..., D]``; or, for
            bfloat16/float16 inputs, [P, B, T, H, D + 2] in that dtype, the float32 lse's bits in the last
            two channels (:func:`xcp.kernels.merge.packed_lse` reads them); -inf where rank r saw nothing
            of the row (weight 0).
        :returns: the merged lse [B, H, T] (``L = logsumexp_r L_r``; -inf, with out 0, on rows no rank saw,
            never NaN), or None when not served.
        """
        return None

    def recurrent_kernels(self) -> dict[str, RecurrentKernel]:
        """The chunk kernels this backend runs recurrent layers with, by recurrence
        (:data:`xcp.kernels.recurrent.RECURRENCES`: name -> the kernel's convention); a recurrence left out
        runs the models' own torch kernel (:func:`xcp.recurrent.recurrent_kernel`). Called when a kernel is
        looked up: import the vendor package here, lazily, and leave out what it lacks. Default: none."""
        return {}

    # ================================================================== tool hooks
    settings: tuple[Setting, ...] = ()
    """The ``XCP_*`` variables this backend reads (when it is built; constructor arguments override them),
    each declared in the backend's own package; ``xcp backends --settings`` lists them."""

    def new_graph(self) -> Any | None:
        """A new device graph to capture work into (see :meth:`capture_graph`), or None where the backend
        has no graphs (the default)."""
        return None

    def capture_graph(self, graph: Any) -> contextlib.AbstractContextManager:
        """A context that captures the work issued on the current stream into ``graph`` (``graph.replay()``
        runs it again), including work other threads issue on streams that wait for it (``xcp bench
        --replay`` captures every virtual rank of a LocalWorld, each a thread, into one graph)."""
        raise NotImplementedError(f"backend {self.name!r} has no device graphs")

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        """Allocator statistics in bytes (``allocated``, ``peak``) where the device has them, else None.

        The default reads ``memory_allocated`` / ``max_memory_allocated`` of the device module.
        """
        module = self._module()
        allocated = getattr(module, "memory_allocated", None)
        peak = getattr(module, "max_memory_allocated", None)
        if allocated is None or peak is None:
            return None
        return {"allocated": int(allocated(device)), "peak": int(peak(device))}

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Reset the allocator's peak counter to what is allocated now, where the device has one."""
        reset = getattr(self._module(), "reset_peak_memory_stats", None)
        if reset is not None:
            reset(device)


class NullStream:
    """A stream for devices without asynchrony: every operation runs at once, in program order."""

    def __init__(self, name: str = "cpu") -> None:
        self.name = name

    def wait_event(self, event: Any) -> None:  # noqa: D102 - nothing to wait for
        pass

    def wait_stream(self, other: Any) -> None:  # noqa: D102
        pass

    def __repr__(self) -> str:
        return f"<NullStream {self.name}>"


class NullEvent:
    """An event that is complete as soon as it is recorded."""

    def record(self, stream: Any = None) -> None:  # noqa: D102
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def query(self) -> bool:  # noqa: D102
        return True


class SynchronousBackend(Backend):
    """Base for backends whose device runs everything in program order (the CPU): no-op streams."""

    handoff_policy = "none"
    _stream = NullStream()

    def current_stream(self, device: torch.device | None = None) -> Any:
        return self._stream

    def new_stream(self, device: torch.device | None = None) -> Any:
        return self._stream

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        return NullEvent()

    def record_event(self, event: Any, stream: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def synchronize_event(self, event: Any) -> None:
        pass

    def synchronize(self, device: torch.device | None = None) -> None:
        pass

    def is_capturing(self) -> bool:
        return False

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass  # no allocator to tell: memory is reusable as soon as the host drops it

    def set_device(self, device: torch.device) -> None:
        pass

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int] | None:
        return None

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        pass


_IDENTITY_STRINGS = ("name", "device_type", "dist_backend", "kernel")


def check_backend(backend: Any) -> Backend:
    """Return ``backend`` if it is a :class:`Backend` with a well-formed identity, else raise a TypeError
    or ValueError naming the attribute, what was expected and what it holds.

    Called on every backend a plugin registers, so a malformed one is reported with its plugin's name
    instead of failing later inside the ring.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: expected an instance of xcp.Backend; got {type(backend).__name__}")
    missing = missing_methods(type(backend))
    if missing:
        raise TypeError(f"backend class {type(backend).__name__} lacks the required methods {', '.join(missing)}")
    for attr in _IDENTITY_STRINGS:
        value = getattr(backend, attr)
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"backend.{attr}: expected a non-empty str; got {value!r}")
    if any(c in backend.name for c in ": \t\n"):
        raise ValueError(f"backend.name: expected a name without ':' or spaces; got {backend.name!r}")
    if backend.handoff_policy not in HANDOFF_POLICIES:
        raise ValueError(
            f"backend.handoff_policy: expected one of {', '.join(HANDOFF_POLICIES)}; got {backend.handoff_policy!r}"
        )
    dtypes = backend.dtypes
    if (
        not isinstance(dtypes, Sequence)
        or not dtypes
        or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes)
    ):
        raise TypeError(f"backend.dtypes: expected a non-empty tuple of floating torch dtypes; got {dtypes!r}")
    masks = backend.masks
    if not isinstance(masks, Sequence) or "none" not in masks or any(m not in MASKS for m in masks):
        raise ValueError(f"backend.masks: expected a tuple of {', '.join(MASKS)} that includes 'none'; got {masks!r}")
    for flag in ("value_head_dims", "poll_comm_waits"):
        if not isinstance(getattr(backend, flag), bool):
            raise TypeError(f"backend.{flag}: expected a bool; got {getattr(backend, flag)!r}")
    mods = backend.score_mods
    if not isinstance(mods, Sequence) or isinstance(mods, str) or any(m not in SCORE_MODS for m in mods):
        raise ValueError(f"backend.score_mods: expected a tuple of some of {', '.join(SCORE_MODS)}; got {mods!r}")
    return backend


def add_into(backend: Backend, acc: torch.Tensor, grad: torch.Tensor) -> None:
    """``acc += grad`` in place on the view ``acc`` (no write-back through __setitem__): the backend's kernel
    (:meth:`Backend.fused_add_`) where it has one for these tensors, else torch's add."""
    if not backend.fused_add_(acc, grad):
        acc.add_(grad)
