"""One object that holds a rank's group, balance and ulysses: ``xcp.context(group, balance, ulysses)``.

``shard``, ``unshard`` and ``attention`` must agree on how the sequence is placed on the ranks; a context
holds the group, the balance and ``ulysses`` (the hybrid all-to-all + ring's head-group size; 1 for the ring
alone) once, and its methods pass them::

    with xcp.context(group, balance="zigzag") as ctx:
        q_l = ctx.shard(q)
        out_l = ctx.attention(q_l, k_l, v_l, causal=True)

Entering a context makes it the current one *of this thread* (each virtual rank of a
:class:`xcp.LocalWorld` is a thread and enters its own); :func:`current` returns the innermost context
entered, or a default one (group None: the default process group when torch.distributed is initialised,
else a world of one rank; balance ``zigzag``). Integrations (e.g. :mod:`xcp.integrations.transformers`)
read the current context, so model code needs no group argument.

``xcp.context`` is both the class and this module: ``xcp.context(group)`` builds a context and
``xcp.context.current()`` returns the current one, whichever of the two ``xcp.context`` names.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

import torch

from . import schedule
from .api import attention as _attention
from .api import shard as _shard
from .api import unshard as _unshard
from .checks import check_ulysses
from .comm import resolve_group

_local = threading.local()


def _stack() -> list[Context]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class Context:
    """A rank's group, balance and ulysses, held once; a context manager (see the module's documentation).

    :param group: a torch.distributed ProcessGroup, a group from :class:`xcp.LocalWorld`, or None (the
        default process group when one is initialised at the time of use, else a world of one rank).
    :param balance: how the sequence is placed on the ranks (``zigzag``, ``contiguous`` or ``stripe``).
    :param ulysses: U of the hybrid all-to-all + ring (see :func:`xcp.attention`): ``shard``, ``unshard``
        and ``attention`` all pass it; 1 (default) is the ring alone. U must divide the group's size (checked
        at use, when the group is known) and the heads.
    """

    __slots__ = ("_group", "_balance", "_ulysses")

    def __init__(self, group: Any = None, balance: str = schedule.DEFAULT_BALANCE, ulysses: int = 1) -> None:
        schedule.check_balance(balance)
        ulysses = check_ulysses(ulysses)
        if group is not None:
            resolve_group(group)  # a TypeError naming group now, not at the first call
        self._group = group
        self._balance = balance
        self._ulysses = ulysses

    # -- what it holds
    @property
    def group(self) -> Any:
        """The group as given (None: the default process group if initialised, else a world of one)."""
        return self._group

    @property
    def balance(self) -> str:
        """How the sequence is placed on the ranks."""
        return self._balance

    @property
    def ulysses(self) -> int:
        """U of the hybrid all-to-all + ring (1: the ring alone)."""
        return self._ulysses

    def _comm(self) -> Any:
        return resolve_group(self._group)

    def _rank_size(self) -> tuple[int, int]:
        if torch.compiler.is_compiling():
            return _traced_rank_size(self._group)
        comm = self._comm()
        return comm.rank(), comm.size()

    @property
    def rank(self) -> int:
        """This rank in the group."""
        return self._rank_size()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks the sequence is split over."""
        return self._rank_size()[1]

    def __repr__(self) -> str:
        comm = self._comm()
        hybrid = f", ulysses={self._ulysses}" if self._ulysses != 1 else ""
        where = f"rank {comm.rank()} of {comm.size()}"
        return f"xcp.context(group={self._group!r}, balance={self._balance!r}{hybrid}: {where})"

    # -- the three operations, with this context's group, balance and ulysses
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the whole sequence ``x`` along ``dim`` (see :func:`xcp.shard`)."""
        rank, size = self._rank_size()
        return _shard(x, size, rank, dim=dim, balance=self._balance, ulysses=self._ulysses)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from the shards of ranks 0..P-1 (see :func:`xcp.unshard`)."""
        return _unshard(shards, dim=dim, balance=self._balance, ulysses=self._ulysses)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        """:func:`xcp.attention` on this rank's shards with this context's group, balance and ulysses: its
        out, or ``(out, lse)`` with ``return_lse=True``.

        ``kwargs`` are those of :func:`xcp.attention` (``causal`` is required there too); a ``balance``,
        ``group`` or ``ulysses`` that disagrees with the context's raises a ValueError naming both.
        """
        if "ulysses" in kwargs and kwargs["ulysses"] != self._ulysses:
            raise ValueError(
                f"ulysses: this xcp.context places the sequence with ulysses={self._ulysses}; "
                f"attention(ulysses={kwargs['ulysses']!r}) disagrees (leave ulysses= out inside a context)"
            )
        if "balance" in kwargs and kwargs["balance"] != self._balance:
            raise ValueError(
                f"balance: this xcp.context places the sequence with balance {self._balance!r}; "
                f"attention(balance={kwargs['balance']!r}) disagrees (leave balance= out inside a context)"
            )
        if "group" in kwargs and kwargs["group"] is not self._group:
            raise ValueError(
                f"group: this xcp.context holds group {self._group!r}; attention(group={kwargs['group']!r}) "
                "disagrees (leave group= out inside a context)"
            )
        kwargs["balance"], kwargs["group"], kwargs["ulysses"] = self._balance, self._group, self._ulysses
        return _attention(q, k, v, **kwargs)

    # -- the current context of this thread
    def __enter__(self) -> Context:
        _stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _stack()
        if not stack or stack[-1] is not self:
            raise RuntimeError("xcp.context: contexts must be left in the reverse order they were entered")
        stack.pop()

    @staticmethod
    def current() -> Context:
        """The innermost context this thread entered, else a default one (group None, balance ``zigzag``)."""
        return current()


context = Context
"""``xcp.context``: the spelling of the public API (a context is built like a function is called)."""


def current() -> Context:
    """The innermost context this thread entered, else a default one (group None, balance ``zigzag``).

    Inside a compiled region (``torch.compile``) the same, read without a side effect so that it traces:
    dynamo reads the thread-local stack and guards on it (a context entered or left between calls
    recompiles), and the default is the module's constant :data:`_DEFAULT`.
    """
    if torch.compiler.is_compiling():
        stack = getattr(_local, "stack", None)
        return stack[-1] if stack else _DEFAULT
    stack = _stack()
    return stack[-1] if stack else Context()


_DEFAULT = Context()
"""The context of a thread that entered none, as a compiled region reads it (a constant to dynamo)."""


def _traced_rank_size(group: Any) -> tuple[int, int]:
    """(rank, size) of ``group`` inside a compiled region, through what dynamo folds into constants
    (``torch.distributed.get_rank``/``get_world_size``) rather than through a communicator. A group a graph
    cannot name (a LocalWorld's: its ranks are threads) raises the ValueError of :func:`xcp.ops.group_name`."""
    import torch.distributed as dist

    from .comm import process_group_of_mesh
    from .ops import group_name

    group_name(group)  # what a compiled call cannot name raises here, with the reason
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    mesh_group = process_group_of_mesh(group)
    pg = group if mesh_group is None else mesh_group
    return dist.get_rank(pg), dist.get_world_size(pg)


class _ContextModule(types.ModuleType):
    """This module, callable: where ``import xcp.context`` made ``xcp.context`` the module rather than the
    class, ``xcp.context(group, balance)`` still builds a context."""

    def __call__(self, group: Any = None, balance: str = schedule.DEFAULT_BALANCE, ulysses: int = 1) -> Context:
        return Context(group, balance, ulysses)


sys.modules[__name__].__class__ = _ContextModule
