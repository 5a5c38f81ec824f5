"""Stand-ins for xcp's core protocols (a communicator, a backend's block kernels), for the
tools that measure one part of a call in isolation (``xcp bench``, benchmarks/) and for the tests.

Each wraps or replaces one protocol and nothing else, so that what is measured or checked is the code around
it: the bytes a ring sends (:class:`CountingCommunicator`), the host work of a ring step without kernel time
(:class:`NullKernels`), one rank's loop without its peers (:class:`LoopbackCommunicator`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..comm import DoneWork


class CountingCommunicator:
    """A rank's communicator that adds up the bytes it sends to other ranks, per tag, into ``sent``; the rest
    is the wrapped communicator's (the ring needs rank, size, rank_store and exchange; the hybrid's head
    group all_to_all, of whose U rows the rank sends U - 1 and keeps its own)."""

    def __init__(self, comm: Any, sent: dict[str, int]) -> None:
        self._comm, self.sent = comm, sent
        self.ranks_are_threads = comm.ranks_are_threads

    def rank(self) -> int:
        return self._comm.rank()

    def size(self) -> int:
        return self._comm.size()

    def rank_store(self) -> dict:
        return self._comm.rank_store()

    def exchange(self, sends, recvs, tag: str, backend, step: int | None = None):
        for tensor, _peer in sends:
            self.sent[tag] = self.sent.get(tag, 0) + tensor.numel() * tensor.element_size()
        return self._comm.exchange(sends, recvs, tag, backend, step)

    def all_to_all(self, send, recv, tag: str, backend, step: int | None = None):
        row = send[0].numel() * send.element_size()
        self.sent[tag] = self.sent.get(tag, 0) + row * (send.shape[0] - 1)
        return self._comm.all_to_all(send, recv, tag, backend, step)


class LoopbackCommunicator:
    """The communicator of one rank's loop run alone: an exchange copies each sent tensor into the receive
    buffer of the same position and is complete at once (no peer, no thread, no wait), so the loop's host
    work is timed without the other ranks'."""

    ranks_are_threads = False

    def __init__(self, world: int, rank: int) -> None:
        self._world, self._rank = world, rank
        self._store: dict[Any, Any] = {}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def rank_store(self) -> dict:
        return self._store

    def exchange(self, sends, recvs, tag: str, backend, step: int | None = None) -> DoneWork:
        for (sent, _), (buf, _) in zip(sends, recvs):
            buf.copy_(sent)
        return DoneWork()

    def all_gather(self, send, recv, tag: str, backend, step: int | None = None) -> DoneWork:
        """Every rank's piece is this rank's own: one copy per rank, as a gather's receives would land."""
        for piece in recv:
            piece.copy_(send)
        return DoneWork()

    def all_to_all(self, send, recv, tag: str, backend, step: int | None = None) -> DoneWork:
        """Every rank's piece for this rank is this rank's own (the ranks are alike): one copy per rank."""
        for piece in recv:
            piece.copy_(send[self._rank])
        return DoneWork()


class NullKernels:
    """A backend whose block kernels compute nothing: each call returns the outputs the wrapped backend's
    kernel gave the first time it saw a call of the same kind, mask, shapes and dtypes (the priming run
    computes them), so a ring step costs what it costs on the host — the loop's Python, the merge and the
    accumulations launched (on tiny tensors), the hand-offs, events and exchanges — and no kernel time.
    Everything else (streams, events, merge, identity) is the wrapped backend's.

    While ``recording``, each kernel call appends ``(kind, thread CPU ns, wall ns)`` to the calling thread's
    list in ``stamps`` (kind ``fwd`` or ``bwd``): one stamp per ring step of that rank, taken on entry, so the
    time between two stamps of one pass is one whole iteration of the ring's step loop.
    """

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        for name in dir(type(backend)):  # bound once: a step looks them up in this instance, not through __getattr__
            if not name.startswith("__") and name not in ("forward", "backward"):
                self.__dict__[name] = getattr(backend, name)
        self._outputs: dict[tuple, Any] = {}
        self.stamps: dict[int, list[tuple[str, int, int]]] = {}
        self.recording = False
        self.computed = 0
        """Kernel calls the wrapped backend actually ran (the priming run's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _stamp(self, kind: str) -> None:
        if self.recording:
            self.stamps.setdefault(threading.get_ident(), []).append(
                (kind, time.thread_time_ns(), time.perf_counter_ns())
            )

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        got = self._outputs.get(key)
        if got is None:
            got = self._outputs[key] = compute()
            self.computed += 1
        return got

    def forward(self, q, k, v, mask, scale):
        self._stamp("fwd")
        key = ("fwd", mask, q.shape, k.shape, q.dtype, q.device)
        return self._cached(key, lambda: self._backend.forward(q, k, v, mask, scale))

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        self._stamp("bwd")
        key = ("bwd", mask, q.shape, k.shape, q.dtype, q.device)
        return self._cached(key, lambda: self._backend.backward(dout, q, k, v, out, lse, mask, scale))
