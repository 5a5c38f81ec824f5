"""A serving workload over :class:`xcp.PagedKVCache`, for ``xcp sanitize --serve``, ``xcp run --serve`` and
``xcp plan --serve``.

:func:`workload` draws N requests from a seed: each arrives at some step, prefills its prompt in chunks of at
most ``chunk`` tokens, decodes its new tokens one a step, and leaves (its blocks freed after the step). Each
step is one packed batch: some requests' chunks beside others' decode steps. :func:`serve_rank` runs it on
one rank, auditing the pool after every append and free (every block either free or in exactly one
sequence's table, and at the end every block back in the pool); :func:`sanitize_serve` runs it on the
simulated device under the lifetime sanitizer, whose rule here is the combine's hand-off (docs/lifetime.md,
rule 3.3), and checks every step against float64 attention over each request's whole history.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch

from .. import schedule
from ..comm import LocalWorld
from ..inference.paged import PagedKVCache
from ..inference.paged_decode import PagedDecode, decode_padding
from ..lifetime import check_handoff, track_buffers
from .sanitizer import TOLERANCE, Finding, Sanitizer, SanitizerReport, gathered_findings, on_model


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a workload: ``batch`` the (request, new tokens) packed in it, ``leaving`` the requests freed
    after it."""

    batch: tuple[tuple[int, int], ...]
    leaving: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(t for _, t in self.batch)


def workload(requests: int, seed: int = 0, chunk: int = 8, max_prompt: int = 24, max_new: int = 5) -> list[Step]:
    """The steps of ``requests`` requests drawn from ``seed``: request i arrives at a random step, takes its
    prompt (1 to ``max_prompt`` tokens) in chunks of at most ``chunk``, then 1 to ``max_new`` decode steps, and
    leaves. A step may be empty (nothing has arrived yet)."""
    for name, value in (("requests", requests), ("chunk", chunk), ("max_prompt", max_prompt), ("max_new", max_new)):
        if not schedule.is_integer(value) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1; got {value!r}")
    rng = random.Random(seed)
    arrival = sorted(rng.randint(0, requests) for _ in range(requests))
    prompt = [rng.randint(1, max_prompt) for _ in range(requests)]
    new = [rng.randint(1, max_new) for _ in range(requests)]
    done = [0] * requests  # tokens appended so far
    steps, step = [], 0
    while any(d < p + n for d, p, n in zip(done, prompt, new)):
        batch, leaving = [], []
        for i in range(requests):
            if arrival[i] > step or done[i] == prompt[i] + new[i]:
                continue
            t = min(chunk, prompt[i] - done[i]) if done[i] < prompt[i] else 1
            batch.append((i, t))
            done[i] += t
            if done[i] == prompt[i] + new[i]:
                leaving.append(i)
        steps.append(Step(tuple(batch), tuple(leaving)))
        step += 1
    return steps


def workload_data(steps: list[Step], heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> list[tuple]:
    """Per request, float64 (q, k, v) of its whole history [L, heads | kv_heads, head_dim]."""
    lengths: dict[int, int] = {}
    for s in steps:
        for i, t in s.batch:
            lengths[i] = lengths.get(i, 0) + t
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(
            torch.randn(lengths.get(i, 0), h, head_dim, generator=g, dtype=torch.float64)
            for h in (heads, kv_heads, kv_heads)
        )
        for i in range(max(lengths, default=-1) + 1)
    ]


def reference(steps: list[Step], data: list[tuple]) -> list[torch.Tensor]:
    """Each step's float64 causal attention of the batch's new queries over their requests' histories."""
    outs, lengths = [], dict[int, int]()
    for s in steps:
        rows = []
        for i, t in s.batch:
            n = lengths[i] = lengths.get(i, 0) + t
            q, k, v = (x[:n].transpose(0, 1) for x in data[i])
            groups = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            allowed = torch.arange(n)[:, None] >= torch.arange(n)[None]
            whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            rows.append(whole.transpose(0, 1)[n - t :])
        heads, dim = data[0][0].shape[1], data[0][2].shape[2]
        outs.append(torch.cat(rows) if rows else torch.zeros(0, heads, dim, dtype=torch.float64))
    return outs


def audit(cache: PagedKVCache) -> str | None:
    """What is wrong with the pool, or None: every block free or in exactly one sequence's table."""
    owners: dict[int, Any] = {}
    for seq_id in cache.seq_ids():
        for b in cache.block_table(seq_id):
            if b in owners:
                return f"block {b} is in the tables of {owners[b]!r} and {seq_id!r}"
            owners[b] = seq_id
    free = cache.free_block_ids()
    for b in free:
        if b in owners:
            return f"block {b} is free and in the table of {owners[b]!r}"
    if len(owners) + len(free) != cache.num_blocks or len(set(free)) != len(free):
        return f"{len(owners)} blocks held and {len(free)} free of {cache.num_blocks}"
    return None


def serve_rank(group: Any, steps: list[Step], data: list[tuple], dtype: torch.dtype, cache_kwargs: dict,
               problems: list[Finding], decode: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """Run ``steps`` on one rank: append each batch, attend, free the leaving requests; the outputs of every
    step. With ``decode``, a step whose every request is known and takes one token runs as
    :class:`xcp.PagedDecode`'s plan and step instead (padded to its sizes: the padding's writes go to the sink).
    Each pool audit's complaint goes to ``problems`` (a reuse), and so do blocks or requests left at the end
    (a leak)."""
    cache = PagedKVCache(group, **cache_kwargs)
    decoder: PagedDecode | None = None
    r, lengths, outs = group.rank(), dict[int, int](), list[torch.Tensor]()
    heads, dim = data[0][0].shape[1], data[0][0].shape[2]
    for n, s in enumerate(steps):
        ids, cu = [], [0]
        pieces: tuple[list[torch.Tensor], ...] = ([], [], [])
        for i, t in s.batch:
            a = lengths.get(i, 0)
            lengths[i] = a + t
            ids.append(i)
            cu.append(cu[-1] + t)
            for got, x in zip(pieces, data[i]):
                got.append(x[a : a + t])
        q, k, v = (torch.cat(p).to(dtype) if p else torch.zeros(0, h, dim, dtype=dtype)
                   for p, h in zip(pieces, (heads, data[0][1].shape[1], data[0][2].shape[1])))  # fmt: skip
        if decode and decoder is None and cache.seq_ids():
            decoder = PagedDecode(cache, max_batch=len(data), max_len=max(x[0].shape[0] for x in data))
        if decoder is not None and s.batch and all(t == 1 and lengths[i] > 1 for i, t in s.batch):
            padded = decode_padding(decoder.plan(ids), q, k, v)
            outs.append(decoder.step(*padded)[: len(ids)])
        else:
            cache.append(ids, k, v, cu)
            out = cache.attention(q, ids, cu)
            assert isinstance(out, torch.Tensor)  # without return_lse
            outs.append(out)
        for i in s.leaving:
            cache.free(i)
        wrong = audit(cache)
        if wrong:
            problems.append(Finding("reuse", f"rank {r}, step {n}: {wrong}"))
    if cache.free_blocks != cache.num_blocks or cache.seq_ids():
        left = f"{cache.num_blocks - cache.free_blocks} blocks of {len(cache.seq_ids())} requests"
        problems.append(Finding("leak", f"rank {r}: {left} not back in the pool after every request left"))
    return outs


def largest_error(outs: list[list[torch.Tensor]], wants: list[torch.Tensor]) -> float:
    """The largest error of any rank's step output against its float64 reference, relative to its magnitude."""
    error = 0.0
    for mine in outs:
        for got, want in zip(mine, wants):
            if want.numel():
                error = max(error, (got.double() - want).abs().max().item() / max(1.0, want.abs().max().item()))
    return error


def sanitize_serve(
    requests: int = 6,
    world: int = 3,
    handoff: str | None = None,
    dtype: torch.dtype = torch.float64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    interleave: int = 1,
    num_blocks: int | None = None,
    chunk: int = 8,
    seed: int = 0,
    decode: bool = False,
    backend: Callable[[Any], Any] | None = None,
) -> SanitizerReport:
    """Run a :func:`workload` of ``requests`` requests on ``world`` virtual ranks of the sim device, one
    :class:`xcp.PagedKVCache` per rank, under the lifetime sanitizer; findings: race, reuse and leak (the
    sanitizer's, the ledger's, and the pool's: a block in two places, blocks not back at the end) and numerics
    (against float64 attention over each request's history).

    :param num_blocks: each rank's pool; default the most the workload ever holds at once, so it always fits.
    :param decode: the steps of single tokens of known requests through :class:`xcp.PagedDecode` (see
        :func:`serve_rank`).
    :param backend: ``backend(model)`` builds a backend whose streams and events are the sanitizer's device model's,
        registered for the run and used in place of ``sim``: the rules checked under another backend's kernels and
        hand-off policy (tests/npu_standin.py's ``NPUOnSim``: Ascend's).
    """
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype: expected one of {', '.join(map(str, TOLERANCE))}; got {dtype}")
    if handoff is not None:
        check_handoff(handoff)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}; got {kv_heads}")
    steps = workload(requests, seed, chunk)
    data = workload_data(steps, heads, kv_heads, head_dim, seed)
    if num_blocks is None:
        num_blocks = max(1, max_blocks(steps, world, block_size, interleave))
    kwargs = {"num_blocks": num_blocks, "block_size": block_size, "interleave": interleave, "handoff": handoff}
    config = {"requests": requests, "steps": len(steps), "world": world, "handoff": handoff,
              "dtype": str(dtype).replace("torch.", ""), "heads": heads, "kv_heads": kv_heads,
              "block_size": block_size, "num_blocks": num_blocks, "interleave": interleave,
              "decode": "PagedDecode" if decode else "attention"}  # fmt: skip
    problems: list[Finding] = []
    with Sanitizer() as san, on_model(san, backend) as used:
        kwargs["device"] = used.name
        config["handoff"] = handoff or used.handoff_policy
        lw = LocalWorld(world, timeout=60.0)

        def rank(group: Any) -> tuple:
            with san.thread(f"rank{group.rank()}"), track_buffers() as ledger:
                return ledger, serve_rank(group, steps, data, dtype, kwargs, problems, decode)

        results = lw.run(rank)
        error = largest_error([r[1] for r in results], reference(steps, data))
        ledgers = [r[0] for r in results]
        del results
        lw.release_buffers()
        del lw
        findings, set_aside = gathered_findings(san, ledgers)
    findings.extend(problems)
    if not error <= TOLERANCE[dtype]:
        findings.append(
            Finding("numerics", f"out: error {error:.3e} against float64 attention exceeds {TOLERANCE[dtype]:g}")
        )
    return SanitizerReport(config, findings, peak_kv_shards={}, peak_bytes={}, peak_comm_bytes={}, bound_shards=0,
                           bound_comm_bytes=0, max_error={"out": error}, set_aside=set_aside)  # fmt: skip


def max_blocks(steps: list[Step], world: int, block_size: int, interleave: int) -> int:
    """The most blocks any rank holds at once during ``steps``."""
    from ..inference.serving import held

    lengths: dict[int, int] = {}
    most = 0
    for s in steps:
        for i, t in s.batch:
            lengths[i] = lengths.get(i, 0) + t
        for r in range(world):
            most = max(most, sum(-(-held(n, world, r, interleave) // block_size) for n in lengths.values()))
        for i in s.leaving:
            del lengths[i]
    return most


__all__ = ["Step", "audit", "max_blocks", "reference", "sanitize_serve", "serve_rank", "workload", "workload_data"]
