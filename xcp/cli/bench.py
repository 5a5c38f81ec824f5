"""``xcp bench``: ring overhead, memory and graph-capture figures measured side by side in one process, so
that the ring's cost over one whole-sequence kernel is known before it is run on many devices.

The overhead ratio is the forward(+backward) time of ring attention over a LocalWorld of P virtual ranks on
one device, divided by the time of the backend's own kernel on the whole sequence (the same total work,
and with a causal mask the same causal work): the ring's cost over ideal. Virtual ranks are threads, each
on its own stream, driving :func:`xcp.ring_forward` / :func:`xcp.ring_backward` directly (on a GPU,
autograd runs every backward on one device thread, where a rank waiting for its neighbour would block the
others). Nothing here asserts anything about time.

``--ulysses U[,U...]`` times the hybrid all-to-all + ring (``xcp.attention(..., ulysses=U)``) the same way:
each virtual rank drives :func:`xcp.hybrid.hybrid_forward` / ``hybrid_backward`` (U = 1: the ring alone),
checked against the whole-sequence kernel before it is timed, with the bytes each rank sent in the
all-to-alls and the ring, counted at its communicators and compared with :func:`xcp.hybrid.hybrid_traffic`.

``--host`` measures the host side alone: the microseconds one ring step of one rank costs on the host (Python,
checks, launches, hand-offs, events, exchanges), with block kernels that return outputs computed once
(:class:`NullKernels`), beside issue 14's targets; and, in the same run, a world of one (``xcp.attention``
without a group) against torch SDPA (``--world-of-one`` alone runs only that).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import schedule
from ..comm import LocalWorld, SingleRank
from ..documents import document_plan
from ..hybrid import HybridConfig, hybrid_backward, hybrid_config, hybrid_forward, hybrid_traffic
from ..lifetime import track_buffers
from ..ring import RingConfig, ring_backward, ring_forward
from ..traffic import ring_traffic
from . import packing, windows
from .common import (
    DTYPES,
    MEASUREMENT_FLAGS,
    REL_TOLERANCE,
    ULYSSES_FLAG,
    ULYSSES_HELP,
    Clock,
    Measurement,
    Problem,
    add_problem_flags,
    apply_size_defaults,
    attention_bytes,
    attention_flops,
    check_hybrid_seq,
    check_memory,
    device_peak,
    error,
    human_bytes,
    measurement_args,
    median,
    positive,
    pyplot,
    random_inputs,
    size_help,
    tool_backend,
    whole_kernel,
    whole_varlen,
    whole_window,
    write_json,
)

HOST_TOKENS = 16
"""Tokens per rank of the host figure's default problem."""
HOST_TARGETS_US = {"fwd": 50.0, "bwd": 100.0}
"""Issue 14's targets for the host work of one ring step of one rank, forward and backward (printed beside
the figures; nothing asserts them)."""
HOST_CALLS = 10
"""Forward+backward calls of every rank in one repetition of the host figure."""
HOST_MIN_REPS = 5
"""The host and world-of-one figures are medians of at least this many repetitions, whatever ``--reps``."""
WORLD_OF_ONE_SEQS = [1024, 4096]
"""``--seqs`` of the world-of-one figure when none are given (on a device and on the CPU alike)."""

REPLAY_FLAG = "--replay"
REPLAY_HELP = (
    "besides the eager times, replay each ring as one device graph that holds every rank's work (the ranks' "
    "threads issue it on their streams, which fork from the capture stream and join it) against the "
    "whole-sequence call replayed as a graph too, checked first: the ring's device time without the host, "
    "what ranks whose host keeps ahead of the device (or that replay captured step loops) would see"
)


@dataclass
class BenchConfig(Measurement):
    """What to measure; the defaults are the H200 grid of issue 5."""

    worlds: list[int] = field(default_factory=lambda: [2, 4, 8])
    causal: list[bool] = field(default_factory=lambda: [False, True])
    memory_worlds: list[int] = field(default_factory=lambda: [2, 4, 8])
    graph: bool = True
    check: bool = True
    sizes_note: str | None = None  # which device-dependent size defaults were used, for the header
    documents: str | None = None
    """``--documents`` as given (lengths, or ``longtail:MIN:MAX[:SEED]``): time the ring over packed documents
    against one whole-sequence varlen call instead of the dense figures; None: the dense bench."""
    compare_dense: bool = False
    """With ``documents`` or ``window``: also time the dense ring at the same S, P and masks (its ratio is
    printed beside)."""
    window: str | None = None
    """``--window`` as given (``L,R``): time the ring under the sliding window (over ``documents`` if given)
    against one whole-sequence windowed varlen call, with the steps and bytes sent per rank; None: no window."""
    host: bool = False
    """``--host``: instead of the dense grid, the host microseconds per forward and backward ring step of one
    rank for each of ``worlds`` (kernels that compute nothing), then the world-of-one figure."""
    world_of_one: bool = False
    """``--world-of-one`` (implied by ``host``): xcp.attention without a group against torch SDPA at ``seqs``."""
    host_tokens: int = HOST_TOKENS
    """Tokens per rank of the host figure (tiny: the figure is about the host, not the kernels)."""
    ulysses: list[int] | None = None
    """``--ulysses``: instead of the dense grid, the hybrid all-to-all + ring for each U (dividing every P of
    ``worlds`` and ``heads``) against one whole-sequence kernel call, with the bytes each rank sends."""
    replay: bool = False
    """``--replay``: besides the eager times, each ring row replayed as one device graph holding every rank's
    work, against the whole-sequence call replayed as a graph too (the ring's device time without the host)."""

    def window_sides(self) -> tuple[int | None, int | None] | None:
        if self.window is None:
            return None
        try:
            return windows.parse_window(self.window)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{windows.FLAG}: {exc}") from None

    def balance_for(self, world: int, causal: bool, cu: tuple[int, ...] | None = None, seq: int | None = None) -> str:
        """The balance of one figure: ``balance``, or with ``auto`` what xcp.choose_balance recommends for it
        (``cu``: the documents, if any; ``seq``: S, with a window)."""
        window = windows.check(self.window_sides(), causal)
        return windows.resolve_balance(self.balance, world, causal, window, cu, seq)

    def document_spec(self) -> packing.DocumentSpec | None:
        if self.documents is None:
            return None
        try:
            return packing.parse_documents(self.documents)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{packing.FLAG}: {exc}") from None

    def validate(self) -> None:
        """Raise a ValueError naming the first field that cannot be measured."""
        if self.replay and (self.host or self.world_of_one):
            flag = "--host" if self.host else "--world-of-one"
            raise ValueError(f"{REPLAY_FLAG}: applies to the ring timings, not to {flag} (a replay has no host "
                             "work to measure)")  # fmt: skip
        if self.host or self.world_of_one:
            return self._validate_host()
        if self.ulysses is not None and (self.documents is not None or self.window is not None):
            name = packing.FLAG if self.documents is not None else windows.FLAG
            raise ValueError(f"{name}: not measured with {ULYSSES_FLAG} yet; got {self.documents or self.window!r}")
        if self.balance not in windows.BALANCE_CHOICES:
            raise ValueError(f"--balance: expected one of {', '.join(windows.BALANCE_CHOICES)}; got {self.balance!r}")
        split_by = windows.check_balance(self.balance)  # auto: at least a multiple of P
        window = self.window_sides()
        if window is not None:
            for causal in self.causal:
                windows.check(window, causal)
            if self.batch != 1:
                raise ValueError(f"--batch: expected 1 with --window (the ring plans it as one packed sequence); "
                                 f"got {self.batch}")  # fmt: skip
        spec = self.document_spec()
        if spec is not None:  # first, so that a sum the balance cannot split is named by --documents
            if self.batch != 1:
                raise ValueError(f"--batch: expected 1 with --documents (the packed layout); got {self.batch}")
            for s in self.seqs:
                for p in self.worlds:
                    packing.resolve_lengths(spec, s, p, split_by, "--seqs")
        for name in ("seqs", "worlds", "memory_worlds"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}: expected a non-empty list of integers >= 1; got {values!r}")
        for name in ("batch", "heads", "kv_heads", "head_dim", "reps", "memory_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1; got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an integer >= 0; got {self.warmup!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads={self.heads}; got {self.kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.ulysses is not None:
            return self._validate_ulysses()
        for s in self.seqs:
            for p in self.worlds:
                if split_by == "zigzag" and s % (2 * p):
                    raise ValueError(f"seqs: {s} is not a multiple of 2 x world {p} (zigzag needs it)")
                if s % schedule.required_multiple(p, split_by):
                    multiple = schedule.required_multiple(p, split_by)
                    raise ValueError(f"seqs: {s} is not a multiple of {multiple} (balance {self.balance!r} over {p} "
                                     "ranks needs it)")  # fmt: skip

    def _validate_ulysses(self) -> None:
        """The checks of ``--ulysses``: every U divides every P and the heads, and every S can be placed by
        ``xcp.shard(..., ulysses=U)`` (split by the balance over R = P/U, and by P)."""
        values = self.ulysses
        if not values or any(not isinstance(u, int) or u < 1 for u in values):
            raise ValueError(f"{ULYSSES_FLAG}: expected a non-empty list of integers >= 1; got {values!r}")
        for u in values:
            for p in self.worlds:
                if p % u:
                    raise ValueError(
                        f"{ULYSSES_FLAG}: expected divisors of every --worlds value (P = U x R); {u} does not divide "
                        f"{p} (give --worlds with multiples of {u}, or leave {u} out)"
                    )
            if self.heads % u:
                raise ValueError(f"{ULYSSES_FLAG}: expected divisors of --heads {self.heads} (each rank of a head "
                                 f"group takes heads / U of them); got {u}")  # fmt: skip
        for s in self.seqs:
            for p in self.worlds:
                for u in values:
                    balance = windows.resolve_balance(self.balance, p // u, True, None, None)
                    check_hybrid_seq(s, p, u, balance, "--seqs")

    def _validate_host(self) -> None:
        """The checks of ``--host`` / ``--world-of-one``: the dense grid's flags that do not apply are refused,
        and every world must shard ``host_tokens`` per rank with a balance where each rank computes a block at
        every step (the per-step figure is the time between a rank's kernel calls)."""
        flag = "--host" if self.host else "--world-of-one"
        if self.documents is not None or self.window is not None:
            name = packing.FLAG if self.documents is not None else windows.FLAG
            raise ValueError(f"{name}: not measured with {flag}; got {self.documents or self.window!r}")
        for name in ("batch", "heads", "kv_heads", "head_dim", "reps", "host_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1; got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an integer >= 0; got {self.warmup!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads={self.heads}; got {self.kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not self.seqs or any(not isinstance(v, int) or v < 1 for v in self.seqs):
            raise ValueError(f"seqs: expected a non-empty list of integers >= 1; got {self.seqs!r}")
        if not self.host:
            return
        if not self.worlds or any(not isinstance(v, int) or v < 2 for v in self.worlds):
            raise ValueError(f"--worlds: expected integers >= 2 with --host (a ring of one rank has no steps); "
                             f"got {self.worlds!r}")  # fmt: skip
        for p in self.worlds:
            balance = windows.resolve_balance(self.balance, p, True, None, None)
            if balance == "contiguous" and True in self.causal:
                raise ValueError("--balance: expected zigzag or stripe with --host and a causal mask (contiguous "
                                 "ranks skip steps, the figure times every step); got 'contiguous'")  # fmt: skip
            multiple = schedule.required_multiple(p, balance)
            if (self.host_tokens * p) % multiple:
                raise ValueError(f"--host-tokens: expected a multiple of {multiple // math.gcd(multiple, p)} "
                                 f"(balance {balance!r} over {p} ranks); got {self.host_tokens}")  # fmt: skip


def ratio(ring_seconds: float, reference_seconds: float) -> float:
    """Overhead ratio: ring time over the whole-sequence kernel time (1.0 is ideal)."""
    if reference_seconds <= 0:
        raise ValueError(f"reference_seconds: expected a positive time; got {reference_seconds!r}")
    return ring_seconds / reference_seconds


class VirtualRing:
    """P virtual ranks on one device, each a thread with its own stream, sharing pre-sharded inputs. With
    ``ulysses`` = U > 1 each rank runs the hybrid (:func:`xcp.hybrid.hybrid_forward` / ``hybrid_backward``:
    head groups of U ranks, rings of R = P/U), the inputs sharded by ``xcp.shard(..., ulysses=U)``."""

    def __init__(
        self,
        backend,
        world: int,
        full: tuple[torch.Tensor, ...],
        causal: bool,
        balance: str,
        slots="bounded",
        documents: tuple[int, ...] | None = None,
        window: tuple[int, int | None] | None = None,
        ulysses: int = 1,
    ):
        from ..api import shard

        self.backend, self.world_size, self.causal, self.balance, self.slots = backend, world, causal, balance, slots
        self.window, self.ulysses = window, ulysses
        seq = full[0].shape[1]
        self.documents = (0, seq) if documents is None and window is not None else documents  # a window needs them
        self.sent: list[dict[str, int]] = [{} for _ in range(world)]
        """Bytes each rank sent in the last run, per tag (``kv``, ``dkv``; ``a2a`` for the hybrid's all-to-alls)."""
        self.device = full[0].device
        self.world = LocalWorld(world, device=self.device)
        self.shards = [tuple(shard(x, world, r, balance=balance, ulysses=ulysses) for x in full) for r in range(world)]
        self.streams = [backend.new_stream(self.device) for _ in range(world)]
        self.scale = 1.0 / math.sqrt(full[0].shape[-1])
        self.ledgers: list[Any] = [None] * world

    def _rank(self, group, backward: bool, main_stream) -> Any:
        be = self.backend
        stream = self.streams[group.rank()]
        be.wait_stream(stream, main_stream)
        q, k, v, dout = self.shards[group.rank()]
        if self.ulysses > 1:
            return self._hybrid_rank(group, backward, stream, q, k, v, dout)
        comm = _Counted(group, self.sent[group.rank()])
        cfg = RingConfig(comm, be, self.causal, self.scale, self.balance, self.slots, documents=self.documents,
                         window=self.window)  # fmt: skip
        with be.stream_context(stream), track_buffers() as ledger:
            out, lse = ring_forward(q, k, v, cfg)
            grads = ring_backward(dout, q, k, v, out, lse, cfg) if backward else None
        self.ledgers[group.rank()] = ledger
        return stream, out, grads

    def _hybrid_rank(self, group, backward: bool, stream, q, k, v, dout) -> Any:
        be, sent = self.backend, self.sent[group.rank()]
        with be.stream_context(stream), track_buffers() as ledger:
            cfg = hybrid_config(q, k, group, be, self.ulysses, causal=self.causal, scale=self.scale,
                                balance=self.balance, slots=self.slots, cu_seqlens=self.documents,
                                window=self.window)  # fmt: skip
            ring = dataclasses.replace(cfg.ring, comm=_Counted(cfg.ring.comm, sent))
            cfg = HybridConfig(_Counted(cfg.head, sent), ring, cfg.ulysses, cfg.replicas)
            out, state = hybrid_forward(q, k, v, cfg)
            grads = hybrid_backward(dout, state, cfg) if backward else None
            del state
        self.ledgers[group.rank()] = ledger
        return stream, out, grads

    def run(self, backward: bool) -> list[Any]:
        """One forward (and backward) of every rank; the caller's stream waits for all of them."""
        main = self.backend.current_stream(self.device)
        for sent in self.sent:
            sent.clear()
        results = self.world.run(self._rank, backward, main)
        for stream, _, _ in results:
            self.backend.wait_stream(main, stream)
        return results


class _Counted:
    """A rank's communicator that adds up the bytes it sends to other ranks, per tag, into ``sent``; the rest
    is the wrapped communicator's (the ring needs rank, size, rank_store and exchange; the hybrid's head
    group all_to_all, of whose U rows the rank sends U - 1 and keeps its own)."""

    def __init__(self, comm, sent: dict[str, int]) -> None:
        self._comm, self.sent = comm, sent
        self.ranks_are_threads = comm.ranks_are_threads

    def rank(self) -> int:
        return self._comm.rank()

    def size(self) -> int:
        return self._comm.size()

    def rank_store(self) -> dict:
        return self._comm.rank_store()

    def exchange(self, sends, recvs, tag, backend, step=None):
        for tensor, _peer in sends:
            self.sent[tag] = self.sent.get(tag, 0) + tensor.numel() * tensor.element_size()
        return self._comm.exchange(sends, recvs, tag, backend, step)

    def all_to_all(self, send, recv, tag, backend, step=None):
        row = send[0].numel() * send.element_size()
        self.sent[tag] = self.sent.get(tag, 0) + row * (send.shape[0] - 1)
        return self._comm.all_to_all(send, recv, tag, backend, step)


def check_againstwhole_kernel(ring: VirtualRing, results, whole_out, whole_grads) -> dict[str, float]:
    """Relative errors of the ring's out (and grads) against the whole-sequence kernel."""
    from ..api import unshard

    u = ring.ulysses
    errs = {"out": error(unshard([r[1] for r in results], balance=ring.balance, ulysses=u), whole_out).rel}
    if whole_grads is not None:
        for i, name in enumerate(("dq", "dk", "dv")):
            errs[name] = error(unshard([r[2][i] for r in results], balance=ring.balance, ulysses=u), whole_grads[i]).rel
    return errs


def _run_work(
    work: list[tuple[str, Callable[[], None]]], report: dict[str, Any], progress: bool, checkpoint: str | None
) -> dict[str, Any]:
    """Run each measurement of ``work`` in order, with the progress bar and the checkpoint after each; return
    ``report`` (which the measurements fill)."""
    for step, (label, measure) in enumerate(work):
        if progress:
            _progress(step, len(work), label)
        measure()
        if checkpoint:
            write_json(report, checkpoint)
    if progress:
        _progress(len(work), len(work), "done")
    return report


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def estimate_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of the run and what needs it: the whole-sequence kernel at the largest seq, or
    the ring at the memory figure's length over the fewest ranks. The math kernel (the cpu backend's, and a
    device's for float64) materialises scores; fused device kernels are linear in the length."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    seq, world = max(cfg.seqs), min(cfg.memory_worlds)
    candidates = [
        (attention_bytes(problem, seq, 1, quadratic), f"fwd+bwd on the whole sequence at S={seq}"),
        (
            attention_bytes(problem, cfg.memory_seq, world, quadratic),
            f"the memory figure at S={cfg.memory_seq}, P={world}",
        ),
    ]
    needed, what = max(candidates)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}"
    return needed, f"{what}, {shape}"


def run_bench(cfg: BenchConfig, progress: bool = True, checkpoint: str | None = None) -> dict[str, Any]:
    """Measure every figure of ``cfg``; returns a JSON-ready dict (rows of timing, memory and graph).

    :param checkpoint: a JSON path rewritten after every figure, so a run cut short keeps what it measured.
    :raises ValueError: a field cannot be measured, or the run would need more memory than there is.
    """
    cfg.validate()
    backend, device = tool_backend(cfg.device, 0)
    if cfg.replay and backend.new_graph() is None:
        raise ValueError(f"{REPLAY_FLAG}: needs a backend with device graphs (cuda has them); backend "
                         f"{backend.name!r} has none")  # fmt: skip
    if cfg.host or cfg.world_of_one:
        return _run_host(cfg, backend, device, progress, checkpoint)
    if cfg.ulysses is not None:
        return _run_ulysses(cfg, backend, device, progress, checkpoint)
    if cfg.documents is not None or cfg.window is not None:
        return _run_documents(cfg, backend, device, progress, checkpoint)
    check_memory(backend, device, *estimate_bytes(cfg, device.type))
    clock = Clock(backend, device)
    jobs = [(s, p, c) for s in cfg.seqs for c in cfg.causal for p in cfg.worlds]
    report: dict[str, Any] = {"meta": _meta(cfg, backend, device), "timing": [], "memory": [], "graph": None}
    work: list[tuple[str, Callable[[], None]]] = []
    # memory and graph first: they are quick, and a run cut short keeps them
    for world in cfg.memory_worlds:
        for policy in ("bounded", "keep_all"):
            row = (cfg, backend, device, world, policy)
            work.append((f"memory P={world} {policy}", lambda r=row: report["memory"].append(_memory_one(*r))))
    if cfg.graph:
        work.append(("graph capture", lambda: report.__setitem__("graph", _graph_one(cfg, backend, clock, device))))
    for seq, world, causal in jobs:
        row = (cfg, backend, clock, device, seq, world, causal)
        label = f"S={seq} P={world} {'causal' if causal else 'full'}"
        work.append((label, lambda r=row: report["timing"].append(_time_one(*r))))
    return _run_work(work, report, progress, checkpoint)


def _meta(cfg: BenchConfig, backend, device: torch.device) -> dict[str, Any]:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None),
        "backend": backend.name,
        "kernel": backend.kernel,
        "config": asdict(cfg),
    }
    if device.type != "cpu":
        meta["device_name"] = torch.get_device_module(device.type).get_device_name(device)
    return meta


def _time_one(cfg, backend, clock, device, seq, world, causal) -> dict[str, Any]:
    full = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, world, causal, None, None)  # dense: auto is zigzag
    ring = VirtualRing(backend, world, full, causal, balance)
    row: dict[str, Any] = {"seq": seq, "world": world, "causal": causal, "balance": balance}
    flops = {b: attention_flops(cfg.batch, seq, cfg.heads, cfg.head_dim, causal, b) for b in (False, True)}
    return _measure(cfg, clock, ring, lambda b: whole_kernel(backend, full, causal, b), flops, row)


def _measure(cfg, clock, ring: VirtualRing, whole: Callable[[bool], Any], flops: dict[bool, float], row):
    """Check the ring against ``whole(backward)`` (the yardstick), then time both, interleaved: the median
    times, their ratio and the ring's throughput for ``flops[backward]``, into ``row``."""
    for mode, backward in (("fwd", False), ("fwd_bwd", True)):
        whole_out, whole_grads = whole(backward)
        _check_into(cfg, row, mode, ring, ring.run(backward), whole_out, whole_grads)
        del whole_out, whole_grads
        for _ in range(cfg.warmup):
            whole(backward)
            ring.run(backward)
        _time_into(cfg, clock, row, mode, lambda b=backward: whole(b), lambda b=backward: ring.run(b))
        row[f"{mode}_ring_tflops"] = flops[backward] / row[f"{mode}_ring_s"] / 1e12
        row[f"{mode}_sent_bytes"] = [dict(sent) for sent in ring.sent]  # per rank and tag, in the last run
        if cfg.replay:
            _measure_replay(cfg, clock, ring, whole, backward, row, f"{mode}_replay")
    return row


def _check_into(cfg, row, run: str, ring: VirtualRing, results, whole_out, whole_grads) -> None:
    """With ``cfg.check``: the ring's ``results`` against the yardstick's, as ``{run}_errors`` and
    ``{run}_check_ok`` of ``row``."""
    if cfg.check:
        errs = check_againstwhole_kernel(ring, results, whole_out, whole_grads)
        row[f"{run}_errors"] = errs
        row[f"{run}_check_ok"] = all(math.isfinite(e) and e <= cfg.check_tolerance for e in errs.values())


def _time_into(cfg, clock, row, run: str, reference: Callable[[], Any], ring: Callable[[], Any]) -> None:
    """``reference`` and ``ring`` timed ``cfg.reps`` times, interleaved (so drifts in clock or temperature hit
    both alike): their medians and ratio as ``{run}_ref_s``, ``{run}_ring_s`` and ``{run}_ratio`` of ``row``."""
    ref_t, ring_t = [], []
    for _ in range(cfg.reps):
        ref_t.append(clock.time(reference))
        ring_t.append(clock.time(ring))
    row[f"{run}_ref_s"] = median(ref_t)
    row[f"{run}_ring_s"] = median(ring_t)
    row[f"{run}_ratio"] = ratio(row[f"{run}_ring_s"], row[f"{run}_ref_s"])


def _measure_replay(cfg, clock, ring: VirtualRing, whole: Callable[[bool], Any], backward: bool, row, run: str):
    """The ring and ``whole`` each captured into a device graph and replayed: checked like the eager run, then
    timed, interleaved, into ``row`` (as ``run``). The graph of the ring holds every rank's work: the ranks'
    threads issue it on their streams, which fork from the capture stream and join it again, as they fork
    from and join the caller's stream eagerly. Called after the eager warm-up, so the ring's slots are in the
    workspace and the kernels are built (nothing is allocated or compiled while capturing)."""
    be = ring.backend
    whole_graph, ring_graph = be.new_graph(), be.new_graph()
    with be.capture_graph(whole_graph):
        whole_out, whole_grads = whole(backward)
    with be.capture_graph(ring_graph):
        results = ring.run(backward)
    whole_graph.replay()
    ring_graph.replay()
    _check_into(cfg, row, run, ring, results, whole_out, whole_grads)
    del whole_out, whole_grads, results
    _time_into(cfg, clock, row, run, whole_graph.replay, ring_graph.replay)


# ---------------------------------------------------------------------------------------- hybrid (--ulysses)
def _run_ulysses(cfg: BenchConfig, backend, device, progress: bool, checkpoint: str | None) -> dict[str, Any]:
    """The figures of ``--ulysses``: per (S, P, mask) and each U, the hybrid over P virtual ranks against one
    whole-sequence kernel call, checked first, with the bytes each rank sent against the formula."""
    quadratic = device.type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    seq = max(cfg.seqs)  # the whole-sequence call (and U = P, whose ranks each compute S x S for H/P heads)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}"
    check_memory(backend, device, attention_bytes(problem, seq, 1, quadratic), f"fwd+bwd at S={seq}, {shape}")
    clock = Clock(backend, device)
    report: dict[str, Any] = {"meta": _meta(cfg, backend, device), "timing": [], "memory": [], "graph": None,
                              "ulysses": []}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    assert cfg.ulysses is not None
    for seq in cfg.seqs:
        for causal in cfg.causal:
            for world in cfg.worlds:
                for u in cfg.ulysses:
                    row = (cfg, backend, clock, device, seq, world, causal, u)
                    work.append((f"S={seq} P={world} U={u} {'causal' if causal else 'full'}",
                                 lambda r=row: report["ulysses"].append(_time_ulysses(*r))))  # fmt: skip
    return _run_work(work, report, progress, checkpoint)


ULYSSES_TAGS = ("a2a", "kv", "dkv")
"""What a rank of the hybrid sends: the all-to-alls (q, k, v, out; dout, dq, dk, dv), the ring's K/V shards
and its dK/dV."""


def ulysses_formula(t) -> dict[str, dict[str, int]]:
    """Bytes per rank and tag of one forward (``fwd``) and one forward+backward (``fwd_bwd``) by the formula
    (:class:`xcp.hybrid.HybridTraffic`)."""
    fwd = {"a2a": t.forward_alltoall, "kv": t.forward_ring, "dkv": 0}
    fwd_bwd = {"a2a": t.forward_alltoall + t.backward_alltoall, "kv": t.forward_ring + t.backward_ring_kv,
               "dkv": t.backward_ring_dkv}  # fmt: skip
    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def _time_ulysses(cfg, backend, clock, device, seq, world, causal, ulysses) -> dict[str, Any]:
    full = random_inputs(cfg, seq, device)
    rings = world // ulysses
    balance = windows.resolve_balance(cfg.balance, rings, causal, None, None)  # dense: auto is zigzag
    ring = VirtualRing(backend, world, full, causal, balance, ulysses=ulysses)
    t = hybrid_traffic(cfg.batch, seq, cfg.heads, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype], world, ulysses)
    row: dict[str, Any] = {"seq": seq, "world": world, "ulysses": ulysses, "ring": rings, "causal": causal,
                           "balance": balance, "sent_formula": ulysses_formula(t)}  # fmt: skip
    flops = {b: attention_flops(cfg.batch, seq, cfg.heads, cfg.head_dim, causal, b) for b in (False, True)}
    row = _measure(cfg, clock, ring, lambda b: whole_kernel(backend, full, causal, b), flops, row)
    row["sent_ok"] = all(  # every rank sent what the formula says, per tag, in the last forward and fwd+bwd runs
        sent.get(tag, 0) == row["sent_formula"][mode][tag] and set(sent) <= set(ULYSSES_TAGS)
        for mode in ("fwd", "fwd_bwd")
        for sent in row[f"{mode}_sent_bytes"]
        for tag in ULYSSES_TAGS
    )
    return row


def _format_ulysses(report: dict[str, Any]) -> list[str]:
    """The table of the hybrid for each U against one whole-sequence kernel call, with the bytes per rank."""
    rows = report["ulysses"]
    lines = [
        "",
        *_wrap(
            "hybrid all-to-all + ring (--ulysses): P virtual ranks = U x R (head groups of U consecutive ranks, "
            "rings of R = P/U), each driving xcp.hybrid.hybrid_forward / hybrid_backward (U = 1: the ring alone), "
            "checked against one whole-sequence kernel call before it is timed; ratio = hybrid / that call. Bytes: "
            "what each rank sent in one fwd+bwd, counted at its communicators (the all-to-alls; the ring's K/V and "
            "dK/dV), checked against xcp.hybrid.hybrid_traffic (as xcp plan --ulysses prints it)"
        ),
        "",
        f"{'S':>8} {'P':>3} {'U':>3} {'R':>3} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | {'a2a/rank':>10} {'ring/rank':>10} "
        f"{'total/rank':>10} | check",
    ]
    for r in rows:
        f = r["sent_formula"]["fwd_bwd"]
        mask = "causal" if r["causal"] else "full"
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {r['ulysses']:>3} {r['ring']:>3} {mask:>6} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} | "
            f"{human_bytes(f['a2a']):>10} {human_bytes(f['kv'] + f['dkv']):>10} "
            f"{human_bytes(f['a2a'] + f['kv'] + f['dkv']):>10} | {_check_text(r)}"
            + ("" if r.get("sent_ok", True) else " bytes MEASURED OTHERWISE")
        )
    lines += _wrap(
        "check: out, dq, dk, dv against the whole-sequence call (relative 2-norm error), and every rank's bytes "
        "per tag equal to the formula, in the forward and in the forward+backward"
    )
    return lines


# ---------------------------------------------------------------------------------------- packed documents
def estimate_documents_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of a run with documents: the inputs, outputs and gradients at the largest S
    and, for a math kernel, the scores of the longest document (the varlen default computes one document
    segment at a time) on every virtual rank at once; with ``compare_dense``, the dense figure's too."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    spec = cfg.document_spec()
    seq, world = max(cfg.seqs), max(cfg.worlds)
    if spec is None:  # a window over one sequence: the whole-sequence call is one segment of S
        longest = seq
    else:
        longest = min(seq, max(spec.lengths) if spec.lengths is not None else spec.high)
    acc = 8 if cfg.dtype == "float64" else 4
    scores = 4 * cfg.heads * longest**2 * acc * max(world, 2) if quadratic else 0
    needed = attention_bytes(problem, seq, 1, False) + scores
    what = f"fwd+bwd over {'documents' if spec else 'segments'} of up to {longest} tokens at S={seq}, P={world}"
    if cfg.compare_dense:
        dense = attention_bytes(problem, seq, 1, quadratic)
        if dense > needed:
            needed, what = dense, f"the dense comparison: fwd+bwd on the whole sequence at S={seq}"
    return needed, f"{what}, B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}"


def _run_documents(cfg: BenchConfig, backend, device, progress: bool, checkpoint: str | None) -> dict[str, Any]:
    """The figures of ``--documents`` and/or ``--window``: per (S, P, mask) the ring over packed documents
    (under the window) against one whole-sequence varlen call, each rank's share of the work, the steps and
    bytes sent per rank, and (``compare_dense``) the dense ring."""
    check_memory(backend, device, *estimate_documents_bytes(cfg, device.type))
    clock = Clock(backend, device)
    spec = cfg.document_spec()
    report: dict[str, Any] = {"meta": _meta(cfg, backend, device), "timing": [], "documents": [], "memory": [],
                              "graph": None}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    for seq in cfg.seqs:
        for causal in cfg.causal:
            for world in cfg.worlds:
                mask = "causal" if causal else "full"
                row = (cfg, backend, clock, device, seq, world, causal, spec)
                what = "window" if cfg.window is not None else "documents"
                work.append((f"{what} S={seq} P={world} {mask}",
                             lambda r=row: report["documents"].append(_time_documents(*r))))  # fmt: skip
                if cfg.compare_dense:
                    row = (cfg, backend, clock, device, seq, world, causal)
                    work.append((f"dense S={seq} P={world} {mask}",
                                 lambda r=row: report["timing"].append(_time_one(*r))))  # fmt: skip
    return _run_work(work, report, progress, checkpoint)


def _time_documents(cfg, backend, clock, device, seq, world, causal, spec) -> dict[str, Any]:
    lengths = (seq,) if spec is None else spec.draw(seq)
    cu = packing.boundaries(lengths)
    window = windows.check(cfg.window_sides(), causal)
    balance = cfg.balance_for(world, causal, None if spec is None else cu, seq)
    full = random_inputs(cfg, seq, device)
    ring = VirtualRing(backend, world, full, causal, balance, documents=None if spec is None else cu, window=window)
    pairs = windows.rank_pairs(cu, world, causal, balance, window)
    total = sum(pairs)
    steps = len(document_plan(cu, world, 0, causal, balance, window).steps)
    row: dict[str, Any] = {
        "seq": seq,
        "world": world,
        "causal": causal,
        "balance": balance,
        "documents": len(lengths) if spec is not None else None,
        "longest": max(lengths),
        "shortest": min(lengths),
        "ring_steps": steps,
        "work_pairs": pairs,
        "work_share": [p / total for p in pairs],
        "work_max_over_mean": packing.max_over_mean(pairs),
    }
    dtype = full[0].dtype
    for name, m in (("ring", steps), ("dense", world)):  # what each rank sends, by the formula
        t = ring_traffic(seq, world, m, cfg.kv_heads, cfg.head_dim, dtype, cfg.batch)
        row[f"{name}_sent_formula"] = {"steps": m, "fwd": t.forward, "fwd_bwd": t.total, "kv_shard": t.kv_shard,
                                       "dkv_message": t.dkv_message}  # fmt: skip
    flops = {b: 4.0 * cfg.heads * cfg.head_dim * total * (3.5 if b else 1.0) for b in (False, True)}
    if window is None:
        return _measure(cfg, clock, ring, lambda b: whole_varlen(backend, full, cu, causal, b), flops, row)
    row["window"] = windows.text_of(window)
    row["recommended"] = windows.resolve_balance(windows.AUTO, world, causal, window, None if spec is None else cu, seq)
    row["recommended_steps"] = windows.ring_steps(cu, world, causal, row["recommended"], window)
    row = _measure(cfg, clock, ring, lambda b: whole_window(backend, full, cu, causal, window, b), flops, row)
    formula = row["ring_sent_formula"]
    row["sent_ok"] = all(  # every rank sent what the formula says, in the last forward and fwd+bwd runs
        sum(sent.values()) == formula[mode] for mode in ("fwd", "fwd_bwd") for sent in row[f"{mode}_sent_bytes"]
    )
    return row


def _memory_one(cfg, backend, device, world, policy) -> dict[str, Any]:
    seq = cfg.memory_seq - cfg.memory_seq % (2 * world)
    full = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, world, True, None, None)
    ring = VirtualRing(backend, world, full, True, balance, policy)
    device_bytes = device_peak(backend, device, lambda: ring.run(backward=True))
    shard_bytes = 2 * full[1].numel() * full[1].element_size() // world
    row = {
        "seq": seq,
        "world": world,
        "policy": policy,
        "kv_shard_bytes": shard_bytes,
        "peak_kv_shards": max(led.peak_kv_shards for led in ring.ledgers),
        "peak_ring_bytes_per_rank": max(led.peak_bytes for led in ring.ledgers),
    }
    if device_bytes is not None:
        row["device_peak_over_start_bytes"] = device_bytes
    return row


def _graph_one(cfg, backend, clock, device) -> dict[str, Any] | None:
    """Captured forward of a world of one (the whole ring loop, merge included) against eager; None where
    the backend has no device graphs."""
    graph = backend.new_graph()
    if graph is None:
        return None
    seq = min(cfg.seqs)
    q, k, v, _ = random_inputs(cfg, seq, device)
    balance = windows.resolve_balance(cfg.balance, 1, True, None, None)
    rcfg = RingConfig(SingleRank(), backend, True, 1.0 / math.sqrt(cfg.head_dim), balance)
    side, main = backend.new_stream(device), backend.current_stream(device)
    backend.wait_stream(side, main)
    with backend.stream_context(side):  # warm up off the capture stream
        for _ in range(2):
            ring_forward(q, k, v, rcfg)
    backend.wait_stream(main, side)
    with backend.capture_graph(graph):
        captured_out, _ = ring_forward(q, k, v, rcfg)
    graph.replay()
    eager_out, _ = ring_forward(q, k, v, rcfg)
    same = torch.equal(captured_out, eager_out)
    eager = median([clock.time(lambda: ring_forward(q, k, v, rcfg)) for _ in range(cfg.reps)])
    replay = median([clock.time(graph.replay) for _ in range(cfg.reps)])
    return {
        "seq": seq,
        "world": 1,
        "eager_s": eager,
        "replay_s": replay,
        "speedup": eager / replay,
        "same_output": same,
    }


# ------------------------------------------------------------------- host time per ring step (issue 14)
class NullKernels:
    """A backend whose block kernels compute nothing: each call returns the outputs the wrapped backend's
    kernel gave the first time it saw a call of the same kind, mask, shapes and dtypes (the priming run
    computes them), so a ring step costs what it costs on the host — the loop's Python, the merge and the
    accumulations launched (on tiny tensors), the hand-offs, events and exchanges — and no kernel time.
    Everything else (streams, events, merge, identity) is the wrapped backend's.

    While ``recording``, each kernel call appends ``(kind, thread CPU ns, wall ns)`` to the calling thread's
    list in ``stamps`` (kind ``fwd`` or ``bwd``): one stamp per ring step of that rank, taken on entry, so the
    time between two stamps of one pass is one whole iteration of the ring's step loop.
    """

    def __init__(self, backend) -> None:
        self._backend = backend
        for name in dir(type(backend)):  # bound once: a step looks them up in this instance, not through __getattr__
            if not name.startswith("__") and name not in ("forward", "backward"):
                self.__dict__[name] = getattr(backend, name)
        self._outputs: dict[tuple, Any] = {}
        self.stamps: dict[int, list[tuple[str, int, int]]] = {}
        self.recording = False
        self.computed = 0
        """Kernel calls the wrapped backend actually ran (the priming run's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _stamp(self, kind: str) -> None:
        if self.recording:
            self.stamps.setdefault(threading.get_ident(), []).append(
                (kind, time.thread_time_ns(), time.perf_counter_ns())
            )

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        got = self._outputs.get(key)
        if got is None:
            got = self._outputs[key] = compute()
            self.computed += 1
        return got

    def forward(self, q, k, v, mask, scale):
        self._stamp("fwd")
        key = ("fwd", mask, q.shape, k.shape, q.dtype, q.device)
        return self._cached(key, lambda: self._backend.forward(q, k, v, mask, scale))

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        self._stamp("bwd")
        key = ("bwd", mask, q.shape, k.shape, q.dtype, q.device)
        return self._cached(key, lambda: self._backend.backward(dout, q, k, v, out, lse, mask, scale))


def _host_rank(group, null: NullKernels, shards, streams, main_stream, causal: bool, balance: str, scale: float,
               calls: int):  # fmt: skip
    """One rank of the host figure: ``calls`` times ring_forward then ring_backward, as xcp.attention runs
    them (no ledger, no counting communicator), on the rank's own stream; returns the stream and the thread
    CPU ns of all the forward and all the backward calls."""
    r = group.rank()
    stream = streams[r]
    null.wait_stream(stream, main_stream)
    q, k, v, dout = shards[r]
    cfg = RingConfig(group, null, causal, scale, balance)  # type: ignore[arg-type]
    fwd = bwd = 0
    with null.stream_context(stream):
        for _ in range(calls):
            t0 = time.thread_time_ns()
            out, lse = ring_forward(q, k, v, cfg)
            t1 = time.thread_time_ns()
            ring_backward(dout, q, k, v, out, lse, cfg)
            t2 = time.thread_time_ns()
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return stream, fwd, bwd


class _Done:
    def wait(self) -> None:
        pass


class _Loopback:
    """The communicator of one rank's loop run alone: an exchange copies each sent tensor into the receive
    buffer of the same position and is complete at once (no peer, no thread, no wait), so the loop's host
    work is timed without the other ranks'."""

    ranks_are_threads = False

    def __init__(self, world: int, rank: int) -> None:
        self._world, self._rank, self._store = world, rank, {}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def rank_store(self) -> dict:
        return self._store

    def exchange(self, sends, recvs, tag, backend, step=None):
        for (sent, _), (buf, _) in zip(sends, recvs):
            buf.copy_(sent)
        return _Done()


def _per_step(stamps: list[tuple[str, int, int]], kind: str) -> tuple[list[int], float, float]:
    """A rank's passes of one kind (its kernel calls in each, in order) and the mean thread CPU and wall µs
    between consecutive kernel calls of one pass."""
    passes: list[list[tuple[int, int]]] = []
    previous = None
    for k, cpu, wall in stamps:
        if k == kind:
            if previous != kind:
                passes.append([])
            passes[-1].append((cpu, wall))
        previous = k
    gaps = sum(len(p) - 1 for p in passes)
    if not gaps:
        return [len(p) for p in passes], math.nan, math.nan
    cpu = sum(p[-1][0] - p[0][0] for p in passes) / gaps / 1e3
    wall = sum(p[-1][1] - p[0][1] for p in passes) / gaps / 1e3
    return [len(p) for p in passes], cpu, wall


def _host_one(cfg: BenchConfig, backend, device, world: int, causal: bool) -> dict[str, Any]:
    """The host figure of one (P, mask): per repetition, the mean over ranks of the thread CPU (and wall)
    µs between a rank's consecutive kernel calls, forward and backward; the medians over the repetitions.
    A repetition is one LocalWorld run in which every rank makes :data:`HOST_CALLS` forward+backward calls;
    a priming run computes the kernels' outputs once and makes the first-call agreement exchange."""
    from ..api import shard

    balance = windows.resolve_balance(cfg.balance, world, causal, None, None)
    seq = cfg.host_tokens * world
    full = random_inputs(cfg, seq, device)
    null = NullKernels(backend)
    lw = LocalWorld(world, device=device)
    shards = [tuple(shard(x, world, r, balance=balance) for x in full) for r in range(world)]
    streams = [backend.new_stream(device) for _ in range(world)]
    scale = 1.0 / math.sqrt(cfg.head_dim)
    steps = len(schedule.plan(world, 0, causal, balance).steps)

    def run() -> list[Any]:
        main = backend.current_stream(device)
        backend.synchronize(device)
        results = lw.run(_host_rank, null, shards, streams, main, causal, balance, scale, HOST_CALLS)
        for stream, _, _ in results:
            backend.wait_stream(main, stream)
        backend.synchronize(device)
        return results

    for _ in range(1 + cfg.warmup):
        run()
    computed = null.computed
    names = [f"{kind}_{what}" for kind in ("fwd", "bwd") for what in ("cpu", "wall", "call", "alone_cpu", "alone_wall")]
    samples: dict[str, list[float]] = {name: [] for name in names}
    calls_ok = True
    calls: dict[str, list[int]] = {}
    reps = max(cfg.reps, HOST_MIN_REPS)
    for _ in range(reps):
        null.stamps.clear()
        null.recording = True
        try:
            results = run()
        finally:
            null.recording = False
        per_rank = list(null.stamps.values())
        for kind in ("fwd", "bwd"):
            figures = [_per_step(s, kind) for s in per_rank]
            calls[kind] = [n for passes, _, _ in figures for n in passes]  # every pass of every rank
            calls_ok = calls_ok and len(per_rank) == world and calls[kind] == [steps] * (world * HOST_CALLS)
            samples[f"{kind}_cpu"].append(sum(c for _, c, _ in figures) / len(figures))
            samples[f"{kind}_wall"].append(sum(w for _, _, w in figures) / len(figures))
        samples["fwd_call"].append(sum(r[1] for r in results) / (world * HOST_CALLS) / 1e3)
        samples["bwd_call"].append(sum(r[2] for r in results) / (world * HOST_CALLS) / 1e3)
    # rank 0's loop alone, in this thread, its exchanges a loopback (the kernels' outputs are those above)
    q, k, v, dout = shards[0]
    cfg0 = RingConfig(_Loopback(world, 0), null, causal, scale, balance)  # type: ignore[arg-type]
    for rep in range(1 + cfg.warmup + reps):
        null.stamps.clear()
        null.recording = rep > cfg.warmup
        backend.synchronize(device)
        try:
            for _ in range(HOST_CALLS):
                out, lse = ring_forward(q, k, v, cfg0)
                ring_backward(dout, q, k, v, out, lse, cfg0)
            backend.synchronize(device)
        finally:
            null.recording = False
        if rep > cfg.warmup:
            for kind in ("fwd", "bwd"):
                passes, cpu, wall = _per_step(null.stamps[threading.get_ident()], kind)
                calls_ok = calls_ok and passes == [steps] * HOST_CALLS
                samples[f"{kind}_alone_cpu"].append(cpu)
                samples[f"{kind}_alone_wall"].append(wall)
    med = {name: median(values) for name, values in samples.items()}
    return {
        "world": world,
        "causal": causal,
        "balance": balance,
        "tokens_per_rank": cfg.host_tokens,
        "steps": steps,
        "reps": reps,
        "fwd_step_us": med["fwd_cpu"],
        "bwd_step_us": med["bwd_cpu"],
        "fwd_step_wall_us": med["fwd_wall"],
        "bwd_step_wall_us": med["bwd_wall"],
        "fwd_call_us": med["fwd_call"],
        "bwd_call_us": med["bwd_call"],
        "fwd_step_alone_us": med["fwd_alone_wall"],
        "bwd_step_alone_us": med["bwd_alone_wall"],
        "fwd_step_alone_cpu_us": med["fwd_alone_cpu"],
        "bwd_step_alone_cpu_us": med["bwd_alone_cpu"],
        "fwd_target_us": HOST_TARGETS_US["fwd"],
        "bwd_target_us": HOST_TARGETS_US["bwd"],
        "calls_per_rep": HOST_CALLS,
        "kernel_calls_per_pass": {kind: sorted(set(n)) for kind, n in calls.items()},
        "kernels_computed_once": computed,
        "kernels_computed_while_timed": null.computed - computed,
        "calls_ok": calls_ok and null.computed == computed,
    }


def _world_of_one_one(cfg: BenchConfig, backend, clock: Clock, device, seq: int, causal: bool) -> dict[str, Any]:
    """xcp.attention without a group (a world of one) against torch SDPA on [B, H, S, D] views with
    enable_gqa, forward and forward+backward: each checked against the other, then timed interleaved."""
    from ..api import attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    dtype = DTYPES[cfg.dtype]
    q, k, v, dout = random_inputs(cfg, seq, device)
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))

    def run_xcp(backward: bool):
        if not backward:
            with torch.no_grad():
                return attention(q, k, v, causal=causal, device=backend.name), None
        out = attention(*leaves, causal=causal, device=backend.name)
        return out, torch.autograd.grad(out, leaves, dout)

    def run_sdpa(backward: bool):
        def call(a, b, c):
            return sdpa(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=causal,
                        enable_gqa=True).transpose(1, 2)  # fmt: skip

        if not backward:
            with torch.no_grad():
                return call(q, k, v), None
        out = call(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)

    row: dict[str, Any] = {"seq": seq, "causal": causal, "tolerance": REL_TOLERANCE[dtype]}
    reps = max(cfg.reps, HOST_MIN_REPS)
    for mode, backward in (("fwd", False), ("fwd_bwd", True)):
        if cfg.check:
            got, ref = run_xcp(backward), run_sdpa(backward)
            errs = {"out": error(got[0], ref[0]).rel}
            if backward:
                errs.update({name: error(g, r).rel for name, g, r in zip(("dq", "dk", "dv"), got[1], ref[1])})
            row[f"{mode}_errors"] = errs
            row[f"{mode}_check_ok"] = all(math.isfinite(e) and e <= REL_TOLERANCE[dtype] for e in errs.values())
            del got, ref
        for _ in range(cfg.warmup):
            run_sdpa(backward)
            run_xcp(backward)
        sdpa_t, xcp_t = [], []
        for _ in range(reps):  # interleaved, so drifts in clock or temperature hit both alike
            sdpa_t.append(clock.time(lambda b=backward: run_sdpa(b)))
            xcp_t.append(clock.time(lambda b=backward: run_xcp(b)))
        row[f"{mode}_sdpa_s"] = median(sdpa_t)
        row[f"{mode}_xcp_s"] = median(xcp_t)
        row[f"{mode}_ratio"] = ratio(row[f"{mode}_xcp_s"], row[f"{mode}_sdpa_s"])
    row["reps"] = reps
    return row


def estimate_host_bytes(cfg: BenchConfig, device_type: str) -> tuple[int, str]:
    """Estimated peak memory of ``--host`` / ``--world-of-one``: forward+backward of a world of one at the
    largest of ``seqs`` (the host figure's problems are tiny)."""
    quadratic = device_type == "cpu" or cfg.dtype == "float64"
    problem = Problem(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    seq = max(cfg.seqs)
    shape = f"B={cfg.batch} H={cfg.heads}/{cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}"
    return attention_bytes(problem, seq, 1, quadratic), f"the world of one at S={seq}, {shape}"


def _run_host(cfg: BenchConfig, backend, device, progress: bool, checkpoint: str | None) -> dict[str, Any]:
    """The figures of ``--host`` (host µs per ring step for each of ``worlds``, then the world of one against
    SDPA) or of ``--world-of-one`` (that one alone)."""
    check_memory(backend, device, *estimate_host_bytes(cfg, device.type))
    clock = Clock(backend, device)
    report: dict[str, Any] = {"meta": _meta(cfg, backend, device), "timing": [], "memory": [], "graph": None,
                              "host": [] if cfg.host else None, "world_of_one": []}  # fmt: skip
    work: list[tuple[str, Callable[[], None]]] = []
    if cfg.host:
        for causal in cfg.causal:
            for world in cfg.worlds:
                row = (cfg, backend, device, world, causal)
                work.append((f"host P={world} {'causal' if causal else 'full'}",
                             lambda r=row: report["host"].append(_host_one(*r))))  # fmt: skip
    for causal in cfg.causal:
        for seq in cfg.seqs:
            row = (cfg, backend, clock, device, seq, causal)
            work.append((f"world of one S={seq} {'causal' if causal else 'full'}",
                         lambda r=row: report["world_of_one"].append(_world_of_one_one(*r))))  # fmt: skip
    return _run_work(work, report, progress, checkpoint)


HOST_METHOD = (
    "host work of one ring step of one rank: LocalWorld virtual ranks run xcp.ring_forward then ring_backward "
    "({calls} times per rank and repetition) on {tokens} tokens per rank with kernels that return outputs "
    "computed once beforehand (no kernel time; the merge and accumulations still run, on tiny tensors); a step "
    "is the time between a rank's consecutive kernel calls in one pass, on the rank thread's CPU clock (waits "
    "for peers and for the interpreter lock not counted), the mean over ranks; wall: the same gaps on the wall "
    "clock, with the other ranks' work that interleaves (P threads share one interpreter); alone: rank 0's loop "
    "run by itself in one thread, its exchanges a loopback copy, wall clock (the loop's own host work, without "
    "the other ranks'); call: a whole ring_forward / ring_backward call, CPU clock, mean over ranks, with what it "
    "does once per call"
)


def _format_host(report: dict[str, Any]) -> list[str]:
    """The host table (when measured), then the world-of-one table."""
    lines: list[str] = []
    rows = report.get("host")
    if rows:
        method = HOST_METHOD.format(tokens=rows[0]["tokens_per_rank"], calls=rows[0]["calls_per_rep"])
        lines += ["", *_wrap(f"{method}; median of {rows[0]['reps']} repetitions."), ""]
        lines.append(
            f"{'':>18} | {'µs per step, mean over ranks':^45} | {'wall µs/step':^13} | {'alone µs/step':^13} | "
            f"{'µs per call':^13} |"
        )
        lines.append(
            f"{'P':>3} {'mask':>6} {'balance':>7} | {'fwd':>7} {'target':>14} {'bwd':>7} {'target':>14} | "
            f"{'fwd':>6} {'bwd':>6} | {'fwd':>6} {'bwd':>6} | {'fwd':>6} {'bwd':>6} | check"
        )
        for r in rows:
            lines.append(
                f"{r['world']:>3} {'causal' if r['causal'] else 'full':>6} {r['balance']:>7} | "
                f"{r['fwd_step_us']:>7.1f} {_target(r['fwd_step_us'], r['fwd_target_us']):>14} "
                f"{r['bwd_step_us']:>7.1f} {_target(r['bwd_step_us'], r['bwd_target_us']):>14} | "
                f"{r['fwd_step_wall_us']:>6.0f} {r['bwd_step_wall_us']:>6.0f} | {r['fwd_step_alone_us']:>6.1f} "
                f"{r['bwd_step_alone_us']:>6.1f} | {r['fwd_call_us']:>6.0f} {r['bwd_call_us']:>6.0f} | "
                f"{'ok' if r['calls_ok'] else 'FAIL'} ({r['steps']} calls/pass)"
            )
        lines += _wrap(f"targets (issue 14): forward ≤ {HOST_TARGETS_US['fwd']:g} µs, backward ≤ "
                       f"{HOST_TARGETS_US['bwd']:g} µs per step and rank; printed, not asserted. check: every rank "
                       "made one kernel call per step in every pass, and none was computed while timed")  # fmt: skip
    w1 = report.get("world_of_one") or []
    if w1:
        c = report["meta"]["config"]
        lines += [
            "",
            *_wrap(
                f"world of one: xcp.attention(q, k, v, causal=...) without a group against torch SDPA (q, k, v "
                f"as [B, H, S, D] views, enable_gqa=True), {c['dtype']}; each checked against the other "
                f"(relative 2-norm error of out, dq, dk, dv ≤ {w1[0]['tolerance']:.0e}) before it is timed; "
                f"median of {w1[0]['reps']}, interleaved; ratio = xcp / SDPA. xcp hands a world of one to the "
                f"backend's whole_attention where it has one (cuda: torch SDPA itself), so the ratio is the cost "
                f"of xcp's checks and dispatch around it"
            ),
            "",
            f"{'S':>8} {'mask':>6} | {'fwd SDPA ms':>11} {'fwd xcp ms':>10} {'ratio':>6} | "
            f"{'f+b SDPA ms':>11} {'f+b xcp ms':>10} {'ratio':>6} | check",
        ]
        for r in w1:
            lines.append(
                f"{r['seq']:>8} {'causal' if r['causal'] else 'full':>6} | {r['fwd_sdpa_s'] * 1e3:>11.2f} "
                f"{r['fwd_xcp_s'] * 1e3:>10.2f} {r['fwd_ratio']:>6.3f} | {r['fwd_bwd_sdpa_s'] * 1e3:>11.2f} "
                f"{r['fwd_bwd_xcp_s'] * 1e3:>10.2f} {r['fwd_bwd_ratio']:>6.3f} | {_check_text(r)}"
            )
    return lines


def _target(value: float, target: float) -> str:
    """``(≤ 50: ok)`` or ``(≤ 50: over)``: the target beside a figure (nothing asserts it)."""
    return f"(≤ {target:g}: {'ok' if value <= target else 'over'})"


def _wrap(text: str, width: int = 110) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def _header(report: dict[str, Any]) -> list[str]:
    m = report["meta"]
    c = m["config"]
    return [
        f"xcp bench {m['date']} on {m.get('device_name', m['host'])}, torch {m['torch']}, cuda {m['cuda']}, "
        f"backend {m['backend']} ({m['kernel']})",
        f"B={c['batch']} H={c['heads']} Hkv={c['kv_heads']} D={c['head_dim']} {c['dtype']} balance {c['balance']}, "
        f"median of {c['reps']} after {c['warmup']} warm-up",
        *([f"sizes: {c['sizes_note']} (give the flags to change them)"] if c.get("sizes_note") else []),
    ]


EAGER_RUNS = ("fwd", "fwd_bwd")
REPLAY_RUNS = ("fwd_replay", "fwd_bwd_replay")
"""The runs of a row checked against the yardstick: eager, and replayed as graphs (``--replay``)."""


def _row_ok(r: dict[str, Any], runs: tuple[str, ...] = EAGER_RUNS + REPLAY_RUNS) -> bool:
    """The row's checks passed: out and grads against the yardstick in ``runs`` (all: eager and replayed),
    and (with a window) the bytes each rank sent against the formula."""
    checks = all(r.get(f"{m}_check_ok", True) for m in runs)
    return checks and r.get("sent_ok", True) and r.get("calls_ok", True)


def _worst_error(r: dict[str, Any], runs: tuple[str, ...]) -> float:
    """The largest relative error of the row's ``runs`` against the yardstick; NaN where none was checked."""
    return max([e for m in runs for e in r.get(f"{m}_errors", {}).values()] or [float("nan")])


def _check_text(r: dict[str, Any], runs: tuple[str, ...] = EAGER_RUNS) -> str:
    """``ok (worst error)`` or ``FAIL (...)`` for the row's ``runs`` (the replayed ones have their own table)."""
    return f"{'ok' if _row_ok(r, runs) else 'FAIL'} ({_worst_error(r, runs):.1e})"


def _versus_table(report: dict[str, Any], fourth: tuple, last: tuple) -> list[str]:
    """Header and rows of a ring-against-one-whole-sequence-call table (documents, windows): S, P, mask, a
    ``fourth`` column, forward and forward+backward times and ratios, a ``last`` column, the dense ring's
    ratio where it was timed, the check. ``fourth``/``last``: (title, width, cell of a row)."""
    dense = {(r["seq"], r["world"], r["causal"]): r for r in report["timing"]}
    lines = [
        f"{'S':>8} {'P':>3} {'mask':>6} {fourth[0]:>{fourth[1]}} | {'fwd ref ms':>10} {'fwd ring ms':>11} "
        f"{'ratio':>6} | {'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | {last[0]:>{last[1]}}"
        + (f" | {'dense f+b':>9}" if dense else "")
        + " | check",
    ]
    for r in report["documents"]:
        d = dense.get((r["seq"], r["world"], r["causal"]))
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {'causal' if r['causal'] else 'full':>6} {fourth[2](r)} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} | "
            f"{last[2](r)}"
            + (f" | {d['fwd_bwd_ratio']:>9.3f}" if d else " | " + " " * 9 if dense else "")
            + f" | {_check_text(r)}"
        )
    return lines


def _format_documents(report: dict[str, Any]) -> list[str]:
    """The table of the ring over packed documents against one whole-sequence varlen call, then each row's
    share of the work per rank."""
    c = report["meta"]["config"]
    lines = [
        f"packed documents ({packing.parse_documents(c['documents']).describe()}): ring of P virtual ranks vs one "
        "whole-sequence varlen call",
        "",
        *_versus_table(
            report,
            ("docs", 5, lambda r: f"{r['documents']:>5}"),
            ("work max/mean", 13, lambda r: f"{r['work_max_over_mean']:>13.3f}"),
        ),
    ]
    dense = report["timing"]
    lines += ["", "share of the work per rank (pairs computed / all pairs; 1/P each is balanced):"]
    for r in report["documents"]:
        shares = " ".join(f"r{i} {x:.3f}" for i, x in enumerate(r["work_share"]))
        steps = f", ring of {r['ring_steps']} steps" if r["ring_steps"] < r["world"] else ""
        lines.append(
            f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'}: {shares}; max/mean "
            f"{r['work_max_over_mean']:.3f} ({r['documents']} documents of {r['shortest']}..{r['longest']}{steps})"
        )
    if dense:
        lines += ["", "dense f+b: the f+b ratio of the same ring without documents (one sequence, same S, P, mask)"]
    return lines


def _format_windows(report: dict[str, Any]) -> list[str]:
    """The table of the ring under a sliding window (over documents, if any) against one whole-sequence
    windowed call, then the steps and bytes each rank sends, next to the dense ring's."""
    dense = report["timing"]
    c = report["meta"]["config"]
    window = windows.parse_window(c["window"])
    over = f" over packed documents ({packing.parse_documents(c['documents']).describe()})" if c["documents"] else ""
    lines = [
        f"sliding {windows.describe(window)}{over}:",
        "ring of P virtual ranks vs one whole-sequence windowed varlen call (forward_varlen/backward_varlen)",
        "",
        *_versus_table(
            report,
            ("balance", 10, lambda r: f"{r['balance']:>10}"),
            ("steps", 5, lambda r: f"{str(r['ring_steps']) + '/' + str(r['world']):>5}"),
        ),
    ]
    first = report["documents"][0]["ring_sent_formula"] if report["documents"] else None
    lines += [
        "",
        "steps and bytes sent per rank, this ring and the dense ring (all P steps, no window): a K/V shard is",
        "2·(S/P)·Hkv·D·itemsize; forward m-1 K/V shards; backward m-1 K/V shards and m dK/dV messages",
        f"(2·(S/P)·Hkv·D in the accumulator dtype{'' if c['dtype'] == 'float64' else ', float32'})"
        + (f"; at the first row a K/V shard is {human_bytes(first['kv_shard'])}" if first else ""),
    ]
    for r in report["documents"]:
        ring, dense_f = r["ring_sent_formula"], r["dense_sent_formula"]
        measured = (
            "as measured"
            if r.get("sent_ok")
            else "MEASURED OTHERWISE: "
            + ", ".join(
                human_bytes(max(sum(s.values()) for s in r[f"{mode}_sent_bytes"])) for mode in ("fwd", "fwd_bwd")
            )
        )
        lines.append(
            f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'} {r['balance']}: {ring['steps']} of "
            f"{r['world']} steps, fwd {human_bytes(ring['fwd'])}, f+b {human_bytes(ring['fwd_bwd'])} ({measured})"
        )
        lines.append(
            f"  {'':<{len(str(r['seq'])) + len(str(r['world'])) + 5}}dense ring: {dense_f['steps']} of {r['world']} "
            f"steps, fwd {human_bytes(dense_f['fwd'])}, f+b {human_bytes(dense_f['fwd_bwd'])}"
        )
        if r.get("recommended", r["balance"]) != r["balance"]:
            lines.append(
                f"  {'':<{len(str(r['seq'])) + len(str(r['world'])) + 5}}xcp.choose_balance recommends "
                f"{r['recommended']} ({r['recommended_steps']} of {r['world']} steps): --balance auto"
            )
    lines += ["", "work per rank (pairs computed; max/mean, 1 = balanced):"]
    for r in report["documents"]:
        docs = f", {r['documents']} documents of {r['shortest']}..{r['longest']}" if r["documents"] else ""
        lines.append(f"  S={r['seq']} P={r['world']} {'causal' if r['causal'] else 'full'}: max/mean "
                     f"{r['work_max_over_mean']:.3f}{docs}")  # fmt: skip
    if dense:
        lines += ["", "dense f+b: the f+b ratio of the ring without window or documents (same S, P, mask; the balance "
                  "given, zigzag for auto)"]  # fmt: skip
    return lines


def _format_replay(rows: list[dict[str, Any]]) -> list[str]:
    """The ``--replay`` table: the ring and the whole-sequence call each replayed as a device graph."""
    rows = [r for r in rows if "fwd_replay_ratio" in r]
    if not rows:
        return []
    lines = [
        "",
        "replayed as device graphs (every rank's work in one graph; the whole-sequence call in another): device time",
        f"{'S':>8} {'P':>3} {'U':>2} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} | check",
    ]
    for r in rows:
        check = _check_text(r, REPLAY_RUNS) if "fwd_replay_errors" in r else "not checked"
        times = [f"{r[f'{m}_replay_ref_s'] * 1e3:>10.2f} {r[f'{m}_replay_ring_s'] * 1e3:>11.2f} "
                 f"{r[f'{m}_replay_ratio']:>6.3f}" for m in ("fwd", "fwd_bwd")]  # fmt: skip
        what = f"{r['seq']:>8} {r['world']:>3} {r.get('ulysses', 1):>2} {'causal' if r['causal'] else 'full':>6}"
        lines.append(f"{what} | {' | '.join(times)} | {check}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables of a report."""
    if report.get("host") is not None or report.get("world_of_one") is not None:
        return "\n".join(_header(report) + _format_host(report))
    if report.get("ulysses") is not None:
        return "\n".join(_header(report) + _format_ulysses(report) + _format_replay(report["ulysses"]))
    replayed = _format_replay(report["timing"] + (report.get("documents") or []))
    if report.get("documents") is not None and report["meta"]["config"].get("window") is not None:
        return "\n".join(_header(report) + _format_windows(report) + replayed)
    if report.get("documents") is not None:
        return "\n".join(_header(report) + _format_documents(report) + replayed)
    lines = [
        *_header(report),
        "",
        f"{'S':>8} {'P':>3} {'mask':>6} | {'fwd ref ms':>10} {'fwd ring ms':>11} {'ratio':>6} | "
        f"{'f+b ref ms':>10} {'f+b ring ms':>11} {'ratio':>6} {'TFLOP/s':>8} | check",
    ]
    for r in report["timing"]:
        lines.append(
            f"{r['seq']:>8} {r['world']:>3} {'causal' if r['causal'] else 'full':>6} | "
            f"{r['fwd_ref_s'] * 1e3:>10.2f} {r['fwd_ring_s'] * 1e3:>11.2f} {r['fwd_ratio']:>6.3f} | "
            f"{r['fwd_bwd_ref_s'] * 1e3:>10.2f} {r['fwd_bwd_ring_s'] * 1e3:>11.2f} {r['fwd_bwd_ratio']:>6.3f} "
            f"{r['fwd_bwd_ring_tflops']:>8.1f} | {_check_text(r)}"
        )
    if report["memory"]:
        lines += [
            "",
            f"{'S':>8} {'P':>3} {'policy':>9} | {'peak KV shards':>14} {'ring MiB/rank':>13} {'device MiB':>10}",
        ]
        for r in report["memory"]:
            dev = r.get("device_peak_over_start_bytes")
            lines.append(
                f"{r['seq']:>8} {r['world']:>3} {r['policy']:>9} | {r['peak_kv_shards']:>14} "
                f"{r['peak_ring_bytes_per_rank'] / 2**20:>13.1f} {'-' if dev is None else f'{dev / 2**20:.1f}':>10}"
            )
    lines += replayed
    g = report.get("graph")
    if g:
        lines += [
            "",
            f"graph capture (S={g['seq']}, world 1, causal fwd): eager {g['eager_s'] * 1e3:.3f} ms, replay "
            f"{g['replay_s'] * 1e3:.3f} ms, speedup {g['speedup']:.2f}x, same output: {g['same_output']}",
        ]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> None:
    """Ratio against S (per P and mask) and ring memory against P (bounded vs keep_all)."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["timing"]
    for world in sorted({r["world"] for r in rows}):
        for causal in (False, True):
            pts = sorted((r["seq"], r["fwd_bwd_ratio"]) for r in rows if r["world"] == world and r["causal"] == causal)
            if pts:
                a.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    ls="-" if causal else "--",
                    label=f"P={world} {'causal' if causal else 'full'}",
                )
    for world in sorted({r["world"] for r in report.get("documents") or []}):
        for causal in (False, True):
            pts = sorted((r["seq"], r["fwd_bwd_ratio"]) for r in report["documents"]
                         if r["world"] == world and r["causal"] == causal)  # fmt: skip
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", ls=":",
                       label=f"documents P={world} {'causal' if causal else 'full'}")  # fmt: skip
    a.axhline(1.10, color="red", lw=0.8, label="target 1.10")
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length S")
    a.set_ylabel("fwd+bwd time / whole-sequence kernel")
    a.legend(fontsize=7)
    mem = report["memory"]
    for policy in ("bounded", "keep_all"):
        pts = sorted((r["world"], r["peak_ring_bytes_per_rank"] / 2**20) for r in mem if r["policy"] == policy)
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    b.set_xlabel("ranks P")
    b.set_ylabel("peak ring buffers per rank (MiB)")
    if mem:
        b.legend()
    else:
        b.text(0.5, 0.5, "no memory figure in this run", ha="center", va="center", transform=b.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> argparse.ArgumentParser:
    d = BenchConfig()
    p = sub.add_parser(
        "bench",
        help="ring overhead vs one whole-sequence kernel, memory, graph capture",
        description="Sizes default to the device: the H200 grid on a device, a small grid when the backend's "
        "device type is cpu. A run whose estimated memory exceeds what the machine has is refused up front.",
    )
    p.add_argument(
        "--seqs", type=positive_list, default=None, help=size_help("seqs", "comma-separated sequence lengths")
    )
    p.add_argument("--worlds", type=positive_list, default=d.worlds, help="comma-separated virtual rank counts")
    p.add_argument(
        "--mask",
        choices=tuple(MASKS),
        default=None,
        help="which masks to time (default: both; with --window, causal when R is 0 or none, else full)",
    )
    add_problem_flags(p, d, [n for n in MEASUREMENT_FLAGS if n not in SIZE_FLAGS])
    p.add_argument("--balance", choices=windows.BALANCE_CHOICES, default=d.balance, help=windows.BALANCE_HELP)
    for name in ("heads", "kv_heads", "head_dim", "dtype"):
        p.add_argument("--" + name.replace("_", "-"), default=None, **_size_flag(name))
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed runs before the timed ones")
    p.add_argument("--reps", type=positive, default=d.reps, help="timed runs (the median is reported)")
    p.add_argument(
        "--memory-seq", type=positive, default=None, help=size_help("memory_seq", "length of the memory figure")
    )
    p.add_argument(
        "--memory-worlds", type=positive_list, default=d.memory_worlds, help="rank counts of the memory figure"
    )
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the graph-capture figure")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument(
        "--documents", type=packing.parse_documents, metavar="L1,L2,...|longtail:MIN:MAX[:SEED]",
        help="time the ring over packed documents against one whole-sequence varlen call instead of the dense "
        "figures: document lengths summing to S (then --seqs may be left out), or lengths drawn log-uniformly "
        "in [MIN, MAX] (seeded, default seed 0) to fill each of --seqs, the last one trimmed",
    )  # fmt: skip
    p.add_argument(
        windows.FLAG, type=windows.parse_window, metavar="L,R",
        help="time the ring under a sliding window (query i sees keys i-L..i+R; none: unbounded; with a causal "
        "mask R is 0 or none), over --documents if given, against one whole-sequence windowed varlen call, with "
        "the steps the ring runs and the K/V and dK/dV bytes each rank sends beside the dense ring's",
    )  # fmt: skip
    p.add_argument("--compare-dense", action="store_true",
                   help="with --documents or --window: also time the dense ring at the same S, P, masks")  # fmt: skip
    p.add_argument(
        "--host", action="store_true",
        help="instead of the dense grid: the host µs per forward and per backward ring step of one rank, for "
        "each of --worlds (>= 2; LocalWorld virtual ranks running xcp.ring_forward/ring_backward on "
        "--host-tokens tokens per rank with kernels that return outputs computed once beforehand, so only host "
        "work remains: Python, checks, the merge and accumulation launches, hand-offs, events, exchanges); a "
        "step is the time between a rank's consecutive kernel calls on its thread's CPU clock, the mean over "
        f"ranks, median of at least {HOST_MIN_REPS}; beside it the same gaps on the wall clock and rank 0's loop "
        "run alone (one thread, loopback exchanges, wall clock), and the targets (forward ≤ "
        f"{HOST_TARGETS_US['fwd']:g} µs, backward ≤ {HOST_TARGETS_US['bwd']:g} µs); then the --world-of-one "
        "figure in the same run",
    )  # fmt: skip
    p.add_argument(
        "--world-of-one", action="store_true",
        help="xcp.attention(q, k, v, causal=...) without a group against torch SDPA (q, k, v as [B, H, S, D] "
        "views, enable_gqa=True), forward and forward+backward, each checked against the other (tolerance by "
        f"dtype) before it is timed, median of at least {HOST_MIN_REPS}, interleaved; --seqs default "
        f"{','.join(map(str, WORLD_OF_ONE_SEQS))} here, heads, head dim and dtype the device's (part of --host)",
    )  # fmt: skip
    p.add_argument("--host-tokens", type=positive, default=d.host_tokens,
                   help="tokens per rank of the --host figure (even for zigzag)")  # fmt: skip
    p.add_argument(
        ULYSSES_FLAG, type=positive_list, metavar="U[,U...]",
        help=ULYSSES_HELP + ". Instead of the dense grid: for each U (dividing every --worlds value and --heads), "
        "the hybrid's fwd and fwd+bwd over P virtual ranks against one whole-sequence kernel call, checked against "
        "it before it is timed, with the bytes each rank sends (all-to-alls, ring K/V and dK/dV) counted and "
        "checked against the formula",
    )  # fmt: skip
    p.add_argument(REPLAY_FLAG, action="store_true", help=REPLAY_HELP)
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw ratio vs S and memory vs P")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


SIZE_FLAGS = ("seqs", "memory_seq", "heads", "kv_heads", "head_dim", "dtype")
"""The flags whose default depends on the device (see :data:`xcp.cli.common.CPU_SIZES`)."""


def _size_flag(name: str) -> dict[str, Any]:
    from .common import _FLAGS

    flag = dict(_FLAGS[name])
    flag["help"] = size_help(name, flag["help"])
    return flag


MASKS = {"both": [False, True], "causal": [True], "full": [False]}


def positive_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1; got {text!r}")
    return values


def _document_sizes(args: argparse.Namespace) -> None:
    """With --documents: --seqs defaults to the sum of explicit lengths (and must be it when given), and the
    memory figure's length, which documents and windows do not use, is left out of the size defaults. With
    --window, --mask defaults to causal where R is 0 or none, else to full."""
    spec = args.documents
    if args.mask is None:
        right = None if args.window is None else args.window[1]
        args.mask = "both" if args.window is None else "causal" if right in (0, None) else "full"
    if args.compare_dense is True and spec is None and args.window is None:
        raise ValueError(
            "--compare-dense: expected together with --documents or --window (the dense bench is the default)"
        )
    if spec is None:
        if args.window is not None and args.memory_seq is None:
            args.memory_seq = max(args.seqs or [1])
        return
    if spec.lengths is not None:
        if args.seqs is None:
            args.seqs = [spec.total]
        elif len(args.seqs) != 1:
            raise ValueError(
                f"--seqs: expected one length, the sum of the --documents lengths ({spec.total}), or none; got "
                f"{','.join(map(str, args.seqs))}"
            )
        elif args.seqs[0] != spec.total:
            raise ValueError(
                f"{packing.FLAG}: expected lengths summing to --seqs {args.seqs[0]}; got {len(spec.lengths)} "
                f"lengths summing to {spec.total}"
            )
    if args.memory_seq is None:
        args.memory_seq = max(args.seqs or [1])


def _host_args(args: argparse.Namespace) -> str | None:
    """With --host or --world-of-one: refuse what does not apply, and default --seqs to the world-of-one's;
    returns a note of that default (None when --seqs was given or neither flag was)."""
    host = getattr(args, "host", False)
    if not (host or getattr(args, "world_of_one", False)):
        return None
    flag = "--host" if host else "--world-of-one"
    if args.documents is not None:
        raise ValueError(f"{packing.FLAG}: not measured with {flag}; got {args.documents.text!r}")
    if args.window is not None:
        raise ValueError(f"{windows.FLAG}: not measured with {flag}; got {windows.text_of(args.window)!r}")
    if args.compare_dense:
        raise ValueError(f"--compare-dense: expected together with --documents or --window, not {flag}")
    if args.plot:
        raise ValueError(f"--plot: draws the dense grid, not measured with {flag}; got {args.plot!r}")
    if args.mask is None:
        args.mask = "both"
    if args.memory_seq is None:
        args.memory_seq = 1  # no memory figure here: kept out of the size defaults and their note
    if args.seqs is not None:
        return None
    args.seqs = list(WORLD_OF_ONE_SEQS)
    return f"seqs {','.join(map(str, WORLD_OF_ONE_SEQS))} (the world of one's, on any device)"


def _ulysses_args(args: argparse.Namespace) -> None:
    """With --ulysses: refuse what it does not measure; the memory figure's length stays out of the size
    defaults (there is no memory figure)."""
    if args.ulysses is None:
        return
    given = " ".join(map(str, args.ulysses))
    for flag, on, value in (
        (packing.FLAG, args.documents is not None, args.documents and args.documents.text),
        (windows.FLAG, args.window is not None, args.window and windows.text_of(args.window)),
        ("--host", args.host, None),
        ("--world-of-one", args.world_of_one, None),
        ("--compare-dense", args.compare_dense, None),
        ("--plot", args.plot is not None, args.plot),
    ):
        if on:
            raise ValueError(f"{flag}: not measured with {ULYSSES_FLAG} {given.replace(' ', ',')} yet"
                             + (f"; got {value!r}" if value is not None else ""))  # fmt: skip
    if args.memory_seq is None:
        args.memory_seq = 1


def command(args: argparse.Namespace) -> int:
    backend, _ = tool_backend(args.device, 0)  # an unknown or unusable backend: the error and the table, first
    host_note = _host_args(args)
    _ulysses_args(args)
    _document_sizes(args)
    note = apply_size_defaults(args, backend, SIZE_FLAGS)
    if host_note:
        note = host_note if note is None else f"{note}, {host_note}"
    cfg = BenchConfig(
        sizes_note=note,
        worlds=args.worlds,
        causal=MASKS[args.mask],
        memory_worlds=args.memory_worlds,
        graph=args.graph,
        check=args.check,
        documents=None if args.documents is None else args.documents.text,
        compare_dense=args.compare_dense,
        window=None if args.window is None else windows.text_of(args.window),
        balance=args.balance,
        host=args.host,
        world_of_one=args.host or args.world_of_one,
        host_tokens=args.host_tokens,
        ulysses=args.ulysses,
        replay=args.replay,
        **measurement_args(args),
    )
    report = run_bench(cfg, progress=not args.quiet, checkpoint=args.json)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    rows = report["timing"] + report.get("documents", []) + (report.get("host") or [])
    rows += (report.get("world_of_one") or []) + (report.get("ulysses") or [])
    failed = [r for r in rows if not _row_ok(r)]
    return 1 if failed else 0
