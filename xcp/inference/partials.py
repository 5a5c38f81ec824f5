"""Partial attentions and their combine: what every cache (and an engine's own kernel) shares.

A rank that holds some of a sequence's keys computes a *partial*: the attention of the queries over its
own keys, ``out`` [B, T, H, Dv] and the natural-log log-sum-exp ``lse`` [B, H, T] of each row's scores
(-inf, and out 0, where a row sees none of them). One collective then gives every rank every rank's
partial and each merges them the same way::

    L = logsumexp_r L_r          O = sum_r exp(L_r - L) * O_r

A partial whose ``L_r`` is -inf weighs 0, and a row no rank sees stays ``O = 0``, ``L = -inf``: never NaN.
Sinks (one value-less logit per head) are folded in once, after the merge (:func:`xcp.kernels.merge.apply_sinks_`).

Here: the local partial of a rank as kernel calls over segments (:func:`run_calls`, :func:`packed_partial`:
the calls come from :mod:`xcp.inference.plan`), a partial packed ``[out | lse]`` in one buffer
(:func:`xcp.kernels.merge.packed_layout`), the all-gather of the packed partials with its hand-off between
streams (:func:`exchange`, :func:`gather_merge`), the merge (:func:`merge_into`), and :func:`combine`, the
same combine for an engine that owns its kernel and its cache. :class:`xcp.KVCache` and
:class:`xcp.PagedKVCache` both run on them.

Lifetimes (docs/lifetime.md, rule 3.3): the packed partial is written on the caller's stream C and read
by the all-gather on the comm stream M, so it is handed to M under the backend's hand-off policy, and the
gather's receive buffer is made on C before M forks, as rule 1 has it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..backends.base import score_mods
from ..comm import resolve_group
from ..kernels.math import Alibi
from ..kernels.merge import NEG_INF, accumulator_dtype, packed_layout, packed_lse
from ..lifetime import RingCall, check_handoff
from ..plugins import select_backend
from ..ring import BlockCall

Mods = tuple[float | None, Alibi | None]
"""The soft-cap and the ALiBi of a partial's calls (``(None, None)``: plain attention)."""

LSE_BASES = ("e", "2")
"""The log bases :func:`combine` takes an lse in: natural (``"e"``) or base 2 (``"2"``, as kernels that
exponentiate with ``exp2`` keep it)."""


# ---------------------------------------------------------------------- the local partial
def run_calls(
    backend: Any, calls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mods: Mods = (None, None)
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Each call's (query rows, out, lse) on this rank's storage.

    Every call goes in varlen form, one segment included: a cache's calls change shape at every step (the
    keys grow), and a varlen kernel takes the lengths at run time, where a dense one may plan per shape (on
    the H200, cuDNN built a plan for each new shape: a chunk over 8 virtual ranks took 14.3x one whole-cache
    call with dense calls, 1.26x in varlen form). Backends without a varlen kernel make the same dense call
    per segment. ``mods``: the soft-cap and the ALiBi of every query row and storage row."""
    softcap, alibi = mods
    for call in calls:
        block = BlockCall.of(call)
        if block.cu is None:
            block = dataclasses.replace(block, cu=(call.cu_q, call.cu_k))
        kwargs = score_mods(softcap, None if alibi is None else alibi.rows(block.qs, block.ks))
        yield block.qs, *block.forward(backend, q[:, block.qs], k[:, block.ks], v[:, block.ks], scale, **kwargs)


def empty_packed(shape: tuple[int, int, int], value_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A packed partial [B, T, H, channels] for inputs of ``dtype`` whose rows see nothing: out 0, lse -inf."""
    packed_dtype, channels = packed_layout(dtype, value_dim)
    packed = torch.zeros((*shape, channels), dtype=packed_dtype, device=device)
    packed_lse(packed, value_dim).fill_(NEG_INF)
    return packed


def fill_packed(packed: torch.Tensor, backend: Any, calls, q, k, v, scale: float, mods: Mods = (None, None)) -> None:
    """Write the rows the ``calls`` cover into ``packed`` (made by :func:`empty_packed`, or a view of query
    rows of one), leaving the others as they are."""
    d = v.shape[3]
    lse = packed_lse(packed, d)
    for rows, o, lse_rows in run_calls(backend, calls, q, k, v, scale, mods):
        packed[:, rows, :, :d] = o
        lse[:, rows] = lse_rows.transpose(1, 2)


def packed_partial(backend: Any, calls, q, k, v, scale: float, dtype: torch.dtype, mods: Mods = (None, None)):
    """The rank's partial packed as one buffer, laid out for inputs of ``dtype`` as :func:`pack` lays it
    out: zeros and -inf on rows no call covers."""
    (b, t, h, _), d = q.shape, v.shape[3]
    packed = empty_packed((b, t, h), d, dtype, q.device)
    fill_packed(packed, backend, calls, q, k, v, scale, mods)
    return packed


def local_partial(
    backend: Any, calls, q, k, v, scale: float, acc: torch.dtype, mods: Mods = (None, None)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's (out [B, T, H, Dv], lse [B, H, T]) in ``acc``: zeros and -inf on rows no call covers."""
    t, d = q.shape[1], v.shape[3]
    if len(calls) == 1 and calls[0].q0 == 0 and calls[0].q1 == t:  # one call covers every row (decode)
        _, out, lse = next(run_calls(backend, calls, q, k, v, scale, mods))
        return out.to(acc), lse.to(acc)  # the kernel's own tensors (fresh: a caller may write them in place)
    packed = packed_partial(backend, calls, q, k, v, scale, acc, mods)  # in acc: a world of one keeps its precision
    return unpack(packed, d)


def unpack(packed: torch.Tensor, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, H, Dv] dense, lse [B, H, T]) of a packed partial."""
    return packed[..., :value_dim].contiguous(), packed_lse(packed, value_dim).transpose(1, 2)


def pack(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One block's (out [B, T, H, Dv], lse [B, H, T]) packed for inputs of ``dtype`` as
    :func:`xcp.kernels.merge.packed_layout` lays it out: [B, T, H, D + 1] or, 16-bit, [B, T, H, D + 2]."""
    b, t, h, d = out.shape
    packed_dtype, channels = packed_layout(dtype, d)
    packed = torch.empty((b, t, h, channels), dtype=packed_dtype, device=out.device)
    packed[..., :d] = out
    packed_lse(packed, d).copy_(lse.transpose(1, 2))
    return packed


# ---------------------------------------------------------------------- the combine
def exchange(comm: Any, backend: Any, handoff: str | None, op: str, send: Callable[[], torch.Tensor],
             recv: torch.Tensor, tag: str, meanwhile: Callable[[], Any] = lambda: None) -> Any:  # fmt: skip
    """One collective ``op`` (``all_gather`` or ``all_to_all``) of the tensor ``send()`` writes on the
    caller's stream C into ``recv``, issued on the comm stream M; returns what ``meanwhile()`` made on C
    while M worked, C waiting for M after.

    docs/lifetime.md: ``recv`` is made on C before M forks (rule 1); what ``send()`` writes on C after
    the fork goes to M through the hand-off (rule 3.3), and the host drops it at once: C's next
    allocation (``meanwhile``'s) may come while M reads, and nothing but the hand-off keeps that memory."""
    collective = getattr(comm, op, None)
    if not callable(collective):
        raise TypeError(
            f"group: a combine over {comm.size()} ranks needs a communicator with {op}(); got {type(comm).__name__}"
        )
    call = RingCall(comm, backend, recv.device, "bounded", handoff)
    with call:
        written = send()
        with call.on_comm():
            (handed,) = call.hand_to_comm([written], tag)  # rule 3.3: M waits for C, then owns its read
            del written
            collective(handed, recv, tag, backend).wait()
            del handed
        return meanwhile()


def gather_merge(
    comm: Any,
    backend: Any,
    handoff: str | None,
    packed: Callable[[], torch.Tensor],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out [B, T, H, Dv], lse [B, H, T]) in the accumulator dtype of every rank's partial:
    ``packed()`` packs this rank's (for inputs of ``dtype``, ``shape`` = (B, T, H, Dv)) on the caller's
    stream C, one all-gather of them on the comm stream M (:func:`exchange`), the merge on C after the
    join, into an output C allocates while M gathers."""
    b, t, h, d = shape
    packed_dtype, channels = packed_layout(dtype, d)
    recv = torch.empty((comm.size(), b, t, h, channels), dtype=packed_dtype, device=device)  # rule 1: before M forks
    acc = accumulator_dtype(dtype)
    out = exchange(comm, backend, handoff, "all_gather", packed, recv, "combine",
                   lambda: torch.empty((b, t, h, d), dtype=acc, device=device))  # fmt: skip
    lse = backend.fused_merge_partials_(out, recv)
    if lse is None:
        lse = merge_into(out, recv[..., :d], packed_lse(recv, d))
    return out, lse


def merge_into(out: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge P partials, ``outs`` [P, B, T, H, D] and ``lses`` [P, B, T, H], into ``out`` [B, T, H, D];
    return the merged lse [B, H, T]. A partial whose lse is -inf weighs 0, and a row no rank sees stays
    0 / -inf: never NaN."""
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(lse == NEG_INF, 0.0, lse)
    weights = torch.exp(lses - safe)  # exp(-inf) = 0
    torch.sum(weights.unsqueeze(-1) * outs, dim=0, out=out)
    return lse.transpose(1, 2).contiguous()


def combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    group: Any = None,
    *,
    lse_base: str = "e",
    handoff: str | None = None,
    timeout: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial attention into the whole one, the same on every rank: one collective.

    For an engine that keeps its own cache and kernel: each rank computes the attention of the same queries
    over the keys it holds, and this combines the P partials exactly (docs/serving.md).

    :param out: [..., S, H, Dv], this rank's partial output, any float dtype; where the rank saw nothing of
        a row it may hold anything (NaN included): such a row weighs 0.
    :param lse: [..., H, S] (the layout of :func:`xcp.attention` with ``return_lse=True`` and of
        FlashAttention), the log-sum-exp of each row's scores, -inf where the rank saw nothing (a NaN lse is
        taken as -inf too, as a kernel that divides 0 by 0 leaves it).
    :param group: as for :func:`xcp.attention`.
    :param lse_base: ``"e"`` (natural log) or ``"2"`` (base 2).
    :param handoff: the hand-off policy of the partial to the comm stream, overriding the backend's.
    :param timeout: as for :func:`xcp.attention`.
    :returns: ``(out, lse)``: the merged output in out's dtype, [..., S, H, Dv], and the natural-log lse in
        float32 (float64 for float64 out), [..., H, S]; a row no rank saw is 0 with lse -inf.
    """
    o, l64, acc = _check_partial(out, lse, lse_base)
    handoff = None if handoff is None else check_handoff(handoff)
    comm = resolve_group(group, timeout)
    lead, (s, h, d) = out.shape[:-3], out.shape[-3:]
    if comm.size() == 1:
        merged, merged_lse = o.to(acc), l64
    else:
        backend = select_backend(None, out.device.type)
        b = o.shape[0]
        send = lambda: pack(o, l64, out.dtype)  # noqa: E731
        merged, merged_lse = gather_merge(comm, backend, handoff, send, (b, s, h, d), out.dtype, out.device)
    return merged.to(out.dtype).reshape(*lead, s, h, d), merged_lse.reshape(*lead, h, s)


def _check_partial(out, lse, lse_base: str) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``out`` as [B, S, H, Dv] with the rows the rank saw nothing of zeroed, and the lse as [B, H, S] in the
    accumulator dtype, natural log, -inf there; refuses shapes, dtypes and bases that do not fit."""
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base: expected one of {', '.join(map(repr, LSE_BASES))}; got {lse_base!r}")
    for name, x in (("out", out), ("lse", lse)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name}: expected a floating-point tensor; got {got}")
    if out.dim() < 3:
        raise ValueError(f"out: expected [..., S, H, Dv] (at least 3 dims); got shape {tuple(out.shape)}")
    *lead, s, h, d = out.shape
    if tuple(lse.shape) != (*lead, h, s):
        raise ValueError(f"lse: expected shape {(*lead, h, s)} (out's [..., H, S]); got {tuple(lse.shape)}")
    if lse.device != out.device:
        raise ValueError(f"lse: expected a tensor on out's device {out.device}; got {lse.device}")
    acc = accumulator_dtype(out.dtype)
    b = math.prod(lead)
    l64 = lse.reshape(b, h, s).to(acc)
    if lse_base == "2":
        l64 = l64 * math.log(2.0)
    empty = torch.isnan(l64) | (l64 == NEG_INF)
    l64 = torch.where(empty, NEG_INF, l64)
    o = out.reshape(b, s, h, d)
    o = torch.where(empty.transpose(1, 2).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), o)
    return o, l64, acc


__all__ = ["LSE_BASES", "combine"]
