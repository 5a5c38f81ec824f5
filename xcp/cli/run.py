"""``xcp run``: ring attention on sharded inputs, checked against a float64 reference, so that a user sees
on their own device that the ring is exact before they trust it.

It runs on a LocalWorld of virtual ranks (the default, on the CPU) or, under torchrun, on the real process
group, and reports the error of out, dq, dk and dv, the time of a warm call (and, apart, of the first, which
builds plans and launches kernels for the first time), and the peak received-KV bytes per rank. With
``--ulysses U`` it runs the hybrid all-to-all + ring (``xcp.attention(..., ulysses=U)``), checked alike; with
``--decode N``, inference over a sharded KV cache (:mod:`xcp.cli.decode`).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import schedule
from ..api import attention, shard, unshard
from ..comm import LocalWorld, resolve_group
from ..hybrid import hybrid_backward, hybrid_config, hybrid_forward
from ..lifetime import track_buffers
from ..ring import RingConfig, ring_backward, ring_forward
from . import decode, packing, serve, ulysses
from .common import (
    DTYPES,
    FLAGS,
    REL_TOLERANCE,
    Problem,
    add_problem_flags,
    check_heads,
    check_value_dim,
    error,
    gather_whole,
    join_process_group,
    placement,
    positive,
    problem_args,
    random_inputs,
    reference,
    tool_backend,
    under_torchrun,
)

TENSORS = ("out", "dq", "dk", "dv")


@dataclass
class RunConfig(Problem):
    """The demo problem: a :class:`Problem` spread over ``world`` ranks."""

    world: int = 4
    seq: int = 3072
    causal: bool = True
    seed: int = 0
    ulysses: int = 1
    """U of the hybrid all-to-all + ring (1: the ring alone)."""
    documents: tuple[int, ...] | None = None
    """The global boundaries ``(0, ..., S)`` of packed documents (batch 1); None: one sequence."""

    def place(self) -> dict:
        """``xcp.shard``'s and ``xcp.unshard``'s keywords for this run (:func:`xcp.cli.common.placement`)."""
        return placement(self.balance, self.ulysses, self.documents)


# xcp run's defaults: small enough for a laptop CPU, large enough to cross several key tiles
RUN_DEFAULTS = RunConfig(heads=8, kv_heads=2, head_dim=64, dtype="float32", device="cpu")


@dataclass
class RunResult:
    """Errors per tensor, the slowest rank's time of a warm call and of the first, and the peak received-KV
    bytes per rank."""

    config: RunConfig
    errors: dict[str, tuple[float, float]]  # name -> (max abs error, relative error)
    seconds: float
    """The slowest rank's forward+backward of a warm call (the second): the speed."""
    first_seconds: float
    """The slowest rank's first call: plans built, kernels launched (and on a GPU, set up) for the first time."""
    peak_kv_bytes: list[int]
    peak_kv_shards: list[int]
    mode: str
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        tol = REL_TOLERANCE[DTYPES[self.config.dtype]]
        self.ok = all(math.isfinite(rel) and rel <= tol for _, rel in self.errors.values())

    def table(self) -> str:
        c = self.config
        tol = REL_TOLERANCE[DTYPES[c.dtype]]
        lines = [
            f"xcp run: {self.mode}, world {c.world}, batch {c.batch}, seq {c.seq}, heads {c.heads}/{c.kv_heads} kv, "
            f"head_dim {c.dims_text()}, {c.dtype}, {'causal' if c.causal else 'full'}, balance {c.balance}, "
            f"device {c.device}",
            *(
                [
                    f"hybrid: world {c.world} = ulysses {c.ulysses} x ring {c.world // c.ulysses} (an all-to-all "
                    f"over heads in each group of {c.ulysses} consecutive ranks, then the ring over the ranks with "
                    f"equal r % {c.ulysses})"
                ]
                if c.ulysses > 1
                else []
            ),
            *(
                [
                    f"documents: {len(c.documents) - 1} packed, lengths "
                    f"{packing.abbreviate(packing.lengths_of(c.documents))} (each attends within itself)"
                ]
                if c.documents is not None
                else []
            ),
            *(
                [f"values of another head dim: q, k, dq, dk of {c.head_dim}; v, out, dout, dv of {c.value_dim}"]
                if c.value_dim != c.head_dim
                else []
            ),
            f"{'tensor':<8}{'max abs err':>14}{'rel err':>12}{'tolerance':>12}  result",
        ]
        for name, (abs_err, rel) in self.errors.items():
            verdict = "ok" if math.isfinite(rel) and rel <= tol else "FAIL"
            lines.append(f"{name:<8}{abs_err:>14.3e}{rel:>12.3e}{tol:>12.1e}  {verdict}")
        mib = [b / 2**20 for b in self.peak_kv_bytes]
        lines.append(f"time (fwd+bwd, warm call, slowest rank): {_duration(self.seconds)}")
        lines.append(f"first call (plan building, first launches): {_duration(self.first_seconds)}")
        lines.append(
            "peak ring buffers per rank (received KV and dK/dV slots): "
            + ", ".join(f"r{r}: {m:.2f} MiB / {s} shards" for r, (m, s) in enumerate(zip(mib, self.peak_kv_shards)))
        )
        lines.append("PASS" if self.ok else "FAIL: an error is above its tolerance")
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    """``2.454 s``, or ``12.35 ms`` below a second (a warm call takes milliseconds on a device)."""
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def rank_step(group, cfg: RunConfig, backend, full: tuple[torch.Tensor, ...], functional: bool,
              clock: Callable[[], float] = time.perf_counter):  # fmt: skip
    """One rank's forward and backward, called twice: the first call, whose time includes building the plans
    and the first launches, and a warm one, timed alone. Returns ``(out, dq, dk, dv, first call's seconds,
    warm call's seconds, ledger)``: the outputs and the ledger are the first call's (what is checked)."""
    out, dq, dk, dv, first, ledger = _call(group, cfg, backend, full, functional, clock)
    warm = _call(group, cfg, backend, full, functional, clock)[4]
    return out, dq, dk, dv, first, warm, ledger


def _call(group, cfg: RunConfig, backend, full: tuple[torch.Tensor, ...], functional: bool,
          clock: Callable[[], float]):  # fmt: skip
    """One call on this rank's shards, forward and backward; returns (out, dq, dk, dv, seconds, ledger)."""
    u = cfg.ulysses
    q, k, v, dout = (shard(x, group.size(), group.rank(), **cfg.place()) for x in full)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    dq: torch.Tensor | None  # None only were a leaf left out of the graph (autograd's .grad)
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    with track_buffers() as ledger:
        start = clock()
        if functional and u > 1:  # the hybrid's ring_forward / ring_backward
            hybrid = hybrid_config(q, k, group, backend, u, causal=cfg.causal, scale=scale, balance=cfg.balance,
                                   cu_seqlens=cfg.documents, v=v)  # fmt: skip
            out, state = hybrid_forward(q, k, v, hybrid)
            dq, dk, dv = hybrid_backward(dout, state, hybrid)
            del state
        elif functional:  # GPU threads cannot share autograd's one device worker: a waiting backward blocks it
            ring = RingConfig(group, backend, cfg.causal, scale, cfg.balance, documents=cfg.documents)
            out, lse = ring_forward(q, k, v, ring)
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ring)
        else:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            cu = None if cfg.documents is None else torch.tensor(cfg.documents)
            out = attention(q, k, v, causal=cfg.causal, group=group, balance=cfg.balance, device=cfg.device,
                            ulysses=u, cu_seqlens=cu)  # fmt: skip
            out.backward(dout)
            dq, dk, dv = q.grad, k.grad, v.grad
        backend.synchronize(out.device)
        seconds = clock() - start
    return out.detach(), dq, dk, dv, seconds, ledger


def _errors(cfg: RunConfig, full, got) -> dict[str, tuple[float, float]]:
    q, k, v, dout = full
    ref = reference(q, k, v, dout, cfg.causal, cfg.documents)
    return {name: error(g, r) for name, g, r in zip(TENSORS, got, ref)}


def run_demo(cfg: RunConfig, clock: Callable[[], float] = time.perf_counter) -> RunResult:
    """Run the demo on a LocalWorld, or on the torch.distributed world when torchrun started us; ``clock``
    times each rank's calls (seconds)."""
    if under_torchrun():
        return _run_distributed(cfg, clock)
    backend, device = tool_backend(cfg.device)
    full = random_inputs(cfg, cfg.seq, device, cfg.seed)
    world = LocalWorld(cfg.world, device=device)
    results = world.run(rank_step, cfg, backend, full, device.type != "cpu", clock)
    got = [unshard([r[i] for r in results], **cfg.place()) for i in range(4)]
    return RunResult(
        cfg,
        _errors(cfg, full, got),
        max(r[5] for r in results),
        max(r[4] for r in results),
        [r[6].peak_bytes for r in results],
        [r[6].peak_kv_shards for r in results],
        f"LocalWorld of {cfg.world} virtual ranks",
    )


def _run_distributed(cfg: RunConfig, clock: Callable[[], float]) -> RunResult:
    import torch.distributed as dist

    backend, device, rank, world = join_process_group(cfg.device)
    cfg.world = world
    ulysses.check_flag(cfg.ulysses, world, cfg.heads, "the torchrun world size")
    ulysses.check_seq(cfg.seq, world, cfg.ulysses, cfg.balance, "--seq" if cfg.documents is None else packing.FLAG)
    full = random_inputs(cfg, cfg.seq, device, cfg.seed)
    out, dq, dk, dv, first, warm, ledger = rank_step(resolve_group(None), cfg, backend, full, False, clock)
    gathered = gather_whole((out, dq, dk, dv), world, cfg.balance, cfg.ulysses, cfg.documents)
    stats = [warm, first, ledger.peak_bytes, ledger.peak_kv_shards]
    mine = torch.tensor(stats, dtype=torch.float64, device=device)
    all_stats = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(all_stats, mine)
    return RunResult(
        cfg,
        _errors(cfg, full, gathered),
        max(s[0].item() for s in all_stats),
        max(s[1].item() for s in all_stats),
        [int(s[2].item()) for s in all_stats],
        [int(s[3].item()) for s in all_stats],
        f"torch.distributed ({dist.get_backend()}), rank {rank} of {world}",
    )


def add_parser(sub) -> None:
    d = RUN_DEFAULTS
    p = sub.add_parser("run", help="ring attention on a LocalWorld (or under torchrun), checked against float64")
    p.add_argument("--world", type=positive, default=d.world, help="virtual ranks (ignored under torchrun)")
    add_problem_flags(p, d, ["batch"])  # interleaved with the run's own flags, in the order of --help
    p.add_argument("--seq", type=positive, default=None,
                   help=f"global sequence length (default: {d.seq}); with {packing.FLAG} of explicit lengths, "
                   "their sum unless given")  # fmt: skip
    add_problem_flags(p, d, ["heads", "kv_heads", "head_dim", "value_head_dim", "dtype"])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal, help="causal mask")
    p.add_argument("--balance", choices=schedule.ALL_BALANCES, default=d.balance,
                   help=f"{FLAGS['balance']['help']}; {packing.DOCUMENT_BALANCE_HELP}")  # fmt: skip
    packing.add_flag(p, "packed documents (batch 1), each attending within itself (xcp.attention's cu_seqlens): "
                     "their lengths in sequence order (summing to S), or lengths drawn log-uniformly in [MIN, MAX] "
                     "(seeded) to fill --seq; checked against float64 attention over each document")  # fmt: skip
    add_problem_flags(p, d, ["device"])
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random inputs")
    p.add_argument(ulysses.FLAG, type=positive, default=d.ulysses,
                   help=ulysses.HELP + " (under torchrun, U divides the world size)")  # fmt: skip
    p.add_argument(decode.FLAG, type=int, default=None, metavar="N",
                   help="inference over a sharded KV cache instead (xcp.KVCache): the prompt of --seq tokens through "
                   "the ring, its shards kept by each rank's cache, then N decode steps of one token and one chunk "
                   f"of {decode.CHUNK_FLAG} tokens, every step's output on every rank checked against float64 "
                   "attention over the whole sequence (causal; exit 1 on a failed check)")  # fmt: skip
    p.add_argument(decode.CHUNK_FLAG, type=int, default=decode.DEFAULT_CHUNK, metavar="T", help=decode.CHUNK_HELP)
    serve.add_flags(
        p,
        "every step's output on every rank checked against float64 attention over each request's "
        "history (exit 1 on a failed check)",
    )


def _documents(args: argparse.Namespace) -> tuple[int, tuple[int, ...] | None]:
    """S and the boundaries of ``--documents`` (None without), checked against ``--seq``, ``--batch`` and the
    balance over the ranks of a ring (under torchrun, of its world)."""
    if args.documents is None:
        return args.seq or RUN_DEFAULTS.seq, None
    if args.batch != 1:
        raise ValueError(f"--batch: expected 1 with {packing.FLAG} (the packed layout); got {args.batch}")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world
    seq = args.seq if args.seq is not None or args.documents.lengths is not None else RUN_DEFAULTS.seq
    lengths, seq = packing.resolve_lengths(args.documents, seq, world // args.ulysses, args.balance)
    return seq, packing.boundaries(lengths)


def command(args: argparse.Namespace) -> int:
    backend, _ = tool_backend(args.device)  # an unknown or unusable backend: xcp's error and the table, first
    check_value_dim(backend, args.head_dim, args.value_head_dim or args.head_dim)
    check_heads(args.heads, args.kv_heads)
    packing.check_balance(args.balance, args.documents is not None)
    if args.serve is not None:
        return serve.run_command(args)
    serve.check_needs_serve(args)
    if args.decode is not None:
        return decode.run_command(args, problem_args(args))
    decode.check_needs_decode(((decode.CHUNK_FLAG, args.chunk, decode.DEFAULT_CHUNK),))
    if args.ulysses > 1 and not under_torchrun():  # under torchrun, once the world size is known
        ulysses.check_flag(args.ulysses, args.world, args.heads)
    seq, documents = _documents(args)
    if not under_torchrun():  # under torchrun, once the world size is known
        ulysses.check_seq(seq, args.world, args.ulysses, args.balance, "--seq" if documents is None else packing.FLAG)
    cfg = RunConfig(world=args.world, seq=seq, causal=args.causal, seed=args.seed, ulysses=args.ulysses,
                    documents=documents, **problem_args(args))  # fmt: skip
    result = run_demo(cfg)
    print(result.table())
    return 0 if result.ok else 1
