"""``xcp bench --recurrent``: recurrent layers through :func:`xcp.recurrent.state_passing` over P virtual ranks
against the same kernel on the whole sequence on one device.

Two layers, with transformers' torch kernels (the families' own CPU reference): a gated delta rule
(``torch_chunk_gated_delta_rule``, Qwen3-Next's) and a Mamba2 SSD scan (``mamba2_chunk_scan``). Per (layer,
S, P): the ranks' outputs (and, with backward, every input's gradient) are checked against the whole
sequence's first; then the forward, and the forward with its backward, are timed. The P ranks run in a
cooperative LocalWorld (one rank at a time), so the world's wall time over P is one rank's work; the ratio
to the whole-sequence kernel's time is about 2/P for a decay (pass 1 and pass 2 over 1/P of the sequence)
and (2 + d_k/d_v)/P for a delta rule (its pass 1 runs d_v + d_k value columns), plus the fold and the
chunk kernels' own cost of shorter sequences.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ...api import shard, unshard
from ...comm import LocalWorld
from ...recurrent import Decay, DeltaRule, Transition, state_passing

FLAG = "--recurrent"
HELP = (
    "instead of the ring figures: a gated delta rule and a Mamba2 scan (transformers' torch kernels) through "
    "xcp.recurrent.state_passing over each of --worlds virtual ranks, forward and forward+backward, against the "
    "same kernel on the whole sequence (checked first); --seqs, --heads (default 4), --head-dim (default 64), "
    "--reps, --warmup"
)


def _layers(heads: int, dim: int) -> dict[str, tuple[Callable[..., Any], Transition, Callable[[int], list]]]:
    try:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError as exc:
        raise ValueError(
            f"{FLAG}: expected transformers installed (its torch kernels are the layers timed); got {exc}"
        ) from exc
    a_log = -torch.rand(heads)

    def delta(q, k, v, g, beta, initial_state=None, output_final_state=False):
        final = output_final_state
        return torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=final, use_qk_l2norm_in_kernel=True
        )

    def delta_inputs(s: int) -> list[torch.Tensor]:
        return [torch.randn(1, s, heads, dim), torch.randn(1, s, heads, dim), torch.randn(1, s, heads, dim),
                -torch.rand(1, s, heads) * 0.1, torch.rand(1, s, heads)]  # fmt: skip

    def ssd(x, dt, b, c, initial_state=None, output_final_state=False):
        return mamba2_chunk_scan(
            x, dt, a_log, b, c, chunk_size=64, initial_states=initial_state, return_final_states=True
        )

    def ssd_decay(x, dt, b, c):
        return torch.exp((a_log * dt).sum(dim=1))[..., None, None]

    def ssd_inputs(s: int) -> list[torch.Tensor]:
        return [torch.randn(1, s, heads, dim), torch.rand(1, s, heads) * 0.1, torch.randn(1, s, 1, dim),
                torch.randn(1, s, 1, dim)]  # fmt: skip

    return {
        f"gated delta ({heads} heads, d_k = d_v = {dim})": (delta, DeltaRule(value=2), delta_inputs),
        f"mamba2 ({heads} heads, head_dim = d_state = {dim})": (ssd, Decay(ssd_decay), ssd_inputs),
    }


def _median(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(name: str, kernel: Callable[..., Any], transition: Transition, whole: list[torch.Tensor], p: int,
         warmup: int, reps: int) -> tuple[float, float, float]:  # fmt: skip
    """Check, then time one rank's forward and forward+backward over P; returns (largest error, fwd, f+b)."""
    leaves = [x.clone().requires_grad_() for x in whole]
    expected, _ = kernel(*leaves)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    world = LocalWorld(p, cooperative=True)

    def rank(group: Any, backward: bool) -> Any:
        r = group.rank()
        local = [shard(x, p, r).requires_grad_(backward) for x in whole]
        out, _ = state_passing(kernel, *local, transition=transition, group=group)
        if backward:
            out.backward(shard(dout, p, r))
            return out.detach(), [x.grad for x in local]
        return out, None

    try:
        got = world.run(rank, True)
        errors = [_rel(unshard([g[0] for g in got]), expected.detach())]
        errors += [_rel(unshard([g[1][i] for g in got]), leaf.grad) for i, leaf in enumerate(leaves)]
        fwd = _median(lambda: world.run(rank, False), warmup, reps) / p
        fb = _median(lambda: world.run(rank, True), warmup, reps) / p
    finally:
        world.close()
    return max(errors), fwd, fb


def _forward_backward(kernel: Callable[..., Any], inputs: list[torch.Tensor], dout: torch.Tensor) -> None:
    kernel(*inputs)[0].backward(dout)


def _rel(got: torch.Tensor, want: Any) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def command(args: argparse.Namespace) -> int:
    heads, dim = args.heads or 4, args.head_dim or 64
    seqs = args.seqs or [2048]
    warmup, reps = max(args.warmup, 0), args.reps
    failed = False
    print(f"xcp bench {FLAG}: cpu, float32, one rank's work (a cooperative LocalWorld's wall time / P) over the "
          "whole-sequence kernel's; median of --reps")  # fmt: skip
    print(f"{'layer':44s} {'S':>6s} {'P':>3s} {'whole fwd':>10s} {'rank fwd':>10s} {'ratio':>6s} "
          f"{'whole f+b':>10s} {'rank f+b':>10s} {'ratio':>6s} {'2/P':>5s}  check")  # fmt: skip
    for name, (kernel, transition, make) in _layers(heads, dim).items():
        for s in seqs:
            whole = make(s)
            leaves = [x.clone().requires_grad_() for x in whole]
            dout = torch.randn_like(kernel(*whole)[0])
            fwd = _median(functools.partial(kernel, *whole), warmup, reps)
            fb = _median(functools.partial(_forward_backward, kernel, leaves, dout), warmup, reps)
            for p in args.worlds:
                if s % (2 * p):
                    print(f"{name:44s} {s:6d} {p:3d}  skipped: S not a multiple of 2P")
                    continue
                error, rank_fwd, rank_fb = _row(name, kernel, transition, whole, p, warmup, reps)
                ok = error <= 1e-3  # float32 kernels, the state folded in another order than one scan's
                failed |= not ok
                print(f"{name:44s} {s:6d} {p:3d} {fwd * 1e3:8.1f}ms {rank_fwd * 1e3:8.1f}ms {rank_fwd / fwd:6.2f} "
                      f"{fb * 1e3:8.1f}ms {rank_fb * 1e3:8.1f}ms {rank_fb / fb:6.2f} {2 / p:5.2f}  "
                      f"{'ok' if ok else 'FAILED'} (largest error {error:.1e})", flush=True)  # fmt: skip
    return 1 if failed else 0
