"""``xcp plan``: the ring schedule as a step x rank table (or a picture), so that who computes on which
shard, and who sends to whom, can be read before anything runs; with ``--decode``, the steps of a sharded KV
cache (:mod:`xcp.cli.decode`)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from .. import schedule
from ..documents import document_plan
from ..hybrid import hybrid_traffic, kv_replicas
from ..kernels.merge import accumulator_dtype
from ..traffic import ring_bytes, travelling_tokens
from . import decode, packing, recurrent, serve, ulysses, windows
from .common import (
    DTYPES,
    Problem,
    add_problem_flags,
    check_heads,
    head_dims_text,
    human_bytes,
    positive,
    pyplot,
)

WIDTH = 100
"""Columns the table keeps within; wider worlds are printed in blocks of ranks."""

KIND_CODES = {
    schedule.FULL: "F",
    schedule.DIAGONAL: "D",
    schedule.LOWER: "L",
    schedule.UPPER: "U",
    schedule.STRIPE_CAUSAL: "C",
    schedule.STRIPE_STRICT: "S",
    schedule.SKIP: "x",
}


def _plans(world_size: int, causal: bool, balance: str, steps: int | None = None) -> list[schedule.Plan]:
    """Every rank's plan: all P steps, or the first ``steps`` (a ring over documents that ends early)."""
    if steps is None or steps == world_size:
        return [schedule.plan(world_size, r, causal, balance) for r in range(world_size)]
    return [schedule.plan(world_size, r, causal, balance, steps) for r in range(world_size)]


def _ring_peers(steps: list[schedule.Step], world_size: int) -> str | None:
    """The peers of a step, when every rank has the same ones relative to itself; else None."""
    if all(s.send_to is None and s.recv_from is None for s in steps):
        return "none"
    if all(s.send_to == (s.rank + 1) % world_size and s.recv_from == (s.rank - 1) % world_size for s in steps):
        return "->r+1 <-r-1"
    return None


def _cell(step: schedule.Step, peers: bool) -> str:
    text = f"{step.src}{KIND_CODES.get(step.kind, '?')} {step.work:.2f}"
    if peers and step.send_to is not None:
        text += f" >{step.send_to}<{step.recv_from}"
    return text


def _grid(cells: list[list[str]], peers: list[str | None], rows: list[tuple[str, list[str]]], width: int) -> list[str]:
    """The step x rank grid within ``width`` columns, in blocks of ranks: one line per step (its cells and
    kv peers), then one line per entry of ``rows`` (a name and a text per rank)."""
    world_size = len(cells[0])
    col = max(4, *(len(c) for row in cells for c in row), *(len(t) for _, texts in rows for t in texts),
              len(f"r{world_size - 1}")) + 1  # fmt: skip
    peer_col = max(len("kv peers"), *(len(p or "in cells") for p in peers)) + 1
    per_block = max(1, (width - 6 - peer_col) // col)
    lines = []
    for start in range(0, world_size, per_block):
        ranks = range(start, min(start + per_block, world_size))
        lines.append("")
        lines.append(f"{'step':<6}" + "".join(f"{'r' + str(r):<{col}}" for r in ranks) + "kv peers")
        for i, row in enumerate(cells):
            lines.append(f"{i:<6}" + "".join(f"{row[r]:<{col}}" for r in ranks) + (peers[i] or "in cells"))
        for name, texts in rows:
            lines.append(f"{name:<6}" + "".join(f"{texts[r]:<{col}}" for r in ranks))
    return lines


BACKWARD_NOTE = "backward: dK/dV of each shard follow it one step behind; after the last step each goes home to r+1"
PEERS_NOTE = "kv peers: where each rank sends the KV it holds (->) and receives the next (<-) after the step"


def plan_table(world_size: int, causal: bool, balance: str, width: int = WIDTH) -> str:
    """The step x rank table within ``width`` columns: one row per step, per rank a compact cell (source
    shard, block kind code, share of a full block), and per step the KV peers (in the cells where they are
    not the ring's ``->r+1 <-r-1``)."""
    plans = _plans(world_size, causal, balance)
    steps = [[p.steps[i] for p in plans] for i in range(world_size)]
    peers = [_ring_peers(row, world_size) for row in steps]
    cells = [[_cell(s, peers[i] is None) for s in row] for i, row in enumerate(steps)]
    totals = [f"{sum(s.work for s in p.steps):.2f}" for p in plans]
    kinds = dict.fromkeys(s.kind for row in steps for s in row)
    lines = [
        f"ring plan: world {world_size}, {'causal' if causal else 'full'} attention, balance {balance}",
        "cell: <source shard><block kind> <share of a full block>; "
        + ", ".join(f"{KIND_CODES.get(k, '?')} {k}" for k in kinds),
        PEERS_NOTE,
        *_grid(cells, peers, [("total", totals)], width),
        "",
        BACKWARD_NOTE,
    ]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------------------------------- packed documents
EMPTY, CAUSAL, BAND, MIXED = "empty", "causal", "band", "mixed"
DOCUMENT_KINDS = {EMPTY: "x", schedule.FULL: "F", CAUSAL: "C", BAND: "B", MIXED: "M"}
"""Block kinds with documents or a window: nothing to compute, only unmasked segments, only square-causal
ones, only banded ones (a sliding window), more than one of these."""
KIND_NOTES = {EMPTY: "empty", schedule.FULL: "full (unmasked segments)", CAUSAL: "causal (square-causal segments)",
              BAND: "banded (sliding-window segments)", MIXED: "mixed (several kinds)"}  # fmt: skip


@dataclass(frozen=True)
class DocumentBlock:
    """What one rank computes at one step of a ring over packed documents."""

    src: int
    calls: int  # kernel calls (xcp.documents.Run)
    segments: int  # document segments in them
    pairs: int  # (query, key) pairs computed
    work: float  # pairs as a share of a full shard x shard block
    kind: str

    @property
    def code(self) -> str:
        return DOCUMENT_KINDS[self.kind]


def _block_kind(runs) -> str:
    kinds = {BAND if r.band is not None else CAUSAL if r.causal else schedule.FULL for r in runs}
    if not kinds:
        return EMPTY
    return MIXED if len(kinds) > 1 else kinds.pop()


def document_blocks(
    cu: tuple[int, ...], world_size: int, causal: bool, balance: str, window: tuple | None = None
) -> list[list[DocumentBlock]]:
    """``[step][rank]``: the :class:`DocumentBlock` of every cell of the ring over documents ``cu`` (``(0, S)``
    for one sequence) under an optional sliding ``window``, for the steps the ring runs (all P, or fewer
    where every rank's later blocks are empty)."""
    local = cu[-1] // world_size
    plans = [document_plan(cu, world_size, r, causal, balance, window) for r in range(world_size)]
    steps = len(plans[0].steps)
    return [
        [
            DocumentBlock(
                src=(r - i) % world_size,
                calls=len(p.steps[i]),
                segments=sum(run.segments for run in p.steps[i]),
                pairs=p.pairs[i],
                work=p.work(local)[i],
                kind=_block_kind(p.steps[i]),
            )
            for r, p in enumerate(plans)
        ]
        for i in range(steps)
    ]


def _ring_end(m: int, world_size: int) -> list[str]:
    """How a ring of ``m`` of ``world_size`` steps ends, forward and backward."""
    if m == world_size:
        return [BACKWARD_NOTE]
    if m == 1:
        return ["the ring stops after step 0 (every later block is empty): nothing moves, forward or backward"]
    return [
        f"the ring stops after {m} of {world_size} steps (every later block is empty): "
        f"K/V move {m - 1} time{'s' * (m > 2)}",
        f"backward: dK/dV of each shard follow it one step behind; after step {m - 1} each goes home to r-{m - 1}",
    ]


def _wrap(head: str, items: list[str], width: int) -> list[str]:
    """``head`` and the comma-separated ``items``, over as many lines as ``width`` needs."""
    lines, line = [], head
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if len(line) + len(text) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += text + " "
    return [*lines, line.rstrip()]


def document_table(
    cu: tuple[int, ...], world_size: int, causal: bool, balance: str, width: int = WIDTH, window: tuple | None = None
) -> str:
    """The step x rank table of a ring over packed documents ``cu`` (global boundaries; ``(0, S)``: one
    sequence, with a ``window``): per cell the source shard, the block kind, kernel calls / segments and the
    share of a full block; per rank the total work and calls; then the balance of the work over ranks
    (max / mean)."""
    blocks = document_blocks(cu, world_size, causal, balance, window)
    m = len(blocks)
    ring = _plans(world_size, causal, balance, m)  # who sends to whom: the ring's m steps
    peers = [_ring_peers([p.steps[i] for p in ring], world_size) for i in range(m)]
    cells = []
    for i, row in enumerate(blocks):
        texts = [f"{b.src}{b.code} {b.calls}/{b.segments} {b.work:.2f}" for b in row]
        if peers[i] is None:
            texts = [t + f" >{ring[r].steps[i].send_to}<{ring[r].steps[i].recv_from}" for r, t in enumerate(texts)]
        cells.append(texts)
    work = [sum(row[r].work for row in blocks) for r in range(world_size)]
    calls = [f"{sum(row[r].calls for row in blocks)}/{sum(row[r].segments for row in blocks)}"
             for r in range(world_size)]  # fmt: skip
    dense_work = [sum(s.work for s in p.steps) for p in _plans(world_size, causal, balance)]
    lengths = packing.lengths_of(cu)
    packed = window is None or len(lengths) > 1
    kinds = [k for k in DOCUMENT_KINDS if any(b.kind == k for row in blocks for b in row)]
    mean = sum(work) / world_size
    without = " or ".join(name for name, on in (("documents", packed), ("window", window is not None)) if on)
    held = sorted(set(schedule.shard_lengths(cu[-1], world_size, balance)))  # document_zigzag's differ by a token
    per_rank = f"S = {cu[-1]} tokens ({' or '.join(map(str, held))} per rank)"
    lines = [
        f"ring plan: world {world_size}, {'causal' if causal else 'full'} attention, balance {balance}"
        + (f", {len(lengths)} packed documents" if packed else "")
        + (f", sliding {windows.text_of(window)}" if window is not None else ""),
        *([f"documents: {per_rank}, lengths {packing.abbreviate(lengths, 6)}"] if packed else []),
        *([f"{windows.describe(window)}" + ("" if packed else f", {per_rank}")] if window is not None else []),
        f"cell: <source shard><block kind> <kernel calls>/<{'document ' if packed else ''}segments> "
        "<share of a full block>",
        *_wrap("block kinds: ", [f"{DOCUMENT_KINDS[k]} {KIND_NOTES[k]}" for k in kinds], width),
        PEERS_NOTE,
        *_grid(cells, peers, [("total", [f"{w:.2f}" for w in work]), ("calls", calls)], width),
        "",
        f"work per rank: max {max(work):.3f}, mean {mean:.3f}, max/mean {packing.max_over_mean(work):.3f} "
        f"(1 = balanced; {packing.max_over_mean(dense_work):.3f} without {without})"
        if window is None or not packed
        else f"work per rank: max {max(work):.3f}, mean {mean:.3f}, max/mean {packing.max_over_mean(work):.3f} "
        f"(1 = balanced; dense {packing.max_over_mean(dense_work):.3f})",
        *_ring_end(m, world_size),
    ]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------------------------------- steps and bytes
def bytes_cell(n: int) -> str:
    """``64.0 MiB (67108864 B)``, or ``512 B``: readable, with the exact count."""
    return human_bytes(n) + (f" ({n} B)" if n >= 1024 else "")


def dims_label(head_dim: int, value_head_dim: int | None) -> str:
    """``D 128``, or ``D/Dv 192/128`` where v's head dim is another (None: the same)."""
    same = value_head_dim is None or value_head_dim == head_dim
    return f"{'D' if same else 'D/Dv'} {head_dims_text(head_dim, value_head_dim)}"


def cost_lines(seq: int, world_size: int, steps: int, kv_heads: int, head_dim: int, dtype: str,
               value_head_dim: int | None = None, balance: str = schedule.DEFAULT_BALANCE) -> list[str]:  # fmt: skip
    """What a ring of ``steps`` of ``world_size`` steps over ``seq`` tokens costs each rank in bytes sent,
    next to the dense ring's (all P steps), and how they are counted (see :mod:`xcp.cli.windows`): K in
    ``head_dim``, V in ``value_head_dim`` (None: ``head_dim``), shards as ``balance`` makes them travel."""
    torch_dtype = DTYPES[dtype]
    dv = head_dim if value_head_dim is None else value_head_dim
    ring, dense = (ring_bytes(seq, world_size, m, kv_heads, head_dim, dv, torch_dtype, balance)
                   for m in (steps, world_size))  # fmt: skip
    local = travelling_tokens(seq, world_size, balance)

    cell = bytes_cell
    rows = [
        ("steps", f"{steps} of {world_size}", f"{world_size} of {world_size}"),
        ("forward K/V", cell(ring.forward), cell(dense.forward)),
        ("backward K/V", cell(ring.backward_kv), cell(dense.backward_kv)),
        ("backward dK/dV", cell(ring.backward_dkv), cell(dense.backward_dkv)),
        ("fwd+bwd total", cell(ring.total), cell(dense.total)),
    ]
    width = max(len("this ring"), *(len(r[1]) for r in rows)) + 2
    formula = windows.formula_lines(ring, local, kv_heads, head_dim, torch_dtype, dv, seq % world_size != 0)
    return [
        f"ring cost: steps run and bytes sent per rank (S = {seq}, Hkv {kv_heads}, {dims_label(head_dim, dv)}, "
        f"{dtype}, batch 1):",
        *("  " + line for line in formula),
        f"  {'':<16}{'this ring':<{width}}dense ring (all P steps)",
        *(f"  {name:<16}{a:<{width}}{b}" for name, a, b in rows),
    ]


# ---------------------------------------------------------------------------------------- hybrid (ulysses)
def _groups_text(groups: list[list[int]], width: int) -> list[str]:
    text = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
    return textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="  ")


def hybrid_lines(world: int, ulysses: int, heads: int, kv_heads: int, width: int = WIDTH) -> list[str]:
    """The head groups and rings of ``xcp.attention(..., ulysses=U)`` on ``world`` ranks, and what each rank
    holds before the all-to-all and in the ring."""
    u, r = ulysses, world // ulysses
    t = kv_replicas(heads, kv_heads, u)
    replicated = f" ({kv_heads} K/V heads replicated {t}x to {kv_heads * t})" if t > 1 else ""
    return [
        f"hybrid all-to-all + ring: world {world} = ulysses {u} x ring {r}",
        f"head groups of U = {u} consecutive ranks (an all-to-all in each: heads scattered, tokens gathered):",
        *_groups_text([list(range(g * u, (g + 1) * u)) for g in range(r)], width),
        f"rings of R = {r} rank{'s' * (r > 1)} with equal r % {u} (rank r is ring position r // {u}):",
        *_groups_text([list(range(g, world, u)) for g in range(u)], width),
        *textwrap.wrap(
            f"each rank holds S/P tokens (piece r % {u} of ring shard r // {u}) with all {heads} query and {kv_heads} "
            f"K/V heads; in the ring it holds the whole ring shard r // {u} (S/R tokens) with {heads // u} query "
            f"and {kv_heads * t // u} K/V heads{replicated}. The ring table below is every ring's: its columns "
            f"{'r0' if r == 1 else f'r0..r{r - 1}'} are ring positions, not ranks",
            width,
        ),
    ]


@dataclass(frozen=True)
class StepBytes:
    """One row of the hybrid's bytes table: what one rank sends at one step (or at each of ``steps`` ring
    steps) of a pass."""

    phase: str  # forward, backward
    step: str  # all-to-all in, ring steps 0..2, all-to-all out
    what: str  # q, k, v, K/V shard, dK/dV, out, dout, dq, dk, dv
    per_step: int
    steps: int

    @property
    def total(self) -> int:
        return self.per_step * self.steps


def _ring_step(first: int, last: int) -> str:
    return f"ring step {first}" if first == last else f"ring steps {first}..{last}"


def _mean(a: int, b: int) -> int:
    """The bytes of a count made at q/k's head dim (``a``) and at v's (``b``) whose tensors are half in each:
    the formulas are linear in the head dim, so the mean (exact: each counts two tensors alike)."""
    return (a + b) // 2


def hybrid_step_bytes(t, tv=None) -> list[StepBytes]:
    """The rows of :func:`hybrid_cost_lines` from a :class:`xcp.hybrid.HybridTraffic` at q/k's head dim
    (``t``) and at v's (``tv``; None: the same): q, k, dq, dk in D; v, out, dout, dv in Dv; the ring's K/V
    shards and dK/dV messages half in each."""
    tv = t if tv is None else tv
    m = t.ring_steps
    shard, message = _mean(t.kv_shard, tv.kv_shard), _mean(t.dkv_message, tv.dkv_message)
    a2a_in, a2a_out = "all-to-all in", "all-to-all out"
    rows = [StepBytes("forward", a2a_in, x, n, 1) for x, n in (("q", t.q), ("k", t.kv), ("v", tv.kv))]
    if m > 1:
        rows.append(StepBytes("forward", _ring_step(0, m - 2), "K/V shard", shard, m - 1))
    else:
        rows.append(StepBytes("forward", "ring step 0", "nothing", 0, 1))
    rows.append(StepBytes("forward", a2a_out, "out", tv.q, 1))
    rows.append(StepBytes("backward", a2a_in, "dout", tv.q, 1))
    if m > 1:
        rows.append(StepBytes("backward", _ring_step(0, m - 2), "K/V shard", shard, m - 1))
        rows.append(StepBytes("backward", _ring_step(0, m - 1), "dK/dV", message, m))
    else:
        rows.append(StepBytes("backward", "ring step 0", "nothing", 0, 1))
    rows += [StepBytes("backward", a2a_out, x, n, 1) for x, n in (("dq", t.q), ("dk", t.kv), ("dv", tv.kv))]
    return rows


def _hybrid_formula(seq: int, world: int, u: int, steps: int, heads: int, kv_heads: int, head_dim: int, dv: int,
                    item: int, acc: str, t, tv) -> list[str]:  # fmt: skip
    """How :func:`hybrid_cost_lines` counts its bytes, with the problem's numbers in."""
    r, n = world // u, seq // world
    hkv = kv_heads * kv_replicas(heads, kv_heads, u)
    replicated = " (replicated)" if hkv != kv_heads else ""
    head = f"all-to-all: each rank sends (U-1)/U of each of its tensors of S/P = {n} tokens (it keeps its own heads' "
    head += "piece): "
    q_formula = f"(U-1)/U·(S/P)·H·D·itemsize = {u - 1}/{u}·{n}·{heads}·{head_dim}·{item} = {human_bytes(t.q)}"
    ring = f"ring over R = {r} rank{'s' * (r > 1)}, {steps} of {r} steps: a K/V shard is "
    if dv == head_dim:
        a2a = (f"q, out, dout, dq {q_formula}; k, v, dk, dv the same with Hkv' = {hkv} K/V heads{replicated}: "
               f"{human_bytes(t.kv)}")  # fmt: skip
        ring += f"2·(S/R)·(Hkv'/U)·D·itemsize = 2·{seq // r}·{hkv // u}·{head_dim}·{item}"
    else:  # q, k and their gradients in D; v, out and theirs in Dv
        a2a = (f"q, dq {q_formula}; out, dout the same in Dv = {dv}: {human_bytes(tv.q)}; k, dk the same with "
               f"Hkv' = {hkv} K/V heads{replicated}: {human_bytes(t.kv)}; v, dv with Hkv' in Dv: "
               f"{human_bytes(tv.kv)}")  # fmt: skip
        ring += f"(S/R)·(Hkv'/U)·(D+Dv)·itemsize = {seq // r}·{hkv // u}·({head_dim}+{dv})·{item}"
    ring += (f" = {human_bytes(_mean(t.kv_shard, tv.kv_shard))}; forward m-1 K/V shards, backward m-1 K/V shards "
             f"and m dK/dV messages ({acc} accumulators: {human_bytes(_mean(t.dkv_message, tv.dkv_message))}); a ring "
             "of 1 step sends nothing")  # fmt: skip
    wrap = textwrap.TextWrapper(WIDTH - 2, initial_indent="  ", subsequent_indent="  ")
    return [*wrap.wrap(head + a2a), *wrap.wrap(ring)]


def hybrid_cost_lines(
    seq: int,
    world: int,
    ulysses: int,
    steps: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    flat_steps: int | None,
    value_head_dim: int | None = None,
) -> list[str]:
    """The bytes one rank sends at each step of the hybrid's forward and backward (all-to-alls and ring),
    per tensor, how they are counted, and the totals next to the ring alone over all ``world`` ranks
    (``flat_steps`` of them; None where the balance cannot place S over P ranks). q, k and their gradients
    in ``head_dim``; v, out and theirs in ``value_head_dim`` (None: ``head_dim``)."""
    torch_dtype = DTYPES[dtype]
    u = ulysses
    dv = head_dim if value_head_dim is None else value_head_dim

    def traffic(dim: int, ulysses: int, steps: int):
        return hybrid_traffic(1, seq, heads, kv_heads, dim, torch_dtype, world, ulysses, steps)

    t, tv = traffic(head_dim, u, steps), traffic(dv, u, steps)
    acc = str(accumulator_dtype(torch_dtype)).replace("torch.", "")
    lines = [
        f"bytes sent per rank, one forward and one backward (S = {seq}, H {heads}, Hkv {kv_heads}, "
        f"{dims_label(head_dim, dv)}, {dtype}, batch 1):",
        *_hybrid_formula(seq, world, u, steps, heads, kv_heads, head_dim, dv, torch_dtype.itemsize, acc, t, tv),
    ]
    rows = hybrid_step_bytes(t, tv)
    per = max(len("bytes per step"), *(len(bytes_cell(x.per_step)) for x in rows)) + 2
    lines.append(f"  {'pass':<10}{'step':<20}{'sends':<11}{'bytes per step':<{per}}{'steps':<7}bytes")
    previous = None
    for x in rows:
        phase = x.phase if x.phase != previous else ""
        previous = x.phase
        lines.append(
            f"  {phase:<10}{x.step:<20}{x.what:<11}{bytes_cell(x.per_step):<{per}}{x.steps:<7}{bytes_cell(x.total)}"
        )
    mine = {name: _mean(getattr(t, name), getattr(tv, name)) for name in ("forward", "backward", "total")}
    alone = None
    if flat_steps is not None:
        flat, flat_v = traffic(head_dim, 1, flat_steps), traffic(dv, 1, flat_steps)
        alone = {name: _mean(getattr(flat, name), getattr(flat_v, name)) for name in mine}
    col = max(len(f"this hybrid (U = {u})"), *(len(bytes_cell(n)) for n in mine.values())) + 2
    lines.append(f"  {'per rank':<41}{'this hybrid (U = ' + str(u) + ')':<{col}}"
                 + ("" if alone is None else f"ring alone over P = {world} (U = 1)"))  # fmt: skip
    for name, key in (("forward total", "forward"), ("backward total", "backward"), ("fwd+bwd total", "total")):
        lines.append(f"  {name:<41}{bytes_cell(mine[key]):<{col}}" + ("" if alone is None else bytes_cell(alone[key])))
    if alone is None:
        lines.append(f"  (the ring alone cannot place S = {seq} over P = {world} ranks with this balance)")
    return [line.rstrip() for line in lines]


# ---------------------------------------------------------------------------------------- plots
def _plot_grid(work, kinds, texts, totals, title: str, path: str) -> None:
    """A step x rank heat map coloured by each cell's share of work (0..1), each cell hatched by its kind
    and labelled with ``texts``, with each rank's total work under the map."""
    plt = pyplot()
    steps, world_size = len(work), len(work[0])
    fig, ax = plt.subplots(figsize=(0.9 * world_size + 2.6, 0.9 * steps + 2.0), layout="constrained")
    im = ax.imshow(work, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    from matplotlib.patches import Patch, Rectangle

    names = list(dict.fromkeys(k for row in kinds for k in row))
    hatch = dict(zip(names, ("", "//", "..", "xx", "\\\\", "oo", "++")))
    for i in range(steps):
        for r in range(world_size):
            if hatch[kinds[i][r]]:  # the block kind as a pattern, so equal shares of different kinds differ
                ax.add_patch(Rectangle((r - 0.5, i - 0.5), 1, 1, fill=False, hatch=hatch[kinds[i][r]], ec="0.75",
                                       lw=0))  # fmt: skip
            ink = "black" if work[i][r] > 0.6 else "white"
            box = {"boxstyle": "round,pad=0.2", "fc": "white" if ink == "black" else "black", "alpha": 0.7, "lw": 0}
            ax.text(r, i, texts[i][r], ha="center", va="center", fontsize=7, color=ink, bbox=box, zorder=5)
    ax.set_xlabel("rank (total work: " + " ".join(f"{t:.2f}" for t in totals) + ")", fontsize=8)
    ax.set_ylabel("step")
    ax.set_xticks(range(world_size))
    ax.set_yticks(range(steps))
    ax.set_title(title, fontsize=9)
    handles = [Patch(fc="white", ec="0.4", hatch=hatch[k] * 2, label=k) for k in names]
    fig.legend(handles=handles, title="block kind (pattern)", fontsize=7, title_fontsize=7, loc="outside lower center",
               ncols=len(names))  # fmt: skip
    fig.colorbar(im, ax=ax, label="share of work: fraction of a full shard x shard block")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plan(world_size: int, causal: bool, balance: str, path: str) -> None:
    """Draw the plan as a heat map coloured by each cell's share of work, each cell labelled with its source
    shard and block kind, with the total work per rank under the map."""
    plans = _plans(world_size, causal, balance)
    steps = [[plans[r].steps[i] for r in range(world_size)] for i in range(world_size)]
    _plot_grid(
        [[s.work for s in row] for row in steps],
        [[s.kind for s in row] for row in steps],
        [[f"src {s.src}\n{s.kind}\n{s.work:.2f}" for s in row] for row in steps],
        [sum(s.work for s in p.steps) for p in plans],
        f"xcp ring plan: P={world_size}, {'causal' if causal else 'full'}, {balance}\n"
        "colour: share of work per cell; text: source shard, kind, share",
        path,
    )


def plot_documents(
    cu: tuple[int, ...], world_size: int, causal: bool, balance: str, path: str, window: tuple | None = None
) -> None:
    """Draw the plan over packed documents (or under a window) like :func:`plot_plan`; each cell also shows
    its kernel calls and segments."""
    blocks = document_blocks(cu, world_size, causal, balance, window)
    work = [sum(row[r].work for row in blocks) for r in range(world_size)]
    _plot_grid(
        [[b.work for b in row] for row in blocks],
        [[b.kind for b in row] for row in blocks],
        [[f"src {b.src}\n{b.kind}\n{b.calls}/{b.segments}\n{b.work:.2f}" for b in row] for row in blocks],
        work,
        f"xcp ring plan: P={world_size}, {'causal' if causal else 'full'}, {balance}, {len(cu) - 1} documents, "
        + (f"window {windows.text_of(window)}, " if window is not None else "")
        + f"S={cu[-1]}, work max/mean {packing.max_over_mean(work):.2f}"
        + (f", {len(blocks)} of {world_size} steps" if len(blocks) < world_size else "")
        + "\n"
        "colour: share of work per cell; text: source shard, kind, kernel calls/segments, share",
        path,
    )


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="print (or plot) the step x rank table of a ring plan",
        description="With --documents, each cell shows what one rank computes at one step of a ring over packed "
        "documents: the block kind (x empty, F full, C causal, M mixed), kernel calls / document segments and "
        "the share of a full shard x shard block; then each rank's total and the balance (max/mean).",
    )
    p.add_argument("--world", type=positive, required=True, help="ranks in the ring")
    p.add_argument("--causal", action="store_true", help="causal mask (default: full attention)")
    p.add_argument("--balance", choices=windows.DOCUMENT_BALANCE_CHOICES, default=schedule.DEFAULT_BALANCE,
                   help=f"{windows.BALANCE_HELP}; {packing.DOCUMENT_BALANCE_HELP}")  # fmt: skip
    packing.add_flag(p, "packed documents: their lengths in sequence order (summing to S), or lengths drawn "
                     "log-uniformly in [MIN, MAX] (seeded) to fill --seq")  # fmt: skip
    p.add_argument(
        windows.FLAG, type=windows.parse_window, metavar="L,R",
        help="sliding window: query i sees keys i-L..i+R (none: unbounded; with --causal R is 0 or none); needs "
        "--seq or --documents. The table shows banded blocks (B) and the steps the ring runs",
    )  # fmt: skip
    p.add_argument("--seq", type=positive, default=None,
                   help="global length S: with --documents (default: the sum of the lengths), with --window, or "
                   "alone to print the steps and bytes of the dense ring")  # fmt: skip
    add_problem_flags(p, Problem(), ["kv_heads", "head_dim", "value_head_dim", "dtype", "heads"])
    p.add_argument(ulysses.FLAG, type=positive, default=1,
                   help=ulysses.HELP + ". Shows the head groups and rings, the plan of the ring over R ranks and, "
                   "with --seq, the bytes each rank sends at each step: the all-to-alls (q, k, v in and out back; "
                   "dout in and dq, dk, dv back) and the ring's K/V and dK/dV")  # fmt: skip
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan into this file (needs matplotlib)")
    p.add_argument(decode.FLAG, type=int, default=None, metavar="N",
                   help="the plan of inference over a sharded KV cache (xcp.KVCache) instead: a prompt of --seq "
                   f"tokens (none without --seq), N decode steps and one chunk of {decode.CHUNK_FLAG} tokens; per "
                   "step the tokens each rank holds, the kernel calls of each rank's local partial and the bytes "
                   "each rank sends and gathers in the combine (causal; with --window, banded)")  # fmt: skip
    p.add_argument(decode.CHUNK_FLAG, type=int, default=decode.DEFAULT_CHUNK, metavar="T", help=decode.CHUNK_HELP)
    recurrent.add_plan_flags(p)
    serve.add_flags(
        p, "per step the requests, the blocks and tokens each rank holds and the combine's bytes", seed=True
    )


def command(args) -> int:
    world, causal, u = args.world, args.causal, args.ulysses
    check_heads(args.heads, args.kv_heads)
    recurrent.check_plan_flags(args)
    if args.recurrent:
        return recurrent.plan_command(args)
    packing.check_balance(args.balance, args.documents is not None)
    if args.serve is not None:
        return serve.plan_command(args)
    serve.check_needs_serve(args, seed=True)
    if args.decode is not None:
        return decode.plan_command(args)
    decode.check_needs_decode(((decode.CHUNK_FLAG, args.chunk, decode.DEFAULT_CHUNK),))
    ring = ulysses.check_flag(u, world, args.heads)  # the ring's ranks: P, or R = P/U with --ulysses
    window = windows.check(args.window, causal)
    cu = documents = None
    split_by = windows.check_balance(args.balance, args.documents is not None)  # auto: the loosest rule it may pick
    if args.documents is not None:
        lengths, _ = packing.resolve_lengths(args.documents, args.seq, ring, split_by)
        cu = documents = packing.boundaries(lengths)
    elif args.seq is not None:
        schedule.check_seq_len(args.seq, ring, split_by, what="--seq")
        cu = (0, args.seq)
    elif window is not None:
        raise ValueError(f"{windows.FLAG}: expected --seq (or --documents) too: a window's plan depends on S")
    if cu is not None and u > 1:  # P divides S (before auto's choice, which needs it too)
        ulysses.check_seq(cu[-1], world, u, split_by, "--seq" if documents is None else packing.FLAG)
    balance = windows.resolve_balance(args.balance, world, causal, window, documents, None if cu is None else cu[-1],
                                      u)  # fmt: skip
    if args.balance == windows.AUTO:
        print(f"--balance auto: xcp.choose_balance recommends {balance}")
        packing.check_balance(balance, documents is not None)
    if cu is not None and documents is None:
        schedule.check_seq_len(cu[-1], ring, balance, what="--seq")
    elif documents is not None:
        packing.check_total(documents[-1], ring, balance)
    if u > 1:
        print("\n".join(hybrid_lines(world, u, args.heads, args.kv_heads)))
        print()
    if documents is None and window is None:
        print(plan_table(ring, causal, balance))
        if args.plot:
            plot_plan(ring, causal, balance, args.plot)
    else:
        assert cu is not None  # documents give it, and a window is refused without --seq above
        print(document_table(cu, ring, causal, balance, window=window))
        if args.plot:
            plot_documents(cu, ring, causal, balance, args.plot, window)
    if cu is not None:
        steps = windows.ring_steps(cu, ring, causal, balance, window)
        print()
        if u > 1:
            flat = None
            if cu[-1] % schedule.required_multiple(world, balance) == 0:
                flat = windows.ring_steps(cu, world, causal, balance, window)
            print("\n".join(hybrid_cost_lines(cu[-1], world, u, steps, args.heads, args.kv_heads, args.head_dim,
                                               args.dtype, flat, args.value_head_dim)))  # fmt: skip
        else:
            print("\n".join(cost_lines(cu[-1], world, steps, args.kv_heads, args.head_dim, args.dtype,
                                        args.value_head_dim, balance)))  # fmt: skip
        if documents is not None or window is not None:
            print()
            print("\n".join(windows.balance_lines(cu, world, causal, window, balance, u)))
    elif u > 1:
        print()
        print("give --seq (S) for the bytes each rank sends at each step of the all-to-alls and the ring")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
