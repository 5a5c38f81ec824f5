"""``xcp bench --world-of-one`` (also part of ``--host``): ``xcp.attention`` without a group against torch
SDPA, forward and forward+backward, each checked against the other before it is timed; and its table (the
cost of xcp's checks and dispatch around the backend's whole-sequence call where the backend has one; else
xcp's own block kernel against SDPA)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ...api import attention
from ..common import DTYPES, REL_TOLERANCE, Clock, error, median, random_inputs
from .config import HOST_MIN_REPS, BenchConfig
from .report import check_text, dims_of, dims_row, wrap
from .timing import ratio

WORLD_OF_ONE_SEQS = [1024, 4096]
"""``--seqs`` of the world-of-one figure when none are given (on a device and on the CPU alike)."""


def time_world_of_one(
    cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, causal: bool
) -> dict[str, Any]:
    """xcp.attention without a group (a world of one) against torch SDPA on [B, H, S, D] views with
    enable_gqa, forward and forward+backward: each checked against the other, then timed interleaved."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dtype = DTYPES[cfg.dtype]
    q, k, v, dout = random_inputs(cfg, seq, device)
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))

    def run_xcp(backward: bool):
        if not backward:
            with torch.no_grad():
                return attention(q, k, v, causal=causal, device=backend.name), None
        out = attention(*leaves, causal=causal, device=backend.name)
        return out, torch.autograd.grad(out, leaves, dout)

    def run_sdpa(backward: bool):
        def call(a, b, c):
            return sdpa(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=causal,
                        enable_gqa=True).transpose(1, 2)  # fmt: skip

        if not backward:
            with torch.no_grad():
                return call(q, k, v), None
        out = call(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)

    row: dict[str, Any] = {"seq": seq, "causal": causal, **dims_row(cfg), "tolerance": REL_TOLERANCE[dtype]}
    with torch.no_grad():  # which path xcp.attention takes: the backend's whole-sequence call, or its own kernel
        row["whole_attention"] = backend.whole_attention(q, k, v, causal, q.shape[-1] ** -0.5) is not None
    reps = max(cfg.reps, HOST_MIN_REPS)
    for mode, backward in (("fwd", False), ("fwd_bwd", True)):
        if cfg.check:
            got, ref = run_xcp(backward), run_sdpa(backward)
            errs = {"out": error(got[0], ref[0]).rel}
            if backward:
                errs.update({name: error(g, r).rel for name, g, r in zip(("dq", "dk", "dv"), got[1], ref[1])})
            row[f"{mode}_errors"] = errs
            row[f"{mode}_check_ok"] = all(math.isfinite(e) and e <= REL_TOLERANCE[dtype] for e in errs.values())
            del got, ref
        for _ in range(cfg.warmup):
            run_sdpa(backward)
            run_xcp(backward)
        sdpa_t: list[float] = []
        xcp_t: list[float] = []
        for _ in range(reps):  # interleaved, so drifts in clock or temperature hit both alike
            sdpa_t.append(clock.time(functools.partial(run_sdpa, backward)))
            xcp_t.append(clock.time(functools.partial(run_xcp, backward)))
        row[f"{mode}_sdpa_s"] = median(sdpa_t)
        row[f"{mode}_xcp_s"] = median(xcp_t)
        row[f"{mode}_ratio"] = ratio(row[f"{mode}_xcp_s"], row[f"{mode}_sdpa_s"])
    row["reps"] = reps
    return row


def format_world_of_one(report: dict[str, Any]) -> list[str]:
    """The world-of-one table, when measured (else no lines)."""
    lines: list[str] = []
    w1 = report.get("world_of_one") or []
    if w1:
        c = report["meta"]["config"]
        lines += [
            "",
            *wrap(
                f"world of one: xcp.attention(q, k, v, causal=...) without a group against torch SDPA (q, k, v "
                f"as [B, H, S, D] views, enable_gqa=True), {c['dtype']}, D={dims_of(c)}; each checked against the "
                f"other (relative 2-norm error of out, dq, dk, dv ≤ {w1[0]['tolerance']:.0e}) before it is timed; "
                f"median of {w1[0]['reps']}, interleaved; ratio = xcp / SDPA. {_path_text(w1)}"
            ),
            "",
            f"{'S':>8} {'mask':>6} | {'fwd SDPA ms':>11} {'fwd xcp ms':>10} {'ratio':>6} | "
            f"{'f+b SDPA ms':>11} {'f+b xcp ms':>10} {'ratio':>6} | check",
        ]
        for r in w1:
            lines.append(
                f"{r['seq']:>8} {'causal' if r['causal'] else 'full':>6} | {r['fwd_sdpa_s'] * 1e3:>11.2f} "
                f"{r['fwd_xcp_s'] * 1e3:>10.2f} {r['fwd_ratio']:>6.3f} | {r['fwd_bwd_sdpa_s'] * 1e3:>11.2f} "
                f"{r['fwd_bwd_xcp_s'] * 1e3:>10.2f} {r['fwd_bwd_ratio']:>6.3f} | {check_text(r)}"
            )
    return lines


def _path_text(rows: list[dict[str, Any]]) -> str:
    """What the ratio measures, by the path xcp took: the backend's whole_attention (then the cost of xcp's
    checks and dispatch around it) or xcp's own block kernel under its autograd Function (then that kernel
    against SDPA's)."""
    whole = {bool(r.get("whole_attention")) for r in rows}
    around = (
        "xcp handed each call to the backend's whole_attention (cuda: torch SDPA itself), so the ratio is the "
        "cost of xcp's checks and dispatch around it"
    )
    own = (
        "the backend has no whole_attention for these inputs, so xcp ran its own block kernel (the header's) "
        "under its autograd Function: the ratio is that kernel against SDPA's, checks and dispatch included"
    )
    if whole == {True}:
        return around
    if whole == {False}:
        return own[0].upper() + own[1:]
    return f"Where the backend's whole_attention took the call, {around}; elsewhere {own}"
