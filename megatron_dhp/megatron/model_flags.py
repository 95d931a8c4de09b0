"""What a Megatron-LM run's model flags say about the job: its shape, whose work scales the default cost model,
and what a token keeps on a rank. One reader of those flags for both."""

from __future__ import annotations

import argparse

from megatron_dhp.cost.model_shape import ModelShape
from megatron_dhp.plan.memory import ModelMemory


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The GPT the flags build, as validate_args leaves them (kv_channels filled in; the padded vocabulary once
    the tokenizer is built). MoE layers are counted as a dense MLP of --ffn-hidden-size, MLA as plain heads."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 0
    return ModelShape(layers=args.num_layers, hidden=args.hidden_size, ffn_hidden=args.ffn_hidden_size,
                      heads=args.num_attention_heads, query_groups=groups, head_size=args.kv_channels, vocab=vocab,
                      swiglu=bool(getattr(args, "swiglu", False)), element_bytes=2 if args.bf16 or args.fp16 else 4)


def model_memory(args: argparse.Namespace, stages: int) -> ModelMemory:
    """What a token keeps on a rank of this run (`ModelMemory.of_gpt` on its shape; MoE's experts and MLA's
    latent keys are counted as a dense GPT of the same sizes: set memory_mb_per_token to do better)."""
    shape = model_shape(args)
    return ModelMemory.of_gpt(hidden=shape.hidden, ffn_hidden=shape.ffn_hidden, layers=shape.layers,
                              kv_channels=shape.query_groups * shape.head_size,
                              tensor_parallel=args.tensor_model_parallel_size, pipeline_stages=stages,
                              element_bytes=shape.element_bytes, full_recompute=args.recompute_granularity == "full")
