"""Every check of a call's arguments, in one place below the entry points (api, hybrid, ops).

An error names the argument, what was expected and what came (``name: expected X; got Y``). The plans
check their own inputs where they take them (:mod:`xcp.schedule`: balance, world, sequence length, ulysses;
:mod:`xcp.documents`: boundaries, window; :mod:`xcp.lifetime`: slot and hand-off policies); this module
composes those with the checks of tensors and options that only a call has.

A check runs once per call. The common case comes first in each (a few comparisons, so that a world of one
at 1K tokens costs about the backend's own attention); where it does not hold, the full check runs and
either names what is wrong or accepts what the short test left out (an int scale, a numpy bool).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from . import schedule
from .documents import check_chunk, check_cu_seqlens, check_window
from .lifetime import check_handoff, check_slots

# with the plans' own checks, since xcp.choose_balance takes ulysses too; the entry points import them from here
from .schedule import check_ulysses as check_ulysses
from .schedule import check_ulysses_divides as check_ulysses_divides

LAYOUT = "[batch, seq, heads, head_dim]"


# ----------------------------------------------------------------------------------------------------
# Tensors


def _check_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor; got {type(x).__name__}")
    _check_dims(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype; got {x.dtype}")
    return x


def _check_dims(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims {LAYOUT}; got {x.dim()} dims, shape {tuple(x.shape)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_length: bool = False) -> int:
    """Check that q, k, v fit together as one block ([B, S, H, D]; with ``same_length``, k as long as q;
    v's head dim Dv may differ from that of q and k, as in multi-head latent attention); return H // Hkv.

    Raises a ValueError naming the argument, the expected and the actual value.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dims(name, x)
    if v.shape[:3] != k.shape[:3] or v.shape[3] < 1:
        want = ", ".join(map(str, k.shape[:3]))
        raise ValueError(
            f"v: expected shape ({want}, Dv) (the batch, length and heads of k; any head dim Dv >= 1); got "
            f"{tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (the batch of q); got {k.shape[0]}")
    if same_length and k.shape[1] != q.shape[1]:
        hint = " (keys of a KV cache, longer than the queries: use xcp.KVCache)" if k.shape[1] > q.shape[1] else ""
        raise ValueError(f"k: expected local sequence length {q.shape[1]} (that of q); got {k.shape[1]}{hint}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected head_dim {q.shape[3]} (that of q); got {k.shape[3]}")
    h, hkv = q.shape[2], k.shape[2]
    if hkv < 1 or h % hkv:
        raise ValueError(f"k: expected a number of heads that divides the {h} heads of q; got {hkv}")
    return h // hkv


def _inputs_fit(q: Any, k: Any, v: Any) -> bool:
    """The short test of :func:`check_inputs`: True only where the full check would pass."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4 or v.shape != ks or min(qs) < 1:
        return False
    if ks[0] != qs[0] or ks[1] != qs[1] or ks[3] != qs[3] or ks[2] < 1 or qs[2] % ks[2]:
        return False
    dtype, dev = q.dtype, q.device
    return k.dtype == dtype and v.dtype == dtype and k.device == dev and v.device == dev and q.is_floating_point()


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Raise a TypeError or ValueError naming the first argument that does not fit with the others."""
    if _inputs_fit(q, k, v):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q); got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q); got {x.device}")
    check_qkv(q, k, v, same_length=True)
    if min(q.shape) < 1:
        raise ValueError(f"q: expected every dim of {LAYOUT} >= 1; got shape {tuple(q.shape)}")


def check_sinks(sinks: Any, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` as given: None, or a float tensor [heads] on q's device."""
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


def check_alibi_slopes(alibi_slopes: Any, q: torch.Tensor) -> torch.Tensor | None:
    """``alibi_slopes`` as given: None, or a float tensor [heads] on q's device that needs no gradient (the
    slopes are constants of the model: xcp computes no gradient for them, and refuses one that asks)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a float tensor [heads] or None; got {type(alibi_slopes).__name__}")
    if alibi_slopes.dim() != 1 or alibi_slopes.shape[0] != q.shape[2]:
        raise ValueError(
            f"alibi_slopes: expected shape ({q.shape[2]},) (one slope per query head); got {tuple(alibi_slopes.shape)}"
        )
    if not alibi_slopes.is_floating_point():
        raise TypeError(f"alibi_slopes: expected a floating-point dtype; got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes: expected device {q.device} (the device of q); got {alibi_slopes.device}")
    if alibi_slopes.requires_grad:
        raise ValueError(
            "alibi_slopes: expected a tensor that does not require grad (the slopes are constants: xcp computes no "
            "gradient for them); got one that requires grad (pass alibi_slopes.detach())"
        )
    return alibi_slopes


# ----------------------------------------------------------------------------------------------------
# Options


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` (logit soft-capping, ``softcap * tanh(s / softcap)``) as a float > 0, or None."""
    if softcap is None:
        return None
    if schedule.is_bool(softcap) or not isinstance(softcap, numbers.Real) or not 0 < float(softcap) < math.inf:
        raise ValueError(f"softcap: expected a positive finite float or None; got {softcap!r}")
    return float(softcap)


def check_variants(
    q: torch.Tensor, softcap: Any, alibi_slopes: Any, chunk: Any
) -> tuple[float | None, torch.Tensor | None, int | None]:
    """The attention variants of a call, checked: ``(softcap, alibi_slopes, chunk)``."""
    return check_softcap(softcap), check_alibi_slopes(alibi_slopes, q), check_chunk(chunk)


def check_backend_variants(backend: Any, softcap: float | None, alibi_slopes: torch.Tensor | None) -> None:
    """Raise a NotImplementedError naming the score modification a call needs and ``backend`` does not serve
    (``Backend.score_mods``): never a kernel that silently leaves it out."""
    served = getattr(backend, "score_mods", ())
    for name, value in (("softcap", softcap), ("alibi", alibi_slopes)):
        if value is not None and name not in served:
            arg = "alibi_slopes" if name == "alibi" else name
            raise NotImplementedError(
                f"{arg}: not supported by backend {backend.name!r} (its kernels do not serve {name}; it declares "
                f"score_mods={tuple(served)!r}); got {arg}={value if name == 'softcap' else 'a tensor'} (run on a "
                "backend that serves it, e.g. device='cpu', or leave it out)"
            )


def check_causal(causal: Any) -> bool:
    """``causal`` as a bool: a bool or a numpy bool."""
    if causal is True or causal is False:
        return causal
    if not schedule.is_bool(causal):
        raise TypeError(f"causal: expected a bool (or numpy.bool_); got {type(causal).__name__}")
    return bool(causal)


def check_return_lse(return_lse: Any) -> bool:
    """``return_lse`` as a bool: a bool or a numpy bool (not 0/1, not a string)."""
    if not schedule.is_bool(return_lse):
        raise TypeError(f"return_lse: expected a bool; got {return_lse!r} ({type(return_lse).__name__})")
    return bool(return_lse)


def check_scale(scale: Any, head_dim: int) -> float:
    """``scale`` as a float; None is 1/sqrt(head_dim)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if type(scale) is float and 0.0 < scale < math.inf:
        return scale
    if schedule.is_bool(scale) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number or None; got {scale!r}")
    return float(scale)


def check_ulysses_heads(ulysses: int, heads: int) -> None:
    """A ValueError naming ulysses unless it divides the query heads."""
    if heads % ulysses:
        raise ValueError(
            f"ulysses: expected a divisor of the {heads} heads of q (each rank of a head group takes "
            f"heads / ulysses of them); got {ulysses}"
        )


def check_call(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, balance: Any, slots: Any, handoff: Any, sinks: Any,
    window: Any, ulysses: Any,
) -> tuple[bool, float, torch.Tensor | None, tuple[int | None, int | None] | None, int]:  # fmt: skip
    """Every check of :func:`xcp.attention` that needs no group: the tensors, then each option; returns
    (causal, scale, sinks, window, ulysses) as the call uses them (the documents wait for the group: they
    depend on its size)."""
    check_inputs(q, k, v)
    causal = check_causal(causal)
    schedule.check_balance(balance, documents=True)
    check_slots(slots)
    if handoff is not None:
        check_handoff(handoff)
    return (
        causal,
        check_scale(scale, q.shape[3]),
        None if sinks is None else check_sinks(sinks, q),
        None if window is None else check_window(window, causal),
        check_ulysses(ulysses),
    )


# ----------------------------------------------------------------------------------------------------
# What depends on the group and the backend


def _cu_seqlens_values(cu_seqlens: Any) -> Any:
    """``cu_seqlens`` as given, once its type is one that holds boundaries: a 1-D integer tensor, a list or a
    tuple (:func:`xcp.documents.check_cu_seqlens` checks the values)."""
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
    return cu_seqlens


def _check_documents(
    cu_seqlens: Any,
    q: torch.Tensor,
    world: int,
    balance: str = schedule.DEFAULT_BALANCE,
    rank: int | None = None,
    ulysses: int = 1,
) -> tuple[int, ...] | None:
    """The global document boundaries as a tuple, empty documents dropped (None for one non-empty document
    of a whole-sequence balance: the dense path)."""
    if cu_seqlens is None:
        return None
    values = _cu_seqlens_values(cu_seqlens)
    if q.shape[0] != 1:
        raise ValueError(f"q: expected batch 1 with cu_seqlens (the packed layout); got batch {q.shape[0]}")
    if balance in schedule.DOCUMENT_BALANCES:  # even one document: its chunks are not the dense path's halves
        cu = check_cu_seqlens(values)
        if ulysses > 1:
            check_piece_length("q", q.shape[1] // ulysses, cu[-1], world * ulysses, ulysses, balance)
        check_shard_length("q", q.shape[1], cu[-1], world, balance, rank)
        return cu
    cu = check_cu_seqlens(values, q.shape[1] * world)
    return None if len(cu) == 2 else cu


def check_piece_length(name: str, n: int, seq_len: int, world: int, ulysses: int, balance: str) -> None:
    """The hybrid cuts each ring shard into U equal pieces, so every rank holds S / P tokens under every
    balance: a document balance, which splits any S >= P over a ring alone, needs P to divide S there. A
    ValueError naming ``cu_seqlens`` where P does not divide ``seq_len``, else ``name`` unless ``n`` = S / P."""
    if seq_len % world:
        raise ValueError(
            f"cu_seqlens: expected cu_seqlens[-1] a multiple of the {world} ranks with ulysses={ulysses} (each "
            f"ring shard is cut into {ulysses} equal pieces; balance {balance!r} splits any length only with "
            f"ulysses=1); got {seq_len}"
        )
    if n != seq_len // world:
        raise ValueError(
            f"{name}: expected {seq_len // world} tokens along the sequence dim (S / P of the {seq_len} tokens of "
            f"cu_seqlens over {world} ranks with ulysses={ulysses}); got {n}"
        )


def check_shard_length(name: str, n: int, seq_len: int, world: int, balance: str, rank: int | None) -> None:
    """Raise a ValueError naming ``name`` unless ``n`` tokens are rank ``rank``'s shard of ``seq_len`` under
    ``balance`` (with no rank: some rank's); :func:`xcp.schedule.shard_lengths`."""
    schedule.check_seq_len(seq_len, world, balance, what="cu_seqlens[-1]")
    lengths = schedule.shard_lengths(seq_len, world, balance)
    if (n == lengths[rank]) if rank is not None else (n in lengths):
        return
    want = lengths[rank] if rank is not None else " or ".join(map(str, sorted(set(lengths))))
    whose = "some rank's" if rank is None else f"rank {rank}'s"
    raise ValueError(
        f"{name}: expected {want} tokens along the sequence dim ({whose} shard of the {seq_len} tokens of "
        f"cu_seqlens under balance {balance!r} over {world} ranks); got {n}"
    )


def check_document_balance(balance: str, cu_seqlens: Any) -> bool:
    """Whether ``balance`` places by documents (:data:`xcp.schedule.DOCUMENT_BALANCES`); raises where such
    a balance comes without ``cu_seqlens``, which it places by."""
    if balance not in schedule.DOCUMENT_BALANCES:
        return False
    if cu_seqlens is None:
        raise ValueError(
            f"cu_seqlens: expected the documents' boundaries with balance {balance!r} (it places each document "
            "over the ranks); got None"
        )
    return True


def check_placement(balance: Any, cu_seqlens: Any, seq_len: int | None) -> tuple[int, ...] | None:
    """What :func:`xcp.shard` and :func:`xcp.unshard` place by: the checked boundaries (ending at
    ``seq_len`` where given) for a document balance, None for a whole-sequence balance, which refuses them
    (:func:`xcp.attention` takes the documents for every balance; placing by them is another matter)."""
    schedule.check_balance(balance, documents=True)
    if check_document_balance(balance, cu_seqlens):
        return check_cu_seqlens(_cu_seqlens_values(cu_seqlens), seq_len)
    if cu_seqlens is not None:
        raise ValueError(
            f"cu_seqlens: expected None with balance {balance!r}, which places the whole sequence (only "
            f"{', '.join(schedule.DOCUMENT_BALANCES)} places by documents); got {type(cu_seqlens).__name__} "
            "boundaries"
        )
    return None


def check_documents(
    cu_seqlens: Any,
    q: torch.Tensor,
    world: int,
    balance: str,
    window: Any,
    rank: int | None = None,
    ulysses: int = 1,
    chunk: int | None = None,
) -> tuple[int, ...] | None:
    """The documents a RingConfig takes: the checked boundaries, (0, S) with a window or a chunk and no
    documents, None for one sequence without either (the dense path). ``rank``: this rank, whose shard length a
    document balance fixes (without it, any rank's length passes). ``ulysses`` > 1: q is a ring shard of the
    hybrid (U pieces of equal length), over ``world`` = R ring ranks."""
    documents = _check_documents(cu_seqlens, q, world, balance, rank, ulysses)
    if (window is not None or chunk is not None) and documents is None:  # their plans work on (0, S)
        schedule.check_seq_len(q.shape[1] * world, world, balance, what="the global sequence length")
        documents = (0, q.shape[1] * world)
    return documents


def check_backend_serves(
    backend: Any,
    q: torch.Tensor,
    world: int,
    causal: bool,
    balance: str,
    device_type: str | None = None,
    value_dim: int | None = None,
) -> None:
    """Raise when ``backend`` cannot run on q (device type, dtype; values of another head dim,
    ``value_dim``, where it does not declare ``value_head_dims``) or zigzag cannot split q's shard over
    ``world`` ranks. ``device_type``: q's, where the caller has it (reading it costs as much as the rest)."""
    if backend.device_type != (device_type or q.device.type):
        raise ValueError(f"device: backend {backend.name!r} runs on {backend.device_type} tensors; q is on {q.device}")
    if q.dtype not in backend.dtypes:
        names = ", ".join(str(d) for d in backend.dtypes)
        raise TypeError(f"q: backend {backend.name!r} serves dtypes {names}; got {q.dtype}")
    if value_dim is not None and value_dim != q.shape[3] and not getattr(backend, "value_head_dims", False):
        raise ValueError(
            f"v: expected head dim {q.shape[3]} (that of q: backend {backend.name!r} does not declare "
            f"value_head_dims, the values of another head dim); got {value_dim}"
        )
    if world > 1 and causal and balance == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"q: balance 'zigzag' needs an even local sequence length (two chunks per rank); got {q.shape[1]}"
        )


# ----------------------------------------------------------------------------------------------------
# shard and unshard


def check_dim(x: torch.Tensor, dim: Any, name: str = "dim") -> int:
    """``dim`` as a non-negative index of x's dims."""
    if not schedule.is_integer(dim) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: expected an integer in [{-x.dim()}, {x.dim()}); got {dim!r}")
    return int(dim) % x.dim()


def check_shards(shards: Any, ragged_dim: Any = None) -> Sequence[torch.Tensor]:
    """``shards`` as given: a non-empty list of tensors alike in shape (but for their length along
    ``ragged_dim``, where given: a dim, checked), dtype and device."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise TypeError(f"shards: expected a non-empty list of tensors, one per rank; got {type(shards).__name__}")
    ragged: int | None = None
    for r, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{r}]: expected a torch.Tensor; got {type(s).__name__}")
        if r == 0 and ragged_dim is not None:
            ragged = check_dim(s, ragged_dim)
        if _shape_but(s, ragged) != _shape_but(shards[0], ragged):
            also = "" if ragged is None else f", any length along dim {ragged}"
            raise ValueError(
                f"shards[{r}]: expected shape {tuple(shards[0].shape)} (that of shards[0]{also}); got {tuple(s.shape)}"
            )
        if s.dtype != shards[0].dtype:
            raise TypeError(f"shards[{r}]: expected dtype {shards[0].dtype} (that of shards[0]); got {s.dtype}")
        if s.device != shards[0].device:
            raise ValueError(f"shards[{r}]: expected device {shards[0].device} (that of shards[0]); got {s.device}")
    return shards


def _shape_but(x: torch.Tensor, dim: int | None) -> tuple[int, ...]:
    """x's shape, with the length along ``dim`` (where given and x has it) left out."""
    shape = tuple(x.shape)
    return shape if dim is None or dim >= len(shape) else shape[:dim] + (-1,) + shape[dim + 1 :]


# ----------------------------------------------------------------------------------------------------
# The KV cache (xcp.inference.cache)

CacheLayout = tuple[int, int, int, torch.dtype, torch.device, int]
"""What a KV cache's tokens are: (batch, kv_heads, head_dim, dtype, device, value head_dim), fixed by its
first tokens."""


def check_cache_capacity(capacity: Any) -> int | None:
    """``capacity`` as an int (global tokens), or None."""
    if capacity is None:
        return None
    if not schedule.is_integer(capacity) or capacity < 1:
        raise ValueError(f"capacity: expected a positive integer (global tokens) or None; got {capacity!r}")
    return int(capacity)


def check_values_in_keys(values_in_keys: Any) -> int | None:
    """``values_in_keys`` (a value head dim Dv, or None) as an int, or None."""
    if values_in_keys is None:
        return None
    if not schedule.is_integer(values_in_keys) or values_in_keys < 1:
        raise ValueError(
            f"values_in_keys: expected None or a positive integer (the value head dim Dv: values are the keys' "
            f"first Dv channels); got {values_in_keys!r}"
        )
    return int(values_in_keys)


def check_cache_kv(
    k: Any, v: Any, layout: CacheLayout | None, names: tuple[str, str] = ("k", "v"), values_in_keys: int | None = None
) -> CacheLayout:
    """k and v of T >= 1 new tokens [batch, T, kv_heads, head_dim] (v's head dim may differ), and like the
    cache's ``layout`` (None for an empty cache); returns their layout. With ``values_in_keys`` = Dv the values
    are the keys' first Dv channels: v must be None, and Dv at most k's head dim."""
    nk, nv = names
    if values_in_keys is not None:
        if v is not None:
            raise ValueError(
                f"{nv}: expected None (KVCache(values_in_keys={values_in_keys}) reads the values from the keys' first "
                f"{values_in_keys} channels); got {type(v).__name__}"
            )
        _check_tensor(nk, k)
        if k.dim() == 4 and k.shape[3] < values_in_keys:
            raise ValueError(
                f"{nk}: expected a head dim of at least values_in_keys={values_in_keys} (the values are its first "
                f"channels); got {k.shape[3]}"
            )
        v = k[..., :values_in_keys]
    for name, x in ((nk, k), (nv, v)):
        _check_tensor(name, x)
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        want = ", ".join(map(str, k.shape[:3]))
        raise ValueError(
            f"{nv}: expected shape ({want}, Dv) (the batch, tokens and kv_heads of {nk}; any head dim Dv); got "
            f"{tuple(v.shape)}"
        )
    if v.dtype != k.dtype:
        raise TypeError(f"{nv}: expected dtype {k.dtype} (the dtype of {nk}); got {v.dtype}")
    if v.device != k.device:
        raise ValueError(f"{nv}: expected device {k.device} (the device of {nk}); got {v.device}")
    if k.shape[1] < 1:
        raise ValueError(f"{nk}: expected T >= 1 tokens along dim 1 of {LAYOUT}; got T = {k.shape[1]}")
    for name, x in ((nk, k), (nv, v)):
        if min(x.shape) < 1:
            raise ValueError(f"{name}: expected every dim of {LAYOUT} >= 1; got shape {tuple(x.shape)}")
    mine = (k.shape[0], k.shape[2], k.shape[3], k.dtype, k.device, v.shape[3])
    if layout is not None and mine != layout:
        _check_like(nk, mine[:5], layout[:5])
        _check_like(nv, mine, layout)  # the value head dim, the one field left to differ
    return mine


def _check_like(name: str, mine: tuple[Any, ...], layout: tuple[Any, ...]) -> None:
    for what, got, want in zip(("batch", "kv_heads", "head_dim", "dtype", "device", "value head_dim"), mine, layout):
        if got != want:
            error = TypeError if what == "dtype" else ValueError
            raise error(f"{name}: expected {what} {want} (that of the tokens in the cache); got {got}")


def check_cache_query(q: Any, layout: CacheLayout | None, seq_len: int) -> int:
    """q [batch, T, heads, head_dim] for a cache holding ``seq_len`` tokens of ``layout``: heads a multiple
    of the cache's kv_heads, 1 <= T <= seq_len; returns T."""
    if layout is None or seq_len == 0:
        raise ValueError("q: expected a cache that holds tokens (prefill or append first); got an empty cache")
    _check_tensor("q", q)
    b, t, h, d = q.shape
    if t < 1:
        raise ValueError(f"q: expected T >= 1 queries along dim 1 of {LAYOUT}; got T = {t}")
    if h < 1 or h % layout[1]:
        raise ValueError(f"q: expected a number of heads that the cache's {layout[1]} kv_heads divide; got {h}")
    _check_like("q", (b, layout[1], d, q.dtype, q.device, layout[5]), layout)
    if t > seq_len:
        raise ValueError(f"q: expected at most seq_len = {seq_len} queries (the last tokens of the cache); got T = {t}")
    return t


# ---------------------------------------------------------------------- the paged cache (xcp.PagedKVCache)
PAGED_LAYOUT = "[T, heads, head_dim]"


def check_num_blocks(num_blocks: Any, block_size: Any) -> tuple[int, int]:
    """``(num_blocks, block_size)`` of a paged cache's pool as positive ints."""
    for name, x in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not schedule.is_integer(x) or x < 1:
            raise ValueError(f"{name}: expected a positive integer; got {x!r}")
    return int(num_blocks), int(block_size)


def check_seq_batch(seq_ids: Any, cu_seqlens: Any, rows: int | None, what: str) -> tuple[tuple, tuple[int, ...]]:
    """``(seq_ids, cu_seqlens)`` of a packed batch as tuples: distinct hashable ids, and ``len(seq_ids) + 1``
    non-decreasing integer offsets (a list or an integer tensor) from 0 to ``rows`` (``what``'s size)."""
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, (list, tuple)):
        raise TypeError(f"seq_ids: expected a list or tuple of sequence ids; got {type(seq_ids).__name__}")
    ids = tuple(seq_ids)
    try:
        distinct = len(set(ids)) == len(ids)
    except TypeError as e:
        raise TypeError(f"seq_ids: expected hashable ids; got {e}") from None
    if not distinct:
        repeated = sorted({repr(i) for i in ids if ids.count(i) > 1})
        raise ValueError(f"seq_ids: expected distinct ids; got {', '.join(repeated)} more than once")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise TypeError(
                f"cu_seqlens: expected a 1-D integer tensor or a list; got {cu_seqlens.dim()}-D {cu_seqlens.dtype}"
            )
        cu_seqlens = cu_seqlens.tolist()  # one host read: the plan is made on the host
    if not isinstance(cu_seqlens, (list, tuple)) or not all(schedule.is_integer(c) for c in cu_seqlens):
        raise TypeError(f"cu_seqlens: expected a list of integers or an integer tensor; got {cu_seqlens!r}")
    cu = tuple(int(c) for c in cu_seqlens)
    if len(cu) != len(ids) + 1:
        raise ValueError(f"cu_seqlens: expected len(seq_ids) + 1 = {len(ids) + 1} offsets; got {len(cu)}")
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0; got {list(cu)}")
    if rows is not None and cu[-1] != rows:
        raise ValueError(f"cu_seqlens: expected the last offset to be {what} = {rows}; got {cu[-1]}")
    return ids, cu


def _check_paged_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor; got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims {PAGED_LAYOUT}; got {x.dim()} dims, shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype; got {x.dtype}")
    return x


def check_paged_kv(k: Any, v: Any, layout: CacheLayout | None, values_in_keys: int | None) -> CacheLayout | None:
    """k [T, kv_heads, head_dim] and v [T, kv_heads, Dv] (None with ``values_in_keys``) of a paged cache whose
    tokens are ``layout`` (None while empty), as :func:`check_cache_kv` checks a KV cache's (T may be 0);
    returns their layout (batch 1), or ``layout`` for a step of no token."""
    _check_paged_tensor("k", k)
    if values_in_keys is None:
        _check_paged_tensor("v", v)
    if k.shape[0] == 0:
        return layout
    return check_cache_kv(k.unsqueeze(0), None if v is None else v.unsqueeze(0), layout, ("k", "v"), values_in_keys)


def check_paged_query(q: Any, layout: CacheLayout | None, rows: list[tuple[Any, int, int]]) -> None:
    """q [T, heads, head_dim] against a paged cache of ``layout``, ``rows`` each listed sequence's
    ``(id, cached tokens, queries)``: heads a multiple of the kv_heads, at most as many queries as tokens."""
    if layout is None:
        raise ValueError("q: expected a cache that holds tokens (append first); got an empty cache")
    _check_paged_tensor("q", q)
    t, h, d = q.shape
    if h < 1 or h % layout[1]:
        raise ValueError(f"q: expected a number of heads that the cache's {layout[1]} kv_heads divide; got {h}")
    _check_like("q", (1, layout[1], d, q.dtype, q.device, layout[5]), layout)
    for seq_id, length, queries in rows:
        if queries > length:
            raise ValueError(
                f"cu_seqlens: expected at most seq_len({seq_id!r}) = {length} queries for it (its last tokens); "
                f"got {queries}"
            )
