"""What every planner shares: the interface, the timing of a solve, and turning groups into a Plan."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from megatron_dhp.cost.reference import ReferenceCostModel
from megatron_dhp.cost.simulate import simulate
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.workload.batches import fit_to_domain
from megatron_dhp.workload.sample import Batch


class Planner(Protocol):
    """A planner maps one batch and a cost model to the groups of a step."""

    name: str

    def solve(self, batch: Batch, model: ReferenceCostModel) -> list[PlanGroup]:
        """Groups covering every rank and every sample of `batch` once (see `Plan.validate`)."""
        ...


def run_planner(planner: Planner, batch: Batch, model: ReferenceCostModel) -> Plan:
    """Solve, time the solve, and return a validated plan carrying its predicted time and lower bound."""
    domain = model.domain
    fit_to_domain(batch, domain.capacity)  # a sample no group can hold is a user error for every planner
    start = time.perf_counter()
    groups = planner.solve(batch, model)
    solve_ms = (time.perf_counter() - start) * 1e3
    plan = Plan(
        planner=planner.name,
        world_size=domain.world_size,
        gpus_per_node=domain.gpus_per_node,
        samples=batch.samples,
        groups=tuple(groups),
        max_tokens_per_rank=domain.max_tokens_per_rank,
    )
    plan.validate()
    return replace(
        plan,
        predicted_step_time_s=simulate(plan, model).step_time_s,
        lower_bound_s=model.lower_bound(batch.samples),
        solve_time_ms=solve_ms,
    )
