"""``xcp bench --serve``: a ragged decode step over :class:`xcp.PagedKVCache` s of P virtual ranks on one device
against one whole-batch paged call over the same tokens on one device; a step mixing a prefill chunk with
decodes; memory over many steps with requests coming and going; the bytes each rank holds and moves.

Requests' lengths follow a long tail from ``MIN`` to ``MAX`` tokens summing to about ``TOTAL``
(:func:`long_tail`: the shortest and the longest included, most requests short). Every figure is checked
before it is timed: xcp's outputs (every rank's) against the whole-batch call's, and that call against float64
attention over each request's tokens.

- decode: every request appends one token and attends over its history. xcp: :class:`xcp.PagedDecode` on every
  rank (its step planned on the host into buffers on the device; the slots written, the rank's partial through
  the backend's ``forward_paged``, the combine), eager, and captured once per padded batch size into ONE device
  graph holding every rank's work, replayed after each plan. The yardstick (:mod:`.serve_yardstick`): what a user
  would call instead, every request's tokens on one device, its step the new tokens written and ONE whole-batch
  call: on CUDA the aten flash varlen op with ``seqused_k`` over the tokens stored contiguously, or its paged form
  (``block_table``) where this torch has it and the blocks hold a multiple of 256 rows; elsewhere the backend's
  ``forward_paged`` over one pool; eager and replayed likewise;
- mixed: the longest request's next prefill chunk of ``CHUNK`` tokens beside the others' decode steps, through
  :meth:`xcp.PagedKVCache.append` and ``attention`` on every rank (eager: chunks take the host-planned path)
  against one whole-batch call of the yardstick with the causal mask aligned bottom-right;
- memory: ``STEPS`` replayed decode steps, a request leaving (its blocks freed) and another joining (a short
  prompt appended) every few steps; the device's allocated bytes after each, flat when graph replays and the
  fixed pools allocate nothing.

Times are medians of device-drained wall times, the contenders interleaved; ratios are xcp over the yardstick.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from typing import Any

import torch

from ...comm import LocalWorld
from ...inference.paged import PagedKVCache, reads_decode_in_place
from ...inference.paged_decode import PagedDecode, decode_padding
from ...inference.plan import combine_bytes
from ...inference.serving import held
from ...kernels.merge import packed_layout
from ..common import DTYPES, Clock, default_device, error, human_bytes, median, tool_backend, write_json
from .report import wrap
from .serve_yardstick import FLASH_PAGED, FLAT, Flat, Whole, choose

__all__ = ["Whole", "Flat", "Ranks", "run_serve", "format_serve", "command"]

FLAG = "--serve"
HELP = (
    "instead of the ring figures: a ragged decode step of --serve-requests requests (lengths a long tail "
    "--serve-lengths MIN:MAX:TOTAL) over xcp.PagedKVCache on --serve-world virtual ranks (xcp.PagedDecode, eager "
    "and replayed as one device graph per padded batch size) against one whole-batch call over the same tokens on "
    "one device (on CUDA flash varlen with seqused_k over contiguous K/V, or its block_table form where torch has "
    "it and blocks are a multiple of 256 rows; elsewhere forward_paged over one pool); a step mixing a "
    "--serve-chunk prefill chunk with the other requests' decodes; device memory over --serve-steps replayed steps "
    "with requests coming and going; bytes per rank; every output checked first"
)
DEVICE_DEFAULTS = {"requests": 32, "lengths": (4096, 262144, 1_500_000), "world": 8, "block": 256, "chunk": 4096,
                   "steps": 1000, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}  # fmt: skip
"""The target sizes (an H200): 32 requests from 4K to 256K tokens, about 1.5M in all, 8 ranks, 32/8 heads, D 128."""
CPU_DEFAULTS = {"requests": 8, "lengths": (32, 1024, 3000), "world": 4, "block": 16, "chunk": 64, "steps": 40,
                "heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}  # fmt: skip
"""The same figures scaled down for a CPU."""
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Relative error allowed against float64, by dtype (a 16-bit output is rounded once, its inputs too)."""


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``--serve`` (their defaults: :data:`DEVICE_DEFAULTS` on a device, :data:`CPU_DEFAULTS` on cpu)."""
    p.add_argument(FLAG, action="store_true", help=HELP)
    p.add_argument("--serve-requests", type=int, default=None, metavar="N", help="requests of the batch (32; cpu 8)")
    p.add_argument("--serve-lengths", type=_lengths, default=None, metavar="MIN:MAX:TOTAL",
                   help="the requests' lengths: a long tail from MIN to MAX summing to about TOTAL "
                   "(4096:262144:1500000; cpu 32:1024:3000)")  # fmt: skip
    p.add_argument("--serve-world", type=int, default=None, metavar="P", help="virtual ranks (8; cpu 4)")
    p.add_argument("--serve-block", type=int, default=None, metavar="ROWS",
                   help="rows of a pool's block (256: the flash paged form's multiple; cpu 16)")  # fmt: skip
    p.add_argument("--serve-chunk", type=int, default=None, metavar="T", help="the mixed step's chunk (4096; cpu 64)")
    p.add_argument("--serve-steps", type=int, default=None, metavar="N",
                   help="steps of the memory figure (1000; cpu 40)")  # fmt: skip


def _lengths(text: str) -> tuple[int, int, int]:
    try:
        lo, hi, total = (int(t) for t in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX:TOTAL (integers); got {text!r}") from None
    if not 1 <= lo <= hi or total < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX and TOTAL >= MIN; got {text!r}")
    return lo, hi, total


def long_tail(n: int, lo: int, hi: int, total: int) -> list[int]:
    """``n`` lengths from ``lo`` to ``hi`` (both included for n > 1), ``lo * (hi/lo) ** (x ** a)`` at x = i/(n-1),
    the exponent a >= 1 found so that they sum to about ``total`` (most requests short, a few long); a total
    below what a = 64 gives takes that, one above the geometric spread's takes it."""
    if n == 1:
        return [min(hi, max(lo, total))]
    xs = [i / (n - 1) for i in range(n)]

    def lengths(a: float) -> list[int]:
        return [round(lo * (hi / lo) ** (x**a)) for x in xs]

    low, high = 1.0, 64.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(lengths(mid)) > total:
            low = mid
        else:
            high = mid
    return lengths(high)


def _defaults(args: argparse.Namespace, cpu: bool) -> dict[str, Any]:
    base = CPU_DEFAULTS if cpu else DEVICE_DEFAULTS
    given = {"requests": args.serve_requests, "lengths": args.serve_lengths, "world": args.serve_world,
             "block": args.serve_block, "chunk": args.serve_chunk, "steps": args.serve_steps, "heads": args.heads,
             "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}  # fmt: skip
    cfg: dict[str, Any] = {k: (base[k] if v is None else v) for k, v in given.items()}
    for name in ("requests", "world", "block", "chunk", "steps", "heads", "kv_heads", "head_dim"):
        if cfg[name] < 1:
            raise ValueError(f"--serve-{name}: expected an integer >= 1; got {cfg[name]}")
    if cfg["requests"] < 2:
        raise ValueError(f"--serve-requests: expected at least 2 (the mixed step's chunk and a decode); got "
                         f"{cfg['requests']}")  # fmt: skip
    if cfg["heads"] % cfg["kv_heads"]:
        raise ValueError(f"--heads: expected a multiple of --kv-heads {cfg['kv_heads']}; got {cfg['heads']}")
    cfg.update(warmup=args.warmup, reps=args.reps, graph=args.graph, device=args.device, seed=0)
    return cfg


# ---------------------------------------------------------------------------------------------- the contenders
class Ranks:
    """P virtual ranks on one device, each with its :class:`xcp.PagedKVCache` (one layer) and, after the prefill,
    its :class:`xcp.PagedDecode`; every rank's thread works on its own stream, forked from the caller's and joined
    back, so one device graph captured on the caller's stream holds every rank's step."""

    def __init__(self, backend, device: torch.device, world: int, num_blocks: int, block: int,
                 handoff: str | None = None) -> None:  # fmt: skip
        self.backend, self.device = backend, device
        self.world = LocalWorld(world, device=device)
        self.caches = [PagedKVCache(self.world.group(r), num_blocks=num_blocks, block_size=block, device=backend.name,
                                    handoff=handoff) for r in range(world)]  # fmt: skip
        self.streams = [backend.new_stream(device) for _ in range(world)]
        self.decodes: list[PagedDecode] = []

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank's thread and stream; the caller's stream waits for all of them."""
        be, main = self.backend, self.backend.current_stream(self.device)

        def rank(group) -> tuple[Any, Any]:
            r = group.rank()
            be.wait_stream(self.streams[r], main)
            with be.stream_context(self.streams[r]):
                return self.streams[r], fn(r)

        results = self.world.run(rank)
        for stream, _ in results:
            be.wait_stream(main, stream)
        return [out for _, out in results]

    def append(self, ids: list, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> None:
        self.run(lambda r: self.caches[r].append(ids, k, v, cu))

    def attention(self, q: torch.Tensor, ids: list, cu: list[int]) -> list[torch.Tensor]:
        return self.run(lambda r: self.caches[r].attention(q, ids, cu))

    def start_decoding(self, max_batch: int, max_len: int) -> None:
        self.decodes = [PagedDecode(c, max_batch=max_batch, max_len=max_len) for c in self.caches]

    def plan(self, ids: list) -> int:
        """Every rank's plan, from the caller's thread (host work and copies on the caller's stream alone)."""
        sizes = {d.plan(ids) for d in self.decodes}
        assert len(sizes) == 1
        return sizes.pop()

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return self.run(lambda r: self.decodes[r].step(q, k, v))

    def free(self, seq_id: Any) -> None:
        for c in self.caches:
            c.free(seq_id)

    def close(self) -> None:
        self.world.close()


# ---------------------------------------------------------------------------------------------- the figures
class Workload:
    """The requests' tokens, drawn on the device from one generator: each request's keys and values for every
    position it reaches, and its queries from its prompt's end on (the only ones attended)."""

    def __init__(self, cfg: dict[str, Any], device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.dtype = DTYPES[cfg["dtype"]]
        self.gen = torch.Generator(device=device).manual_seed(cfg["seed"])
        self.tokens: dict[int, tuple[int, list[torch.Tensor]]] = {}  # id -> (first query's position, [q, k, v])

    def new(self, seq_id: int, prompt: int, extra: int) -> None:
        """Tokens of a request of a ``prompt`` that grows by at most ``extra`` more."""
        h, hkv, d = self.cfg["heads"], self.cfg["kv_heads"], self.cfg["head_dim"]
        shapes = ((extra, h), (prompt + extra, hkv), (prompt + extra, hkv))
        self.tokens[seq_id] = (prompt, [torch.randn(n, heads, d, generator=self.gen, device=self.device,
                                                    dtype=self.dtype) for n, heads in shapes])  # fmt: skip

    def rows(self, ids: list, starts: list[int], counts: list[int], which: int) -> torch.Tensor:
        """Rows ``starts[i] .. starts[i] + counts[i] - 1`` (positions) of each request's q (0), k (1) or v (2)."""
        parts = []
        for i, s, n in zip(ids, starts, counts):
            first, x = self.tokens[i]
            at = s - first if which == 0 else s
            parts.append(x[which][at : at + n])
        return torch.cat(parts)


SAMPLED_ROWS = 64
"""The rows of a long chunk checked against float64 (spread over it, its first and last included): a whole
4096-token chunk over 100K+ keys in float64 would take more memory than the device has for scores."""


def sampled_rows(t: int) -> list[int]:
    """The rows of a chunk of ``t`` queries that are checked against float64: all of them up to
    :data:`SAMPLED_ROWS`, else that many spread evenly."""
    if t <= SAMPLED_ROWS:
        return list(range(t))
    return sorted({round(i * (t - 1) / (SAMPLED_ROWS - 1)) for i in range(SAMPLED_ROWS)})


def _float64_rows(work: Workload, ids: list, lengths: list[int], counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """float64 attention, causal, on the device, of each request's newest ``counts[i]`` queries (the
    :func:`sampled_rows` of each) over its first ``lengths[i]`` tokens; and those rows' indices in the packed
    batch."""
    outs, packed, at = [], [], 0
    for i, n, t in zip(ids, lengths, counts):
        rows = sampled_rows(t)
        first, (q, k, v) = work.tokens[i]
        k, v = (x[:n].double() for x in (k, v))
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        at_rows = torch.tensor(rows, device=q.device) + (n - t)
        mask = torch.arange(n, device=q.device)[None] <= at_rows[:, None]
        qs = q[at_rows - first].double().transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        outs.append(o.transpose(0, 1))
        packed += [at + r for r in rows]
        at += t
    return torch.cat(outs), packed


def _worst(outs: list[torch.Tensor], ref: torch.Tensor) -> float:
    return max(error(o, ref).rel for o in outs)


def run_serve(cfg: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """The figures of ``--serve``; a JSON-ready dict."""
    backend, device = tool_backend(cfg["device"], 0)
    dtype = DTYPES[cfg["dtype"]]
    n, (lo, hi, total) = cfg["requests"], cfg["lengths"]
    lengths = long_tail(n, lo, hi, total)
    p, block, chunk, steps = cfg["world"], cfg["block"], cfg["chunk"], cfg["steps"]
    timed = cfg["warmup"] + cfg["reps"]
    # decode tokens a request takes beyond its prompt: the checked step, the eager rounds, 2 checked replays, the
    # replayed rounds, the mixed step's (checked and timed), the memory figure's steps
    grows = 1 + timed + 2 + timed + 1 + timed + steps
    max_len = hi + grows + chunk * (1 + timed)
    per_rank = sum(-(-held(x + grows, p, 0) // block) for x in lengths) + n + chunk * (1 + timed) // block + 4
    whole_blocks = sum(-(-(x + grows) // block) for x in lengths) + n + chunk * (1 + timed) // block + 4
    clock = Clock(backend, device)
    work = Workload(cfg, device)
    report: dict[str, Any] = {"config": {**cfg, "lengths": lengths, "tokens": sum(lengths), "backend": backend.name,
                                         "device_name": _device_name(device), "torch": torch.__version__}}  # fmt: skip
    say = print if progress else (lambda *a, **k: None)
    ranks = Ranks(backend, device, p, per_rank, block)
    kind = choose(device, dtype, cfg["head_dim"], block)
    whole: Whole | Flat
    if kind != FLAT:
        whole = Whole(backend, whole_blocks, block, flash_paged=kind == FLASH_PAGED)
    else:  # every request's region, the chunks', and the memory figure's joining requests' (at most)
        joining = (steps // 8) * (max(1, lo // 4) + steps + 2)
        whole = Flat(sum(x + grows for x in lengths) + chunk * (1 + timed) + joining, cfg["kv_heads"],
                     cfg["head_dim"], dtype, device)  # fmt: skip
    report["config"]["yardstick"] = whole.label
    ids = list(range(n))
    chunked = ids[-1]  # the longest request: its prompt goes on in the mixed step's chunks
    for i, x in zip(ids, lengths):
        extra = grows + (chunk * (1 + timed) if i == chunked else 0)
        work.new(i, x, extra)
        whole.reserve(i, x + extra)
    say(f"serve: prefilling {sum(lengths)} tokens of {n} requests over {p} ranks and the yardstick ({whole.label})")
    for i, x in zip(ids, lengths):  # one request at a time: the host plans of long prompts stay small
        k, v = work.tokens[i][1][1][:x], work.tokens[i][1][2][:x]
        ranks.append([i], k, v, [0, x])
        whole.append([i], k, v, [0, x])
    ranks.start_decoding(n, max_len)
    report["config"]["xcp_pools"] = _pools_read(backend, ranks.caches[0], work.tokens[ids[0]][1][0][:1])
    whole.start_decoding(n, max_len)
    length = dict(zip(ids, lengths))
    graphs = cfg["graph"] and backend.new_graph() is not None

    def inputs(batch: int, order: list) -> list[torch.Tensor]:
        rows = [work.rows(order, [length[i] for i in order], [1] * len(order), j) for j in range(3)]
        return decode_padding(batch, *rows)

    def plan(order: list) -> int:
        b = ranks.plan(order)
        whole.plan(order, b)
        return b

    def advance(order: list) -> None:
        for i in order:
            length[i] += 1

    # ---- decode: checked, then timed eager and replayed
    order = ids[:]
    b = plan(order)
    q, k, v = inputs(b, order)
    outs, ref = ranks.step(q, k, v), whole.step(q, k, v)
    advance(order)
    want, _ = _float64_rows(work, order, [length[i] for i in order], [1] * n)
    row: dict[str, Any] = {"batch": n, "padded": b, "tokens": sum(length.values())}
    padded = max(o[n:].abs().max().item() if b > n else 0.0 for o in outs)
    mine = [o[:n] for o in outs]
    row["errors"] = {"xcp": _worst(mine, ref[:n]), "whole_vs_float64": error(ref[:n], want).rel,
                     "xcp_vs_float64": _worst(mine, want), "padded_rows_zero": float(padded)}  # fmt: skip
    tol = TOLERANCE[dtype]
    row["check_ok"] = all(math.isfinite(e) and e <= tol for e in row["errors"].values())
    say(f"serve: decode checked ({'ok' if row['check_ok'] else 'FAIL'}): {row['errors']}")
    del outs, ref

    def eager_pair() -> dict[str, Callable[[], Any]]:
        state: dict[str, Any] = {}

        def prepare() -> None:
            plan(order)
            state["x"] = inputs(b, order)

        return {"prepare": prepare, "whole": lambda: whole.step(*state["x"]), "xcp": lambda: ranks.step(*state["x"]),
                "after": lambda: advance(order)}  # fmt: skip

    row.update(_timed(cfg, clock, eager_pair(), "eager"))
    if graphs:
        row.update(_replayed(cfg, backend, clock, ranks, whole, plan, inputs, advance, order, work, length, tol))
    else:
        row["replay"] = "left out (--no-graph)" if not cfg["graph"] else f"no graphs on {device.type}"
    packed, channels = packed_layout(dtype, cfg["head_dim"])  # one all-gather of the packed partials
    shape = (1, b, cfg["heads"], channels, packed.itemsize)
    row["combine_sent_per_rank"], row["combine_received_per_rank"] = (combine_bytes(p - 1, *shape),
                                                                      combine_bytes(p, *shape))  # fmt: skip
    row["pool_bytes_per_rank"] = [_pool_bytes(c) for c in ranks.caches]
    row["whole_pool_bytes"] = whole.nbytes()
    row["tokens_per_rank"] = [sum(c.local_len(i) for i in c.seq_ids()) for c in ranks.caches]
    report["decode"] = row

    # ---- mixed: one request's chunk beside the others' decodes (eager, host-planned)
    report["mixed"] = _mixed(cfg, clock, ranks, whole, work, length, order, chunked, tol, say)

    # ---- memory: replayed steps with requests coming and going
    report["memory"] = _memory(cfg, backend, device, ranks, whole, work, length, order, plan, inputs, advance, say)
    ranks.close()
    return report


def _pools_read(backend, cache: PagedKVCache, q: torch.Tensor) -> str:
    """How a rank's partial reads its pool: in place for every call, for the decode calls alone, or gathered."""
    k, v = cache._k, cache._v
    assert k is not None and v is not None
    if backend.paged_in_place(q, k, v):
        return "in place (every call)"
    if reads_decode_in_place(backend, q, k, v):
        return "in place for decode calls (one query per segment); a chunk's sequence gathered"
    return "gathered"


def _pool_bytes(cache: PagedKVCache) -> int:
    k, v = cache._k, cache._v
    if k is None or v is None:
        return 0
    return k.numel() * k.element_size() + (0 if v.data_ptr() == k.data_ptr() else v.numel() * v.element_size())


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    return torch.get_device_module(device.type).get_device_name(device)


def _timed(cfg: dict[str, Any], clock: Clock, pair: dict[str, Callable[[], Any]], run: str) -> dict[str, Any]:
    """``whole`` and ``xcp`` of ``pair`` timed interleaved (``prepare`` untimed before each round, ``after`` after
    it): medians and the ratio, as ``{run}_whole_s``, ``{run}_xcp_s``, ``{run}_ratio``."""
    times: dict[str, list[float]] = {"whole": [], "xcp": []}
    for i in range(cfg["warmup"] + cfg["reps"]):
        pair["prepare"]()
        for name in ("whole", "xcp"):
            seconds = clock.time(pair[name])
            if i >= cfg["warmup"]:
                times[name].append(seconds)
        pair["after"]()
    whole_s, xcp_s = median(times["whole"]), median(times["xcp"])
    return {f"{run}_whole_s": whole_s, f"{run}_xcp_s": xcp_s, f"{run}_ratio": xcp_s / whole_s}


def _replayed(cfg, backend, clock, ranks: Ranks, whole: Whole | Flat, plan, inputs, advance, order, work, length, tol):
    """xcp's step (every rank's) and the yardstick's captured once at this padded size and replayed: checked on
    two replays (new tokens each, against float64), then timed interleaved."""
    b = plan(order)
    static = inputs(b, order)  # the graphs' inputs: refilled before each replay
    g_whole, g_xcp = backend.new_graph(), backend.new_graph()
    with backend.capture_graph(g_whole):
        whole_out = whole.step(*static)
    with backend.capture_graph(g_xcp):
        xcp_outs = ranks.step(*static)
    n = len(order)
    errors: dict[str, float] = {}
    for rep in range(2):
        if rep:
            b = plan(order)
            for x, new in zip(static, inputs(b, order)):
                x.copy_(new)
        g_whole.replay()
        g_xcp.replay()
        advance(order)
        want, _ = _float64_rows(work, order, [length[i] for i in order], [1] * n)
        errors[f"replay{rep + 1}_xcp_vs_whole"] = _worst([o[:n] for o in xcp_outs], whole_out[:n])
        errors[f"replay{rep + 1}_xcp_vs_float64"] = _worst([o[:n] for o in xcp_outs], want)
    out: dict[str, Any] = {"replay_errors": errors,
                           "replay_check_ok": all(math.isfinite(e) and e <= tol for e in errors.values())}  # fmt: skip

    def prepare() -> None:
        plan(order)
        for x, new in zip(static, inputs(b, order)):
            x.copy_(new)

    pair = {"prepare": prepare, "whole": g_whole.replay, "xcp": g_xcp.replay, "after": lambda: advance(order)}
    out.update(_timed(cfg, clock, pair, "replay"))
    out["graphs"] = (g_whole, g_xcp)
    return out


def _mixed(cfg, clock, ranks: Ranks, whole: Whole | Flat, work: Workload, length: dict, order: list, chunked, tol,
           say) -> dict:  # fmt: skip
    """A chunk of ``cfg["chunk"]`` tokens of request ``chunked`` (the longest: a long prompt's next chunk) beside
    one decode token of each other, appended and attended by xcp (eager, host-planned) and by one whole-batch
    causal ``forward_paged`` call."""
    t = cfg["chunk"]
    ids = [chunked] + [i for i in order if i != chunked]
    counts = [t] + [1] * (len(ids) - 1)
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)

    def tensors() -> list[torch.Tensor]:
        return [work.rows(ids, [length[i] for i in ids], counts, j) for j in range(3)]

    def append_both(q_k_v: list[torch.Tensor]) -> None:
        ranks.append(ids, q_k_v[1], q_k_v[2], cu)
        whole.append(ids, q_k_v[1], q_k_v[2], cu)
        for i, c in zip(ids, counts):
            length[i] += c

    x = tensors()
    append_both(x)
    outs = ranks.attention(x[0], ids, cu)
    ref = whole.mixed(x[0], ids, cu)
    want, rows = _float64_rows(work, ids, [length[i] for i in ids], counts)
    row: dict[str, Any] = {"chunk": t, "decodes": len(ids) - 1, "chunk_request_length": length[chunked],
                           "float64_rows_checked": len(rows)}  # fmt: skip
    row["errors"] = {"xcp": _worst(outs, ref), "whole_vs_float64": error(ref[rows], want).rel,
                     "xcp_vs_float64": _worst([o[rows] for o in outs], want)}  # fmt: skip
    row["check_ok"] = all(math.isfinite(e) and e <= tol for e in row["errors"].values())
    say(f"serve: mixed checked ({'ok' if row['check_ok'] else 'FAIL'}): {row['errors']}")
    del outs, ref
    state: dict[str, Any] = {}

    def prepare() -> None:
        state["x"] = tensors()
        ranks.append(ids, state["x"][1], state["x"][2], cu)
        whole.append(ids, state["x"][1], state["x"][2], cu)

    def after() -> None:
        for i, c in zip(ids, counts):
            length[i] += c

    pair = {"prepare": prepare, "whole": lambda: whole.mixed(state["x"][0], ids, cu),
            "xcp": lambda: ranks.attention(state["x"][0], ids, cu), "after": after}  # fmt: skip
    row.update(_timed(cfg, clock, pair, "eager"))
    return row


def _memory(cfg, backend, device, ranks: Ranks, whole: Whole | Flat, work: Workload, length: dict, order: list, plan,
            inputs, advance, say) -> dict:  # fmt: skip
    """``cfg["steps"]`` decode steps (replayed where graphs exist, one graph per padded size met), every 8th step a
    request leaving and a new one joining with a short prompt; the device's allocated bytes after each step. The
    joining requests' tokens are drawn before the first step and the leaving ones' kept to the end, so that the
    workload's own tensors hold the same bytes throughout and only xcp's and the pools' can change."""
    rng = random.Random(cfg["seed"])
    graphs: dict[int, tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = {}
    use_graphs = cfg["graph"] and backend.new_graph() is not None
    next_id, allocated, warm = max(order) + 1, [], set()
    joining = [rng.randint(1, max(1, cfg["lengths"][0] // 4)) for _ in range(cfg["steps"] // 8)]
    for j, prompt in enumerate(joining):
        work.new(next_id + j, prompt, cfg["steps"] + 2)
        whole.reserve(next_id + j, prompt + cfg["steps"] + 2)
    active = list(order)
    replays = 0
    for step in range(cfg["steps"]):
        if step % 8 == 7 and len(active) > 1:  # one leaves, one joins
            gone = active.pop(rng.randrange(len(active)))
            ranks.free(gone)
            whole.free(gone)
            del length[gone]
            prompt = joining[step // 8]
            k, v = work.tokens[next_id][1][1][:prompt], work.tokens[next_id][1][2][:prompt]
            ranks.append([next_id], k, v, [0, prompt])
            whole.append([next_id], k, v, [0, prompt])
            length[next_id] = prompt
            active.append(next_id)
            next_id += 1
        b = plan(active)
        x = inputs(b, active)
        if use_graphs and b in graphs:
            graph, static, _ = graphs[b]
            for s, new in zip(static, x):
                s.copy_(new)
            graph.replay()
            replays += 1
        elif use_graphs and b in warm:  # a size met before: captured now (the capture runs nothing), replayed
            graph = backend.new_graph()
            with backend.capture_graph(graph):
                outs = ranks.step(*x)
            graph.replay()
            graphs[b] = (graph, x, outs)
        else:  # a size met first: eagerly, which builds its kernels before any capture
            ranks.step(*x)
            warm.add(b)
        advance(active)
        backend.synchronize(device)
        stats = backend.memory_stats(device)
        if stats is not None:
            allocated.append(stats["allocated"])
    row: dict[str, Any] = {"steps": cfg["steps"], "replays": replays, "graphs": sorted(graphs),
                           "requests_seen": next_id, "active_at_end": len(active)}  # fmt: skip
    if allocated:
        settled = allocated[len(allocated) // 10 :]  # after the first captures
        row.update(first=allocated[0], low=min(settled), high=max(settled), last=allocated[-1],
                   flat=max(settled) - min(settled) <= 1 << 20)  # fmt: skip
        say(f"serve: memory over {cfg['steps']} steps: {human_bytes(min(settled))} .. {human_bytes(max(settled))}")
    else:
        row["flat"] = None
    return row


# ---------------------------------------------------------------------------------------------- report
def format_serve(report: dict[str, Any]) -> str:
    c, d, m, mem = report["config"], report["decode"], report["mixed"], report["memory"]
    lines = [
        f"xcp bench --serve on {c['device_name']} (backend {c['backend']}, torch {c['torch']}): {c['requests']} "
        f"requests, {c['tokens']} tokens (long tail {min(c['lengths'])}..{max(c['lengths'])}), {c['world']} virtual "
        f"ranks, heads {c['heads']}/{c['kv_heads']}, D {c['head_dim']}, {c['dtype']}, blocks of {c['block']} rows; "
        f"xcp's pools {c.get('xcp_pools', '?')}",
        *wrap(
            "decode: every request appends one token and attends over its history; xcp = xcp.PagedDecode on every "
            "rank (the slots written, forward_paged over the rank's blocks, the combine); whole = every request's "
            f"tokens on one device, the new ones written and ONE call over the batch: {c.get('yardstick', '?')}. "
            "Checked first (relative error; "
            "padded rows must be 0); medians of device-drained wall time, interleaved; replayed: each captured once "
            "as a device graph (xcp's holds every rank's work)"
        ),
        "",
        f"{'figure':<16} {'whole ms':>9} {'xcp ms':>9} {'xcp/whole':>9} | check",
    ]
    lines.append(f"{'decode eager':<16} {d['eager_whole_s'] * 1e3:>9.3f} {d['eager_xcp_s'] * 1e3:>9.3f} "
                 f"{d['eager_ratio']:>9.3f} | {_check(d['check_ok'], d['errors'])}")  # fmt: skip
    if "replay_ratio" in d:
        lines.append(f"{'decode replayed':<16} {d['replay_whole_s'] * 1e3:>9.3f} {d['replay_xcp_s'] * 1e3:>9.3f} "
                     f"{d['replay_ratio']:>9.3f} | {_check(d['replay_check_ok'], d['replay_errors'])}")  # fmt: skip
    else:
        lines.append(f"{'decode replayed':<16} {d.get('replay', '-')}")
    lines.append(f"{'mixed eager':<16} {m['eager_whole_s'] * 1e3:>9.3f} {m['eager_xcp_s'] * 1e3:>9.3f} "
                 f"{m['eager_ratio']:>9.3f} | {_check(m['check_ok'], m['errors'])}  (chunk {m['chunk']} + "
                 f"{m['decodes']} decodes)")  # fmt: skip
    lines += [
        "",
        f"bytes per rank: pool {human_bytes(max(d['pool_bytes_per_rank']))} (the yardstick's K/V "
        f"{human_bytes(d['whole_pool_bytes'])} / {c['world']} = {human_bytes(d['whole_pool_bytes'] / c['world'])}); "
        f"tokens per rank {min(d['tokens_per_rank'])}..{max(d['tokens_per_rank'])}; a decode step's combine sends "
        f"{human_bytes(d['combine_sent_per_rank'])} and gathers {human_bytes(d['combine_received_per_rank'])}",
    ]
    if mem.get("flat") is None:
        lines.append(f"memory: {mem['steps']} steps, no memory statistics on this device")
    else:
        lines.append(
            f"memory over {mem['steps']} steps ({mem['replays']} replays, graphs for sizes {mem['graphs']}, "
            f"{mem['requests_seen']} requests seen): allocated {human_bytes(mem['low'])} .. {human_bytes(mem['high'])} "
            f"after the first tenth, last {human_bytes(mem['last'])}: {'flat' if mem['flat'] else 'NOT FLAT'}"
        )
    return "\n".join(lines)


def _check(ok: bool, errors: dict[str, float]) -> str:
    return f"{'ok' if ok else 'FAIL'} (worst {max(errors.values()):.1e})"


def failed(report: dict[str, Any]) -> bool:
    d, m, mem = report["decode"], report["mixed"], report["memory"]
    return not (d["check_ok"] and d.get("replay_check_ok", True) and m["check_ok"] and mem.get("flat") is not False)


def command(args: argparse.Namespace) -> int:
    """``xcp bench --serve``: the figures, the table, the JSON; exit status 1 when a check failed."""
    default_device(args)
    _, device = tool_backend(args.device, 0)
    cfg = _defaults(args, device.type == "cpu")
    report = run_serve(cfg, progress=not args.quiet)
    report["decode"].pop("graphs", None)
    print(format_serve(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    return 1 if failed(report) else 0
