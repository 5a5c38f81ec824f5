"""How ``xcp bench`` checks and times a ring against its yardstick (one whole-sequence call): the errors
first, then both timed interleaved, their medians and the ratio; nothing asserts anything about time."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..common import Clock, median
from .config import BenchConfig
from .virtual import VirtualRing, check_against_whole_kernel


def ratio(ring_seconds: float, reference_seconds: float) -> float:
    """Overhead ratio: ring time over the whole-sequence kernel time (1.0 is ideal)."""
    if reference_seconds <= 0:
        raise ValueError(f"reference_seconds: expected a positive time; got {reference_seconds!r}")
    return ring_seconds / reference_seconds


def check_into(
    cfg: BenchConfig, row: dict[str, Any], run: str, ring: VirtualRing, results, whole_out, whole_grads
) -> None:
    """With ``cfg.check``: the ring's ``results`` against the yardstick's, as ``{run}_errors`` and
    ``{run}_check_ok`` of ``row``."""
    if cfg.check:
        errs = check_against_whole_kernel(ring, results, whole_out, whole_grads)
        row[f"{run}_errors"] = errs
        row[f"{run}_check_ok"] = all(math.isfinite(e) and e <= cfg.check_tolerance for e in errs.values())


def time_into(
    cfg: BenchConfig, clock: Clock, row: dict[str, Any], run: str, reference: Callable[[], Any], ring: Callable[[], Any]
) -> None:
    """``reference`` and ``ring`` timed ``cfg.reps`` times, interleaved (so drifts in clock or temperature hit
    both alike): their medians and ratio as ``{run}_ref_s``, ``{run}_ring_s`` and ``{run}_ratio`` of ``row``."""
    ref_t: list[float] = []
    ring_t: list[float] = []
    for _ in range(cfg.reps):
        ref_t.append(clock.time(reference))
        ring_t.append(clock.time(ring))
    row[f"{run}_ref_s"] = median(ref_t)
    row[f"{run}_ring_s"] = median(ring_t)
    row[f"{run}_ratio"] = ratio(row[f"{run}_ring_s"], row[f"{run}_ref_s"])
