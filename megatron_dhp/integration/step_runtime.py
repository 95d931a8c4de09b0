"""One builder of what plans and runs a job's steps, for every entry point (trainer, Megatron-LM, selftest).

A job decides its comm policy and cost model from its domain (`job_policy`, `live_cost_config`), reads what
it needs of its data with that cost model's capacity, then builds the rest (`build_step_runtime`): the
planner, and the group pool with the policy's start-up groups. Every rank builds it in the same order, so
the pool's collective creation of the family lines up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from megatron_dhp.cost import CostConfig
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.planning import JobPlanner, domain_node_size, live_cost_config
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.plan.memory import ModelMemory
from megatron_dhp.runtime.attention.kernels import describe
from megatron_dhp.runtime.distributed import bind_default_group
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import SampleSource, StepEngine
from megatron_dhp.runtime.fused import kernels_status
from megatron_dhp.runtime.group_pool import GroupPool, nccl_sharing
from megatron_dhp.runtime.slot_timer import SlotTimer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRuntime:
    """This rank's planner, group pool and the comm policy both follow, on its dynamic domain."""

    config: DhpConfig
    domain: DynamicDomain
    policy: CommPolicy
    cost: CostConfig
    planner: JobPlanner
    pool: GroupPool
    pipeline_stages: int = 1
    """P: the planner plans 1F1B slots and the engines run megatron-core's 1F1B when > 1."""
    kernels: str = ""
    """Which copy kernels the steps run (`fused.kernels_status`, loaded at start-up)."""

    def engine(self, *, source: SampleSource | None = None, lookahead: bool = False, seq_multiple: int = 1,
               aligned_slots: bool = False, equal_rows: bool = False) -> StepEngine:
        """A step engine over this runtime (`StepEngine` documents the options); it runs 1F1B under PP and, when
        adaptive or slowed by `slow_ranks`, times every slot (slowed as injected), reporting to the planner's
        closed loop when adaptive."""
        timed = self.config.adaptive or bool(self.config.slowdowns)  # nobody reads the timings otherwise
        return StepEngine(self.domain, self.pool, self.planner, source=source, lookahead=lookahead,
                          seq_multiple=seq_multiple, aligned_slots=aligned_slots, equal_rows=equal_rows,
                          policy=self.policy, backend=self.config.attention_backend,
                          pipelined=self.pipeline_stages > 1,
                          timer=SlotTimer.for_job(self.domain.device, self.config.slowdowns) if timed else None,
                          feedback=self.planner.loop if self.config.adaptive else None)


def job_policy(config: DhpConfig, domain: DynamicDomain, job_world_size: int) -> CommPolicy:
    """The job's comm policy on this domain (its node size from `gpus_per_node` or torchrun's LOCAL_WORLD_SIZE)."""
    node = domain_node_size(config, domain.global_ranks, job_world_size)
    return config.comm_policy(world_size=domain.size, gpus_per_node=node)


def job_cost(config: DhpConfig, domain: DynamicDomain, model: ModelMemory | None = None) -> tuple[CommPolicy, CostConfig]:
    """The job's comm policy and the cost model it plans with. On a GPU, with the `model`'s memory per token,
    the token cap gives up what the communicators take and the memory rule counts gathered keys and values
    (`live_cost_config`); a CPU job's cap is max_tokens_per_rank as stated. Rank 0 logs what was counted."""
    policy = job_policy(config, domain, dist.get_world_size())
    counted = model if domain.device.type == "cuda" else None
    cost = live_cost_config(config, policy, counted)
    if dist.get_rank() == 0 and domain.device.type == "cuda":
        logger.info("dhp: %s", memory_summary(config, policy, cost, counted))
    return policy, cost


def memory_summary(config: DhpConfig, policy: CommPolicy, cost: CostConfig, model: ModelMemory | None) -> str:
    """One start-up line: the token cap the planner holds and what it gave up, and the gathered keys and values."""
    rate = config.mb_per_token(model)
    if rate:
        source = "memory_mb_per_token" if config.memory_mb_per_token is not None else "estimated from the model"
        given_up = (f"{config.max_tokens_per_rank - cost.max_tokens_per_rank} tokens for "
                    f"{policy.communicators_per_rank} communicators x {policy.communicator_mb:.0f} MB at {rate:.3g} MB "
                    f"per token ({source})")
    elif config.memory_mb_per_token == 0:
        given_up = "nothing (memory_mb_per_token 0 leaves the communicators outside it)"
    else:
        given_up = "nothing (no model to estimate a token's memory from: set memory_mb_per_token to count the communicators)"
    kv = (f"; gathered keys and values count {cost.kv_memory_per_token:.3g} tokens per token on every rank of "
          "their group" if cost.kv_memory_per_token else "")
    return f"token cap {cost.max_tokens_per_rank} per rank: max_tokens_per_rank {config.max_tokens_per_rank} less " \
           f"{given_up}{kv}"


def build_step_runtime(config: DhpConfig, domain: DynamicDomain, policy: CommPolicy, cost: CostConfig, *,
                       dataset_max_tokens: int | None, pipeline_stages: int = 1, virtual_stages: int = 1) -> StepRuntime:
    """The planner and the group pool (collective: every rank creates the policy's start-up groups in one order,
    on CUDA each split from the default communicator and connected here, `distributed.bind_default_group`).
    Rank 0 logs the policy's one line."""
    planner = JobPlanner(config, cost, policy, dataset_max_tokens=dataset_max_tokens, pipeline_stages=pipeline_stages,
                         virtual_stages=virtual_stages)
    kernels = kernels_status(domain.device)  # every rank: a JIT build now, not in the first forward
    if domain.device.type == "cuda":  # Megatron-LM's default group is unbound: bind it so the family splits from it
        bind_default_group(domain.device)
    pool = GroupPool(domain, max_groups=config.max_groups, family=policy.startup_groups)
    if dist.get_rank() == 0:
        logger.info("dhp: %s", policy.summary())
        logger.info("dhp: %s; %s", describe(config.attention_backend, domain.device), kernels)
        sharing = nccl_sharing()
        if sharing is not None and policy.startup_groups:
            logger.info("dhp: %s", sharing)
    return StepRuntime(config, domain, policy, cost, planner, pool, pipeline_stages, kernels)
