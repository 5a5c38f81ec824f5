"""Execute a ring plan: the forward pass, the backward pass, and the thin autograd Function over them.

Both passes are one step loop: :class:`_KVRing` rotates the K/V shards (step 0 reads the caller's own, each
later step a receive slot), the pass computes on the shard it holds. The ring owns the accumulators and the
merge. Forward and backward are plain functions so that virtual ranks on a GPU can drive them directly:
PyTorch runs the backward of CUDA tensors on one autograd worker thread per device, where a backward that
waits for its peers in other threads would never return.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import schedule
from .agreement import check_agreement
from .backends.base import Backend, add_into, score_mods, varlen_backward, varlen_forward
from .comm import Communicator
from .documents import Run, document_plan, join_runs, position_runs
from .kernels.math import Alibi
from .kernels.merge import accumulator_dtype, apply_sinks_, merge_, new_accumulators, sinks_grad
from .lifetime import RingCall, ShardSlots
from .spec import CallSpec, spec_values


@dataclass(frozen=True, init=False)
class RingConfig(CallSpec):
    """Everything one call needs besides the tensors: its :class:`~xcp.spec.CallSpec` (made as
    ``RingConfig(comm, backend, causal, scale, balance, slots, handoff, documents, window, ulysses)``, the
    spec's fields after the group and the backend) and where it runs.

    :param documents: global document boundaries ``(0, ..., S)`` of a packed sequence (checked by
        :func:`xcp.documents.check_cu_seqlens`), or None for one sequence.
    :param window: ``(left, right)`` sliding window over global positions (checked by
        :func:`xcp.documents.check_window`); needs ``documents`` (``(0, S)`` for one sequence).
    :param alibi_slopes: ALiBi's slopes [H] of the heads the ring computes (keyword only; checked by
        :func:`xcp.checks.check_alibi_slopes`), or None. A tensor, so not a field of the spec; the ranks agree
        on its shape and dtype (:mod:`xcp.agreement`).
    """

    comm: Communicator = field(kw_only=True)
    backend: Backend = field(kw_only=True)
    alibi_slopes: torch.Tensor | None = field(kw_only=True, default=None, compare=False)

    def __init__(
        self, comm: Communicator, backend: Backend, *spec: Any, alibi_slopes: torch.Tensor | None = None, **fields: Any
    ) -> None:
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "alibi_slopes", alibi_slopes)
        super().__init__(*spec, **fields)

    @classmethod
    def of(
        cls, comm: Communicator, backend: Backend, spec: CallSpec, alibi_slopes: torch.Tensor | None = None
    ) -> RingConfig:
        """The configuration of ``spec`` on ``comm`` and ``backend``."""
        return cls(comm, backend, alibi_slopes=alibi_slopes, **spec_values(spec))

    def _document_plan(self):
        return document_plan(
            self.documents, self.comm.size(), self.comm.rank(), self.causal, self.balance, self.window, self.chunk
        )

    @property
    def plan(self) -> schedule.Plan:
        """The ring's steps: all P, or as many as the documents and the window need."""
        steps = None if self.documents is None else len(self._document_plan().steps)
        return schedule.plan(self.comm.size(), self.comm.rank(), self.causal, self.balance, steps)

    def block_calls(self, n: int) -> tuple[tuple[BlockCall, ...], ...]:
        """The kernel calls of each step for local shards of ``n`` tokens (made once per configuration)."""
        if self.documents is None:
            return _dense_calls(self.comm.size(), self.comm.rank(), self.causal, self.balance, n)
        return _document_calls(self.documents, self.comm.size(), self.comm.rank(), self.causal, self.balance,
                               self.window, bool(self.backend.varlen_fillers), self.chunk)  # fmt: skip


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a step: query rows ``qs`` against key rows ``ks`` of the shard held, under
    ``mask``; ``cu`` the (cu_q, cu_k) of packed segments (a varlen call), None for a dense call."""

    qs: slice
    ks: slice
    mask: str
    cu: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    window: tuple[int, int] | None = None

    @classmethod
    def of(cls, run: Run) -> BlockCall:
        """The call of a run: dense for one unbanded segment, else varlen (a band always goes varlen)."""
        varlen = run.segments > 1 or run.band is not None
        return cls(
            slice(run.q0, run.q1), slice(run.k0, run.k1), run.mask, (run.cu_q, run.cu_k) if varlen else None, run.band
        )

    def forward(self, backend: Backend, q, k, v, scale: float, **mods: Any):
        """``(out, lse)`` of the call; ``mods``, the score modifications of its rows (:class:`Scores`)."""
        if self.cu is None:
            return backend.forward(q, k, v, self.mask, scale, **mods)
        return varlen_forward(backend, q, k, v, *self.cu, self.mask == "causal", scale, self.window, **mods)

    def backward(self, backend: Backend, dout, q, k, v, out, lse, scale: float, **mods: Any):
        """``(dq, dk, dv)`` of the call, from the rows' merged out and lse."""
        if self.cu is None:
            return backend.backward(dout, q, k, v, out, lse, self.mask, scale, **mods)
        causal = self.mask == "causal"
        return varlen_backward(backend, dout, q, k, v, out, lse, *self.cu, causal, scale, self.window, **mods)


@functools.lru_cache(maxsize=1024)
def _dense_calls(world: int, rank: int, causal: bool, balance: str, n: int) -> tuple[tuple[BlockCall, ...], ...]:
    plan = schedule.plan(world, rank, causal, balance)
    return tuple(_step_calls(st, n) if st.computes else () for st in plan.steps)


def _step_calls(step: schedule.Step, n: int) -> tuple[BlockCall, ...]:
    """The call of a dense step. A strictly causal block (stripe, src > r; always square) runs as causal
    attention of rows 1.. against keys ..n-2 of views of the same tensors: one causal call that writes its
    rows' results in place, where a kernel's own strict form is causal pieces concatenated and padded
    (copies of out, lse, dq, dk and dv); its row 0 sees no key of the block and is not touched."""
    qs, ks = _views(step, n)
    if step.mask != "strict":
        return (BlockCall(qs, ks, step.mask),)
    if qs.stop - qs.start < 2:
        return ()
    return (BlockCall(slice(qs.start + 1, qs.stop), slice(ks.start, ks.stop - 1), "causal"),)


@functools.lru_cache(maxsize=64)
def _document_calls(documents, world: int, rank: int, causal: bool, balance: str, window, fillers: bool = False,
                    chunk: int | None = None):  # fmt: skip
    """A step's calls: its runs, joined across the rows between them (:func:`join_runs`) where the backend's
    varlen kernel serves filler segments."""
    steps = document_plan(documents, world, rank, causal, balance, window, chunk).steps
    return tuple(tuple(BlockCall.of(r) for r in (join_runs(step) if fillers else step)) for step in steps)


def _views(step: schedule.Step, n: int) -> tuple[slice, slice]:
    """The query rows and key rows of a local shard of ``n`` tokens that ``step`` touches."""
    q0, q1 = step.q_range(n)
    k0, k1 = step.k_range(n)
    return slice(q0, q1), slice(k0, k1)


@functools.lru_cache(maxsize=256)
def shard_positions(seq_len: int, world: int, rank: int, balance: str, cu: tuple[int, ...] | None) -> tuple[int, ...]:
    """The global position of each local row of ``rank``'s shard (:func:`xcp.shard`'s placement; ``cu`` the
    documents, which only a document balance places by)."""
    placed = cu if balance in schedule.DOCUMENT_BALANCES else None
    return tuple(
        p
        for r in position_runs(seq_len, world, rank, balance, placed)
        for p in range(r.global0, r.global0 + r.stride * r.count, r.stride)
    )


class Scores:
    """The score modifications of one ring call (soft-capping, ALiBi), as each block call's keyword
    arguments (:func:`xcp.backends.base.score_mods`): none where the call has none.

    ALiBi's bias needs the global positions of the block's rows: the queries' are this rank's shard's, the
    keys' those of the shard held at the step, whose owner ``src`` the plan names; both from the placement
    (:func:`shard_positions`), so a strided (stripe) or cut (zigzag, document_zigzag) shard gives the bias of
    the whole sequence. Rows appended to a shorter shard as it travels (:func:`_travelling`) get position 0;
    no call reads them."""

    def __init__(self, cfg: RingConfig, q: torch.Tensor, n_keys: int) -> None:
        self.softcap = cfg.softcap
        self.slopes = cfg.alibi_slopes
        self.device, self.n_keys = q.device, n_keys
        world = cfg.comm.size()
        self.placement = (cfg.documents[-1] if cfg.documents is not None else q.shape[1] * world, world, cfg.balance,
                          cfg.documents)  # fmt: skip
        self._keys: dict[int, torch.Tensor] = {}
        self.q_pos = None if self.slopes is None else self._positions(cfg.comm.rank(), q.shape[1])

    def _positions(self, rank: int, n: int) -> torch.Tensor:
        seq_len, world, balance, cu = self.placement
        got = shard_positions(seq_len, world, rank, balance, cu)
        return torch.tensor(got + (0,) * (n - len(got)), dtype=torch.int64, device=self.device)

    def block(self, src: int, qs: slice, ks: slice) -> dict[str, Any]:
        """The keyword arguments of the call of query rows ``qs`` against key rows ``ks`` of ``src``'s shard."""
        if self.slopes is None or self.q_pos is None:
            return score_mods(self.softcap, None)
        k_pos = self._keys.get(src)
        if k_pos is None:
            k_pos = self._keys[src] = self._positions(src, self.n_keys)
        return score_mods(self.softcap, Alibi(self.slopes, self.q_pos[qs], k_pos[ks]))


def merge_block(backend: Backend, out, lse, block_out, block_lse, rows: slice = slice(None)) -> None:
    """Fold a block into the running (out, lse): the backend's fused kernel if it has one, else the eager merge."""
    if not backend.fused_merge_(out, lse, block_out, block_lse, rows):
        merge_(out, lse, block_out, block_lse, rows)


PAIR_MAX_BYTES = 16 << 20
"""The largest block output (forward) or block dQ (backward) the ring holds for the next block, in bytes.
Holding raises the pass's memory peak by that block, while the pass over the float32 rows it saves matters
only at short shards (at 2K tokens per rank it costs a third to a half of a block's kernel; at 8K, a few
%): so only small blocks are held, and long shards keep their memory peak. 16 MiB is 2K rows of 32 heads x
128 in bf16."""


class _Pairs:
    """Blocks folded into an accumulator as they come, two at a time where the backend can (one pass over the
    float32 rows for two blocks instead of two passes).

    A block whose first tensor is at most :data:`PAIR_MAX_BYTES` is held until the next: if that has the same
    key (the same rows), the two fold together (:meth:`_two`), else the held one folds alone (:meth:`_one`).
    Only a backend that ``folds_pairs`` gets blocks held; :meth:`_two` answering False (no kernel for these
    tensors) makes every later block fold alone.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.pairs = bool(backend.folds_pairs)
        self.held: tuple[Any, tuple[torch.Tensor, ...]] | None = None

    def add(self, key: Any, *block: torch.Tensor) -> None:
        """Fold ``block`` in, now or with the next block of the same ``key``."""
        held = self.held
        if held is not None and held[0] == key:
            self.held = None
            if not self._two(key, held[1], block):
                self.pairs = False  # no pair kernel for these tensors: one at a time from now on
                self._one(key, held[1])
                self._one(key, block)
            return
        self.flush()
        if self.pairs and block[0].numel() * block[0].element_size() <= PAIR_MAX_BYTES:
            self.held = (key, block)
        else:
            self._one(key, block)

    def flush(self) -> None:
        """Fold in the block held, if any."""
        if self.held is not None:
            key, block = self.held
            self.held = None
            self._one(key, block)

    def _one(self, key: Any, block: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError

    def _two(self, key: Any, first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> bool:
        raise NotImplementedError


class _PairedAdds(_Pairs):
    """The backward's additions into the dQ accumulator: a block is ``(dq, acc)``, the block's dQ and the
    accumulator's view of its rows; two of the same rows add in one pass (``backend.fused_add_pair_``)."""

    def _one(self, key: Any, block: tuple[torch.Tensor, ...]) -> None:
        grad, acc = block
        add_into(self.backend, acc, grad)

    def _two(self, key: Any, first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> bool:
        return self.backend.fused_add_pair_(second[1], first[0], second[0])


class _Running(_Pairs):
    """The running (out, lse) of a forward: a block is ``(block_out, block_lse)`` keyed by its rows; two of
    the same rows fold in one pass (``backend.fused_merge_pair_``). The first fold into rows covering the
    whole shard writes the accumulators instead of merging into zeros (a pair: ``fresh``, not read at all).
    """

    def __init__(self, backend: Backend, q: torch.Tensor, value_dim: int) -> None:
        super().__init__(backend)
        self.q, self.n, self.value_dim = q, q.shape[1], value_dim
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulators with every block folded in (zeros / -inf where no block came)."""
        self.flush()
        if self.out is None or self.lse is None:
            self.out, self.lse = new_accumulators(self.q, value_dim=self.value_dim)
        return self.out, self.lse

    def _whole(self, rows: slice) -> bool:
        return rows.start == 0 and rows.stop == self.n

    def _one(self, rows: slice, block: tuple[torch.Tensor, ...]) -> None:
        block_out, block_lse = block
        if self.out is None and self._whole(rows):  # nothing to merge into yet: the block is the result so far
            acc = accumulator_dtype(self.q.dtype)
            self.out = block_out.to(acc, memory_format=torch.contiguous_format, copy=True)
            self.lse = block_lse.to(acc, memory_format=torch.contiguous_format, copy=True)
            return
        if self.out is None or self.lse is None:
            self.out, self.lse = new_accumulators(self.q, value_dim=self.value_dim)
        merge_block(self.backend, self.out, self.lse, block_out, block_lse, rows)

    def _two(self, rows: slice, first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> bool:
        fresh = self.out is None and self._whole(rows)
        if fresh:
            out, lse = new_accumulators(self.q, empty=True, value_dim=self.value_dim)
        else:
            if self.out is None or self.lse is None:
                self.out, self.lse = new_accumulators(self.q, value_dim=self.value_dim)
            out, lse = self.out, self.lse
        if not self.backend.fused_merge_pair_(out, lse, (first[0], first[1]), (second[0], second[1]), rows, fresh):
            return False
        self.out, self.lse = out, lse
        return True


def flat_like(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A template (no memory of its own) for one flat buffer that holds x and then y, in ``dtype`` (default
    x's): what a slot of :func:`pair_views` is made like."""
    return x.new_empty(1, dtype=dtype or x.dtype).expand(x.numel() + y.numel())


def pair_views(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of ``flat`` (made like :func:`flat_like`) shaped like x and like y, laid out one after the other."""
    n = x.numel()
    return flat[:n].view(x.shape), flat[n:].view(y.shape)


class _KVRing:
    """The K/V shards of a ring call, step by step: rule 2 of xcp.lifetime around one exchange per step.

    ``begin(step)`` issues, on the comm stream, the send of the shard held now and the receive of the next
    one into the other slot; ``end()`` waits for it and makes the received shard current. Step 0 reads the
    caller's own K and V in place.

    A slot is ONE buffer holding K then V (their head dims may differ: multi-head latent attention), so
    every step after the first sends one tensor and receives one: half the point-to-point operations of
    sending them apart. Step 0 sends the caller's own K and V as they are (packing them would copy the
    shard), into the two views of the receiver's slot.
    """

    def __init__(self, call: RingCall | None, comm: Communicator, k: torch.Tensor, v: torch.Tensor, steps: int) -> None:
        """``call`` is None in a world of one rank (or a ring of one step), where nothing moves."""
        self.call, self.comm, self.k, self.v = call, comm, k, v
        slots = None if call is None else call.slots("kv", (flat_like(k, v),), steps=range(1, steps))
        self.slots: ShardSlots | None = slots
        self.current: tuple[torch.Tensor, ...] = (k, v)
        self._flat: torch.Tensor | None = None  # the slot held now, None at step 0 (the caller's own K and V)
        self._work: Any = None
        self._next: torch.Tensor | None = None

    def begin(self, step: schedule.Step) -> None:
        call = self.call
        if step.send_to is None or step.recv_from is None or call is None or self.slots is None:
            return
        (nxt,) = self.slots.slot(step.step + 1)
        self._next = nxt
        flat = self._flat
        sends = self.current if flat is None else (flat,)
        recvs = pair_views(nxt, self.k, self.v) if flat is None else (nxt,)  # a step 0 sends K and V apart
        with call.on_comm():
            call.comm_after_compute()  # the slot nxt was last read by the previous step's compute
            send = call.hand_to_comm(sends, "kv", ordered=True)
            self._work = _exchange(self.comm, send, recvs, step.send_to, step.recv_from, "kv", call.backend, step.step)

    def views(self, keys: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ``keys`` of the shard held now (pass them on, do not keep them: a kept view keeps
        the slot's memory alive past its hand-back; so they are made anew each step, never cached)."""
        return self.current[0][:, keys], self.current[1][:, keys]

    def end(self) -> None:
        if self._work is not None and self._next is not None:
            self._work.wait()
            self._flat, self._work, self._next = self._next, None, None
            self.current = pair_views(self._flat, self.k, self.v)


def _travelling(cfg: RingConfig, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as they travel the ring: as long as the longest shard, so that every rank's fit the same
    slots (document_zigzag shards differ by a token: zero rows are appended to the shorter ones, which no
    kernel call reads and whose dK/dV rows are dropped at home); k and v themselves where shards are alike."""
    cu = cfg.documents
    n = k.shape[1] if cu is None else schedule.shard_lengths(cu[-1], cfg.comm.size(), cfg.balance)[0]
    pad = (0, 0, 0, 0, 0, n - k.shape[1])
    return (k, v) if n == k.shape[1] else (torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad))


def _exchange(comm: Communicator, send, recv, to: int, frm: int, tag: str, backend: Backend, step: int) -> Any:
    """Send the tensors of ``send`` to rank ``to`` and receive ``recv`` from rank ``frm``, pairwise."""
    return comm.exchange([(t, to) for t in send], [(b, frm) for b in recv], tag, backend, step=step)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RingConfig, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (in q's dtype) and log-sum-exp (accumulator dtype, [B, H, S]).

    ``sinks`` [H]: one value-less logit per head, folded in once after the merge (the lse includes it).

    Step i computes (on the caller's stream C) on the shard of ``src`` while, on the comm stream M, that
    shard goes to the next rank and the shard of step i + 1 arrives from the previous one into the other
    of two slots (docs/design.md, buffer lifetime rules; xcp/lifetime.py).
    """
    comm, backend = cfg.comm, cfg.backend
    if comm.size() == 1 and cfg.documents is None:  # one dense block: the kernel's own output, nothing to merge
        return _local_forward(q, k, v, cfg, sinks)
    check_agreement(comm, backend, q, k, v, cfg, sinks)
    n = q.shape[1]
    running = _Running(backend, q, v.shape[3])
    plan = cfg.plan
    moves = len(plan.steps) > 1
    call = RingCall(comm, backend, q.device, cfg.slots, cfg.handoff) if moves else None
    k, v = _travelling(cfg, k, v)
    scores = Scores(cfg, q, k.shape[1])
    kv = _KVRing(call, comm, k, v, len(plan.steps))
    q_views: dict[tuple[int, int], torch.Tensor] = {}
    with call or contextlib.nullcontext():
        for step, blocks in zip(plan.steps, cfg.block_calls(n)):
            kv.begin(step)
            for b in blocks:
                q_rows = q_views.get((b.qs.start, b.qs.stop))
                if q_rows is None:  # made once per call: a ring has two or three kinds of rows
                    q_rows = q_views[b.qs.start, b.qs.stop] = q[:, b.qs]
                mods = scores.block(step.src, b.qs, b.ks)
                running.add(b.qs, *b.forward(backend, q_rows, *kv.views(b.ks), cfg.scale, **mods))
            kv.end()
        out, lse = running.result()  # inside the call: a held block folds on the caller's stream before the join
    if sinks is not None:
        apply_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cfg: RingConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients (dq, dk, dv) of this rank's shards, in the inputs' dtypes.

    K/V travel as in the forward; the dK/dV of a shard travel one step behind it, each rank adding its
    contribution, and a final hop returns them to their owner. dQ accumulates locally. Two KV slots and
    two dKV slots per rank, whatever the number of ranks. ``out`` and ``lse`` are the final ones (with
    the sinks folded in, where there are sinks).
    """
    comm, backend, plan = cfg.comm, cfg.backend, cfg.plan
    n = q.shape[1]
    calls = cfg.block_calls(n)
    m = len(plan.steps)
    if m == 1:  # one step on the own shard (a world of one, or a window within it): nothing moves
        return _local_backward(dout, q, k, v, out, lse, cfg, calls[0])
    n_k = k.shape[1]  # this rank's keys; k and v below as they travel (_travelling)
    k, v = _travelling(cfg, k, v)
    scores = Scores(cfg, q, k.shape[1])
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    call = RingCall(comm, backend, q.device, cfg.slots, cfg.handoff)
    kv = _KVRing(call, comm, k, v, m)
    dkv_slots = call.slots("dkv", (flat_like(k, v, acc),), steps=range(m + 1))  # dK then dV, one buffer
    views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    dq_adds = _PairedAdds(backend)
    with call:
        dkv_work: Any = None
        for step, blocks in zip(plan.steps, calls):
            i = step.step
            kv.begin(step)
            grads = []
            for b in blocks:
                qs = b.qs
                rows = views.get((qs.start, qs.stop))
                if rows is None:  # the rows' views, made once per call (a ring has two or three kinds)
                    rows = views[qs.start, qs.stop] = (dout[:, qs], q[:, qs], out[:, qs], lse[:, :, qs], dq[:, qs])
                g_out, g_q, g_o, g_lse, g_dq = rows
                mods = scores.block(step.src, qs, b.ks)
                g = b.backward(backend, g_out, g_q, *kv.views(b.ks), g_o, g_lse, cfg.scale, **mods)
                dq_adds.add((qs.start, qs.stop), g[0], g_dq)
                grads.append((b.ks, g[1], g[2]))
                del g
            if i == 0:
                (dkv,) = dkv_slots.slot(0, zero=True)
            else:
                dkv_work.wait()  # the dK/dV of src, from the previous rank, are in slot i
                (dkv,) = dkv_slots.slot(i)
            dk_acc, dv_acc = pair_views(dkv, k, v)
            for ks, gk, gv in grads:  # slot views made anew each step: a kept view would keep a slot alive
                add_into(backend, dk_acc[:, ks], gk)
                add_into(backend, dv_acc[:, ks], gv)
            del grads
            # after the last step this is the hop home: the owner of src is the next rank
            del dk_acc, dv_acc
            with call.on_comm():
                send = call.hand_to_comm((dkv,), "dkv")  # M waits for the additions above
                dkv_work = _exchange(
                    comm, send, dkv_slots.slot(i + 1), step.dkv_send_to, plan.dkv_recv_after(i), "dkv", backend, i
                )
            del send, dkv
            kv.end()
        dq_adds.flush()
        dkv_work.wait()
        dk_acc, dv_acc = pair_views(dkv_slots.slot(m)[0], k, v)
        # fresh tensors: results never alias the slots, which the workspace keeps for the next call
        dk, dv = dk_acc[:, :n_k].to(k.dtype, copy=True), dv_acc[:, :n_k].to(v.dtype, copy=True)
    return dq.to(q.dtype), dk, dv


def _local_forward(q, k, v, cfg: RingConfig, sinks: torch.Tensor | None):
    """The forward of a world of one without documents: one kernel call on the whole shard, its output
    cast to q's dtype (the kernel accumulates in float32 itself), and the sinks folded in, if any."""
    mods = Scores(cfg, q, k.shape[1]).block(0, slice(None), slice(None))
    out, lse = cfg.backend.forward(q, k, v, "causal" if cfg.causal else "none", cfg.scale, **mods)
    acc = accumulator_dtype(q.dtype)
    if sinks is not None:
        out, lse = out.to(acc), lse.to(acc)  # fresh or the kernel's own: ours to change in place
        apply_sinks_(out, lse, sinks)
    elif lse.dtype != acc:
        lse = lse.to(acc)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _local_backward(dout, q, k, v, out, lse, cfg: RingConfig, blocks: Sequence[BlockCall]):
    """The backward of a ring of one step: one call as it is, or the varlen calls of the documents."""
    backend = cfg.backend
    n = q.shape[1]
    scores, me = Scores(cfg, q, k.shape[1]), cfg.comm.rank()  # a ring of one step: the rank's own keys
    if len(blocks) == 1 and blocks[0].qs == slice(0, n) and blocks[0].ks == slice(0, n):
        g = blocks[0].backward(
            backend, dout, q, k, v, out, lse, cfg.scale, **scores.block(me, slice(None), slice(None))
        )
        return tuple(x.to(like.dtype).contiguous() for x, like in zip(g, (q, k, v)))
    acc = accumulator_dtype(q.dtype)
    grads = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v)]
    for b in blocks:
        qs, ks = b.qs, b.ks
        g = b.backward(backend, dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs], cfg.scale,
                       **scores.block(me, qs, ks))  # fmt: skip
        for total, x, where in zip(grads, g, (qs, ks, ks)):
            add_into(backend, total[:, where], x)
    return tuple(x.to(like.dtype) for x, like in zip(grads, (q, k, v)))


ONCE_DIFFERENTIABLE = (
    "xcp.attention: expected one backward (its backward is once_differentiable, as flash kernels are); got a "
    "second one through it (a grad of gradients made with create_graph=True)"
)


class _SecondBackward(torch.autograd.Function):
    """The gradients of a backward made with ``create_graph=True``, as they are, in a graph that reaches
    what they depend on: a grad of them arrives here and raises :data:`ONCE_DIFFERENTIABLE`, the same at
    every world size, instead of PyTorch's "not used in the graph" or a silent wrong second-order term."""

    @staticmethod
    def forward(ctx, count: int, *tensors: torch.Tensor):
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise RuntimeError(ONCE_DIFFERENTIABLE)


def once_differentiable(
    grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    """``grads``, a backward's results, as they are; where the backward runs with ``create_graph=True``
    (grad mode on) and one of ``inputs`` (the forward's inputs and the incoming gradients) needs a
    gradient, tied to ``inputs`` by :class:`_SecondBackward`, so that a second backward raises."""
    links = [x for x in inputs if x is not None and x.requires_grad]
    if not torch.is_grad_enabled() or not links:
        return tuple(grads)
    present = [g for g in grads if g is not None]
    tied = iter(_SecondBackward.apply(len(present), *present, *links))
    return tuple(None if g is None else next(tied) for g in grads)


LSE_GRADIENT = (
    "return_lse: gradients through lse are not supported; expected no gradient (or zeros) to reach the lse "
    "of xcp.attention(..., return_lse=True); got a non-zero one (use lse.detach() where it enters the loss)"
)


def check_lse_grad(dlse: torch.Tensor | None) -> None:
    """Raise :data:`LSE_GRADIENT` where a non-zero gradient reached the lse of ``return_lse=True``: the
    backward takes the output's gradient only, and ignoring one of the lse would be a wrong gradient. None
    (lse unused) or zeros add nothing. Reads one flag on the host, only when a gradient came."""
    if dlse is not None and bool(dlse.ne(0).any()):
        raise RuntimeError(LSE_GRADIENT)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: returns ``(out, lse)``, saves (q, k, v, out, lse, sinks) and runs
    :func:`ring_backward`; the sinks' gradient is this rank's share (its rows), which ranks sum like any
    replicated parameter's. A non-zero gradient of lse raises (:func:`check_lse_grad`); gradients are not
    materialised, so an unused lse costs nothing.

    Differentiable once, as flash kernels are: a double backward (``create_graph=True`` then a second
    grad) raises instead of returning wrong second-order terms.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg: RingConfig):
        out, lse = ring_forward(q, k, v, cfg, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cfg = cfg
        ctx.thread = threading.get_ident()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        cfg = ctx.cfg
        if cfg.comm.size() > 1 and cfg.comm.ranks_are_threads and threading.get_ident() != ctx.thread:
            raise RuntimeError(
                f"xcp: autograd ran the backward of LocalWorld rank {cfg.comm.rank()} outside its thread "
                f"(device {ctx.saved_tensors[0].device}); PyTorch runs GPU backward on one worker thread per "
                "device, where a ring that waits for its peers would hang. Drive virtual ranks on this device "
                "with xcp.ring_forward / xcp.ring_backward, or use real ranks (torchrun)."
            )
        check_lse_grad(dlse)
        if dout is None:  # only lse's gradient came, and it is zero
            return None, None, None, None, None
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with torch.no_grad():
            dout_c = dout.contiguous()
            dq, dk, dv = ring_backward(dout_c, q, k, v, out, lse, cfg)
            dsinks = sinks_grad(dout_c, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return (*once_differentiable((dq, dk, dv, dsinks), (q, k, v, sinks, dout)), None)
