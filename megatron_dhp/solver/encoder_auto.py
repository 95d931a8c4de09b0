"""`encoder_placement: auto`: plan under each concrete encoder placement and keep the fastest plan.

The encoder's placement changes which groups pay for it (`cost.encoder`), so the best grouping depends on
it; a planner plans once per placement and the predicted step decides. A batch without encoder work
gives the same plan under every placement and is planned once, as `split`. A placement whose encoder
activations the domain cannot hold (`plan.memory`: replicate's whole images on every rank of a group,
global's share on every rank all step) is not tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.plan import Plan
from megatron_dhp.workload.sample import Batch


def auto_placements(batch: Batch, model: CostModel) -> tuple[str, ...]:
    """The placements worth planning this batch under: those whose encoder memory the domain holds (split
    alone if none does, so that its error names the sample)."""
    if not model.with_placement("split").encoder_time(batch.samples, 1).any():
        return ("split",)
    n = model.domain.world_size
    fits = tuple(p for p in CONCRETE_PLACEMENTS
                 if model.with_placement(p).footprint(batch.samples).min_degree().max(initial=1) <= n)
    return fits or ("split",)


def plan_best_placement(solve: Callable[[CostModel], Plan], batch: Batch, model: CostModel) -> Plan:
    """The plan with the lowest predicted step over `auto_placements` (ties: the earlier placement), with the
    solve time of all of them."""
    plans = [solve(model.with_placement(p)) for p in auto_placements(batch, model)]
    best = min(plans, key=lambda plan: plan.predicted_step_time_s)
    return replace(best, solve_time_ms=sum(plan.solve_time_ms for plan in plans))
