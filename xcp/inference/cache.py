"""A KV cache sharded across the ranks of a group, for inference: prefill, append, attention.

Each rank keeps some tokens of one layer's keys and values, with their global positions
(:mod:`xcp.inference.plan` says which: a prefill's shard as :func:`xcp.shard` placed it, then one contiguous
piece of each appended chunk, rank ``position % P`` for a single token). :meth:`KVCache.attention` runs the
queries of the last T tokens against the rank's own tokens (the *local partial*: kernel calls through the
backend's ``forward`` / ``forward_varlen``), then combines the P partials with one collective: every rank
all-gathers every rank's ``[out | lse]`` packed in one buffer (float32; float64 for float64 inputs) and
merges them, ``L = logsumexp_r L_r``, ``O = sum_r exp(L_r - L) O_r`` (a rank that sees nothing of a row
has ``L_r = -inf`` and weight 0), folding the sinks in once after. So every rank ends with the same output,
and no rank ever holds more than its share of the keys and values. A world of one makes the local call
alone.

A cache with ``capacity`` is graph-safe: its storage is allocated once, and its lengths and positions also
live on the device (:mod:`xcp.inference.state`), so a decode step (``append`` of one token, ``attention`` of its
query) reads and advances them with device ops alone, runs its local partial through the backend's
``forward_range`` (the visible storage range given on the device), and can be captured into a device graph
and replayed. The host's own counters then lag behind and are read back from the device when next needed.

Lifetimes (docs/lifetime.md, rule 3.3): the packed partial is written on the caller's stream C and read
by the all-gather on the comm stream M, so it is handed to M under the backend's hand-off policy, and the
gather's receive buffer is made on C before M forks, as rule 1 has it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .. import schedule
from ..agreement import agree, fingerprint
from ..backends.base import range_forward, score_mods
from ..checks import (
    CacheLayout,
    check_backend_serves,
    check_backend_variants,
    check_cache_capacity,
    check_cache_kv,
    check_cache_query,
    check_causal,
    check_scale,
    check_sinks,
    check_ulysses,
    check_values_in_keys,
    check_variants,
)
from ..comm import resolve_group
from ..documents import check_window
from ..kernels.math import Alibi
from ..kernels.merge import NEG_INF, accumulator_dtype, apply_sinks_, packed_lse
from ..lifetime import check_handoff
from ..plugins import select_backend
from . import partials
from . import plan as cache_plan
from .state import DeviceCounts

GROWTH = 1.25
"""Without ``capacity``, storage that runs out grows to this many times its room (at least to what it needs):
appends stay amortised O(1) while room beyond the tokens held stays within a quarter of them."""


class KVCache:
    """This rank's part of ONE layer's keys and values of a batch of equal-length sequences.

    :param group: as for :func:`xcp.attention` (a ProcessGroup, a LocalWorld group, or None).
    :param balance: how the prompt given to :meth:`prefill` was sharded (as for :func:`xcp.shard`).
    :param capacity: N global tokens to preallocate room for, never reallocating (the graph-safe mode):
        rank r keeps room for ``N // P + (r < N % P)`` tokens, exactly its share at N (see
        :mod:`xcp.inference.plan`), plus one scratch row, allocated with the first tokens (which fix batch,
        heads, dtype and device). A decode step (T = 1) then never reads a length on the host and can be
        captured into a device graph (module docstring). More than N tokens is a ValueError naming the
        capacity: at once in an eager step, at the next host read after replayed ones. None: storage grows
        as needed.
    :param device: backend name, as for :func:`xcp.attention`; default the tensors' device type.
    :param handoff: the hand-off policy of the combine, overriding the backend's.
    :param timeout: as for :func:`xcp.attention`.
    :param ulysses: only 1: the cache is sharded over the ranks of ``group`` alone.
    :param combine: how a long chunk's partials are combined (:data:`xcp.inference.plan.COMBINES`): ``auto``
        (over heads between processes, one all-gather between virtual ranks), ``gather`` or ``heads``.
    :param values_in_keys: Dv where the values are the first Dv channels of the keys, as in multi-head latent
        attention's absorbed cache (DeepSeek-V3's latent ``kv_nope`` is the key's first 512 of 576 channels
        and the value): only the keys are stored, the values read as a view of them, and :meth:`prefill` /
        :meth:`append` take ``v=None``. None (the default): values of their own.
    """

    def __init__(
        self,
        group: Any = None,
        balance: str = schedule.DEFAULT_BALANCE,
        capacity: int | None = None,
        *,
        device: str | None = None,
        handoff: str | None = None,
        timeout: float | None = None,
        ulysses: int = 1,
        combine: str = "auto",
        values_in_keys: int | None = None,
    ) -> None:
        if check_ulysses(ulysses) != 1:
            raise NotImplementedError(
                f"ulysses: expected 1 (a KV cache is sharded over the ranks of its group, not over heads); "
                f"got ulysses={ulysses}"
            )
        self.balance = schedule.check_balance(balance)
        self.capacity = check_cache_capacity(capacity)
        self._comm = resolve_group(group, timeout)
        self._device = device
        self._handoff = None if handoff is None else check_handoff(handoff)
        self._world, self._rank = self._comm.size(), self._comm.rank()
        self.combine = cache_plan.check_combine(combine)
        self.values_in_keys = check_values_in_keys(values_in_keys)
        self._layout: CacheLayout | None = None
        self._k: torch.Tensor | None = None  # storage [B, room, Hkv, D]; rows [0, local_len) hold tokens
        self._v: torch.Tensor | None = None
        self._local = 0
        self._seq = 0
        self._runs: tuple[cache_plan.PositionRun, ...] = ()
        self._appended = False
        self._counts: DeviceCounts | None = None  # capacity caches: lengths and positions on the device
        self._lagging = False  # captured steps advance the device's counters, not these: read them back first

    # ------------------------------------------------------------------ what the cache holds
    @property
    def seq_len(self) -> int:
        """Tokens held by all ranks together (the next token's global position). After replayed steps
        this reads the device's counters (the host waits for the device)."""
        self._catch_up()
        return self._seq

    @property
    def local_len(self) -> int:
        """Tokens held by this rank (read as :attr:`seq_len` is)."""
        self._catch_up()
        return self._local

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's key and value storage (room included; values read from the keys count once)."""
        held = (self._k,) if self.values_in_keys is not None else (self._k, self._v)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def positions(self) -> list[int]:
        """The global positions of this rank's tokens, in storage order (increasing)."""
        self._catch_up()
        return [r.global0 + r.stride * t for r in self._runs for t in range(r.count)]

    def keys(self) -> torch.Tensor | None:
        """This rank's keys [B, local_len, Hkv, D] (a view of the storage), or None while empty."""
        self._catch_up()
        return None if self._k is None else self._k[:, : self._local]

    def values(self) -> torch.Tensor | None:
        """This rank's values, as :meth:`keys`."""
        self._catch_up()
        return None if self._v is None else self._v[:, : self._local]

    def _catch_up(self) -> None:
        """Read the device's counters back after captured steps ran (one host read), or raise if a replayed
        step went past the capacity."""
        if self._counts is None or not self._lagging:
            return
        seq, local, overflow = self._counts.read()
        if overflow:  # the host stays behind: every later call reads again and raises again
            raise ValueError(
                f"capacity: expected at most {self.capacity} tokens in the cache (KVCache(capacity={self.capacity})); "
                f"got {seq} after replayed decode steps: the {overflow} past the capacity were not kept, so the cache "
                "refuses every call"
            )
        runs = cache_plan.extend_decoded(self._runs, self._seq, seq, self._world, self._rank)
        held = sum(r.count for r in runs)
        if held != local:
            raise AssertionError(f"xcp.KVCache: the device holds {local} tokens of rank {self._rank}; the plan {held}")
        self._runs, self._seq, self._local, self._lagging = runs, seq, local, False
        self._appended = self._appended or seq > 0

    def __repr__(self) -> str:
        return (
            f"<KVCache rank {self._rank} of {self._world}: {self._local} of {self._seq} tokens, "
            f"balance {self.balance!r}, capacity {self.capacity}>"
        )

    # ------------------------------------------------------------------ filling
    def prefill(self, k_l: torch.Tensor, v_l: torch.Tensor | None) -> None:
        """Keep this rank's shard of a prompt, ``k_l`` [B, S / P, Hkv, D] and ``v_l`` [B, S / P, Hkv, Dv], as
        :func:`xcp.shard` made it with this cache's balance (what the rank passed to :func:`xcp.attention`); ``v_l``
        None with ``values_in_keys``. No communication; the tensors are copied, never kept."""
        self._catch_up()
        if self._seq:
            what = "append" if self._appended else "prefill"
            raise ValueError(f"prefill: expected an empty cache (prefill comes first, once); got one after {what}")
        layout = check_cache_kv(k_l, v_l, None, ("k_l", "v_l"), self.values_in_keys)
        n = k_l.shape[1]
        seq = n * self._world
        schedule.check_seq_len(seq, self._world, self.balance, what=f"k_l.shape[1] x {self._world} ranks")
        self._check_room(seq)
        self._store(layout, k_l, v_l)
        self._runs = cache_plan.prefill_runs(seq, self._world, self._rank, self.balance)
        self._seq = seq
        if self._counts is not None:
            self._counts.record(self._runs, self._seq, self._local)

    def append(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Add the next T tokens, ``k`` [B, T, Hkv, D] and ``v`` [B, T, Hkv, Dv], the same on every rank, at
        global positions ``seq_len .. seq_len + T - 1`` (``v`` None with ``values_in_keys``); this rank keeps its
        piece of them (:mod:`xcp.inference.plan`). No communication; the piece is copied."""
        layout = check_cache_kv(k, v, self._layout, values_in_keys=self.values_in_keys)
        t = k.shape[1]
        if t == 1 and self._counts is not None and self._k is not None and self._v is not None:
            self._append_on_device(k, v)
            return
        self._catch_up()
        self._refuse_capture("append", t, k.device)
        self._check_room(self._seq + t)
        first, count = cache_plan.chunk_pieces(self._seq, t, self._world)[self._rank]
        lo = first - self._seq
        local0 = self._local
        self._store(layout, k[:, lo : lo + count], None if v is None else v[:, lo : lo + count])
        self._runs = cache_plan.extend(self._runs, first, count)
        self._seq += t
        self._appended = True
        if self._counts is not None:
            self._counts.record((cache_plan.PositionRun(local0, first, 1, count),), self._seq, self._local)

    def _append_on_device(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """A decode step's append on a capacity cache: written in place at the row the device's counters
        name (:meth:`xcp.inference.state.DeviceCounts.append_token`). Eagerly the host keeps its counters in
        step and checks the capacity first; while capturing it cannot (the step runs again at every
        replay), so its counters lag until they are read back."""
        assert self._counts is not None and self._k is not None and self._v is not None
        backend = select_backend(self._device, k.device.type)
        capturing = backend.is_capturing()
        if not capturing and not self._lagging:
            self._check_room(self._seq + 1)
        values = None if v is None else (self._v, v)  # else the values are the keys' first channels, written
        self._counts.append_token(self._k, k, values)
        if capturing or self._lagging:
            self._lagging = True
            return
        first, count = cache_plan.chunk_pieces(self._seq, 1, self._world)[self._rank]
        self._runs = cache_plan.extend(self._runs, first, count)
        self._seq, self._local, self._appended = self._seq + 1, self._local + count, True

    def _refuse_capture(self, what: str, t: int, device: torch.device) -> None:
        """A step the host must plan (a chunk, or any step of a cache without capacity) cannot be captured."""
        if select_backend(self._device, device.type).is_capturing():
            raise RuntimeError(
                f"{what}: expected a decode step (T = 1) of a cache with capacity while capturing a device graph; "
                f"got T = {t}{'' if self.capacity is not None else ' on a cache without capacity'} (its kernel "
                "calls and placement are planned on the host from the cache's length, which a replay cannot change)"
            )

    def _check_room(self, seq: int) -> None:
        if self.capacity is not None and seq > self.capacity:
            raise ValueError(
                f"capacity: expected at most {self.capacity} tokens in the cache (KVCache(capacity={self.capacity})); "
                f"got {seq} (seq_len {self._seq} + {seq - self._seq} new)"
            )

    def _store(self, layout: CacheLayout, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Copy k, v (this rank's new tokens) after the tokens held, growing storage where allowed; with
        ``values_in_keys`` (v None) the value storage is a view of the keys' first channels."""
        n = k.shape[1]
        need = self._local + n
        if self._k is None or self._v is None or need > self._k.shape[1]:
            b, h, d, dtype, device, dv = layout
            dims = (d,) if v is None else (d, dv)
            if self.capacity is not None:  # once: the share at full capacity and a scratch row, zeroed (finite)
                room = cache_plan.held(self.capacity, self._world, self._rank)
                self._counts = DeviceCounts(room, self.capacity, self._world, self._rank, device)
                grown = [torch.zeros((b, room + 1, h, dim), dtype=dtype, device=device) for dim in dims]
            else:
                room = max(need, math.ceil(GROWTH * (0 if self._k is None else self._k.shape[1])))
                grown = [torch.empty((b, room, h, dim), dtype=dtype, device=device) for dim in dims]
            held = (self._k,) if v is None else (self._k, self._v)
            for new, old in zip(grown, held):
                if old is not None:
                    new[:, : self._local].copy_(old[:, : self._local])
            self._k = grown[0]
            self._v = grown[0][..., :dv] if v is None else grown[1]
        self._k[:, self._local : need].copy_(k)
        if v is not None:
            self._v[:, self._local : need].copy_(v)
        self._local, self._layout = need, layout

    # ------------------------------------------------------------------ attention
    def attention(
        self,
        q: torch.Tensor,
        causal: bool = True,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        sinks: torch.Tensor | None = None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """Exact attention of the last T tokens' queries over every cached token, the same on every rank.

        :param q: [B, T, H, D], the same on every rank: the queries at positions ``seq_len - T ..
            seq_len - 1`` (T = 1 decode, T > 1 a chunk of a chunked prefill); H a multiple of the cache's
            kv_heads (GQA).
        :param causal: query i sees the cached tokens at positions <= its own; else every cached token.
        :param scale: factor on q·k; default 1/sqrt(head_dim).
        :param window: ``(left, right)`` over global positions, as for :func:`xcp.attention`.
        :param sinks: [H], one value-less logit per head, as for :func:`xcp.attention`.
        :param softcap: logit soft-capping, as for :func:`xcp.attention`.
        :param alibi_slopes: ALiBi's slopes [H], as for :func:`xcp.attention`: the bias from the queries'
            positions and the global positions the cache keeps of its tokens (on the device, for a decode step
            of a capacity cache).
        :param chunk: chunked attention, as for :func:`xcp.attention`: a query sees the cached tokens of its
            own chunk of ``chunk`` positions (chunks aligned at position 0).
        :returns: [B, T, H, Dv] (the values' head dim) in q's dtype, equal on every rank.
        """
        decode = self._counts is not None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] == 1
        if not decode:
            self._catch_up()
        t = check_cache_query(q, self._layout, self._seq)
        causal = check_causal(causal)
        scale = check_scale(scale, q.shape[3])
        window = check_window(window, causal)
        sinks = check_sinks(sinks, q)
        softcap, alibi_slopes, chunk = check_variants(q, softcap, alibi_slopes, chunk)
        backend = select_backend(self._device, q.device.type)
        assert self._layout is not None  # check_cache_query refused an empty cache
        check_backend_serves(backend, q, 1, causal, self.balance, value_dim=self._layout[5])
        check_backend_variants(backend, softcap, alibi_slopes)
        variants = (softcap, alibi_slopes, chunk)
        if not decode:
            self._refuse_capture("attention", t, q.device)
        comm = self._comm
        if self._world > 1 and not backend.is_capturing():
            key = self._fingerprint(q, causal, scale, window, sinks, 0, variants)
            compared = lambda: self._fingerprint(q, causal, scale, window, sinks, self.seq_len, variants)  # noqa: E731
            agree(comm, backend, compared, q.device, key)
        acc = accumulator_dtype(q.dtype)
        if decode:
            local = functools.partial(self._decode_partial, backend, q, scale, window, softcap, alibi_slopes, chunk)
            packed = lambda: partials.pack(*local(), q.dtype)  # noqa: E731
        else:
            calls = cache_plan.chunked_calls(self._runs, self._seq, t, causal, window, chunk)
            k, v = self.keys(), self.values()
            assert k is not None and v is not None  # a cache with tokens has storage
            alibi = None
            if alibi_slopes is not None:
                q_pos = torch.arange(self._seq - t, self._seq, device=q.device)
                alibi = Alibi(alibi_slopes, q_pos, torch.tensor(self.positions(), dtype=torch.int64, device=q.device))
            mods = (softcap, alibi)
            local = functools.partial(partials.local_partial, backend, calls, q, k, v, scale, acc, mods)
            packed = functools.partial(partials.packed_partial, backend, calls, q, k, v, scale, q.dtype, mods)
        if self._world > 1 and not decode and self._combines_over_heads(t, q.shape[2]):
            return self._combine_over_heads(backend, packed, q, acc, sinks)
        out, lse = local() if self._world == 1 else self._combine(backend, packed, q, acc)
        if sinks is not None:
            out, lse = out.to(acc), lse.to(acc)  # fresh tensors (a kernel's, or the merge's): written in place
            apply_sinks_(out, lse, sinks)
        return out.to(q.dtype)

    def _decode_partial(
        self, backend: Any, q, scale: float, window, softcap, alibi_slopes, chunk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A capacity cache's local partial (out, lse) of the newest token's query, as the kernel gives them
        (a world of one without sinks returns that out as it is; the combine packs it,
        :func:`xcp.inference.partials.pack`): one ``backend.forward_range`` call over the storage range the
        device's counters give (every token held; with a window or a chunk, those it reaches), so the host reads
        no length; ALiBi's positions come from the device's counters too."""
        counts = self._counts
        assert counts is not None and self._k is not None and self._v is not None
        lo, hi = counts.visible(None if window is None else window[0], chunk)
        alibi = None if alibi_slopes is None else Alibi(alibi_slopes, counts.newest(), counts.positions)
        return range_forward(backend, q, self._k, self._v, lo, hi, scale, **score_mods(softcap, alibi))

    def _fingerprint(self, q, causal: bool, scale: float, window, sinks, seq_len: int, variants=(None,) * 3) -> tuple:
        """A call as :func:`xcp.agreement.fingerprint` has it, the cache's keys and values as shape
        [B, seq_len, Hkv, D]: the first call of a configuration compares the global length too (ranks that
        prefilled or appended differently), the agreed set keeps it as 0 (each decode step's length differs)."""
        assert self._layout is not None
        b, h, d, dtype, _, dv = self._layout
        like_k, like_v = (torch.empty((b, seq_len, h, dim), dtype=dtype, device="meta") for dim in (d, dv))
        return fingerprint(q, like_k, like_v, causal, self.balance, scale, None, sinks, window, 1, *variants)

    def _exchange(self, backend: Any, op: str, send: Callable[[], torch.Tensor], recv: torch.Tensor, tag: str,
                  meanwhile: Callable[[], Any] = lambda: None) -> Any:  # fmt: skip
        """:func:`xcp.inference.partials.exchange` over this cache's group and hand-off (docs/lifetime.md, rules 1
        and 3.3)."""
        return partials.exchange(self._comm, backend, self._handoff, op, send, recv, tag, meanwhile)

    def _combine(self, backend: Any, partial: Callable[[], torch.Tensor], q, acc: torch.dtype):
        """The merged (out [B, T, H, Dv], lse [B, H, T]) of every rank's partial
        (:func:`xcp.inference.partials.gather_merge`)."""
        assert self._layout is not None
        shape = (*q.shape[:3], self._layout[5])  # out has the values' head dim
        return partials.gather_merge(self._comm, backend, self._handoff, partial, shape, q.dtype, q.device)

    def _combines_over_heads(self, t: int, heads: int) -> bool:
        """``combine`` (:data:`xcp.inference.plan.COMBINES`) for a chunk of t queries over ``heads``."""
        if self.combine == "gather" or (self.combine == "auto" and getattr(self._comm, "ranks_are_threads", False)):
            return False
        over_heads = cache_plan.combine_over_heads(self._world, t, heads)
        return over_heads and callable(getattr(self._comm, "all_to_all", None))

    def _combine_over_heads(self, backend: Any, partial: Callable[[], torch.Tensor], q, acc: torch.dtype, sinks):
        """The merged output [B, T, H, Dv] in q's dtype, sinks folded in, of a long chunk: three collectives
        that move about P/2 times fewer bytes than one all-gather of the partials
        (:func:`xcp.inference.plan.combine_over_heads`).

        1. All-gather the lse [B, T, H] alone; every rank computes ``L = logsumexp_r L_r``.
        2. Each rank weighs its partial out by ``exp(L_r - L)`` (0 where it sees nothing: never NaN), in the
           accumulator dtype, rounded to the packed dtype once as the all-gather's packing would round it;
           an all-to-all gives rank j every rank's weighted slice of heads ``j·H/P .. (j+1)·H/P``, which it
           sums in the accumulator dtype (its heads' merged output) and folds its heads' sinks into.
        3. All-gather the merged slices."""
        assert self._layout is not None
        p, me = self._world, self._rank
        (b, t, h, _), d = q.shape, self._layout[5]  # out has the values' head dim
        hp, heads = h // p, slice(me * (h // p), (me + 1) * (h // p))
        packed = partial()  # [B, T, H, channels] on C
        out, lse = packed[..., :d], packed_lse(packed, d)
        lses = torch.empty((p, b, t, h), dtype=acc, device=q.device)
        self._exchange(backend, "all_gather", functools.partial(lse.to, acc, copy=True), lses, "combine")
        merged = torch.logsumexp(lses, dim=0)
        del lses

        pieces = torch.empty((p, b, t, hp, d), dtype=packed.dtype, device=q.device)
        self._exchange(backend, "all_to_all", functools.partial(_weighted, out, lse, merged, p), pieces, "combine")
        del packed, out, lse

        def merged_slice() -> torch.Tensor:
            mine = pieces.sum(dim=0, dtype=acc)  # [B, T, H/P, D]: this rank's heads, merged
            if sinks is not None:
                apply_sinks_(mine, merged[..., heads].transpose(1, 2).contiguous(), sinks[heads])
            return mine.to(q.dtype)

        slices = torch.empty((p, b, t, hp, d), dtype=q.dtype, device=q.device)
        self._exchange(backend, "all_gather", merged_slice, slices, "combine")
        return slices.permute(1, 2, 0, 3, 4).reshape(b, t, h, d)


def _weighted(out: torch.Tensor, lse: torch.Tensor, merged: torch.Tensor, world: int) -> torch.Tensor:
    """A partial ``out`` [B, T, H, D] weighed by ``exp(lse - merged)`` (lse and merged [B, T, H]; 0 where the
    rank sees nothing, or no rank does: never NaN) in the accumulator dtype, rounded to out's dtype once, and
    laid out [P, B, T, H/P, D]: row j the slice of heads rank j merges."""
    b, t, h, d = out.shape
    acc = merged.dtype
    weight = torch.exp(lse.to(acc) - torch.where(merged == NEG_INF, 0.0, merged))  # exp(-inf) = 0
    scaled = (out.to(acc) * weight.unsqueeze(-1)).to(out.dtype)
    return scaled.view(b, t, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()


__all__ = ["KVCache"]
