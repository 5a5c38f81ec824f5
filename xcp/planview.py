"""Text and picture views of a ring plan, for ``xcp plan``."""

from __future__ import annotations

from . import schedule


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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            f"--plot needs matplotlib, which is not importable: {exc} (pip install 'xcp[plot]')"
        ) from exc
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
