"""What the tools share about inference over a sharded KV cache (:class:`xcp.KVCache`): the ``--decode`` and
``--chunk`` flags, ``xcp run --decode N`` and ``xcp plan --decode``.

``xcp run --decode N`` prefills a prompt of ``--seq`` tokens through the ring (``xcp.attention``) and keeps
each rank's shard in a cache (``KVCache.prefill``), then runs N decode steps (append one token, attend over
the cache) and one chunk of ``--chunk`` tokens (chunked prefill), checking every step's output on every rank
against float64 attention over the whole sequence, on a LocalWorld or under torchrun, so that a user sees on
their own device that the sharded cache is exact before they serve with it.

``xcp plan --decode`` prints, for the same steps, what :mod:`xcp.inference.plan` says without running anything:
the tokens each rank holds, the kernel calls of each rank's local partial, and the bytes of the combine
(:func:`xcp.inference.plan.combine_traffic`).
"""

from __future__ import annotations

import argparse
import math
import textwrap
from dataclasses import dataclass, field

import torch

from .. import schedule
from ..api import attention, shard, unshard
from ..comm import LocalWorld, resolve_group
from ..inference import plan as cache_plan
from ..inference.cache import KVCache
from ..kernels.merge import packed_layout
from ..testing.reference import sdpa_reference
from . import windows
from .common import (
    DTYPES,
    REL_TOLERANCE,
    Error,
    Problem,
    error,
    gather_whole,
    head_dims_text,
    human_bytes,
    join_process_group,
    random_inputs,
    tool_backend,
    under_torchrun,
)

FLAG = "--decode"
CHUNK_FLAG = "--chunk"
DEFAULT_CHUNK = 7
"""The chunk's tokens by default: odd, so that its pieces differ in size across ranks."""
WIDTH = 100
"""Columns the plan's text keeps within."""
CHUNK_HELP = f"with {FLAG}: the tokens of the one chunk appended after the decode steps (0: none)"


def steps(decode: int, chunk: int) -> list[tuple[str, int]]:
    """``(name, T)`` of each append: ``decode 1 .. decode N`` of one token, then ``chunk`` of ``chunk`` tokens."""
    return [(f"decode {i + 1}", 1) for i in range(decode)] + ([("chunk", chunk)] if chunk else [])


def check_flags(decode: int, chunk: int) -> None:
    """A ValueError naming the flag unless ``--decode N`` and ``--chunk T`` are >= 0 and give a step to run."""
    for flag, value in ((FLAG, decode), (CHUNK_FLAG, chunk)):
        if value < 0:
            raise ValueError(f"{flag}: expected an integer >= 0; got {value}")
    if not decode and not chunk:
        raise ValueError(f"{FLAG}: expected a step to run ({FLAG} N >= 1 or {CHUNK_FLAG} T >= 1); got {FLAG} 0 "
                         f"{CHUNK_FLAG} 0")  # fmt: skip


# ---------------------------------------------------------------------------------------- xcp run --decode
@dataclass
class DecodeConfig(Problem):
    """``xcp run --decode``: a prompt of ``seq`` tokens over ``world`` ranks, ``decode`` steps, one chunk."""

    world: int = 4
    seq: int = 3072
    decode: int = 8
    chunk: int = DEFAULT_CHUNK
    seed: int = 0


@dataclass
class StepCheck:
    """One step: its name, its T, the tokens each rank holds after it, and its worst error over the ranks."""

    name: str
    tokens: int
    held: list[int]
    error: Error


@dataclass
class DecodeResult:
    """Every step's check, and the run's verdict (every step within the dtype's tolerance)."""

    config: DecodeConfig
    checks: list[StepCheck]
    mode: str
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = all(passes(c.error, self.config.dtype) for c in self.checks)

    def table(self) -> str:
        tol = REL_TOLERANCE[DTYPES[self.config.dtype]]
        lines = [_header(self.config, self.mode), *ABOUT_RUN]
        lines.append(f"{'step':<10}{'T':>6}{'max abs err':>14}{'rel err':>12}{'tolerance':>12}  result  tokens held "
                     "per rank")  # fmt: skip
        for check in self.checks:
            verdict = "ok" if passes(check.error, self.config.dtype) else "FAIL"
            lines.append(f"{check.name:<10}{check.tokens:>6}{check.error.max_abs:>14.3e}{check.error.rel:>12.3e}"
                         f"{tol:>12.1e}  {verdict:<8}{' '.join(map(str, check.held))}")  # fmt: skip
        lines.append("PASS" if self.ok else "FAIL: an error is above its tolerance")
        return "\n".join(lines)


ABOUT_RUN = (
    "the prompt runs through the ring (xcp.attention) and each rank keeps its shard (KVCache.prefill); each",
    "step appends T tokens (KVCache.append: each kept by one rank) and attends over the whole cache",
    "(KVCache.attention: each rank's local partial, one all-gather of [out | lse], the merge); every",
    "rank's output is checked against float64 attention over the whole sequence",
)


def _header(c: DecodeConfig, mode: str) -> str:
    return (f"xcp run --decode: {mode}, world {c.world}, batch {c.batch}, prompt {c.seq}, {c.decode} decode steps, "
            f"chunk {c.chunk}, heads {c.heads}/{c.kv_heads} kv, head_dim {c.dims_text()}, {c.dtype}, causal, balance "
            f"{c.balance}, device {c.device}")  # fmt: skip


def passes(err: Error, dtype: str) -> bool:
    """The run's rule: the relative error is finite and within the dtype's tolerance."""
    return math.isfinite(err.rel) and err.rel <= REL_TOLERANCE[DTYPES[dtype]]


def rank_decode(group, cfg: DecodeConfig, backend, full: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    """One rank's prefill through the ring, then every step on its cache; returns ``(the prefill's output
    shard, each step's output, the tokens held after the prefill and after each step)``."""
    world, r = group.size(), group.rank()
    q, k, v = full
    s = cfg.seq
    with torch.no_grad():
        q_l, k_l, v_l = (shard(x[:, :s], world, r, balance=cfg.balance) for x in (q, k, v))
        prefill = attention(q_l, k_l, v_l, causal=True, group=group, balance=cfg.balance, device=cfg.device)
        cache = KVCache(group=group, balance=cfg.balance, device=cfg.device)
        cache.prefill(k_l, v_l)
        held, outs = [cache.local_len], []
        for _, t in steps(cfg.decode, cfg.chunk):
            cache.append(k[:, s : s + t], v[:, s : s + t])
            s += t
            outs.append(cache.attention(q[:, s - t : s]))
            held.append(cache.local_len)
    return prefill, outs, held


def _step_errors(cfg: DecodeConfig, ref: torch.Tensor, prefill: torch.Tensor, outs: list[torch.Tensor]):
    """The error of the whole prefill output and of each step's output against the reference's rows."""
    errors, s = [error(prefill, ref[:, : cfg.seq])], cfg.seq
    for out, (_, t) in zip(outs, steps(cfg.decode, cfg.chunk)):
        s += t
        errors.append(error(out, ref[:, s - t : s]))
    return errors


def _checks(cfg: DecodeConfig, held: list[list[int]], errors: list[list[Error]]) -> list[StepCheck]:
    """Per step: the tokens each rank holds and the worst rank's error (``held[rank][step]``, alike errors;
    a failed check is worse than any passing one)."""
    names = [("prefill", cfg.seq), *steps(cfg.decode, cfg.chunk)]

    def badness(e: Error) -> tuple[bool, float]:
        return not passes(e, cfg.dtype), e.rel if math.isfinite(e.rel) else math.inf

    return [StepCheck(name, t, [h[i] for h in held], max((e[i] for e in errors), key=badness))
            for i, (name, t) in enumerate(names)]  # fmt: skip


def run_decode(cfg: DecodeConfig) -> DecodeResult:
    """``xcp run --decode`` on a LocalWorld of ``cfg.world`` virtual ranks, or on the torch.distributed world
    when torchrun started us."""
    if under_torchrun():
        return _run_distributed(cfg)
    backend, device = tool_backend(cfg.device)
    schedule.check_seq_len(cfg.seq, cfg.world, cfg.balance, what="--seq")
    full = _inputs(cfg, device)
    results = LocalWorld(cfg.world, device=device).run(rank_decode, cfg, backend, full)
    ref = sdpa_reference(*full, causal=True)
    prefill = unshard([r[0] for r in results], balance=cfg.balance)
    errors = [_step_errors(cfg, ref, prefill, r[1]) for r in results]
    return DecodeResult(cfg, _checks(cfg, [r[2] for r in results], errors), f"LocalWorld of {cfg.world} virtual ranks")


def _inputs(cfg: DecodeConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded q, k, v of the prompt and every appended token (the same on every rank of a device type)."""
    q, k, v, _ = random_inputs(cfg, cfg.seq + sum(t for _, t in steps(cfg.decode, cfg.chunk)), device, cfg.seed)
    return q, k, v


def _run_distributed(cfg: DecodeConfig) -> DecodeResult:
    import torch.distributed as dist

    backend, device, rank, world = join_process_group(cfg.device)
    cfg.world = world
    schedule.check_seq_len(cfg.seq, world, cfg.balance, what="--seq")
    full = _inputs(cfg, device)
    prefill, outs, held = rank_decode(resolve_group(None), cfg, backend, full)
    whole = gather_whole([prefill], world, cfg.balance)[0]
    ref = sdpa_reference(*full, causal=True)
    mine = torch.tensor([[h, *e] for h, e in zip(held, _step_errors(cfg, ref, whole, outs))], dtype=torch.float64,
                        device=device)  # fmt: skip
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    rows = [s.tolist() for s in every]
    return DecodeResult(
        cfg,
        _checks(cfg, [[int(x[0]) for x in r] for r in rows], [[Error(x[1], x[2]) for x in r] for r in rows]),
        f"torch.distributed ({dist.get_backend()}), rank {rank} of {world}",
    )


ONE_SEQUENCE = "a KV cache is one sequence over the ranks of its group"
"""Why a KV cache takes no ``--documents`` or ``--ulysses``."""


def typed(flag: str, value) -> str:
    """A flag as it was typed: ``--backward`` (a switch), ``--calls 3``, ``--documents 3,5`` (a parsed
    ``--documents`` shows its text)."""
    return flag if value is True else f"{flag} {getattr(value, 'text', value)}"


def check_alone(given) -> None:
    """A ValueError naming ``--decode`` and the first flag of ``given`` that the decode path does not take:
    each entry the flag, its value, its default (a value equal to it was left out, or changes nothing) and why
    a KV cache takes no such flag (None: :data:`ONE_SEQUENCE`)."""
    for flag, value, default, why in given:
        if value != default:
            raise ValueError(f"{FLAG}: expected no {flag} ({why or ONE_SEQUENCE}); got {typed(flag, value)}")


def check_needs_decode(given) -> None:
    """Without ``--decode``: a ValueError naming the first flag of ``given`` (the flag, its value, its default)
    whose value is not its default: only the decode path reads it."""
    for flag, value, default in given:
        if value != default:
            raise ValueError(f"{flag}: expected together with {FLAG} (only the decode path reads it); got "
                             f"{typed(flag, value)} without {FLAG}")  # fmt: skip


def check_causal(causal: bool) -> None:
    """A ValueError naming ``--decode`` and ``--no-causal``: the decode path attends causally."""
    if not causal:
        raise ValueError(f"{FLAG}: expected a causal mask (each token attends to the tokens before it); got "
                         "--no-causal")  # fmt: skip


def run_command(args: argparse.Namespace, problem: dict) -> int:
    """``xcp run --decode``: the flags checked, the run, its table; 0 when every step passes, else 1."""
    check_flags(args.decode, args.chunk)
    check_alone((("--documents", args.documents, None, None),))
    check_causal(args.causal)
    if args.ulysses != 1:
        raise ValueError(f"{FLAG}: expected --ulysses 1 (a KV cache is sharded over the ranks of its group, not "
                         f"over heads); got --ulysses {args.ulysses}")  # fmt: skip
    cfg = DecodeConfig(world=args.world, seq=args.seq or DecodeConfig.seq, decode=args.decode, chunk=args.chunk,
                       seed=args.seed, **problem)  # fmt: skip
    result = run_decode(cfg)
    print(result.table())
    return 0 if result.ok else 1


# ---------------------------------------------------------------------------------------- xcp plan --decode
@dataclass(frozen=True)
class PlannedStep:
    """One append and attention of a cache, planned: T, the tokens each rank holds after it, each rank's
    kernel calls, and the bytes each rank sends in the combine and receives into its buffers
    (:func:`xcp.inference.plan.combine_traffic`)."""

    name: str
    tokens: int
    seq_len: int
    held: tuple[int, ...]
    calls: tuple[int, ...]
    sends: int
    gathered: int


def plan_steps(world: int, prompt: int, decode: int, chunk: int, balance: str, heads: int, value_dim: int,
               dtype: torch.dtype, window: tuple | None = None, batch: int = 1) -> list[PlannedStep]:  # fmt: skip
    """What every rank's cache holds and does at each step (:mod:`xcp.inference.plan`, as :class:`xcp.KVCache`
    runs it): a prompt of ``prompt`` tokens prefilled (0: none), then :func:`steps`; causal attention of the
    last T queries, under ``window`` when given. A world of one makes its local calls and sends nothing.
    ``value_dim``: v's head dim, the partials' out's (what the combine sends)."""
    stored = [cache_plan.prefill_runs(prompt, world, r, balance) if prompt else () for r in range(world)]
    out, s = [], prompt
    for name, t in steps(decode, chunk):
        pieces = cache_plan.chunk_pieces(s, t, world)
        stored = [cache_plan.extend(runs, *piece) for runs, piece in zip(stored, pieces)]
        s += t
        calls = tuple(len(cache_plan.partial_calls(runs, s, t, True, window)) for runs in stored)
        held = tuple(sum(run.count for run in runs) for runs in stored)
        sends, gathered = cache_plan.combine_traffic(world, batch, t, heads, value_dim, dtype)
        out.append(PlannedStep(name, t, s, held, calls, sends, gathered))
    return out


def _per_rank(values: tuple[int, ...]) -> str:
    """Every rank's value up to 8 ranks; beyond, the range over ranks."""
    if len(values) <= 8:
        return " ".join(map(str, values))
    lo, hi = min(values), max(values)
    return f"{lo} (all)" if lo == hi else f"{lo}..{hi}"


def plan_lines(world: int, prompt: int, decode: int, chunk: int, balance: str, heads: int, kv_heads: int,
               head_dim: int, dtype: str, window: tuple | None = None,
               value_head_dim: int | None = None) -> list[str]:  # fmt: skip
    """The table of ``xcp plan --decode``, with how its bytes are counted (the partials' out in v's head dim,
    ``value_head_dim``; None: ``head_dim``)."""
    dv = head_dim if value_head_dim is None else value_head_dim
    planned = plan_steps(world, prompt, decode, chunk, balance, heads, dv, DTYPES[dtype], window)
    packed, channels = packed_layout(DTYPES[dtype], dv)
    item = packed.itemsize
    how = ("out as the kernel gives it, the float32 lse's bits in two more channels" if channels == dv + 2
           else "out and lse in the accumulator dtype")  # fmt: skip
    partial = cache_plan.combine_bytes(1, 1, 1, heads, channels, item)
    text = [
        "Each appended chunk is cut into P contiguous pieces in rank order, rank r keeping as many tokens as the "
        "chunk has positions p with p % P == r (one token: rank p % P), so holdings stay within one token.",
        "calls: the kernel calls of each rank's local partial (segments of its own tokens against the T queries).",
        f"combine: one all-gather of every rank's partial [out | lse] of B·T·H·({'D' if dv == head_dim else 'Dv'}+"
        f"{channels - dv})·{item} "
        f"bytes ({str(packed).replace('torch.', '')}: {how}; at T = 1: 1·1·{heads}·{channels}·{item} = "
        f"{human_bytes(partial)}); each rank sends its partial to the P-1 others and gathers P partials (a world "
        "of one sends nothing).",
        f"Between processes (KVCache's combine='auto'; virtual ranks of a LocalWorld gather, their copies staying "
        f"on one device), a chunk of at least {cache_plan.HEADS_COMBINE_MIN_QUERIES} tokens, where P divides the "
        "heads, combines over heads instead: an all-gather of the lse, an all-to-all of the weighted partials "
        "(each rank gets its H/P heads' and sums them) and an all-gather of the merged heads; about P/2 times "
        "fewer bytes. The table counts that.",
    ]
    if prompt:
        text.append(f"prefill: {prompt} tokens through the ring, {prompt // world} kept per rank, no communication "
                    f"for the cache (the ring's plan and bytes: xcp plan --world {world} --causal --seq "
                    f"{prompt}).")  # fmt: skip
    lines = [
        f"decode plan: world {world}, prompt {prompt}, {decode} decode steps, chunk {chunk}, heads {heads}/{kv_heads} "
        f"kv, head_dim {head_dims_text(head_dim, dv)}, {dtype}, balance {balance}, causal"
        + (f", window {windows.text_of(window)}" if window is not None else "")
        + ", batch 1",
        *(line for paragraph in text for line in textwrap.wrap(paragraph, WIDTH)),
    ]
    held_col = max(len("tokens held per rank"), *(len(_per_rank(p.held)) for p in planned)) + 2
    calls_col = max(len("calls per rank"), *(len(_per_rank(p.calls)) for p in planned)) + 2
    lines.append(f"{'step':<10}{'T':>6}{'cache':>8}  {'tokens held per rank':<{held_col}}"
                 f"{'calls per rank':<{calls_col}}{'sends':<12}gathers")  # fmt: skip
    for p in planned:
        sizes = f"{human_bytes(p.sends):<12}{human_bytes(p.gathered)}"
        lines.append(f"{p.name:<10}{p.tokens:>6}{p.seq_len:>8}  {_per_rank(p.held):<{held_col}}"
                     f"{_per_rank(p.calls):<{calls_col}}{sizes}")  # fmt: skip
    return [line.rstrip() for line in lines]


def plan_command(args: argparse.Namespace) -> int:
    """``xcp plan --decode``: pure, nothing runs."""
    check_flags(args.decode, args.chunk)
    check_alone((("--ulysses", args.ulysses, 1, None), ("--documents", args.documents, None, None),
                 ("--plot", args.plot, None, "the plan of a KV cache is a table: nothing is drawn")))  # fmt: skip
    window = windows.check(args.window, True)
    prompt = args.seq or 0
    balance = windows.resolve_balance(args.balance, args.world, True, window, None, prompt) if prompt else (
        schedule.DEFAULT_BALANCE if args.balance == windows.AUTO else args.balance)  # fmt: skip
    if prompt:
        schedule.check_seq_len(prompt, args.world, balance, what="--seq")
    print("\n".join(plan_lines(args.world, prompt, args.decode, args.chunk, balance, args.heads, args.kv_heads,
                               args.head_dim, args.dtype, window, args.value_head_dim)))  # fmt: skip
    return 0
