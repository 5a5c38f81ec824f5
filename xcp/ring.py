"""Execute a ring plan: the forward pass, the backward pass, and the thin autograd Function over them.

Forward and backward are plain functions so that virtual ranks on a GPU can drive them directly
(FACTS.md: CUDA autograd runs the backward of every thread on one worker, which cannot wait for peers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from . import schedule
from .lifetime import ShardSlots
from .merge import accumulator_dtype, new_accumulators


@dataclass(frozen=True)
class RingConfig:
    """Everything one call needs besides the tensors."""

    comm: Any
    backend: Any
    causal: bool
    scale: float
    balance: str = schedule.DEFAULT_BALANCE
    policy: str = "bounded"
    handoff: str | None = None

    @property
    def plan(self) -> schedule.Plan:
        return schedule.plan(self.comm.size, self.comm.rank, self.causal, self.balance)


def _views(step: schedule.Step, n: int) -> tuple[slice, slice]:
    """The query rows and key rows of a local shard of ``n`` tokens that ``step`` touches."""
    q0, q1 = step.q_range(n)
    k0, k1 = step.k_range(n)
    return slice(q0, q1), slice(k0, k1)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (in q's dtype) and log-sum-exp (accumulator dtype, [B, H, S]).

    Step i computes on the shard of ``src`` while that shard goes to the next rank and the shard of step
    i + 1 arrives from the previous one into the other of two slots.
    """
    comm, backend, plan = cfg.comm, cfg.backend, cfg.plan
    n = q.shape[1]
    out, lse = new_accumulators(q)
    slots = ShardSlots((k, v), cfg.policy)
    try:
        cur_k, cur_v = k, v  # step 0 reads the caller's own K and V in place
        for step in plan.steps:
            work = None
            if step.send_to is not None:
                nxt_k, nxt_v = slots.slot(step.step + 1)
                work = comm.exchange(
                    [(cur_k, step.send_to), (cur_v, step.send_to)],
                    [(nxt_k, step.recv_from), (nxt_v, step.recv_from)],
                    "kv",
                    backend,
                )
            if step.computes:
                qs, ks = _views(step, n)
                block_out, block_lse = backend.forward(q[:, qs], cur_k[:, ks], cur_v[:, ks], step.mask, cfg.scale)
                backend.merge_(out, lse, block_out, block_lse, qs)
            if work is not None:
                work.wait()
                cur_k, cur_v = nxt_k, nxt_v
    finally:
        slots.release()
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cfg: RingConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of this rank's shards, in the inputs' dtypes.

    K/V travel as in the forward; the dK/dV of a shard travel one step behind it, each rank adding its
    contribution, and a final hop returns them to their owner. dQ accumulates locally.
    """
    comm, backend, plan = cfg.comm, cfg.backend, cfg.plan
    n = q.shape[1]
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv_slots = ShardSlots((k, v), cfg.policy)
    dkv_slots = ShardSlots((k, v), cfg.policy, dtype=acc)
    try:
        cur_k, cur_v = k, v
        dkv_work = None
        for step in plan.steps:
            i = step.step
            kv_work = None
            if step.send_to is not None:
                nxt_k, nxt_v = kv_slots.slot(i + 1)
                kv_work = comm.exchange(
                    [(cur_k, step.send_to), (cur_v, step.send_to)],
                    [(nxt_k, step.recv_from), (nxt_v, step.recv_from)],
                    "kv",
                    backend,
                )
            block = None
            if step.computes:
                qs, ks = _views(step, n)
                block = backend.backward(
                    dout[:, qs], q[:, qs], cur_k[:, ks], cur_v[:, ks], out[:, qs], lse[:, :, qs], step.mask, cfg.scale
                )
                dq[:, qs] += block[0]
            if i == 0:
                dk_acc, dv_acc = dkv_slots.slot(0, zero=True)
            else:
                dkv_work.wait()  # the dK/dV of src, from the previous rank, are in slot i
                dk_acc, dv_acc = dkv_slots.slot(i)
            if block is not None:
                dk_acc[:, ks] += block[1]
                dv_acc[:, ks] += block[2]
            if comm.size > 1:
                # after the last step this is the hop home: the owner of src is the next rank
                rk, rv = dkv_slots.slot(i + 1)
                dkv_work = comm.exchange(
                    [(dk_acc, step.dkv_send_to), (dv_acc, step.dkv_send_to)],
                    [(rk, plan.dkv_home_from), (rv, plan.dkv_home_from)],
                    "dkv",
                    backend,
                )
            if kv_work is not None:
                kv_work.wait()
                cur_k, cur_v = nxt_k, nxt_v
        if dkv_work is not None:
            dkv_work.wait()
            dk_acc, dv_acc = dkv_slots.slot(comm.size)
        dk, dv = dk_acc.to(k.dtype, copy=True), dv_acc.to(v.dtype, copy=True)
    finally:
        kv_slots.release()
        dkv_slots.release()
    return dq.to(q.dtype), dk, dv


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: saves (q, k, v, out, lse) and runs :func:`ring_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: RingConfig):  # type: ignore[override]
        out, lse = ring_forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.thread = threading.get_ident()
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        cfg = ctx.cfg
        if cfg.comm.size > 1 and getattr(cfg.comm, "kind", "") == "LocalWorld" and threading.get_ident() != ctx.thread:
            raise RuntimeError(
                f"xcp: autograd ran the backward of LocalWorld rank {cfg.comm.rank} outside its thread "
                f"(device {ctx.saved_tensors[0].device}); PyTorch runs GPU backward on one worker thread per "
                "device, where a ring that waits for its peers would hang. Drive virtual ranks on this device "
                "with xcp.ring_forward / xcp.ring_backward, or use real ranks (torchrun)."
            )
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, cfg)
        return dq, dk, dv, None
