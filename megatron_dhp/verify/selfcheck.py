"""Check the runtime against the single-process oracle on a live job (the `selftest` command, the tests).

One `SelfCheck` per rank holds the model under test (tiny GPT, dynamic-CP spec, megatron DDP over the
domain) and the oracle (the same weights, megatron's local attention, one process). `check(plan, samples,
comm)` runs a full step under the plan and compares the loss and every parameter gradient (TP shards
gathered; under pipeline parallelism each stage its own, by whole-model name) with the oracle; the
differences are reduced over the world so every rank returns the same verdict. With PP > 1 the step runs
through megatron-core's 1F1B, which the step engine drives (`StepEngine.run`); with V > 1 virtual stages
each rank holds V model chunks and the step runs megatron-core's interleaved 1F1B.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_dhp.closed_loop.injection import timer_for_job
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.launch.cpu_shim import backport_fsdp2_finish_grad_sync
from megatron_dhp.models.gpt import TinyGPTConfig, build_tiny_gpt_chunks, global_names
from megatron_dhp.models.vlm import TinyVLM, TinyVLMConfig
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.plan.family import group_family
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.pipeline import check_pipeline
from megatron_dhp.runtime.step import run_step
from megatron_dhp.runtime.step_data import TokenSample, local_slice
from megatron_dhp.verify.reference import build_reference_gpt, reference_step, single_rank_groups
from megatron_dhp.workload.sample import Batch

TOLERANCE = 1e-5
"""fp32: loss and every gradient element must agree with the oracle to this absolute difference."""


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one plan, identical on every rank except `worst_param`."""

    plan_summary: str
    comm: str
    loss: float
    reference_loss: float
    max_loss_diff: float
    max_grad_diff: float
    worst_param: str
    """The parameter with this rank's largest gradient difference (the only field that may differ by rank)."""
    tokens_computed: int
    """Real tokens computed over the domain; equals `batch_tokens` when every token ran exactly once."""
    batch_tokens: int
    loss_tokens_computed: int
    batch_loss_tokens: int
    slots_by_comm: dict[str, int] = field(default_factory=dict)
    """The variant each of this rank's slots ran (`mixed` resolves group by group)."""

    @property
    def ok(self) -> bool:
        """Loss and gradients within `TOLERANCE` and every token computed exactly once."""
        return (
            self.max_loss_diff <= TOLERANCE
            and self.max_grad_diff <= TOLERANCE
            and self.tokens_computed == self.batch_tokens
            and self.loss_tokens_computed == self.batch_loss_tokens
        )


def random_samples(batch: Batch, *, vocab_size: int, seed: int) -> list[TokenSample]:
    """Token ids for `batch`; each sample's first tokens (a random 0-3) are a prompt with no loss."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in batch.samples:
        tokens = torch.randint(0, vocab_size, (s.tokens + 1,), generator=gen)
        mask = torch.ones(s.tokens)
        mask[: int(torch.randint(0, 4, (1,), generator=gen))] = 0
        out.append(TokenSample(s.id, tokens[:-1], tokens[1:], mask))
    return out


class SelfCheck:
    """This rank's model under test, its oracle, its domain and its group pool."""

    def __init__(self, *, config: TinyGPTConfig | None = None, seed: int = 0, backend: str = "auto",
                 tied_embeddings: bool = False, vlm: TinyVLMConfig | None = None,
                 slowdowns: Mapping[int, float] | None = None, virtual: int = 1, fsdp: bool = False,
                 gpus_per_node: int | None = None) -> None:
        """`vlm`: check the vision-language model of that config (its language model is `vlm.language`);
        `slowdowns`: global rank -> factor, each of those ranks holds its slots that many times as long, and
        every rank its groups for them (`closed_loop.injection`); `virtual`: model
        chunks per pipeline stage (interleaved 1F1B); `fsdp`: megatron-core's torch FSDP2 wrapper over the
        domain instead of its DDP (gradients summed, not averaged, as the per-token rule needs); `gpus_per_node`:
        the domain's positions per node (default all: one node), which decides the group family and where a
        group crosses nodes."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = vlm.language if vlm is not None else config or TinyGPTConfig()
        self.config = config
        self.backend = backend
        self.slowdowns = dict(slowdowns or {})
        self.domain = DynamicDomain.from_parallel_state()
        self.gpus_per_node = gpus_per_node or self.domain.size
        if not 1 <= self.gpus_per_node <= self.domain.size:
            raise DhpError(f"gpus_per_node = {gpus_per_node} must be between 1 and the domain's {self.domain.size} positions")
        self.pool = GroupPool(self.domain)
        self.max_groups_per_rank = 0
        """K of the pool's family (`use_family`): the comm policy of each check is built with it."""
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        if self.pp_group.size() > 1:
            check_pipeline(self.domain)
        if vlm is not None:
            inners = [TinyVLM(vlm, seed=seed)]
        else:
            inners = build_tiny_gpt_chunks(config, virtual=virtual, seed=seed, tied_embeddings=tied_embeddings)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
        self.fsdp = fsdp
        self.chunks = []
        """This rank's model under test: its stage, or its V model chunks (megatron DDP or FSDP2 each)."""
        for inner in inners:
            if torch.cuda.is_available():
                inner.cuda()
            wrap = sharded if fsdp else DistributedDataParallel
            self.chunks.append(wrap(config=inner.config, ddp_config=ddp_config, module=inner))
        self.model = self.chunks[0] if virtual == 1 else self.chunks
        if vlm is not None:
            self.reference = TinyVLM(vlm, language_spec=get_gpt_layer_local_spec(), pg_collection=single_rank_groups(),
                                     seed=seed)
        else:
            self.reference = build_reference_gpt(config, single_rank_groups(), seed=seed, tied_embeddings=tied_embeddings)
        if torch.cuda.is_available():  # on the model's device: megatron's RoPE puts its table on the current GPU
            self.reference.cuda()

    def use_family(self, max_groups_per_rank: int) -> None:
        """A fresh pool with the group family of this bound (on `gpus_per_node`) created now, as a job's
        start-up does; 0: no family. Collective."""
        n = self.domain.size
        self.max_groups_per_rank = max_groups_per_rank
        groups = group_family(n, self.gpus_per_node, max_groups_per_rank).groups if max_groups_per_rank else ()
        self.pool = GroupPool(self.domain, family=groups)

    def policy(self, comm: str) -> CommPolicy:
        """The comm policy of `comm` over this check's domain and the family of `use_family`."""
        return CommPolicy.resolve(comm, max_groups_per_rank=self.max_groups_per_rank, world_size=self.domain.size,
                                  gpus_per_node=self.gpus_per_node)

    def check(self, plan: Plan, samples: list[TokenSample], comm: str, *, placement: str = "split") -> CheckResult:
        """Run one step under `plan` with each group talking as `comm`'s policy says, and compare it with the
        oracle on the same samples (images encoded where `placement` says). Collective."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
            chunk.module.zero_grad(set_to_none=True)  # FSDP2 keeps its gradients on the parameters
        local = local_slice(samples, self.domain.position, self.domain.size)
        config = self.chunks[0].config
        pipelined = self.pp_group.size() > 1
        n = self.domain.size
        spec = JobSpec(DhpConfig(attention_backend=self.backend, comm=comm), n, self.gpus_per_node,
                       tensor_parallel=config.tensor_model_parallel_size, sequence_parallel=config.sequence_parallel,
                       pipeline_stages=self.pp_group.size(), virtual_stages=len(self.chunks),
                       expert_parallel=config.expert_model_parallel_size,
                       moe_dispatcher=config.moe_token_dispatcher_type, fully_sharded=self.fsdp)
        engine = spec.engine(self.domain, self.pool, policy=self.policy(comm),
                             timer=timer_for_job(self.domain.device, self.slowdowns))
        inputs = engine.prepare(local, replace(plan, encoder_placement=placement))
        step = run_step(engine, self.model, inputs)
        device = self.domain.device
        totals = torch.tensor([step.loss_sum, step.num_tokens, step.num_loss_tokens], dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=self.domain.group)
        if pipelined:  # only the last stage computed the loss
            dist.all_reduce(totals, group=self.pp_group)
        loss = float(totals[0]) / step.global_loss_tokens

        ref = reference_step(self.reference, samples)
        worst, worst_name = 0.0, ""
        for chunk in self.chunks:
            names = global_names(chunk)
            for local_name, param in chunk.module.named_parameters():
                name = names[local_name]
                diff = float((full_grad(param, self.tp_group).cpu() - ref.grads[name]).abs().max())
                if diff > worst:
                    worst, worst_name = diff, name
        diffs = torch.tensor([abs(loss - ref.loss), worst], dtype=torch.float64, device=device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        return CheckResult(
            plan_summary=plan.summary(),
            comm=comm,
            loss=loss,
            reference_loss=ref.loss,
            max_loss_diff=float(diffs[0]),
            max_grad_diff=float(diffs[1]),
            worst_param=worst_name,
            tokens_computed=int(totals[1]),
            batch_tokens=inputs.num_tokens,
            loss_tokens_computed=int(totals[2]),
            batch_loss_tokens=inputs.num_loss_tokens,
            slots_by_comm=dict(engine.slots_by_comm),
        )


def sharded(*, config: object, ddp_config: object, module: torch.nn.Module) -> torch.nn.Module:
    """megatron-core's torch FSDP2 wrapper of `module` over the domain, its gradient reductions summing."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.fsdp import FSDPModule

    backport_fsdp2_finish_grad_sync()
    # megatron's own set for the local spec (it drops ColumnParallelLinear when transformer_impl is "local")
    model = TorchFullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                          sub_modules_to_wrap={TransformerLayer, LanguageModelEmbedding})
    for sub in model.module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def full_grad(param: torch.nn.Parameter, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The reduced gradient of `param` with its tensor-parallel shards concatenated (collective over TP); an
    FSDP2 parameter's gradient gathered whole (collective over its shard group)."""
    if hasattr(param.grad, "full_tensor"):
        return param.grad.full_tensor()
    grad = param.main_grad
    if not getattr(param, "tensor_model_parallel", False) or tp_group.size() == 1:
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp_group.size())]
    dist.all_gather(parts, grad.contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)
