"""``xcp bench --distributed``: the ring over real ranks (torchrun), one device per rank, to measure what
the single-process bench can only model: real transfers between devices.

Run under ``torchrun --nproc-per-node N -m xcp.cli bench --distributed ...`` (benchmarks/multigpu.sh wraps
it for NCCL). Three figures, all printed by rank 0:

- correctness: out, dq, dk, dv of the sharded ring, gathered to rank 0, against the backend's kernel on the
  whole sequence on rank 0 (relative error);
- efficiency: each rank's forward+backward throughput on its share of the work (total FLOPs / N over the
  ring's time) against the throughput of the backend kernel on one whole sequence on one device;
- memory: the device's peak allocation per rank and the ledger's peak ring buffers, bounded vs keep_all.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from ...api import attention, shard
from ...lifetime import track_buffers
from ..common import (
    Clock,
    Measurement,
    Problem,
    apply_size_defaults,
    attention_bytes,
    attention_flops,
    check_memory,
    check_value_dim,
    default_device,
    device_peak,
    error,
    gather_whole,
    head_dims_text,
    join_process_group,
    measurement_args,
    median,
    positive,
    random_inputs,
    size_help,
    tool_backend,
    under_torchrun,
    whole_kernel,
    write_json,
)
from .config import SIZE_FLAGS


@dataclass
class DistBenchConfig(Measurement):
    """Sizes for the distributed run: a :class:`Measurement` plus the lengths of the correctness check and
    of the one-device reference."""

    check_seq: int = 32768
    reference_seq: int = 65536
    sizes_note: str | None = None


def estimate_bytes(cfg: DistBenchConfig, world: int, local_world: int, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of one machine: rank 0's whole-sequence kernel (check and reference) and each
    rank's shard of the longest ring; on the CPU every local rank shares the machine's memory."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, value_head_dim=cfg.value_head_dim)
    whole = max(cfg.check_seq, cfg.reference_seq)
    ring_seq = max(*cfg.seqs, cfg.memory_seq)
    ring = attention_bytes(problem, ring_seq // world, 1, quadratic)
    rank0 = attention_bytes(problem, whole, 1, quadratic) + ring
    needed = rank0 + (local_world - 1) * ring if device_type == "cpu" else rank0
    what = f"the whole-sequence kernel at S={whole} on rank 0, the ring at S={ring_seq} over {world} ranks"
    return needed, what


def _ring_step(cfg, shards, slots: str = "bounded"):
    q, k, v, dout = (x.detach().requires_grad_(i < 3) for i, x in enumerate(shards))
    out = attention(q, k, v, causal=True, device=cfg.device, slots=slots, balance=cfg.balance)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def run_distributed_bench(cfg: DistBenchConfig) -> dict[str, Any] | None:
    """Run every figure on this rank; rank 0 returns the report, the others None."""
    import torch.distributed as dist

    backend, device, rank, world = join_process_group(cfg.device)
    check_value_dim(backend, cfg.head_dim, cfg.value_dim)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_memory(backend, device, *estimate_bytes(cfg, world, local_world, device.type))
    clock = Clock(backend, device)
    report: dict[str, Any] = {"world": world, "backend": backend.name, "dist_backend": dist.get_backend()}
    report["sizes_note"] = cfg.sizes_note
    report["head_dim"], report["value_head_dim"] = cfg.head_dim, cfg.value_dim

    # correctness: gather the ring's results to rank 0 and compare with the whole-sequence kernel
    full = random_inputs(cfg, cfg.check_seq, device)  # the same seed, so the same sequence, on every rank
    got = _ring_step(cfg, [shard(x, world, rank, balance=cfg.balance) for x in full])
    gathered = gather_whole(got, world, cfg.balance)
    if rank == 0:
        ref_out, ref_grads = whole_kernel(backend, full, causal=True, backward=True)
        errs = {n: error(g, r).rel for n, g, r in zip(("out", "dq", "dk", "dv"), gathered, (ref_out, *ref_grads))}
        report["check"] = {
            "seq": cfg.check_seq,
            "errors": errs,
            "ok": all(e <= cfg.check_tolerance for e in errs.values()),
        }
    del full, got, gathered

    # efficiency: the whole-sequence kernel's throughput on one device, then the ring per rank
    if rank == 0:
        whole = random_inputs(cfg, cfg.reference_seq, device)

        def step():
            return whole_kernel(backend, whole, causal=True, backward=True)

        for _ in range(cfg.warmup):
            step()
        t = median([clock.time(step) for _ in range(cfg.reps)])
        flops = attention_flops(cfg.batch, cfg.reference_seq, cfg.heads, cfg.head_dim, True, True, cfg.value_dim)
        report["reference"] = {"seq": cfg.reference_seq, "seconds": t, "tflops": flops / t / 1e12}
        del whole
    rows = []
    for seq in cfg.seqs:
        local = seq // world
        shards = random_inputs(cfg, local, device, seed=100 + rank)
        for _ in range(cfg.warmup):
            _ring_step(cfg, shards)
        times = []
        for _ in range(cfg.reps):
            dist.barrier()
            times.append(clock.time(functools.partial(_ring_step, cfg, shards)))
        slowest = torch.tensor([median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        flops = attention_flops(cfg.batch, seq, cfg.heads, cfg.head_dim, True, True, cfg.value_dim)
        seconds = slowest.item()
        row = {"seq": seq, "seconds": seconds, "tflops_per_rank": flops / world / seconds / 1e12}
        if rank == 0:
            row["efficiency"] = row["tflops_per_rank"] / report["reference"]["tflops"]
        rows.append(row)
        del shards
    report["throughput"] = rows

    # memory: bounded against keep_all, per rank
    mem = []
    local = cfg.memory_seq // world
    shards = random_inputs(cfg, local, device, seed=200 + rank)
    for policy in ("bounded", "keep_all"):
        with track_buffers() as ledger:
            device_bytes = device_peak(backend, device, functools.partial(_ring_step, cfg, shards, policy))
        vals = [ledger.peak_bytes, ledger.peak_kv_shards, -1 if device_bytes is None else device_bytes]
        peaks = torch.tensor(vals, dtype=torch.float64, device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        mem.append(
            {
                "policy": policy,
                "seq": cfg.memory_seq,
                "peak_ring_bytes": int(peaks[0]),
                "peak_kv_shards": int(peaks[1]),
                "device_peak_over_start_bytes": int(peaks[2]),
            }
        )
    report["memory"] = mem
    return report if rank == 0 else None


def format_distributed(report: dict[str, Any]) -> str:
    """Rank 0's tables."""
    dims = head_dims_text(report.get("head_dim", 0), report.get("value_head_dim"))
    lines = [
        f"xcp bench --distributed: {report['world']} ranks, backend {report['backend']} over {report['dist_backend']}"
        + (f", D={dims} (q/k, v)" if "/" in dims else "")
    ]
    if report.get("sizes_note"):
        lines.append(f"sizes: {report['sizes_note']} (give the flags to change them)")
    c = report["check"]
    lines.append(
        f"check S={c['seq']}: "
        + ", ".join(f"{k} {v:.2e}" for k, v in c["errors"].items())
        + (" ok" if c["ok"] else " FAIL")
    )
    r = report["reference"]
    lines.append(
        f"whole-sequence kernel, one device, S={r['seq']}: {r['seconds'] * 1e3:.1f} ms, {r['tflops']:.1f} TFLOP/s"
    )
    lines.append(f"{'S':>9} {'fwd+bwd ms':>11} {'TFLOP/s/rank':>13} {'efficiency':>10}")
    for row in report["throughput"]:
        lines.append(
            f"{row['seq']:>9} {row['seconds'] * 1e3:>11.1f} {row['tflops_per_rank']:>13.1f} {row['efficiency']:>10.3f}"
        )
    lines.append(f"{'policy':>9} {'S':>9} {'ring MiB/rank':>14} {'KV shards':>9} {'device MiB':>10}")
    for m in report["memory"]:
        dev = m["device_peak_over_start_bytes"]
        lines.append(
            f"{m['policy']:>9} {m['seq']:>9} {m['peak_ring_bytes'] / 2**20:>14.1f} {m['peak_kv_shards']:>9} "
            f"{'-' if dev < 0 else f'{dev / 2**20:.1f}':>10}"
        )
    return "\n".join(lines)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``xcp bench`` takes for ``--distributed`` alone."""
    parser.add_argument("--distributed", action="store_true", help="real ranks under torchrun, one device each")
    parser.add_argument("--check-seq", type=positive, default=None,
                        help=size_help("check_seq", "--distributed: length of the correctness check"))  # fmt: skip
    parser.add_argument("--reference-seq", type=positive, default=None,
                        help=size_help("reference_seq", "--distributed: whole-sequence reference"))  # fmt: skip


def command(args: argparse.Namespace) -> int:
    """``xcp bench --distributed``: rank 0 prints the tables; the exit status is 1 when the check failed."""
    if not under_torchrun():
        raise RuntimeError("--distributed: expected to run under torchrun (RANK and WORLD_SIZE set); they are not")
    device_note = default_device(args)
    backend, _ = tool_backend(args.device)  # an unknown or unusable backend: the error and the table, first
    notes = (device_note, apply_size_defaults(args, backend, (*SIZE_FLAGS, "check_seq", "reference_seq")))
    note = ", ".join(n for n in notes if n) or None
    cfg = DistBenchConfig(
        check_seq=args.check_seq, reference_seq=args.reference_seq, sizes_note=note, **measurement_args(args)
    )
    try:
        report = run_distributed_bench(cfg)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if report is None:
        return 0
    print(format_distributed(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    return 0 if report["check"]["ok"] else 1
