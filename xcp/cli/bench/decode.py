"""``xcp bench --decode``: a decode step over a sharded KV cache (:class:`xcp.KVCache` with ``capacity``) of P
virtual ranks on one device against one whole-cache call on one device, and a chunk of T tokens likewise.

Per (L, P): P caches with room for L + the steps + the chunks, prefilled with ``xcp.shard`` of one random
whole K/V (the cache's balance; no ring prefill), then

- a decode step of xcp (every rank appends the same token per sequence, attends the same query over its own
  tokens, and the ranks combine: one all-gather and the merge), eager, and captured once into ONE device
  graph holding every rank's work and replayed (each replay appends one more token and attends over all of
  them: the lengths live on the device), against one whole-cache call (append + attention): torch SDPA
  (default dispatch, ``enable_gqa``), eager and replayed as a graph, and the aten flash varlen op with
  ``seqused_k`` on the device (the kernel a graph-safe single-device decode runs), eager and replayed;
- with ``--chunk T``: T tokens appended after the cached ones and their T queries attended causally (eager;
  chunks take the host path), against one whole-cache call with the same mask (flash varlen, causal aligned
  bottom-right: the queries are the last T positions; SDPA with that mask where flash does not serve).

Every xcp output (every rank's) is checked against the whole-cache reference before anything is timed, the
replayed ones too; the references are checked against each other. Times are medians, the contenders timed
interleaved (so drifts in clock or temperature hit all alike); ratios are xcp / reference of the same run.
Each row also gives the bytes of K/V each rank's cache holds (``KVCache.nbytes``) beside the whole cache's
over P, and the host µs of one rank's decode step (the rank thread's CPU clock, as ``--host`` measures a ring
step: kernels launch asynchronously on a device, so this is the step's host work; on the CPU the kernels run
in it too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ...api import shard
from ...comm import LocalWorld
from ...inference.cache import KVCache
from .. import windows
from ..common import DTYPES, Clock, check_memory, check_value_dim, error, human_bytes, median, tool_backend
from .config import BenchConfig
from .report import check_text, dims_row, header, meta, run_work, wrap
from .timing import ratio

DECODE_RUNS = ("decode", "decode_replay")
"""The checks of a decode row: eager, and replayed as graphs."""
CHUNK_RUNS = ("chunk",)
"""The check of a chunk row."""
PRE_CAPTURE_STEPS = 2
"""Eager decode steps right before the capture (after a chunk, which takes the host path)."""
REPLAY_CHECKS = 2
"""Replays checked against the reference, each with new inputs: the second proves the graph appends."""


# ---------------------------------------------------------------------------------------------- sizes
def decode_steps(cfg: BenchConfig, graphs: bool) -> int:
    """Decode steps one figure appends: the eager check, warm-up and timed steps; with ``graphs``, the eager
    steps before the capture, the checked replays, the warm-up and timed replays."""
    runs = cfg.warmup + cfg.reps
    return 1 + runs + ((PRE_CAPTURE_STEPS + REPLAY_CHECKS + runs) if graphs else 0)


def chunk_tokens(cfg: BenchConfig) -> int:
    """Tokens the chunks of one figure append: the checked chunk, the warm-up and timed ones."""
    return cfg.chunk * (1 + cfg.warmup + cfg.reps)


def capacity(cfg: BenchConfig, seq: int, graphs: bool) -> int:
    """The caches' capacity for a figure at ``seq`` cached tokens: L + the steps + the chunks."""
    return seq + decode_steps(cfg, graphs) + chunk_tokens(cfg)


def flash_serves(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None) -> bool:
    """Whether the aten flash varlen op serves the whole-cache reference: CUDA, fp16/bf16, head_dim % 8 == 0
    up to 256, and v of the same head dim (its kernels take one)."""
    same = value_head_dim is None or value_head_dim == head_dim
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and same)  # fmt: skip


def estimate_decode_bytes(cfg: BenchConfig, device: torch.device, graphs: bool) -> tuple[int, str]:
    """Estimated peak memory of the largest figure: the whole cache and the P caches (each its share, at the
    capacity), a rank's prompt shard while it is copied in, the chunk's gathered partials and the merge's
    temporaries (about 2P + 2 partials per rank, in the accumulator dtype; each rank allocates on its own
    stream, whose memory the others do not reuse) and, where flash does not serve, the math kernel's repeated
    K/V and scores."""
    dtype = DTYPES[cfg.dtype]
    elt, acc = dtype.itemsize, (8 if dtype == torch.float64 else 4)
    seq, world, fewest = max(cfg.seqs), max(cfg.worlds), min(cfg.worlds)
    cap = capacity(cfg, seq, graphs)
    token = cfg.batch * cfg.kv_heads * (cfg.head_dim + cfg.value_dim) * elt  # K and V of one token of every sequence
    needed = 2 * cap * token + seq * token // fewest + world * token
    t = max(cfg.chunk, 1)
    needed += world * (2 * world + 2) * cfg.batch * t * cfg.heads * (cfg.value_dim + 1) * acc  # partials: out in Dv
    if not flash_serves(device, dtype, cfg.head_dim, cfg.value_dim):
        needed += cap * token * cfg.heads // cfg.kv_heads + 2 * cfg.batch * cfg.heads * t * cap * acc
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.dims_text()} {cfg.dtype}"
    return needed, f"a whole cache of {cap} tokens and its shards over {world} ranks, {shape}"


# ---------------------------------------------------------------------------------------------- the yardstick
class WholeCache:
    """One device holding the whole cache, K [B, capacity, Hkv, D] and V [B, capacity, Hkv, Dv] (rows [0, n)
    the tokens the ranks hold together), and the whole-cache calls the ranks are measured against."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, scale: float, flash: bool) -> None:
        self.k, self.v, self.scale, self.flash = k, v, scale, flash
        b, cap = k.shape[:2]
        device = k.device
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        """flash: the row its next step writes (on the device: a replayed graph advances it)."""
        self.used = torch.zeros(b, dtype=torch.int32, device=device)
        """flash: the tokens of each sequence its next step attends over (``seqused_k``)."""
        self.cu_k = torch.arange(0, b + 1, dtype=torch.int32, device=device) * cap
        self._cu_q: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def sdpa(self, q: torch.Tensor, at: int) -> torch.Tensor:
        """torch SDPA (its default dispatch, ``enable_gqa``) of ``q`` [B, T, H, D], the queries at ``at ..
        at + T - 1``, over the tokens [0, at + T): every one for T = 1, else under the causal mask aligned
        bottom-right (query i sees the tokens up to ``at + i``)."""
        t = q.shape[1]
        n = at + t
        mask = None
        if t > 1:
            mask = torch.arange(n, device=q.device).view(1, n) <= torch.arange(at, n, device=q.device).view(t, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), self.k[:, :n].transpose(1, 2), self.v[:, :n].transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2)

    def sdpa_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: int) -> torch.Tensor:
        """Append ``k`` [B, T, Hkv, D], ``v`` [B, T, Hkv, Dv] at row ``at`` (host position), then :meth:`sdpa`."""
        t = k.shape[1]
        self.k[:, at : at + t].copy_(k)
        self.v[:, at : at + t].copy_(v)
        return self.sdpa(q, at)

    def place(self, at: int, t: int) -> None:
        """flash: its next step writes rows ``at .. at + t - 1`` and attends over ``at + t`` tokens."""
        self.pos.fill_(at)
        self.used.fill_(at + t)

    def flash_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append ``k``, ``v`` [B, T, Hkv, D / Dv] at the device position, attend ``q`` [B, T, H, D] over every
        token with the aten flash varlen op and ``seqused_k`` (causal, bottom-right, for T > 1), advance the
        positions by T: no host position anywhere, so a replayed graph of it appends and attends one step
        further each time."""
        b, t, h, d = q.shape
        cap, hkv, dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]
        rows = self.pos if t == 1 else self.pos + self._arange(t)
        self.k.index_copy_(1, rows, k)
        self.v.index_copy_(1, rows, v)
        out = torch.ops.aten._flash_attention_forward(
            q.reshape(b * t, h, d), self.k.view(b * cap, hkv, d), self.v.view(b * cap, hkv, dv), self._cu(t, q.device),
            self.cu_k, t, cap, 0.0, t > 1, False, scale=self.scale, seqused_k=self.used,
        )[0]  # fmt: skip
        self.pos.add_(t)
        self.used.add_(t)
        return out.view(b, t, h, dv)

    def _cu(self, t: int, device: torch.device) -> torch.Tensor:
        cu = self._cu_q.get(t)
        if cu is None:
            cu = self._cu_q[t] = torch.arange(0, self.used.shape[0] + 1, dtype=torch.int32, device=device) * t
        return cu

    def _arange(self, t: int) -> torch.Tensor:
        rows = self._rows.get(t)
        if rows is None:
            rows = self._rows[t] = torch.arange(t, dtype=torch.int64, device=self.pos.device)
        return rows


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The kernel torch SDPA picks for the decode query against the whole cache (``torch._fused_sdp_choice``),
    or None where torch does not say."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    try:
        from torch.nn.attention import SDPBackend

        views = [x.transpose(1, 2) for x in (q, k, v)]
        value = int(choose(*views, None, 0.0, False, scale=None, enable_gqa=True))
        return next((name for name, b in SDPBackend.__members__.items() if b.value == value), str(value))
    except Exception:  # noqa: BLE001 - a name for the table only
        return None


# ---------------------------------------------------------------------------------------------- xcp's ranks
class DecodeRanks:
    """P virtual ranks on one device, each with its :class:`xcp.KVCache` (``capacity``) of one layer, kept
    from one step to the next; every rank's thread runs on its own stream, which forks from the caller's
    stream and joins it (so one device graph captured on the caller's stream holds every rank's work)."""

    def __init__(self, backend, device: torch.device, world: int, balance: str, room: int, k, v) -> None:
        self.backend, self.device = backend, device
        self.world = LocalWorld(world, device=device)
        self.caches = [KVCache(group=self.world.group(r), balance=balance, capacity=room, device=backend.name)
                       for r in range(world)]  # fmt: skip
        for r, cache in enumerate(self.caches):  # no communication: each rank keeps its shard
            cache.prefill(shard(k, world, r, balance=balance), shard(v, world, r, balance=balance))
        self.streams = [backend.new_stream(device) for _ in range(world)]
        self.cpu_ns: list[list[int]] = [[] for _ in range(world)]
        """Per rank: the thread CPU ns of each step (fork, append, attention and combine, on its thread)."""

    def _rank(self, group, main, q, k, v):
        t0 = time.thread_time_ns()
        be, r = self.backend, group.rank()
        stream = self.streams[r]
        be.wait_stream(stream, main)
        with be.stream_context(stream):
            cache = self.caches[r]
            cache.append(k, v)
            out = cache.attention(q, causal=True)
        self.cpu_ns[r].append(time.thread_time_ns() - t0)
        return stream, out

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """Every rank appends ``k``, ``v`` and attends ``q``; returns every rank's output. The caller's stream
        waits for all of them."""
        main = self.backend.current_stream(self.device)
        results = self.world.run(self._rank, main, q, k, v)
        for stream, _ in results:
            self.backend.wait_stream(main, stream)
        return [out for _, out in results]

    def host_us(self, last: int) -> float:
        """The median over the ``last`` steps of the mean over ranks of a step's thread CPU µs."""
        steps = [sum(ns[i] for ns in self.cpu_ns) / len(self.cpu_ns) / 1e3 for i in range(-last, 0)]
        return median(steps)

    def close(self) -> None:
        self.world.close()


def _worst(outs: list[torch.Tensor], ref: torch.Tensor) -> float:
    """The largest relative error of the ranks' outputs against ``ref``."""
    return max(error(o, ref).rel for o in outs)


def _verdict(cfg: BenchConfig, row: dict[str, Any], run: str, errs: dict[str, float]) -> None:
    row[f"{run}_errors"] = errs
    row[f"{run}_check_ok"] = all(math.isfinite(e) and e <= cfg.check_tolerance for e in errs.values())


def _interleaved(cfg: BenchConfig, clock: Clock, contenders: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
                 between: Callable[[], None]) -> dict[str, float]:  # fmt: skip
    """``cfg.warmup`` then ``cfg.reps`` rounds; in each, every contender's ``(prepare, step)``: ``prepare``
    untimed, then ``step`` on the clock; ``between`` after each round. Returns each contender's median."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(cfg.warmup + cfg.reps):
        for name, (prepare, step) in contenders.items():
            prepare()
            seconds = clock.time(step)
            if i >= cfg.warmup:
                times[name].append(seconds)
        between()
    return {name: median(values) for name, values in times.items()}


def _nothing() -> None:
    pass


# ---------------------------------------------------------------------------------------------- one figure
def measure_decode(cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, world: int,
                   report: dict[str, Any]) -> None:  # fmt: skip
    """The decode row (and the chunk row, with ``cfg.chunk``) of L = ``seq`` cached tokens over ``world``
    virtual ranks, appended to ``report["decode"]`` (and ``report["chunk"]``)."""
    dtype = DTYPES[cfg.dtype]
    b, h, hkv, d, dv = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.value_dim
    graphs = cfg.graph and backend.new_graph() is not None
    room = capacity(cfg, seq, graphs)
    balance = windows.resolve_balance(cfg.balance, world, True, None, None)
    gen = torch.Generator(device=device).manual_seed(seq * 131 + world)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    k_all, v_all = randn(b, room, hkv, d), randn(b, room, hkv, dv)
    flash = flash_serves(device, dtype, d, dv)
    whole = WholeCache(k_all, v_all, 1.0 / math.sqrt(d), flash)
    ranks = DecodeRanks(backend, device, world, balance, room, k_all[:, :seq], v_all[:, :seq])
    q1, k1, v1 = randn(b, 1, h, d), randn(b, 1, hkv, d), randn(b, 1, hkv, dv)  # the step's inputs, kept in place

    def fresh(*xs: torch.Tensor) -> None:
        for x in xs:
            x.copy_(randn(*x.shape))

    n = seq
    row: dict[str, Any] = {
        "seq": seq, "world": world, "batch": b, "balance": balance, **dims_row(cfg), "capacity": room,
        "tolerance": cfg.check_tolerance, "sdpa_kernel": sdpa_kernel(q1, k_all[:, :seq], v_all[:, :seq]),
        "flash": flash,
    }  # fmt: skip

    # (a), (c), (d) eager: checked, then timed
    outs = ranks.step(q1, k1, v1)
    ref = whole.sdpa_step(q1, k1, v1, n)
    errs = {"xcp": _worst(outs, ref)}
    if flash:
        whole.place(n, 1)
        errs["flash"] = error(whole.flash_step(q1, k1, v1), ref).rel
    _verdict(cfg, row, "decode", errs)
    n += 1
    del outs, ref

    def advance(t: int) -> Callable[[], None]:
        def step() -> None:
            nonlocal n
            n += t

        return step

    contenders: dict[str, tuple[Callable[[], Any], Callable[[], Any]]]
    contenders = {"sdpa": (_nothing, lambda: whole.sdpa_step(q1, k1, v1, n))}
    if flash:
        contenders["flash"] = (lambda: whole.place(n, 1), lambda: whole.flash_step(q1, k1, v1))
    contenders["xcp"] = (_nothing, lambda: ranks.step(q1, k1, v1))
    eager = _interleaved(cfg, clock, contenders, advance(1))
    _times_into(row, "eager", eager)
    row["host_step_us"] = ranks.host_us(cfg.reps)

    chunk_row = _measure_chunk(cfg, clock, ranks, whole, randn, n, row) if cfg.chunk else None
    if chunk_row is not None:
        n = chunk_row["cached"] + chunk_tokens(cfg)

    # (b) every rank's step captured as one device graph and replayed, against the references replayed
    if graphs:
        n = _measure_replay(cfg, backend, clock, ranks, whole, fresh, (q1, k1, v1), n, row)
    else:
        row["replay"] = "left out (--no-graph)" if not cfg.graph else f"no graphs on {device.type}"

    row["steps"] = n - seq - (chunk_tokens(cfg) if cfg.chunk else 0)
    row["cache_bytes"] = [c.nbytes for c in ranks.caches]
    row["whole_cache_bytes"] = sum(x.numel() * x.element_size() for x in (k_all, v_all))
    row["whole_cache_bytes_per_rank"] = row["whole_cache_bytes"] / world
    row["tokens_per_rank"] = [c.local_len for c in ranks.caches]  # after replays: the device's counts
    row["tokens"] = n
    held = row["tokens_per_rank"]
    row["tokens_ok"] = sum(held) == n and max(held) - min(held) <= 1  # within one token of each other
    ranks.close()
    report["decode"].append(row)
    if chunk_row is not None:
        report["chunk"].append(chunk_row)


def _times_into(row: dict[str, Any], run: str, medians: dict[str, float]) -> None:
    """The medians of ``run`` (``eager``, ``replay``) and xcp's ratio over each reference, into ``row``."""
    for name, seconds in medians.items():
        row[f"{run}_{name}_s"] = seconds
    for name in ("sdpa", "flash"):
        if name in medians:
            row[f"{run}_xcp_over_{name}"] = ratio(medians["xcp"], medians[name])


def _measure_chunk(cfg: BenchConfig, clock: Clock, ranks: DecodeRanks, whole: WholeCache, randn, n: int,
                   decode_row: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The chunk row: T tokens appended after the ``n`` cached ones and their queries attended causally, by
    xcp over the ranks (eager) and by one whole-cache call with the same mask, checked, then timed."""
    b, h, hkv, d, dv, t = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.value_dim, cfg.chunk
    q, k, v = randn(b, t, h, d), randn(b, t, hkv, d), randn(b, t, hkv, dv)
    row: dict[str, Any] = {
        "seq": decode_row["seq"], "world": decode_row["world"], "chunk": t, "cached": n, **dims_row(cfg),
        "reference": "flash varlen" if whole.flash else "sdpa", "tolerance": cfg.check_tolerance,
    }  # fmt: skip

    def reference(at: int) -> torch.Tensor:
        if whole.flash:
            whole.place(at, t)
            return whole.flash_step(q, k, v)
        return whole.sdpa_step(q, k, v, at)

    outs = ranks.step(q, k, v)
    _verdict(cfg, row, "chunk", {"xcp": _worst(outs, reference(n))})
    del outs
    at = n + t

    def advance() -> None:
        nonlocal at
        at += t

    if whole.flash:
        ref = (lambda: whole.place(at, t), lambda: whole.flash_step(q, k, v))
    else:
        ref = (_nothing, lambda: whole.sdpa_step(q, k, v, at))
    medians = _interleaved(cfg, clock, {"ref": ref, "xcp": (_nothing, lambda: ranks.step(q, k, v))}, advance)
    row["chunk_ref_s"], row["chunk_xcp_s"] = medians["ref"], medians["xcp"]
    row["chunk_ratio"] = ratio(medians["xcp"], medians["ref"])
    return row


def _measure_replay(cfg: BenchConfig, backend, clock: Clock, ranks: DecodeRanks, whole: WholeCache, fresh,
                    inputs: tuple[torch.Tensor, ...], n: int, row: dict[str, Any]) -> int:  # fmt: skip
    """xcp's step (every rank) captured once into one device graph, the SDPA step and the flash step into
    graphs of their own; each replay of xcp's and flash's appends one more token. Checked, then timed
    interleaved; returns the tokens cached after."""
    q1, k1, v1 = inputs
    for _ in range(PRE_CAPTURE_STEPS):  # the first eager step of a configuration agrees among ranks; warm-up
        ranks.step(q1, k1, v1)
        whole.k[:, n : n + 1].copy_(k1)
        whole.v[:, n : n + 1].copy_(v1)
        n += 1
    xcp_graph = backend.new_graph()
    with backend.capture_graph(xcp_graph):
        outs = ranks.step(q1, k1, v1)
    errs: dict[str, float] = {}
    for i in range(REPLAY_CHECKS):
        fresh(q1, k1, v1)
        ref = whole.sdpa_step(q1, k1, v1, n)  # also the warm-up of SDPA at the shape its graph captures
        if i == REPLAY_CHECKS - 1:  # the inputs stay these from now on: the references' graphs are made
            sdpa_graph = backend.new_graph()
            with backend.capture_graph(sdpa_graph):
                sdpa_out = whole.sdpa_step(q1, k1, v1, n)
            flash_graph = None
            if whole.flash:
                whole.place(n, 1)
                flash_graph = backend.new_graph()
                with backend.capture_graph(flash_graph):
                    flash_out = whole.flash_step(q1, k1, v1)
                flash_graph.replay()
                errs["flash"] = error(flash_out, ref).rel
            sdpa_graph.replay()
            errs["sdpa"] = error(sdpa_out, ref).rel
        xcp_graph.replay()
        errs[f"xcp_{i + 1}"] = _worst(outs, ref)
        n += 1
    _verdict(cfg, row, "decode_replay", errs)
    start = n

    def advance() -> None:
        nonlocal n
        n += 1

    contenders: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {"sdpa": (_nothing, sdpa_graph.replay)}
    if flash_graph is not None:
        contenders["flash"] = (_nothing, flash_graph.replay)
    contenders["xcp"] = (_nothing, xcp_graph.replay)
    _times_into(row, "replay", _interleaved(cfg, clock, contenders, advance))
    whole.k[:, start:n].copy_(k1.expand(-1, n - start, -1, -1))  # what xcp's replays appended (flash's too)
    whole.v[:, start:n].copy_(v1.expand(-1, n - start, -1, -1))
    return n


# ---------------------------------------------------------------------------------------------- the mode
def run_decode(cfg: BenchConfig, progress: bool = True, checkpoint: str | None = None) -> dict[str, Any]:
    """The figures of ``--decode``: per (L, P) of ``seqs`` x ``worlds`` a decode row (and a chunk row);
    returns a JSON-ready dict (as :func:`.runner.run_bench` does for the other modes).

    :param checkpoint: a JSON path rewritten after every figure, so a run cut short keeps what it measured.
    :raises ValueError: a field cannot be measured, or the run would need more memory than there is.
    """
    cfg.validate()
    backend, device = tool_backend(cfg.device, 0)
    check_value_dim(backend, cfg.head_dim, cfg.value_dim)
    graphs = cfg.graph and backend.new_graph() is not None
    check_memory(backend, device, *estimate_decode_bytes(cfg, device, graphs))
    clock = Clock(backend, device)
    report: dict[str, Any] = {"meta": meta(cfg, backend, device), "timing": [], "memory": [], "graph": None,
                              "decode": [], "chunk": []}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    for seq in cfg.seqs:
        for world in cfg.worlds:
            step = _figure(cfg, backend, clock, device, seq, world, report)
            work.append((f"decode L={seq} P={world}" + (f" chunk {cfg.chunk}" if cfg.chunk else ""), step))
    return run_work(work, report, progress, checkpoint)


def _figure(cfg: BenchConfig, backend, clock: Clock, device: torch.device, seq: int, world: int,
            report: dict[str, Any]) -> Callable[[], None]:  # fmt: skip
    def step() -> None:
        measure_decode(cfg, backend, clock, device, seq, world, report)

    return step


def rows_failed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a ``--decode`` report whose checks failed (or whose tokens per rank are off)."""
    failed = [r for r in report.get("decode") or [] if not (row_checks_ok(r) and r.get("tokens_ok", True))]
    return failed + [r for r in report.get("chunk") or [] if not row_checks_ok(r, CHUNK_RUNS)]


def row_checks_ok(r: dict[str, Any], runs: tuple[str, ...] = DECODE_RUNS) -> bool:
    """The row's checks in ``runs`` passed (a check not made counts as passed)."""
    return all(r.get(f"{m}_check_ok", True) for m in runs)


def _ms(r: dict[str, Any], key: str) -> str:
    value = r.get(key)
    return "-" if value is None else f"{value * 1e3:.3f}"


def _x(r: dict[str, Any], key: str) -> str:
    value = r.get(key)
    return "-" if value is None else f"{value:.3f}"


def format_decode(report: dict[str, Any]) -> str:
    """The ``--decode`` report: the header, the decode table, the per-rank table, the chunk table."""
    rows, chunks = report["decode"], report.get("chunk") or []
    c = report["meta"]["config"]
    lines = header(report)
    if not rows:
        return "\n".join(lines)
    kernel = rows[0].get("sdpa_kernel") or "its choice"
    flash = any(r["flash"] for r in rows)
    lines += [
        "",
        *wrap(
            f"decode over a sharded KV cache (xcp.KVCache with capacity L + steps + chunks): one step = every rank "
            f"appends the same token of each of the {c['batch']} sequences, attends the same query over its own "
            f"tokens, and the ranks combine (one all-gather, the merge); xcp over P virtual ranks on one device "
            f"against one whole-cache call on one device (append + attention): torch SDPA (default dispatch: "
            f"{kernel}; enable_gqa)"
            + (" and the aten flash varlen op with seqused_k on the device" if flash else "")
            + f". Every rank's output checked against SDPA first (relative error ≤ {rows[0]['tolerance']:.0e}), "
            f"the replayed ones too; median of {c['reps']} after {c['warmup']} warm-up, interleaved. Replayed: "
            "xcp's step captured once as one device graph holding every rank's work, each replay appending one "
            "more token (device time without the host); SDPA's graph attends at one length. Eager, each step's "
            "new length makes a cuDNN kernel build a new plan (SDPA's eager figure is mostly that); eager xcp is "
            "P Python threads launching for one device: its replayed figure is the one to read"
        ),
        "",
        f"{'L':>8} {'P':>3} | {'eager ms: SDPA':>14} {'flash':>7} {'xcp':>7} {'xcp/SDPA':>8} {'xcp/flash':>9} | "
        f"{'replayed ms: SDPA':>17} {'flash':>7} {'xcp':>7} {'xcp/SDPA':>8} {'xcp/flash':>9} | check",
    ]
    for r in rows:
        eager = (f"{_ms(r, 'eager_sdpa_s'):>14} {_ms(r, 'eager_flash_s'):>7} {_ms(r, 'eager_xcp_s'):>7} "
                 f"{_x(r, 'eager_xcp_over_sdpa'):>8} {_x(r, 'eager_xcp_over_flash'):>9}")  # fmt: skip
        if "replay" in r:
            replayed = f"{r['replay']:<53}"
        else:
            replayed = (f"{_ms(r, 'replay_sdpa_s'):>17} {_ms(r, 'replay_flash_s'):>7} {_ms(r, 'replay_xcp_s'):>7} "
                        f"{_x(r, 'replay_xcp_over_sdpa'):>8} {_x(r, 'replay_xcp_over_flash'):>9}")  # fmt: skip
        lines.append(f"{r['seq']:>8} {r['world']:>3} | {eager} | {replayed} | {check_text(r, DECODE_RUNS)}")
    lines += [
        "",
        *wrap(
            "per rank: host µs of one decode step (the rank thread's CPU clock over its fork, append, attention "
            "and combine — LocalWorld's all-gather launches P-1 copies per rank —, mean over ranks, median over the "
            "timed eager steps; kernels launch asynchronously on a device, on the CPU they run inside it); the "
            "bytes of K/V its cache holds (KVCache.nbytes, the largest rank) beside the whole cache's over P; the "
            "tokens each rank holds at the end (within one of each other, summing to the cache's)"
        ),
        "",
        f"{'L':>8} {'P':>3} | {'host µs/step':>12} | {'cache/rank':>11} {'whole/P':>11} | tokens per rank",
    ]
    for r in rows:
        held = r["tokens_per_rank"]
        tokens = f"{min(held)}..{max(held)} of {r['tokens']}" + ("" if r.get("tokens_ok", True) else " FAIL")
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} | {r['host_step_us']:>12.1f} | {human_bytes(max(r['cache_bytes'])):>11} "
            f"{human_bytes(r['whole_cache_bytes_per_rank']):>11} | {tokens}"
        )
    if chunks:
        ref = "aten flash varlen, causal bottom-right, seqused_k" if chunks[0]["reference"] != "sdpa" else (
            "torch SDPA under the causal mask aligned bottom-right")  # fmt: skip
        lines += [
            "",
            *wrap(
                f"chunk of T tokens appended after the cached ones (query i of the chunk sees every cached token and "
                f"the chunk's first i + 1): xcp over P virtual ranks (append + attention + combine, eager: chunks "
                f"take the host path) against one whole-cache call with the same mask ({ref}; append + attention), "
                f"checked first; each timed call appends T more tokens"
            ),
            "",
            f"{'L':>8} {'P':>3} {'T':>6} {'cached':>8} | {'ref ms':>8} {'xcp ms':>8} {'xcp/ref':>7} | check",
        ]
        for r in chunks:
            lines.append(
                f"{r['seq']:>8} {r['world']:>3} {r['chunk']:>6} {r['cached']:>8} | {_ms(r, 'chunk_ref_s'):>8} "
                f"{_ms(r, 'chunk_xcp_s'):>8} {r['chunk_ratio']:>7.3f} | {check_text(r, CHUNK_RUNS)}"
            )
    return "\n".join(lines)
