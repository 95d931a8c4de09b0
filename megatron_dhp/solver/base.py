"""What every planner shares: the interface, the timing of a solve, and turning groups into a Plan."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

import numpy as np

from megatron_dhp.cost.config import Domain
from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.pipeline import lower_bound as pipeline_lower_bound
from megatron_dhp.cost.simulate import simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import group_family
from megatron_dhp.plan.pipeline import pipeline_token_cap
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.solver.encoder_auto import plan_best_placement
from megatron_dhp.workload.batches import fit_to_domain
from megatron_dhp.workload.sample import Batch


class PlannerUnsupported(DhpError):
    """The planner's source cannot plan this batch on this domain (e.g. upstream has no group of that size).

    Benchmarks report such a batch as "n/a" for that planner instead of patching the planner around it.
    """


class Planner(Protocol):
    """A planner maps one batch and a cost model to the groups of a step.

    A planner whose schedule waits for every rank between phases (megatron-hcp) says so with a class
    attribute `phase_barrier = True`; its plans then carry `Plan.phase_barrier`. A planner that plans for
    pipeline parallelism says so with `plans_pipeline = True` and takes `pipeline_stages` in `solve`. A
    planner with `max_groups_per_rank` = K > 0 may use only the groups of `group_family(N, g, K)`.
    """

    name: str

    def solve(self, batch: Batch, model: CostModel) -> list[PlanGroup]:
        """Groups covering every rank and every sample of `batch` once (see `Plan.validate`)."""
        ...


def run_planner(planner: Planner, batch: Batch, model: CostModel, *, pipeline_stages: int = 1) -> Plan:
    """Solve, time the solve, and return a validated plan carrying its predicted time and lower bound.

    With P = `pipeline_stages` > 1 the plan runs as 1F1B slots (`plan.pipeline_slots`) and is priced so. A
    planner with `plans_pipeline` is told P; any other planner is run as published on a domain whose
    per-rank cap is M // P, so that the P microbatches stage 0 keeps in flight hold at most M tokens per rank
    (a sample too long for that is `PlannerUnsupported`).
    """
    if model.encoder_placement == "auto":  # plan under each placement, keep the fastest
        return plan_best_placement(lambda m: run_planner(planner, batch, m, pipeline_stages=pipeline_stages),
                                   batch, model)
    domain, rule = model.domain, model.memory_rule()
    fit_to_domain(batch, domain.capacity)  # a sample no group can hold is a user error for every planner
    rule.check(batch.samples, domain.world_size)  # nor may its images' encoder memory overflow it
    pipelined = getattr(planner, "plans_pipeline", False)
    planning_model = model if pipelined else pipeline_planning_model(planner, batch, model, pipeline_stages)
    start = time.perf_counter()
    groups = planner.solve(batch, planning_model, pipeline_stages=pipeline_stages) if pipelined \
        else planner.solve(batch, planning_model)
    solve_ms = (time.perf_counter() - start) * 1e3
    check_family(planner, groups, domain)
    plan = Plan(
        planner=planner.name,
        world_size=domain.world_size,
        gpus_per_node=domain.gpus_per_node,
        samples=batch.samples,
        groups=tuple(groups),
        max_tokens_per_rank=domain.max_tokens_per_rank,
        phase_barrier=getattr(planner, "phase_barrier", False),
        pipeline_stages=pipeline_stages,
        encoder_placement=model.encoder_placement,
        enc_memory_per_token=rule.enc_memory_per_token,
    )
    plan.validate()
    return replace(
        plan,
        predicted_step_time_s=simulate(plan, model).step_time_s,
        lower_bound_s=pipeline_lower_bound(model, batch.samples, pipeline_stages),
        solve_time_ms=solve_ms,
    )


def check_family(planner: Planner, groups: list[PlanGroup], domain: Domain) -> None:
    """`PlannerUnsupported` if the planner is held to a group family and formed a group outside it."""
    limit = getattr(planner, "max_groups_per_rank", 0)
    if not limit:
        return
    family = group_family(domain.world_size, domain.gpus_per_node, limit)
    outside = next((g for g in groups if not family.contains(g.ranks)), None)
    if outside is not None:
        raise PlannerUnsupported(
            f"{planner.name} formed a group of {outside.size} ranks {list(outside.ranks)} that is not in the fixed "
            f"group family of {domain.world_size} ranks (max_groups_per_rank = {limit}); set max_groups_per_rank "
            "to 0 to plan it with any groups")


def pipeline_planning_model(planner: Planner, batch: Batch, model: CostModel, stages: int) -> CostModel:
    """The model a planner that does not plan for pipelining plans with at `stages` stages (see `run_planner`)."""
    if stages == 1:
        return model
    cap = pipeline_token_cap(model.domain.max_tokens_per_rank, stages)
    # A planner that sizes its groups by the dataset's longest sample (static) must hold that one too.
    longest = max(int(batch.lengths.max()), getattr(planner, "dataset_max_tokens", None) or 0)
    n = model.domain.world_size
    if cap < 1 or longest > cap * n:
        raise PlannerUnsupported(
            f"{planner.name} packs microbatches as published; at {stages} pipeline stages a microbatch may hold "
            f"M // P = {cap} tokens per rank, and a {longest}-token sample needs more than the domain's "
            f"{n} ranks of that")
    capped = model.with_token_cap(cap)
    need = capped.footprint(batch.samples).min_degree()
    if need.max(initial=1) > n:
        s = batch.samples[int(np.argmax(need))]
        raise PlannerUnsupported(
            f"{planner.name} packs microbatches as published; at {stages} pipeline stages a microbatch may hold "
            f"M // P = {cap} tokens per rank, and sample {s.id}'s tokens and encoder activations need more than "
            f"the domain's {n} ranks of that")
    return capped


def contiguous_ranks(sizes: Iterable[int]) -> list[tuple[int, ...]]:
    """Consecutive rank ranges of the given sizes from rank 0, in order (how FCP and FlexSP lay out groups)."""
    bounds = np.cumsum([0, *sizes])
    return [tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]
