"""``xcp bench --recurrent``: recurrent layers through state passing over P virtual ranks against the same
kernel on the whole sequence on one device, each checked first (outputs and every input's gradient).

Two layers, with the kernels :func:`xcp.recurrent.recurrent_kernel` picks on the device (CUDA: fla's Triton
kernels where installed; else the models' own torch kernels): a gated delta rule (Qwen3-Next's) and a
Mamba2 SSD scan. With ``--stack``, also a Qwen3-Next-shaped block stack: three gated-delta layers to one
causal attention layer (16 query heads, 2 KV heads, head dim 256) through xcp's ring.

The ranks run in a cooperative LocalWorld (one rank's host code at a time), each on its own stream: on a
GPU their kernels, launched asynchronously, overlap as the ring bench's ranks' do. The world's wall time over
the whole-sequence kernel's is the cost of the P ranks' work beside one device doing all of it (1.0: no
overhead). The exchange runs outside autograd
(:class:`xcp.recurrent.state.Passes`): on a GPU, virtual ranks cannot run a collective inside autograd's
backward (one device thread for all ranks); real ranks run :func:`xcp.recurrent.state_passing` as it is.
The breakdown (pass 1, pass 2, their backwards, the exchanges) is a second run, one rank at a time with the
device drained between steps: each kernel step's time summed over the ranks, and the exchanges' as the rest
of that run's wall time (a rank waiting in one lets the others run), as shares of the run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ...api import shard, unshard
from ...comm import LocalWorld
from ...kernels.recurrent import RecurrentKernel
from ...recurrent import Transition
from ...recurrent.exchange import gather, scatter_sum
from ...recurrent.kernels import recurrent_kernel, transition
from ...recurrent.state import prepare_passes
from ..common import DTYPES, Clock, default_device, tool_backend, whole_kernel
from .virtual import VirtualRing

FLAG = "--recurrent"
STACK_FLAG = "--stack"
HELP = (
    "instead of the ring figures: a gated delta rule and a Mamba2 scan through xcp.recurrent's state passing over "
    "each of --worlds virtual ranks, forward and forward+backward, against the same kernel on the whole sequence "
    "(checked first), with where the time goes (pass 1, exchange, pass 2); the kernels xcp backends names for the "
    "device (CUDA: fla's where installed). --seqs, --heads, --head-dim (default 16 x 128 on a device, 4 x 64 on the "
    "CPU; Mamba2: twice the heads of half the dim, d_state = --head-dim), --dtype, --reps, --warmup"
)
STACK_HELP = (
    f"with {FLAG}: also a Qwen3-Next-shaped block stack, 3 gated-delta layers to 1 causal attention layer (16/2 heads "
    "of 256, xcp's ring), over the same ranks against the same layers on the whole sequence"
)
PHASES = ("pass 1", "pass 2", "pass 2 bwd", "pass 1 bwd", "exchange")
"""Where a rank's time goes: its kernels' steps, then the exchanges (forward and backward) and the waits for
the other ranks around them."""


@dataclass
class Layer:
    """One recurrent layer of the bench: its kernel, transition, inputs and keyword arguments."""

    name: str
    kernel: RecurrentKernel
    transition: Transition
    inputs: list[torch.Tensor]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _gated_delta(seq: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> Layer:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    inputs = [r(1, seq, heads, dim).to(dtype), r(1, seq, heads, dim).to(dtype), r(1, seq, heads, dim).to(dtype),
              F.logsigmoid(r(1, seq, heads) + 4.0), torch.rand(1, seq, heads, device=device).to(dtype)]  # fmt: skip
    kernel = recurrent_kernel("gated_delta_rule", device)
    name = f"gated delta ({heads} heads, d_k = d_v = {dim})"
    return Layer(name, kernel, transition("gated_delta_rule"), inputs, {"use_qk_l2norm_in_kernel": True})


def _mamba2(seq: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> Layer:
    h, p, n = 2 * heads, max(dim // 2, 1), dim
    x = torch.randn(1, seq, h, p, device=device).to(dtype)
    dt = F.softplus(torch.randn(1, seq, h, device=device) - 3.0)
    b, c = (torch.randn(1, seq, 1, n, device=device).to(dtype) for _ in range(2))
    a = -torch.rand(h, device=device) - 0.5
    name = f"mamba2 ({h} heads of {p}, d_state = {n})"
    return Layer(name, recurrent_kernel("mamba2", device), transition("mamba2"), [x, dt, b, c], {"A": a})


class VirtualStates:
    """P virtual ranks running one layer's state passing, each a thread with its own stream, one rank's host
    code at a time, on pre-sharded inputs; the exchange outside autograd (see the module's docstring)."""

    def __init__(self, backend: Any, layer: Layer, world: int, dout: torch.Tensor) -> None:
        self.backend, self.layer, self.world_size = backend, layer, world
        self.device = layer.inputs[0].device
        # one rank's host code at a time: Triton's autotuner (fla's kernels) keeps per-call state on the kernel
        # object, so two threads launching one kernel at once can break it ("'NoneType' object is not a mapping");
        # the launches are asynchronous, so on a GPU the ranks' kernels still overlap, each on its own stream
        self.world = LocalWorld(world, device=self.device, cooperative=True)
        self.shards = [[shard(x, world, r) for x in layer.inputs] for r in range(world)]
        self.douts = [shard(dout, world, r) for r in range(world)]
        self.streams = [backend.new_stream(self.device) for _ in range(world)]

    def close(self) -> None:
        self.world.close()

    def run(self, backward: bool, steps: dict[str, float] | None = None) -> list[Any]:
        """One forward (and backward) of every rank; with ``steps``, one rank at a time, each step's time
        (the device drained around it) added into ``steps``."""
        main = self.backend.current_stream(self.device)
        if steps is not None:
            self.backend.synchronize(self.device)
            start = time.perf_counter()
        results = self.world.run(self._rank, backward, main, steps)
        for stream, _, _ in results:
            self.backend.wait_stream(main, stream)
        if steps is not None:
            # a rank waiting in an exchange lets the others run: the exchanges' time is the rest of the run's
            self.backend.synchronize(self.device)
            steps["exchange"] = time.perf_counter() - start - sum(v for k, v in steps.items() if k != "exchange")
        return results

    def _rank(self, group: Any, backward: bool, main: Any, steps: dict[str, float] | None) -> Any:
        be, rank = self.backend, group.rank()
        stream = self.streams[rank]
        be.wait_stream(stream, main)
        inputs = [x.detach().requires_grad_(backward and x.is_floating_point()) for x in self.shards[rank]]
        lap = _Lap(be, self.device, steps)
        with be.stream_context(stream), torch.enable_grad() if backward else torch.no_grad():
            passes = prepare_passes(self.layer.kernel.fn, *inputs, transition=self.layer.transition, group=group,
                                    **self.layer.kwargs)  # fmt: skip
            if passes.comm.size() == 1:
                return self._alone(passes, inputs, backward, stream)
            summaries = passes.summaries()
            lap("pass 1")
            sent = passes.packed(summaries)
            gathered = gather(passes.comm, be, None, [s.detach() for s in sent], passes.rows, "state")
            lap("exchange")  # replaced by the run's remainder (see run)
            leaf = gathered.requires_grad_(backward)
            own = [None if x is None else _view(leaf[rank, i], x) for i, x in enumerate(summaries)]
            kept, passes.kept = passes.kept, [_cut_graph(k) for k in passes.kept]  # pass 1's outputs, as leaves
            incoming, _ = passes.fold(own, leaf)
            out = passes.outputs(incoming)
            lap("pass 2")
            grads = None
            if backward:
                out.backward(self.douts[rank])
                lap("pass 2 bwd")
                dleaf = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                mine = scatter_sum(passes.comm, be, None, dleaf, "dstate")
                lap("exchange")
                needed = [(s, mine[i]) for i, s in enumerate(sent) if s.requires_grad]
                for graph, cut in zip(kept, passes.kept):  # pass 1's outputs' gradients, into pass 1 with the rest
                    if graph is not None and cut is not None:
                        needed += [(a, b.grad) for a, b in zip((graph[0], *graph[1]), (cut[0], *cut[1]))
                                   if b.grad is not None]  # fmt: skip
                if needed:
                    torch.autograd.backward([s for s, _ in needed], [g for _, g in needed])
                lap("pass 1 bwd")
                grads = [x.grad for x in inputs]
        return stream, out.detach(), grads

    def _alone(self, passes: Any, inputs: list[torch.Tensor], backward: bool, stream: Any) -> Any:
        """A world of one: the kernel alone (nothing to exchange)."""
        out = passes.outputs([None])
        if backward:
            out.backward(self.douts[0])
        return stream, out.detach(), [x.grad for x in inputs] if backward else None


def _cut_graph(kept: Any) -> Any:
    """A piece's kept pass-1 outputs as leaves (their gradients go into pass 1 once, with the summaries')."""
    if kept is None:
        return None
    zero, extra, carry = kept
    return (zero.detach().requires_grad_(zero.requires_grad),
            tuple(x.detach().requires_grad_(x.requires_grad) for x in extra), carry)  # fmt: skip


def _view(row: torch.Tensor, summary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own summary read back from the gathered rows (so its gradient, too, goes through them)."""
    t, s = summary
    return row[: t.numel()].view(t.shape), row[t.numel() :].view(s.shape)


class _Lap:
    """Adds the time since the last lap to ``steps[name]`` (the device drained first); nothing without steps."""

    def __init__(self, backend: Any, device: torch.device, steps: dict[str, float] | None) -> None:
        self.backend, self.device, self.steps = backend, device, steps
        self.last = self._now()

    def _now(self) -> float:
        if self.steps is None:
            return 0.0
        self.backend.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, name: str) -> None:
        if self.steps is None:
            return
        now = self._now()
        self.steps[name] = self.steps.get(name, 0.0) + now - self.last
        self.last = now


def _whole(layer: Layer, dout: torch.Tensor, backward: bool) -> tuple[torch.Tensor, list[Any] | None]:
    with torch.enable_grad() if backward else torch.no_grad():
        leaves = [x.detach().requires_grad_(backward and x.is_floating_point()) for x in layer.inputs]
        out, _ = layer.kernel.fn(*leaves, **layer.kwargs)
        if not backward:
            return out, None
        out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _errors(results: list[Any], whole_out: torch.Tensor, whole_grads: list[Any] | None) -> float:
    errors = [_rel(unshard([r[1] for r in results]), whole_out)]
    for i, g in enumerate(whole_grads or []):
        if g is not None:
            errors.append(_rel(unshard([r[2][i] for r in results]), g))
    return max(errors)


def _median(clock: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(clock(fn) for _ in range(reps))


def _tolerance(dtype: torch.dtype) -> float:
    """bf16/fp16 kernels round their inputs, outputs and chunk products in another order than one scan's; float32
    keeps about 1e-6 of the largest value through the fold."""
    return 5e-2 if dtype in (torch.bfloat16, torch.float16) else 2e-3


def layer_row(backend: Any, clock: Any, layer: Layer, world: int, warmup: int, reps: int) -> dict[str, Any]:
    """Check, then time one layer over ``world`` virtual ranks against its kernel on the whole sequence."""
    gen_out, _ = _whole(layer, torch.empty(0), False)
    dout = torch.randn_like(gen_out)
    del gen_out
    ranks = VirtualStates(backend, layer, world, dout)
    row: dict[str, Any] = {"layer": layer.name, "seq": layer.inputs[0].shape[1], "world": world}
    try:
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            whole_out, whole_grads = _whole(layer, dout, backward)
            row[f"{mode}_error"] = _errors(ranks.run(backward), whole_out, whole_grads)
            del whole_out, whole_grads
            whole = functools.partial(_whole, layer, dout, backward)
            ours = functools.partial(ranks.run, backward)
            row[f"{mode}_whole_s"] = _median(clock.time, whole, warmup, reps)
            row[f"{mode}_ranks_s"] = _median(clock.time, ours, warmup, reps)
            steps: dict[str, float] = {}
            ranks.run(backward, steps)
            row[f"{mode}_steps"] = steps
    finally:
        ranks.close()
    row["ok"] = max(row["fwd_error"], row["fwd_bwd_error"]) <= _tolerance(layer.inputs[0].dtype)
    return row


def attention_row(backend: Any, clock: Any, seq: int, world: int, dtype: torch.dtype, device: torch.device,
                  warmup: int, reps: int) -> dict[str, Any]:  # fmt: skip
    """The stack's attention layer (16/2 heads of 256, causal) through xcp's ring over ``world`` virtual ranks
    against the backend's kernel on the whole sequence, forward+backward."""
    q = torch.randn(1, seq, 16, 256, device=device, dtype=dtype)
    k, v = (torch.randn(1, seq, 2, 256, device=device, dtype=dtype) for _ in range(2))
    full = (q, k, v, torch.randn_like(q))
    ring = VirtualRing(backend, world, full, True, "zigzag")
    out, _ = whole_kernel(backend, full, True, False)
    error = _rel(unshard([r[1] for r in ring.run(False)], **ring.place), out)
    del out
    whole = _median(clock.time, lambda: whole_kernel(backend, full, True, True), warmup, reps)
    row = {"error": error, "whole_s": whole, "ranks_s": _median(clock.time, lambda: ring.run(True), warmup, reps)}
    ring.world.close()
    return row


def _format_steps(steps: dict[str, float]) -> str:
    total = sum(steps.values()) or 1.0
    return ", ".join(f"{name} {100 * steps[name] / total:.0f}%" for name in PHASES if name in steps)


def command(args: argparse.Namespace) -> int:
    note = default_device(args)
    backend, device = tool_backend(args.device, 0)
    on_cpu = device.type == "cpu"
    heads, dim = int(args.heads or (4 if on_cpu else 16)), int(args.head_dim or (64 if on_cpu else 128))
    dtype = DTYPES[args.dtype or ("float32" if on_cpu else "bfloat16")]
    seqs = args.seqs or ([2048] if on_cpu else [262144])
    warmup, reps = max(args.warmup, 0), args.reps
    print(f"xcp bench {FLAG}: {device} ({note or 'device ' + str(args.device)}), {str(dtype).removeprefix('torch.')}; "
          "ranks: the P virtual ranks' wall time on this one device; ratio: ranks / whole (1.00: no overhead); "
          "median of --reps")  # fmt: skip
    failed = False
    gdr: dict[tuple[int, int], dict[str, Any]] = {}
    for make in (_gated_delta, _mamba2):
        for seq in seqs:
            layer = make(seq, heads, dim, dtype, device)
            print(f"{layer.name}: {layer.kernel.label}")
            for p in args.worlds:
                if seq % (2 * p):
                    print(f"  S {seq} P {p}: skipped (S not a multiple of 2P)")
                    continue
                row = layer_row(backend, Clock(backend, device), layer, p, warmup, reps)
                failed |= not row["ok"]
                if make is _gated_delta:
                    gdr[(seq, p)] = row
                for mode in ("fwd", "fwd_bwd"):
                    whole, ours = row[f"{mode}_whole_s"], row[f"{mode}_ranks_s"]
                    print(f"  S {seq:>8d} P {p:>2d} {mode:>7s}: whole {whole * 1e3:9.1f} ms  ranks {ours * 1e3:9.1f} ms"
                          f"  ratio {ours / whole:5.2f}  ({_format_steps(row[mode + '_steps'])})  "
                          f"{'ok' if row['ok'] else 'FAILED'} (largest error {row[mode + '_error']:.1e})",
                          flush=True)  # fmt: skip
            del layer
    if getattr(args, "stack", False):
        failed |= _stack(args, backend, device, dtype, seqs, gdr, warmup, reps)
    return 1 if failed else 0


def _stack(args: argparse.Namespace, backend: Any, device: torch.device, dtype: torch.dtype, seqs: Sequence[int],
           gdr: dict[tuple[int, int], dict[str, Any]], warmup: int, reps: int) -> bool:  # fmt: skip
    """The block stack's line per (S, P): 3 gated-delta layers (their rows above) and 1 attention layer."""
    failed = False
    print("block stack (3 gated delta : 1 causal attention of 16/2 heads x 256), fwd+bwd: 3 x the gated delta "
          "layer's time above + the attention layer's, whole and over the ranks")  # fmt: skip
    for seq in seqs:
        for p in args.worlds:
            if (seq, p) not in gdr:
                continue
            att = attention_row(backend, Clock(backend, device), seq, p, dtype, device, warmup, reps)
            ok = att["error"] <= _tolerance(dtype) and gdr[(seq, p)]["ok"]
            failed |= not ok
            whole = 3 * gdr[(seq, p)]["fwd_bwd_whole_s"] + att["whole_s"]
            ours = 3 * gdr[(seq, p)]["fwd_bwd_ranks_s"] + att["ranks_s"]
            print(f"  S {seq:>8d} P {p:>2d}: whole {whole * 1e3:9.1f} ms  ranks {ours * 1e3:9.1f} ms  ratio "
                  f"{ours / whole:5.2f}  (attention: whole {att['whole_s'] * 1e3:.1f} ms, ring "
                  f"{att['ranks_s'] * 1e3:.1f} ms)  {'ok' if ok else 'FAILED'} (attention error {att['error']:.1e})",
                  flush=True)  # fmt: skip
    return failed
