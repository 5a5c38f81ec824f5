"""The lifetime sanitizer on the decode path: a sharded KV cache's prefill, decode steps and one chunk.

:func:`sanitize_decode` (what ``xcp sanitize --decode`` runs) fills an :class:`xcp.KVCache` per virtual
rank on the simulated device, runs its attention after each append, and reports what the sanitizer finds
(races, reuses, leaks) and the largest error against float64 attention over the whole sequence. The rule
it checks is docs/lifetime.md, rule 3.3 (the combine's hand-off).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import schedule
from ..api import shard
from ..comm import LocalWorld
from ..documents import check_window
from ..inference.cache import KVCache
from ..lifetime import check_handoff, track_buffers
from .sanitizer import TOLERANCE, Finding, Sanitizer, SanitizerReport, gathered_findings


def _reference(q, k, v, s: int, t: int, scale: float, window: tuple | None = None) -> torch.Tensor:
    """float64 causal attention of the queries at ``s - t .. s - 1`` over the first s tokens (under a sliding
    ``window`` ``(left, 0)``: query i over keys ``i - left .. i``)."""
    groups = q.shape[2] // k.shape[2]
    qd = q[:, s - t : s].double().transpose(1, 2)
    kd, vd = (x[:, :s].double().transpose(1, 2).repeat_interleave(groups, 1) for x in (k, v))
    keys, queries = torch.arange(s).view(1, s), torch.arange(s - t, s).view(t, 1)
    allowed = keys <= queries
    if window is not None and window[0] is not None:
        allowed &= keys >= queries - window[0]
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


def _largest_error(outs: list[list[torch.Tensor]], q, k, v, prompt: int, steps: list[int], scale: float,
                   window: tuple | None = None) -> float:  # fmt: skip
    """The largest error of every rank's outputs against the float64 reference, relative to its magnitude."""
    error, s = 0.0, prompt
    for i, t in enumerate(steps):
        s += t
        want = _reference(q, k, v, s, t, scale, window)
        for mine in outs:
            error = max(error, (mine[i].double() - want).abs().max().item() / max(1.0, want.abs().max().item()))
    return error


def sanitize_decode(
    world: int = 4,
    balance: str = "zigzag",
    handoff: str | None = None,
    decode: int = 3,
    chunk: int = 5,
    prompt: int | None = None,
    dtype: torch.dtype = torch.float64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    batch: int = 1,
    seed: int = 0,
    preallocated: bool = False,
    combine: str = "auto",
    value_head_dim: int | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> SanitizerReport:
    """Prefill a KV cache on ``world`` virtual ranks of the sim device, then ``decode`` single tokens and one
    chunk of ``chunk`` tokens, each followed by the cache's attention; check every lifetime rule.

    :param handoff: the combine's hand-off policy; None: the sim backend's default, ``record_stream``.
    :param prompt: the prompt's length (a multiple of what the balance splits); default 2 tokens per rank.
    :param preallocated: caches with ``capacity`` for exactly the run's tokens: the decode steps then keep
        their lengths on the device and run ``forward_range`` (the path a captured step takes).
    :param combine: the caches' ``combine`` (``heads``: a chunk of at least
        :data:`xcp.inference.plan.HEADS_COMBINE_MIN_QUERIES` tokens combines over heads where P divides heads).
    :param value_head_dim: v's head dim (and the output's), None: ``head_dim`` (multi-head latent attention's
        values of another head dim otherwise: the caches keep K and V in their own dims).
    :param window: a sliding window ``(left, right)`` of the cache's attention (causal: ``right`` 0 or None;
        see :func:`xcp.documents.check_window`), checked against float64 attention under the banded mask.
    :returns: a :class:`xcp.testing.sanitizer.SanitizerReport`; findings of kind race, reuse, leak or numerics.
    """
    value_dim = head_dim if value_head_dim is None else value_head_dim
    for name, value in (("world", world), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("value_head_dim", value_dim), ("batch", batch), ("decode", decode)):  # fmt: skip
        if not schedule.is_integer(value) or value < (0 if name == "decode" else 1):
            raise ValueError(f"{name}: expected an integer >= {0 if name == 'decode' else 1}; got {value!r}")
    if not schedule.is_integer(chunk) or chunk < 0:
        raise ValueError(f"chunk: expected an integer >= 0 (0: no chunk); got {chunk!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}; got {kv_heads}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype: expected one of {', '.join(map(str, TOLERANCE))}; got {dtype}")
    if handoff is not None:
        check_handoff(handoff)
    window = check_window(window, True)
    prompt = schedule.required_multiple(world, balance) if prompt is None else prompt
    schedule.check_seq_len(prompt, world, balance, what="prompt")
    steps = [1] * decode + ([chunk] if chunk else [])
    total = prompt + sum(steps)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, total, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, total, kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, total, kv_heads, value_dim, generator=gen, dtype=torch.float64).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    config = {"world": world, "balance": balance, "handoff": handoff or "record_stream", "decode": decode,
              "chunk": chunk, "prompt": prompt, "dtype": str(dtype).replace("torch.", ""), "heads": heads,
              "kv_heads": kv_heads, "preallocated": preallocated}  # fmt: skip
    if value_dim != head_dim:
        config["head_dim"] = f"{head_dim}/{value_dim}"
    if window is not None:
        config["window"] = ",".join("none" if x is None else str(x) for x in window)

    with Sanitizer() as san:
        lw = LocalWorld(world, timeout=60.0)

        def rank(group: Any) -> tuple:
            with san.thread(f"rank{group.rank()}"), track_buffers() as ledger:
                capacity = total if preallocated else None
                cache = KVCache(
                    group=group, balance=balance, capacity=capacity, device="sim", handoff=handoff, combine=combine
                )
                r = group.rank()
                cache.prefill(shard(k[:, :prompt], world, r, balance=balance),
                              shard(v[:, :prompt], world, r, balance=balance))  # fmt: skip
                outs, s = [], prompt
                for t in steps:
                    cache.append(k[:, s : s + t], v[:, s : s + t])
                    s += t
                    outs.append(cache.attention(q[:, s - t : s], window=window))
                del cache
                return ledger, outs

        results = lw.run(rank)
        error = _largest_error([r[1] for r in results], q, k, v, prompt, steps, scale, window)
        ledgers = [r[0] for r in results]
        del results
        lw.release_buffers()
        del lw
        findings, set_aside = gathered_findings(san, ledgers)
    if not error <= TOLERANCE[dtype]:
        tol = TOLERANCE[dtype]
        against = f"float64 attention{' with the banded mask' if window is not None else ''}"
        findings.append(Finding("numerics", f"out: error {error:.3e} against {against} exceeds {tol:g}"))
    return SanitizerReport(config, findings, peak_kv_shards={}, peak_bytes={}, peak_comm_bytes={}, bound_shards=0,
                           bound_comm_bytes=0, max_error={"out": error}, set_aside=set_aside,
                           window=window)  # fmt: skip
