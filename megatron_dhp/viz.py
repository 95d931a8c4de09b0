"""PNG pictures of plans: a per-rank Gantt of one step, and planners side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron_dhp.cost.simulate import Timeline
from megatron_dhp.plan.plan import Plan


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_gantt(ax, plan: Plan, timeline: Timeline) -> None:
    """One row per rank; each group a bar coloured by its size, microbatch boundaries as ticks."""
    plt = _pyplot()
    sizes = sorted({g.size for g in plan.groups})
    cmap = plt.get_cmap("viridis", max(len(sizes), 2))
    colour = {d: cmap(i) for i, d in enumerate(sizes)}
    for span in timeline.spans:
        g = plan.groups[span.group_index]
        for r in g.ranks:
            ax.barh(r, span.end_s - span.start_s, left=span.start_s, height=0.85, color=colour[g.size],
                    edgecolor="white", linewidth=0.3)
            t = span.start_s
            for mb in span.microbatch_s[:-1]:
                t += mb
                ax.plot([t, t], [r - 0.42, r + 0.42], color="white", linewidth=0.4)
    if plan.lower_bound_s:
        ax.axvline(plan.lower_bound_s, color="red", linestyle="--", linewidth=1, label="lower bound")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[d]) for d in sizes]
    ax.legend(handles, [f"d={d}" for d in sizes], title="group size", fontsize=6, title_fontsize=7,
              loc="upper right", ncol=max(1, len(sizes) // 6))
    ax.set_ylim(plan.world_size - 0.5, -0.5)
    ax.set_ylabel("rank")
    ratio = f" = {timeline.step_time_s / plan.lower_bound_s:.3f} x LB" if plan.lower_bound_s else ""
    ax.set_title(f"{plan.planner}: step {timeline.step_time_s:.2f} s{ratio}", fontsize=9)


def save_simulation_figure(path: str | Path, plans: Sequence[tuple[Plan, Timeline]], mean_ratio: dict[str, float]) -> None:
    """A Gantt of one step for each planner above a bar chart of each planner's mean step / LB."""
    plt = _pyplot()
    n = len(plans)
    fig, axes = plt.subplots(n + 1, 1, figsize=(10, 2.4 * n + 2.6), gridspec_kw={"height_ratios": [3] * n + [2]})
    xmax = max(t.step_time_s for _, t in plans) * 1.02
    for ax, (plan, timeline) in zip(axes[:-1], plans):
        draw_gantt(ax, plan, timeline)
        ax.set_xlim(0, xmax)
    axes[-2].set_xlabel("seconds into the step")
    bar = axes[-1]
    names = list(mean_ratio)
    bar.bar(names, [mean_ratio[k] for k in names], color="tab:blue")
    bar.axhline(1.0, color="red", linestyle="--", linewidth=1)
    for i, k in enumerate(names):
        bar.text(i, mean_ratio[k], f"{mean_ratio[k]:.3f}", ha="center", va="bottom", fontsize=8)
    bar.set_ylabel("mean step / LB")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
