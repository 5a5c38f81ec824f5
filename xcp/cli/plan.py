"""``xcp plan``: the ring schedule as a step x rank table (or a picture), so that who computes on which
shard, and who sends to whom, can be read before anything runs."""

from __future__ import annotations

from .. import schedule
from .common import Problem, add_problem_flags, positive, pyplot

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


def _plans(world_size: int, causal: bool, balance: str) -> list[schedule.Plan]:
    return [schedule.plan(world_size, r, causal, balance) for r in range(world_size)]


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


def plan_table(world_size: int, causal: bool, balance: str, width: int = WIDTH) -> str:
    """The step x rank table within ``width`` columns: one row per step, per rank a compact cell (source
    shard, block kind code, share of a full block), and per step the KV peers (in the cells where they are
    not the ring's ``->r+1 <-r-1``)."""
    plans = _plans(world_size, causal, balance)
    steps = [[p.steps[i] for p in plans] for i in range(world_size)]
    peers = [_ring_peers(row, world_size) for row in steps]
    cells = [[_cell(s, peers[i] is None) for s in row] for i, row in enumerate(steps)]
    work = [sum(s.work for s in p.steps) for p in plans]
    totals = [f"{w:.2f}" for w in work]
    col = max(4, *(len(c) for row in cells for c in row), *(len(t) for t in totals), len(f"r{world_size - 1}")) + 1
    peer_col = max(len("kv peers"), *(len(p or "in cells") for p in peers)) + 1
    per_block = max(1, (width - 6 - peer_col) // col)
    kinds = dict.fromkeys(s.kind for row in steps for s in row)
    lines = [
        f"ring plan: world {world_size}, {'causal' if causal else 'full'} attention, balance {balance}",
        "cell: <source shard><block kind> <share of a full block>; "
        + ", ".join(f"{KIND_CODES.get(k, '?')} {k}" for k in kinds),
        "kv peers: where each rank sends the KV it holds (->) and receives the next (<-) after the step",
    ]
    for start in range(0, world_size, per_block):
        ranks = range(start, min(start + per_block, world_size))
        lines.append("")
        lines.append(f"{'step':<6}" + "".join(f"{'r' + str(r):<{col}}" for r in ranks) + "kv peers")
        for i, row in enumerate(cells):
            lines.append(f"{i:<6}" + "".join(f"{row[r]:<{col}}" for r in ranks) + (peers[i] or "in cells"))
        lines.append(f"{'total':<6}" + "".join(f"{totals[r]:<{col}}" for r in ranks))
    lines.append("")
    lines.append("backward: dK/dV of each shard follow it one step behind; after the last step each goes home to r+1")
    return "\n".join(line.rstrip() for line in lines)


def plot_plan(world_size: int, causal: bool, balance: str, path: str) -> None:
    """Draw the plan as a heat map coloured by each cell's share of work, each cell labelled with its source
    shard and block kind, with the total work per rank under the map."""
    plt = pyplot()
    plans = _plans(world_size, causal, balance)
    work = [[plans[r].steps[i].work for r in range(world_size)] for i in range(world_size)]
    side = 0.9 * world_size
    fig, ax = plt.subplots(figsize=(side + 2.6, side + 2.0), layout="constrained")
    im = ax.imshow(work, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    from matplotlib.patches import Patch, Rectangle

    kinds = list(dict.fromkeys(p.steps[i].kind for i in range(world_size) for p in plans))
    hatch = dict(zip(kinds, ("", "//", "..", "xx", "\\\\", "oo", "++")))
    for i in range(world_size):
        for r in range(world_size):
            s = plans[r].steps[i]
            if hatch[s.kind]:  # the block kind as a pattern, so equal shares of different kinds differ
                ax.add_patch(Rectangle((r - 0.5, i - 0.5), 1, 1, fill=False, hatch=hatch[s.kind], ec="0.75", lw=0))
            ink = "black" if s.work > 0.6 else "white"
            box = {"boxstyle": "round,pad=0.2", "fc": "white" if ink == "black" else "black", "alpha": 0.7, "lw": 0}
            text = f"src {s.src}\n{s.kind}\n{s.work:.2f}"
            ax.text(r, i, text, ha="center", va="center", fontsize=7, color=ink, bbox=box, zorder=5)
    totals = [sum(s.work for s in p.steps) for p in plans]
    ax.set_xlabel("rank (total work: " + " ".join(f"{t:.2f}" for t in totals) + ")", fontsize=8)
    ax.set_ylabel("step")
    ax.set_xticks(range(world_size))
    ax.set_yticks(range(world_size))
    ax.set_title(
        f"xcp ring plan: P={world_size}, {'causal' if causal else 'full'}, {balance}\n"
        "colour: share of work per cell; text: source shard, kind, share",
        fontsize=9,
    )
    handles = [Patch(fc="white", ec="0.4", hatch=hatch[k] * 2, label=k) for k in kinds]
    fig.legend(handles=handles, title="block kind (pattern)", fontsize=7, title_fontsize=7, loc="outside lower center",
               ncols=len(kinds))  # fmt: skip
    fig.colorbar(im, ax=ax, label="share of work: fraction of a full shard x shard block")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print (or plot) the step x rank table of a ring plan")
    p.add_argument("--world", type=positive, required=True, help="ranks in the ring")
    p.add_argument("--causal", action="store_true", help="causal mask (default: full attention)")
    add_problem_flags(p, Problem(), ["balance"])
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan into this file (needs matplotlib)")


def command(args) -> int:
    print(plan_table(args.world, args.causal, args.balance))
    if args.plot:
        plot_plan(args.world, args.causal, args.balance, args.plot)
        print(f"plot written to {args.plot}")
    return 0
