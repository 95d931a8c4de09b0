"""PNG pictures of plans: a per-rank Gantt of one step, and planners side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_dhp.cost.simulate import Timeline
from megatron_dhp.plan.plan import Plan


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ENCODER_STYLE = dict(facecolor="none", edgecolor="black", hatch="////", linewidth=0.0)
"""How the encoder's time is drawn over a block: hatched, apart from the LLM's plain colour."""


def draw_gantt(ax, plan: Plan, timeline: Timeline) -> None:
    """One row per rank; each group a block over its ranks coloured by its size, microbatches as ticks, the
    encoder's seconds hatched (at the start of each microbatch; `global`'s phase across every rank)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    sizes = sorted({g.size for g in plan.groups})
    # One colour per power-of-two size class (1, 2, 3-4, 5-8, 9-16, ...), the same in every panel.
    palette = plt.get_cmap("tab10")
    colour = {d: palette(int(np.ceil(np.log2(d))) % 10) for d in sizes}
    for span in timeline.spans:
        g = plan.groups[span.group_index]
        if span.end_s <= span.start_s:
            continue
        for lo, hi in _runs(g.ranks):
            ax.add_patch(plt.Rectangle((span.start_s, lo - 0.45), span.end_s - span.start_s, hi - lo + 0.9,
                                       facecolor=colour[g.size], edgecolor="white", linewidth=0.6))
            t = span.start_s
            for k, mb in enumerate(span.microbatch_s):
                enc = span.encoder_s[k] if span.encoder_s else 0.0
                if enc > 0:
                    ax.add_patch(plt.Rectangle((t, lo - 0.45), enc, hi - lo + 0.9, **ENCODER_STYLE))
                t += mb
                if k < len(span.microbatch_s) - 1:
                    ax.plot([t, t], [lo - 0.45, hi + 0.45], color="white", linewidth=0.3, alpha=0.8)
    spans = [s for s in timeline.spans if s.end_s > s.start_s]
    if timeline.encoder_before_s and spans:
        first = min(s.start_s for s in spans) - timeline.encoder_before_s
        ax.add_patch(plt.Rectangle((first, -0.45), timeline.encoder_before_s, plan.world_size - 0.1, **ENCODER_STYLE))
    if timeline.encoder_after_s:
        ax.add_patch(plt.Rectangle((timeline.step_time_s - timeline.encoder_after_s, -0.45), timeline.encoder_after_s,
                                   plan.world_size - 0.1, **ENCODER_STYLE))
    if plan.lower_bound_s:
        ax.axvline(plan.lower_bound_s, color="red", linestyle="--", linewidth=1)
    classes = sorted({int(np.ceil(np.log2(d))) for d in sizes})
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette(k % 10)) for k in classes]
    labels = ["1" if k == 0 else "2" if k == 1 else f"{2 ** (k - 1) + 1}-{2 ** k}" for k in classes]
    if timeline.encoder_in_groups_s or timeline.encoder_before_s or timeline.encoder_after_s:
        handles.append(plt.Rectangle((0, 0), 1, 1, **ENCODER_STYLE))
        labels.append(f"encoder ({plan.encoder_placement})")
    ax.legend(handles, labels, title="group size", fontsize=7, title_fontsize=7, loc="center left",
              bbox_to_anchor=(1.0, 0.5))
    ax.set_ylim(plan.world_size - 0.5, -0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, timeline.step_time_s * 1.02)
    ax.set_ylabel("rank")
    ratio = f" = {timeline.step_time_s / plan.lower_bound_s:.3f} x lower bound (red)" if plan.lower_bound_s else ""
    ax.set_title(f"{plan.planner}: step {timeline.step_time_s:.2f} s{ratio}, {plan.num_phases} phase(s), "
                 f"{plan.num_microbatches} microbatches", fontsize=9)


def _runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ranks, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def save_simulation_figure(path: str | Path, plans: Sequence[tuple[Plan, Timeline]], mean_ratio: dict[str, float]) -> None:
    """A Gantt of one step for each planner above a bar chart of each planner's mean step / LB."""
    plt = _pyplot()
    n = len(plans)
    fig, axes = plt.subplots(n + 1, 1, figsize=(11, 2.6 * n + 2.6), gridspec_kw={"height_ratios": [3] * n + [2]})
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
