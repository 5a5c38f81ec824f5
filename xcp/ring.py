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
from .lifetime import RingCall
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


def _forward_block(step, q, k, v, out, lse, n, cfg) -> None:
    qs, ks = _views(step, n)
    block_out, block_lse = cfg.backend.forward(q[:, qs], k[:, ks], v[:, ks], step.mask, cfg.scale)
    cfg.backend.merge_(out, lse, block_out, block_lse, qs)


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (in q's dtype) and log-sum-exp (accumulator dtype, [B, H, S]).

    Step i computes (on the caller's stream C) on the shard of ``src`` while, on the comm stream M, that
    shard goes to the next rank and the shard of step i + 1 arrives from the previous one into the other
    of two slots (DESIGN.md, buffer lifetime rules; xcp/lifetime.py).
    """
    comm, backend, plan = cfg.comm, cfg.backend, cfg.plan
    n = q.shape[1]
    out, lse = new_accumulators(q)
    if comm.size == 1:
        _forward_block(plan.steps[0], q, k, v, out, lse, n, cfg)
        return out.to(q.dtype), lse
    call = RingCall(comm, backend, q.device, cfg.policy, cfg.handoff)
    slots = call.slots("kv", (k, v), steps=range(1, comm.size))
    with call:
        cur = (k, v)  # step 0 reads the caller's own K and V in place
        for step in plan.steps:
            work = None
            if step.send_to is not None:
                nxt = slots.slot(step.step + 1)
                with call.on_comm():
                    call.comm_after_compute()  # the slot nxt was last read by the previous step's compute
                    send = call.hand_to_comm(cur, "kv", ordered=True)
                    work = comm.exchange(
                        [(send[0], step.send_to), (send[1], step.send_to)],
                        [(nxt[0], step.recv_from), (nxt[1], step.recv_from)],
                        "kv",
                        backend,
                    )
                del send
            if step.computes:
                _forward_block(step, q, cur[0], cur[1], out, lse, n, cfg)
            if work is not None:
                work.wait()
                cur = nxt
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
    contribution, and a final hop returns them to their owner. dQ accumulates locally. Two KV slots and
    two dKV slots per rank, whatever the number of ranks.
    """
    comm, backend, plan = cfg.comm, cfg.backend, cfg.plan
    n = q.shape[1]
    acc = accumulator_dtype(q.dtype)
    if comm.size == 1:  # one step, always the whole local shard
        step = plan.steps[0]
        g = backend.backward(dout, q, k, v, out, lse, step.mask, cfg.scale)
        return tuple(x.to(like.dtype).contiguous() for x, like in zip(g, (q, k, v)))
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    call = RingCall(comm, backend, q.device, cfg.policy, cfg.handoff)
    kv_slots = call.slots("kv", (k, v), steps=range(1, comm.size))
    dkv_slots = call.slots("dkv", (k, v), dtype=acc, steps=range(comm.size + 1))
    with call:
        cur = (k, v)
        dkv_work = None
        for step in plan.steps:
            i = step.step
            kv_work = None
            if step.send_to is not None:
                nxt = kv_slots.slot(i + 1)
                with call.on_comm():
                    call.comm_after_compute()
                    send = call.hand_to_comm(cur, "kv", ordered=True)
                    kv_work = comm.exchange(
                        [(send[0], step.send_to), (send[1], step.send_to)],
                        [(nxt[0], step.recv_from), (nxt[1], step.recv_from)],
                        "kv",
                        backend,
                    )
                del send
            block = None
            if step.computes:
                qs, ks = _views(step, n)
                block = backend.backward(
                    dout[:, qs], q[:, qs], cur[0][:, ks], cur[1][:, ks], out[:, qs], lse[:, :, qs], step.mask, cfg.scale
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
                del block
            # after the last step this is the hop home: the owner of src is the next rank
            rk, rv = dkv_slots.slot(i + 1)
            with call.on_comm():
                send = call.hand_to_comm((dk_acc, dv_acc), "dkv")  # M waits for the additions above
                dkv_work = comm.exchange(
                    [(send[0], step.dkv_send_to), (send[1], step.dkv_send_to)],
                    [(rk, plan.dkv_home_from), (rv, plan.dkv_home_from)],
                    "dkv",
                    backend,
                )
            del send
            if kv_work is not None:
                kv_work.wait()
                cur = nxt
        dkv_work.wait()
        dk_acc, dv_acc = dkv_slots.slot(comm.size)
        # fresh tensors: results never alias the slots, which the workspace keeps for the next call
        dk, dv = dk_acc.to(k.dtype, copy=True), dv_acc.to(v.dtype, copy=True)
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
