"""``xcp plan``: the ring schedule as a step x rank table (or a picture), so that who computes on which
shard, and who sends to whom, can be read before anything runs."""

from __future__ import annotations

from .. import schedule
from .common import Problem, add_problem_flags, positive, pyplot


def plan_table(world_size: int, causal: bool, balance: str) -> str:
    """The step x rank table: per cell the source shard, block kind, share of work and the KV peers."""
    plans = [schedule.plan(world_size, r, causal, balance) for r in range(world_size)]
    cells = [[_cell(p.steps[i]) for p in plans] for i in range(world_size)]
    width = max(12, *(len(c) for row in cells for c in row))
    head = f"{'step':<6}" + "".join(f"{'rank ' + str(r):<{width + 2}}" for r in range(world_size))
    lines = [
        f"ring plan: world {world_size}, {'causal' if causal else 'full'} attention, balance {balance}",
        "cell: src <shard>  <block kind>  <share of a full block>  send ->rank  recv <-rank",
        head,
    ]
    for i, row in enumerate(cells):
        lines.append(f"{i:<6}" + "".join(f"{c:<{width + 2}}" for c in row))
    work = [sum(s.work for s in p.steps) for p in plans]
    lines.append(f"{'total':<6}" + "".join(f"{w:<{width + 2}.2f}" for w in work))
    lines.append(
        "backward: dK/dV of each shard follow it one step behind; after the last step each goes home to rank+1"
    )
    return "\n".join(lines)


def _cell(step: schedule.Step) -> str:
    peers = "" if step.send_to is None else f" ->{step.send_to} <-{step.recv_from}"
    return f"src {step.src} {step.kind} {step.work:.2f}{peers}"


def plot_plan(world_size: int, causal: bool, balance: str, path: str) -> None:
    """Draw the plan as a heat map of work per step and rank, annotated with source and kind."""
    plt = pyplot()
    plans = [schedule.plan(world_size, r, causal, balance) for r in range(world_size)]
    work = [[plans[r].steps[i].work for r in range(world_size)] for i in range(world_size)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * world_size, 1.0 + 0.7 * world_size))
    im = ax.imshow(work, cmap="Blues", vmin=0, vmax=1)
    for i in range(world_size):
        for r in range(world_size):
            s = plans[r].steps[i]
            ax.text(r, i, f"{s.src}\n{s.kind}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("rank")
    ax.set_ylabel("step")
    ax.set_xticks(range(world_size))
    ax.set_yticks(range(world_size))
    ax.set_title(f"xcp ring plan: P={world_size}, {'causal' if causal else 'full'}, {balance}")
    fig.colorbar(im, ax=ax, label="share of a full block")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print (or plot) the step x rank table of a ring plan")
    p.add_argument("--world", type=positive, required=True)
    p.add_argument("--causal", action="store_true")
    add_problem_flags(p, Problem(), ["balance"])
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan into this file (needs matplotlib)")


def command(args) -> int:
    print(plan_table(args.world, args.causal, args.balance))
    if args.plot:
        plot_plan(args.world, args.causal, args.balance, args.plot)
        print(f"plot written to {args.plot}")
    return 0
