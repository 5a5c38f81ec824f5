"""A CPU model of an asynchronous device, for the lifetime sanitizer (docs/lifetime.md says what it models).

Ops run eagerly on CPU tensors, so numbers stay exact; what the model adds is the *device order* they
would have on an accelerator: every op is issued on a simulated stream, and the model keeps a vector
clock per stream (program order, event record/wait, stream waits, host synchronisation). Two accesses are
ordered only if the clocks say so, whatever the threads happened to do on the host, so a finding does
not depend on one lucky timing.

Memory is modelled like a caching allocator: a storage lives in a *block*; when it is freed the block
returns to the pool of the stream it was allocated on, and the next allocation on that stream may get it
at once, unless ``record_stream`` marked it for other streams (then the work those streams had issued by
the free is known to be finished before any reuse). The checker looks at accesses per block, across the
storages that occupy it over time, and reports:

- ``race``: two accesses to one storage, at least one a write, on different streams, not ordered;
- ``reuse``: an access to a block's previous occupant not ordered before its reuse by a new occupant;
- ``capture``: ``record_stream``, or a received-buffer allocation, while a graph is being captured.

Leaks and peaks are judged by the session (:mod:`xcp.testing.sanitizer`) from what the model counts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_EMPTY_FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_PROJECT_DIR = os.path.dirname(os.path.dirname(_THIS_DIR))
_SKIP_FILES = (os.path.join(_THIS_DIR, "sim_device.py"), os.path.join(_THIS_DIR, "sim_backend.py"))


# ----------------------------------------------------------------------------------------------------
# Reports


@dataclass(frozen=True)
class Access:
    """One access to a tensor's memory, as a report shows it."""

    op: str
    stream: str
    write: bool
    tensor: str  # "float64[1, 8, 2, 4]": the view the op touched
    storage: str  # "1024 B allocated at xcp/ring.py:70 ring_forward on rank0:C"

    def describe(self) -> str:
        return f"{'write' if self.write else 'read'} by {self.op} on stream {self.stream} of {self.tensor}"


@dataclass(frozen=True)
class Finding:
    """A broken rule: ``kind`` is race, reuse, leak, bound, capture or numerics."""

    kind: str
    message: str
    accesses: tuple[Access, ...] = ()

    def format(self) -> str:
        lines = [f"[{self.kind}] {self.message}"]
        if self.accesses:
            lines.append(f"    memory: {self.accesses[0].storage}")
            if len(self.accesses) > 1 and self.accesses[1].storage != self.accesses[0].storage:
                lines.append(f"    reused by: {self.accesses[1].storage}")
            for name, a in zip(("first", "second"), self.accesses):
                lines.append(f"    {name}: {a.describe()}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Streams and events


class SimStream:
    """A simulated stream: a name and a vector clock (what it has waited for, and its own op count)."""

    _ids = itertools.count(1)

    def __init__(self, model: DeviceModel, name: str) -> None:
        self.id = next(SimStream._ids)
        self.name = name
        self.vc: dict[int, int] = {self.id: 0}
        self._model = model
        model._streams[self.id] = self

    def wait_event(self, event: SimEvent) -> None:
        self._model.wait_event(self, event)

    def wait_stream(self, other: SimStream) -> None:
        self._model.wait_stream(self, other)

    def synchronize(self) -> None:
        self._model.sync_stream(self)

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"


class SimEvent:
    """A simulated event: the clock of the stream it was last recorded on, at the time of recording."""

    def __init__(self, model: DeviceModel) -> None:
        self.vc: dict[int, int] | None = None
        self._model = model

    def record(self, stream: SimStream | None = None) -> None:
        self._model.record(self, stream or self._model.current_stream())

    def synchronize(self) -> None:
        self._model.sync_event(self)

    def query(self) -> bool:
        return True


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


# ----------------------------------------------------------------------------------------------------
# Memory


@dataclass
class _Entry:
    """An access kept in a block's history: stream id and epoch (for ordering) and how to report it."""

    sid: int
    epoch: int
    occupant: int
    access: Access


@dataclass
class _Block:
    id: int
    size: int
    pool: int  # id of the stream whose pool it returns to; 0 for memory the model did not allocate
    history: dict[tuple[int, bool], _Entry] = field(default_factory=dict)


@dataclass
class _Storage:
    key: int
    block: _Block
    occupant: int
    nbytes: int
    owner: str  # label of the thread (rank) that allocated it
    info: str
    external: bool
    marks: set[int] = field(default_factory=set)  # streams record_stream named
    comm: bool = False  # written by a peer-to-peer transfer (a received buffer)
    alltoall: bool = False  # written by a peer's piece of an all-to-all (the hybrid's receive buffer; no slot)
    captured: bool = False  # allocated while capturing


class _ThreadState:
    def __init__(self, label: str, stream: SimStream) -> None:
        self.label = label
        self.default = stream
        self.stack: list[SimStream] = []
        self.host: dict[int, int] = {}
        self.side_streams = 0
        self.capturing = 0
        self.labels: list[str] = []


class _Mode(TorchDispatchMode):
    """Records every op of one thread in the model, after running it."""

    def __init__(self, model: DeviceModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.model.on_op(func, args, kwargs, out)
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _site() -> str:
    """Where the current op was called from: the innermost project frame, then the first one in another file."""
    frame: types.FrameType | None = sys._getframe(2)
    found: list[str] = []
    files: list[str] = []
    while frame is not None and len(found) < 2:
        path = frame.f_code.co_filename
        name = frame.f_code.co_name
        ours = path.startswith(_PROJECT_DIR) and not path.startswith(_TORCH_DIR) and path not in _SKIP_FILES
        if ours and not name.startswith("<") and path not in files:
            found.append(f"{os.path.relpath(path, _PROJECT_DIR)}:{frame.f_lineno} {name}")
            files.append(path)
        frame = frame.f_back
    return " < ".join(found) if found else "outside the project"


class _OpInfo:
    """What an aten op reads and writes, from its schema's alias annotations."""

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.name = str(func)
        self.view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        self.empty = schema.name.split("::")[-1] in _EMPTY_FACTORIES

        def writes(arg: Any) -> bool:
            return bool(arg.alias_info is not None and arg.alias_info.is_write)

        self.positional = [writes(a) for a in schema.arguments if not a.kwarg_only]
        self.keyword = {a.name: writes(a) for a in schema.arguments}

    def accesses(self, args: tuple, kwargs: dict) -> Iterator[tuple[torch.Tensor, bool]]:
        for write, value in zip(self.positional, args):
            for t in _tensors(value):
                yield t, write
        for name, value in kwargs.items():
            write = self.keyword.get(name, False)
            for t in _tensors(value):
                yield t, write


class DeviceModel:
    """The simulated device shared by every thread (rank) of a session; all state behind one lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._threads: dict[str, _ThreadState] = {}
        self._streams: dict[int, SimStream] = {}
        self._storages: dict[int, _Storage] = {}
        self._pools: dict[int, list[_Block]] = {}
        self._freed: deque[int] = deque()
        self._finalizers: list[weakref.finalize] = []
        self._ops: dict[Any, _OpInfo] = {}
        self._blocks = itertools.count(1)
        self._occupants = itertools.count(1)
        self._seen: set[tuple] = set()
        self.findings: list[Finding] = []
        self.comm_live: dict[str, int] = {}
        self.comm_peak: dict[str, int] = {}
        self.alltoall_live: dict[str, int] = {}
        self.alltoall_peak: dict[str, int] = {}
        self.record_stream_calls = 0

    # -- threads
    @contextlib.contextmanager
    def thread(self, label: str) -> Iterator[None]:
        """Run the block as ``label`` (a rank): its own caller stream, every op recorded."""
        with self._lock:
            state = self._threads.get(label)
            if state is None:
                state = self._threads[label] = _ThreadState(label, SimStream(self, f"{label}:C"))
        previous = getattr(self._tls, "state", None)
        self._tls.state = state
        try:
            with _Mode(self):
                yield
        finally:
            self._tls.state = previous

    def _state(self) -> _ThreadState:
        state = getattr(self._tls, "state", None)
        if state is None:
            raise RuntimeError(
                "the sim backend was used outside a sanitizer thread: run each rank's work inside "
                "`with session.thread('rank0'):` (xcp.testing.sanitizer)"
            )
        return state

    def active(self) -> bool:
        """True in a thread inside :meth:`thread`."""
        return getattr(self._tls, "state", None) is not None

    # -- streams and events
    def current_stream(self) -> SimStream:
        state = self._state()
        return state.stack[-1] if state.stack else state.default

    def new_stream(self, name: str | None = None) -> SimStream:
        state = self._state()
        with self._lock:
            if name is None:  # the first unnamed side stream of a rank is the ring's comm stream
                state.side_streams += 1
                name = "M" if state.side_streams == 1 else f"S{state.side_streams}"
            return SimStream(self, f"{state.label}:{name}")

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[None]:
        state = self._state()
        state.stack.append(stream)
        try:
            yield
        finally:
            state.stack.pop()

    def record(self, event: SimEvent, stream: SimStream) -> None:
        with self._lock:
            _join(stream.vc, self._state().host)
            event.vc = dict(stream.vc)

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        with self._lock:
            if event.vc is not None:  # waiting on an event never recorded does nothing, as on a device
                _join(stream.vc, event.vc)

    def wait_stream(self, stream: SimStream, other: SimStream) -> None:
        with self._lock:
            _join(stream.vc, self._state().host)
            _join(stream.vc, other.vc)

    def sync_event(self, event: SimEvent) -> None:
        with self._lock:
            if event.vc is not None:
                _join(self._state().host, event.vc)

    def sync_stream(self, stream: SimStream) -> None:
        with self._lock:
            _join(self._state().host, stream.vc)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Report, for this thread, that a graph is being captured (``is_capturing()`` is True)."""
        state = self._state()
        state.capturing += 1
        try:
            yield
        finally:
            state.capturing -= 1

    def capturing(self) -> bool:
        return self._state().capturing > 0

    @contextlib.contextmanager
    def label(self, text: str) -> Iterator[None]:
        """Name the ops of the block (e.g. a peer-to-peer copy); a labelled ``p2p`` write marks a received buffer
        (``p2p agree``, xcp.agreement's fingerprint, excepted; ``p2p a2a``, the hybrid's all-to-all, counted
        apart)."""
        labels = self._state().labels
        labels.append(text)
        try:
            yield
        finally:
            labels.pop()

    # -- allocator marks
    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """``tensor.record_stream(stream)``: the block is not reused before ``stream``'s work at the free."""
        with self._lock:
            self.record_stream_calls += 1
            state = self._state()
            st = self._storage(tensor, self.current_stream())
            st.marks.add(stream.id)
            if state.capturing:
                self._report(
                    "capture",
                    f"{state.label}: record_stream during graph capture (rule 4 forbids it)",
                    (self._access(tensor, st, "record_stream", stream, False),),
                )

    # -- ops
    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _OpInfo(func)
        if info.view:
            return
        with self._lock:
            self._drain()
            state = self._state()
            stream = state.stack[-1] if state.stack else state.default
            _join(stream.vc, state.host)
            stream.vc[stream.id] += 1
            labels = state.labels
            name = info.name if not labels else f"{info.name} ({labels[-1]})"
            touched: list[tuple[torch.Tensor, bool]] = list(info.accesses(args, kwargs))
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                key = id(t.untyped_storage())
                if key not in self._storages:
                    self._allocate(t, stream, name, state)
                    if not info.empty:
                        touched.append((t, True))
            for t, write in touched:
                st = self._storage(t, stream)
                self._check(t, st, stream, name, write)
                # a shard slot: not the small fingerprint of xcp.agreement, which is no ring shard, nor the
                # hybrid's all-to-all receive buffer, which is no slot (counted on its own)
                label = labels[-1] if labels else ""
                shard = label.startswith("p2p") and not label.startswith(("p2p agree", "p2p a2a"))
                if write and shard and not st.comm:
                    self._mark_comm(st, name, stream, t)
                elif write and label.startswith("p2p a2a") and not st.alltoall:
                    st.alltoall = True
                    live = self.alltoall_live[st.owner] = self.alltoall_live.get(st.owner, 0) + st.nbytes
                    self.alltoall_peak[st.owner] = max(self.alltoall_peak.get(st.owner, 0), live)

    def _mark_comm(self, st: _Storage, op: str, stream: SimStream, t: torch.Tensor) -> None:
        st.comm = True
        live = self.comm_live[st.owner] = self.comm_live.get(st.owner, 0) + st.nbytes
        self.comm_peak[st.owner] = max(self.comm_peak.get(st.owner, 0), live)
        if st.captured:
            self._report(
                "capture",
                f"{st.owner}: a received buffer was allocated during graph capture (rule 4: slots come from the "
                "workspace)",
                (self._access(t, st, op, stream, True),),
            )

    def _storage(self, t: torch.Tensor, stream: SimStream) -> _Storage:
        storage = t.untyped_storage()
        st = self._storages.get(id(storage))
        if st is None:  # memory from outside the model (made before tracking, or by an untracked thread)
            block = _Block(next(self._blocks), storage.nbytes(), 0)
            st = _Storage(
                id(storage),
                block,
                next(self._occupants),
                storage.nbytes(),
                "outside",
                "made outside the sanitizer",
                True,
            )
            self._track(storage, st)
        return st

    def _track(self, storage: Any, st: _Storage) -> None:
        self._storages[st.key] = st
        self._finalizers.append(weakref.finalize(storage, self._freed.append, st.key))

    def _allocate(self, t: torch.Tensor, stream: SimStream, op: str, state: _ThreadState) -> None:
        storage = t.untyped_storage()
        size = storage.nbytes()
        info = f"{size} B {_describe(t)} allocated at {_site()} on {stream.name}"
        occupant = next(self._occupants)
        pool = self._pools.setdefault(stream.id, [])
        fits = [b for b in pool if b.size >= size]
        new_access = Access(f"{op} (allocation)", stream.name, True, _describe(t), info)
        for block in fits:  # any fitting free block may be handed out now: each must be safe to reuse
            for entry in block.history.values():
                if entry.sid != stream.id and entry.epoch > stream.vc.get(entry.sid, 0):
                    self._report(
                        "reuse",
                        f"{state.label}: a freed block may be reused on {stream.name} while an access on "
                        f"{entry.access.stream} to its previous tensor is not known to be finished",
                        (entry.access, new_access),
                    )
        if fits:
            block = min(fits, key=lambda b: b.size)
            pool.remove(block)
        else:
            block = _Block(next(self._blocks), size, stream.id)
        st = _Storage(id(storage), block, occupant, size, state.label, info, False, captured=state.capturing > 0)
        self._track(storage, st)

    def _access(self, t: torch.Tensor, st: _Storage, op: str, stream: SimStream, write: bool) -> Access:
        return Access(op, stream.name, write, _describe(t), st.info)

    def _check(self, t: torch.Tensor, st: _Storage, stream: SimStream, op: str, write: bool) -> None:
        block = st.block
        access = None
        for entry in block.history.values():
            if entry.sid == stream.id or not (write or entry.access.write):
                continue
            if entry.epoch <= stream.vc.get(entry.sid, 0):
                continue
            access = access or self._access(t, st, op, stream, write)
            if entry.occupant == st.occupant:
                msg = f"{st.owner}: two accesses to one tensor, one a write, on different streams are not ordered"
                self._report("race", msg, (entry.access, access))
            else:
                msg = (
                    f"{st.owner}: memory reused by a new tensor on {stream.name} while an access on "
                    f"{entry.access.stream} to its previous tensor is not known to be finished"
                )
                self._report("reuse", msg, (entry.access, access))
        access = access or self._access(t, st, op, stream, write)
        block.history[(stream.id, write)] = _Entry(stream.id, stream.vc[stream.id], st.occupant, access)

    def _report(self, kind: str, message: str, accesses: tuple[Access, ...]) -> None:
        key = (kind, *((a.op, a.stream, a.write) for a in accesses))
        if key in self._seen:
            return
        self._seen.add(key)
        self.findings.append(Finding(kind, message, accesses))

    # -- frees
    def _drain(self) -> None:
        while self._freed:
            st = self._storages.pop(self._freed.popleft(), None)
            if st is None or st.external:
                continue
            if st.comm:
                self.comm_live[st.owner] -= st.nbytes
            if st.alltoall:
                self.alltoall_live[st.owner] -= st.nbytes
            block = st.block
            for sid in st.marks:  # work the marked streams issued by now is finished before any reuse
                stream = self._streams.get(sid)
                done = stream.vc[sid] if stream is not None else 0
                for key in [k for k, e in block.history.items() if e.sid == sid and e.epoch <= done]:
                    del block.history[key]
            self._pools.setdefault(block.pool, []).append(block)

    def collect(self) -> None:
        """Process the frees seen so far (call after dropping references, e.g. at the end of a session)."""
        with self._lock:
            self._drain()

    def live(self) -> list[_Storage]:
        """Storages the model allocated that are still alive."""
        with self._lock:
            self._drain()
            return [s for s in self._storages.values() if not s.external]

    def close(self) -> None:
        """Stop watching frees (the model's storages may outlive the session)."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
