"""The plain step runner: a megatron GPT's per-token loss per microbatch, run by the step engine.

`run_step` serves every layout: the engine walks the slots, or under pipeline parallelism drives megatron-
core's 1F1B over them (`StepEngine.run`). Either way it follows the engine's normalisation rule (`engine`
module docstring): the walk divides each microbatch's loss sum by the step's global loss-token count
before its backward, and the data-parallel reduction sums (megatron DDP with `calculate_per_token_loss`,
static CP 1, over the whole domain); under PP the loss function reports each slot's loss tokens and
megatron-core's `finalize_model_grads` divides once. `train`, `demo`, `profile` and `selftest` run their
steps with it; the Megatron-LM schedule runs megatron-core's own forward and backward through the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_dhp.errors import DhpError
from megatron_dhp.runtime.attention.context import CPContext, DhpPackedSeqParams
from megatron_dhp.runtime.collectives import all_to_all_rows
from megatron_dhp.runtime.engine import Slot, StepEngine
from megatron_dhp.runtime.host import to_device
from megatron_dhp.runtime.step_data import MicrobatchInputs, StepInputs


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


def forward_thd(model: torch.nn.Module, mb: MicrobatchInputs, ctx: CPContext, *, labels: bool = True,
                decoder_input: torch.Tensor | None = None) -> torch.Tensor:
    """Run one microbatch through a megatron GPT (or one pipeline stage of it) as THD over its group: the
    per-token losses, [1, t], unmasked, when given the labels; else the stage's output activations.
    `decoder_input` [t, 1, h] replaces the word embeddings (a vision-language model's merged input)."""
    device = next(model.parameters()).device
    return model(
        to_device(mb.input_ids[None], device),
        ctx.meta.positions[None],
        None,
        decoder_input=decoder_input,
        labels=to_device(mb.labels[None], device) if labels else None,
        packed_seq_params=DhpPackedSeqParams.for_microbatch(ctx),
        loss_mask=to_device(mb.loss_mask[None], device) if labels else None,  # what multi-token prediction's loss keeps
    )


def masked_loss_sum(per_token: torch.Tensor, mb: MicrobatchInputs) -> tuple[torch.Tensor, int]:
    """The microbatch's loss, the sum of its per-token losses where the loss mask is 1, and its loss tokens."""
    return (per_token.view(-1) * to_device(mb.loss_mask, per_token.device)).sum(), int(mb.loss_mask.sum())


class _LossSum:
    """Forward: the microbatch's masked loss sum; backward: that sum / the global loss-token count. Under PP
    (`forward_step`) the last stage's loss function reports the sum and its loss tokens to 1F1B instead."""

    schedule_options: Mapping[str, object] = {}

    def __init__(self, model: torch.nn.Module, global_loss_tokens: int) -> None:
        self.model = model
        self.global_loss_tokens = global_loss_tokens
        self.loss_sum: torch.Tensor | float = 0.0
        """On the model's device until `result` reads it once: a read per microbatch would wait for the GPU."""
        self.loss_tokens = 0

    def forward(self, slot: Slot) -> torch.Tensor:
        return self.loss(slot.inputs, self.per_token(slot))[0]

    def loss(self, mb: MicrobatchInputs, per_token: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The microbatch's masked loss sum and loss tokens, counted into this rank's totals."""
        loss, count = masked_loss_sum(per_token, mb)
        self.loss_sum = self.loss_sum + loss.detach()
        self.loss_tokens += count
        return loss, count

    def forward_step(self, slots: Iterator[Slot], stage: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        slot = next(slots)
        last = parallel_state.is_pipeline_last_stage()
        return forward_thd(stage, slot.inputs, slot.context, labels=last), functools.partial(self._reported, slot.inputs)

    def _reported(self, mb: MicrobatchInputs, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """1F1B's loss function: the loss sum and its loss tokens, which `finalize_model_grads` divides by."""
        loss, count = self.loss(mb, per_token)
        return loss, torch.tensor(count, dtype=torch.int, device=per_token.device), {}

    def result(self, inputs: StepInputs, *, computed: bool = True) -> StepResult:
        """This rank's part of the step; `computed` False: a pipeline stage that computes no loss, so no tokens."""
        return StepResult(
            loss_sum=float(self.loss_sum),
            num_loss_tokens=self.loss_tokens,
            num_tokens=sum(int(mb.layout.real().sum()) for mb in inputs.microbatches) if computed else 0,
            global_loss_tokens=inputs.num_loss_tokens,
        )

    def per_token(self, slot: Slot) -> torch.Tensor:
        return forward_thd(self.model, slot.inputs, slot.context)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.global_loss_tokens).backward()

    def finish(self) -> None:
        """A megatron DDP model's gradients reduced over the domain (`reduce_gradients`)."""
        if hasattr(self.model, "finish_grad_sync"):
            reduce_gradients(self.model)


class VisionLanguageModel(Protocol):
    """What a step with images needs of the model (`models.vlm.TinyVLM` has it)."""

    language: torch.nn.Module
    """A megatron GPT with dynamic-CP attention, fed `embed`'s output as its decoder input."""

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [k, 3, h, w] -> their LLM-token embeddings [rows, hidden], image after image."""
        ...

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, image_rows: torch.Tensor,
              image_embeddings: torch.Tensor) -> torch.Tensor:
        """Word embeddings [t, 1, h] with rows `image_rows` replaced by `image_embeddings`."""
        ...


class _ImageLossSum(_LossSum):
    """`_LossSum` whose microbatches take their image rows from the embeddings the step received."""

    def __init__(self, model: torch.nn.Module, vlm: VisionLanguageModel, global_loss_tokens: int,
                 received: torch.Tensor, microbatches: tuple[MicrobatchInputs, ...],
                 rows: tuple[tuple[torch.Tensor, torch.Tensor], ...], encoder_backward: Callable[[], None]) -> None:
        super().__init__(model, global_loss_tokens)
        self.vlm = vlm
        self.received = received
        self.encoder_backward = encoder_backward
        """Returns the received rows' gradients to their encoders and runs the encoder's backward."""
        device = received.device
        self.rows = {id(mb): (to_device(slots, device), to_device(r, device)) for mb, (slots, r) in zip(microbatches, rows)}
        self.no_rows = (torch.empty(0, dtype=torch.int64, device=device),) * 2

    def per_token(self, slot: Slot) -> torch.Tensor:
        mb = slot.inputs
        slots, rows = self.rows.get(id(mb), self.no_rows)  # a padding slot of aligned slots has no image
        device = self.received.device
        merged = self.vlm.embed(to_device(mb.input_ids[None], device), slot.context.meta.positions[None], slots,
                                self.received[rows])
        return forward_thd(self.vlm.language, mb, slot.context, decoder_input=merged)

    def finish(self) -> None:
        """The encoder's backward first, so that its gradients are reduced with the language model's."""
        self.encoder_backward()
        super().finish()


def run_step(engine: StepEngine, model: torch.nn.Module, inputs: StepInputs) -> StepResult:
    """Forward and backward this rank's microbatches of a prepared step; the engine then finishes the gradients.

    Gradients accumulate into the model (zero them before the step, as Megatron's train step does). With a
    megatron `DistributedDataParallel` model the domain-wide reduction runs after the walk (`_LossSum.finish`;
    `engine.finish_s` is how long it took). Under PP (`engine.pipelined`; `model` is this rank's megatron DDP
    stage, interleaved the list of its chunks) 1F1B finalizes the gradients itself through the model config,
    which this sets, and only the last stage computes the loss and tokens.
    """
    chunks = model if isinstance(model, list) else [model]
    config = getattr(chunks[0], "config", None)
    if hasattr(chunks[0], "finish_grad_sync") and config is not None and not config.calculate_per_token_loss:
        raise DhpError(
            "the model's DDP averages gradients over the domain (calculate_per_token_loss=False), which "
            "breaks per-token normalisation across dynamic groups; set calculate_per_token_loss=True"
        )
    if engine.pipelined:
        if inputs.vision is not None:
            raise DhpError("a step with images under pipeline parallelism is not supported; use PP 1 for a "
                           "vision-language model")
        no_sync = [chunk.no_sync for chunk in chunks]
        config.no_sync_func = no_sync if len(chunks) > 1 else no_sync[0]
        config.finalize_model_grads_func = finalize_model_grads  # with the loss tokens 1F1B's loss function reports
        work = _LossSum(model, inputs.num_loss_tokens)
        engine.run(inputs, work)
        return work.result(inputs, computed=parallel_state.is_pipeline_last_stage())
    scale_aux_losses(inputs.num_loss_tokens, next(chunks[0].parameters()).device)
    if inputs.vision is None:
        work = _LossSum(model, inputs.num_loss_tokens)
        engine.run(inputs, work)
    else:
        work = _run_with_images(engine, model, inputs)
    return work.result(inputs)


def scale_aux_losses(global_loss_tokens: int, device: torch.device) -> None:
    """Divide a MoE router's load-balancing loss and multi-token prediction's loss (sums over a microbatch's
    tokens under per-token loss) by the global loss-token count, as the main loss. The scale lives on the
    model's device: megatron-core multiplies it with the loss's gradient in backward, and a 1-D tensor on
    another device is refused there. (MoE's `set_loss_scale` copies into the scale it already holds, whatever
    its device, so a scale elsewhere is replaced, not copied into.)"""
    scale = torch.full((1,), 1.0 / global_loss_tokens, device=device)  # megatron-core's shape
    for scaler in (MoEAuxLossAutoScaler, MTPLossAutoScaler):
        held = scaler.main_loss_backward_scale
        if held is not None and held.device == scale.device and held.shape == scale.shape:
            held.copy_(scale)
        else:
            scaler.main_loss_backward_scale = scale


def _run_with_images(engine: StepEngine, model: torch.nn.Module, inputs: StepInputs) -> _LossSum:
    """The step of a multimodal batch (`runtime.vision`): encode this rank's images, send their rows, walk the
    microbatches; the work's finish returns the rows' gradients and runs the encoder's backward once before the
    gradients are reduced."""
    vision = inputs.vision
    vlm: VisionLanguageModel = model.module if hasattr(model, "finish_grad_sync") else model
    encoded = vlm.encode(vision.pixels.to(next(vlm.parameters()).device))
    send_rows = vision.send_rows.to(encoded.device)
    received = all_to_all_rows(encoded.detach()[send_rows], vision.send_counts, vision.recv_counts, engine.domain)
    received.requires_grad_(True)

    def encoder_backward() -> None:
        grad = received.grad if received.grad is not None else torch.zeros_like(received)
        back = all_to_all_rows(grad, vision.recv_counts, vision.send_counts, engine.domain)
        if encoded.requires_grad:
            encoded.backward(torch.zeros_like(encoded).index_add_(0, send_rows, back.to(encoded.device)))

    work = _ImageLossSum(model, vlm, inputs.num_loss_tokens, received, inputs.microbatches, vision.microbatch_rows,
                         encoder_backward)
    engine.run(inputs, work)
    return work


def reduce_gradients(model: torch.nn.Module) -> None:
    """Reduce a megatron DDP model's gradients over the domain, and its sequence-parallel LayerNorm gradients
    over TP: megatron-core's `finalize_model_grads` without a token count (the backward already divided)."""
    finalize_model_grads([model], None)
