"""One training step's forward and backward under a plan: this rank's microbatches, then the gradient sync.

Loss normalisation is what keeps the math independent of the grouping: each microbatch's per-token
losses are summed and divided by the step's global loss-token count (known to every rank from the length
gather), and the data-parallel reduction sums (megatron DDP with `calculate_per_token_loss`, static CP 1,
over the whole domain). The gradient is then the mean over every token of the global batch, exactly as a
single process computing the whole batch would get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
from megatron_dhp.runtime.dispatch import MicrobatchInputs, StepInputs
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.group_pool import GroupPool


@dataclass(frozen=True)
class StepResult:
    """This rank's part of the step; sum `loss_sum` over the domain and divide by `global_loss_tokens`."""

    loss_sum: float
    """Sum of the per-token losses this rank computed (its shards of its microbatches)."""
    num_loss_tokens: int
    """Loss tokens this rank computed; over the domain they add up to `global_loss_tokens`."""
    num_tokens: int
    """Real (non-padding) tokens this rank computed; over the domain they add up to the batch's tokens."""
    global_loss_tokens: int


PHASE_BARRIER = None
"""An item of `execution_order`: a barrier over the domain between two phases."""


def execution_order(plan: Plan, microbatches: Sequence[MicrobatchInputs]) -> list[MicrobatchInputs | None]:
    """A rank's microbatches (already in phase order) with a `PHASE_BARRIER` after every phase but the last
    when the plan separates its phases by barriers, as megatron-core's hybrid CP scheduler does."""
    if not plan.phase_barrier:
        return list(microbatches)
    work: list[MicrobatchInputs | None] = []
    for phase in range(plan.num_phases):
        work += [mb for mb in microbatches if mb.phase == phase]
        if phase < plan.num_phases - 1:
            work.append(PHASE_BARRIER)
    return work


def microbatch_context(mb: MicrobatchInputs, pool: GroupPool, *, comm: str, backend: str = "auto") -> CPContext:
    """The attention context of one microbatch: its layout and this rank's communicator for its group."""
    return CPContext(layout=mb.layout, group=pool.get(mb.group_ranks), comm=comm, backend=backend)


def per_token_losses(model: torch.nn.Module, mb: MicrobatchInputs, ctx: CPContext) -> torch.Tensor:
    """Run one microbatch through a megatron GPT as THD; returns its per-token losses, [1, t], unmasked."""
    device = next(model.parameters()).device
    params = DhpPackedSeqParams.for_microbatch(ctx, device=device)
    return model(
        mb.input_ids[None].to(device),
        mb.position_ids[None].to(device),
        None,
        labels=mb.labels[None].to(device),
        packed_seq_params=params,
    )


def forward_microbatch(model: torch.nn.Module, mb: MicrobatchInputs, ctx: CPContext) -> torch.Tensor:
    """Run one microbatch through a megatron GPT as THD; returns the sum of its masked per-token losses."""
    per_token = per_token_losses(model, mb, ctx)
    return (per_token.view(-1) * mb.loss_mask.to(per_token.device)).sum()


def run_step(
    model: torch.nn.Module,
    inputs: StepInputs,
    pool: GroupPool,
    domain: DynamicDomain,
    *,
    comm: str = "allgather",
    backend: str = "auto",
    grad_sync: bool = True,
) -> StepResult:
    """Forward and backward this rank's microbatches phase by phase, then reduce gradients over the domain.

    Gradients accumulate into the model (zero them before the step, as Megatron's train step does). With a
    megatron `DistributedDataParallel` model the domain-wide reduction runs here (`finish_grad_sync`)
    unless `grad_sync` is False, which leaves it to the caller (the train loop times it apart from the
    forward and backward the plan predicts). `pool.prepare(inputs.plan)` must have run on every rank.
    """
    config = getattr(model, "config", None)
    if hasattr(model, "finish_grad_sync") and config is not None and not config.calculate_per_token_loss:
        raise DhpError(
            "the model's DDP averages gradients over the domain (calculate_per_token_loss=False), which "
            "breaks per-token normalisation across dynamic groups; set calculate_per_token_loss=True"
        )
    loss_sum, loss_tokens = 0.0, 0
    for mb in execution_order(inputs.plan, inputs.microbatches):
        if mb is PHASE_BARRIER:
            dist.barrier(group=domain.group)
            continue
        loss = forward_microbatch(model, mb, microbatch_context(mb, pool, comm=comm, backend=backend))
        (loss / inputs.num_loss_tokens).backward()
        loss_sum += float(loss.detach())
        loss_tokens += int(mb.loss_mask.sum())
    if grad_sync and hasattr(model, "finish_grad_sync"):
        model.finish_grad_sync()
    return StepResult(
        loss_sum=loss_sum,
        num_loss_tokens=loss_tokens,
        num_tokens=sum(int(mb.layout.real().sum()) for mb in inputs.microbatches),
        global_loss_tokens=inputs.num_loss_tokens,
    )
