"""The one adapter from a Bridge `ConfigContainer` to what megatron-dhp's Megatron-LM hooks read.

The hooks (`megatron_dhp.megatron`: the refusals, `layer_spec`, `setup`) read Megatron-LM's parsed `args`. Under
Bridge the same values live in the container's sections; `_FIELDS` says where each one is, and the same table
turns the refusal lines' Megatron-LM flag names back into the container's field paths, so a Bridge user reads
`model.context_parallel_size 2 with dhp: ...` rather than a flag they never set.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_dhp.bridge.config import dhp_of
from megatron_dhp.bridge.refusals import BRIDGE_REFUSALS
from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.arguments import validate_dhp_args
from megatron_dhp.megatron.refusals import refusals

_FIELDS: dict[str, str] = {
    # what `hooks.setup` and `model_flags` read
    "seq_length": "dataset.seq_length",
    "distributed_timeout_minutes": "dist.distributed_timeout_minutes",
    "tensor_model_parallel_size": "model.tensor_model_parallel_size",
    "sequence_parallel": "model.sequence_parallel",
    "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
    "use_torch_fsdp2": "dist.use_torch_fsdp2",
    "reset_attention_mask": "dataset.reset_attention_mask",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_layers": "model.num_layers",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "kv_channels": "model.kv_channels",
    "bf16": "model.bf16",
    "fp16": "model.fp16",
    "recompute_granularity": "model.recompute_granularity",
    # Bridge's logging cadence (`hooks._log_steps`; `args.iteration` is set once Bridge's setup loaded a checkpoint)
    "log_interval": "logger.log_interval",
    "tensorboard_log_interval": "logger.tensorboard_log_interval",
    # what the refusal table (`megatron.refusals.REFUSALS`) and `validate_dhp_args` read
    "context_parallel_size": "model.context_parallel_size",
    "calculate_per_token_loss": "model.calculate_per_token_loss",
    "hybrid_context_parallel": "model.hybrid_context_parallel",
    "num_experts": "model.num_moe_experts",
    "expert_model_parallel_size": "model.expert_model_parallel_size",
    "pipeline_model_parallel_size": "model.pipeline_model_parallel_size",
    "multi_latent_attention": "model.multi_latent_attention",
    "use_megatron_fsdp": "dist.use_megatron_fsdp",
    "reset_position_ids": "dataset.reset_position_ids",
    "iterations_to_skip": "train.iterations_to_skip",
    "cuda_graph_impl": "model.cuda_graph_impl",
    "rampup_batch_size": "train.rampup_batch_size",
    "attention_backend": "model.attention_backend",
    "attention_dropout": "model.attention_dropout",
    "transformer_impl": "model.transformer_impl",
    "cp_comm_type": "model.cp_comm_type",
    "fp8": "model.fp8",
    "tp_comm_overlap": "model.tp_comm_overlap",
    "distributed_backend": "dist.distributed_backend",
    "mtp_num_layers": "model.mtp_num_layers",
    # Bridge's own settings (`refusals.BRIDGE_REFUSALS`)
    "dynamic_context_parallel": "model.dynamic_context_parallel",
    "use_decentralized_pg": "dist.use_decentralized_pg",
    "eval_context_parallel_size": "dist.eval_context_parallel_size",
    "dataloader_type": "dataset.dataloader_type",
}
"""Megatron-LM `args` attribute -> where a Bridge `ConfigContainer` keeps it (section.field)."""


def bridge_args(config: Any) -> argparse.Namespace:
    """Megatron-LM's `args` as the hooks read them, from a `ConfigContainer` with a `dhp` section (which takes
    the place of the `--dhp-config` YAML; no `--dhp-*` override is set)."""
    values = {attr: _read(config, path) for attr, path in _FIELDS.items()}
    heads, groups = values["num_attention_heads"], values["num_query_groups"]
    values["group_query_attention"] = groups is not None and groups != heads
    values["num_query_groups"] = groups or heads
    return argparse.Namespace(dhp=True, dhp_config=dhp_of(config), **values)


def validate(config: Any) -> argparse.Namespace:
    """`bridge_args(config)` once megatron-dhp's refusals (Megatron-LM's table and Bridge's own) pass; else one
    `DhpError` with a line per problem, each naming the container field and the fix."""
    args = bridge_args(config)
    problems = refusals(args, dhp_of(config), BRIDGE_REFUSALS)
    try:
        validate_dhp_args(args)
    except DhpError as e:
        problems += str(e).splitlines()
    if problems:
        raise DhpError("\n".join(_in_bridge_terms(line) for line in problems))
    return args


def _read(config: Any, path: str) -> Any:
    section, _, field = path.partition(".")
    return getattr(getattr(config, section, None), field, None)


def _in_bridge_terms(line: str) -> str:
    """A refusal line with each Megatron-LM flag named by its container field (longest flags first)."""
    for attr in sorted(_FIELDS, key=len, reverse=True):
        line = line.replace(f"--{attr.replace('_', '-')}", _FIELDS[attr])
    return line.replace("--dhp-config YAML", "DhpConfig").replace("--dhp", "dhp")

