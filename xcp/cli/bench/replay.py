"""``xcp bench --replay``: each ring row also captured into one device graph holding every rank's work and
replayed, against the whole-sequence call replayed as a graph too (the ring's device time without the host),
checked like the eager run; and its table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..common import Clock
from .config import BenchConfig
from .report import REPLAY_RUNS, check_text
from .timing import check_into, time_into
from .virtual import VirtualRing


def measure_replay(
    cfg: BenchConfig,
    clock: Clock,
    ring: VirtualRing,
    whole: Callable[[bool], Any],
    backward: bool,
    row: dict[str, Any],
    run: str,
) -> None:
    """The ring and ``whole`` each captured into a device graph and replayed: checked like the eager run, then
    timed, interleaved, into ``row`` (as ``run``). The graph of the ring holds every rank's work: the ranks'
    threads issue it on their streams, which fork from the capture stream and join it again, as they fork
    from and join the caller's stream eagerly. Called after the eager warm-up, so the ring's slots are in the
    workspace and the kernels are built (nothing is allocated or compiled while capturing)."""
    be = ring.backend
    whole_graph, ring_graph = be.new_graph(), be.new_graph()
    with be.capture_graph(whole_graph):
        whole_out, whole_grads = whole(backward)
    with be.capture_graph(ring_graph):
        results = ring.run(backward)
    whole_graph.replay()
    ring_graph.replay()
    check_into(cfg, row, run, ring, results, whole_out, whole_grads)
    del whole_out, whole_grads, results
    time_into(cfg, clock, row, run, whole_graph.replay, ring_graph.replay)


def format_replay(rows: list[dict[str, Any]]) -> list[str]:
    """The ``--replay`` table: the ring and the whole-sequence call each replayed as a device graph."""
    rows = [r for r in rows if "fwd_replay_ratio" in r]
    if not rows:
        return []
    lines = [
        "",
        "replayed as device graphs (every rank's work in one graph; the whole-sequence call in another): device time",
        f"{'S':>8} {'P':>3} {'U':>2} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | check",
    ]
    for r in rows:
        check = check_text(r, REPLAY_RUNS) if "fwd_replay_errors" in r else "not checked"
        times = [f"{r[f'{m}_replay_ref_s'] * 1e3:>10.2f} {r[f'{m}_replay_ring_s'] * 1e3:>11.2f} "
                 f"{r[f'{m}_replay_ratio']:>6.3f}" for m in ("fwd", "fwd_bwd")]  # fmt: skip
        what = f"{r['seq']:>8} {r['world']:>3} {r.get('ulysses', 1):>2} {'causal' if r['causal'] else 'full':>6}"
        lines.append(f"{what} | {' | '.join(times)} | {check}")
    return lines
