"""What the ``xcp`` tools share, so that ``run``, ``bench`` and ``bench --distributed`` describe, build and
judge a problem the same way: the dtype names, the tolerances, the problem's shape and its flags, seeded
inputs, the float64 reference's gradients, the error measure, the clock, and the process-group set-up under torchrun.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import schedule, settings
from ..api import unshard
from ..plugins import backend_table, select_backend
from ..testing.reference import sdpa_reference

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Largest accepted relative error ||x - ref|| / ||ref|| per input dtype. float64 and float32 sit many
# orders above their rounding (1e-16, 6e-8) to allow for sums over thousands of keys; bf16 (8-bit
# mantissa, unit roundoff 3.9e-3) and fp16 (11-bit, 4.9e-4) are bounded by the rounding of the inputs and
# outputs themselves, since accumulation is fp32.
REL_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass
class Problem:
    """The attention problem every tool runs: shapes, dtype, backend and balance. The defaults are one
    H200-sized layer (32 query heads over 8 K/V heads of 128, bf16 on cuda); a tool that wants other
    defaults gives its own instance (see :func:`add_problem_flags`)."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    device: str = "cuda"
    balance: str = schedule.DEFAULT_BALANCE
    value_head_dim: int | None = None
    """The head dim of v (and of out, dout, dv): None is ``head_dim``; another value is multi-head latent
    attention's (DeepSeek-V3: q/k 192, v 128)."""

    @property
    def value_dim(self) -> int:
        """The head dim of v, out, dout and dv: ``value_head_dim``, else ``head_dim``."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def dims_text(self) -> str:
        """``128``, or ``192/128`` (q/k, v) when v's head dim is another."""
        return head_dims_text(self.head_dim, self.value_dim)


@dataclass
class Measurement(Problem):
    """A timed problem, as ``xcp bench`` (one process) and ``xcp bench --distributed`` measure it."""

    seqs: list[int] = field(default_factory=lambda: [16384, 65536, 131072])
    memory_seq: int = 262144
    warmup: int = 1
    reps: int = 5
    check_tolerance: float = REL_TOLERANCE[torch.bfloat16]  # bf16's bound, whatever the dtype


def head_dims_text(head_dim: int, value_head_dim: int | None) -> str:
    """``128``, or ``192/128`` (q/k, v) when v's head dim is another (None: the same)."""
    if value_head_dim is None or value_head_dim == head_dim:
        return str(head_dim)
    return f"{head_dim}/{value_head_dim}"


def positive(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prefixes the flag: ``--world: expected ...``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, except where there is none to show (None, a switch) or the help
    text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "%(default)" in help_text or "default:" in help_text or action.default in (None, argparse.SUPPRESS):
            return help_text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return help_text
        if isinstance(action.default, list):
            return f"{help_text} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


# What a size flag of ``xcp bench`` defaults to when it is not given: the H200 grid on a device, and a grid
# a laptop finishes in a minute or two when the backend's device type is cpu (the math kernel materialises
# S x S scores per head: the device grid would need terabytes there). Name: (on a device, on the CPU).
_SIZES: dict[str, tuple[Any, Any]] = {
    "seqs": ([16384, 65536, 131072], [512, 1024, 2048]),
    "memory_seq": (262144, 4096),
    "heads": (32, 8),
    "kv_heads": (8, 2),
    "head_dim": (128, 64),
    "dtype": ("bfloat16", "float32"),
    "check_seq": (32768, 1024),
    "reference_seq": (65536, 2048),
}
DEVICE_SIZES: dict[str, Any] = {name: device for name, (device, _) in _SIZES.items()}
CPU_SIZES: dict[str, Any] = {name: cpu for name, (_, cpu) in _SIZES.items()}


def _sizes_text(sizes: dict[str, Any], names: Sequence[str]) -> str:
    def show(v: Any) -> str:
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)

    return ", ".join(f"{n.replace('_', '-')} {show(sizes[n])}" for n in names)


def apply_size_defaults(args: argparse.Namespace, backend, names: Sequence[str]) -> str | None:
    """Fill the size flags among ``names`` that the user left out (None) with the defaults of the backend's
    device type; returns a line saying which defaults were used, or None when every size was given."""
    sizes = CPU_SIZES if backend.device_type == "cpu" else DEVICE_SIZES
    missing = [n for n in names if getattr(args, n, None) is None]
    for name in missing:
        setattr(args, name, list(sizes[name]) if isinstance(sizes[name], list) else sizes[name])
    if not missing:
        return None
    kind = "small CPU" if sizes is CPU_SIZES else "device"
    return f"{kind} defaults ({backend.device_type}): {_sizes_text(sizes, missing)}"


def size_help(name: str, text: str) -> str:
    """The help of a size flag: its text, then its default on a device and on the CPU."""
    return (
        f"{text} (default: {_sizes_text(DEVICE_SIZES, [name]).split(' ', 1)[1]} on a device, "
        f"{_sizes_text(CPU_SIZES, [name]).split(' ', 1)[1]} when the backend's device type is cpu)"
    )


FLAGS: dict[str, dict[str, Any]] = {
    # the keyword arguments of add_argument for each problem flag, but its default
    "batch": {"type": positive, "help": "batch size"},
    "heads": {"type": positive, "help": "query heads"},
    "kv_heads": {"type": positive, "help": "key/value heads (a divisor of --heads)"},
    "head_dim": {"type": positive, "help": "size of one head"},
    "value_head_dim": {
        "type": positive,
        "metavar": "N",
        "help": "size of one value head: v's, out's, dout's and dv's (multi-head latent attention, DeepSeek-V3: "
        "--head-dim 192 --value-head-dim 128) (default: --head-dim)",
    },
    "dtype": {"choices": list(DTYPES), "help": "dtype of q, k, v"},
    "device": {
        "help": "backend name as `xcp backends` lists it (cpu, cuda, npu, a plug-in's name), "
        "optionally with a device index: cuda:1"
    },  # fmt: skip
    "balance": {"choices": schedule.BALANCES, "help": "how the sequence is cut into shards"},
}
PROBLEM_FLAGS = tuple(FLAGS)


def add_problem_flags(parser: argparse.ArgumentParser, defaults: Problem, names: Sequence[str] = PROBLEM_FLAGS):
    """Declare ``--batch --heads --kv-heads --head-dim --value-head-dim --dtype --device --balance`` (or the
    ``names`` among them) on ``parser``, each defaulting to the field of ``defaults``."""
    for name in names:
        parser.add_argument("--" + name.replace("_", "-"), default=getattr(defaults, name), **FLAGS[name])


def problem_args(args: argparse.Namespace, names: Sequence[str] = PROBLEM_FLAGS) -> dict[str, Any]:
    """The parsed problem flags, as keyword arguments of a :class:`Problem`."""
    return {name: getattr(args, name) for name in names}


# ``xcp bench`` has no --balance: it measures the default balance
MEASUREMENT_FLAGS = tuple(n for n in PROBLEM_FLAGS if n != "balance")


def measurement_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags ``bench`` and ``bench --distributed`` share, as keyword arguments of a :class:`Measurement`."""
    return problem_args(args, (*MEASUREMENT_FLAGS, "seqs", "memory_seq", "warmup", "reps"))


DEVICE_DEFAULT = "XCP_DEVICE where set, else the first usable backend on a device in `xcp backends` order, else cpu"


def default_device(args: argparse.Namespace) -> str | None:
    """Fill in ``--device`` where it was not given: ``XCP_DEVICE`` where set, else the first usable backend on
    a device (not the CPU) in ``xcp backends`` order, else ``cpu`` (so a machine without an accelerator runs
    on its CPU rather than failing). Returns a note for the header saying which and why; None when given."""
    if args.device is not None:
        return None
    chosen = settings.DEVICE.read()
    if chosen:
        args.device = chosen
        return f"device {chosen} ({settings.DEVICE.name})"
    on_device = [row.name for row in backend_table() if row.available and row.device_type not in ("cpu", "-")]
    args.device = on_device[0] if on_device else "cpu"
    why = "the first usable backend on a device" if on_device else "no backend on a device is usable here"
    return f"device {args.device} ({why}; --device picks another)"


def tool_device(backend, name: str, default_index: int | None = None) -> torch.device:
    """The torch device a tool runs on: the CPU, or the backend's device at the index ``name`` gives
    (``cuda:1``), else at ``default_index``."""
    index = default_index
    if ":" in name:
        text = name.split(":", 1)[1]
        if not text.isdigit():
            raise ValueError(f"device: expected a backend name, optionally with :INDEX (cuda:1); got {name!r}")
        index = int(text)
    if backend.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(backend.device_type) if index is None else torch.device(backend.device_type, index)


def tool_backend(name: str, default_index: int | None = None):
    """The backend ``--device`` names (a backend name such as ``tiled``, or a device type) and the torch
    device its tensors live on (``backend.device_type``); raises BackendError (a RuntimeError) with the
    table of installed backends when it is unknown or unusable here."""
    backend = select_backend(name, None)
    return backend, tool_device(backend, name, default_index)


def available_bytes(backend, device: torch.device) -> int | None:
    """Memory this machine can still give the tool: available RAM for a cpu device type (MemAvailable of
    /proc/meminfo, else os.sysconf), free device memory where the device module reports it; else None."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        free, _total = torch.get_device_module(device.type).mem_get_info(device)
        return int(free)
    except Exception:  # noqa: BLE001 - a device without the query: skip the check
        return None


def attention_bytes(problem: Problem, seq: int, world: int, quadratic: bool) -> int:
    """Estimated peak bytes of forward+backward attention over ``seq`` tokens cut into ``world`` shards
    that run at once: the inputs, outputs and gradients (three copies: whole kernel, ring, reference; q, k
    and their gradients in ``head_dim``, v, out and theirs in the value head dim), their accumulator-dtype
    copies, and, for a ``quadratic`` (math) kernel, about four score-sized [B, H, S/P, S/P] buffers per
    shard."""
    elt = DTYPES[problem.dtype].itemsize
    acc = 8 if problem.dtype == "float64" else 4
    tokens, dims = problem.batch * seq, problem.head_dim + problem.value_dim  # q, k in one dim; v, out in v's
    io = 3 * tokens * dims * (problem.heads + problem.kv_heads) * elt + 3 * tokens * dims * problem.heads * acc
    scores = 4 * problem.batch * problem.heads * (seq // world) ** 2 * acc * world if quadratic else 0
    return io + scores


def check_heads(heads: int, kv_heads: int) -> None:
    """A ValueError naming ``--kv-heads`` unless it divides ``--heads`` (each K/V head serves a group of query
    heads)."""
    if heads % kv_heads:
        raise ValueError(f"--kv-heads: expected a divisor of --heads {heads}; got {kv_heads}")


def check_value_dim(backend, head_dim: int, value_dim: int) -> None:
    """A ValueError naming ``--value-head-dim`` when v's head dim differs from q/k's and the backend's kernels
    do not take that (``value_head_dims`` False)."""
    if value_dim != head_dim and not getattr(backend, "value_head_dims", False):
        raise ValueError(
            f"--value-head-dim: expected --head-dim {head_dim} with backend {backend.name!r}, whose kernels take "
            f"one head dim (it does not declare value_head_dims); got {value_dim}"
        )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_memory(backend, device: torch.device, needed: int, what: str) -> None:
    """Refuse up front (ValueError) a run whose estimated memory exceeds what the machine has."""
    have = available_bytes(backend, device)
    if have is not None and needed > have:
        where = "available RAM" if device.type == "cpu" else f"free memory on {device}"
        raise ValueError(
            f"this configuration needs about {human_bytes(needed)} ({what}) but {where} is {human_bytes(have)}; "
            "give smaller sizes (--seqs, --memory-seq, --heads, --head-dim, --dtype)"
        )


def random_inputs(problem: Problem, seq: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded random q, k, v and dout of ``seq`` tokens in the problem's dtype, drawn on ``device`` (the same
    seed gives every rank of a device type the same tensors); q and k of ``head_dim``, v and dout (out's
    gradient) of the value head dim."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[problem.dtype]
    d, dv = problem.head_dim, problem.value_dim
    shapes = ((problem.heads, d), (problem.kv_heads, d), (problem.kv_heads, dv), (problem.heads, dv))
    return tuple(torch.randn(problem.batch, seq, h, dim, generator=gen, device=device, dtype=dtype)
                 for h, dim in shapes)  # fmt: skip


def reference(q, k, v, dout, causal: bool, cu_seqlens: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of whole-sequence attention in float64 on the CPU: the library's
    :func:`xcp.testing.reference.sdpa_reference` and its gradients; with ``cu_seqlens`` (packed documents'
    boundaries, batch 1), of each document alone. Not ``reference_gradients``: that one materialises the
    scores (at S=4096 with 8 heads about 5 GiB and 9x the time, against 0.2 GiB), and the tools check
    lengths where it would not fit."""
    q, k, v, dout = (x.detach().to("cpu", torch.float64) for x in (q, k, v, dout))
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    cu = (0, q.shape[1]) if cu_seqlens is None else tuple(cu_seqlens)
    out = torch.cat([sdpa_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal) for a, b in zip(cu, cu[1:])], dim=1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


def whole_kernel(backend, full: Sequence[torch.Tensor], causal: bool, backward: bool):
    """The backend's own kernel on the whole sequence: ``(out, (dq, dk, dv) or None)``, the yardstick of
    the benchmarks."""
    q, k, v, dout = full
    scale = 1.0 / q.shape[-1] ** 0.5
    mask = "causal" if causal else "none"
    out, lse = backend.forward(q, k, v, mask, scale)
    grads = backend.backward(dout, q, k, v, out.to(q.dtype), lse, mask, scale) if backward else None
    return out, grads


def whole_varlen(backend, full: Sequence[torch.Tensor], cu: tuple[int, ...], causal: bool, backward: bool):
    """The backend's varlen kernel on the whole packed sequence (documents ``cu``, batch 1), one call for
    the forward and one for the backward: ``(out, (dq, dk, dv) or None)``, the yardstick of the benchmarks
    with documents (a world of one with the same documents)."""
    q, k, v, dout = full
    scale = 1.0 / q.shape[-1] ** 0.5
    out, lse = backend.forward_varlen(q, k, v, cu, cu, causal, scale)
    grads = backend.backward_varlen(dout, q, k, v, out.to(q.dtype), lse, cu, cu, causal, scale) if backward else None
    return out, grads


def whole_window(backend, full: Sequence[torch.Tensor], cu: tuple[int, ...], causal: bool, window, backward: bool):
    """The backend's varlen kernel on the whole sequence under a sliding ``window`` ``(left, right)`` (None:
    unbounded), one call for the forward and one for the backward over documents ``cu`` (``(0, S)``: one
    sequence): ``(out, (dq, dk, dv) or None)``, the yardstick of the benchmarks with a window. Each document
    is one square segment, so the bottom-right aligned band ``(left, 0)`` without a causal mask is the causal
    window, and an unbounded side is the sequence's length."""
    q, k, v, dout = full
    seq = q.shape[1]
    scale = 1.0 / q.shape[-1] ** 0.5
    left, right = window
    band = (seq if left is None else min(left, seq), 0 if causal else seq if right is None else min(right, seq))
    out, lse = backend.forward_varlen(q, k, v, cu, cu, False, scale, window=band)
    if not backward:
        return out, None
    return out, backend.backward_varlen(dout, q, k, v, out.to(q.dtype), lse, cu, cu, False, scale, window=band)


class Error(NamedTuple):
    max_abs: float
    rel: float  # ||got - ref|| / ||ref|| in the 2-norm


def error(got: torch.Tensor, ref: torch.Tensor) -> Error:
    """The error of ``got`` against ``ref``, computed where ``ref`` lies, in float64 if ``ref`` is float64
    and in float32 otherwise."""
    dtype = torch.promote_types(ref.dtype, torch.float32)
    ref = ref.detach().to(dtype)
    diff = got.detach().to(ref.device, dtype) - ref
    rel = diff.norm() / ref.norm().clamp_min(torch.finfo(dtype).tiny)
    return Error(diff.abs().max().item(), rel.item())


def median(values: list[float]) -> float:
    """The median of ``values`` (the figure every timing reports)."""
    if not values:
        raise ValueError("values: expected at least one timing; got none")
    return statistics.median(values)


def pair_flops(pairs: float, heads: int, head_dim: int, backward: bool, value_head_dim: int | None = None) -> float:
    """FLOPs of attention over ``pairs`` (query, key) pairs per head: each matmul costs 2 FLOPs a pair and
    element of its head dim. The forward makes q·kᵀ (q/k's head dim D) and p·v (v's, Dv): 2·pairs·H·(D + Dv);
    the backward recomputes q·kᵀ and makes dq, dk (D) and dp, dv (Dv): fwd+bwd 2·pairs·H·(4·D + 3·Dv), which
    is 3.5x the forward when Dv = D."""
    dv = head_dim if value_head_dim is None else value_head_dim
    per_pair = 4 * head_dim + 3 * dv if backward else head_dim + dv
    return 2.0 * pairs * heads * per_pair


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool, backward: bool,
                    value_head_dim: int | None = None) -> float:  # fmt: skip
    """FLOPs of attention on the whole sequence: :func:`pair_flops` of B·S² pairs, halved if causal (forward
    4·B·S²·H·D when v's head dim is D; fwd+bwd 3.5x)."""
    pairs = float(batch) * seq * seq
    if causal:
        pairs /= 2
    return pair_flops(pairs, heads, head_dim, backward, value_head_dim)


class Clock:
    """Host wall time of a region, with the device drained before and after it."""

    def __init__(self, backend, device: torch.device) -> None:
        self.backend, self.device = backend, device

    def time(self, fn: Callable[[], Any]) -> float:
        self.backend.synchronize(self.device)
        start = time.perf_counter()
        fn()
        self.backend.synchronize(self.device)
        return time.perf_counter() - start


def device_peak(backend, device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Bytes the device allocator's peak rose above what was allocated before ``fn``; None where the device
    keeps no statistics."""
    backend.synchronize(device)
    backend.reset_peak_memory(device)
    before = backend.memory_stats(device)
    fn()
    backend.synchronize(device)
    after = backend.memory_stats(device)
    return None if before is None or after is None else after["peak"] - before["allocated"]


def under_torchrun() -> bool:
    """True when torchrun started this process (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def quiet_rank() -> bool:
    """True on every rank but 0 under torchrun: those print nothing unless ``--all-ranks`` is given."""
    return under_torchrun() and os.environ.get("RANK", "0") != "0"


def join_process_group(device_name: str):
    """Under torchrun: select the backend, put this rank on its local device and join the default process
    group; returns ``(backend, device, rank, world size)``."""
    import torch.distributed as dist

    backend, device = tool_backend(device_name, int(os.environ.get("LOCAL_RANK", "0")))
    backend.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend.dist_backend)
        # torn down before the interpreter's own teardown: a process group left to it can abort the process
        # ("terminate called without an active exception") after the tool has printed its result
        atexit.register(_leave_process_group)
    return backend, device, dist.get_rank(), dist.get_world_size()


def _leave_process_group() -> None:
    """Wait for every rank, then leave: a rank that tears gloo down while a peer still finishes its last
    collective can abort that peer ('terminate called without an active exception', seen in CI). A peer
    that is gone is waited for at most a minute (gloo), and the group is left all the same."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        else:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a failed or missing peer must not keep this rank from leaving
        pass
    dist.destroy_process_group()


def placement(balance: str, ulysses: int = 1, cu_seqlens: Sequence[int] | None = None) -> dict[str, Any]:
    """``xcp.shard``'s and ``xcp.unshard``'s keywords: a balance that places each document takes the
    documents' boundaries ``cu_seqlens`` too (the others place the whole sequence, documents or not)."""
    place: dict[str, Any] = {"balance": balance, "ulysses": ulysses}
    if balance in schedule.DOCUMENT_BALANCES:
        place["cu_seqlens"] = cu_seqlens
    return place


def gather_whole(shards: Sequence[torch.Tensor], world: int, balance: str, ulysses: int = 1,
                 cu_seqlens: Sequence[int] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's shard of each tensor, all-gathered and put back in sequence order on every rank (shards
    placed by ``xcp.shard`` with ``balance``, ``ulysses`` and ``cu_seqlens``). Shards that differ by a token
    (``document_zigzag``) are gathered padded to the longest and cut back."""
    import torch.distributed as dist

    place = placement(balance, ulysses, cu_seqlens)
    cu = place.get("cu_seqlens")
    whole = []
    for t in shards:
        lengths = [t.shape[1]] * world if cu is None else schedule.shard_lengths(cu[-1], world, balance)
        padded = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, lengths[0] - t.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
        whole.append(unshard([p[:, :n] for p, n in zip(parts, lengths)], **place))
    return whole


def write_json(report: dict[str, Any], path: str) -> None:
    """Write a report as JSON."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a RuntimeError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            f"--plot needs matplotlib, which is not importable: {exc} "
            "(pip install matplotlib, or pip install -e '.[plot]' in a checkout)"
        ) from exc
    return plt
