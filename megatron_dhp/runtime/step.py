"""The plain step runner: a megatron GPT's per-token loss per microbatch, walked by the step engine.

It follows the engine's normalisation rule (`engine` module docstring) by dividing each microbatch's loss
sum by the step's global loss-token count before its backward; the data-parallel reduction sums (megatron
DDP with `calculate_per_token_loss`, static CP 1, over the whole domain). `train`, `demo`, `profile` and
`selftest` run their steps with it; the Megatron-LM schedule runs megatron-core's own forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
from megatron_dhp.runtime.dispatch import MicrobatchInputs, StepInputs
from megatron_dhp.runtime.engine import Slot, StepEngine


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


def forward_thd(model: torch.nn.Module, mb: MicrobatchInputs, ctx: CPContext, *, labels: bool = True) -> torch.Tensor:
    """Run one microbatch through a megatron GPT (or one pipeline stage of it) as THD over its group: the
    per-token losses, [1, t], unmasked, when given the labels; else the stage's output activations."""
    device = next(model.parameters()).device
    params = DhpPackedSeqParams.for_microbatch(ctx, device=device)
    return model(
        mb.input_ids[None].to(device),
        mb.position_ids[None].to(device),
        None,
        labels=mb.labels[None].to(device) if labels else None,
        packed_seq_params=params,
    )


def masked_loss_sum(per_token: torch.Tensor, mb: MicrobatchInputs) -> tuple[torch.Tensor, int]:
    """The microbatch's loss, the sum of its per-token losses where the loss mask is 1, and its loss tokens."""
    return (per_token.view(-1) * mb.loss_mask.to(per_token.device)).sum(), int(mb.loss_mask.sum())


class _LossSum:
    """Forward: the microbatch's masked loss sum; backward: that sum / the global loss-token count."""

    def __init__(self, model: torch.nn.Module, global_loss_tokens: int) -> None:
        self.model = model
        self.global_loss_tokens = global_loss_tokens
        self.loss_sum = 0.0
        self.loss_tokens = 0

    def forward(self, slot: Slot) -> torch.Tensor:
        loss, count = masked_loss_sum(forward_thd(self.model, slot.inputs, slot.context), slot.inputs)
        self.loss_sum += float(loss.detach())
        self.loss_tokens += count
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.global_loss_tokens).backward()


def run_step(
    engine: StepEngine,
    model: torch.nn.Module,
    inputs: StepInputs,
    *,
    comm: str = "allgather",
    backend: str = "auto",
    grad_sync: bool = True,
) -> StepResult:
    """Forward and backward this rank's microbatches of a prepared step, then reduce gradients over the domain.

    Gradients accumulate into the model (zero them before the step, as Megatron's train step does). With a
    megatron `DistributedDataParallel` model the domain-wide reduction runs here (`reduce_gradients`)
    unless `grad_sync` is False, which leaves it to the caller (the train loop times it apart from the
    forward and backward the plan predicts).
    """
    config = getattr(model, "config", None)
    if hasattr(model, "finish_grad_sync") and config is not None and not config.calculate_per_token_loss:
        raise DhpError(
            "the model's DDP averages gradients over the domain (calculate_per_token_loss=False), which "
            "breaks per-token normalisation across dynamic groups; set calculate_per_token_loss=True"
        )
    work = _LossSum(model, inputs.num_loss_tokens)
    # A MoE router's load-balancing loss (a sum over a microbatch's tokens under per-token loss) is
    # divided by the same global loss-token count as the main loss.
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / inputs.num_loss_tokens))  # megatron-core shape
    engine.run(inputs, work, comm=comm, backend=backend)
    if grad_sync and hasattr(model, "finish_grad_sync"):
        reduce_gradients(model)
    return StepResult(
        loss_sum=work.loss_sum,
        num_loss_tokens=work.loss_tokens,
        num_tokens=sum(int(mb.layout.real().sum()) for mb in inputs.microbatches),
        global_loss_tokens=inputs.num_loss_tokens,
    )


def reduce_gradients(model: torch.nn.Module) -> None:
    """Reduce a megatron DDP model's gradients over the domain, and its sequence-parallel LayerNorm gradients
    over TP: megatron-core's `finalize_model_grads` without a token count (the backward already divided)."""
    finalize_model_grads([model], None)
