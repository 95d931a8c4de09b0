"""The static layout a user tunes once per run: `static` at its best (TP, CP).

A Megatron user with long documents does not run the smallest CP that fits at a fixed TP; they try tensor
parallelism inside a node (with sequence parallelism a TP group holds t times the tokens, so CP shrinks)
and keep the layout that trains their length distribution fastest, once, for the whole run. `tune_static`
does that over every power-of-two t dividing the node (and the heads, when the config states them) and
every power-of-two CP from the smallest that holds the run's longest sample up to the whole domain, each
packed as `static` packs, prices each layout with the cost model at that t (`cost.tensor_parallel`) and
ranks them by the mean simulated step over the given batches. `megatron-dhp simulate --tuned` adds
`best_static`'s layout as a row beside the planners; the benches set it against dhp at its best TP, which
bench/tuning.py picks the same way (`tune_dhp`, from `models` and `steps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_dhp.cost import CostConfig, CostModel, build_cost_model, simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.solver.base import PlannerUnsupported, run_planner
from megatron_dhp.solver.static import StaticPlanner, static_cp_size
from megatron_dhp.workload.sample import Batch


@dataclass(frozen=True)
class Layout:
    """A tuned layout: its TP degree, its CP size (0 for dhp, whose groups change per step) and its step on
    each batch."""

    tp: int
    cp: int
    steps: tuple[float, ...]

    @property
    def step_s(self) -> float:
        """The mean step over the batches (what the tuning ranks by)."""
        return float(np.mean(self.steps))


def tp_degrees(config: CostConfig) -> list[int]:
    """Powers of two that divide the node, the domain and (when stated) the heads: the TP a user would try."""
    out, t = [], 1
    while t <= config.gpus_per_node:
        heads_ok = not config.attention_heads or config.attention_heads % t == 0
        if config.gpus_per_node % t == 0 and config.world_size % t == 0 and heads_ok:
            out.append(t)
        t *= 2
    return out


def models(base: CostConfig) -> dict[int, CostModel]:
    """The cost model of every TP a user would try (`tp_degrees`) whose memory holds at all (a stated budget
    may leave no room at small TP), by TP."""
    out = {}
    for t in tp_degrees(base):
        try:
            out[t] = build_cost_model(replace(base, tensor_parallel=t))
        except DhpError:
            continue
    return out


def steps(model: CostModel, batches: Sequence[Batch], planner) -> tuple[float, ...]:
    """The simulated step of `planner`'s plan for each batch under `model` (inf where it cannot plan one)."""
    try:
        return tuple(simulate(run_planner(planner, b, model), model).step_time_s for b in batches)
    except PlannerUnsupported:
        return (float("inf"),) * len(batches)


def static_planner(model: CostModel, cp: int) -> StaticPlanner:
    """`static` packing every batch at CP `cp` under `model` (CP fixed for the run, as Megatron runs it)."""
    return StaticPlanner(dataset_max_tokens=cp * model.domain.max_tokens_per_rank)


def tune_static(base: CostConfig, batches: Sequence[Batch], longest: int | None = None) -> list[Layout]:
    """Every static (TP, CP) layout that holds the longest sample (`longest`: the run's, when the batches do
    not hold it, as a run at a fixed context length must), fastest first."""
    longest = max([int(b.lengths.max()) for b in batches] + [longest or 0])
    layouts = []
    for t, model in models(base).items():
        domain = model.domain
        cp = static_cp_size(longest, domain)
        while cp <= domain.world_size:
            layouts.append(Layout(t, cp, steps(model, batches, static_planner(model, cp))))
            cp *= 2
    return sorted(layouts, key=lambda layout: (layout.step_s, layout.tp, layout.cp))


def best_static(base: CostConfig, batches: Sequence[Batch],
                longest: int | None = None) -> tuple[Layout, CostModel, StaticPlanner] | None:
    """The fastest of `tune_static`'s layouts with the cost model at its TP and the planner that packs it;
    None where no layout plans every batch (no TP's memory holds, or `static` cannot plan on any)."""
    layouts = tune_static(base, batches, longest)
    if not layouts or not np.isfinite(layouts[0].step_s):
        return None
    best = layouts[0]
    model = build_cost_model(replace(base, tensor_parallel=best.tp))
    return best, model, static_planner(model, best.cp)

