"""The dense figures of ``xcp bench`` (the default): the ring over P virtual ranks against one whole-sequence
kernel call per (S, P, mask), the ring buffers' memory per slot policy, a world of one captured as a graph;
their tables and plot. :func:`measure` is the row every ring mode (documents, windows, the hybrid) shares."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from ...comm import SingleRank
from ...ring import RingConfig, ring_forward
from .. import windows
from ..common import (
    Clock,
    Problem,
    attention_bytes,
    attention_flops,
    check_memory,
    device_peak,
    median,
    pyplot,
    random_inputs,
    whole_kernel,
)
from .config import BenchConfig
from .replay import measure_replay
from .report import check_text, dims_row, header, into, meta, run_work
from .timing import check_into, time_into
from .virtual import VirtualRing


def estimate_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of the run and what needs it: the whole-sequence kernel at the largest seq, or
    the ring at the memory figure's length over the fewest ranks. The math kernel (the cpu backend's, and a
    device's for float64) materialises scores; fused device kernels are linear in the length."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, value_head_dim=cfg.value_head_dim)
    seq, world = max(cfg.seqs), min(cfg.memory_worlds)
    candidates = [
        (attention_bytes(problem, seq, 1, quadratic), f"fwd+bwd on the whole sequence at S={seq}"),
        (
            attention_bytes(problem, cfg.memory_seq, world, quadratic),
            f"the memory figure at S={cfg.memory_seq}, P={world}",
        ),
    ]
    needed, what = max(candidates)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.dims_text()} {cfg.dtype}"
    return needed, f"{what}, {shape}"


def run_dense(
    cfg: BenchConfig, backend, device: torch.device, progress: bool, checkpoint: str | None
) -> dict[str, Any]:
    """The dense figures: the memory of the ring's buffers per policy, the graph capture of a world of one,
    then per (S, P, mask) the ring against one whole-sequence kernel call."""
    check_memory(backend, device, *estimate_bytes(cfg, device.type))
    clock = Clock(backend, device)
    jobs = [(s, p, c) for s in cfg.seqs for c in cfg.causal for p in cfg.worlds]
    report: dict[str, Any] = {"meta": meta(cfg, backend, device), "timing": [], "memory": [], "graph": None}
    work: list[tuple[str, Callable[[], None]]] = []
    # memory and graph first: they are quick, and a run cut short keeps them
    for world in cfg.memory_worlds:
        for policy in ("bounded", "keep_all"):
            step = into(report["memory"], _memory_one, cfg, backend, device, world, policy)
            work.append((f"memory P={world} {policy}", step))
    if cfg.graph:
        work.append(("graph capture", lambda: report.__setitem__("graph", _graph_one(cfg, backend, clock, device))))
    for seq, world, causal in jobs:
        label = f"S={seq} P={world} {'causal' if causal else 'full'}"
        work.append((label, into(report["timing"], time_one, cfg, backend, clock, device, seq, world, causal)))
    return run_work(work, report, progress, checkpoint)


def time_one(cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, world: int, causal: bool
             ) -> dict[str, Any]:  # fmt: skip
    """One dense row: the ring over ``world`` virtual ranks against the whole-sequence kernel."""
    full = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, world, causal, None, None)  # dense: auto is zigzag
    ring = VirtualRing(backend, world, full, causal, balance)
    row: dict[str, Any] = {"seq": seq, "world": world, "causal": causal, "balance": balance, **dims_row(cfg)}
    flops = {b: attention_flops(cfg.batch, seq, cfg.heads, cfg.head_dim, causal, b, cfg.value_dim)
             for b in (False, True)}  # fmt: skip
    return measure(cfg, clock, ring, lambda b: whole_kernel(backend, full, causal, b), flops, row)


def measure(
    cfg: BenchConfig,
    clock: Clock,
    ring: VirtualRing,
    whole: Callable[[bool], Any],
    flops: dict[bool, float],
    row: dict[str, Any],
) -> dict[str, Any]:
    """Check the ring against ``whole(backward)`` (the yardstick), then time both, interleaved: the median
    times, their ratio and the ring's throughput for ``flops[backward]``, into ``row``."""
    for mode, backward in (("fwd", False), ("fwd_bwd", True)):
        whole_out, whole_grads = whole(backward)
        check_into(cfg, row, mode, ring, ring.run(backward), whole_out, whole_grads)
        del whole_out, whole_grads
        for _ in range(cfg.warmup):
            whole(backward)
            ring.run(backward)
        time_into(cfg, clock, row, mode, functools.partial(whole, backward), functools.partial(ring.run, backward))
        row[f"{mode}_ring_tflops"] = flops[backward] / row[f"{mode}_ring_s"] / 1e12
        row[f"{mode}_sent_bytes"] = [dict(sent) for sent in ring.sent]  # per rank and tag, in the last run
        if cfg.replay:
            measure_replay(cfg, clock, ring, whole, backward, row, f"{mode}_replay")
    return row


def _memory_one(cfg: BenchConfig, backend, device: torch.device, world: int, policy: str) -> dict[str, Any]:
    """The ring buffers' peak under a slot ``policy``: counted by the ledger, and the device allocator's."""
    seq = cfg.memory_seq - cfg.memory_seq % (2 * world)
    full = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, world, True, None, None)
    ring = VirtualRing(backend, world, full, True, balance, policy)
    device_bytes = device_peak(backend, device, lambda: ring.run(backward=True))
    shard_bytes = sum(x.numel() * x.element_size() for x in full[1:3]) // world  # K and V (in v's head dim)
    row = {
        "seq": seq,
        "world": world,
        "policy": policy,
        **dims_row(cfg),
        "kv_shard_bytes": shard_bytes,
        "peak_kv_shards": max(led.peak_kv_shards for led in ring.ledgers),
        "peak_ring_bytes_per_rank": max(led.peak_bytes for led in ring.ledgers),
    }
    if device_bytes is not None:
        row["device_peak_over_start_bytes"] = device_bytes
    return row


def _graph_one(cfg: BenchConfig, backend, clock: Clock, device: torch.device) -> dict[str, Any] | None:
    """Captured forward of a world of one (the whole ring loop, merge included) against eager; None where
    the backend has no device graphs."""
    graph = backend.new_graph()
    if graph is None:
        return None
    seq = min(cfg.seqs)
    q, k, v, _ = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, 1, True, None, None)
    rcfg = RingConfig(SingleRank(), backend, True, 1.0 / math.sqrt(cfg.head_dim), balance)
    side, main = backend.new_stream(device), backend.current_stream(device)
    backend.wait_stream(side, main)
    with backend.stream_context(side):  # warm up off the capture stream
        for _ in range(2):
            ring_forward(q, k, v, rcfg)
    backend.wait_stream(main, side)
    with backend.capture_graph(graph):
        captured_out, _ = ring_forward(q, k, v, rcfg)
    graph.replay()
    eager_out, _ = ring_forward(q, k, v, rcfg)
    same = torch.equal(captured_out, eager_out)
    eager = median([clock.time(lambda: ring_forward(q, k, v, rcfg)) for _ in range(cfg.reps)])
    replay = median([clock.time(graph.replay) for _ in range(cfg.reps)])
    return {
        "seq": seq,
        "world": 1,
        **dims_row(cfg),
        "eager_s": eager,
        "replay_s": replay,
        "speedup": eager / replay,
        "same_output": same,
    }


def format_dense(report: dict[str, Any], replayed: list[str]) -> str:
    """The dense report: the ring against the whole-sequence kernel per (S, P, mask), the memory figure, the
    ``replayed`` table (``--replay``), the graph capture."""
    lines = [
        *header(report),
        "",
        f"{'S':>8} {'P':>3} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} {'TFLOP/s':>8} | check",
    ]
    for r in report["timing"]:
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {'causal' if r['causal'] else 'full':>6} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} "
            f"{r['fwd_bwd_ring_tflops']:>8.1f} | {check_text(r)}"
        )
    if report["memory"]:
        lines += [
            "",
            f"{'S':>8} {'P':>3} {'policy':>9} | {'peak KV shards':>14} {'ring MiB/rank':>13} {'device MiB':>10}",
        ]
        for r in report["memory"]:
            dev = r.get("device_peak_over_start_bytes")
            lines.append(
                f"{r['seq']:>8} {r['world']:>3} {r['policy']:>9} | {r['peak_kv_shards']:>14} "
                f"{r['peak_ring_bytes_per_rank'] / 2**20:>13.1f} {'-' if dev is None else f'{dev / 2**20:.1f}':>10}"
            )
    lines += replayed
    g = report.get("graph")
    if g:
        lines += [
            "",
            f"graph capture (S={g['seq']}, world 1, causal fwd): eager {g['eager_s'] * 1e3:.3f} ms, replay "
            f"{g['replay_s'] * 1e3:.3f} ms, speedup {g['speedup']:.2f}x, same output: {g['same_output']}",
        ]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> None:
    """Ratio against S (per P and mask) and ring memory against P (bounded vs keep_all)."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["timing"]
    for world in sorted({r["world"] for r in rows}):
        for causal in (False, True):
            pts = sorted((r["seq"], r["fwd_bwd_ratio"]) for r in rows if r["world"] == world and r["causal"] == causal)
            if pts:
                a.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    ls="-" if causal else "--",
                    label=f"P={world} {'causal' if causal else 'full'}",
                )
    for world in sorted({r["world"] for r in report.get("documents") or []}):
        for causal in (False, True):
            pts = sorted((r["seq"], r["fwd_bwd_ratio"]) for r in report["documents"]
                         if r["world"] == world and r["causal"] == causal)  # fmt: skip
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", ls=":",
                       label=f"documents P={world} {'causal' if causal else 'full'}")  # fmt: skip
    a.axhline(1.10, color="red", lw=0.8, label="target 1.10")
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length S")
    a.set_ylabel("fwd+bwd time / whole-sequence kernel")
    a.legend(fontsize=7)
    mem = report["memory"]
    for policy in ("bounded", "keep_all"):
        pts = sorted((r["world"], r["peak_ring_bytes_per_rank"] / 2**20) for r in mem if r["policy"] == policy)
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    b.set_xlabel("ranks P")
    b.set_ylabel("peak ring buffers per rank (MiB)")
    if mem:
        b.legend()
    else:
        b.text(0.5, 0.5, "no memory figure in this run", ha="center", va="center", transform=b.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
