"""Communicators: how a shard moves to the next rank.

Three kinds, one typed interface, :class:`Communicator` (``rank()``, ``size()``, ``exchange(sends, recvs,
tag, backend) -> work``, ``work.wait()``, ``rank_store()``):

- :class:`DistCommunicator`: torch.distributed point-to-point through ``batch_isend_irecv`` on any
  process group (NCCL, HCCL, gloo), launched with torchrun, across hosts;
- :class:`LocalGroup`: one virtual rank of a :class:`LocalWorld`, P ranks as threads of one process with
  an in-process exchange that keeps device stream semantics (the sender's stream copies into the buffer
  the receiver posted, after the receiver's "free" event; the receiver's wait waits on the copy's event);
- :class:`SingleRank`: a world of one, for calls without a group.

The hybrid (``ulysses=U``) path also needs an all-to-all, ``all_to_all(send, recv, tag, backend)`` (an
optional method: a third-party communicator without it serves the ring only), and the two sub-groups of a
rank, :func:`hybrid_groups`: its head group of U consecutive ranks and its ring of the ranks with the same
``rank % U`` (torch.distributed groups made by ``new_group`` and cached; LocalWorld sub-groups that share
the parent's threads and mailbox).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import math
import numbers
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .lifetime import Workspace, thread_store

Sends = Sequence[tuple[torch.Tensor, int]]
Recvs = Sequence[tuple[torch.Tensor, int]]

_TAGS = {"kv": 1, "dkv": 2, "agree": 3, "a2a": 4}

TIMEOUT_ENV = "XCP_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
"""Seconds a torch.distributed wait that blocks the host (gloo, CPU tensors) may take when neither
``timeout=`` nor ``XCP_TIMEOUT`` says otherwise: gloo's own bound is the process group's (30 minutes by
default), far too long to learn that a peer is stuck."""


class RankAborted(RuntimeError):
    """Raised in a virtual rank whose world was aborted because another rank failed."""


class CommTimeout(TimeoutError):
    """A rank waited longer than its bound for a peer (a LocalWorld's ``timeout``, or ``XCP_TIMEOUT`` /
    ``timeout=`` on a torch.distributed group); the message names the rank, the peer, the step and the tag."""


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` as float seconds (None stays None); a ValueError naming ``name`` unless positive and finite."""
    if timeout is None:
        return None
    real = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
    if not real or not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{name}: expected a positive finite number of seconds or None; got {timeout!r}")
    return float(timeout)


def timeout_from_env() -> float | None:
    """The bound set by ``XCP_TIMEOUT`` (seconds), or None when it is unset or empty."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}: expected a positive number of seconds; got {raw!r}") from None
    return check_timeout(value, name=TIMEOUT_ENV)


def _at_step(step: int | None) -> str:
    return "" if step is None else f" at step {step}"


class Work(Protocol):
    """An exchange in flight."""

    def wait(self) -> None:
        """Make the current stream wait until every receive of the exchange has landed."""


@runtime_checkable
class Communicator(Protocol):
    """What the ring needs of a group of ranks; a ``group=`` that is one is used as it is.

    ``ranks_are_threads`` is True where the ranks are threads of one process (a LocalWorld): there a
    backward that autograd runs on another thread than the rank's own could not wait for its peers.
    """

    ranks_are_threads: bool

    def rank(self) -> int:
        """This rank, 0 <= rank < size."""

    def size(self) -> int:
        """The number of ranks (the world size of the ring)."""

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> Work:
        """Send each ``(tensor, peer)`` of ``sends`` and receive into each ``(buffer, peer)`` of ``recvs``.

        Issued on the backend's current stream; ``tag`` (``kv``, ``dkv`` or ``agree``) keeps channels apart;
        ``step`` (the ring step, when there is one) is for error messages.
        """

    def rank_store(self) -> dict:
        """A dict kept for this rank across calls (xcp.lifetime keeps its streams and workspace there)."""


class _DoneWork:
    def wait(self) -> None:
        pass


class SingleRank:
    """A world of one rank: nothing to exchange."""

    ranks_are_threads = False

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def rank_store(self) -> dict:
        return thread_store()

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> Work:
        if sends or recvs:
            raise RuntimeError("a world of one rank has no peer to exchange with")
        return _DoneWork()


class DistCommunicator:
    """Point-to-point over a torch.distributed process group (``batch_isend_irecv``).

    :param timeout: seconds a wait on a peer may take before :class:`CommTimeout`; None reads
        ``XCP_TIMEOUT``. Without either, waits that block the host anyway (CPU tensors, gloo) are bounded
        by :data:`DEFAULT_TIMEOUT`, and device waits (NCCL, HCCL), which only order streams and never block
        the host, are left to the process group's own timeout. An explicit bound applies to device waits
        too, at a price: each wait then blocks the host until the transfer has landed.
    """

    ranks_are_threads = False

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self._size = dist.get_world_size(self.group)
        self._rank = dist.get_rank(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self._size)]
        timeout = check_timeout(timeout)
        self.timeout = timeout if timeout is not None else timeout_from_env()

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of the group, in group order."""
        return tuple(self._global)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def rank_store(self) -> dict:
        return thread_store()

    def wait_bound(self, device: torch.device) -> float | None:
        """Seconds a wait on ``device`` tensors may take (None: unbounded by xcp)."""
        if self.timeout is not None:
            return self.timeout
        return DEFAULT_TIMEOUT if device.type == "cpu" else None

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> Work:
        dist = self._dist
        base = _TAGS[tag] * 16
        # P2P needs contiguous tensors; a copy made here is on the current (comm) stream, which the process
        # group orders and keeps alive itself
        sends = [(t.contiguous(), p) for t, p in sends]
        ops = [dist.P2POp(dist.isend, t, self._global[p], self.group, base + i) for i, (t, p) in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, b, self._global[p], self.group, base + i) for i, (b, p) in enumerate(recvs)]
        if not ops:
            return _DoneWork()
        what = [f"sending {tag}{i} to rank {p}" for i, (_, p) in enumerate(sends)]
        what += [f"receiving {tag}{i} from rank {p}" for i, (_, p) in enumerate(recvs)]
        peers = [p for _, p in sends] + [p for _, p in recvs]
        bound = self.wait_bound((sends[0][0] if sends else recvs[0][0]).device)
        return _DistWork(dist.batch_isend_irecv(ops), list(zip(what, peers)), self._who(), step, bound)

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> Work:
        """``send[j]`` to group rank j and ``recv[j]`` from group rank j (dim 0 indexes the ranks), through
        ``all_to_all_single`` issued on the current stream; ``wait()`` as for :meth:`exchange`."""
        _check_all_to_all(send, recv, self._size)
        send = send.contiguous()  # a copy made here lives on the current stream, which the group orders
        if self._size == 1:
            recv.copy_(send)
            return _DoneWork()
        work = self._dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return _DistWork([work], [(f"in all-to-all {tag}", None)], self._who(), step, self.wait_bound(send.device))

    def _who(self) -> str:
        me = self._global[self._rank]
        return f"rank {self._rank}" + ("" if me == self._rank else f" (global rank {me})")


class _DistWork:
    """Requests in flight; ``wait`` bounds them together by one deadline when a bound is set."""

    def __init__(
        self, requests: list, what: list[tuple[str, int | None]], who: str, step: int | None, bound: float | None
    ):
        self._requests, self._what, self._who, self._step, self._bound = requests, what, who, step, bound

    def wait(self) -> None:
        if self._bound is None:
            for req in self._requests:
                req.wait()
            return
        start = time.monotonic()
        deadline = start + self._bound
        for req, (what, peer) in zip(self._requests, self._what):
            left = max(deadline - time.monotonic(), 0.001)
            try:
                req.wait(datetime.timedelta(seconds=left))
            except RuntimeError as exc:
                where = f"xcp: {self._who} {what}{_at_step(self._step)}"
                if time.monotonic() >= deadline - 0.05 * self._bound or "timed out" in str(exc).lower():
                    whom = "a rank of the group" if peer is None else f"rank {peer}"
                    raise CommTimeout(
                        f"{where}: no progress within {self._bound:g} s; is {whom} stuck or gone? "
                        f"(the bound is xcp.attention(timeout=...) or {TIMEOUT_ENV})"
                    ) from exc
                raise RuntimeError(f"{where} failed: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# LocalWorld: virtual ranks as threads


class _Job:
    """One rank's part of a :meth:`LocalWorld.run`, with the join interface of a thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


class _RankThread:
    """A daemon thread that runs the jobs of one virtual rank, one after another, until stopped."""

    def __init__(self, name: str, cpu: int | None = None) -> None:
        """:param cpu: the one CPU the thread runs on (Linux), or None to leave it to the scheduler."""
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.busy = False
        self.cpu = cpu
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(fn, args)
        self.busy = True
        self.jobs.put(job)
        return job

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
    def stop_all(workers: list[_RankThread | None]) -> None:
        """End the threads of a LocalWorld that is gone (each after its current job)."""
        for w in workers:
            if w is not None:
                w.jobs.put(None)


class LocalWorld:
    """``size`` virtual ranks in one process, each a thread, exchanging tensors in memory.

    :param world_size: number of ranks (>= 1).
    :param device: device of the ranks' tensors ("cpu", "cuda", ...).
    :param timeout: seconds a rank waits for a peer before failing with a message naming both.

    A transfer behaves like a device P2P send/receive: the receiver posts its buffer with an event
    recorded on its issuing stream; the sender's issuing stream waits for that event, copies its tensor
    into the buffer and records a completion event, which the receiver's ``work.wait()`` makes its current
    stream wait for. So the sent tensor is read only on the sender's stream and the received buffer is
    written only after the receiver declared it free.

    On a GPU, PyTorch runs the backward of all threads on one autograd worker per device, so a ring
    backward that waits for peers cannot go through ``Tensor.backward()`` there; use
    :func:`xcp.ring_forward` / :func:`xcp.ring_backward` directly (autograd raises a clear error).
    """

    def __init__(
        self,
        world_size: int,
        device: str | torch.device = "cpu",
        timeout: float = 120.0,
        cooperative: bool | None = None,
        pin: bool | None = None,
    ) -> None:
        """:param cooperative: run one rank at a time, handing over only where a rank waits for a peer
        (default: on devices other than the CPU, where the ranks' threads only launch work). P threads
        launching at once contend for the interpreter and the driver; taking turns at the ring's wait
        points keeps the device fed with one thread's launch rate. A rank must then not wait for its
        peers outside xcp (a ``threading.Barrier`` between ranks would never be passed).
        :param pin: run every rank's thread on one CPU, the one the creating thread runs on (default: in
            cooperative worlds, on Linux). Ranks that take turns never run at once, and a hand-over that stays
            on one core finds its caches warm and wakes no other core: 8 virtual ranks on 2 CPUs spent about
            half the host time per ring step (benchmarks/world_profile.py)."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1; got {world_size!r}")
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout = check_timeout(timeout)
        if self.timeout is None:
            raise ValueError("timeout: expected a positive finite number of seconds; got None")
        self._lock = threading.Lock()
        self._failure: tuple[int, BaseException] | None = None
        self._rank_stores: dict[int, dict] = {}
        self._workers: list[_RankThread | None] = [None] * world_size
        self.cooperative = self.device.type != "cpu" if cooperative is None else bool(cooperative)
        self._cpu = _current_cpu() if (self.cooperative if pin is None else bool(pin)) else None
        self._sched = threading.Lock()  # guards the mail and the turn: holder, runnable ranks, ranks waiting
        self._holder: _Waker | None = None
        self._runnable: collections.deque[_Waker] = collections.deque()
        self._waiting: dict[tuple, tuple[_Waker, bool]] = {}  # key -> (waiter, whether it gave up the turn)
        self._mail: dict[tuple, collections.deque] = {}  # the mailboxes, by key
        weakref.finalize(self, _RankThread.stop_all, self._workers)

    def __repr__(self) -> str:
        return f"LocalWorld(world_size={self.world_size}, device={str(self.device)!r})"

    def group(self, rank: int) -> LocalGroup:
        """The group handle of virtual rank ``rank``."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected an integer in [0, {self.world_size}); got {rank!r}")
        return LocalGroup(self, rank)

    def release_buffers(self) -> None:
        """Drop every rank's cached streams and reusable ring buffers (the workspace)."""
        with self._lock:
            self._rank_stores.clear()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(group, *args)`` on every rank, one thread each; return the results in rank order.

        Each rank keeps its thread from one run to the next (as a real rank keeps its process), so what
        libraries cache per thread (cuDNN's execution plans, cuBLAS handles) is built once, not per run.

        An exception in any rank aborts the others (their waits raise :class:`RankAborted`) and is
        re-raised here as a RuntimeError naming the rank. Once any rank has finished, the others have twice
        the world's ``timeout`` to finish too (time for a wait on a peer to time out first, with its own
        message); a rank still running then (stuck in user code, where no xcp wait
        can time out) is named in a RuntimeError, aborted at its next xcp wait, and left behind as a daemon
        thread.
        """
        self._failure = None
        with self._sched:  # nothing of an earlier run's mail or turn survives
            self._holder, self._waiting, self._mail = None, {}, {}
            self._runnable.clear()
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            group = self.group(rank)
            try:
                with self._turn(rank):
                    results[rank] = fn(group, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors[rank] = exc
                with self._lock:
                    if self._failure is None and not isinstance(exc, RankAborted):
                        self._failure = (rank, exc)

        threads = [self._worker(r).submit(body, r) for r in range(self.world_size)]
        self._join(threads, errors)
        if self._failure is None and any(errors):
            rank = next(r for r, e in enumerate(errors) if e is not None)
            self._failure = (rank, errors[rank])
        if self._failure is not None:
            rank, exc = self._failure
            what = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"LocalWorld rank {rank} of {self.world_size} failed: {what}") from exc
        return results

    def _worker(self, rank: int) -> _RankThread:
        """Rank ``rank``'s thread; a new one where the last is still busy (left stuck by a failed run)."""
        worker = self._workers[rank]
        if worker is None or worker.busy:
            worker = self._workers[rank] = _RankThread(f"xcp-rank-{rank}", self._cpu)
        return worker

    def _join(self, threads: list[_Job], errors: list[BaseException | None]) -> None:
        """Wait for every rank; raise naming the ranks still running 2 x ``timeout`` s after the first finished."""
        first_done: float | None = None
        while True:
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
            if not alive:
                return
            now = time.monotonic()
            if first_done is None and len(alive) < len(threads):
                first_done = now
            if first_done is not None and now - first_done > 2 * self.timeout:
                break
            threads[alive[0]].join(0.02)
        finished = [r for r in range(len(threads)) if r not in alive]
        with self._lock:
            cause = self._failure
            if cause is None:
                stuck = RuntimeError(f"ranks {alive} did not finish")
                self._failure = (alive[0], stuck)  # aborts the stuck ranks at their next xcp wait
        names = ", ".join(str(r) for r in alive)
        why = ""
        if cause is not None:
            why = f"; rank {cause[0]} had failed: {type(cause[1]).__name__}: {cause[1]}"
        raise RuntimeError(
            f"LocalWorld rank{'s' if len(alive) > 1 else ''} {names} of {self.world_size} did not finish within "
            f"{2 * self.timeout:g} s (twice the world's timeout) after rank {finished[0]} finished{why}"
        ) from (cause[1] if cause is not None else None)

    def _rank_store(self, rank: int) -> dict:
        with self._lock:
            return self._rank_stores.setdefault(rank, {})

    def _check_abort(self, rank: int) -> None:
        failure = self._failure
        if failure is not None and failure[0] != rank:
            raise RankAborted(f"rank {rank}: aborted because rank {failure[0]} failed")

    # -- turns (cooperative worlds): one rank runs at a time and hands over only where it would wait.
    # A rank that must wait for a mailbox item registers for it and passes the turn to a rank that can run;
    # the put of that item makes it runnable (queued, not woken), and it is woken only when the turn comes
    # to it. So exactly one thread is awake, and a hand-over wakes exactly one: no wake-up that then waits
    # for the interpreter lock held by a rank still running.
    @contextlib.contextmanager
    def _turn(self, rank: int):
        """Hold the world's turn for the body of a rank's job (cooperative worlds only)."""
        if not self.cooperative or self.world_size == 1:
            yield
            return
        self._take_turn(rank)
        try:
            yield
        finally:
            with self._sched:
                if self._holder is _waker():
                    self._hand_over()

    def _hand_over(self) -> None:
        """Give the turn to the next runnable rank, or leave it free (call with ``_sched`` held)."""
        if self._runnable:
            self._holder = self._runnable.popleft()
            self._holder.set()
        else:
            self._holder = None

    def _await_wake(self, rank: int, me: _Waker, what: Callable[[], str], key: tuple | None = None) -> None:
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
        me = _waker()
        with self._sched:
            if self._holder is None and not self._runnable:
                self._holder = me
                return
            self._runnable.append(me)
        why = "its turn to run; another rank of this cooperative LocalWorld kept it (stuck outside an xcp wait?)"
        self._await_wake(rank, me, lambda: why)

    # -- mailboxes: one deque per key under ``_sched``, for both kinds of world
    def _put(self, key: tuple, item: Any) -> None:
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

    def _take(self, rank: int, key: tuple, what: Callable[[], str]) -> Any:
        """The next item of mailbox ``key``, waiting for it (``what()`` describes it in a timeout). A rank
        holding the turn of a cooperative world passes the turn on while it waits."""
        me = _waker()
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


def _current_cpu() -> int | None:
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


class _Waker:
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


def _waker() -> _Waker:
    """This thread's turn signal: set when the turn of a cooperative LocalWorld is handed to it."""
    event = getattr(_wakers, "event", None)
    if event is None:
        event = _wakers.event = _Waker()
    return event


class LocalGroup:
    """One virtual rank of a :class:`LocalWorld`; pass it as ``group=`` to :func:`xcp.attention`.

    Like a torch ProcessGroup where users touch it: ``group.rank()`` and ``group.size()``.
    """

    ranks_are_threads = True

    def __init__(self, world: LocalWorld, rank: int, members: Sequence[int] | None = None) -> None:
        """Rank ``rank`` of the whole world, or with ``members`` (world ranks, in group order) rank ``rank``
        of that sub-group (see :meth:`subgroup`)."""
        self.world = world
        self._rank = rank
        self._members = None if members is None else tuple(members)
        self._me = rank if members is None else self._members[rank]  # this rank in the world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.world_size if self._members is None else len(self._members)

    @property
    def members(self) -> tuple[int, ...]:
        """The world ranks of the group, in group order."""
        return tuple(range(self.world.world_size)) if self._members is None else self._members

    def __repr__(self) -> str:
        if self._members is None:
            return f"<LocalGroup rank {self._rank} of {self.size()}>"
        return f"<LocalGroup rank {self._rank} of {self.size()}: world ranks {list(self._members)}>"

    def subgroup(self, ranks: Sequence[int]) -> LocalGroup:
        """The sub-group of this group's ranks ``ranks`` (in that order), which must include this rank.

        It shares the world's threads and mailbox: its exchanges are the parent's, peers translated to world
        ranks. Its rank store shares the comm streams and the workspace of the rank (one thread, one
        device), but keeps its own agreed fingerprints (xcp.agreement), which are per group.
        """
        ranks = [int(r) for r in ranks]
        if self._rank not in ranks:
            raise ValueError(f"ranks: expected a list that includes this rank {self._rank}; got {ranks}")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.size() for r in ranks):
            raise ValueError(f"ranks: expected distinct ranks in [0, {self.size()}); got {ranks}")
        parent = self.members
        return LocalGroup(self.world, ranks.index(self._rank), [parent[r] for r in ranks])

    def rank_store(self) -> dict:
        """A dict kept per rank for the life of the world (xcp.lifetime keeps streams and buffers there)."""
        store = self.world._rank_store(self._me)
        if self._members is None:
            return store
        sub = store.setdefault(("group", self._members), {})
        if not sub:  # one thread, one device: the rank's streams and workspace serve every group
            sub["streams"] = store.setdefault("streams", {})
            sub["workspace"] = store.setdefault("workspace", Workspace())
        return sub

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> _LocalWork:
        """Post ``recvs``, then copy each send into its peer's posted buffer on the current stream.

        Blocks (on the host) until each peer has posted the matching receive; never waits on a device.
        """
        if tag not in _TAGS:
            raise ValueError(f"tag: expected one of {', '.join(_TAGS)}; got {tag!r}")
        world, me = self.world, self._me
        # one mailbox item per peer and direction: the i-th tensor to (or from) a peer is channel i of the pair
        send_to = _by_peer(sends, self._members)
        recv_from = _by_peer(recvs, self._members)
        if not send_to and not recv_from:
            return _LocalWork(self, backend, (), tag, step)
        device = (sends[0][0] if sends else recvs[0][0]).device
        stream = backend.current_stream(device)
        if recv_from:
            free = backend.new_event()
            backend.record_event(free, stream)
            for peer, bufs in recv_from.items():
                world._put(("post", peer, me, tag), (bufs, free))
        if send_to:
            waited: list[Any] = []
            for peer, tensors in send_to.items():
                names = _channels(tag, len(tensors))
                what = lambda p=peer, c=names: f"rank {p} to post receive {c}{_at_step(step)}"  # noqa: E731
                bufs, free = world._take(me, ("post", me, peer, tag), what)
                _check_posted(me, peer, tag, tensors, bufs)
                if not any(free is e for e in waited):
                    backend.wait_event(stream, free)
                    waited.append(free)
                for i, (tensor, buf) in enumerate(zip(tensors, bufs)):
                    with backend.label(f"p2p {tag}{i} rank {me}->{peer}"):
                        buf.copy_(tensor)
                del bufs
            done = backend.new_event()
            backend.record_event(done, stream)
            for peer in send_to:
                world._put(("done", me, peer, tag), done)
        recvs_by_peer = tuple((bufs[0].device, peer, len(bufs)) for peer, bufs in recv_from.items())
        return _LocalWork(self, backend, recvs_by_peer, tag, step)

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> _LocalWork:
        """``send[j]`` to group rank j and ``recv[j]`` from group rank j (dim 0 indexes the ranks): this
        rank's own piece copied on the current stream, then one :meth:`exchange` with every peer (whose
        "free" event, recorded after that copy, orders the peers' copies into ``recv`` after it)."""
        n, me = self.size(), self._rank
        _check_all_to_all(send, recv, n)
        recv[me].copy_(send[me])
        peers = [j for j in range(n) if j != me]
        return self.exchange([(send[j], j) for j in peers], [(recv[j], j) for j in peers], tag, backend, step)


class _LocalWork:
    def __init__(self, group: LocalGroup, backend: Any, recvs: list, tag: str, step: int | None) -> None:
        self._group, self._backend, self._recvs, self._tag, self._step = group, backend, recvs, tag, step
        self._waited = False

    def wait(self) -> None:
        """Make the current stream wait until every receive of the exchange has landed."""
        if self._waited:
            return
        self._waited = True
        g, be, tag = self._group, self._backend, self._tag
        waited: list[Any] = []
        for device, peer, n in self._recvs:
            what = lambda p=peer, n=n: f"{_channels(tag, n)} from rank {p}{_at_step(self._step)}"  # noqa: E731
            done = g.world._take(g._me, ("done", peer, g._me, tag), what)
            if not any(done is e for e in waited):
                be.wait_event(be.current_stream(device), done)
                waited.append(done)


def _by_peer(items: Sequence[tuple[torch.Tensor, int]], members: tuple[int, ...] | None) -> dict[int, list]:
    """The tensors of ``items`` (``(tensor, group peer)``) grouped by world rank, in order: channels 0, 1, ..."""
    out: dict[int, list] = {}
    for tensor, peer in items:
        out.setdefault(peer if members is None else members[peer], []).append(tensor)
    return out


def _channels(tag: str, n: int) -> str:
    """The names of the n channels of one exchange between two ranks, for messages: kv0, or kv0..kv1."""
    return f"{tag}0" if n == 1 else f"{tag}0..{tag}{n - 1}"


def _check_posted(me: int, peer: int, tag: str, tensors: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
    """Raise when the buffers ``peer`` posted do not take the tensors sent to it, naming the channel."""
    if len(bufs) != len(tensors):
        raise RuntimeError(
            f"rank {me}: sending {len(tensors)} {tag} tensors to rank {peer}, which posted {len(bufs)} receive "
            "buffers (do all ranks make the same calls?)"
        )
    for i, (tensor, buf) in enumerate(zip(tensors, bufs)):
        if buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            raise RuntimeError(
                f"rank {me}: sending {tag}{i} shaped {tuple(tensor.shape)} {tensor.dtype} to rank {peer}, "
                f"which expects {tuple(buf.shape)} {buf.dtype} (do all ranks pass equal shapes?)"
            )


def _check_all_to_all(send: torch.Tensor, recv: torch.Tensor, size: int) -> None:
    if send.dim() < 1 or send.shape[0] != size:
        raise ValueError(f"send: expected dim 0 of size {size} (one piece per rank); got shape {tuple(send.shape)}")
    if recv.shape != send.shape or recv.dtype != send.dtype:
        raise ValueError(
            f"recv: expected shape {tuple(send.shape)} {send.dtype} (that of send); "
            f"got {tuple(recv.shape)} {recv.dtype}"
        )


def process_group_of_mesh(group: Any) -> Any:
    """The ProcessGroup of a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (a mesh of one dim, or one
    named dim of a larger mesh: ``mesh["cp"]``), as FSDP2 and torch's context parallel take it; None when
    ``group`` is no DeviceMesh; a ValueError naming the dims for a mesh of several."""
    mesh_type = None
    try:
        from torch.distributed.device_mesh import DeviceMesh as mesh_type
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not isinstance(group, mesh_type):
        return None
    if group.ndim != 1:
        names = getattr(group, "mesh_dim_names", None)
        raise ValueError(
            f"group: expected a DeviceMesh of 1 dim (or one named dim of it, e.g. mesh['cp']); got {group.ndim} "
            f"dims{f' named {tuple(names)}' if names else ''}"
        )
    return group.get_group()


# ----------------------------------------------------------------------------------------------------
# Hybrid sub-groups: the head group and the ring of a rank


def hybrid_members(size: int, rank: int, ulysses: int) -> tuple[list[int], list[int]]:
    """The group ranks of ``rank``'s head group (the ``ulysses`` consecutive ranks ``rank // ulysses``
    shares) and of its ring (the ranks with the same ``rank % ulysses``), each in group order."""
    g, u = divmod(rank, ulysses)
    return [g * ulysses + j for j in range(ulysses)], list(range(u, size, ulysses))


_dist_groups: dict[tuple, tuple[Any, Any]] = {}
_dist_groups_lock = threading.Lock()


def _dist_hybrid_groups(comm: DistCommunicator, ulysses: int) -> tuple[Any, Any]:
    """This process's (head group, ring) ProcessGroups for ``comm``'s group split by ``ulysses``, made once.

    Every rank makes every group in the same order: the head groups by index, then the rings. When
    ``comm``'s group is the whole world this is plain ``new_group`` (every process of the world takes part,
    and every process calls xcp.attention); for a smaller group only its members call, so the groups are made
    with ``use_local_synchronization=True``, each rank making only the groups it belongs to (in the same
    global order, which keeps the hashed group names equal on the members).
    """
    dist = comm._dist
    members = comm.members
    whole = sorted(members) == list(range(dist.get_world_size()))
    key = (members, ulysses, whole)
    with _dist_groups_lock:
        have = _dist_groups.get(key)
    if have is not None and all(_registered(g) for g in have if g is not None):
        return have
    size, rank = len(members), comm.rank()
    if list(members) != sorted(members):
        raise ValueError(
            f"group: ulysses > 1 needs a group whose ranks are in increasing global order (new_group sorts "
            f"the sub-groups it makes); got global ranks {list(members)}"
        )
    heads = [[members[g * ulysses + j] for j in range(ulysses)] for g in range(size // ulysses)]
    rings = [[members[u + i * ulysses] for i in range(size // ulysses)] for u in range(ulysses)]
    mine: list[Any] = [None, None]
    me = members[rank]
    for which, lists in enumerate((heads, rings)):
        for ranks in lists:
            if len(ranks) == 1:  # a ring of one rank moves nothing: no group
                made = None
            elif len(ranks) == size:  # the whole group: use it as it is
                made = comm.group
            elif whole:
                made = dist.new_group(ranks)
            elif me in ranks:
                made = dist.new_group(ranks, use_local_synchronization=True)
            else:
                continue
            if me in ranks:
                mine[which] = made
    pair = (mine[0], mine[1])
    with _dist_groups_lock:
        _dist_groups[key] = pair
    return pair


def _registered(group: Any) -> bool:
    """Whether ``group`` is still a live process group (not destroyed with its world)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return group in c10d._world.pg_map
    except (ImportError, AttributeError):  # pragma: no cover - a torch without that table: trust the cache
        return True


def hybrid_groups(comm: Communicator, ulysses: int) -> tuple[Communicator, Communicator]:
    """This rank's head group (``ulysses`` consecutive ranks; group rank ``rank % ulysses``) and its ring
    (the ranks with the same ``rank % ulysses``; group rank ``rank // ulysses``), as communicators.

    ``ulysses`` divides ``comm.size()`` (checked by the caller). A head group of the whole group is
    ``comm`` itself and a ring of one rank is a :class:`SingleRank`. A torch.distributed group is split
    with ``new_group`` (made once per group and ``ulysses``, cached), a LocalWorld group into
    :meth:`LocalGroup.subgroup` s; another communicator may offer ``hybrid_groups(ulysses)`` itself.
    """
    size, rank = comm.size(), comm.rank()
    head_ranks, ring_ranks = hybrid_members(size, rank, ulysses)
    if isinstance(comm, LocalGroup):
        head = comm if len(head_ranks) == size else comm.subgroup(head_ranks)
        ring = SingleRank() if len(ring_ranks) == 1 else comm.subgroup(ring_ranks)
        return head, ring
    if isinstance(comm, DistCommunicator):
        head_pg, ring_pg = _dist_hybrid_groups(comm, ulysses)
        head = comm if len(head_ranks) == size else DistCommunicator(head_pg, comm.timeout)
        ring = SingleRank() if len(ring_ranks) == 1 else DistCommunicator(ring_pg, comm.timeout)
        for what, c, want in (("head group", head, rank % ulysses), ("ring", ring, rank // ulysses)):
            if c.rank() != want:  # pragma: no cover - new_group orders sorted ranks, as checked above
                raise RuntimeError(f"xcp: rank {rank} is rank {c.rank()} of its {what}, expected {want}")
        return head, ring
    own = getattr(comm, "hybrid_groups", None)
    if callable(own):
        return own(ulysses)
    raise TypeError(
        f"group: ulysses > 1 needs a group xcp can split into head groups and rings (a torch.distributed "
        f"ProcessGroup or a group from xcp.LocalWorld), or a communicator with hybrid_groups(); got "
        f"{type(comm).__name__}"
    )


def resolve_group(group: Any, timeout: float | None = None) -> Communicator:
    """The communicator for ``group``: a LocalGroup or communicator as is, a ProcessGroup wrapped, None
    the default process group when torch.distributed is initialised, else a world of one.

    :param timeout: the wait bound of a torch.distributed group (see :class:`DistCommunicator`); other
        groups carry their own, and a ValueError says so when one is given for them.
    """
    timeout = check_timeout(timeout)
    if group is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return DistCommunicator(None, timeout)
        return SingleRank()
    mesh_group = process_group_of_mesh(group)
    if mesh_group is not None:
        return DistCommunicator(mesh_group, timeout)
    if isinstance(group, Communicator):
        if timeout is not None:
            raise ValueError(
                f"timeout: applies to torch.distributed groups; {group!r} bounds its own waits "
                "(a LocalWorld's by LocalWorld(timeout=...))"
            )
        return group
    try:
        import torch.distributed as dist

        if isinstance(group, dist.ProcessGroup):
            return DistCommunicator(group, timeout)
    except (ImportError, AttributeError):  # pragma: no cover - torch built without distributed
        pass
    raise TypeError(
        f"group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh, a group from xcp.LocalWorld, or "
        f"None; got {type(group).__name__}"
    )
