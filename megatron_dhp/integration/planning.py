"""Planning a training step from its gathered batch, optionally one step ahead of execution.

The step engine asks only global rank 0's `JobPlanner` for plans and broadcasts them
(`runtime.collectives.broadcast_plan`), so a planner need not be deterministic across ranks and the others
never solve. Every rank still builds one (cheap: solvers keep no state between solves), so a bad planner
setting stops every rank at start-up. With `overlap_planning` the plan of step t+1 is solved in a
background thread while step t trains, so the solver never stalls the step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from megatron_dhp.closed_loop.loop import ClosedLoop
from megatron_dhp.cost import CostConfig, CostModel, simulate
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.plan.plan import Plan
from megatron_dhp.solver import PlannerContext, build_planner, run_planner
from megatron_dhp.workload.sample import Batch


def domain_node_size(config: DhpConfig, global_ranks: Sequence[int], job_world_size: int) -> int:
    """How many of the domain's ranks share a node (the cost model's `gpus_per_node`): they sit at stride TP,
    so a node of `config.gpus_per_node` GPUs (default LOCAL_WORLD_SIZE, as torchrun sets it) holds fewer."""
    gpus = config.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", job_world_size))
    first_node = global_ranks[0] // gpus
    return sum(1 for rank in global_ranks if rank // gpus == first_node)


class JobPlanner:
    """A job's planner (a solver with its cost model and the comm policy's family): turns each step's gathered
    batch into its plan; `prefetch` starts the next one in the background."""

    def __init__(self, config: DhpConfig, cost: CostConfig, policy: CommPolicy, *,
                 dataset_max_tokens: int | None = None, pipeline_stages: int = 1, virtual_stages: int = 1) -> None:
        self.config = config
        self.policy = policy
        """Which family the planner keeps to (`planning_family`), the same policy the runtime runs under."""
        self.pipeline_stages = pipeline_stages
        """Every plan runs as 1F1B slots over this many stages (`run_planner`)."""
        self.virtual_stages = virtual_stages
        """Model chunks per stage: interleaved 1F1B when > 1."""
        self.loop = ClosedLoop(cost, adaptive=config.adaptive, window=config.adaptive_window,
                               hysteresis=config.adaptive_hysteresis, pipeline_stages=pipeline_stages)
        """The speeds and model correction each plan uses (`closed_loop`), the engine's `Feedback` when it is
        adaptive (`ClosedLoop.adaptive`: asked for, and no pipeline parallelism)."""
        self.planner = build_planner(
            config.planner, PlannerContext(dataset_max_tokens=dataset_max_tokens, time_limit_s=config.time_limit_s))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dhp-plan") if config.overlap_planning else None
        self._pending: tuple[Batch, Future[Plan]] | None = None

    def plan(self, batch: Batch) -> Plan:
        """The plan of `batch`: the prefetched one if it was started for this batch, else solved now."""
        if self._pending is not None and self._pending[0] == batch:
            future = self._pending[1]
            self._pending = None
            return future.result()
        return self._solve(batch, self.loop.model(), self.loop.predictor())

    def prefetch(self, batch: Batch) -> None:
        """Start planning `batch` in the background (a no-op without `overlap_planning`)."""
        if self._executor is not None:  # with the models of now: the loop may observe while it solves
            self._pending = (batch, self._executor.submit(self._solve, batch, self.loop.model(), self.loop.predictor()))

    def close(self) -> None:
        """Stop the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def model(self) -> CostModel:
        """The cost model the next plan is made with (the configured one, corrected by the closed loop)."""
        return self.loop.model()

    def _solve(self, batch: Batch, model: CostModel, predictor: CostModel) -> Plan:
        """The plan made with `model`, its step predicted with `predictor` (the ranks at their measured speeds)."""
        plan = run_planner(self.planner, batch, model, family=self.policy.planning_family,
                           pipeline_stages=self.pipeline_stages, virtual_stages=self.virtual_stages)
        if predictor is model:
            return plan
        return replace(plan, predicted_step_time_s=simulate(plan, predictor).step_time_s)
