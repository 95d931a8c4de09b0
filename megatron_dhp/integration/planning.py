"""Planning a training step from its gathered batch, optionally one step ahead of execution.

The step engine asks only global rank 0's `StepPlanner` for plans and broadcasts them
(`runtime.collectives.broadcast_plan`), so a planner need not be deterministic across ranks and the others
never solve. Every rank still builds one (cheap: solvers keep no state between solves), so a bad planner
setting stops every rank at start-up. With `overlap_planning` the plan of step t+1 is solved in a
background thread while step t trains, so the solver never stalls the step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, group_family
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.attention import ANY_GROUP_COMMS, DOMAIN_COMMS
from megatron_dhp.solver import PlannerContext, build_planner, family_option, run_planner
from megatron_dhp.workload.sample import Batch


def live_cost_config(config: DhpConfig, *, world_size: int, gpus_per_node: int) -> CostConfig:
    """The configured cost model with the live job's domain (its size, node size and token cap) and the
    configured encoder placement."""
    return CostConfig.load(config.cost).with_overrides(
        world_size=world_size, gpus_per_node=gpus_per_node, max_tokens_per_rank=config.max_tokens_per_rank,
        encoder_placement=config.encoder_placement,
    )


def comm_family_option(planner: str, comm: str, max_groups_per_rank: int | None) -> dict:
    """The family option `planner` plans with for training `comm`: any group (0) under `p2p` and `mixed`, where a
    group outside the family costs no communicator (with TransformerEngine's attention, which cannot run one,
    `DhpConfig` has made `mixed` `allgather`); else `max_groups_per_rank` (`solver.family_option`)."""
    return family_option(planner, 0 if comm in ANY_GROUP_COMMS else max_groups_per_rank)


def domain_node_size(config: DhpConfig, global_ranks: Sequence[int], job_world_size: int) -> int:
    """How many of the domain's ranks share a node (the cost model's `gpus_per_node`): they sit at stride TP,
    so a node of `config.gpus_per_node` GPUs (default LOCAL_WORLD_SIZE, as torchrun sets it) holds fewer."""
    gpus = config.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", job_world_size))
    first_node = global_ranks[0] // gpus
    return sum(1 for rank in global_ranks if rank // gpus == first_node)


class StepPlanner:
    """Turns each step's gathered batch into its plan; `prefetch` starts the next one in the background."""

    def __init__(self, config: DhpConfig, cost: CostConfig, *, dataset_max_tokens: int | None = None,
                 pipeline_stages: int = 1) -> None:
        self.config = config
        self.pipeline_stages = pipeline_stages
        """Every plan runs as 1F1B slots over this many stages (`run_planner`)."""
        self.model = build_cost_model(cost)
        self.planner = build_planner(
            config.planner, PlannerContext(dataset_max_tokens=dataset_max_tokens, time_limit_s=config.time_limit_s),
            **comm_family_option(config.planner, config.comm, config.max_groups_per_rank),
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dhp-plan") if config.overlap_planning else None
        self._pending: tuple[Batch, Future[Plan]] | None = None

    def family_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups the runtime creates at start-up, in the family's creation order: under `mixed` the family of
        `max_groups_per_rank` (default 32), else the planner's (none when it may use any group, or when the comm
        variant needs no group)."""
        if self.config.comm in DOMAIN_COMMS:
            return ()
        limit = getattr(self.planner, "max_groups_per_rank", 0)
        if self.config.comm == "mixed":
            limit = DEFAULT_MAX_GROUPS_PER_RANK if self.config.max_groups_per_rank is None else self.config.max_groups_per_rank
        if not limit:
            return ()
        domain = self.model.domain
        return group_family(domain.world_size, domain.gpus_per_node, limit).groups

    def plan(self, batch: Batch) -> Plan:
        """The plan of `batch`: the prefetched one if it was started for this batch, else solved now."""
        if self._pending is not None and self._pending[0] == batch:
            future = self._pending[1]
            self._pending = None
            return future.result()
        return self._solve(batch)

    def prefetch(self, batch: Batch) -> None:
        """Start planning `batch` in the background (a no-op without `overlap_planning`)."""
        if self._executor is not None:
            self._pending = (batch, self._executor.submit(self._solve, batch))

    def close(self) -> None:
        """Stop the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _solve(self, batch: Batch) -> Plan:
        return run_planner(self.planner, batch, self.model, pipeline_stages=self.pipeline_stages)
