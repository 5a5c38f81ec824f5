"""``xcp bench --documents`` (and ``--window``, over documents or one sequence): the ring over packed
documents against one whole-sequence varlen call per (S, P, mask), with each rank's share of the work and the
steps and bytes each rank sends; ``--compare-dense`` times the dense ring beside it. The documents' table;
the window's is :mod:`.window`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...documents import document_plan
from ...traffic import ring_bytes
from .. import packing, windows
from ..common import (
    Clock,
    Problem,
    attention_bytes,
    check_memory,
    pair_flops,
    random_inputs,
    whole_varlen,
    whole_window,
)
from .config import BenchConfig
from .dense import measure, time_one
from .report import dims_row, into, meta, run_work, versus_table
from .virtual import VirtualRing


def estimate_documents_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of a run with documents: the inputs, outputs and gradients at the largest S
    and, for a math kernel, the scores of the longest document (the varlen default computes one document
    segment at a time) on every virtual rank at once; with ``compare_dense``, the dense figure's too."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype, value_head_dim=cfg.value_head_dim)
    spec = cfg.document_spec()
    seq, world = max(cfg.seqs), max(cfg.worlds)
    if spec is None:  # a window over one sequence: the whole-sequence call is one segment of S
        longest = seq
    else:
        longest = min(seq, max(spec.lengths) if spec.lengths is not None else spec.high)
    acc = 8 if cfg.dtype == "float64" else 4
    scores = 4 * cfg.heads * longest**2 * acc * max(world, 2) if quadratic else 0
    needed = attention_bytes(problem, seq, 1, False) + scores
    what = f"fwd+bwd over {'documents' if spec else 'segments'} of up to {longest} tokens at S={seq}, P={world}"
    if cfg.compare_dense:
        dense = attention_bytes(problem, seq, 1, quadratic)
        if dense > needed:
            needed, what = dense, f"the dense comparison: fwd+bwd on the whole sequence at S={seq}"
    return needed, f"{what}, B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.dims_text()} {cfg.dtype}"


def run_documents(
    cfg: BenchConfig, backend, device: torch.device, progress: bool, checkpoint: str | None
) -> dict[str, Any]:
    """The figures of ``--documents`` and/or ``--window``: per (S, P, mask) the ring over packed documents
    (under the window) against one whole-sequence varlen call, each rank's share of the work, the steps and
    bytes sent per rank, and (``compare_dense``) the dense ring."""
    check_memory(backend, device, *estimate_documents_bytes(cfg, device.type))
    clock = Clock(backend, device)
    spec = cfg.document_spec()
    report: dict[str, Any] = {"meta": meta(cfg, backend, device), "timing": [], "documents": [], "memory": [],
                              "graph": None}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    for seq in cfg.seqs:
        for causal in cfg.causal:
            for world in cfg.worlds:
                mask = "causal" if causal else "full"
                what = "window" if cfg.window is not None else "documents"
                args = (cfg, backend, clock, device, seq, world, causal)
                step = into(report["documents"], _time_documents, *args, spec)
                work.append((f"{what} S={seq} P={world} {mask}", step))
                if cfg.compare_dense:
                    work.append((f"dense S={seq} P={world} {mask}", into(report["timing"], time_one, *args)))
    return run_work(work, report, progress, checkpoint)


def _time_documents(cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, world: int, causal: bool,
                    spec: packing.DocumentSpec | None) -> dict[str, Any]:  # fmt: skip
    """One row of ``--documents`` / ``--window``: the ring over the documents ``spec`` draws for ``seq`` (one
    sequence without documents) against the whole-sequence varlen (windowed) call."""
    lengths = (seq,) if spec is None else spec.draw(seq)
    cu = packing.boundaries(lengths)
    window = windows.check(cfg.window_sides(), causal)
    balance = cfg.balance_for(world, causal, None if spec is None else cu, seq)
    full = random_inputs(cfg, seq, device)
    ring = VirtualRing(backend, world, full, causal, balance, documents=None if spec is None else cu, window=window)
    pairs = windows.rank_pairs(cu, world, causal, balance, window)
    total = sum(pairs)
    steps = len(document_plan(cu, world, 0, causal, balance, window).steps)
    row: dict[str, Any] = {
        "seq": seq,
        "world": world,
        "causal": causal,
        "balance": balance,
        **dims_row(cfg),
        "documents": len(lengths) if spec is not None else None,
        "longest": max(lengths),
        "shortest": min(lengths),
        "ring_steps": steps,
        "work_pairs": pairs,
        "work_share": [p / total for p in pairs],
        "work_max_over_mean": packing.max_over_mean(pairs),
    }
    dtype = full[0].dtype
    for name, m in (("ring", steps), ("dense", world)):  # what each rank sends, by the formula
        t = ring_bytes(seq, world, m, cfg.kv_heads, cfg.head_dim, cfg.value_dim, dtype, balance, cfg.batch)
        row[f"{name}_sent_formula"] = {"steps": m, "fwd": t.forward, "fwd_bwd": t.total, "kv_shard": t.kv_shard,
                                       "dkv_message": t.dkv_message}  # fmt: skip
    flops = {b: pair_flops(total, cfg.heads, cfg.head_dim, b, cfg.value_dim) for b in (False, True)}
    if window is None:
        return measure(cfg, clock, ring, lambda b: whole_varlen(backend, full, cu, causal, b), flops, row)
    row["window"] = windows.text_of(window)
    row["recommended"] = windows.resolve_balance(windows.AUTO, world, causal, window, None if spec is None else cu, seq)
    row["recommended_steps"] = windows.ring_steps(cu, world, causal, row["recommended"], window)
    row = measure(cfg, clock, ring, lambda b: whole_window(backend, full, cu, causal, window, b), flops, row)
    formula = row["ring_sent_formula"]
    row["sent_ok"] = all(  # every rank sent what the formula says, in the last forward and fwd+bwd runs
        sum(sent.values()) == formula[mode] for mode in ("fwd", "fwd_bwd") for sent in row[f"{mode}_sent_bytes"]
    )
    return row


def format_documents(report: dict[str, Any]) -> list[str]:
    """The table of the ring over packed documents against one whole-sequence varlen call, then each row's
    share of the work per rank."""
    c = report["meta"]["config"]
    lines = [
        f"packed documents ({packing.parse_documents(c['documents']).describe()}): ring of P virtual ranks vs one "
        "whole-sequence varlen call",
        "",
        *versus_table(
            report,
            ("docs", 5, lambda r: f"{r['documents']:>5}"),
            ("work max/mean", 13, lambda r: f"{r['work_max_over_mean']:>13.3f}"),
        ),
    ]
    dense = report["timing"]
    lines += ["", "share of the work per rank (pairs computed / all pairs; 1/P each is balanced):"]
    for r in report["documents"]:
        shares = " ".join(f"r{i} {x:.3f}" for i, x in enumerate(r["work_share"]))
        steps = f", ring of {r['ring_steps']} steps" if r["ring_steps"] < r["world"] else ""
        lines.append(
            f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'}: {shares}; max/mean "
            f"{r['work_max_over_mean']:.3f} ({r['documents']} documents of {r['shortest']}..{r['longest']}{steps})"
        )
    if dense:
        lines += ["", "dense f+b: the f+b ratio of the same ring without documents (one sequence, same S, P, mask)"]
    return lines
