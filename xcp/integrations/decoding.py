"""Which sharded KV cache a thread's model forward attends over, while ``xt.generate`` runs it.

transformers hands a ``Cache`` the new keys and values (``Cache.update``) but never the queries, and hands
the attention function the queries but never the cache. :func:`xcp.integrations.transformers.generate`
therefore sets its cache here for the thread that runs the model (a virtual rank of a LocalWorld is a
thread; a torchrun rank a process), and the attention function asks it for the attention of a layer: a
tensor over the sharded cache, or None while the prompt goes through the ring. Nothing here imports
transformers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Window = tuple[int, int] | None
Decoder = Callable[..., torch.Tensor | None]
"""``decoder(module, q, key, value, causal, scale, window, sinks, who, **variants)``: the attention of
``module`` (the attention module transformers hands the attention function) for ``q`` ``[B, T, H, D]`` (the
same on every rank) over the sharded cache, ``[B, T, H, D]``; ``key`` and ``value`` are what the model
handed to the attention function (transformers' ``[B, H_kv, T, D]``, the very objects: the cache finds the
layer whose update returned them); None: run the ring (the prompt), after the cache kept its shard. ``who``
names the module in errors; ``variants``: ``softcap=`` and ``chunk=``, passed only where the layer has
them."""


_local = threading.local()


def current() -> Decoder | None:
    """The decoder this thread set with :func:`using`, else None."""
    return getattr(_local, "decoder", None)


def cache() -> object | None:
    """The object whose method this thread's decoder is (``xt.generate``'s sharded cache), else None: where a
    recurrent layer whose model hands it no cache (RWKV, xLSTM) finds the states that generate keeps."""
    return getattr(current(), "__self__", None)


@contextmanager
def using(decoder: Decoder) -> Iterator[Decoder]:
    """Set ``decoder`` for this thread while the block runs (the one before it afterwards)."""
    before = current()
    _local.decoder = decoder
    try:
        yield decoder
    finally:
        _local.decoder = before
