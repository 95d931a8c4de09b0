"""The layouts a user tunes once per run: `static` at its best (TP, CP) and `dhp` at its best TP.

A Megatron user with long documents does not run the smallest CP that fits at a fixed TP; they try tensor
parallelism inside a node (with sequence parallelism a TP group holds t times the tokens, so CP shrinks)
and keep the layout that trains their length distribution fastest, once, for the whole run. `tune_static`
does that over every power-of-two t dividing the node (and the heads, when the config states them) and
every power-of-two CP from the smallest that holds the run's longest sample up to the whole domain, each
packed as `static` packs; `tune_dhp` picks dhp's TP the same way. Both price each layout with the cost
model at that t (`cost.tensor_parallel`) and rank it by the mean simulated step over the given batches
(`bench/plan_quality.py --tuned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_dhp.cost import CostConfig, CostModel, build_cost_model, simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.solver.base import PlannerUnsupported, run_planner
from megatron_dhp.solver.dhp import DhpPlanner
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


def tune_static(base: CostConfig, batches: Sequence[Batch], longest: int | None = None) -> list[Layout]:
    """Every static (TP, CP) layout that holds the longest sample (`longest`: the run's, when the batches do
    not hold it, as a run at a fixed context length must), fastest first."""
    longest = max([int(b.lengths.max()) for b in batches] + [longest or 0])
    layouts = []
    for t, model in models(base).items():
        domain = model.domain
        cp = static_cp_size(longest, domain)
        while cp <= domain.world_size:  # static packs each size as Megatron would run it: CP fixed for the run
            planner = StaticPlanner(dataset_max_tokens=cp * domain.max_tokens_per_rank)
            layouts.append(Layout(t, cp, steps(model, batches, planner)))
            cp *= 2
    return sorted(layouts, key=lambda layout: (layout.step_s, layout.tp, layout.cp))


def tune_dhp(base: CostConfig, batches: Sequence[Batch]) -> list[Layout]:
    """dhp at every TP degree whose memory holds, fastest first."""
    layouts = [Layout(t, 0, steps(model, batches, DhpPlanner())) for t, model in models(base).items()]
    return sorted(layouts, key=lambda layout: (layout.step_s, layout.tp))
