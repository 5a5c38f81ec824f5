"""What several test files share: the tests' own float64 reference, ring runners on a LocalWorld, the
brute-force plan checkers, a comparison and a plugin registration.

Test files import from here (``from helpers import ...``), never from each other; the fixtures that wrap
some of these live in tests/conftest.py, the Hypothesis strategies and inputs in tests/strategies.py.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import xcp
from xcp import schedule
from xcp.hookspecs import hookimpl
from xcp.plugins import register_plugin, unregister_plugin

TENSORS = ("out", "dq", "dk", "dv")
NAMES = (*TENSORS, "dsinks")  # what independent_masked_reference and ring_with_documents return, in order

# ------------------------------------------------------------------------------------------- references


@dataclass
class Result:
    """Output and gradients of an attention call, all on the whole (unsharded) sequence."""

    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}


def independent_masked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    cu: Sequence[int],
    causal: bool,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
) -> list[torch.Tensor]:
    """Attention of the whole sequence in float64: one softmax with the explicit document (``cu``), causal
    and window mask, layout [B, S, H, D], K/V heads repeated for GQA; the sink, when given, is one more
    logit per head with a zero value. Returns ``[out, dq, dk, dv]`` (and ``dsinks`` with sinks).

    The variants, written from their definitions: ``softcap`` caps every score ``softcap * tanh(s /
    softcap)``, ``alibi_slopes`` [H] adds ``-slope_h * |i - j|`` after it, ``chunk`` lets query i see key j
    only when ``i // chunk == j // chunk`` (besides the documents); the sink is neither capped nor biased.

    Kept apart from the library's ``xcp.testing.reference`` on purpose: that one is part of what these tests
    check (backend authors and the tools rely on it), and a reference cannot check itself. This one uses no
    xcp code at all: one softmax over all keys (no blocks, no log-sum-exp merge), masks from index
    comparisons, gradients by autograd. Every input is converted to float64 first, so the reference sees
    exactly the (possibly rounded) values the ring saw.
    """
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().to(torch.float64).requires_grad_())
    q64, k64, v64 = leaves[:3]
    s = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    doc = torch.tensor([bisect.bisect_right(cu, i) - 1 for i in range(s)])
    allowed = doc[:, None] == doc[None, :]
    if chunk is not None:
        blocks = torch.arange(s) // chunk
        allowed &= blocks[:, None] == blocks[None, :]
    if causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
        if window[0] is not None:
            allowed &= j >= i - window[0]
        if window[1] is not None:
            allowed &= j <= i + window[1]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        distance = (torch.arange(s)[:, None] - torch.arange(s)[None, :]).abs().to(torch.float64)
        scores = scores - alibi_slopes.detach().to(torch.float64).view(-1, 1, 1) * distance
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = leaves[3].view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
        vh = torch.cat([vh, torch.zeros_like(vh[:, :, :1])], dim=2)
    out = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout.detach().to(torch.float64))
    return [out.detach(), *grads]


def independent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> Result:
    """:func:`independent_masked_reference` of one document (the whole sequence, causal or not), as a
    :class:`Result`."""
    return Result(*independent_masked_reference(q, k, v, dout, (0, q.shape[1]), causal, scale=scale))


# ----------------------------------------------------------------------------------------- ring runners


def run_sharded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    world: int,
    *,
    balance: str = "zigzag",
    ulysses: int = 1,
    sinks: torch.Tensor | None = None,
    grads: Sequence[bool] = (True, True, True),
    timeout: float = 60,
    **kwargs: Any,
) -> list[torch.Tensor | None]:
    """Shard q, k, v, dout over ``world`` LocalWorld ranks with xcp's own ``shard``, run
    :func:`xcp.attention` (``**kwargs`` passed on) on each, backward with each rank's shard of ``dout``
    (skipped when None), unshard. ``grads`` says which of q, k, v require grad; a gradient not asked for is
    None. Returns ``[out, dq, dk, dv]`` and, with sinks, their gradient summed over ranks (each rank's is
    the share of its rows)."""

    place: dict[str, Any] = dict(balance=balance, ulysses=ulysses)
    if balance in schedule.DOCUMENT_BALANCES:  # they place by the documents: shard and unshard take them too
        place["cu_seqlens"] = kwargs.pop("cu_seqlens")

    def rank_fn(group: xcp.LocalGroup) -> list[torch.Tensor | None]:
        r = group.rank()
        local = [xcp.shard(t, world, r, **place).requires_grad_(g) for t, g in zip((q, k, v), grads)]
        sk = None if sinks is None else sinks.detach().clone().requires_grad_()
        out = xcp.attention(*local, group=group, sinks=sk, **place, **kwargs)
        if dout is not None:
            out.backward(xcp.shard(dout, world, r, **place))
        return [out.detach(), *(t.grad for t in local), None if sk is None else sk.grad]

    per_rank = xcp.LocalWorld(world, timeout=timeout).run(rank_fn)
    got = []
    for i in range(4):
        parts = [res[i] for res in per_rank]
        got.append(None if parts[0] is None else xcp.unshard(parts, **place))
    if sinks is not None:
        got.append(sum(res[4] for res in per_rank))
    return got


def rank_errors(world: int, call: Callable[[xcp.LocalGroup], Any], timeout: float = 10) -> list[str | None]:
    """Run ``call(group)`` on every rank of a LocalWorld: each rank's ValueError message, None where none."""

    def body(group: xcp.LocalGroup) -> str | None:
        try:
            call(group)
        except ValueError as exc:
            return str(exc)
        return None

    return xcp.LocalWorld(world, timeout=timeout).run(body)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    world_size: int,
    causal: bool,
    balance: str = "zigzag",
    scale: float | None = None,
    grads: Sequence[bool] = (True, True, True),
    **kwargs: Any,
) -> Result:
    """:func:`run_sharded` of one sequence, as a :class:`Result` to compare with :func:`independent_reference`."""
    out, dq, dk, dv = run_sharded(
        q, k, v, dout, world_size, causal=causal, balance=balance, scale=scale, grads=grads, **kwargs
    )
    assert out is not None
    return Result(out, dq, dk, dv)


def ring_with_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    world: int,
    balance: str,
    causal: bool,
    cu: Sequence[int],
    sinks: torch.Tensor | None = None,
    **kwargs: Any,
) -> list[torch.Tensor | None]:
    """:func:`run_sharded` with ``cu_seqlens=cu`` (and ``sinks``): the same list as
    :func:`independent_masked_reference` returns for the same arguments."""
    cu_seqlens = torch.tensor(cu)
    return run_sharded(
        q, k, v, dout, world, balance=balance, causal=causal, sinks=sinks, cu_seqlens=cu_seqlens, **kwargs
    )


# ---------------------------------------------------------------------------------- brute-force plans


def allowed_pairs(
    cu: Sequence[int],
    world: int,
    rank: int,
    src: int,
    balance: str,
    causal: bool,
    window: tuple[int | None, int | None] | None = None,
    chunk: int | None = None,
) -> set[tuple[int, int]]:
    """Brute force: the (local query, local key) pairs of rank's block against src's shard, from the global
    positions each holds (xcp.schedule.shard_indices): same document (and chunk of ``chunk`` positions),
    causality and window applied."""
    seq, placed = cu[-1], (tuple(cu) if balance in schedule.DOCUMENT_BALANCES else None)
    qi = schedule.shard_indices(seq, world, rank, balance, placed)
    ki = schedule.shard_indices(seq, world, src, balance, placed)
    left, right = window if window is not None else (None, None)

    def ok(gi: int, gj: int) -> bool:
        return (
            bisect.bisect_right(cu, gi) == bisect.bisect_right(cu, gj)
            and (chunk is None or gi // chunk == gj // chunk)
            and (not causal or gj <= gi)
            and (left is None or gj >= gi - left)
            and (right is None or gj <= gi + right)
        )

    return {(i, j) for i, gi in enumerate(qi) for j, gj in enumerate(ki) if ok(gi, gj)}


def pairs_of_runs(runs: Sequence[Any]) -> list[tuple[int, int]]:
    """Every (query, key) pair the kernel calls of ``runs`` (xcp.documents runs) compute, with repeats
    (there must be none): a segment is full, square causal, or under its bottom-right aligned band."""
    out = []
    for run in runs:
        for a in range(run.segments):
            q0, q1 = run.q0 + run.cu_q[a], run.q0 + run.cu_q[a + 1]
            k0, k1 = run.k0 + run.cu_k[a], run.k0 + run.cu_k[a + 1]
            sq, sk = q1 - q0, k1 - k0
            if run.causal and run.band is None:
                assert sq == sk, "a causal segment is square"
            for i in range(sq):
                for j in range(sk):
                    if run.band is not None:
                        seen = i + sk - sq - run.band[0] <= j <= i + sk - sq + run.band[1]
                    else:
                        seen = not run.causal or j <= i
                    if seen:
                        out.append((q0 + i, k0 + j))
    return out


# ------------------------------------------------------------------------------------ checks, plugins


def assert_matches(got: Result, want: Result, atol: float = 1e-10) -> None:
    """float64: every tensor equal to the reference within ``atol`` absolute (and of its dtype and shape)."""
    for name in TENSORS:
        g, w = getattr(got, name), getattr(want, name)
        assert g is not None, f"{name} missing"
        assert g.dtype == torch.float64, f"{name} has dtype {g.dtype}"
        assert g.shape == w.shape, f"{name} has shape {tuple(g.shape)}, want {tuple(w.shape)}"
        err = (g - w).abs().max().item()
        assert err <= atol, f"{name}: max abs error {err:.3e} > {atol:.0e}"


@contextlib.contextmanager
def installed(backend: Any) -> Iterator[Any]:
    """``backend`` registered (through a plugin, as a third party would) for the block, unregistered after."""

    class Plugin:
        @hookimpl
        def xcp_register_backends(self, register):
            register(backend)

    plugin = Plugin()
    register_plugin(plugin, backend.name)
    try:
        yield backend
    finally:
        unregister_plugin(plugin)


# ------------------------------------------------------------------------------------- gloo processes

GLOO_WORKER_HEAD = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist

    rank, world, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    """
)
"""The start of a worker script for :func:`start_ranks`: ``rank``, ``world`` and ``workdir`` from its
arguments, then the default process group over gloo (60 s timeout), rendezvous in ``workdir``."""


GLOO_WORKER_TAIL = textwrap.dedent(
    """
    sys.stdout.flush()
    sys.stderr.flush()
    import os
    os._exit(0)
    """
)
"""The end of a worker script whose body ran to its end (results written, group destroyed): leave without the
interpreter's teardown, where gloo's threads now and then abort a finished rank ('terminate called without an
active exception', twice in CI in one day, after every check had passed). A body that raises or exits never
gets here, so its exit status stays non-zero."""


def gloo_worker(body: str) -> str:
    """A worker script: :data:`GLOO_WORKER_HEAD`, then ``body`` (dedented), then :data:`GLOO_WORKER_TAIL`."""
    return GLOO_WORKER_HEAD + textwrap.dedent(body) + GLOO_WORKER_TAIL


def start_ranks(source: str, world: int, workdir: Path, *args: str, **env: str) -> list[subprocess.Popen]:
    """Write ``source`` to ``workdir`` and start ``world`` processes of it: ``python script rank world workdir
    *args``, one thread each for OpenMP, gloo on the loopback device, ``env`` added to the environment."""
    script = workdir / "worker.py"
    script.write_text(source)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    if sys.platform.startswith("linux"):
        full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback, whatever the host name resolves to
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(workdir), *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def finish_ranks(procs: Sequence[subprocess.Popen], timeout: float = 180) -> list[str]:
    """Wait for every rank (``timeout`` seconds each at most) and return their logs; fail the test, with the
    logs, when one does not finish (all are killed then) or exits non-zero."""
    logs = []
    try:
        for r, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=timeout)
            logs.append(f"--- rank {r} (exit {proc.returncode}):\n{out}")
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"gloo ranks did not finish within {timeout} s:\n" + "\n".join(logs))
    failed = [p.returncode for p in procs if p.returncode != 0]
    assert not failed, "a gloo rank failed:\n" + "\n".join(logs)
    return logs


# ------------------------------------------------------------------------------------------- transformers


def float64_transformers(monkeypatch: Any) -> Any:
    """Patch transformers' float32 steps (the eager attention's softmax, RMSNorm) to stay in float64, for a
    one-device run and an xcp run alike; returns ``apply(model)``, which patches the model's RMSNorm
    classes and returns the model."""
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    def rmsnorm64(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def norm(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    norms = {  # by how the class keeps its epsilon and weight (Gemma: 1 + weight; Llama-4's qk norm: none)
        "variance_epsilon": rmsnorm64,
        "gemma": lambda self, x: norm(x, self.eps) * (1.0 + self.weight),
        "eps": lambda self, x: norm(x, self.eps) * self.weight,
        "l2": lambda self, x: norm(x, self.eps),
    }

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)

    def apply(model: Any) -> Any:
        for m in model.modules():
            name = type(m).__name__
            if name.endswith("RMSNorm"):
                gemma = "gemma" if name.startswith("Gemma") else "eps"
                kind = "variance_epsilon" if hasattr(m, "variance_epsilon") else gemma
                monkeypatch.setattr(type(m), "forward", norms[kind])
            elif name.endswith("L2Norm"):
                monkeypatch.setattr(type(m), "forward", norms["l2"])
        return model

    return apply
