"""What the ring asks of a group of ranks: the :class:`Communicator` protocol, its errors and tags.

Also the communicator of a world of one (:class:`SingleRank`) and the split of a group into the hybrid's
head groups and rings (:func:`hybrid_members`, :func:`split_hybrid`), which every communicator that
serves ``ulysses > 1`` builds from through its own ``hybrid_groups(ulysses)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..lifetime import thread_store

Sends = Sequence[tuple[torch.Tensor, int]]
Recvs = Sequence[tuple[torch.Tensor, int]]

TAGS: dict[str, int] = {
    "kv": 1,
    "dkv": 2,
    "agree": 3,
    "a2a": 4,
    "combine": 5,
    "token": 6,
    "state": 7,
    "dstate": 8,
    "halo": 9,
    "dhalo": 10,
}
"""The channels of an exchange, each with its number (a torch.distributed tag base): ``kv`` the K/V shards
the ring forward passes on, ``dkv`` the dK/dV the backward sends home, ``agree`` the fingerprint of the
first call of a configuration (xcp.agreement), ``a2a`` the hybrid's all-to-all over heads, ``combine`` the
all-gather of the packed partial [out | lse] of a KV cache's attention (xcp.inference.cache), ``token`` the token
rank 0 chose at a step of generation (xcp.integrations.transformers_generate), ``state`` / ``dstate`` the
all-gather of a recurrent layer's per-piece summaries and the all-to-all of their gradients, ``halo`` /
``dhalo`` the same for a causal convolution's halos (xcp.recurrent)."""


class RankAborted(RuntimeError):
    """Raised in a virtual rank whose world was aborted because another rank failed (or was closed)."""


class CommTimeout(TimeoutError):
    """A rank waited longer than its bound for a peer (a LocalWorld's ``timeout``; on a torch.distributed
    group ``timeout=``, ``XCP_TIMEOUT`` or the group's own timeout); the message names the rank, the peer,
    the step and the tag."""


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` as float seconds (None stays None); a ValueError naming ``name`` unless positive and finite."""
    if timeout is None:
        return None
    real = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
    if not real or not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{name}: expected a positive finite number of seconds or None; got {timeout!r}")
    return float(timeout)


def at_step(step: int | None) -> str:
    """`` at step N`` for an error message, or nothing outside a ring step."""
    return "" if step is None else f" at step {step}"


class Work(Protocol):
    """An exchange in flight."""

    def wait(self) -> None:
        """Make the current stream wait until every receive of the exchange has landed."""


class DoneWork:
    """A :class:`Work` with nothing left to wait for (an exchange that moved nothing)."""

    def wait(self) -> None:
        pass


@runtime_checkable
class Communicator(Protocol):
    """What the ring needs of a group of ranks; a ``group=`` that is one is used as it is.

    ``ranks_are_threads`` is True where the ranks are threads of one process (a LocalWorld): there a
    backward that autograd runs on another thread than the rank's own could not wait for its peers.

    The hybrid (``ulysses > 1``) needs two more methods, optional here (a communicator without them serves
    the ring only): ``all_to_all(send, recv, tag, backend, step=None) -> Work`` (``send[j]`` to group rank
    j, ``recv[j]`` from it) and ``hybrid_groups(ulysses) -> (head group, ring)`` (see :func:`split_hybrid`).
    The KV cache (:class:`xcp.KVCache`) needs one more, optional too:
    ``all_gather(send, recv, tag, backend, step=None) -> Work``: every rank's ``send`` into ``recv``
    [size, *send.shape] (``recv[j]`` is group rank j's), issued on the backend's current stream like
    :meth:`exchange`, ``wait()`` making the current stream wait until ``recv`` holds every piece
    (:func:`check_all_gather`). Optional members keep a ring-only communicator a Communicator.
    """

    ranks_are_threads: bool

    def rank(self) -> int:
        """This rank, 0 <= rank < size."""

    def size(self) -> int:
        """The number of ranks (the world size of the ring)."""

    def exchange(self, sends: Sends, recvs: Recvs, tag: str, backend: Any, step: int | None = None) -> Work:
        """Send each ``(tensor, peer)`` of ``sends`` and receive into each ``(buffer, peer)`` of ``recvs``.

        Issued on the backend's current stream; ``tag`` (one of :data:`TAGS`) keeps channels apart;
        ``step`` (the ring step, when there is one) is for error messages.
        """

    def rank_store(self) -> dict:
        """A dict kept for this rank across calls (xcp.lifetime keeps its streams and workspace there)."""


def check_all_to_all(send: torch.Tensor, recv: torch.Tensor, size: int) -> None:
    """Raise unless ``send`` holds one piece per rank on dim 0 and ``recv`` has its shape and dtype."""
    if send.dim() < 1 or send.shape[0] != size:
        raise ValueError(f"send: expected dim 0 of size {size} (one piece per rank); got shape {tuple(send.shape)}")
    if recv.shape != send.shape or recv.dtype != send.dtype:
        raise ValueError(
            f"recv: expected shape {tuple(send.shape)} {send.dtype} (that of send); "
            f"got {tuple(recv.shape)} {recv.dtype}"
        )


def check_all_gather(send: torch.Tensor, recv: torch.Tensor, size: int) -> None:
    """Raise unless ``recv`` is [size, *send.shape] in send's dtype."""
    want = (size, *send.shape)
    if tuple(recv.shape) != want or recv.dtype != send.dtype:
        raise ValueError(
            f"recv: expected shape {want} {send.dtype} (one send per rank); got {tuple(recv.shape)} {recv.dtype}"
        )


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
        return DoneWork()

    def all_gather(
        self, send: torch.Tensor, recv: torch.Tensor, tag: str, backend: Any, step: int | None = None
    ) -> Work:
        """``recv[0]`` is ``send``: a copy on the current stream."""
        check_all_gather(send, recv, 1)
        recv[0].copy_(send)
        return DoneWork()

    def hybrid_groups(self, ulysses: int) -> tuple[Communicator, Communicator]:
        """Itself as its head group and as its ring (``ulysses`` divides 1)."""
        return self, self


# ----------------------------------------------------------------------------------------------------
# Hybrid sub-groups: the head group and the ring of a rank


def hybrid_members(size: int, rank: int, ulysses: int) -> tuple[list[int], list[int]]:
    """The group ranks of ``rank``'s head group (the ``ulysses`` consecutive ranks ``rank // ulysses``
    shares) and of its ring (the ranks with the same ``rank % ulysses``), each in group order."""
    g, u = divmod(rank, ulysses)
    return [g * ulysses + j for j in range(ulysses)], list(range(u, size, ulysses))


def split_hybrid(
    comm: Communicator, ulysses: int, make: Callable[[list[int], int], Communicator]
) -> tuple[Communicator, Communicator]:
    """``comm``'s head group and ring for ``ulysses`` (see :func:`hybrid_members`), the part every
    communicator's ``hybrid_groups`` shares: a head group of the whole group is ``comm`` itself, a ring of
    one rank a :class:`SingleRank`, any other ``make(group ranks, which)`` (``which``: 0 head, 1 ring)."""
    size = comm.size()
    head_ranks, ring_ranks = hybrid_members(size, comm.rank(), ulysses)
    head = comm if len(head_ranks) == size else make(head_ranks, 0)
    ring = SingleRank() if len(ring_ranks) == 1 else make(ring_ranks, 1)
    return head, ring


def hybrid_groups(comm: Communicator, ulysses: int) -> tuple[Communicator, Communicator]:
    """This rank's head group (``ulysses`` consecutive ranks; group rank ``rank % ulysses``) and its ring
    (the ranks with the same ``rank % ulysses``; group rank ``rank // ulysses``), as communicators: the
    communicator's own ``hybrid_groups(ulysses)`` (``ulysses`` divides ``comm.size()``, checked by the
    caller); a TypeError naming a communicator that has none."""
    own = getattr(comm, "hybrid_groups", None)
    if not callable(own):
        raise TypeError(
            f"group: ulysses > 1 needs a group xcp can split into head groups and rings (a torch.distributed "
            f"ProcessGroup or a group from xcp.LocalWorld), or a communicator with hybrid_groups(); got "
            f"{type(comm).__name__}"
        )
    return own(ulysses)
