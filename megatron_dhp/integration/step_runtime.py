"""One builder of what plans and runs a job's steps, for every entry point (trainer, Megatron-LM).

A job describes itself once (`job_spec.JobSpec`: its sizes, token cap, comm policy and cost model), reads what it
needs of its data with that spec's longest sample, then builds the rest here (`build_step_runtime`): the planner,
and the group pool with the policy's start-up groups. Every rank builds it in the same order, so the pool's
collective creation of the family lines up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from megatron_dhp.closed_loop.injection import timer_for_job
from megatron_dhp.cost import CostConfig
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.integration.planning import JobPlanner
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.runtime.attention.kernels import describe
from megatron_dhp.runtime.distributed import bind_default_group
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import SampleSource, StepEngine
from megatron_dhp.runtime.fused import kernels_status
from megatron_dhp.runtime.group_pool import GroupPool, nccl_sharing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRuntime:
    """This rank's planner and group pool on its dynamic domain, for the job its spec describes."""

    spec: JobSpec
    domain: DynamicDomain
    planner: JobPlanner
    pool: GroupPool
    kernels: str = ""
    """Which copy kernels the steps run (`fused.kernels_status`, loaded at start-up)."""

    @property
    def config(self) -> DhpConfig:
        """The user's settings."""
        return self.spec.config

    @property
    def policy(self) -> CommPolicy:
        """The job's comm policy, which the planner and the pool follow."""
        return self.spec.policy

    @property
    def cost(self) -> CostConfig:
        """The cost model the planner holds."""
        return self.spec.cost

    def engine(self, *, source: SampleSource | None = None, lookahead: bool = False) -> StepEngine:
        """A step engine over this runtime (`JobSpec.engine`); when its closed loop is adaptive (`adaptive`, and
        no pipeline parallelism: `ClosedLoop.adaptive`) or `slow_ranks` slows a rank (refused under pipeline
        parallelism, `JobSpec`), it times every slot, slowed as injected (`closed_loop.injection.timer_for_job`),
        reporting to the planner's closed loop when adaptive."""
        adaptive = self.planner.loop.adaptive
        timed = adaptive or bool(self.config.slowdowns)  # nobody reads the timings otherwise
        return self.spec.engine(self.domain, self.pool, planning=self.planner, source=source, lookahead=lookahead,
                                timer=timer_for_job(self.domain.device, self.config.slowdowns) if timed else None,
                                feedback=self.planner.loop if adaptive else None)


def build_step_runtime(spec: JobSpec, domain: DynamicDomain, *, dataset_max_tokens: int | None) -> StepRuntime:
    """The planner and the group pool (collective: every rank creates the policy's start-up groups in one order,
    on CUDA each split from the default communicator and connected here, `distributed.bind_default_group`).
    Rank 0 logs the policy's, the token cap's and the kernels' lines, and why the closed loop is off where the
    job asked for it under pipeline parallelism (`ClosedLoop.off_note`)."""
    config, policy = spec.config, spec.policy
    planner = JobPlanner(config, spec.cost, policy, dataset_max_tokens=dataset_max_tokens,
                         pipeline_stages=spec.pipeline_stages, virtual_stages=spec.virtual_stages)
    kernels = kernels_status(domain.device)  # every rank: a JIT build now, not in the first forward
    if domain.device.type == "cuda":  # Megatron-LM's default group is unbound: bind it so the family splits from it
        bind_default_group(domain.device)
    pool = GroupPool(domain, max_groups=config.max_groups, family=policy.startup_groups)
    if dist.get_rank() == 0:
        logger.info("dhp: %s", policy.summary())
        logger.info("dhp: %s", spec.memory_line())
        logger.info("dhp: %s", spec.cost_line())
        logger.info("dhp: %s; %s", describe(config.attention_backend, domain.device), kernels)
        sharing = nccl_sharing()
        if sharing is not None and policy.startup_groups:
            logger.info("dhp: %s", sharing)
        if planner.loop.off_note is not None:
            logger.info("dhp: %s", planner.loop.off_note)
    return StepRuntime(spec, domain, planner, pool, kernels)
