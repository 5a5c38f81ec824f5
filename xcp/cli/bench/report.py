"""What every measurement of ``xcp bench`` shares in its report: the run loop with its progress bar and
checkpoint, the ``meta`` block and header, and the verdict and layout of a row checked against a yardstick."""

from __future__ import annotations

import datetime
import platform
import sys
import textwrap
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ..common import head_dims_text, write_json
from .config import BenchConfig


def run_work(
    work: list[tuple[str, Callable[[], None]]], report: dict[str, Any], progress: bool, checkpoint: str | None
) -> dict[str, Any]:
    """Run each measurement of ``work`` in order, with the progress bar and the checkpoint after each; return
    ``report`` (which the measurements fill)."""
    for step, (label, measure) in enumerate(work):
        if progress:
            _progress(step, len(work), label)
        measure()
        if checkpoint:
            write_json(report, checkpoint)
    if progress:
        _progress(len(work), len(work), "done")
    return report


def into(rows: list[dict[str, Any]], measure: Callable[..., dict[str, Any]], *args: Any) -> Callable[[], None]:
    """A measurement of :func:`run_work` that appends ``measure(*args)`` to ``rows`` (a table of the report)."""

    def step() -> None:
        rows.append(measure(*args))

    return step


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def meta(cfg: BenchConfig, backend, device: torch.device) -> dict[str, Any]:
    """The ``meta`` of a report: when, where, with what, and the whole configuration."""
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None),
        "backend": backend.name,
        "kernel": backend.kernel,
        "config": {**asdict(cfg), "value_head_dim": cfg.value_dim},  # None (head_dim's) resolved
    }
    if device.type != "cpu":
        meta["device_name"] = torch.get_device_module(device.type).get_device_name(device)
    return meta


def wrap(text: str, width: int = 110) -> list[str]:
    """A paragraph of a report, in lines of at most ``width``."""
    return textwrap.wrap(text, width)


def dims_of(config: dict[str, Any]) -> str:
    """A report's head dims: ``128``, or ``192/128`` (q/k, v) where v's is another."""
    return head_dims_text(config["head_dim"], config.get("value_head_dim"))


def dims_row(cfg: BenchConfig) -> dict[str, int]:
    """The head dims every row of a report carries: q/k's (``head_dim``) and v's (``value_head_dim``)."""
    return {"head_dim": cfg.head_dim, "value_head_dim": cfg.value_dim}


_VALUES = "values of another head dim: q, k, dq, dk of D={}; v, out, dout, dv of Dv={}"


def header(report: dict[str, Any]) -> list[str]:
    """The lines every local report opens with: date, device, versions, backend, problem, repetitions."""
    m = report["meta"]
    c = m["config"]
    return [
        f"xcp bench {m['date']} on {m.get('device_name', m['host'])}, torch {m['torch']}, cuda {m['cuda']}, "
        f"backend {m['backend']} ({m['kernel']})",
        f"B={c['batch']} H={c['heads']} Hkv={c['kv_heads']} D={dims_of(c)} {c['dtype']} balance {c['balance']}, "
        f"median of {c['reps']} after {c['warmup']} warm-up",
        *([_VALUES.format(c["head_dim"], c.get("value_head_dim"))] if dims_of(c) != str(c["head_dim"]) else []),
        *([f"sizes: {c['sizes_note']} (give the flags to change them)"] if c.get("sizes_note") else []),
    ]


EAGER_RUNS = ("fwd", "fwd_bwd")
REPLAY_RUNS = ("fwd_replay", "fwd_bwd_replay")
"""The runs of a row checked against the yardstick: eager, and replayed as graphs (``--replay``)."""


def row_ok(r: dict[str, Any], runs: tuple[str, ...] = EAGER_RUNS + REPLAY_RUNS) -> bool:
    """The row's checks passed: out and grads against the yardstick in ``runs`` (all: eager and replayed),
    and (with a window) the bytes each rank sent against the formula."""
    checks = all(r.get(f"{m}_check_ok", True) for m in runs)
    return checks and r.get("sent_ok", True) and r.get("calls_ok", True)


def worst_error(r: dict[str, Any], runs: tuple[str, ...]) -> float:
    """The largest relative error of the row's ``runs`` against the yardstick; NaN where none was checked."""
    return max([e for m in runs for e in r.get(f"{m}_errors", {}).values()] or [float("nan")])


def check_text(r: dict[str, Any], runs: tuple[str, ...] = EAGER_RUNS) -> str:
    """``ok (worst error)`` or ``FAIL (...)`` for the row's ``runs`` (the replayed ones have their own table)."""
    return f"{'ok' if row_ok(r, runs) else 'FAIL'} ({worst_error(r, runs):.1e})"


def versus_table(report: dict[str, Any], fourth: tuple, last: tuple) -> list[str]:
    """Header and rows of a ring-against-one-whole-sequence-call table (documents, windows): S, P, mask, a
    ``fourth`` column, forward and forward+backward times and ratios, a ``last`` column, the dense ring's
    ratio where it was timed, the check. ``fourth``/``last``: (title, width, cell of a row)."""
    dense = {(r["seq"], r["world"], r["causal"]): r for r in report["timing"]}
    lines = [
        f"{'S':>8} {'P':>3} {'mask':>6} {fourth[0]:>{fourth[1]}} | {'fwd ref ms':>10} {'fwd ring ms':>11} "
        f"{'ratio':>6} | {'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | {last[0]:>{last[1]}}"
        + (f" | {'dense f+b':>9}" if dense else "")
        + " | check",
    ]
    for r in report["documents"]:
        d = dense.get((r["seq"], r["world"], r["causal"]))
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {'causal' if r['causal'] else 'full':>6} {fourth[2](r)} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} | "
            f"{last[2](r)}"
            + (f" | {d['fwd_bwd_ratio']:>9.3f}" if d else " | " + " " * 9 if dense else "")
            + f" | {check_text(r)}"
        )
    return lines
