"""``xcp bench --ulysses U[,U...]``: the hybrid all-to-all + ring (``xcp.attention(..., ulysses=U)``) over P
virtual ranks, each driving :func:`xcp.hybrid.hybrid_forward` / ``hybrid_backward`` (U = 1: the ring alone),
checked against one whole-sequence kernel call before it is timed, with the bytes each rank sent in the
all-to-alls and the ring counted at its communicators and compared with :func:`xcp.hybrid.hybrid_traffic`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...hybrid import hybrid_traffic
from .. import windows
from ..common import (
    DTYPES,
    Clock,
    Problem,
    attention_bytes,
    attention_flops,
    check_memory,
    human_bytes,
    random_inputs,
    whole_kernel,
)
from .config import BenchConfig
from .dense import measure
from .report import check_text, dims_row, into, meta, run_work, wrap
from .virtual import VirtualRing


def run_ulysses(
    cfg: BenchConfig, backend, device: torch.device, progress: bool, checkpoint: str | None
) -> dict[str, Any]:
    """The figures of ``--ulysses``: per (S, P, mask) and each U, the hybrid over P virtual ranks against one
    whole-sequence kernel call, checked first, with the bytes each rank sent against the formula."""
    quadratic = device.type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, value_head_dim=cfg.value_head_dim)
    seq = max(cfg.seqs)  # the whole-sequence call (and U = P, whose ranks each compute S x S for H/P heads)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.dims_text()} {cfg.dtype}"
    check_memory(backend, device, attention_bytes(problem, seq, 1, quadratic), f"fwd+bwd at S={seq}, {shape}")
    clock = Clock(backend, device)
    report: dict[str, Any] = {"meta": meta(cfg, backend, device), "timing": [], "memory": [], "graph": None,
                              "ulysses": []}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    assert cfg.ulysses is not None
    for seq in cfg.seqs:
        for causal in cfg.causal:
            for world in cfg.worlds:
                for u in cfg.ulysses:
                    step = into(report["ulysses"], _time_ulysses, cfg, backend, clock, device, seq, world, causal, u)
                    work.append((f"S={seq} P={world} U={u} {'causal' if causal else 'full'}", step))
    return run_work(work, report, progress, checkpoint)


ULYSSES_TAGS = ("a2a", "kv", "dkv")
"""What a rank of the hybrid sends: the all-to-alls (q, k, v, out; dout, dq, dk, dv), the ring's K/V shards
and its dK/dV."""


def ulysses_formula(t, tv=None) -> dict[str, dict[str, int]]:
    """Bytes per rank and tag of one forward (``fwd``) and one forward+backward (``fwd_bwd``) by the formula
    (:class:`xcp.hybrid.HybridTraffic`). ``tv``: the formula at v's head dim where it is another than q/k's
    (``t`` at q/k's). Half of what moves is in each dim — q, k, dq, dk in D; v, out, dout, dv in Dv, and so K
    and dK against V and dV in the ring — and the formula is linear in the head dim (each count even), so the
    bytes are the mean of the two formulas."""
    if tv is not None:
        at_d, at_dv = ulysses_formula(t), ulysses_formula(tv)
        return {mode: {tag: (n + at_dv[mode][tag]) // 2 for tag, n in counts.items()} for mode, counts in at_d.items()}
    fwd = {"a2a": t.forward_alltoall, "kv": t.forward_ring, "dkv": 0}
    fwd_bwd = {"a2a": t.forward_alltoall + t.backward_alltoall, "kv": t.forward_ring + t.backward_ring_kv,
               "dkv": t.backward_ring_dkv}  # fmt: skip
    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def _time_ulysses(cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, world: int, causal: bool,
                  ulysses: int) -> dict[str, Any]:  # fmt: skip
    """One row of ``--ulysses``: the hybrid with head groups of ``ulysses`` ranks over ``world``."""
    full = random_inputs(cfg, seq, device)
    rings = world // ulysses
    balance = windows.resolve_balance(cfg.balance, world, causal, None, None, ulysses=ulysses)  # dense: zigzag
    ring = VirtualRing(backend, world, full, causal, balance, ulysses=ulysses)
    t, tv = (hybrid_traffic(cfg.batch, seq, cfg.heads, cfg.kv_heads, d, DTYPES[cfg.dtype], world, ulysses)
             for d in (cfg.head_dim, cfg.value_dim))  # fmt: skip
    formula = ulysses_formula(t, None if cfg.value_dim == cfg.head_dim else tv)
    row: dict[str, Any] = {"seq": seq, "world": world, "ulysses": ulysses, "ring": rings, "causal": causal,
                           "balance": balance, **dims_row(cfg), "sent_formula": formula}  # fmt: skip
    flops = {b: attention_flops(cfg.batch, seq, cfg.heads, cfg.head_dim, causal, b, cfg.value_dim)
             for b in (False, True)}  # fmt: skip
    row = measure(cfg, clock, ring, lambda b: whole_kernel(backend, full, causal, b), flops, row)
    row["sent_ok"] = all(  # every rank sent what the formula says, per tag, in the last forward and fwd+bwd runs
        sent.get(tag, 0) == row["sent_formula"][mode][tag] and set(sent) <= set(ULYSSES_TAGS)
        for mode in ("fwd", "fwd_bwd")
        for sent in row[f"{mode}_sent_bytes"]
        for tag in ULYSSES_TAGS
    )
    return row


def format_ulysses(report: dict[str, Any]) -> list[str]:
    """The table of the hybrid for each U against one whole-sequence kernel call, with the bytes per rank."""
    rows = report["ulysses"]
    lines = [
        "",
        *wrap(
            "hybrid all-to-all + ring (--ulysses): P virtual ranks = U x R (head groups of U consecutive ranks, "
            "rings of R = P/U), each driving xcp.hybrid.hybrid_forward / hybrid_backward (U = 1: the ring alone), "
            "checked against one whole-sequence kernel call before it is timed; ratio = hybrid / that call. Bytes: "
            "what each rank sent in one fwd+bwd, counted at its communicators (the all-to-alls; the ring's K/V and "
            "dK/dV), checked against xcp.hybrid.hybrid_traffic (as xcp plan --ulysses prints it)"
        ),
        "",
        f"{'S':>8} {'P':>3} {'U':>3} {'R':>3} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | {'a2a/rank':>10} {'ring/rank':>10} "
        f"{'total/rank':>10} | check",
    ]
    for r in rows:
        f = r["sent_formula"]["fwd_bwd"]
        mask = "causal" if r["causal"] else "full"
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {r['ulysses']:>3} {r['ring']:>3} {mask:>6} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} | "
            f"{human_bytes(f['a2a']):>10} {human_bytes(f['kv'] + f['dkv']):>10} "
            f"{human_bytes(f['a2a'] + f['kv'] + f['dkv']):>10} | {check_text(r)}"
            + ("" if r.get("sent_ok", True) else " bytes MEASURED OTHERWISE")
        )
    lines += wrap(
        "check: out, dq, dk, dv against the whole-sequence call (relative 2-norm error), and every rank's bytes "
        "per tag equal to the formula, in the forward and in the forward+backward"
    )
    return lines
