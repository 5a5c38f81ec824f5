"""``xcp bench --host``: the microseconds one ring step of one rank costs on the host (Python, checks,
launches, hand-offs, events, exchanges) for each of ``--worlds``, with block kernels that return outputs
computed once (:class:`xcp.testing.doubles.NullKernels`), beside the targets; then, in the same run, the
world of one (:mod:`.world_of_one`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ... import schedule
from ...api import shard
from ...comm import LocalWorld
from ...ring import RingConfig, ring_backward, ring_forward
from ...testing.doubles import LoopbackCommunicator, NullKernels
from .. import windows
from ..common import Clock, Problem, attention_bytes, check_memory, median, random_inputs
from .config import HOST_MIN_REPS, BenchConfig
from .report import dims_row, into, meta, run_work, wrap
from .world_of_one import format_world_of_one, time_world_of_one

HOST_TARGETS_US = {"fwd": 50.0, "bwd": 100.0}
"""The targets for the host work of one ring step of one rank, forward and backward (printed beside
the figures; nothing asserts them)."""
HOST_CALLS = 10
"""Forward+backward calls of every rank in one repetition of the host figure."""


def _host_rank(group, null: NullKernels, shards, streams, main_stream, causal: bool, balance: str, scale: float,
               calls: int):  # fmt: skip
    """One rank of the host figure: ``calls`` times ring_forward then ring_backward, as xcp.attention runs
    them (no ledger, no counting communicator), on the rank's own stream; returns the stream and the thread
    CPU ns of all the forward and all the backward calls."""
    r = group.rank()
    stream = streams[r]
    null.wait_stream(stream, main_stream)
    q, k, v, dout = shards[r]
    cfg = RingConfig(group, null, causal, scale, balance)  # type: ignore[arg-type]
    fwd = bwd = 0
    with null.stream_context(stream):
        for _ in range(calls):
            t0 = time.thread_time_ns()
            out, lse = ring_forward(q, k, v, cfg)
            t1 = time.thread_time_ns()
            ring_backward(dout, q, k, v, out, lse, cfg)
            t2 = time.thread_time_ns()
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return stream, fwd, bwd


def per_step(stamps: list[tuple[str, int, int]], kind: str) -> tuple[list[int], float, float]:
    """A rank's passes of one kind (its kernel calls in each, in order) and the mean thread CPU and wall µs
    between consecutive kernel calls of one pass."""
    passes: list[list[tuple[int, int]]] = []
    previous = None
    for k, cpu, wall in stamps:
        if k == kind:
            if previous != kind:
                passes.append([])
            passes[-1].append((cpu, wall))
        previous = k
    gaps = sum(len(p) - 1 for p in passes)
    if not gaps:
        return [len(p) for p in passes], math.nan, math.nan
    cpu_us = sum(p[-1][0] - p[0][0] for p in passes) / gaps / 1e3
    wall_us = sum(p[-1][1] - p[0][1] for p in passes) / gaps / 1e3
    return [len(p) for p in passes], cpu_us, wall_us


def _host_one(cfg: BenchConfig, backend, device: torch.device, world: int, causal: bool) -> dict[str, Any]:
    """The host figure of one (P, mask): per repetition, the mean over ranks of the thread CPU (and wall)
    µs between a rank's consecutive kernel calls, forward and backward; the medians over the repetitions.
    A repetition is one LocalWorld run in which every rank makes :data:`HOST_CALLS` forward+backward calls;
    a priming run computes the kernels' outputs once and makes the first-call agreement exchange."""
    balance = windows.resolve_balance(cfg.balance, world, causal, None, None)
    seq = cfg.host_tokens * world
    full = random_inputs(cfg, seq, device)
    null = NullKernels(backend)
    lw = LocalWorld(world, device=device)
    shards = [tuple(shard(x, world, r, balance=balance) for x in full) for r in range(world)]
    streams = [backend.new_stream(device) for _ in range(world)]
    scale = 1.0 / math.sqrt(cfg.head_dim)
    steps = len(schedule.plan(world, 0, causal, balance).steps)

    def run() -> list[Any]:
        main = backend.current_stream(device)
        backend.synchronize(device)
        results = lw.run(_host_rank, null, shards, streams, main, causal, balance, scale, HOST_CALLS)
        for stream, _, _ in results:
            backend.wait_stream(main, stream)
        backend.synchronize(device)
        return results

    for _ in range(1 + cfg.warmup):
        run()
    computed = null.computed
    names = [f"{kind}_{what}" for kind in ("fwd", "bwd") for what in ("cpu", "wall", "call", "alone_cpu", "alone_wall")]
    samples: dict[str, list[float]] = {name: [] for name in names}
    calls_ok = True
    calls: dict[str, list[int]] = {}
    reps = max(cfg.reps, HOST_MIN_REPS)
    for _ in range(reps):
        null.stamps.clear()
        null.recording = True
        try:
            results = run()
        finally:
            null.recording = False
        per_rank = list(null.stamps.values())
        for kind in ("fwd", "bwd"):
            figures = [per_step(s, kind) for s in per_rank]
            calls[kind] = [n for passes, _, _ in figures for n in passes]  # every pass of every rank
            calls_ok = calls_ok and len(per_rank) == world and calls[kind] == [steps] * (world * HOST_CALLS)
            samples[f"{kind}_cpu"].append(sum(c for _, c, _ in figures) / len(figures))
            samples[f"{kind}_wall"].append(sum(w for _, _, w in figures) / len(figures))
        samples["fwd_call"].append(sum(r[1] for r in results) / (world * HOST_CALLS) / 1e3)
        samples["bwd_call"].append(sum(r[2] for r in results) / (world * HOST_CALLS) / 1e3)
    # rank 0's loop alone, in this thread, its exchanges a loopback (the kernels' outputs are those above)
    q, k, v, dout = shards[0]
    cfg0 = RingConfig(LoopbackCommunicator(world, 0), null, causal, scale, balance)  # type: ignore[arg-type]
    for rep in range(1 + cfg.warmup + reps):
        null.stamps.clear()
        null.recording = rep > cfg.warmup
        backend.synchronize(device)
        try:
            for _ in range(HOST_CALLS):
                out, lse = ring_forward(q, k, v, cfg0)
                ring_backward(dout, q, k, v, out, lse, cfg0)
            backend.synchronize(device)
        finally:
            null.recording = False
        if rep > cfg.warmup:
            for kind in ("fwd", "bwd"):
                passes, cpu, wall = per_step(null.stamps[threading.get_ident()], kind)
                calls_ok = calls_ok and passes == [steps] * HOST_CALLS
                samples[f"{kind}_alone_cpu"].append(cpu)
                samples[f"{kind}_alone_wall"].append(wall)
    med = {name: median(values) for name, values in samples.items()}
    return {
        "world": world,
        "causal": causal,
        "balance": balance,
        **dims_row(cfg),
        "tokens_per_rank": cfg.host_tokens,
        "steps": steps,
        "reps": reps,
        "fwd_step_us": med["fwd_cpu"],
        "bwd_step_us": med["bwd_cpu"],
        "fwd_step_wall_us": med["fwd_wall"],
        "bwd_step_wall_us": med["bwd_wall"],
        "fwd_call_us": med["fwd_call"],
        "bwd_call_us": med["bwd_call"],
        "fwd_step_alone_us": med["fwd_alone_wall"],
        "bwd_step_alone_us": med["bwd_alone_wall"],
        "fwd_step_alone_cpu_us": med["fwd_alone_cpu"],
        "bwd_step_alone_cpu_us": med["bwd_alone_cpu"],
        "fwd_target_us": HOST_TARGETS_US["fwd"],
        "bwd_target_us": HOST_TARGETS_US["bwd"],
        "calls_per_rep": HOST_CALLS,
        "kernel_calls_per_pass": {kind: sorted(set(n)) for kind, n in calls.items()},
        "kernels_computed_once": computed,
        "kernels_computed_while_timed": null.computed - computed,
        "calls_ok": calls_ok and null.computed == computed,
    }


def estimate_host_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of ``--host`` / ``--world-of-one``: forward+backward of a world of one at the
    largest of ``seqs`` (the host figure's problems are tiny)."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, value_head_dim=cfg.value_head_dim)
    seq = max(cfg.seqs)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.dims_text()} {cfg.dtype}"
    return attention_bytes(problem, seq, 1, quadratic), f"the world of one at S={seq}, {shape}"


def run_host(cfg: BenchConfig, backend, device: torch.device, progress: bool, checkpoint: str | None) -> dict[str, Any]:
    """The figures of ``--host`` (host µs per ring step for each of ``worlds``, then the world of one against
    SDPA) or of ``--world-of-one`` (that one alone)."""
    check_memory(backend, device, *estimate_host_bytes(cfg, device.type))
    clock = Clock(backend, device)
    report: dict[str, Any] = {"meta": meta(cfg, backend, device), "timing": [], "memory": [], "graph": None,
                              "host": [] if cfg.host else None, "world_of_one": []}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    if cfg.host:
        for causal in cfg.causal:
            for world in cfg.worlds:
                step = into(report["host"], _host_one, cfg, backend, device, world, causal)
                work.append((f"host P={world} {'causal' if causal else 'full'}", step))
    for causal in cfg.causal:
        for seq in cfg.seqs:
            step = into(report["world_of_one"], time_world_of_one, cfg, backend, clock, device, seq, causal)
            work.append((f"world of one S={seq} {'causal' if causal else 'full'}", step))
    return run_work(work, report, progress, checkpoint)


HOST_METHOD = (
    "host work of one ring step of one rank: LocalWorld virtual ranks run xcp.ring_forward then ring_backward "
    "({calls} times per rank and repetition) on {tokens} tokens per rank with kernels that return outputs "
    "computed once beforehand (no kernel time; the merge and accumulations still run, on tiny tensors); a step "
    "is the time between a rank's consecutive kernel calls in one pass, on the rank thread's CPU clock (waits "
    "for peers and for the interpreter lock not counted), the mean over ranks; wall: the same gaps on the wall "
    "clock, with the other ranks' work that interleaves (P threads share one interpreter); alone: rank 0's loop "
    "run by itself in one thread, its exchanges a loopback copy, wall clock (the loop's own host work, without "
    "the other ranks'); call: a whole ring_forward / ring_backward call, CPU clock, mean over ranks, with what it "
    "does once per call"
)


def format_host(report: dict[str, Any]) -> list[str]:
    """The host table (when measured), then the world-of-one table."""
    lines: list[str] = []
    rows = report.get("host")
    if rows:
        method = HOST_METHOD.format(tokens=rows[0]["tokens_per_rank"], calls=rows[0]["calls_per_rep"])
        lines += ["", *wrap(f"{method}; median of {rows[0]['reps']} repetitions."), ""]
        lines.append(
            f"{'':>18} | {'µs per step, mean over ranks':^45} | {'wall µs/step':^13} | {'alone µs/step':^13} | "
            f"{'µs per call':^13} |"
        )
        lines.append(
            f"{'P':>3} {'mask':>6} {'balance':>7} | {'fwd':>7} {'target':>14} {'bwd':>7} {'target':>14} | "
            f"{'fwd':>6} {'bwd':>6} | {'fwd':>6} {'bwd':>6} | {'fwd':>6} {'bwd':>6} | check"
        )
        for r in rows:
            lines.append(
                f"{r['world']:>3} {'causal' if r['causal'] else 'full':>6} {r['balance']:>7} | "
                f"{r['fwd_step_us']:>7.1f} {_target(r['fwd_step_us'], r['fwd_target_us']):>14} "
                f"{r['bwd_step_us']:>7.1f} {_target(r['bwd_step_us'], r['bwd_target_us']):>14} | "
                f"{r['fwd_step_wall_us']:>6.0f} {r['bwd_step_wall_us']:>6.0f} | {r['fwd_step_alone_us']:>6.1f} "
                f"{r['bwd_step_alone_us']:>6.1f} | {r['fwd_call_us']:>6.0f} {r['bwd_call_us']:>6.0f} | "
                f"{'ok' if r['calls_ok'] else 'FAIL'} ({r['steps']} calls/pass)"
            )
        lines += wrap(f"targets: forward ≤ {HOST_TARGETS_US['fwd']:g} µs, backward ≤ "
                      f"{HOST_TARGETS_US['bwd']:g} µs per step and rank; printed, not asserted. check: every rank "
                      "made one kernel call per step in every pass, and none was computed while timed")  # fmt: skip
    return lines + format_world_of_one(report)


def _target(value: float, target: float) -> str:
    """``(≤ 50: ok)`` or ``(≤ 50: over)``: the target beside a figure (nothing asserts it)."""
    return f"(≤ {target:g}: {'ok' if value <= target else 'over'})"
