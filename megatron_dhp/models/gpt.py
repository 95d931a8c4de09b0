"""A tiny GPT for checks: small enough for a 2-core CPU, with weights that depend only on parameter names.

Built with the dynamic-CP layer spec (`runtime.layer_spec`) unless given another; the oracle
(`verify.reference`) builds the same weights on megatron's local spec.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_dhp.runtime.layer_spec import dhp_layer_spec, mtp_block_spec


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
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (megatron-core's MLASelfAttention with q/k LayerNorms): queries and
    keys 24 wide (16 + an 8-wide RoPE part), values 12 wide, K/V through a 32-wide latent, Q through 24; a key
    per query head (MLA has no query groups)."""
    mtp_num_layers: int = 0
    """Multi-token prediction layers (megatron-core's MTP block on the last stage; depth k predicts token
    i + 1 + k); 0: none."""
    mtp_loss_scaling_factor: float = 0.5
    """Weight of the MTP loss in the objective (megatron's `--mtp-loss-scaling-factor`; above its 0.1 so that
    a wrong roll shows plainly in the checks' gradients)."""

    def layer_spec_kwargs(self) -> dict[str, object]:
        """What megatron's GPT layer-spec builders need for this model (its MoE layer and MLA, if any)."""
        moe = {"num_experts": self.num_experts, "moe_grouped_gemm": False} if self.num_experts else {}
        mla = {"multi_latent_attention": True, "qk_layernorm": True} if self.multi_latent_attention else {}
        return {**moe, **mla}

    def transformer_config(self, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                           expert_parallel: int = 1, virtual_pipeline: int = 1) -> TransformerConfig:
        """fp32, CPU-initialised, every fusion and dropout off (they would break bit-level comparisons)."""
        mla = dict(q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                   rope_type="rope", normalization="LayerNorm") if self.multi_latent_attention else {}
        return (MLATransformerConfig if self.multi_latent_attention else TransformerConfig)(
            **mla,
            **self._moe_options(expert_parallel),
            sequence_parallel=self.sequence_parallel and tensor_parallel > 1,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_attention_heads if self.multi_latent_attention else self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            pipeline_dtype=torch.float32 if pipeline_parallel > 1 else None,
            virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
            # interleaved: Megatron-LM's default p2p (overlapped, one request per direction)
            overlap_p2p_comm=virtual_pipeline > 1,
            deallocate_pipeline_outputs=True,
            batch_p2p_comm=virtual_pipeline == 1,
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
            mtp_num_layers=self.mtp_num_layers or None,
            mtp_loss_scaling_factor=self.mtp_loss_scaling_factor,
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
    vp_stage: int | None = None,
    virtual_pipeline: int = 1,
) -> GPTModel:
    """A tiny RoPE GPT (dynamic-CP spec unless `spec` is given) with weights set by `init_weights_`.

    The tensor-, pipeline- and expert-parallel sizes are those of `pg_collection.tp`, `.pp` and `.ep`
    (default: megatron's parallel state); a pipeline stage builds its share of the layers, the embedding on the first stage and
    the output layer on the last; `tied_embeddings` shares the output layer with the embedding (under
    pipeline parallelism each end holds a copy and megatron-core all-reduces their gradients). With
    `virtual_pipeline` V > 1 it is model chunk `vp_stage` of the stage (interleaved pipelining: the stage's
    layers in V chunks, the embedding in chunk 0 of stage 0, the output layer in chunk V - 1 of the last).
    """
    config = config or TinyGPTConfig()
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    stage, stages = pgs.pp.rank(), pgs.pp.size()
    first = stage == 0 and (vp_stage or 0) == 0
    last = stage == stages - 1 and (vp_stage is None or vp_stage == virtual_pipeline - 1)
    spec = spec if spec is not None else dhp_layer_spec(**config.layer_spec_kwargs())
    model = GPTModel(
        config=config.transformer_config(tensor_parallel=pgs.tp.size(), pipeline_parallel=stages,
                                         expert_parallel=pgs.ep.size() if config.num_experts else 1,
                                         virtual_pipeline=virtual_pipeline),
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec(spec, config.mtp_num_layers, last_stage=last),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied_embeddings,
        pre_process=first,
        post_process=last,
        pg_collection=pgs,
        **({"vp_stage": vp_stage} if vp_stage is not None else {}),
    )
    init_weights_(model, seed=seed, tp_rank=pgs.tp.rank(), tp_size=pgs.tp.size())
    return model


def build_tiny_gpt_chunks(config: TinyGPTConfig | None = None, *, virtual: int = 1, **kwargs: object) -> list[GPTModel]:
    """This stage's model as its `virtual` chunks (`build_tiny_gpt` of each `vp_stage`; one model at 1)."""
    return [build_tiny_gpt(config, virtual_pipeline=virtual, vp_stage=c if virtual > 1 else None, **kwargs)
            for c in range(virtual)]


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

