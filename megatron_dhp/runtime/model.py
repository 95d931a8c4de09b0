"""The layer spec that puts dynamic-CP attention into a megatron-core GPT, and a tiny GPT for checks.

Integration is one entry in megatron-core's own layer spec: the self-attention module (so RoPE follows the
dynamic group) and its core attention. Everything else is megatron-core as shipped.
"""

from __future__ import annotations

import argparse
import copy
import zlib
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import LAYER_SPECS
from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention, DynamicCPSelfAttention


def dhp_layer_spec(*, backend: str = "local", **spec_kwargs: object) -> ModuleSpec:
    """megatron-core's GPT layer spec with dynamic context-parallel attention.

    `local`: megatron's local spec with `DynamicCPAttention` as core attention (any device; the CPU
    reference). `te`: the TransformerEngine spec, whose `TEDotProductAttention` runs context parallelism over
    the group it receives per microbatch in `PackedSeqParams.cp_group` (GPU with TE installed; TE's
    variant is the config's `cp_comm_type`, `p2p` or `all_gather` for THD; untested here, no GPU). In
    both, the self-attention module is `DynamicCPSelfAttention`, so RoPE uses the same group.
    """
    _check_backend(backend)
    if backend == "local":
        return with_dynamic_cp(get_gpt_layer_local_spec(**spec_kwargs), backend=backend)
    _require_te()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return with_dynamic_cp(get_gpt_layer_with_transformer_engine_spec(**spec_kwargs), backend=backend)


def with_dynamic_cp(spec: ModuleSpec, *, backend: str) -> ModuleSpec:
    """A copy of a GPT layer spec (megatron's local or TE one, or a user's) with dynamic-CP attention.

    The self-attention module becomes `DynamicCPSelfAttention`; `local` also swaps the core attention for
    `DynamicCPAttention` (whatever the linear layers are), `te` keeps `TEDotProductAttention`. A decoder
    block spec (megatron's MoE and heterogeneous models: one spec per layer) has each layer's swapped.
    """
    _check_backend(backend)
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]:
        _swap_attention(layer, backend)
    return spec


def _swap_attention(spec: ModuleSpec, backend: str) -> None:
    """`with_dynamic_cp` on one layer spec, in place (idempotent: layers may share one spec object)."""
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if not isinstance(attention, ModuleSpec) or not (
        isinstance(attention.module, type) and issubclass(attention.module, SelfAttention)
    ):
        raise DhpError(
            f"dynamic CP needs a GPT layer spec whose self_attention is megatron's SelfAttention, got "
            f"{getattr(attention, 'module', attention)!r}; use a standard (non-MLA) GPT layer or decoder block spec"
        )
    if backend == "local":
        attention.submodules.core_attention = DynamicCPAttention
    else:
        te_attention = _require_te()
        if not (isinstance(attention.submodules.core_attention, type)
                and issubclass(attention.submodules.core_attention, te_attention)):
            raise DhpError(
                f"layer spec 'te' needs TEDotProductAttention as core attention, the spec has "
                f"{attention.submodules.core_attention!r}; build it with --transformer-impl transformer_engine"
            )
    attention.module = DynamicCPSelfAttention


def _check_backend(backend: str) -> None:
    if backend not in LAYER_SPECS:
        raise DhpError(f"layer-spec backend {backend!r} is unknown; use {' or '.join(map(repr, LAYER_SPECS))}")


def _require_te() -> type:
    """TE's core attention class, with the CP stream that static CP 1 never allocates."""
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as e:
        raise DhpError(f"the 'te' layer spec needs TransformerEngine ({e}); install it or use backend='local'") from None
    if not torch.cuda.is_available():
        raise DhpError("the 'te' layer spec needs a CUDA device; use backend='local' on CPU")
    # megatron-core only allocates TE's CP stream when the static CP size is > 1; dynamic groups run with
    # static CP 1, so it would stay None and TE would fail on the first dynamic group (Megatron-LM #6821).
    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()
    return TEDotProductAttention


@dataclass(frozen=True)
class TinyGPTConfig:
    """A GPT small enough for a 2-core CPU yet with every feature the runtime must keep exact."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width; a multiple of num_attention_heads."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA): num_attention_heads / num_query_groups query heads share one."""
    ffn_hidden_size: int = 128
    """Width of the MLP."""
    vocab_size: int = 128
    """Token ids are drawn below it."""
    max_sequence_length: int = 4096
    """Length of the RoPE table: at least the longest sample (checked)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (with tensor parallelism > 1; a single rank ignores it)."""
    num_experts: int = 0
    """Experts of megatron-core's MoE layer in place of every MLP (each ffn_hidden_size wide); 0: dense."""
    moe_router_topk: int = 2
    """Experts each token is routed to (no capacity factor: no token is ever dropped)."""
    moe_token_dispatcher: str = "alltoall"
    """megatron-core's token dispatcher: `alltoall` or `allgather` (over the expert-parallel group)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the router's load-balancing loss; it depends on how tokens are split into microbatches."""

    def layer_spec_kwargs(self) -> dict[str, object]:
        """What megatron's GPT layer-spec builders need for this model (its MoE layer, if any)."""
        return {"num_experts": self.num_experts, "moe_grouped_gemm": False} if self.num_experts else {}

    def transformer_config(self, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                           expert_parallel: int = 1) -> TransformerConfig:
        """fp32, CPU-initialised, every fusion and dropout off (they would break bit-level comparisons)."""
        return TransformerConfig(
            **self._moe_options(expert_parallel),
            sequence_parallel=self.sequence_parallel and tensor_parallel > 1,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            pipeline_dtype=torch.float32 if pipeline_parallel > 1 else None,
            use_cpu_initialization=True,
            apply_rope_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            calculate_per_token_loss=True,
        )

    def _moe_options(self, expert_parallel: int) -> dict[str, object]:
        # No linear biases with experts: megatron-core's SequentialMLP adds an expert's bias in place to the
        # output of its row-parallel linear, an autograd view at TP 1, which torch refuses.
        if not self.num_experts:
            return {}
        return {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.moe_router_topk,
            "moe_token_dispatcher_type": self.moe_token_dispatcher,
            "moe_aux_loss_coeff": self.moe_aux_loss_coeff,
            "expert_model_parallel_size": expert_parallel,
            "add_bias_linear": False,
        }


def build_tiny_gpt(
    config: TinyGPTConfig | None = None,
    *,
    spec: ModuleSpec | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    seed: int = 0,
    tied_embeddings: bool = False,
) -> GPTModel:
    """A tiny RoPE GPT (dynamic-CP spec unless `spec` is given) with weights set by `init_weights_`.

    The tensor-, pipeline- and expert-parallel sizes are those of `pg_collection.tp`, `.pp` and `.ep`
    (default: megatron's parallel state); a pipeline stage builds its share of the layers, the embedding on the first stage and
    the output layer on the last; `tied_embeddings` shares the output layer with the embedding (under
    pipeline parallelism each end holds a copy and megatron-core all-reduces their gradients).
    """
    config = config or TinyGPTConfig()
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    stage, stages = pgs.pp.rank(), pgs.pp.size()
    model = GPTModel(
        config=config.transformer_config(tensor_parallel=pgs.tp.size(), pipeline_parallel=stages,
                                         expert_parallel=pgs.ep.size() if config.num_experts else 1),
        transformer_layer_spec=spec if spec is not None else dhp_layer_spec(**config.layer_spec_kwargs()),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied_embeddings,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        pg_collection=pgs,
    )
    init_weights_(model, seed=seed, tp_rank=pgs.tp.rank(), tp_size=pgs.tp.size())
    return model


def init_weights_(model: torch.nn.Module, *, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Give every parameter a value that depends only on its name and `seed`, sliced for this TP rank.

    Models of any tensor- or pipeline-parallel size built this way hold the same full weights, which is what
    lets a single-process oracle check a TP or PP run (names are the whole model's, `global_names`). Scales are large enough that attention is far from uniform, so
    a wrong position or mask shows up in the gradients.
    """
    names = global_names(model)
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            name = names[local_name]
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            shape = list(param.shape)
            if dim >= 0:
                shape[dim] *= tp_size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, dtype=torch.float32)
            if name.endswith("layernorm.weight"):
                full = 1.0 + 0.1 * full
            elif "embedding" not in name:
                full = 0.1 * full
            if dim >= 0:
                full = full.chunk(tp_size, dim=dim)[tp_rank]
            param.copy_(full)


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's name in the whole (one-stage, one expert-parallel rank) model: a pipeline stage
    numbers its layers from 0, an expert-parallel rank its experts, and the last stage's output layer tied
    to the embedding is the embedding weight."""
    module = model.module if hasattr(model, "finish_grad_sync") else model
    layers = getattr(getattr(module, "decoder", None), "layers", [])
    offsets = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}." for i, layer in enumerate(layers)}
    experts = {
        f"{name}.experts.local_experts.{i}.": f"{name}.experts.local_experts.{index}."
        for name, sub in module.named_modules() if hasattr(sub, "local_expert_indices")
        for i, index in enumerate(sub.local_expert_indices)
    }
    tied = getattr(module, "share_embeddings_and_output_weights", False) and not getattr(module, "pre_process", True)
    out = {}
    for name, _ in module.named_parameters():
        expert = next((p for p in experts if name.startswith(p)), None)
        full = experts[expert] + name[len(expert):] if expert else name
        prefix = next((p for p in offsets if full.startswith(p)), None)
        full = offsets[prefix] + full[len(prefix):] if prefix else full
        out[name] = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else full
    return out


def seq_multiple(config: TransformerConfig | argparse.Namespace) -> int:
    """What each sample's shard must divide by (`layout`): the TP size under sequence parallelism, else 1.
    Megatron-LM's parsed args name both settings as the model config does."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1
