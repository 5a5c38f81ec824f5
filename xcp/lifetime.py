"""Buffer lifetimes of one ring call: streams, receive slots, hand-offs, workspace and ledger.

Five rules keep every ring buffer valid and bounded; this module is where each one is kept (docs/design.md
states them, docs/lifetime.md says why each holds):

1. Fork/join (:class:`RingCall`): the comm stream M first waits on the caller's stream C; before the
   call returns, C waits on M. Ring buffers are allocated while C is current, before the fork.
2. Two slots (:class:`ShardSlots`): received KV (and dKV) shards land in two buffers used ping-pong; the
   receive into a slot is issued on M only after M waited for the compute that last read it
   (:meth:`RingCall.comm_after_compute`); the send that last read it ran earlier on M itself.
3. Hand-off (:meth:`RingCall.hand_to_comm`, :func:`hand_off`): a tensor made on C and read on M is ordered
   by an event and given to M under the backend's policy (``record_stream``, ``clone``, ``event``,
   ``none``), or the call's override, using the backend's primitives (``record_stream``, streams).
4. Graph capture: while the backend captures, slots come from the workspace, nothing of the ring is
   allocated or freed inside the step loop, and ``record_stream`` is replaced by ``event``.
5. Ledger (:func:`track_buffers`): every slot and hand-off copy is counted per rank (per thread).

Two policies, two names: the *slot* policy (``slots=``: ``bounded`` or ``keep_all``) says how many receive
buffers a call keeps; the *hand-off* policy (``handoff=``) says how a tensor passes between streams.
``keep_all`` reproduces the unbounded behaviour of other libraries (one fresh buffer per received shard,
all kept until the call ends) so benchmarks and tests can show the difference.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .schedule import check_choice

SLOT_POLICIES = ("bounded", "keep_all")
"""How many receive buffers a call keeps: two used ping-pong, or one per step (for comparisons only)."""

HANDOFF_POLICIES = ("record_stream", "clone", "event", "none")
"""How a tensor made on one stream is given to another (rule 3)."""

WORKSPACE_CAPACITY = 4
"""Buffer sets (one per role, shapes, dtype and device) a rank keeps between calls; older ones are dropped."""


def check_slots(slots: str) -> str:
    """Return the slot policy ``slots`` if known, else raise a ValueError listing the known ones."""
    return check_choice("slots", slots, SLOT_POLICIES)


def check_handoff(handoff: str) -> str:
    """Return the hand-off policy ``handoff`` if known, else raise a ValueError listing the known ones."""
    return check_choice("handoff", handoff, HANDOFF_POLICIES)


# ----------------------------------------------------------------------------------------------------
# Ledger (rule 5)


@dataclass
class BufferLedger:
    """Bytes and shards of ring buffers alive now and at peak, for one rank (one thread).

    ``peak_kv_shards`` counts received KV and dKV shards alive at once (a K and V pair is one shard);
    hand-off copies count in bytes only. ``allocations`` counts buffers made anew (a workspace hit is
    not one). The workspace keeps its buffers between calls; ``live_bytes`` counts what calls hold.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    live_kv_shards: int = 0
    peak_kv_shards: int = 0
    allocations: int = 0
    _live: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _next: int = field(default=0, repr=False)

    def add(self, nbytes: int, shards: int = 1, new: bool = True) -> int:
        """Count a buffer of ``nbytes`` holding ``shards`` shards; return a token for :meth:`release`."""
        self._next += 1
        self._live[self._next] = (nbytes, shards)
        self.allocations += int(new)
        self.live_bytes += nbytes
        self.live_kv_shards += shards
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_kv_shards = max(self.peak_kv_shards, self.live_kv_shards)
        return self._next

    def release(self, token: int) -> None:
        """Stop counting the buffer of ``token`` (it is no longer referenced by the ring)."""
        nbytes, shards = self._live.pop(token)
        self.live_bytes -= nbytes
        self.live_kv_shards -= shards


_local = threading.local()


def _ledgers() -> list[BufferLedger]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def track_buffers() -> Iterator[BufferLedger]:
    """Count the ring buffers of every xcp call made in this thread (one rank) inside the block."""
    ledger = BufferLedger()
    stack = _ledgers()
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.remove(ledger)


Tokens = list[tuple[BufferLedger, int]]


def _count(tensors: Iterable[torch.Tensor], shards: int, new: bool) -> Tokens:
    stack = _ledgers()
    if not stack:
        return []
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [(ledger, ledger.add(nbytes, shards, new)) for ledger in stack]


def _uncount(tokens: Tokens) -> None:
    for ledger, token in tokens:
        ledger.release(token)


# ----------------------------------------------------------------------------------------------------
# Per-rank store: the comm stream and the workspace


def thread_store() -> dict:
    """A dict kept per thread: where a process's rank (one per process or thread) keeps its streams and
    workspace. Communicators whose ranks share a thread keep one store per rank instead."""
    if not hasattr(_local, "store"):
        _local.store = {}
    return _local.store


def _rank_store(comm: Any) -> dict:
    """The dict where this rank keeps its comm streams and workspace (see ``Communicator.rank_store``)."""
    return comm.rank_store()


def comm_stream(comm: Any, backend: Any, device: torch.device) -> Any:
    """This rank's communication stream M for ``backend`` on ``device``, created once and reused."""
    streams = _rank_store(comm).setdefault("streams", {})
    key = (backend, str(device))
    stream = streams.get(key)
    if stream is None:
        stream = streams[key] = backend.new_stream(device)
    return stream


class Workspace:
    """Ring buffers a rank keeps between calls, so repeated calls with the same shapes allocate nothing.

    Keyed by role (``kv``, ``dkv``), shapes, dtype and device; at most :data:`WORKSPACE_CAPACITY` keys,
    least recently used dropped first. ``ready`` is an event recorded on the caller's stream when the last
    call using the buffers joined; the next call waits on it, so calls from different streams are ordered.
    Buffers are never returned to a caller (results are always fresh tensors).
    """

    def __init__(self, capacity: int = WORKSPACE_CAPACITY) -> None:
        self.capacity = capacity
        self.ready: Any = None
        self._sets: OrderedDict[tuple, dict[int, list[torch.Tensor]]] = OrderedDict()

    def buffers(self, key: tuple) -> dict[int, list[torch.Tensor]]:
        """The slot buffers of ``key`` (slot index -> tensors), created empty on first use."""
        if key in self._sets:
            self._sets.move_to_end(key)
        else:
            self._sets[key] = {}
            while len(self._sets) > self.capacity:
                self._sets.popitem(last=False)
        return self._sets[key]

    def nbytes(self) -> int:
        """Bytes the workspace holds."""
        return sum(t.numel() * t.element_size() for s in self._sets.values() for b in s.values() for t in b)

    def clear(self) -> None:
        """Drop every buffer."""
        self._sets.clear()
        self.ready = None


def workspace(comm: Any) -> Workspace:
    """The workspace of this rank (of ``comm``'s LocalWorld rank, or of this thread)."""
    store = _rank_store(comm)
    ws = store.get("workspace")
    if ws is None:
        ws = store["workspace"] = Workspace()
    return ws


def clear_workspace(comm: Any = None) -> None:
    """Drop the reusable buffers of ``comm``'s rank, or of this thread when ``comm`` is None."""
    store = _rank_store(comm) if comm is not None else thread_store()
    ws = store.get("workspace")
    if ws is not None:
        ws.clear()


@contextlib.contextmanager
def workspace_disabled() -> Iterator[None]:
    """Inside the block, calls made in this thread allocate their slots per call (no workspace)."""
    old = getattr(_local, "no_workspace", False)
    _local.no_workspace = True
    try:
        yield
    finally:
        _local.no_workspace = old


def _workspace_enabled() -> bool:
    return not getattr(_local, "no_workspace", False)


# ----------------------------------------------------------------------------------------------------
# Slots (rule 2)


class ShardSlots:
    """Receive buffers for shards of the ring (a shard is a tuple of tensors, e.g. (K, V)).

    ``bounded``: the buffers of the slot indices ``steps`` use (at most two, ``step % 2``) are made or
    taken from the workspace up front, before the ring forks its comm stream. ``keep_all``: a fresh buffer
    per step, made on first use, all alive until :meth:`release`.
    """

    def __init__(
        self,
        like: Sequence[torch.Tensor],
        slots: str = "bounded",
        dtype: torch.dtype | None = None,
        steps: Iterable[int] = (0, 1),
        preset: dict[int, list[torch.Tensor]] | None = None,
    ) -> None:
        self._like = list(like)
        self._dtype = dtype
        self._policy = check_slots(slots)
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._tokens: dict[int, Tokens] = {}
        if self._policy == "bounded":
            for key in sorted({self._key(s) for s in steps}):
                have = preset.get(key) if preset is not None else None
                bufs = have if have is not None else self._allocate(False)
                if preset is not None:
                    preset[key] = bufs
                self._slots[key] = bufs
                self._tokens[key] = _count(bufs, 1, have is None)

    def _allocate(self, zero: bool) -> list[torch.Tensor]:
        make = torch.zeros_like if zero else torch.empty_like
        return [make(t, dtype=self._dtype or t.dtype, memory_format=torch.contiguous_format) for t in self._like]

    def _key(self, step: int) -> int:
        """The slot index the shard of ``step`` lives in."""
        return step % 2 if self._policy == "bounded" else step

    def slot(self, step: int, zero: bool = False) -> list[torch.Tensor]:
        """The buffers that receive (or hold) the shard of ``step``; zero-filled when ``zero``."""
        key = self._key(step)
        bufs = self._slots.get(key)
        if bufs is None:
            bufs = self._slots[key] = self._allocate(zero)
            self._tokens[key] = _count(bufs, 1, True)
        elif zero:
            for b in bufs:
                b.zero_()
        return bufs

    def release(self) -> None:
        """Drop every slot and stop counting it."""
        self._slots.clear()
        for tokens in self._tokens.values():
            _uncount(tokens)
        self._tokens.clear()


# ----------------------------------------------------------------------------------------------------
# One call (rules 1, 3, 4)


class RingCall:
    """The streams, slots and hand-offs of one ring call on one rank.

    Make the slots with :meth:`slots`, then enter the call (the fork); leaving it joins the streams and
    releases everything the call held::

        call = RingCall(comm, backend, device, slots, handoff)
        kv = call.slots("kv", (k, v), steps=range(1, P))
        with call:
            ...  # per step: with call.on_comm(): call.comm_after_compute(); call.hand_to_comm(...); exchange
    """

    def __init__(self, comm: Any, backend: Any, device: torch.device, slots: str, handoff: str | None) -> None:
        self.backend = backend
        self.capturing = bool(backend.is_capturing())
        self.slot_policy = check_slots(slots)
        chosen = check_handoff(handoff or backend.handoff_policy)
        if self.capturing and chosen in ("record_stream", "clone"):
            chosen = "event"  # rule 4: no record_stream and no per-step copies while capturing
        self.handoff_policy = chosen
        if self.capturing and self.slot_policy == "keep_all":
            raise ValueError("slots: 'keep_all' allocates a buffer per step, which graph capture forbids")
        self.workspace = workspace(comm) if _workspace_enabled() and self.slot_policy == "bounded" else None
        if self.capturing and self.workspace is None:
            raise RuntimeError("xcp: graph capture needs the workspace (do not capture inside workspace_disabled())")
        self.device = device
        self.caller = backend.current_stream(device)
        self.comm_stream = comm_stream(comm, backend, device)
        self._slots: list[ShardSlots] = []
        self._keep: list[torch.Tensor] = []
        self._clones: dict[str, Tokens] = {}
        self._order_event: Any = None

    # -- rule 2: slots
    def slots(
        self, role: str, like: Sequence[torch.Tensor], dtype: torch.dtype | None = None, steps: Iterable[int] = (0, 1)
    ) -> ShardSlots:
        """Receive slots shaped like ``like`` for the shards of ``steps``; call before entering the call."""
        preset = None
        if self.workspace is not None:
            key = (role, tuple(tuple(t.shape) for t in like), dtype or like[0].dtype, str(like[0].device))
            preset = self.workspace.buffers(key)
            if self.capturing:
                missing = {s % 2 for s in steps} - set(preset)
                if missing:
                    raise RuntimeError(
                        f"xcp: graph capture found no {role} buffers for shapes {key[1]} {key[2]} in the workspace; "
                        "run one call with the same shapes before capturing (rule 4: nothing is allocated in the "
                        "captured step loop)"
                    )
        slots = ShardSlots(like, self.slot_policy, dtype, steps, preset)
        self._slots.append(slots)
        return slots

    # -- rule 1: fork and join
    def __enter__(self) -> RingCall:
        be = self.backend
        ready = self.workspace.ready if self.workspace is not None else None
        if ready is not None and not self.capturing:
            be.wait_event(self.caller, ready)
        be.wait_stream(self.comm_stream, self.caller)
        return self

    def __exit__(self, *exc: Any) -> None:
        be = self.backend
        be.wait_stream(self.caller, self.comm_stream)
        if self.workspace is not None and not self.capturing:
            ready = be.new_event()
            be.record_event(ready, self.caller)
            self.workspace.ready = ready
        self._keep.clear()
        for tokens in self._clones.values():
            _uncount(tokens)
        self._clones.clear()
        for slots in self._slots:
            slots.release()
        self._slots.clear()

    def on_comm(self) -> contextlib.AbstractContextManager:
        """A context in which the comm stream M is current (exchanges are issued there)."""
        return self.backend.stream_context(self.comm_stream)

    # -- rule 2: the receive waits for the compute that last read its slot
    def comm_after_compute(self) -> None:
        """Make M wait for everything issued on C so far (the last compute, and C's waits on receives).

        One event serves every call: a wait binds to the event's latest record when it is issued, and this
        record is waited for at once, so re-recording it later never moves an earlier wait."""
        be = self.backend
        event = self._order_event
        if event is None:
            event = self._order_event = be.new_event()
        be.record_event(event, self.caller)
        be.wait_event(self.comm_stream, event)

    # -- rule 3: hand-off from C to M
    def hand_to_comm(self, tensors: Sequence[torch.Tensor], channel: str, ordered: bool = False) -> list[torch.Tensor]:
        """Give ``tensors`` (made on C) to M; return what M should read.

        :param channel: which transfer the tensors feed (``kv``, ``dkv``); a ``clone`` copy of a channel is
            dropped when the channel's next hand-off replaces it (M has read it by then, in stream order).
        :param ordered: True when M already waited on C after the tensors were written.

        ``record_stream`` marks each tensor for M (the allocator will not reuse it before M's work);
        ``clone`` gives M a copy it owns, and ``event`` the tensor itself: under both the original is kept
        alive until the join, which makes it valid whatever the caller does with its references; ``none``
        assumes no asynchrony.
        """
        be, policy = self.backend, self.handoff_policy
        if not ordered:
            self.comm_after_compute()
        if policy in ("event", "clone"):
            self._keep.extend(tensors)
        out = [hand_off(be, t, self.comm_stream, policy) for t in tensors]
        if policy == "clone":
            _uncount(self._clones.pop(channel, []))
            self._clones[channel] = _count(out, 0, True)
        return out


def hand_off(backend: Any, tensor: torch.Tensor, consumer: Any, policy: str) -> torch.Tensor:
    """Give ``tensor`` to the stream ``consumer`` under ``policy`` (rule 3); return what ``consumer`` reads.

    The caller has already made ``consumer`` wait for the stream that wrote ``tensor``.
    ``record_stream`` tells the allocator that ``consumer`` reads the tensor (zero copy); ``clone`` copies
    it with ``consumer`` current, so the copy belongs to ``consumer``'s pool; ``event`` and ``none`` return
    it unchanged (ordering is the caller's, or there is no asynchrony).
    """
    check_handoff(policy)
    if policy == "record_stream":
        backend.record_stream(tensor, consumer)
        return tensor
    if policy == "clone":
        with backend.stream_context(consumer):
            return tensor.clone()
    return tensor
