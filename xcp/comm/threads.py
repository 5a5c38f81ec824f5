"""The threads of a LocalWorld's virtual ranks: one long-lived thread per rank (optionally pinned to one
CPU), and the mailboxes through which the ranks hand each other buffers and events, with the turn of a
cooperative world (one rank runs at a time and hands over only where it would wait for a peer).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .protocol import CommTimeout


class Job:
    """One rank's part of a :meth:`LocalWorld.run`, with the join interface of a thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


class RankThread:
    """A daemon thread that runs the jobs of one virtual rank, one after another, until stopped."""

    def __init__(self, name: str, cpu: int | None = None) -> None:
        """:param cpu: the one CPU the thread runs on (Linux), or None to leave it to the scheduler."""
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.busy = False
        self.cpu = cpu
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        job = Job(fn, args)
        self.busy = True
        self.jobs.put(job)
        return job

    def stop(self) -> None:
        """End the thread after its current job (at once when idle)."""
        self.jobs.put(None)

    def _loop(self) -> None:
        if self.cpu is not None:
            with contextlib.suppress(OSError):  # a CPU taken away meanwhile: run unpinned
                os.sched_setaffinity(0, {self.cpu})  # 0: this thread (Linux)
        while (job := self.jobs.get()) is not None:
            try:
                job.fn(*job.args)  # the job catches its own exceptions (LocalWorld.run's body)
            finally:
                self.busy = False
                job.done.set()
                del job

    @staticmethod
    def stop_all(workers: list[RankThread | None]) -> None:
        """End the threads of a LocalWorld that is gone or closed (each after its current job)."""
        for w in workers:
            if w is not None:
                w.stop()


def current_cpu() -> int | None:
    """The CPU this thread runs on now, where the platform can pin threads (Linux), else None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        import ctypes

        cpu = int(ctypes.CDLL(None).sched_getcpu())
    except (OSError, AttributeError, TypeError, ValueError):
        cpu = -1
    allowed = os.sched_getaffinity(0)
    return cpu if cpu in allowed else min(allowed, default=None)


class Waker:
    """A thread's turn signal in a cooperative LocalWorld: a lock held while the turn is elsewhere.

    ``set`` releases it, ``wait`` takes it (and so consumes the signal). A hand-over is two calls into
    the lock, where a ``threading.Event`` adds a Condition and a fresh waiter lock per wait.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if self._lock.locked():
            self._lock.release()

    def wait(self, timeout: float) -> bool:
        """True (and the signal consumed) once set; False after ``timeout`` seconds."""
        return self._lock.acquire(timeout=timeout)

    def clear(self) -> None:
        self._lock.acquire(blocking=False)


_wakers = threading.local()


def waker() -> Waker:
    """This thread's turn signal: set when the turn of a cooperative LocalWorld is handed to it."""
    event = getattr(_wakers, "event", None)
    if event is None:
        event = _wakers.event = Waker()
    return event


class Mailboxes:
    """The mail of a LocalWorld's ranks (one deque per key) and, in a cooperative world, the turn.

    Turns: one rank runs at a time and hands over only where it would wait. A rank that must wait for a
    mailbox item registers for it and passes the turn to a rank that can run; the put of that item makes it
    runnable (queued, not woken), and it is woken only when the turn comes to it. So exactly one thread is
    awake, and a hand-over wakes exactly one: no wake-up that then waits for the interpreter lock held by a
    rank still running.

    :param timeout: seconds a wait may take before :class:`CommTimeout`.
    :param check_abort: called with the waiting rank while it waits; raises to abort the wait.
    """

    def __init__(self, cooperative: bool, timeout: float, check_abort: Callable[[int], None]) -> None:
        self.cooperative, self.timeout, self._check_abort = cooperative, timeout, check_abort
        self._sched = threading.Lock()  # guards the mail and the turn: holder, runnable ranks, ranks waiting
        self._holder: Waker | None = None
        self._runnable: collections.deque[Waker] = collections.deque()
        self._waiting: dict[tuple, tuple[Waker, bool]] = {}  # key -> (waiter, whether it gave up the turn)
        self._mail: dict[tuple, collections.deque] = {}  # the mailboxes, by key

    def clear(self) -> None:
        """Drop every item and the turn: nothing of an earlier run's mail or turn survives."""
        with self._sched:
            self._holder, self._waiting, self._mail = None, {}, {}
            self._runnable.clear()

    @contextlib.contextmanager
    def turn(self, rank: int) -> Iterator[None]:
        """Hold the turn for the body of a rank's job (cooperative worlds only)."""
        if not self.cooperative:
            yield
            return
        self._take_turn(rank)
        try:
            yield
        finally:
            with self._sched:
                if self._holder is waker():
                    self._hand_over()

    def _hand_over(self) -> None:
        """Give the turn to the next runnable rank, or leave it free (call with ``_sched`` held)."""
        if self._runnable:
            self._holder = self._runnable.popleft()
            self._holder.set()
        else:
            self._holder = None

    def _await_wake(self, rank: int, me: Waker, what: Callable[[], str], key: tuple | None = None) -> None:
        """Block until ``me`` is set (the turn handed to it, or the mail it waits for put); on abort or timeout
        leave every queue and pass on a turn that arrived meanwhile."""
        deadline = time.monotonic() + self.timeout
        while not me.wait(0.02):
            try:
                self._check_abort(rank)
                if time.monotonic() > deadline:
                    raise CommTimeout(f"rank {rank} waited {self.timeout:g} s for {what()}")
            except BaseException:
                with self._sched:
                    if key is not None and self._waiting.get(key, (None,))[0] is me:
                        del self._waiting[key]
                    if me in self._runnable:
                        self._runnable.remove(me)
                    if self._holder is me:
                        self._hand_over()
                me.clear()
                raise

    def _take_turn(self, rank: int) -> None:
        me = waker()
        with self._sched:
            if self._holder is None and not self._runnable:
                self._holder = me
                return
            self._runnable.append(me)
        why = "its turn to run; another rank of this cooperative LocalWorld kept it (stuck outside an xcp wait?)"
        self._await_wake(rank, me, lambda: why)

    def put(self, key: tuple, item: Any) -> None:
        """Put ``item`` in the mailbox ``key`` and wake the thread waiting for it: directly, or (a rank that
        passed on the turn of a cooperative world to wait) by making it runnable."""
        with self._sched:  # one lock for the mail and the turn: a put cannot slip between a check and a wait
            self._mail.setdefault(key, collections.deque()).append(item)
            waiting = self._waiting.pop(key, None)
            if waiting is not None:
                waiter, gave_turn = waiting
                if not gave_turn:
                    waiter.set()
                    return
                self._runnable.append(waiter)
                if self._holder is None:
                    self._hand_over()

    def take(self, rank: int, key: tuple, what: Callable[[], str]) -> Any:
        """The next item of mailbox ``key``, waiting for it (``what()`` describes it in a timeout). A rank
        holding the turn of a cooperative world passes the turn on while it waits."""
        me = waker()
        with self._sched:
            box = self._mail.get(key)
            if box:
                return box.popleft()
            gave_turn = self.cooperative and self._holder is me
            self._waiting[key] = (me, gave_turn)
            if gave_turn:
                self._hand_over()
        self._await_wake(rank, me, lambda: f"{what()}; is a peer stuck or missing?", key)
        with self._sched:
            return self._mail[key].popleft()
