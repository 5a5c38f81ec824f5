"""The checked demo behind ``xcp run``: ring attention on sharded inputs against a float64 reference.

It runs on a LocalWorld of virtual ranks (the default, on the CPU) or, under torchrun, on the real process
group, and reports the error of out, dq, dk and dv, the time, and the peak received-KV bytes per rank.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from .api import attention, shard, unshard
from .comm import LocalWorld, resolve_group
from .lifetime import track_buffers
from .plugins import select_backend
from .ring import RingConfig, ring_backward, ring_forward
from .testing.reference import sdpa_reference

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Largest accepted relative error ||x - ref|| / ||ref|| per input dtype. float64 and float32 sit many
# orders above their rounding (1e-16, 6e-8) to allow for sums over thousands of keys; bf16 (8-bit
# mantissa, unit roundoff 3.9e-3) and fp16 (11-bit, 4.9e-4) are bounded by the rounding of the inputs and
# outputs themselves, since accumulation is fp32.
REL_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass
class DemoConfig:
    """The shape of the demo problem; the defaults are ``xcp run``'s."""

    world: int = 4
    batch: int = 1
    seq: int = 3072
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    balance: str = "zigzag"
    device: str = "cpu"
    seed: int = 0


@dataclass
class DemoResult:
    """Errors per tensor, the slowest rank's time, and the peak received-KV bytes per rank."""

    config: DemoConfig
    errors: dict[str, tuple[float, float]]  # name -> (max abs error, relative error)
    seconds: float
    peak_kv_bytes: list[int]
    peak_kv_shards: list[int]
    mode: str
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        tol = REL_TOLERANCE[DTYPES[self.config.dtype]]
        self.ok = all(math.isfinite(rel) and rel <= tol for _, rel in self.errors.values())

    def table(self) -> str:
        c = self.config
        tol = REL_TOLERANCE[DTYPES[c.dtype]]
        lines = [
            f"xcp run: {self.mode}, world {c.world}, batch {c.batch}, seq {c.seq}, heads {c.heads}/{c.kv_heads} kv, "
            f"head_dim {c.head_dim}, {c.dtype}, {'causal' if c.causal else 'full'}, balance {c.balance}, "
            f"device {c.device}",
            f"{'tensor':<8}{'max abs err':>14}{'rel err':>12}{'tolerance':>12}  result",
        ]
        for name, (abs_err, rel) in self.errors.items():
            verdict = "ok" if math.isfinite(rel) and rel <= tol else "FAIL"
            lines.append(f"{name:<8}{abs_err:>14.3e}{rel:>12.3e}{tol:>12.1e}  {verdict}")
        mib = [b / 2**20 for b in self.peak_kv_bytes]
        lines.append(f"time (fwd+bwd, slowest rank): {self.seconds:.3f} s")
        lines.append(
            "peak ring buffers per rank (received KV and dK/dV slots): "
            + ", ".join(f"r{r}: {m:.2f} MiB / {s} shards" for r, (m, s) in enumerate(zip(mib, self.peak_kv_shards)))
        )
        lines.append("PASS" if self.ok else "FAIL: an error is above its tolerance")
        return "\n".join(lines)


def make_inputs(cfg: DemoConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Seeded random q, k, v and dout of the whole sequence, in the demo dtype."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    shapes = [(cfg.batch, cfg.seq, h, cfg.head_dim) for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads)]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float32).to(dtype).to(device) for s in shapes)


def reference(q, k, v, dout, causal: bool) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of whole-sequence attention in float64 on the CPU (torch SDPA, K/V heads repeated)."""
    q, k, v, dout = (x.detach().to("cpu", torch.float64) for x in (q, k, v, dout))
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = sdpa_reference(q, k, v, causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative error in the 2-norm) of ``got`` against ``ref``."""
    diff = got.detach().to("cpu", torch.float64) - ref
    return diff.abs().max().item(), (diff.norm() / ref.norm().clamp_min(1e-300)).item()


def _rank_step(group, cfg: DemoConfig, full: tuple[torch.Tensor, ...], functional: bool):
    """One rank's shard, forward and backward; returns (out, dq, dk, dv, seconds, ledger)."""
    q, k, v, dout = (shard(x, group.size, group.rank, balance=cfg.balance) for x in full)
    with track_buffers() as ledger:
        start = time.perf_counter()
        if functional:  # threads on a GPU cannot share autograd's device worker (FACTS.md)
            backend = select_backend(cfg.device, q.device.type)
            ring = RingConfig(group, backend, cfg.causal, 1.0 / math.sqrt(cfg.head_dim), cfg.balance)
            out, lse = ring_forward(q, k, v, ring)
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ring)
        else:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = attention(q, k, v, causal=cfg.causal, group=group, balance=cfg.balance, device=cfg.device)
            out.backward(dout)
            dq, dk, dv = q.grad, k.grad, v.grad
        _synchronize(out)
        seconds = time.perf_counter() - start
    return out.detach(), dq, dk, dv, seconds, ledger


def _synchronize(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        torch.get_device_module(t.device.type).synchronize()


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the demo on a LocalWorld, or on the torch.distributed world when torchrun started us."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_distributed(cfg)
    device = torch.device(cfg.device if cfg.device != "cpu" else "cpu")
    full = make_inputs(cfg, device)
    world = LocalWorld(cfg.world, device=device)
    results = world.run(_rank_step, cfg, full, device.type != "cpu")
    got = [unshard([r[i] for r in results], balance=cfg.balance) for i in range(4)]
    ref = reference(*full, cfg.causal)
    errs = {name: errors(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    return DemoResult(
        cfg,
        errs,
        max(r[4] for r in results),
        [r[5].peak_bytes for r in results],
        [r[5].peak_kv_shards for r in results],
        f"LocalWorld of {cfg.world} virtual ranks",
    )


def _run_distributed(cfg: DemoConfig) -> DemoResult:
    import torch.distributed as dist

    backend = select_backend(cfg.device, None)
    if not dist.is_initialized():
        dist.init_process_group(backend.dist_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.world = world
    device = torch.device(cfg.device if cfg.device == "cpu" else f"{cfg.device}:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    full = make_inputs(cfg, device)
    group = resolve_group(None)
    out, dq, dk, dv, seconds, ledger = _rank_step(group, cfg, full, functional=False)
    gathered = []
    for t in (out, dq, dk, dv):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(unshard(parts, balance=cfg.balance))
    stats = torch.tensor([seconds, ledger.peak_bytes, ledger.peak_kv_shards], dtype=torch.float64, device=device)
    all_stats = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(all_stats, stats)
    ref = reference(*full, cfg.causal)
    errs = {name: errors(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), gathered, ref)}
    return DemoResult(
        cfg,
        errs,
        max(s[0].item() for s in all_stats),
        [int(s[1].item()) for s in all_stats],
        [int(s[2].item()) for s in all_stats],
        f"torch.distributed ({dist.get_backend()}), rank {rank} of {world}",
    )
