"""The public entry points: :func:`attention`, :func:`shard` and :func:`unshard`.

Every argument is checked up front, once (:mod:`xcp.checks`); an error names the argument, what was
expected and what came. Then :func:`attention` takes one of four ways: the compiled op (inside
``torch.compile``), the hybrid (``ulysses`` > 1), the backend's whole attention (a world of one without
documents or sinks, where the backend has one) or the ring.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch

from . import schedule
from .checks import (
    LAYOUT,
    check_backend_serves,
    check_backend_variants,
    check_call,
    check_dim,
    check_document_balance,
    check_documents,
    check_piece_length,
    check_placement,
    check_return_lse,
    check_shard_length,
    check_shards,
    check_ulysses,
    check_ulysses_divides,
    check_variants,
)
from .comm import check_timeout, resolve_group
from .hybrid import hybrid_attention, hybrid_config
from .ops import compiled_attention
from .plugins import select_backend
from .ring import RingAttention, RingConfig, ring_forward

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _Options(TypedDict, total=False):
    """The keyword options of :func:`attention` besides ``return_lse``, for its typed overloads."""

    causal: bool
    group: Any
    cu_seqlens: torch.Tensor | None
    sinks: torch.Tensor | None
    window: tuple[int | None, int | None] | None
    scale: float | None
    balance: str
    device: str | torch.device | None
    slots: str
    handoff: str | None
    timeout: float | None
    policy: str | None
    ulysses: int
    softcap: float | None
    alibi_slopes: torch.Tensor | None
    chunk: int | None


@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: Literal[False] = ..., **options: Unpack[_Options]
) -> torch.Tensor: ...
@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: Literal[True], **options: Unpack[_Options]
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool, **options: Unpack[_Options]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: Any = None,
    cu_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    balance: str = schedule.DEFAULT_BALANCE,
    device: str | torch.device | None = None,
    slots: str = "bounded",
    handoff: str | None = None,
    timeout: float | None = None,
    policy: str | None = None,
    ulysses: int = 1,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over the ranks of ``group``; differentiable in q, k and v.

    :param q: this rank's queries {layout}, a shard made by :func:`shard` with the same ``balance``.
    :param k: this rank's keys [batch, seq, kv_heads, head_dim]; kv_heads divides heads (GQA/MQA).
    :param v: this rank's values, shaped like k.
    :param causal: causal attention over the *global* sequence.
    :param cu_seqlens: packed documents: an integer tensor [documents + 1] of GLOBAL boundaries
        ``0 = cu[0] <= ... <= cu[-1] = S`` (S = local length x ranks, or under ``document_zigzag`` the sum of
        the shards' lengths; a repeat is an empty document, which costs nothing), equal on every rank; query
        i sees key j only in its own document. Batch must be 1. Keep it on the CPU: it is read on the host.
        Needed with ``balance="document_zigzag"``.
    :param sinks: a float tensor [heads]: one value-less logit per query head added to every row's
        softmax (attention sinks), applied once after the ring. Differentiable; each rank's gradient is
        the share of its rows, summed over ranks like any replicated parameter's.
    :param window: a sliding window ``(left, right)`` over global positions: query i sees key j only when
        ``i - left <= j <= i + right`` (ints >= 0, None unbounded; with ``causal`` right is 0 or None).
        The ring runs only the steps whose shards a window reaches (``balance="contiguous"`` needs the
        fewest: see :func:`xcp.choose_balance`).
    :param group: a torch.distributed ProcessGroup, a group from :class:`xcp.LocalWorld`, or None (the
        default process group when one is initialised, else a world of one rank).
    :param scale: factor on q·k; default 1/sqrt(head_dim).
    :param balance: how the sequence was sharded (``zigzag``, ``contiguous`` or ``stripe``; or
        ``document_zigzag``, each document zigzagged over the ranks, with ``cu_seqlens``: shards of
        ``S // P`` or ``S // P + 1`` tokens, see :func:`shard`; with ``ulysses`` S / P, each document
        zigzagged over the rings of P / U ranks).
    :param device: backend name (``cpu``, ``cuda``, ``npu``, ...); default the tensors' device type.
    :param slots: the slot policy: ``bounded`` (two receive slots) or ``keep_all`` (every received shard
        kept; for comparisons only).
    :param handoff: the hand-off policy, overriding the backend's (``record_stream``, ``clone``,
        ``event``, ``none``).
    :param timeout: seconds a wait on a peer of a torch.distributed group may take before a
        :class:`xcp.CommTimeout` naming this rank, the peer, the step and the tag; default ``XCP_TIMEOUT``,
        else, where the wait blocks the host (gloo), the process group's own timeout but at most 600 s, and
        for device waits (NCCL, HCCL) the process group's own timeout. A LocalWorld bounds its waits by its
        own ``timeout``.
    :param policy: the former name of ``slots`` (deprecated).
    :param ulysses: U, the ranks of a head group (hybrid all-to-all + ring; xcp/hybrid.py): the P ranks of
        ``group`` form P / U rings of R = P / U ranks; an all-to-all inside each group of U consecutive ranks
        gives every rank H / U heads of its ring shard, the ring runs over R ranks, and a second all-to-all
        returns the output. U divides P and the heads; the shards come from :func:`shard` with the same
        ``ulysses``. 1 (default) is the ring alone, U = P all-to-all alone (Ulysses).
    :param softcap: logit soft-capping (Gemma-2): every score ``s = scale * q.k`` becomes
        ``softcap * tanh(s / softcap)`` before the mask and the softmax (a float > 0; None: none). Exact in
        every block, so on every balance; the backward goes through the tanh. Sinks are not capped.
    :param alibi_slopes: ALiBi (BLOOM, MPT, Falcon): a float tensor [heads], one slope per query head, on q's
        device; every score gets ``-slope_h * |i - j|``, i and j the GLOBAL positions of the query and the key
        (each block knows its rows' positions from the balance). Added after the soft-cap, where both are
        given. The slopes are constants: no gradient is computed for them (a tensor that requires grad is
        refused). Sinks get no bias.
    :param chunk: chunked attention (Llama-4's ``attention_chunk_size``): query i sees key j only when both
        lie in the same chunk of ``chunk`` tokens, chunks aligned at global position 0 (``i // chunk == j //
        chunk``), and, with ``cu_seqlens``, in the same document: the documents cut at every multiple of
        ``chunk`` (their intersection; the placement of ``document_zigzag`` stays by ``cu_seqlens``). Combines
        with ``causal`` (as Llama-4 uses it) and ``window``. The ring runs only the steps a chunk reaches.
    :param return_lse: also return the log-sum-exp of every row's scores (natural log), for callers that
        merge attention themselves: ``(out, lse)``, lse [batch, heads, seq] (seq: this rank's rows, in q's
        order; with ``ulysses``, this rank's own rows and all heads again), float32, or float64 for float64
        inputs. With ``sinks`` it includes the sink: ``log(sum_j exp(s_ij) + exp(sink_h))``. A row that
        sees no key has lse -inf and out 0. lse is not differentiable: a gradient that reaches it raises a
        RuntimeError in the backward (detach it where it enters a loss); gradients through out are as
        without it. In a world of one it runs the backend's block kernel, not ``whole_attention``.
    :returns: this rank's output, shaped and typed like q; with ``return_lse``, ``(out, lse)``.
    """
    if policy is not None:
        warnings.warn("attention(policy=...) is now spelled slots=...", DeprecationWarning, stacklevel=2)
        slots = policy
    causal, scale, sinks, window, ulysses = check_call(q, k, v, causal, scale, balance, slots, handoff, sinks,
                                                       window, ulysses)  # fmt: skip
    softcap, alibi_slopes, chunk = check_variants(q, softcap, alibi_slopes, chunk)
    return_lse = check_return_lse(return_lse)
    check_document_balance(balance, cu_seqlens)
    if torch.compiler.is_compiling():
        if ulysses != 1:
            raise NotImplementedError(
                f"ulysses: the hybrid all-to-all + ring does not run under torch.compile yet; got ulysses={ulysses} "
                "(call xcp.attention outside the compiled region, or ulysses=1)"
            )
        out, lse = compiled_attention(q, k, v, sinks, group, device, check_timeout(timeout), causal=causal,
                                      scale=scale, balance=balance, slots=slots, handoff=handoff, documents=cu_seqlens,
                                      window=window, ulysses=ulysses, softcap=softcap, chunk=chunk,
                                      alibi_slopes=alibi_slopes)  # fmt: skip
        return (out, lse) if return_lse else out
    comm = resolve_group(group, timeout)
    device_type = q.device.type
    backend = select_backend(None if device is None else str(device), device_type)
    check_backend_variants(backend, softcap, alibi_slopes)
    if ulysses != 1:
        hybrid = hybrid_config(q, k, comm, backend, ulysses, causal=causal, scale=scale, balance=balance, slots=slots,
                               handoff=handoff, cu_seqlens=cu_seqlens, window=window, sinks=sinks, v=v,
                               softcap=softcap, alibi_slopes=alibi_slopes, chunk=chunk)  # fmt: skip
        out, hybrid_lse = hybrid_attention(q, k, v, hybrid, sinks, return_lse)
        return out if hybrid_lse is None else (out, hybrid_lse)
    world = comm.size()
    check_backend_serves(backend, q, world, causal, balance, device_type, v.shape[3])
    documents = check_documents(cu_seqlens, q, world, balance, window, comm.rank(), chunk=chunk)
    plain = documents is None and sinks is None and softcap is None and alibi_slopes is None
    if world == 1 and plain and not return_lse:  # the vendor's attention, if any
        whole = backend.whole_attention(q, k, v, causal, scale)
        if whole is not None:
            return whole
    cfg = RingConfig(comm, backend, causal, scale, balance, slots, handoff, documents, window, softcap=softcap,
                     chunk=chunk, alibi_slopes=alibi_slopes)  # fmt: skip
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks)):
        out, lse = RingAttention.apply(q, k, v, sinks, cfg)
    else:
        out, lse = ring_forward(q, k, v, cfg, sinks)
    return (out, lse) if return_lse else out


attention.__doc__ = (attention.__doc__ or "").replace("{layout}", LAYOUT)


def _slice(x: torch.Tensor, dim: int, start: int, stop: int, step: int) -> torch.Tensor:
    index = [slice(None)] * x.dim()
    index[dim] = slice(start, stop, step)
    return x[tuple(index)]


def shard(
    x: torch.Tensor,
    world_size: int,
    rank: int,
    dim: int = 1,
    balance: str = schedule.DEFAULT_BALANCE,
    ulysses: int = 1,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank ``rank``'s part of the sequence ``x`` along ``dim`` (a new contiguous tensor).

    With ``ulysses`` = U > 1 (see :func:`attention`): the sequence is sharded over the R = P / U ring
    positions by ``balance``, and each ring shard is cut into U contiguous pieces; rank r gets piece
    ``r % U`` of ring shard ``r // U``.

    With ``balance="document_zigzag"`` (and ``cu_seqlens``, the documents' global boundaries, required
    there and refused with every other balance): each document of L tokens is cut into 2P chunks of
    ``L // 2P`` tokens, ``L % 2P`` of them one longer, and rank r gets chunks r and 2P - 1 - r of every
    document, in document order. Any length S >= P is split, with no padding; rank r's shard holds
    ``S // P + (1 if r < S % P else 0)`` tokens (:func:`xcp.schedule.shard_lengths`): shards differ by one
    token at most, and are equal when P divides S. With ``ulysses`` the documents are zigzagged over the R
    ring positions and S must be a multiple of P, as under every balance: the pieces are equal.

    :raises ValueError: when the length along ``dim`` is not a multiple of what ``balance`` needs (and,
        with ``ulysses``, of P), or when ``ulysses`` does not divide ``world_size``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor; got {type(x).__name__}")
    dim = check_dim(x, dim)
    schedule.check_world(world_size, rank)
    world_size, rank = int(world_size), int(rank)
    ulysses = check_ulysses(ulysses)
    cu = check_placement(balance, cu_seqlens, x.shape[dim])
    if ulysses != 1:
        rings = check_ulysses_divides(ulysses, world_size, "world_size")
        schedule.check_seq_len(x.shape[dim], rings, balance, what=f"x.shape[{dim}]")
        if x.shape[dim] % world_size:
            also = f"; balance {balance!r} splits any length only with ulysses=1" if cu is not None else ""
            raise ValueError(
                f"x.shape[{dim}]: expected a multiple of world_size {world_size} with ulysses={ulysses} (each of "
                f"{rings} ring shards splits into {ulysses} pieces{also}); got {x.shape[dim]}"
            )
        ring_shard = shard(x, rings, rank // ulysses, dim, balance, cu_seqlens=cu)
        piece = ring_shard.shape[dim] // ulysses
        return ring_shard.narrow(dim, (rank % ulysses) * piece, piece).clone(memory_format=torch.contiguous_format)
    schedule.check_seq_len(x.shape[dim], world_size, balance, what=f"x.shape[{dim}]")
    slices = schedule.chunk_slices(x.shape[dim], world_size, rank, balance, cu)
    parts = [_slice(x, dim, a, b, c) for a, b, c in slices]
    if len(parts) > 1:
        return torch.cat(parts, dim=dim)
    return parts[0].clone(memory_format=torch.contiguous_format)  # never a view of the caller's tensor


def unshard(
    shards: Sequence[torch.Tensor],
    dim: int = 1,
    balance: str = schedule.DEFAULT_BALANCE,
    ulysses: int = 1,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole sequence from the shards of ranks 0..P-1 (the inverse of :func:`shard`, with the same
    ``balance``, ``ulysses`` and ``cu_seqlens``; under ``document_zigzag`` the shards' lengths along
    ``dim`` are those :func:`shard` gives)."""
    schedule.check_balance(balance, documents=True)
    check_shards(shards, dim if balance in schedule.DOCUMENT_BALANCES else None)
    world = len(shards)
    dim = check_dim(shards[0], dim)
    ulysses = check_ulysses(ulysses)
    cu = check_placement(balance, cu_seqlens, None)
    if ulysses != 1:  # the ranks of a head group hold consecutive pieces of one ring shard
        rings = check_ulysses_divides(ulysses, world, f"the {world} shards")
        if cu is not None:  # every piece S / P tokens, as shard(..., ulysses=U) cuts them
            for r, s in enumerate(shards):
                check_piece_length(f"shards[{r}]", s.shape[dim], cu[-1], world, ulysses, balance)
        ring_shards = [torch.cat(list(shards[g * ulysses : (g + 1) * ulysses]), dim=dim) for g in range(rings)]
        return unshard(ring_shards, dim, balance, cu_seqlens=cu)
    if cu is not None:
        seq_len = cu[-1]
        for r, s in enumerate(shards):
            check_shard_length(f"shards[{r}]", s.shape[dim], seq_len, world, balance, r)
    else:
        n = shards[0].shape[dim]
        seq_len = n * world
        schedule.check_seq_len(seq_len, world, balance, what=f"{world} shards of length {n} along dim {dim}")
    if balance == "stripe":  # global token j*P + r is local token j of rank r
        stacked = torch.stack(list(shards), dim=dim + 1)
        return stacked.flatten(dim, dim + 1)
    pieces = []
    for r, s in enumerate(shards):
        offset = 0
        for start, stop, _ in schedule.chunk_slices(seq_len, world, r, balance, cu):
            pieces.append((start, s.narrow(dim, offset, stop - start)))
            offset += stop - start
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim=dim)
