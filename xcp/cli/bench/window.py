"""The table of ``xcp bench --window``: the ring under a sliding window (over documents, if any) against one
whole-sequence windowed varlen call, then the steps and bytes each rank sends next to the dense ring's, and
the balance :func:`xcp.choose_balance` recommends. The rows are measured as :mod:`.documents`' are."""

from __future__ import annotations

from typing import Any

from .. import packing, windows
from ..common import human_bytes
from .report import dims_of, versus_table


def format_windows(report: dict[str, Any]) -> list[str]:
    """The table of the ring under a sliding window (over documents, if any) against one whole-sequence
    windowed call, then the steps and bytes each rank sends, next to the dense ring's."""
    dense = report["timing"]
    c = report["meta"]["config"]
    window = windows.parse_window(c["window"])
    over = f" over packed documents ({packing.parse_documents(c['documents']).describe()})" if c["documents"] else ""
    lines = [
        f"sliding {windows.describe(window)}{over}:",
        "ring of P virtual ranks vs one whole-sequence windowed varlen call (forward_varlen/backward_varlen)",
        "",
        *versus_table(
            report,
            ("balance", 10, lambda r: f"{r['balance']:>10}"),
            ("steps", 5, lambda r: f"{str(r['ring_steps']) + '/' + str(r['world']):>5}"),
        ),
    ]
    first = report["documents"][0]["ring_sent_formula"] if report["documents"] else None
    elements = "2·(S/P)·Hkv·D" if dims_of(c) == str(c["head_dim"]) else "(S/P)·Hkv·(D+Dv)"  # K in D, V in Dv
    lines += [
        "",
        "steps and bytes sent per rank, this ring and the dense ring (all P steps, no window): a K/V shard is",
        f"{elements}·itemsize; forward m-1 K/V shards; backward m-1 K/V shards and m dK/dV messages",
        f"({elements} in the accumulator dtype{'' if c['dtype'] == 'float64' else ', float32'})"
        + (f"; at the first row a K/V shard is {human_bytes(first['kv_shard'])}" if first else ""),
    ]
    for r in report["documents"]:
        ring, dense_f = r["ring_sent_formula"], r["dense_sent_formula"]
        measured = (
            "as measured"
            if r.get("sent_ok")
            else "MEASURED OTHERWISE: "
            + ", ".join(
                human_bytes(max(sum(s.values()) for s in r[f"{mode}_sent_bytes"])) for mode in ("fwd", "fwd_bwd")
            )
        )
        lines.append(
            f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'} {r['balance']}: {ring['steps']} of "
            f"{r['world']} steps, fwd {human_bytes(ring['fwd'])}, f+b {human_bytes(ring['fwd_bwd'])} ({measured})"
        )
        lines.append(
            f"  {'':<{len(str(r['seq'])) + len(str(r['world'])) + 5}}dense ring: {dense_f['steps']} of {r['world']} "
            f"steps, fwd {human_bytes(dense_f['fwd'])}, f+b {human_bytes(dense_f['fwd_bwd'])}"
        )
        if r.get("recommended", r["balance"]) != r["balance"]:
            lines.append(
                f"  {'':<{len(str(r['seq'])) + len(str(r['world'])) + 5}}xcp.choose_balance recommends "
                f"{r['recommended']} ({r['recommended_steps']} of {r['world']} steps): --balance auto"
            )
    lines += ["", "work per rank (pairs computed; max/mean, 1 = balanced):"]
    for r in report["documents"]:
        docs = f", {r['documents']} documents of {r['shortest']}..{r['longest']}" if r["documents"] else ""
        lines.append(f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'}: max/mean "
                     f"{r['work_max_over_mean']:.3f}{docs}")  # fmt: skip
    if dense:
        lines += ["", "dense f+b: the f+b ratio of the ring without window or documents (same S, P, mask; the balance "
                  "given, zigzag for auto)"]  # fmt: skip
    return lines
