"""Which measurement ``xcp bench`` makes and which tables it prints: one :class:`BenchConfig` (or the report
it gave) picks its mode, and each mode's module measures and formats it."""

from __future__ import annotations

from typing import Any

from ..common import check_value_dim, tool_backend
from .config import REPLAY_FLAG, BenchConfig
from .dense import format_dense, run_dense
from .documents import format_documents, run_documents
from .host import format_host, run_host
from .hybrid import format_ulysses, run_ulysses
from .replay import format_replay
from .report import header
from .window import format_windows


def run_bench(cfg: BenchConfig, progress: bool = True, checkpoint: str | None = None) -> dict[str, Any]:
    """Measure every figure of ``cfg``; returns a JSON-ready dict (rows of timing, memory and graph).

    :param checkpoint: a JSON path rewritten after every figure, so a run cut short keeps what it measured.
    :raises ValueError: a field cannot be measured, or the run would need more memory than there is.
    """
    cfg.validate()
    backend, device = tool_backend(cfg.device, 0)
    check_value_dim(backend, cfg.head_dim, cfg.value_dim)
    if cfg.replay and backend.new_graph() is None:
        raise ValueError(f"{REPLAY_FLAG}: needs a backend with device graphs (cuda has them); backend "
                         f"{backend.name!r} has none")  # fmt: skip
    if cfg.host or cfg.world_of_one:
        return run_host(cfg, backend, device, progress, checkpoint)
    if cfg.ulysses is not None:
        return run_ulysses(cfg, backend, device, progress, checkpoint)
    if cfg.documents is not None or cfg.window is not None:
        return run_documents(cfg, backend, device, progress, checkpoint)
    return run_dense(cfg, backend, device, progress, checkpoint)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables of a report."""
    if report.get("host") is not None or report.get("world_of_one") is not None:
        return "\n".join(header(report) + format_host(report))
    if report.get("ulysses") is not None:
        return "\n".join(header(report) + format_ulysses(report) + format_replay(report["ulysses"]))
    replayed = format_replay(report["timing"] + (report.get("documents") or []))
    if report.get("documents") is not None and report["meta"]["config"].get("window") is not None:
        return "\n".join(header(report) + format_windows(report) + replayed)
    if report.get("documents") is not None:
        return "\n".join(header(report) + format_documents(report) + replayed)
    return format_dense(report, replayed)
