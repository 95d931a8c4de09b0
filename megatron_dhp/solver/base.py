"""What every planner shares: the interface, the timing of a solve, and turning groups into a Plan."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import ClassVar, Protocol

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.pipeline import lower_bound as pipeline_lower_bound
from megatron_dhp.cost.simulate import simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import GroupFamily
from megatron_dhp.plan.pipeline import pipeline_token_cap
from megatron_dhp.plan.plan import Plan, PlanGroup, memory_fields
from megatron_dhp.solver.encoder_auto import plan_best_placement
from megatron_dhp.workload.batches import fit_to_domain
from megatron_dhp.workload.sample import Batch


class PlannerUnsupported(DhpError):
    """The planner's source cannot plan this batch on this domain (e.g. upstream has no group of that size).

    Benchmarks report such a batch as "n/a" for that planner instead of patching the planner around it.
    """


class Planner(Protocol):
    """A planner maps one batch and a cost model to the groups of a step; its traits say how it is run.

    Planners subclass this protocol, so a trait a planner does not set keeps the default below.
    """

    name: str
    phase_barrier: ClassVar[bool] = False
    """Its schedule waits for every rank between phases (megatron-hcp): its plans carry `Plan.phase_barrier`."""
    plans_pipeline: ClassVar[bool] = False
    """It plans 1F1B itself and takes `pipeline_stages` and `virtual_stages` in `solve`; else it runs as
    published on the per-microbatch cap (`plan.pipeline.pipeline_token_cap`)."""
    plans_on_family: ClassVar[bool] = False
    """It takes the group family in `solve` and plans on it (dhp); else `run_planner` only checks that its
    groups are family groups, and by default it is held to none (`CommPolicy.resolve`)."""
    dataset_max_tokens: int | None = None
    """The dataset's longest sample, for a planner that sizes its groups by it (static)."""
    speed_aware: bool = False
    """It plans with the ranks' speeds (dhp); else it plans on the speed-blind model, as published, and
    `run_planner` prices its plan with the speeds."""

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """Groups covering every rank and every sample of `batch` once (see `Plan.validate`)."""
        ...


def run_planner(planner: Planner, batch: Batch, model: CostModel, *, family: GroupFamily | None = None,
                pipeline_stages: int = 1, virtual_stages: int = 1) -> Plan:
    """Solve, time the solve, and return a validated plan carrying its predicted time and lower bound (both
    under the model's rank speeds, which the plan records).

    With a `family` (the comm policy's `planning_family`) every group of the plan is one of its groups: a
    planner that `plans_on_family` plans on it, any other is `PlannerUnsupported` when it forms another.

    With P = `pipeline_stages` > 1 the plan runs as 1F1B slots (`plan.pipeline_slots`) and is priced so. A
    planner with `plans_pipeline` is told P; any other planner is run as published on a domain whose
    per-rank cap is M // P, so that the P microbatches stage 0 keeps in flight hold at most M tokens per rank
    (a sample too long for that is `PlannerUnsupported`). `virtual_stages` V > 1 interleaves V model chunks
    per stage (`plan.pipeline`): the cap is M V // C for the C chunks stage 0 keeps in flight.
    """
    if model.encoder_placement == "auto":  # plan under each placement, keep the fastest
        return plan_best_placement(
            lambda m: run_planner(planner, batch, m, family=family, pipeline_stages=pipeline_stages,
                                  virtual_stages=virtual_stages), batch, model)
    domain, rule = model.domain, model.memory_rule()
    fit_to_domain(batch, domain.capacity)  # a sample no group can hold is a user error for every planner
    rule.check(batch.samples, domain.world_size)  # nor may its images' encoder memory overflow it
    seen = model if planner.speed_aware else model.with_speeds(())
    planning_model = (seen if planner.plans_pipeline
                      else pipeline_planning_model(planner, batch, seen, pipeline_stages, virtual_stages))
    options = {"pipeline_stages": pipeline_stages, "virtual_stages": virtual_stages} if planner.plans_pipeline else {}
    if planner.plans_on_family:
        options["family"] = family
    start = time.perf_counter()
    groups = planner.solve(batch, planning_model, **options)
    solve_ms = (time.perf_counter() - start) * 1e3
    check_family(planner, groups, family)
    plan = Plan(
        planner=planner.name,
        world_size=domain.world_size,
        gpus_per_node=domain.gpus_per_node,
        samples=batch.samples,
        groups=tuple(groups),
        max_tokens_per_rank=domain.max_tokens_per_rank,
        phase_barrier=planner.phase_barrier,
        pipeline_stages=pipeline_stages,
        virtual_stages=virtual_stages,
        **memory_fields(rule),
        rank_speeds=domain.rank_speeds,
    )
    plan.validate()
    return replace(
        plan,
        predicted_step_time_s=simulate(plan, model).step_time_s,
        lower_bound_s=pipeline_lower_bound(model, batch.samples, pipeline_stages, virtual_stages),
        solve_time_ms=solve_ms,
    )


def check_family(planner: Planner, groups: list[PlanGroup], family: GroupFamily | None) -> None:
    """`PlannerUnsupported` if the planner is held to a group family and formed a group outside it."""
    outside = next((g for g in groups if family is not None and not family.contains(g.ranks)), None)
    if outside is not None:
        raise PlannerUnsupported(
            f"{planner.name} formed a group of {outside.size} ranks {list(outside.ranks)} that is not in the fixed "
            f"group family of {family.world_size} ranks (max_groups_per_rank = {family.max_groups_per_rank}); "
            "set max_groups_per_rank to 0, or use comm mixed, to plan it with any groups")


def pipeline_planning_model(planner: Planner, batch: Batch, model: CostModel, stages: int,
                            virtual: int = 1) -> CostModel:
    """The model a planner that does not plan for pipelining plans with at `stages` stages of `virtual` chunks
    (see `run_planner`)."""
    if stages == 1:
        return model
    cap = pipeline_token_cap(model.domain.max_tokens_per_rank, stages, virtual)
    # A planner that sizes its groups by the dataset's longest sample (static) must hold that one too.
    longest = max(int(batch.lengths.max()), planner.dataset_max_tokens or 0)
    n = model.domain.world_size
    rule = "M // P" if virtual == 1 else f"M V // C at V = {virtual}"
    if cap < 1 or longest > cap * n:
        raise PlannerUnsupported(
            f"{planner.name} packs microbatches as published; at {stages} pipeline stages a microbatch may hold "
            f"{rule} = {cap} tokens per rank, and a {longest}-token sample needs more than the domain's "
            f"{n} ranks of that")
    capped = model.with_token_cap(cap)
    need = capped.footprint(batch.samples).min_degree()
    if need.max(initial=1) > n:
        s = batch.samples[int(np.argmax(need))]
        raise PlannerUnsupported(
            f"{planner.name} packs microbatches as published; at {stages} pipeline stages a microbatch may hold "
            f"{rule} = {cap} tokens per rank, and sample {s.id}'s tokens and encoder activations need more than "
            f"the domain's {n} ranks of that")
    return capped


def contiguous_ranks(sizes: Iterable[int]) -> list[tuple[int, ...]]:
    """Consecutive rank ranges of the given sizes from rank 0, in order (how FCP and FlexSP lay out groups)."""
    bounds = np.cumsum([0, *sizes])
    return [tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]
