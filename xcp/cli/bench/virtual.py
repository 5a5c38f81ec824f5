"""P virtual ranks of a ring (or of the hybrid) on one device, in one process: the thing ``xcp bench`` times
against one whole-sequence kernel call, and checks against it first."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ... import schedule
from ...api import shard, unshard
from ...comm import LocalWorld
from ...hybrid import HybridConfig, hybrid_backward, hybrid_config, hybrid_forward
from ...lifetime import track_buffers
from ...ring import RingConfig, ring_backward, ring_forward
from ...testing.doubles import CountingCommunicator
from ..common import error


class VirtualRing:
    """P virtual ranks on one device, each a thread with its own stream, sharing pre-sharded inputs. With
    ``ulysses`` = U > 1 each rank runs the hybrid (:func:`xcp.hybrid.hybrid_forward` / ``hybrid_backward``:
    head groups of U ranks, rings of R = P/U), the inputs sharded by ``xcp.shard(..., ulysses=U)``."""

    def __init__(
        self,
        backend,
        world: int,
        full: tuple[torch.Tensor, ...],
        causal: bool,
        balance: str,
        slots="bounded",
        documents: tuple[int, ...] | None = None,
        window: tuple[int | None, int | None] | None = None,
        ulysses: int = 1,
    ):
        self.backend, self.world_size, self.causal, self.balance, self.slots = backend, world, causal, balance, slots
        self.window, self.ulysses = window, ulysses
        seq = full[0].shape[1]
        self.documents = (0, seq) if documents is None and window is not None else documents  # a window needs them
        self.sent: list[dict[str, int]] = [{} for _ in range(world)]
        """Bytes each rank sent in the last run, per tag (``kv``, ``dkv``; ``a2a`` for the hybrid's all-to-alls)."""
        self.device = full[0].device
        self.world = LocalWorld(world, device=self.device)
        self.place: dict[str, Any] = {"balance": balance, "ulysses": ulysses}
        """How the inputs are placed (``xcp.shard``'s and ``xcp.unshard``'s keywords): a balance that places each
        document takes the documents' boundaries too."""
        if balance in schedule.DOCUMENT_BALANCES:
            self.place["cu_seqlens"] = self.documents
        self.shards = [tuple(shard(x, world, r, **self.place) for x in full) for r in range(world)]
        self.streams = [backend.new_stream(self.device) for _ in range(world)]
        self.scale = 1.0 / math.sqrt(full[0].shape[-1])
        self.ledgers: list[Any] = [None] * world

    def _rank(self, group, backward: bool, main_stream) -> Any:
        be = self.backend
        stream = self.streams[group.rank()]
        be.wait_stream(stream, main_stream)
        q, k, v, dout = self.shards[group.rank()]
        if self.ulysses > 1:
            return self._hybrid_rank(group, backward, stream, q, k, v, dout)
        comm = CountingCommunicator(group, self.sent[group.rank()])
        cfg = RingConfig(comm, be, self.causal, self.scale, self.balance, self.slots, documents=self.documents,
                         window=self.window)  # fmt: skip
        with be.stream_context(stream), track_buffers() as ledger:
            out, lse = ring_forward(q, k, v, cfg)
            grads = ring_backward(dout, q, k, v, out, lse, cfg) if backward else None
        self.ledgers[group.rank()] = ledger
        return stream, out, grads

    def _hybrid_rank(self, group, backward: bool, stream, q, k, v, dout) -> Any:
        be, sent = self.backend, self.sent[group.rank()]
        with be.stream_context(stream), track_buffers() as ledger:
            cfg = hybrid_config(q, k, group, be, self.ulysses, causal=self.causal, scale=self.scale,
                                balance=self.balance, slots=self.slots, cu_seqlens=self.documents,
                                window=self.window)  # fmt: skip
            ring = dataclasses.replace(cfg.ring, comm=CountingCommunicator(cfg.ring.comm, sent))
            cfg = HybridConfig(CountingCommunicator(cfg.head, sent), ring, cfg.ulysses, cfg.replicas)
            out, state = hybrid_forward(q, k, v, cfg)
            grads = hybrid_backward(dout, state, cfg) if backward else None
            del state
        self.ledgers[group.rank()] = ledger
        return stream, out, grads

    def run(self, backward: bool) -> list[Any]:
        """One forward (and backward) of every rank; the caller's stream waits for all of them."""
        main = self.backend.current_stream(self.device)
        for sent in self.sent:
            sent.clear()
        results = self.world.run(self._rank, backward, main)
        for stream, _, _ in results:
            self.backend.wait_stream(main, stream)
        return results


def check_against_whole_kernel(ring: VirtualRing, results, whole_out, whole_grads) -> dict[str, float]:
    """Relative errors of the ring's out (and grads) against the whole-sequence kernel."""
    errs = {"out": error(unshard([r[1] for r in results], **ring.place), whole_out).rel}
    if whole_grads is not None:
        for i, name in enumerate(("dq", "dk", "dv")):
            errs[name] = error(unshard([r[2][i] for r in results], **ring.place), whole_grads[i]).rel
    return errs
