"""The paged decode kernels side by side at the serving target's decode shapes: 32 requests whose lengths follow a
long tail from 4K to 256K tokens (about 1.5M), 32/8 heads, D 128, bf16, one query each.

Timed (CUDA graphs of one call each, replayed; median of CUDA-event times), each checked first against the
yardstick (relative error; the yardstick itself against float64 on the two shortest requests):

- ``flash varlen seqused_k``: the aten flash varlen op over every request's K/V stored contiguously, ``cum_seq_k``
  the starts and ``seqused_k`` the lengths: the yardstick of ``xcp bench --serve``;
- ``flash paged``: the op's ``block_table`` form over blocks of 256 rows, where this torch's op has it;
- ``triton paged, blocks of B``: xcp's Triton paged decode (``xcp_cuda.paged``) over a pool of blocks of 16 and 256
  rows, each request's blocks shuffled;
- ``triton, one rank of P``: the same over one rank's share of every request (every P-th token: what each of P
  virtual ranks reads in ``xcp bench --serve``), and that time x P (the ranks' kernels if they ran one after another).

Usage: ``python benchmarks/paged_decode_probe.py [--world 8] [--reps 50]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from xcp.cli.bench.serve import long_tail
from xcp_cuda import kernels
from xcp_cuda import paged as cuda_paged

HEADS, KV_HEADS, DIM = 32, 8, 128


def timed(fn, reps: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of ``fn`` captured once into a CUDA graph and replayed ``reps`` times; its output."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def pool_of(k: torch.Tensor, v: torch.Tensor, starts: list[int], lengths: list[int], block: int, gen):
    """The tokens as a pool of ``block``-row blocks, each request's blocks shuffled: pools, int32 table."""
    need = [-(-n // block) for n in lengths]
    order = torch.randperm(sum(need) + 1, generator=gen, device="cuda")
    width = max(need)
    table = torch.full((len(lengths), width), int(order[-1]), dtype=torch.int32, device="cuda")
    k_pool, v_pool = (torch.zeros(sum(need) + 1, block, KV_HEADS, DIM, dtype=k.dtype, device="cuda") for _ in range(2))
    at = 0
    for i, (s, n, c) in enumerate(zip(starts, lengths, need)):
        blocks = order[at : at + c]
        table[i, :c] = blocks.to(torch.int32)
        for pool, x in ((k_pool, k), (v_pool, v)):
            rows = torch.zeros(c * block, KV_HEADS, DIM, dtype=k.dtype, device="cuda")
            rows[:n] = x[s : s + n]
            pool.index_copy_(0, blocks, rows.view(c, block, KV_HEADS, DIM))
        at += c
    return k_pool, v_pool, table


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = long_tail(32, 4096, 262144, 1_500_000)
    b, total = len(lengths), sum(lengths)
    starts = [sum(lengths[:i]) for i in range(b)]
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(DIM)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(starts + [total], dtype=torch.int32, device="cuda")
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    max_k = max(lengths)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: {b} requests, {total} tokens "
          f"({min(lengths)}..{max_k}), heads {HEADS}/{KV_HEADS}, D {DIM}, bf16; (splits, keys a split) "
          f"{cuda_paged.decode_splits(max_k)}")  # fmt: skip

    def flat():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale,
                                                       seqused_k=used)[0]  # fmt: skip

    base_ms, want = timed(flat, args.reps)
    bad = False
    for i in (0, 1):  # the yardstick against float64 on the two shortest requests
        keys, vals = (x[starts[i] : starts[i] + lengths[i]].double().repeat_interleave(HEADS // KV_HEADS, 1)
                      for x in (k, v))  # fmt: skip
        ref = torch.einsum("hk,khd->hd", torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), keys) * scale, -1),
                           vals)  # fmt: skip
        bad |= rel(want[i], ref) > 2e-2
    rows = [("flash varlen seqused_k (yardstick)", base_ms, 0.0)]
    for block in (16, 256):
        pools = pool_of(k, v, starts, lengths, block, gen)
        ms, out = timed(lambda pools=pools: cuda_paged.paged_decode(q, *pools, cu_q, used, max_k, scale)[0], args.reps)
        rows.append((f"triton paged, blocks of {block}", ms, rel(out, want)))
        if block == 256 and kernels.flash_takes_block_table():
            paged = lambda pools=pools: kernels.flash_paged_forward(q, *pools, cu_q, used, 1, max_k, scale)[0]  # noqa: E731
            ms, out = timed(paged, args.reps)
            rows.append(("flash paged, blocks of 256", ms, rel(out, want)))
        del pools
    share = [-(-n // args.world) for n in lengths]  # rank 0's share: every P-th token
    mine = torch.cat([k[s : s + n : args.world] for s, n in zip(starts, lengths)])
    mine_v = torch.cat([v[s : s + n : args.world] for s, n in zip(starts, lengths)])
    k_pool, v_pool, table = pool_of(mine, mine_v, [sum(share[:i]) for i in range(b)], share, 16, gen)
    used_rank = torch.tensor(share, dtype=torch.int32, device="cuda")
    ms, _ = timed(lambda: cuda_paged.paged_decode(q, k_pool, v_pool, table, cu_q, used_rank, max(share), scale),
                  args.reps)  # fmt: skip
    rows.append((f"triton, one rank of {args.world} (blocks of 16)", ms, float("nan")))
    rows.append((f"  x {args.world}", ms * args.world, float("nan")))
    print(f"{'kernel':<44} {'ms':>8} {'/ yardstick':>11} {'rel err':>9}")
    for name, t, err in rows:
        bad |= err > 2e-2
        print(f"{name:<44} {t:>8.3f} {t / base_ms:>11.3f} {err:>9.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
