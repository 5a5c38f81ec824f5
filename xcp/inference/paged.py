"""A paged KV cache of many sequences, sharded across the ranks of a group: serving's continuous batches.

Requests of different lengths arrive and leave, prefill in chunks beside others' decode steps; their keys and
values live in a pool of fixed-size blocks per rank, a block table per sequence. Position p of any sequence
lives on rank ``(p // I) % P`` (:mod:`xcp.serving`), so every rank knows every rank's share of every
sequence from the global lengths alone, and plans a step for all ranks before writing anything: a step the
pool of some rank cannot hold is refused on every rank, the cache left as it was.

:meth:`PagedKVCache.attention` is :class:`xcp.KVCache`'s attention over a packed (THD) batch: each listed
sequence's local partial as kernel calls over segments (:mod:`xcp.inference.plan`, on the rank's tokens of that
sequence): where the backend reads the pool in place (:meth:`xcp.Backend.paged_in_place`), every call over a
prefix of a sequence's rows in one :meth:`xcp.Backend.forward_paged` call for the batch (where it reads it in place
only for one query per segment, ``max_q=1``, those calls: the decode rows), the rest on the sequence's rows
gathered from its blocks; every sequence's rows packed in one buffer, one all-gather of it for
the whole batch and the merge (:mod:`xcp.inference.partials`), sinks folded in once after. A row a rank sees nothing of
weighs 0; a row no rank sees is 0 with lse -inf.

Lifetimes (docs/lifetime.md): the packed partial goes to the comm stream under the hand-off policy (rule
3.3), as the KV cache's does. A sequence's blocks are read by its partial (on the caller's stream, inside
the combine, before the collective reads the packed partial) and written by appends on that same stream, so
a block freed and handed to another sequence is rewritten only after every read of it issued before.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..agreement import agree, fingerprint
from ..checks import (
    CacheLayout,
    check_backend_serves,
    check_backend_variants,
    check_causal,
    check_num_blocks,
    check_paged_kv,
    check_paged_query,
    check_scale,
    check_seq_batch,
    check_sinks,
    check_values_in_keys,
    check_variants,
)
from ..comm import resolve_group
from ..documents import PositionRun, check_window
from ..kernels.math import Alibi
from ..kernels.merge import accumulator_dtype, apply_sinks_
from ..lifetime import check_handoff
from ..plugins import select_backend
from . import partials
from . import plan as cache_plan
from .serving import check_placement, held, kept


@dataclasses.dataclass
class _Sequence:
    """One sequence: its global length, this rank's block table and the positions its rows hold."""

    length: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    runs: tuple[PositionRun, ...] = ()


class PagedKVCache:
    """This rank's part of ONE layer's keys and values of many sequences, in blocks.

    :param group: as for :func:`xcp.attention` (a ProcessGroup, a LocalWorld group, or None).
    :param num_blocks: the blocks of this rank's pool (every rank has as many).
    :param block_size: tokens a block holds.
    :param interleave: I: position p of a sequence lives on rank ``(p // I) % P``.
    :param device: backend name, as for :func:`xcp.attention`; default the tensors' device type.
    :param handoff: the hand-off policy of the combine, overriding the backend's.
    :param timeout: as for :func:`xcp.attention`.
    :param values_in_keys: Dv where the values are the keys' first Dv channels (as :class:`xcp.KVCache`'s):
        only keys are stored and :meth:`append` takes ``v=None``.

    The pool is allocated at the first :meth:`append` with tokens (which fixes heads, dims, dtype, device).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        num_blocks: int,
        block_size: int = 16,
        interleave: int = 1,
        device: str | None = None,
        handoff: str | None = None,
        timeout: float | None = None,
        values_in_keys: int | None = None,
    ) -> None:
        self._num_blocks, self.block_size = check_num_blocks(num_blocks, block_size)
        self._comm = resolve_group(group, timeout)
        self._world, self._rank = self._comm.size(), self._comm.rank()
        _, _, self.interleave = check_placement(self._world, self._rank, interleave)
        self._device = device
        self._handoff = None if handoff is None else check_handoff(handoff)
        self.values_in_keys = check_values_in_keys(values_in_keys)
        self._layout: CacheLayout | None = None
        self._k: torch.Tensor | None = None  # pool [num_blocks, block_size, Hkv, D]
        self._v: torch.Tensor | None = None
        self._seqs: dict[Hashable, _Sequence] = {}
        self._free = list(range(self._num_blocks - 1, -1, -1))  # this rank's free blocks (a stack: lowest first)
        self._used = [0] * self._world  # blocks in use on each rank, as every rank computes them

    # ------------------------------------------------------------------ what the cache holds
    @property
    def num_blocks(self) -> int:
        """The blocks of each rank's pool."""
        return self._num_blocks

    @property
    def free_blocks(self) -> int:
        """This rank's blocks that hold no sequence's tokens."""
        return len(self._free)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of sequence ``seq_id`` held by all ranks together (its next token's position)."""
        return self._sequence(seq_id).length

    def local_len(self, seq_id: Hashable) -> int:
        """Tokens of sequence ``seq_id`` this rank holds."""
        return held(self._sequence(seq_id).length, self._world, self._rank, self.interleave)

    def seq_ids(self) -> list[Hashable]:
        """The sequences the cache holds, in the order they started."""
        return list(self._seqs)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The blocks of this rank's pool that hold sequence ``seq_id``'s tokens, in position order."""
        return list(self._sequence(seq_id).blocks)

    def free_block_ids(self) -> list[int]:
        """The blocks of this rank's pool that hold no sequence's tokens (the next append takes the last first)."""
        return list(self._free)

    def _sequence(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"seq_id: expected a sequence the cache holds; got {seq_id!r}") from None

    def __repr__(self) -> str:
        return (
            f"<PagedKVCache rank {self._rank} of {self._world}: {len(self._seqs)} sequences, "
            f"{self.free_blocks} of {self._num_blocks} blocks of {self.block_size} free, interleave {self.interleave}>"
        )

    # ------------------------------------------------------------------ filling and freeing
    def append(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor | None, cu_seqlens) -> None:
        """Add tokens to sequences: ``k`` [T, Hkv, D] and ``v`` [T, Hkv, Dv] (None with ``values_in_keys``), the
        same on every rank, rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` the next tokens of ``seq_ids[i]`` (an id not
        seen before starts a sequence). This rank keeps its positions of them; no communication.

        Every rank's blocks are planned first: where some rank's pool cannot hold the step, a ValueError says
        which, on every rank, and nothing is written anywhere."""
        layout = check_paged_kv(k, v, self._layout, self.values_in_keys)
        self._refuse_capture("append", k.device)
        ids, cu = check_seq_batch(seq_ids, cu_seqlens, k.shape[0], "k.shape[0]")
        rows, sources = self._place(ids, cu)  # refuses a step some rank cannot hold before anything is allocated
        if layout is not None and self._k is None:
            self._allocate(layout)
        if rows:
            assert self._k is not None and self._v is not None
            where = torch.tensor(rows, dtype=torch.int64, device=k.device)
            which = torch.tensor(sources, dtype=torch.int64, device=k.device)
            self._k.view(-1, *self._k.shape[2:]).index_copy_(0, where, k.index_select(0, which))
            if v is not None:
                self._v.view(-1, *self._v.shape[2:]).index_copy_(0, where, v.index_select(0, which))

    def _place(self, ids: tuple, cu: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Plan an append of rows ``cu[i]:cu[i + 1]`` to sequence ``ids[i]`` (every rank's blocks counted first,
        the step refused on every rank where some pool cannot hold it), give the sequences their blocks and
        lengths, and return the pool rows (``block * block_size + offset``) of this rank's new tokens and their
        rows in the appended batch. Writes no tensor."""
        grows = [self._seqs[i].length if i in self._seqs else 0 for i in ids]
        self._check_fits(ids, cu, grows)
        rows: list[int] = []
        sources: list[int] = []
        for seq_id, start, n, c0 in zip(ids, grows, (b - a for a, b in zip(cu, cu[1:])), cu):
            seq = self._seqs.setdefault(seq_id, _Sequence())
            self._grow(seq, start + n)
            blocks, size = seq.blocks, self.block_size
            for first, count in kept(start, n, self._world, self._rank, self.interleave):
                local0 = held(first, self._world, self._rank, self.interleave)
                rows.extend(blocks[j // size] * size + j % size for j in range(local0, local0 + count))
                sources.extend(range(c0 + first - start, c0 + first - start + count))
                seq.runs = cache_plan.extend(seq.runs, first, count)
            seq.length = start + n
        return rows, sources

    @property
    def sink_block(self) -> int:
        """The pool's one block past ``num_blocks``: never any sequence's, the target of writes that must land in
        no live block (a padded row of a captured decode step, :class:`xcp.PagedDecode`)."""
        return self._num_blocks

    def free(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id``: its blocks go back to the pool (every rank's, as every rank counts them)."""
        seq = self._sequence(seq_id)
        for r in range(self._world):
            self._used[r] -= self._blocks_for(seq.length, r)
        self._free.extend(reversed(seq.blocks))
        del self._seqs[seq_id]

    def _blocks_for(self, length: int, rank: int) -> int:
        """The blocks ``rank`` needs for ``length`` tokens of one sequence."""
        return -(-held(length, self._world, rank, self.interleave) // self.block_size)

    def _check_fits(self, ids: tuple, cu: tuple[int, ...], starts: list[int]) -> None:
        """Count the step's new blocks on every rank, refusing (on every rank, writing nothing) a step some
        rank's pool cannot hold."""
        needs = [
            sum(self._blocks_for(s + cu[i + 1] - cu[i], r) - self._blocks_for(s, r) for i, s in enumerate(starts))
            for r in range(self._world)
        ]
        for r, need in enumerate(needs):
            free = self._num_blocks - self._used[r]
            if need > free:
                raise ValueError(
                    f"num_blocks: expected a pool that holds the step (PagedKVCache(num_blocks={self._num_blocks}, "
                    f"block_size={self.block_size})); got rank {r} needing {need} more blocks with {free} free "
                    f"(nothing was written; free sequences or give a larger pool)"
                )
        self._used = [used + need for used, need in zip(self._used, needs)]

    def _grow(self, seq: _Sequence, length: int) -> None:
        """Give ``seq`` the blocks this rank needs to hold ``length`` tokens of it (checked to be free)."""
        while len(seq.blocks) < self._blocks_for(length, self._rank):
            seq.blocks.append(self._free.pop())

    def _allocate(self, layout: CacheLayout) -> None:
        _, h, d, dtype, device, dv = layout
        shape = (self._num_blocks + 1, self.block_size, h)  # + the sink block (sink_block)
        self._k = torch.zeros((*shape, d), dtype=dtype, device=device)  # zeroed: a block's unused rows stay finite
        self._v = self._k[..., :dv] if self.values_in_keys is not None else torch.zeros((*shape, dv), dtype=dtype,
                                                                                         device=device)  # fmt: skip
        self._layout = layout

    # ------------------------------------------------------------------ attention
    def attention(
        self,
        q: torch.Tensor,
        seq_ids: Sequence[Hashable],
        cu_seqlens,
        *,
        causal: bool = True,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        sinks: torch.Tensor | None = None,
        return_lse: bool = False,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Exact attention of the newest tokens' queries of each listed sequence over its cached tokens, the same
        on every rank: one collective for the whole batch.

        :param q: [T, H, D], the same on every rank: rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` the queries of
            the last ``cu_seqlens[i + 1] - cu_seqlens[i]`` tokens of ``seq_ids[i]`` (decode: 1; a chunk of a
            chunked prefill: more; none: that sequence sits this step out); H a multiple of the kv_heads (GQA).
        :param causal: a query sees its sequence's cached tokens at positions <= its own; else all of them.
        :param scale: factor on q·k; default 1/sqrt(head_dim).
        :param window: ``(left, right)`` over each sequence's positions, as for :func:`xcp.attention`.
        :param sinks: [H], one value-less logit per head, as for :func:`xcp.attention`.
        :param return_lse: also return the natural-log lse [H, T] (float32; float64 for float64), sinks included.
        :param softcap: logit soft-capping, as for :func:`xcp.attention`.
        :param alibi_slopes: ALiBi's slopes [H], as for :func:`xcp.attention`: the bias from each sequence's
            positions.
        :param chunk: chunked attention, as for :func:`xcp.attention`: a query sees its sequence's tokens of its
            own chunk of ``chunk`` positions (chunks aligned at position 0).
        :returns: [T, H, Dv] in q's dtype (and the lse), equal on every rank; a row that sees no token is 0.
        """
        ids, cu = check_seq_batch(seq_ids, cu_seqlens, q.shape[0] if isinstance(q, torch.Tensor) else None,
                                  "q.shape[0]")  # fmt: skip
        seqs = [self._sequence(i) for i in ids] if self._layout is not None else []  # empty: refused below
        check_paged_query(q, self._layout, [(i, s.length, b - a) for i, s, a, b in zip(ids, seqs, cu, cu[1:])])
        assert self._layout is not None and self._k is not None and self._v is not None
        causal = check_causal(causal)
        scale = check_scale(scale, q.shape[2])
        window = check_window(window, causal)
        sinks = check_sinks(sinks, q.unsqueeze(0))
        softcap, alibi_slopes, chunk = check_variants(q.unsqueeze(0), softcap, alibi_slopes, chunk)
        backend = select_backend(self._device, q.device.type)
        self._refuse_capture("attention", q.device)
        check_backend_serves(backend, q.unsqueeze(0), 1, causal, "stripe", value_dim=self._layout[5])
        check_backend_variants(backend, softcap, alibi_slopes)
        variants = (softcap, alibi_slopes, chunk)
        if self._world > 1:
            self._agree(backend, q, cu, [s.length for s in seqs], causal, scale, window, sinks, variants)
        t, h, dv = q.shape[0], q.shape[1], self._layout[5]
        acc = accumulator_dtype(q.dtype)

        plain = softcap is None and alibi_slopes is None  # forward_paged takes no score modifier
        in_place = plain and backend.paged_in_place(q, self._k, self._v)
        one_query = in_place or (plain and reads_decode_in_place(backend, q, self._k, self._v))

        def packed(dtype: torch.dtype) -> torch.Tensor:
            """This rank's partial of every row, packed for inputs of ``dtype``: where the backend reads the pool
            in place, every call over a prefix of a sequence's rows without a mask in ONE paged call (no block
            copied); the rest (and everything on other backends) per sequence over its gathered rows."""
            out = partials.empty_packed((1, t, h), dv, dtype, q.device)
            paged: dict[bool, list[tuple[int, int, list[int], int]]] = {False: [], True: []}  # by causal: rows, keys
            for seq, c0, c1 in zip(seqs, cu, cu[1:]):
                calls = (
                    cache_plan.chunked_calls(seq.runs, seq.length, c1 - c0, causal, window, chunk) if c1 > c0 else ()
                )
                if one_query:  # every prefix call where the backend reads the pool in place, else its one-query ones
                    masks = [_paged_mask(c) if in_place or c.q1 - c.q0 == 1 else None for c in calls]
                    for c, m in zip(calls, masks):
                        if m is not None:
                            paged[m].append((c0 + c.q0, c0 + c.q1, seq.blocks, c.k1))
                    calls = tuple(c for c, m in zip(calls, masks) if m is None)
                if calls:
                    k, v = self._rows(seq)
                    mods = (softcap, None if alibi_slopes is None else _alibi(alibi_slopes, seq, c1 - c0, q.device))
                    partials.fill_packed(out[:, c0:c1], backend, calls, q[None, c0:c1], k, v, scale, mods)
            for masked, segments in paged.items():
                if segments:
                    self._fill_paged(out, backend, q, segments, scale, masked)
            return out

        if self._world == 1:
            out, lse = partials.unpack(packed(acc), dv)
        else:
            out, lse = partials.gather_merge(self._comm, backend, self._handoff, lambda: packed(q.dtype),
                                             (1, t, h, dv), q.dtype, q.device)  # fmt: skip
        if sinks is not None:  # out and lse are this call's own, in acc (unpack's or the merge's): written in place
            apply_sinks_(out, lse, sinks)
        result = out[0].to(q.dtype)
        return (result, lse[0].to(acc)) if return_lse else result

    def _refuse_capture(self, what: str, device: torch.device) -> None:
        """A paged step is planned on the host from the lengths (block tables, kernel calls), which a replayed
        device graph could not change: capturing one is refused."""
        if select_backend(self._device, device.type).is_capturing():
            raise RuntimeError(
                f"{what}: expected no device-graph capture (a paged cache plans each step on the host from the "
                "sequences' lengths, which a replay cannot change); got a call while capturing"
            )

    def _fill_paged(self, out: torch.Tensor, backend: Any, q: torch.Tensor,
                    segments: list[tuple[int, int, list[int], int]], scale: float, causal: bool) -> None:  # fmt: skip
        """Write the rows of ``segments`` (query rows ``a .. b - 1`` against the first ``keys`` rows of ``blocks``)
        into the packed partial ``out`` [1, T, H, channels] with one :meth:`xcp.Backend.forward_paged` call that
        reads the pool in place (``causal``: aligned bottom-right)."""
        assert self._k is not None and self._v is not None
        dev, dv = q.device, self._v.shape[-1]
        rows = [i for a, b, _, _ in segments for i in range(a, b)]
        cu = [0]
        for a, b, _, _ in segments:
            cu.append(cu[-1] + b - a)
        tables: dict[int, int] = {}  # a chunk's many segments share their sequence's table: uploaded once
        distinct: list[list[int]] = []
        for _, _, blocks, _ in segments:
            if id(blocks) not in tables:
                tables[id(blocks)] = len(distinct)
                distinct.append(blocks)
        width = max(len(blocks) for blocks in distinct)
        table = torch.tensor([blocks + [self.sink_block] * (width - len(blocks)) for blocks in distinct],
                             dtype=torch.int32, device=dev)  # fmt: skip
        if len(distinct) < len(segments):
            which = torch.tensor([tables[id(blocks)] for _, _, blocks, _ in segments], dtype=torch.int64, device=dev)
            table = table.index_select(0, which)
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        o, lse = backend.forward_paged(
            q.index_select(0, idx), self._k, self._v, table, torch.tensor(cu, dtype=torch.int32, device=dev),
            torch.tensor([keys for *_, keys in segments], dtype=torch.int32, device=dev),
            max(b - a for a, b, _, _ in segments), max(keys for *_, keys in segments), scale, causal,
        )  # fmt: skip
        out[0, idx, :, :dv] = o.to(out.dtype)
        lse_rows = partials.packed_lse(out, dv)
        lse_rows[0, idx] = lse.transpose(0, 1).to(lse_rows.dtype)

    def _rows(self, seq: _Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's keys and values of ``seq`` [1, local_len, Hkv, D], in position order, read from its blocks."""
        assert self._k is not None and self._v is not None
        n = held(seq.length, self._world, self._rank, self.interleave)
        blocks = torch.tensor(seq.blocks, dtype=torch.int64, device=self._k.device)
        k = self._k.index_select(0, blocks).flatten(0, 1)[None, :n]
        if self.values_in_keys is not None:
            return k, k[..., : self.values_in_keys]
        return k, self._v.index_select(0, blocks).flatten(0, 1)[None, :n]

    def _agree(self, backend: Any, q, cu: tuple[int, ...], lengths: list[int], causal, scale, window, sinks,
               variants: tuple) -> None:  # fmt: skip
        """The ranks' calls must match (shapes, options, batch and lengths): checked on the first call of a
        configuration (:func:`xcp.agreement.agree`), whose key leaves the batch, its tokens and the lengths out
        (they change at every step of a serving loop; a new key would cost the check's P - 1 hops again)."""
        assert self._layout is not None
        _, h, d, dtype, _, dv = self._layout

        def values(like_q: torch.Tensor, total: int, documents: tuple[int, ...] | None) -> tuple:
            like_k, like_v = (torch.empty((1, total, h, dim), dtype=dtype, device="meta") for dim in (d, dv))
            return fingerprint(like_q, like_k, like_v, causal, "stripe", scale, documents, sinks, window, 1,
                               *variants)  # fmt: skip

        compared = lambda: values(q.unsqueeze(0), sum(lengths), (*cu, *lengths))  # noqa: E731
        key_q = torch.empty((1, 0, *q.shape[1:]), dtype=q.dtype, device="meta")
        agree(self._comm, backend, compared, q.device, ("paged", self.interleave, *values(key_q, 0, None)))


def reads_decode_in_place(backend: Any, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the backend's ``forward_paged`` reads these pools in place for calls of one query per segment
    (``paged_in_place(..., max_q=1)``; False for a backend whose ``paged_in_place`` takes no ``max_q``)."""
    return _takes_max_q(type(backend).paged_in_place) and bool(backend.paged_in_place(q, k_pool, v_pool, max_q=1))


@functools.lru_cache(maxsize=64)
def _takes_max_q(method: Any) -> bool:
    """Whether a ``paged_in_place`` takes ``max_q`` (one written before it was added does not)."""
    try:
        return "max_q" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _paged_mask(call: Any) -> bool | None:
    """How :meth:`xcp.Backend.forward_paged` takes a planned call: one segment over a prefix of the sequence's
    rows (from row 0) without a mask (False: a decode step's call, a chunk's groups of rows with the same keys),
    or causal aligned bottom-right (True: a causal square from row 0, or a band ``(left, 0)`` whose left side
    reaches row 0 from every query); None for the rest (windows, chunked attention, calls not from row 0)."""
    if call.k0 != 0 or len(call.cu_q) != 2:
        return None
    if call.band is None:
        return call.causal
    left, right = call.band
    return True if right == 0 and left >= call.k1 - 1 else None


def _alibi(slopes: torch.Tensor, seq: _Sequence, queries: int, device: torch.device) -> Alibi:
    """ALiBi of one sequence's partial: its last ``queries`` positions against the positions of this rank's rows."""
    q_pos = torch.arange(seq.length - queries, seq.length, device=device)
    k_pos = [r.global0 + r.stride * i for r in seq.runs for i in range(r.count)]
    return Alibi(slopes, q_pos, torch.tensor(k_pos, dtype=torch.int64, device=device))


__all__ = ["PagedKVCache"]
