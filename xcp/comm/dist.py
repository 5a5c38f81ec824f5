"""The torch.distributed communicator: point-to-point on any process group (NCCL, HCCL, gloo), bounded waits,
the hybrid's sub-groups made with ``new_group``, and what a ``group=`` argument means (:func:`resolve_group`).

A wait that blocks the host (CPU tensors, gloo) is bounded by ``timeout=``, else ``XCP_TIMEOUT``, else the
shorter of :data:`DEFAULT_TIMEOUT` and the process group's own timeout, so a stuck peer fails every rank
waiting for it with :class:`CommTimeout` within the bound the user asked for; a device wait (NCCL, HCCL)
only orders streams and is left to the process group unless a bound is given. A bound on a process group whose
``work.wait(timeout)`` ignores the timeout (``Backend.poll_comm_waits``: HCCL) is kept by polling
``work.is_completed()`` on the host.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from typing import Any, cast

import torch

from .. import settings
from ..lifetime import thread_store
from .protocol import (
    TAGS,
    CommTimeout,
    Communicator,
    DoneWork,
    Recvs,
    Sends,
    SingleRank,
    Work,
    at_step,
    check_all_gather,
    check_all_to_all,
    check_timeout,
    split_hybrid,
)

DEFAULT_TIMEOUT = 600.0
"""Seconds a torch.distributed wait that blocks the host (gloo, CPU tensors) may take when neither
``timeout=`` nor ``XCP_TIMEOUT`` says otherwise and the process group's own timeout is not shorter: gloo's
default bound is 30 minutes, far too long to learn that a peer is stuck."""


def group_timeout(group: Any, device: str | None = "cpu") -> float | None:
    """Seconds of ``group``'s own timeout (set by ``init_process_group`` / ``new_group(timeout=...)``) for
    its ``device`` backend (None: its first); None where the group has no such backend or torch does not say."""
    try:
        # torch keeps the timeout in the options of the group's backend object (private, untyped here)
        dev = group._device_types[0] if device is None else torch.device(device)
        return float(group._get_backend(dev).options._timeout.total_seconds())
    except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
        return None


class DistCommunicator:
    """Point-to-point over a torch.distributed process group (``batch_isend_irecv``).

    :param timeout: seconds a wait on a peer may take before :class:`CommTimeout`; None reads
        ``XCP_TIMEOUT``. Without either, waits that block the host anyway (CPU tensors, gloo) are bounded
        by the process group's own timeout, and by :data:`DEFAULT_TIMEOUT` where that is longer; device
        waits (NCCL, HCCL), which only order streams and never block the host, are left to the process
        group's own timeout. An explicit bound applies to device waits too, at a price: each wait then
        blocks the host until the transfer has landed.
    """

    ranks_are_threads = False

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        # the default group: WORLD, typed Optional (None until initialised, which get_world_size reports)
        self.group: Any = cast(Any, dist.group.WORLD) if group is None else group
        self._size = dist.get_world_size(self.group)
        self._rank = dist.get_rank(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self._size)]
        timeout = check_timeout(timeout)
        self.timeout: float | None = timeout if timeout is not None else settings.TIMEOUT.read()

    @functools.cached_property
    def group_timeout(self) -> float | None:
        """The group's own timeout for host waits (seconds; None where torch does not say), read at the
        first wait that needs it: a call with a bound of its own, or on a device, never does."""
        return group_timeout(self.group)

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
        return self._bound(device)[0]

    def _bound(self, device: torch.device) -> tuple[float | None, str]:
        """The bound of a wait on ``device`` tensors and where it comes from, for a timeout's message."""
        if self.timeout is not None:
            return self.timeout, f"the bound is xcp.attention(timeout=...) or {settings.TIMEOUT.name}"
        if device.type != "cpu":
            return None, ""
        change = f"xcp.attention(timeout=...) or {settings.TIMEOUT.name} sets another"
        if self.group_timeout is not None and self.group_timeout <= DEFAULT_TIMEOUT:
            return self.group_timeout, f"the process group's own timeout; {change}"
        return DEFAULT_TIMEOUT, f"xcp's default for waits that block the host; {change}"

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> Work:
        dist = self._dist
        base = TAGS[tag] * 16
        # P2P needs contiguous tensors; a copy made here is on the current (comm) stream, which the process
        # group orders and keeps alive itself
        sends = [(t.contiguous(), p) for t, p in sends]
        ops = [dist.P2POp(dist.isend, t, self._global[p], self.group, base + i) for i, (t, p) in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, b, self._global[p], self.group, base + i) for i, (b, p) in enumerate(recvs)]
        if not ops:
            return DoneWork()
        what: list[tuple[str, int | None]] = [(f"sending {tag}{i} to rank {p}", p) for i, (_, p) in enumerate(sends)]
        what += [(f"receiving {tag}{i} from rank {p}", p) for i, (_, p) in enumerate(recvs)]
        device = (sends[0][0] if sends else recvs[0][0]).device
        return _DistWork(dist.batch_isend_irecv(ops), what, self._who(), step, self._bound(device), _polls(backend))

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> Work:
        """``send[j]`` to group rank j and ``recv[j]`` from group rank j (dim 0 indexes the ranks), through
        ``all_to_all_single`` issued on the current stream; ``wait()`` as for :meth:`exchange`."""
        check_all_to_all(send, recv, self._size)
        send = send.contiguous()  # a copy made here lives on the current stream, which the group orders
        if self._size == 1:
            recv.copy_(send)
            return DoneWork()
        work = self._dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        what: list[tuple[str, int | None]] = [(f"in all-to-all {tag}", None)]
        return _DistWork([work], what, self._who(), step, self._bound(send.device), _polls(backend))

    def all_gather(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> Work:
        """Every rank's ``send`` into ``recv[j]`` (dim 0 indexes the ranks; ``recv`` contiguous), through
        ``all_gather_single`` (``all_gather_into_tensor`` before torch had it) on flat views, the form
        every process group serves, issued on the current stream; ``wait()`` as for :meth:`exchange`."""
        check_all_gather(send, recv, self._size)
        if not recv.is_contiguous():
            raise ValueError(f"recv: expected a contiguous tensor; got strides {recv.stride()}")
        send = send.contiguous()  # a copy made here lives on the current stream, which the group orders
        if self._size == 1:
            recv[0].copy_(send)
            return DoneWork()
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        work = gather(recv.view(-1), send.view(-1), group=self.group, async_op=True)
        what: list[tuple[str, int | None]] = [(f"in all-gather {tag}", None)]
        return _DistWork([work], what, self._who(), step, self._bound(send.device), _polls(backend))

    def hybrid_groups(self, ulysses: int) -> tuple[Communicator, Communicator]:
        """The head group and ring of this rank (see :func:`xcp.comm.hybrid_groups`), over ProcessGroups
        made with ``new_group`` once per group and ``ulysses`` (:func:`_hybrid_process_groups`); they keep
        this communicator's ``timeout`` and their process groups this group's own timeout."""
        groups = _hybrid_process_groups(self, ulysses)
        head, ring = split_hybrid(self, ulysses, lambda ranks, which: DistCommunicator(groups[which], self.timeout))
        rank = self._rank
        for what, c, want in (("head group", head, rank % ulysses), ("ring", ring, rank // ulysses)):
            if c.rank() != want:  # pragma: no cover - new_group orders sorted ranks, as checked when made
                raise RuntimeError(f"xcp: rank {rank} is rank {c.rank()} of its {what}, expected {want}")
        return head, ring

    def _who(self) -> str:
        me = self._global[self._rank]
        return f"rank {self._rank}" + ("" if me == self._rank else f" (global rank {me})")


POLL_INTERVAL = 0.001
"""Seconds between two ``work.is_completed()`` queries of a polled bounded wait (``Backend.poll_comm_waits``)."""


def _polls(backend: Any) -> bool:
    """Whether bounded waits on ``backend``'s process group poll (see ``Backend.poll_comm_waits``)."""
    return bool(getattr(backend, "poll_comm_waits", False))


class _DistWork:
    """Requests in flight; ``wait`` bounds them together by one deadline when a bound is set: by passing what is left
    to ``req.wait(timeout)``, or, with ``poll`` (a process group whose wait ignores its timeout, e.g. HCCL without
    TORCH_HCCL_BLOCKING_WAIT), by polling ``req.is_completed()`` on the host until the deadline and then calling
    ``req.wait()`` on a request that has completed (which orders the current stream after it)."""

    def __init__(
        self,
        requests: list,
        what: list[tuple[str, int | None]],
        who: str,
        step: int | None,
        bound: tuple[float | None, str],
        poll: bool = False,
    ) -> None:
        self._requests, self._what, self._who, self._step = requests, what, who, step
        self._bound, self._why = bound
        self._poll = poll

    def wait(self) -> None:
        bound = self._bound
        if bound is None:
            for req in self._requests:
                req.wait()
            return
        deadline = time.monotonic() + bound
        for req, (what, peer) in zip(self._requests, self._what):
            where = f"xcp: {self._who} {what}{at_step(self._step)}"
            timeout = CommTimeout(
                f"{where}: no progress within {bound:g} s; is "
                f"{'a rank of the group' if peer is None else f'rank {peer}'} stuck or gone? ({self._why})"
            )
            try:
                if self._poll:
                    while not req.is_completed():
                        if time.monotonic() >= deadline:
                            raise timeout
                        time.sleep(POLL_INTERVAL)
                    req.wait()
                else:
                    req.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except CommTimeout:
                raise
            except RuntimeError as exc:
                if time.monotonic() >= deadline - 0.05 * bound or "timed out" in str(exc).lower():
                    raise timeout from exc
                raise RuntimeError(f"{where} failed: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# The hybrid's process groups


_dist_groups: dict[tuple, tuple[Any, Any]] = {}
_dist_groups_lock = threading.Lock()


def _hybrid_process_groups(comm: DistCommunicator, ulysses: int) -> tuple[Any, Any]:
    """This process's (head group, ring) ProcessGroups for ``comm``'s group split by ``ulysses``, made once.

    Every rank makes every group in the same order: the head groups by index, then the rings. When
    ``comm``'s group is the whole world this is plain ``new_group`` (every process of the world takes part,
    and every process calls xcp.attention); for a smaller group only its members call, so the groups are made
    with ``use_local_synchronization=True``, each rank making only the groups it belongs to (in the same
    global order, which keeps the hashed group names equal on the members). Each gets the timeout of
    ``comm``'s group, so a wait on a sub-group is bounded as one on the group itself.
    """
    dist = comm._dist
    members = comm.members
    whole = sorted(members) == list(range(dist.get_world_size()))
    own = group_timeout(comm.group, None)
    key = (members, ulysses, whole, own)
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
    timeout = None if own is None else datetime.timedelta(seconds=own)
    mine: list[Any] = [None, None]
    me = members[rank]
    for which, lists in enumerate((heads, rings)):
        for ranks in lists:
            if len(ranks) == 1:  # a ring of one rank moves nothing: no group
                made = None
            elif len(ranks) == size:  # the whole group: use it as it is
                made = comm.group
            elif whole:
                made = dist.new_group(ranks, timeout=timeout)
            elif me in ranks:
                made = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
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


# ----------------------------------------------------------------------------------------------------
# What group= means


def process_group_of_mesh(group: Any) -> Any:
    """The ProcessGroup of a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (a mesh of one dim, or one
    named dim of a larger mesh: ``mesh["cp"]``), as FSDP2 and torch's context parallel take it; None when
    ``group`` is no DeviceMesh; a ValueError naming the dims for a mesh of several."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not isinstance(group, DeviceMesh):
        return None
    if group.ndim != 1:
        names = getattr(group, "mesh_dim_names", None)
        raise ValueError(
            f"group: expected a DeviceMesh of 1 dim (or one named dim of it, e.g. mesh['cp']); got {group.ndim} "
            f"dims{f' named {tuple(names)}' if names else ''}"
        )
    return group.get_group()


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
