"""LocalWorld: P virtual ranks as threads of one process, and their groups (:class:`LocalGroup`), which
exchange tensors in memory with the stream semantics of a device send/receive (see :class:`LocalWorld`)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..lifetime import Workspace
from .protocol import (
    TAGS,
    Communicator,
    RankAborted,
    Recvs,
    Sends,
    at_step,
    check_all_gather,
    check_all_to_all,
    check_timeout,
    split_hybrid,
)
from .threads import Job, Mailboxes, RankThread, current_cpu


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

    The ranks' threads live until :meth:`close` (``with xcp.LocalWorld(P) as world:`` closes on leaving)
    or until the world is garbage-collected.

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
        bound = check_timeout(timeout)
        if bound is None:
            raise ValueError("timeout: expected a positive finite number of seconds; got None")
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout: float = bound
        self._lock = threading.Lock()
        self._failure: tuple[int, BaseException] | None = None
        self._closed = False
        self._rank_stores: dict[int, dict] = {}
        self._running: dict[int, int] = {}  # thread id -> the world rank whose job of :meth:`run` it runs now
        self._workers: list[RankThread | None] = [None] * world_size
        self.cooperative = self.device.type != "cpu" if cooperative is None else bool(cooperative)
        self._cpu = current_cpu() if (self.cooperative if pin is None else bool(pin)) else None
        self.mail = Mailboxes(self.cooperative and world_size > 1, bound, self._check_abort)
        """The ranks' mailboxes (and the turn of a cooperative world), through which LocalGroup exchanges."""
        self._stop_threads = weakref.finalize(self, RankThread.stop_all, self._workers)

    def __repr__(self) -> str:
        return f"LocalWorld(world_size={self.world_size}, device={str(self.device)!r})"

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """End the ranks' threads and drop their rank stores; a closed world refuses :meth:`run`.

        Idle threads are joined. The thread of a rank stuck in user code (a run that named it as not
        finished) cannot be stopped from outside: it stays behind as a daemon thread, aborted at its next
        xcp wait, and ends when its job returns. Closing twice is fine.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._rank_stores.clear()
        self._stop_threads()
        for worker in self._workers:
            if worker is not None and not worker.busy:
                worker.thread.join(self.timeout)

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
        re-raised here as a RuntimeError naming the rank, whose ``__cause__`` is the rank's own exception (a
        ValueError for a bad argument, say). Nothing of a failed run stays behind in the world: once the caller
        lets go of that error, the tensors and the autograd graph the run referenced are freed, and a world
        dropped afterwards is collected (its threads end) like one whose runs returned. Once any rank has
        finished, the others have twice
        the world's ``timeout`` to finish too (time for a wait on a peer to time out first, with its own
        message); a rank still running then (stuck in user code, where no xcp wait
        can time out) is named in a RuntimeError, aborted at its next xcp wait, and left behind as a daemon
        thread.
        """
        if self._closed:
            raise RuntimeError("LocalWorld.run: expected an open world; got one closed by close()")
        self._failure = None
        self.mail.clear()  # nothing of an earlier run's mail or turn survives
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            group = self.group(rank)
            me = threading.get_ident()
            self._running[me] = rank
            try:
                with self.mail.turn(rank):
                    results[rank] = fn(group, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors[rank] = exc
                with self._lock:
                    if self._failure is None and not isinstance(exc, RankAborted):
                        self._failure = (rank, exc)
            finally:
                self._running.pop(me, None)

        threads = [self._worker(r).submit(body, r) for r in range(self.world_size)]
        try:
            self._join(threads)
            failure = self._failure
            if failure is None:
                failure = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
            if failure is not None:
                rank, exc = failure
                what = f"{type(exc).__name__}: {exc}"
                raise RuntimeError(f"LocalWorld rank {rank} of {self.world_size} failed: {what}") from exc
            return results
        finally:
            self._forget_failure()
            errors.clear()  # each rank's exception holds its frames, which hold ``errors``: no cycle left behind

    def _forget_failure(self) -> None:
        """Keep only which rank failed (a rank left stuck by the run is still aborted at its next xcp wait),
        not its exception: that holds the traceback, the frames, and through them every tensor the run
        referenced and the world itself, which would then live until :meth:`close`."""
        with self._lock:
            if self._failure is not None:
                rank, exc = self._failure
                self._failure = (rank, RankAborted(f"rank {rank} failed: {type(exc).__name__}"))

    def _worker(self, rank: int) -> RankThread:
        """Rank ``rank``'s thread; a new one where the last is still busy (left stuck by a failed run), which
        then ends when its job returns."""
        worker = self._workers[rank]
        if worker is None or worker.busy:
            if worker is not None:
                worker.stop()
            worker = self._workers[rank] = RankThread(f"xcp-rank-{rank}", self._cpu)
        return worker

    def _join(self, threads: list[Job]) -> None:
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
        """Raise :class:`RankAborted` in a rank waiting in a world another rank failed, or one closed."""
        failure = self._failure
        if failure is not None and failure[0] != rank:
            raise RankAborted(f"rank {rank}: aborted because rank {failure[0]} failed")
        if self._closed:
            raise RankAborted(f"rank {rank}: aborted because its LocalWorld was closed")


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
        self._me = rank if self._members is None else self._members[rank]  # this rank in the world

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

    def hybrid_groups(self, ulysses: int) -> tuple[Communicator, Communicator]:
        """This rank's head group and ring (see :func:`xcp.comm.hybrid_groups`) as :meth:`subgroup` s."""
        return split_hybrid(self, ulysses, lambda ranks, which: self.subgroup(ranks))

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
        if tag not in TAGS:
            raise ValueError(f"tag: expected one of {', '.join(TAGS)}; got {tag!r}")
        world, me = self.world, self._me
        # one mailbox item per peer and direction: the i-th tensor to (or from) a peer is channel i of the pair
        send_to = _by_peer(sends, self._members)
        recv_from = _by_peer(recvs, self._members)
        if not send_to and not recv_from:
            return _LocalWork(self, backend, (), tag, step)
        self._check_in_run()
        device = (sends[0][0] if sends else recvs[0][0]).device
        stream = backend.current_stream(device)
        if recv_from:
            free = backend.new_event()
            backend.record_event(free, stream)
            for peer, bufs in recv_from.items():
                world.mail.put(("post", peer, me, tag), (bufs, free))
        if send_to:
            waited: list[Any] = []
            for peer, tensors in send_to.items():
                names = _channels(tag, len(tensors))
                what = lambda p=peer, c=names: f"rank {p} to post receive {c}{at_step(step)}"  # noqa: E731
                bufs, free = world.mail.take(me, ("post", me, peer, tag), what)
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
                world.mail.put(("done", me, peer, tag), done)
        recvs_by_peer = tuple((bufs[0].device, peer, len(bufs)) for peer, bufs in recv_from.items())
        return _LocalWork(self, backend, recvs_by_peer, tag, step)

    def _check_in_run(self) -> None:
        """Refuse at once an exchange from a thread that is not running this rank's job of
        :meth:`LocalWorld.run`: no peer would ever answer it, and it would wait the whole timeout."""
        running = self.world._running.get(threading.get_ident())
        if running == self._me:
            return
        where = f"thread {threading.current_thread().name!r}"
        where += " outside any run" if running is None else f", which runs world rank {running}"
        raise RuntimeError(
            f"group {self!r}: expected a call inside LocalWorld.run(fn) on this rank's own thread (fn(group) is "
            f"handed its group); got one from {where}. Its peers answer only inside world.run: used elsewhere it "
            "would wait for them until the timeout"
        )

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> _LocalWork:
        """``send[j]`` to group rank j and ``recv[j]`` from group rank j (dim 0 indexes the ranks): this
        rank's own piece copied on the current stream, then one :meth:`exchange` with every peer (whose
        "free" event, recorded after that copy, orders the peers' copies into ``recv`` after it)."""
        n, me = self.size(), self._rank
        check_all_to_all(send, recv, n)
        recv[me].copy_(send[me])
        peers = [j for j in range(n) if j != me]
        return self.exchange([(send[j], j) for j in peers], [(recv[j], j) for j in peers], tag, backend, step)

    def all_gather(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> _LocalWork:
        """Every rank's ``send`` into ``recv[j]`` (dim 0 indexes the ranks), as :meth:`all_to_all` moves its
        pieces: this rank's own copied on the current stream, then one :meth:`exchange` with every peer."""
        n, me = self.size(), self._rank
        check_all_gather(send, recv, n)
        recv[me].copy_(send)
        peers = [j for j in range(n) if j != me]
        return self.exchange([(send, j) for j in peers], [(recv[j], j) for j in peers], tag, backend, step)


class _LocalWork:
    """The receives of one exchange, each ``(device, peer world rank, number of channels)``."""

    def __init__(
        self, group: LocalGroup, backend: Any, recvs: Sequence[tuple[Any, int, int]], tag: str, step: int | None
    ) -> None:
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
            what = lambda p=peer, n=n: f"{_channels(tag, n)} from rank {p}{at_step(self._step)}"  # noqa: E731
            done = g.world.mail.take(g._me, ("done", peer, g._me, tag), what)
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
