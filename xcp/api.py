"""The public entry points: :func:`attention`, :func:`shard` and :func:`unshard`.

Every argument is checked up front; an error names the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import schedule
from .comm import check_timeout, resolve_group
from .documents import check_cu_seqlens, check_window
from .hybrid import check_ulysses, check_ulysses_divides, hybrid_attention
from .lifetime import SLOT_POLICIES as _SLOTS
from .lifetime import check_handoff, check_slots
from .ops import compiled_attention
from .plugins import select_backend
from .ring import RingAttention, RingConfig, ring_forward

_LAYOUT = "[batch, seq, heads, head_dim]"


def _check_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor; got {type(x).__name__}")
    _check_dims(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype; got {x.dtype}")
    return x


def _check_dims(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims {_LAYOUT}; got {x.dim()} dims, shape {tuple(x.shape)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_length: bool = False) -> int:
    """Check that q, k, v fit together as one block ([B, S, H, D]; with ``same_length``, k as long as q);
    return H // Hkv.

    Raises a ValueError naming the argument, the expected and the actual value.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dims(name, x)
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (the shape of k); got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (the batch of q); got {k.shape[0]}")
    if same_length and k.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected local sequence length {q.shape[1]} (that of q); got {k.shape[1]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected head_dim {q.shape[3]} (that of q); got {k.shape[3]}")
    h, hkv = q.shape[2], k.shape[2]
    if hkv < 1 or h % hkv:
        raise ValueError(f"k: expected a number of heads that divides the {h} heads of q; got {hkv}")
    return h // hkv


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Raise a TypeError or ValueError naming the first argument that does not fit with the others."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q); got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q); got {x.device}")
    check_qkv(q, k, v, same_length=True)
    if min(q.shape) < 1:
        raise ValueError(f"q: expected every dim of {_LAYOUT} >= 1; got shape {tuple(q.shape)}")


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if schedule.is_bool(scale) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number or None; got {scale!r}")
    return float(scale)


def _check_documents(cu_seqlens: Any, q: torch.Tensor, world: int) -> tuple[int, ...] | None:
    """The global document boundaries as a tuple (None for one document: the dense path)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"cu_seqlens: expected 1 dim [documents + 1]; got {cu_seqlens.dim()} dims, shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens: expected an integer dtype (int32 or int64); got {cu_seqlens.dtype}")
    elif not isinstance(cu_seqlens, (list, tuple)):
        raise TypeError(
            "cu_seqlens: expected an integer tensor [documents + 1] (or a list of ints); "
            f"got {type(cu_seqlens).__name__}"
        )
    if q.shape[0] != 1:
        raise ValueError(f"q: expected batch 1 with cu_seqlens (the packed layout); got batch {q.shape[0]}")
    cu = check_cu_seqlens(cu_seqlens, q.shape[1] * world)
    return None if len(cu) == 2 else cu


def check_backend_serves(backend: Any, q: torch.Tensor, comm: Any, causal: bool, balance: str) -> None:
    """Raise when ``backend`` cannot run on q (device type, dtype) or zigzag cannot split q's shard."""
    if backend.device_type != q.device.type:
        raise ValueError(f"device: backend {backend.name!r} runs on {backend.device_type} tensors; q is on {q.device}")
    if q.dtype not in backend.dtypes:
        names = ", ".join(str(d) for d in backend.dtypes)
        raise TypeError(f"q: backend {backend.name!r} serves dtypes {names}; got {q.dtype}")
    if comm.size() > 1 and causal and balance == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"q: balance 'zigzag' needs an even local sequence length (two chunks per rank); got {q.shape[1]}"
        )


def check_documents(cu_seqlens: Any, q: torch.Tensor, world: int, balance: str, window: Any) -> tuple[int, ...] | None:
    """The documents a RingConfig takes: the checked boundaries, (0, S) with a window and no documents,
    None for one sequence without a window (the dense path)."""
    documents = _check_documents(cu_seqlens, q, world)
    if window is not None and documents is None:  # the window's plan works on (0, S): one document
        schedule.check_seq_len(q.shape[1] * world, world, balance, what="the global sequence length")
        documents = (0, q.shape[1] * world)
    return documents


def _check_sinks(sinks: Any, q: torch.Tensor) -> torch.Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a float tensor [heads] or None; got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        raise ValueError(f"sinks: expected shape ({q.shape[2]},) (one logit per query head); got {tuple(sinks.shape)}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks: expected a floating-point dtype; got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks: expected device {q.device} (the device of q); got {sinks.device}")
    return sinks


def _alone(q: Any, k: Any, v: Any, causal: Any, scale: Any, balance: Any, slots: Any, device: Any) -> Any:
    """A world of one without documents, window or sinks, answered by the backend's whole-sequence
    attention, or None where any check below fails or the backend has no such call.

    The checks are :func:`attention`'s, each one comparison (which costs little next to the kernel at 1K
    tokens); where one fails, the general path runs and its checks name what is wrong.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4 or v.shape != ks or min(qs) < 1:
        return None
    if ks[0] != qs[0] or ks[1] != qs[1] or ks[3] != qs[3] or ks[2] < 1 or qs[2] % ks[2]:
        return None
    dtype, dev = q.dtype, q.device
    if k.dtype != dtype or v.dtype != dtype or k.device != dev or v.device != dev or not q.is_floating_point():
        return None
    if not (causal is True or causal is False) or type(balance) is not str or balance not in schedule.BALANCES:
        return None
    if type(slots) is not str or slots not in _SLOTS:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(qs[3])
    elif type(scale) is not float or not 0.0 < scale < math.inf:
        return None
    if torch.compiler.is_compiling() or (dist.is_available() and dist.is_initialized()):
        return None
    backend = select_backend(None if device is None else str(device), dev.type)
    if backend.device_type != dev.type or dtype not in backend.dtypes:
        return None
    return backend.whole_attention(q, k, v, causal, scale)


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
) -> torch.Tensor:
    """Ring attention over the ranks of ``group``; differentiable in q, k and v.

    :param q: this rank's queries {layout}, a shard made by :func:`shard` with the same ``balance``.
    :param k: this rank's keys [batch, seq, kv_heads, head_dim]; kv_heads divides heads (GQA/MQA).
    :param v: this rank's values, shaped like k.
    :param causal: causal attention over the *global* sequence.
    :param cu_seqlens: packed documents: an integer tensor [documents + 1] of GLOBAL boundaries
        ``0 = cu[0] < ... < cu[-1] = S`` (S = local length x ranks), equal on every rank; query i sees key
        j only in its own document. Batch must be 1. Keep it on the CPU: it is read on the host.
    :param sinks: a float tensor [heads]: one value-less logit per query head added to every row's
        softmax (attention sinks), applied once after the ring. Differentiable; each rank's gradient is
        the share of its rows, summed over ranks like any replicated parameter's.
    :param window: a sliding window ``(left, right)`` over global positions: query i sees key j only when
        ``i - left <= j <= i + right`` (ints >= 0, None unbounded; with ``causal`` right is 0 or None).
        The ring runs only the steps whose shards a window reaches (``balance="contiguous"`` needs the
        fewest: see :func:`xcp.schedule.choose_balance`).
    :param group: a torch.distributed ProcessGroup, a group from :class:`xcp.LocalWorld`, or None (the
        default process group when one is initialised, else a world of one rank).
    :param scale: factor on q·k; default 1/sqrt(head_dim).
    :param balance: how the sequence was sharded (``zigzag``, ``contiguous`` or ``stripe``).
    :param device: backend name (``cpu``, ``cuda``, ``npu``, ...); default the tensors' device type.
    :param slots: the slot policy: ``bounded`` (two receive slots) or ``keep_all`` (every received shard
        kept; for comparisons only).
    :param handoff: the hand-off policy, overriding the backend's (``record_stream``, ``clone``,
        ``event``, ``none``).
    :param timeout: seconds a wait on a peer of a torch.distributed group may take before a
        :class:`xcp.CommTimeout` naming this rank, the peer, the step and the tag; default ``XCP_TIMEOUT``,
        else 600 s where the wait blocks the host (gloo) and the process group's own timeout for device
        waits (NCCL, HCCL). A LocalWorld bounds its waits by its own ``timeout``.
    :param policy: the former name of ``slots`` (deprecated).
    :param ulysses: U, the ranks of a head group (hybrid all-to-all + ring; xcp/hybrid.py): the P ranks of
        ``group`` form P / U rings of R = P / U ranks; an all-to-all inside each group of U consecutive ranks
        gives every rank H / U heads of its ring shard, the ring runs over R ranks, and a second all-to-all
        returns the output. U divides P and the heads; the shards come from :func:`shard` with the same
        ``ulysses``. 1 (default) is the ring alone, U = P all-to-all alone (Ulysses).
    :returns: this rank's output, shaped and typed like q.
    """
    if (group is None and cu_seqlens is None and sinks is None and window is None and handoff is None
            and timeout is None and policy is None and type(ulysses) is int and ulysses == 1):  # fmt: skip
        out = _alone(q, k, v, causal, scale, balance, slots, device)
        if out is not None:
            return out
    check_inputs(q, k, v)
    if not schedule.is_bool(causal):
        raise TypeError(f"causal: expected a bool (or numpy.bool_); got {type(causal).__name__}")
    causal = bool(causal)
    schedule.check_balance(balance)
    if policy is not None:
        warnings.warn("attention(policy=...) is now spelled slots=...", DeprecationWarning, stacklevel=2)
        slots = policy
    check_slots(slots)
    if handoff is not None:
        check_handoff(handoff)
    scale = _check_scale(scale, q.shape[3])
    sinks = _check_sinks(sinks, q)
    window = check_window(window, causal)
    ulysses = check_ulysses(ulysses)
    if ulysses != 1:
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"ulysses: the hybrid all-to-all + ring does not run under torch.compile yet; got ulysses={ulysses} "
                "(call xcp.attention outside the compiled region, or ulysses=1)"
            )
        comm = resolve_group(group, timeout)
        backend = select_backend(None if device is None else str(device), q.device.type)
        options = dict(causal=causal, scale=scale, balance=balance, slots=slots, handoff=handoff)
        return hybrid_attention(q, k, v, comm, backend, ulysses, cu_seqlens=cu_seqlens, window=window, sinks=sinks,
                                **options)  # fmt: skip
    if torch.compiler.is_compiling():  # one opaque custom op; the group by name (xcp/ops.py)
        return compiled_attention(q, k, v, sinks, group, device, causal, scale, balance, slots, handoff,
                                  cu_seqlens, window, check_timeout(timeout))  # fmt: skip
    comm = resolve_group(group, timeout)
    backend = select_backend(None if device is None else str(device), q.device.type)
    check_backend_serves(backend, q, comm, causal, balance)
    documents = check_documents(cu_seqlens, q, comm.size(), balance, window)
    if documents is None and sinks is None and comm.size() == 1:  # a world of one: the vendor's attention
        out = backend.whole_attention(q, k, v, causal, scale)
        if out is not None:
            return out
    cfg = RingConfig(comm, backend, causal, scale, balance, slots, handoff, documents, window)
    needs_grad = any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if torch.is_grad_enabled() and needs_grad:
        return RingAttention.apply(q, k, v, sinks, cfg)
    return ring_forward(q, k, v, cfg, sinks)[0]


attention.__doc__ = attention.__doc__.replace("{layout}", _LAYOUT)


def _check_dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    if not schedule.is_integer(dim) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: expected an integer in [{-x.dim()}, {x.dim()}); got {dim!r}")
    return int(dim) % x.dim()


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
) -> torch.Tensor:
    """Rank ``rank``'s part of the sequence ``x`` along ``dim`` (a new contiguous tensor).

    With ``ulysses`` = U > 1 (see :func:`attention`): the sequence is sharded over the R = P / U ring
    positions by ``balance``, and each ring shard is cut into U contiguous pieces; rank r gets piece
    ``r % U`` of ring shard ``r // U``.

    :raises ValueError: when the length along ``dim`` is not a multiple of what ``balance`` needs (and,
        with ``ulysses``, of P), or when ``ulysses`` does not divide ``world_size``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor; got {type(x).__name__}")
    dim = _check_dim(x, dim)
    schedule.check_world(world_size, rank)
    world_size, rank = int(world_size), int(rank)
    ulysses = check_ulysses(ulysses)
    if ulysses != 1:
        rings = check_ulysses_divides(ulysses, world_size, "world_size")
        schedule.check_seq_len(x.shape[dim], rings, balance, what=f"x.shape[{dim}]")
        if x.shape[dim] % world_size:
            raise ValueError(
                f"x.shape[{dim}]: expected a multiple of world_size {world_size} with ulysses={ulysses} (each of "
                f"{rings} ring shards splits into {ulysses} pieces); got {x.shape[dim]}"
            )
        ring_shard = shard(x, rings, rank // ulysses, dim, balance)
        piece = ring_shard.shape[dim] // ulysses
        return ring_shard.narrow(dim, (rank % ulysses) * piece, piece).clone(memory_format=torch.contiguous_format)
    schedule.check_seq_len(x.shape[dim], world_size, balance, what=f"x.shape[{dim}]")
    parts = [_slice(x, dim, a, b, c) for a, b, c in schedule.chunk_slices(x.shape[dim], world_size, rank, balance)]
    if len(parts) > 1:
        return torch.cat(parts, dim=dim)
    return parts[0].clone(memory_format=torch.contiguous_format)  # never a view of the caller's tensor


def unshard(
    shards: Sequence[torch.Tensor], dim: int = 1, balance: str = schedule.DEFAULT_BALANCE, ulysses: int = 1
) -> torch.Tensor:
    """The whole sequence from the shards of ranks 0..P-1 (the inverse of :func:`shard`, with the same
    ``balance`` and ``ulysses``)."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise TypeError(f"shards: expected a non-empty list of tensors, one per rank; got {type(shards).__name__}")
    for r, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{r}]: expected a torch.Tensor; got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(
                f"shards[{r}]: expected shape {tuple(shards[0].shape)} (that of shards[0]); got {tuple(s.shape)}"
            )
        if s.dtype != shards[0].dtype:
            raise TypeError(f"shards[{r}]: expected dtype {shards[0].dtype} (that of shards[0]); got {s.dtype}")
        if s.device != shards[0].device:
            raise ValueError(f"shards[{r}]: expected device {shards[0].device} (that of shards[0]); got {s.device}")
    schedule.check_balance(balance)
    world = len(shards)
    dim = _check_dim(shards[0], dim)
    ulysses = check_ulysses(ulysses)
    if ulysses != 1:  # the ranks of a head group hold consecutive pieces of one ring shard
        rings = check_ulysses_divides(ulysses, world, f"the {world} shards")
        ring_shards = [torch.cat(list(shards[g * ulysses : (g + 1) * ulysses]), dim=dim) for g in range(rings)]
        return unshard(ring_shards, dim, balance)
    n = shards[0].shape[dim]
    seq_len = n * world
    schedule.check_seq_len(seq_len, world, balance, what=f"{world} shards of length {n} along dim {dim}")
    if balance == "stripe":  # global token j*P + r is local token j of rank r
        stacked = torch.stack(list(shards), dim=dim + 1)
        return stacked.flatten(dim, dim + 1)
    pieces = []
    for r, s in enumerate(shards):
        offset = 0
        for start, stop, _ in schedule.chunk_slices(seq_len, world, r, balance):
            pieces.append((start, s.narrow(dim, offset, stop - start)))
            offset += stop - start
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim=dim)
