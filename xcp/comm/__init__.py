"""Communicators: how a shard moves to the next rank.

Three kinds, one typed interface, :class:`Communicator` (``rank()``, ``size()``, ``exchange(sends, recvs,
tag, backend) -> work``, ``work.wait()``, ``rank_store()``; the protocol, its errors and tags in
:mod:`xcp.comm.protocol`):

- :class:`DistCommunicator` (:mod:`xcp.comm.dist`): torch.distributed point-to-point through
  ``batch_isend_irecv`` on any process group (NCCL, HCCL, gloo), launched with torchrun, across hosts;
- :class:`LocalGroup` (:mod:`xcp.comm.local`): one virtual rank of a :class:`LocalWorld`, P ranks as
  threads of one process (:mod:`xcp.comm.threads`) with an in-process exchange that keeps device stream
  semantics;
- :class:`SingleRank`: a world of one, for calls without a group.

The hybrid (``ulysses=U``) path also needs an all-to-all, ``all_to_all(send, recv, tag, backend)``, and the
two sub-groups of a rank, which each communicator builds itself (``comm.hybrid_groups(U)``; called through
:func:`hybrid_groups`, which names a communicator without them): its head group of U consecutive ranks and
its ring of the ranks with the same ``rank % U`` (torch.distributed groups made by ``new_group`` and
cached; LocalWorld sub-groups that share the parent's threads and mailbox). The KV cache
(:class:`xcp.KVCache`) needs an all-gather, ``all_gather(send, recv, tag, backend)`` (``recv[j]`` is group
rank j's ``send``): ``all_gather_single`` on a process group, one exchange with every peer on a LocalWorld,
a copy in a world of one.
"""

from .dist import DEFAULT_TIMEOUT, DistCommunicator, group_timeout, process_group_of_mesh, resolve_group
from .local import LocalGroup, LocalWorld
from .protocol import (
    TAGS,
    CommTimeout,
    Communicator,
    DoneWork,
    RankAborted,
    Recvs,
    Sends,
    SingleRank,
    Work,
    check_timeout,
    hybrid_groups,
    hybrid_members,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "TAGS",
    "CommTimeout",
    "Communicator",
    "DistCommunicator",
    "DoneWork",
    "LocalGroup",
    "LocalWorld",
    "RankAborted",
    "Recvs",
    "Sends",
    "SingleRank",
    "Work",
    "check_timeout",
    "group_timeout",
    "hybrid_groups",
    "hybrid_members",
    "process_group_of_mesh",
    "resolve_group",
]
