"""The oracle: one process, megatron-core's own local attention, one sample at a time, no sharding at all.

It shares nothing with the code under test beyond megatron-core itself (no THD packing, no zigzag, no
dynamic groups, no DynamicCPAttention), so agreement with it is evidence, not a tautology. Inside a
distributed job it runs on a private single-rank process-group collection, so every rank can compute it
without touching the job's groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_dhp.models.gpt import TinyGPTConfig, build_tiny_gpt
from megatron_dhp.runtime.step_data import TokenSample


@dataclass
class ReferenceResult:
    """Loss (sum of per-token losses over the global token count) and the full gradient of every parameter."""

    loss: float
    num_tokens: int
    grads: dict[str, torch.Tensor]


def single_rank_groups() -> ProcessGroupCollection:
    """A collection in which every megatron group is this rank alone (a model built on it has TP = 1).

    Every rank of the job must call this once, in the same order relative to its other group creations:
    `new_group` is collective over the world even for a group of one.
    """
    own = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            own = group
    names = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "dp", "dp_cp", "tp_dp_cp",
             "ep", "expt_tp", "tp_ep", "tp_ep_pp", "expt_dp")
    return ProcessGroupCollection(**{name: own for name in names})


class _MLADotProductAttention(DotProductAttention):
    """megatron-core's local DotProductAttention taking MLA's head sizes: 0.16.1's local MLA spec builds it
    with `k_channels` and `v_channels`, which it does not accept, and it sizes its output by kv_channels.
    Queries and keys keep their width; the output is v_channels per head."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # megatron's Attention first builds it without (MLA then rebuilds it with)
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def build_reference_gpt(config: TinyGPTConfig, pgs: ProcessGroupCollection, *, seed: int,
                        tied_embeddings: bool = False) -> GPTModel:
    """The tiny GPT with megatron's local layer spec and the same weights as the model under test (every
    expert in this one process); MLA's core attention is megatron's local one, sized for MLA's heads."""
    spec = get_gpt_layer_local_spec(**config.layer_spec_kwargs())
    if config.multi_latent_attention:
        spec.submodules.self_attention.submodules.core_attention = _MLADotProductAttention
    return build_tiny_gpt(config, spec=spec, pg_collection=pgs, seed=seed, tied_embeddings=tied_embeddings)


def reference_step(model: GPTModel, samples: Sequence[TokenSample]) -> ReferenceResult:
    """Forward and backward every sample on its own ([s, 1] layout, explicit causal mask; a vision-language
    model's images encoded one by one); a MoE router's load-balancing loss is therefore per sample, as under
    a plan whose microbatches are single samples. Runs on the model's device; the gradients come back on the CPU."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    num_tokens = int(sum(int(s.loss_mask.sum()) for s in samples))
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / num_tokens))  # shaped as megatron-core sets it
    MTPLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / num_tokens))
    total = 0.0
    for s in samples:
        n = s.input_ids.numel()
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)[None, None]
        # Logits, not megatron's loss: its unfused vocab-parallel cross entropy reads the TP group from
        # parallel_state, not from the model's collection, and would reduce over the job's TP group.
        loss = (_per_token_loss(model, s, causal) * s.loss_mask.float().to(device)).sum()
        (loss / num_tokens).backward()
        total += float(loss.detach())
    grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    return ReferenceResult(loss=total / num_tokens, num_tokens=num_tokens, grads=grads)


def _per_token_loss(model: torch.nn.Module, sample: TokenSample, causal: torch.Tensor) -> torch.Tensor:
    """A sample's per-token losses, unmasked. With multi-token prediction megatron's own loss path, which
    also adds the MTP layers' masked loss to the backward (on one process: its plain roll of each sample);
    else the cross entropy of `_logits`."""
    device = causal.device
    labels = sample.labels.to(device)
    if getattr(model.config, "mtp_num_layers", None):
        positions = torch.arange(sample.length, device=device)[None]
        return model(sample.input_ids[None].to(device), positions, causal, labels=labels[None],
                     loss_mask=sample.loss_mask[None].float().to(device))[0].float()
    return F.cross_entropy(_logits(model, sample, causal)[0].float(), labels, reduction="none")


def _logits(model: torch.nn.Module, sample: TokenSample, causal: torch.Tensor) -> torch.Tensor:
    """A GPT's logits of one sample; a vision-language model (`models.vlm.TinyVLM`) first encodes the
    sample's images, each on its own, and puts their rows at their positions."""
    device = causal.device
    positions = torch.arange(sample.length, device=device)[None]
    tokens = sample.input_ids[None].to(device)
    if not hasattr(model, "language"):
        return model(tokens, positions, causal)
    rows = torch.cat([torch.arange(im.start, im.start + im.llm_tokens) for im in sample.images] or
                     [torch.empty(0, dtype=torch.int64)]).to(device)
    encoded = [model.encode(im.pixels.to(device)) for im in sample.images]
    merged = model.embed(tokens, positions, rows,
                         torch.cat(encoded) if encoded else torch.empty(0, model.config.hidden_size, device=device))
    return model.language(tokens, positions, causal, decoder_input=merged)
