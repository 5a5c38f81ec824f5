"""What the tools share about serving over a paged cache (:class:`xcp.PagedKVCache`): the ``--serve`` flag and
its own flags, ``xcp run --serve N``, ``xcp plan --serve N`` and ``xcp sanitize --serve N``.

Each draws the same workload from ``--seed`` (:func:`xcp.testing.serve_sanitizer.workload`): N requests
arriving at random steps, prefilling their prompts in chunks of at most ``--chunk`` tokens beside the others'
decode steps, and leaving when done. ``run`` checks every step's output on every rank against float64
attention over each request's history; ``plan`` prints, without running anything, each step's batch, the
blocks and tokens each rank holds, and the combine's bytes; ``sanitize`` runs it on the simulated device
under the lifetime sanitizer.
"""

from __future__ import annotations

import argparse
import time

from ..comm import LocalWorld
from ..inference import plan as cache_plan
from ..inference.serving import held
from ..kernels.merge import packed_layout
from .common import DTYPES, REL_TOLERANCE, human_bytes, positive

FLAG = "--serve"
DEFAULT_REQUESTS = 8
"""The requests of ``--serve`` given without N."""
HELP = (
    "serve N requests over a paged cache (xcp.PagedKVCache) instead: they arrive at random steps (--seed), "
    "prefill in chunks of at most --chunk tokens beside the others' decode steps (1 to 5 new tokens each) and leave"
)


def add_flags(p: argparse.ArgumentParser, what: str, seed: bool = False) -> None:
    """``--serve N`` and the paged cache's flags (and ``--seed``, where the command has none of its own)."""
    p.add_argument(FLAG, type=positive, nargs="?", const=DEFAULT_REQUESTS, default=None, metavar="N",
                   help=f"{HELP} (N alone: {DEFAULT_REQUESTS}); {what}")  # fmt: skip
    if seed:
        p.add_argument("--seed", type=int, default=0, help=f"with {FLAG}: the seed of the workload")
    p.add_argument("--block-size", type=positive, default=4, help=f"with {FLAG}: tokens a block holds")
    p.add_argument("--interleave", type=positive, default=1, help=f"with {FLAG}: position p on rank (p // I) %% P")
    p.add_argument("--num-blocks", type=positive, default=None,
                   help=f"with {FLAG}: each rank's pool (default: the most the workload holds at once)")  # fmt: skip
    p.add_argument("--paged-decode", action="store_true",
                   help=f"with {FLAG}: steps of one token for each of their requests run as xcp.PagedDecode's plan "
                   "and step (the graph-safe decode step) instead of append and attention")  # fmt: skip


def check_needs_serve(args: argparse.Namespace, seed: bool = False) -> None:
    """The paged cache's flags (and ``--seed`` where :func:`add_flags` declared it) mean nothing without ``--serve``."""
    flags = [("--block-size", args.block_size, 4), ("--interleave", args.interleave, 1),
             ("--num-blocks", args.num_blocks, None), ("--seed", args.seed if seed else 0, 0),
             ("--paged-decode", args.paged_decode, False)]  # fmt: skip
    for flag, value, default in flags:
        if value != default:
            raise ValueError(f"{flag}: expected only with {FLAG}; got {value} without it")


def _steps(args: argparse.Namespace):
    from ..testing.serve_sanitizer import max_blocks, workload

    if args.chunk < 1:
        raise ValueError(f"--chunk: expected with {FLAG} the prefill chunk's most tokens, >= 1; got {args.chunk}")
    steps = workload(args.serve, args.seed, args.chunk)
    need = max_blocks(steps, args.world, args.block_size, args.interleave)
    return steps, args.num_blocks or max(1, need)


def run_command(args: argparse.Namespace) -> int:
    """``xcp run --serve N``: every step on every rank against float64; exit 1 on a failed check."""
    from ..testing.serve_sanitizer import largest_error, reference, serve_rank, workload_data

    steps, num_blocks = _steps(args)
    dtype = DTYPES[args.dtype]
    data = workload_data(steps, args.heads, args.kv_heads, args.head_dim, args.seed)
    kwargs = {"num_blocks": num_blocks, "block_size": args.block_size, "interleave": args.interleave,
              "device": args.device}  # fmt: skip
    problems: list = []
    data_on = [tuple(x.to(args.device or "cpu") for x in d) for d in data]
    start = time.perf_counter()
    with LocalWorld(args.world) as world:
        outs = world.run(lambda g: serve_rank(g, steps, data_on, dtype, kwargs, problems, args.paged_decode))
    seconds = time.perf_counter() - start
    wants = reference(steps, data)
    tol = REL_TOLERANCE[dtype]
    print(f"xcp run: serve {args.serve} requests in {len(steps)} steps, world {args.world}, heads {args.heads}/"
          f"{args.kv_heads} kv, head_dim {args.head_dim}, {args.dtype}, blocks of {args.block_size} x {num_blocks} a "
          f"rank, interleave {args.interleave}" + (", decode steps through PagedDecode" if args.paged_decode
                                                    else ""))  # fmt: skip
    print(f"{'step':>5} {'requests':>9} {'tokens':>7} {'rel err':>11} {'tolerance':>10}  result")
    ok = not problems
    for n, (s, want) in enumerate(zip(steps, wants)):
        err = largest_error([[r[n]] for r in outs], [want])
        good = err <= tol
        ok &= good
        print(f"{n:>5} {len(s.batch):>9} {s.tokens:>7} {err:>11.3e} {tol:>10.1e}  {'ok' if good else 'FAIL'}")
    for p in problems:
        print(f"pool: {p.kind}: {p.detail}")
    print(f"time: {seconds:.3f} s for every step of every rank")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def plan_command(args: argparse.Namespace) -> int:
    """``xcp plan --serve N``: per step the batch, each rank's blocks and tokens, the combine's bytes."""
    if args.paged_decode:
        raise ValueError("--paged-decode: expected with xcp run --serve or xcp sanitize --serve (a plan's steps are "
                         "the same either way); got it with xcp plan")  # fmt: skip
    steps, num_blocks = _steps(args)
    world, dtype = args.world, DTYPES[args.dtype]
    dims = args.value_head_dim or args.head_dim
    print(f"xcp plan: serve {args.serve} requests in {len(steps)} steps, world {world}, heads {args.heads}, value "
          f"head_dim {dims}, {args.dtype}, blocks of {args.block_size} x {num_blocks} a rank, interleave "
          f"{args.interleave}")  # fmt: skip
    print(f"{'step':>5} {'requests':>9} {'tokens':>7}  {'blocks per rank':<24}{'tokens per rank':<28}{'sends':>11}"
          f"{'gathers':>11}")  # fmt: skip
    packed, channels = packed_layout(dtype, dims)
    lengths: dict[int, int] = {}
    for n, s in enumerate(steps):
        for i, t in s.batch:
            lengths[i] = lengths.get(i, 0) + t
        tokens = [sum(held(x, world, r, args.interleave) for x in lengths.values()) for r in range(world)]
        blocks = [
            sum(-(-held(x, world, r, args.interleave) // args.block_size) for x in lengths.values())
            for r in range(world)
        ]
        shape = (1, s.tokens, args.heads, channels, packed.itemsize)
        sent, got = (
            (cache_plan.combine_bytes(world - 1, *shape), cache_plan.combine_bytes(world, *shape))
            if world > 1
            else (0, 0)
        )
        print(f"{n:>5} {len(s.batch):>9} {s.tokens:>7}  {' '.join(map(str, blocks)):<24}"
              f"{' '.join(map(str, tokens)):<28}{human_bytes(sent):>11}{human_bytes(got):>11}")  # fmt: skip
        for i in s.leaving:
            del lengths[i]
    print("sends / gathers: the bytes each rank sends and receives in the one all-gather of the step's packed partials")
    return 0


def sanitize_command(args: argparse.Namespace) -> int:
    """``xcp sanitize --serve N``: the workload on the simulated device under the lifetime sanitizer."""
    from ..testing.serve_sanitizer import sanitize_serve

    report = sanitize_serve(requests=args.serve, world=args.world, handoff=args.handoff, dtype=DTYPES[args.dtype],
                            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                            block_size=args.block_size, interleave=args.interleave, num_blocks=args.num_blocks,
                            chunk=args.chunk, seed=args.seed, decode=args.paged_decode)  # fmt: skip
    print(report.format())
    return 0 if report.ok else 1
