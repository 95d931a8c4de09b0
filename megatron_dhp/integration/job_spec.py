"""A job's parallel layout and its token cap, decided once: what every entry point asks "how many ranks, how
many tokens" of.

The trainer, the Megatron-LM hooks, `selftest` and `profile` each build one `JobSpec` from what they know (the
user's `DhpConfig`, the dynamic domain's size and node size, TP, SP, PP, VPP, EP, FSDP, the device, the model's
memory per token) and read the rest from it: the comm policy, the cost model the planner holds, the longest
sample the data may carry, the start-up line, and the step engine (`engine`, the one builder). A frozen
dataclass validated on construction, with no process group, so a test builds any job.

The token cap is one chain, in this order (`TokenCaps`):

1. `stated`: the user's M, `max_tokens_per_rank`;
2. `budget`: where the cost model states a memory budget (`memory_budget_bytes`), the M it leaves instead
   (`cost.tensor_parallel.token_cap`: the budget less the model's states, over a token's activations);
3. `planner`: on a GPU, less the group family's NCCL communicators at a token's activation memory
   (`DhpConfig.mb_per_token`: `memory_mb_per_token`, or the model's estimate): the M every plan holds;
4. `microbatch`: under pipeline parallelism a microbatch holds M // P per rank, interleaved M V // C
   (`plan.pipeline.pipeline_token_cap`), since stage 0 keeps that many in flight;
5. `longest_sample`: the longest text sample the whole domain holds in one microbatch, less every rank's
   share of its gathered keys and values where a group keeps them (`plan.memory.longest_sample`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from megatron_dhp.closed_loop.injection import check_injected_ranks, check_injection
from megatron_dhp.cost import CostConfig
from megatron_dhp.cost.model_shape import ModelShape, scale_factors, scaled_cost
from megatron_dhp.cost.tensor_parallel import token_cap as budget_token_cap
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DEFAULT_COST, DhpConfig
from megatron_dhp.integration.planning import domain_node_size
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.plan.memory import ModelMemory, longest_sample, ranks_cap_for
from megatron_dhp.plan.pipeline import in_flight_chunks, interleaving_problem, pipeline_token_cap
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import Feedback, PlanSource, SampleSource, StepEngine
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.slot_timer import SlotTimer
from megatron_dhp.runtime.slots import slot_rules


@dataclass(frozen=True)
class TokenCaps:
    """The token cap after each link of the chain (the module docstring)."""

    stated: int
    budget: int
    planner: int
    microbatch: int
    longest_sample: int


@dataclass(frozen=True)
class JobSpec:
    """A job's parallel sizes, device and model memory, and everything derived from them."""

    config: DhpConfig
    domain_size: int
    """N: the dynamic domain's positions (data x context parallel ranks of one TP/PP coordinate)."""
    gpus_per_node: int
    """How many of the domain's positions share a node (`planning.domain_node_size`)."""
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    pipeline_stages: int = 1
    virtual_stages: int = 1
    expert_parallel: int = 1
    moe_dispatcher: str | None = None
    """megatron-core's MoE token dispatcher (`alltoall`, `allgather`), None without MoE."""
    fully_sharded: bool = False
    """Torch FSDP2 over the domain."""
    device_type: str = "cpu"
    model: ModelMemory | None = None
    """What a token keeps on a rank (`plan.memory.ModelMemory`); None: not known."""
    shape: ModelShape | None = None
    """The job's model, whose work scales the default cost model when `DhpConfig.cost` names none; None: not
    known (the default preset plans as it is)."""

    def __post_init__(self) -> None:
        for name in ("domain_size", "gpus_per_node", "tensor_parallel", "pipeline_stages", "virtual_stages",
                     "expert_parallel"):
            if getattr(self, name) < 1:
                raise DhpError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.gpus_per_node > self.domain_size:
            raise DhpError(f"gpus_per_node = {self.gpus_per_node} exceeds the domain's {self.domain_size} positions")
        problem = interleaving_problem(self.pipeline_stages, self.virtual_stages)
        if problem is not None:
            raise DhpError(problem)
        check_injection(self.config.slow_ranks, self.pipeline_stages)
        self.caps  # noqa: B018 - a cap the job cannot hold is an error now, not at the first step

    @classmethod
    def for_domain(cls, config: DhpConfig, domain: DynamicDomain, *, world_size: int, **sizes: object) -> JobSpec:
        """The spec of a live job on `domain` (its node size from `gpus_per_node` or torchrun's LOCAL_WORLD_SIZE
        out of the job's `world_size`; its device the domain's); `sizes` are the other fields. A slow rank the
        job does not have (`slow_ranks`, `--dhp-slow-rank`) is an error here, where the world size is known."""
        check_injected_ranks(config.slow_ranks, world_size, given="slow rank")
        return cls(config, domain.size, domain_node_size(config, domain.global_ranks, world_size),
                   device_type=domain.device.type, **sizes)

    @functools.cached_property
    def policy(self) -> CommPolicy:
        """The job's comm policy on its domain."""
        return self.config.comm_policy(world_size=self.domain_size, gpus_per_node=self.gpus_per_node)

    @property
    def counted(self) -> ModelMemory | None:
        """The model memory the cap counts: a GPU job's (a CPU job's communicators hold no GPU memory)."""
        return self.model if self.device_type == "cuda" else None

    @functools.cached_property
    def scaled(self) -> dict[str, float] | None:
        """The factors the default cost model is scaled by to this job's model (`cost.model_shape`); None where it
        plans as loaded (a cost named in the config, or no model known)."""
        if self.config.cost is not None or self.shape is None:
            return None
        return scale_factors(self.shape, tensor_parallel=self.tensor_parallel)

    @functools.cached_property
    def loaded_cost(self) -> CostConfig:
        """The configured cost model on this job's domain (the default scaled to the job's model where it names
        none), before the token cap is applied."""
        cost = CostConfig.load(self.config.cost_name)
        if self.scaled is not None:
            cost = scaled_cost(cost, self.shape, tensor_parallel=self.tensor_parallel)[0]
        if cost.tensor_parallel > 1:
            raise DhpError(f"dhp.cost {self.config.cost!r} has tensor_parallel = {cost.tensor_parallel}, which prices "
                           "simulated layouts; a job's TP is its own (train.tp, --tensor-model-parallel-size) and its "
                           "cost model describes the domain's positions: use tensor_parallel 1 (`megatron-dhp profile` "
                           "writes it)")
        return replace(cost, world_size=self.domain_size, gpus_per_node=self.gpus_per_node,
                       max_tokens_per_rank=self.config.max_tokens_per_rank)

    @property
    def communicator_rate(self) -> float:
        """MB per token at which the communicators' memory leaves the cap: a GPU job's `DhpConfig.mb_per_token`
        (the user's, else the model's estimate); 0 on a CPU, whose communicators hold no GPU memory."""
        return self.config.mb_per_token(self.counted) if self.device_type == "cuda" else 0.0

    @functools.cached_property
    def kv_memory_per_token(self) -> float:
        """g of the memory rule: the gathered keys and values a GPU job counts where a group keeps them."""
        model = self.counted
        return model.kv_memory_per_token if model is not None and self.policy.gathers_kv else 0.0

    @functools.cached_property
    def caps(self) -> TokenCaps:
        """The token-cap chain (the module docstring), each link once."""
        stated = self.config.max_tokens_per_rank
        loaded = self.loaded_cost
        budget = budget_token_cap(loaded, 1) if loaded.memory_budget_bytes else stated
        rate, policy = self.communicator_rate, self.policy
        planner = budget - int(policy.memory_per_rank_mb / rate + 0.5) if rate else budget
        if planner < 1:
            raise DhpError(
                f"the group family's {policy.communicators_per_rank} communicators per rank take "
                f"{policy.memory_per_rank_mb:.0f} MB, more than the token cap of {budget} tokens of {rate:.3g} MB; "
                "lower max_groups_per_rank or raise max_tokens_per_rank")
        microbatch = pipeline_token_cap(planner, self.pipeline_stages, self.virtual_stages)
        return TokenCaps(stated, budget, planner, microbatch,
                         longest_sample(microbatch, self.domain_size, self.kv_memory_per_token))

    @functools.cached_property
    def cost(self) -> CostConfig:
        """The cost model the planner holds: the configured one with the job's domain, the chain's M (its budget
        applied, so building the model does not derive M again), the gathered keys and values where counted,
        the configured encoder placement and stated speeds; even shards only under TransformerEngine's attention,
        whose THD context parallelism knows no other (`runtime.engine.check_shares` refuses them there)."""
        policy = self.policy
        return self.loaded_cost.with_overrides(
            max_tokens_per_rank=self.caps.planner, memory_budget_bytes=0.0,
            kv_memory_per_token=self.kv_memory_per_token or None, encoder_placement=self.config.encoder_placement,
            rank_speeds=self.config.stated_speeds(policy.world_size, policy.gpus_per_node) or None,
            uneven_shards=False if policy.layer_spec == "te" else None)

    def stated_cap_for(self, length: int) -> int:
        """The `max_tokens_per_rank` at which the domain would hold a sample of `length` (the communicators'
        share kept; under a memory budget, what the budget must leave)."""
        per_rank = ranks_cap_for(length, self.domain_size, self.kv_memory_per_token)
        planner = -(-per_rank * in_flight_chunks(self.pipeline_stages, self.virtual_stages) // self.virtual_stages)
        return planner + self.caps.budget - self.caps.planner

    @property
    def seq_multiple(self) -> int:
        """What each sample's shard divides by: the TP size under sequence parallelism."""
        return self.tensor_parallel if self.sequence_parallel else 1

    def cost_line(self) -> str:
        """One start-up line: which cost model plans, where it came from, and how it is corrected."""
        cost = self.loaded_cost
        if self.scaled is not None:
            factors = ", ".join(f"{name} x{value:.3g}" for name, value in self.scaled.items())
            source = (f"{DEFAULT_COST} (no cost given) scaled to this job's model, {self.shape.describe(self.tensor_parallel)}: "
                      f"{factors}")
        else:
            given = "no cost given, no model known" if self.config.cost is None else "given"
            source = f"{self.config.cost_name} ({given})"
        loop = ("the closed loop corrects its attention and its other seconds from timed steps (adaptive)"
                if self.config.adaptive and self.pipeline_stages == 1 else "no correction online (adaptive off)")
        return (f"cost model {cost.kind}: {source}; a {cost.linear_s_per_token:.3g} s/token, a {cost.attn_s_per_token2:.3g} "
                f"s/token^2, gamma {cost.comm_bytes_per_token:.3g} B/token; {loop}")

    def memory_line(self) -> str:
        """One start-up line: the token cap the planner holds and what it gave up, and the gathered keys and values."""
        caps, policy, rate = self.caps, self.policy, self.communicator_rate
        budget = f", {caps.budget} under the memory budget" if caps.budget != caps.stated else ""
        if rate:
            source = "memory_mb_per_token" if self.config.memory_mb_per_token is not None else "estimated from the model"
            given_up = (f"{caps.budget - caps.planner} tokens for {policy.communicators_per_rank} communicators x "
                        f"{policy.communicator_mb:.0f} MB at {rate:.3g} MB per token ({source})")
        elif self.device_type != "cuda":
            given_up = "nothing (a CPU job's communicators hold no GPU memory)"
        elif self.config.memory_mb_per_token == 0:
            given_up = "nothing (memory_mb_per_token 0 leaves the communicators outside it)"
        else:
            given_up = "nothing (no model to estimate a token's memory from: set memory_mb_per_token to count them)"
        kv = (f"; gathered keys and values count {self.kv_memory_per_token:.3g} tokens per token on every rank of "
              "their group" if self.kv_memory_per_token else "")
        return (f"token cap {caps.planner} per rank: max_tokens_per_rank {caps.stated}{budget} less {given_up}; "
                f"{caps.microbatch} per microbatch, samples up to {caps.longest_sample}{kv}")

    def engine(self, domain: DynamicDomain, pool: GroupPool | None, *, policy: CommPolicy | None = None,
               planning: PlanSource | None = None, source: SampleSource | None = None, lookahead: bool = False,
               timer: SlotTimer | None = None, feedback: Feedback | None = None) -> StepEngine:
        """The step engine of this job (the one builder: trainer, Megatron-LM, selftest, profile): its shard
        multiple, slot rules (`runtime.slots.slot_rules`), attention kernel and pipelining from the spec;
        `policy` defaults to the job's (profile times groups under `for_profiling`'s)."""
        aligned, equal_rows = slot_rules(self.expert_parallel, self.moe_dispatcher, fully_sharded=self.fully_sharded)
        return StepEngine(domain, pool, planning, source=source, lookahead=lookahead, seq_multiple=self.seq_multiple,
                          aligned_slots=aligned, equal_rows=equal_rows, policy=policy or self.policy,
                          backend=self.config.attention_backend, pipelined=self.pipeline_stages > 1, timer=timer,
                          feedback=feedback)

