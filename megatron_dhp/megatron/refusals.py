"""Every Megatron-LM flag combination that cannot work with --dhp, as one table.

The validator (`arguments.validate_dhp_args`) evaluates the table and the docs' list of unsupported flags
(`scripts/config_docs.py`, docs/megatron-lm.md) is printed from it, so the two cannot drift apart. Each
rule's message is one line: what was given, why it cannot work, and the nearest supported setting.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dhp.closed_loop.injection import INJECTION_UNDER_PP
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.runtime.attention.te import te_unsupported


@dataclass(frozen=True)
class Refusal:
    """One refused combination: `given` finds it, `problem`, `why` and `fix` say it in one line."""

    refused: str
    """What is refused, for the docs (markdown)."""
    given: Callable[[argparse.Namespace, DhpConfig], object]
    """The refused value in the parsed args and config; falsy when the run does not use it."""
    problem: str
    """What was given, formatted with `value` (what `given` returned), `args` and `config`."""
    why: str
    """Why dynamic groups cannot work with it (markdown: the message drops the backticks)."""
    fix: str
    """The nearest supported setting (markdown, as `why`)."""

    def message(self, args: argparse.Namespace, config: DhpConfig) -> str | None:
        """The one-line refusal for this run, or None when the run does not use the refused setting."""
        value = self.given(args, config)
        if not value:
            return None
        problem = self.problem.format(value=value, args=args, config=config)
        return f"{problem}: {self.why}; {self.fix}".replace("`", "")


def _non_thd_comm_types(args: argparse.Namespace, config: DhpConfig) -> str:
    if config.layer_spec != "te":
        return ""
    return " ".join(te_unsupported(args.cp_comm_type))


REFUSALS: tuple[Refusal, ...] = (
    Refusal("`--context-parallel-size` > 1",
            lambda a, c: a.context_parallel_size if a.context_parallel_size > 1 else None,
            "--context-parallel-size {value} with --dhp",
            "megatron-dhp forms the context-parallel groups itself every step",
            "set `--context-parallel-size 1` (the DP ranks become the dynamic domain)"),
    Refusal("no `--calculate-per-token-loss`",
            lambda a, c: not a.calculate_per_token_loss,
            "--dhp needs --calculate-per-token-loss",
            "with groups that change every step only a loss summed per token and divided by the global token "
            "count keeps gradients exact",
            "add `--calculate-per-token-loss`"),
    Refusal("`--hybrid-context-parallel`",
            lambda a, c: getattr(a, "hybrid_context_parallel", False),
            "--hybrid-context-parallel with --dhp",
            "both form dynamic CP groups",
            "drop `--hybrid-context-parallel`"),
    Refusal("MoE's `allgather` token dispatcher with `--expert-model-parallel-size` > 1 and pipeline parallelism",
            lambda a, c: a.expert_model_parallel_size if getattr(a, "num_experts", None) and
            a.moe_token_dispatcher_type == "allgather" and a.expert_model_parallel_size > 1 and
            a.pipeline_model_parallel_size > 1 else None,
            "--moe-token-dispatcher-type allgather with --expert-model-parallel-size {value} and "
            "--pipeline-model-parallel-size {args.pipeline_model_parallel_size}",
            "it gathers equally long token blocks over the expert-parallel group, and megatron-dhp pads 1F1B "
            "slots to equal counts but not yet to equal lengths",
            "use `--moe-token-dispatcher-type alltoall` (allgather works without pipeline parallelism)"),
    Refusal("MoE's `flex` token dispatcher (`--moe-token-dispatcher-type flex`)",
            lambda a, c: getattr(a, "num_experts", None) and getattr(a, "moe_token_dispatcher_type", "") == "flex",
            "--moe-token-dispatcher-type flex with --dhp",
            "DeepEP / HybridEP are not verified with per-step slot alignment",
            "use `--moe-token-dispatcher-type alltoall`"),
    Refusal("MLA (`--multi-latent-attention`) with `--tensor-model-parallel-size` > 1 or `layer_spec: te`",
            lambda a, c: getattr(a, "multi_latent_attention", False) and (
                f"--tensor-model-parallel-size {a.tensor_model_parallel_size}"
                if getattr(a, "tensor_model_parallel_size", 1) > 1
                else "layer_spec te" if c.layer_spec == "te" else None),
            "--multi-latent-attention with {value} and --dhp",
            "MLA over dynamic groups is checked at TP 1 with the local spec only (under TP megatron-core 0.16.1's "
            "local MLA does not sum its shared RoPE key's gradient over the TP ranks, even without context "
            "parallelism; TE's is unverified here)",
            "use `--tensor-model-parallel-size 1` and `layer_spec: local`"),
    Refusal("Megatron-FSDP (`--use-megatron-fsdp`)",
            lambda a, c: getattr(a, "use_megatron_fsdp", False),
            "--use-megatron-fsdp with --dhp",
            "Megatron-FSDP is not verified under dynamic groups yet (its CUDA-only buffers keep it from running on "
            "the CPU, where the runs are checked)",
            "use `--use-torch-fsdp2` (verified: the same sharding over the whole domain) or "
            "`--use-distributed-optimizer`"),
    Refusal("legacy models (`--use-legacy-models`)",
            lambda a, c: getattr(a, "use_legacy_models", False),
            "--use-legacy-models with --dhp",
            "only megatron-core models take dynamic groups",
            "drop `--use-legacy-models`"),
    Refusal("`--reset-attention-mask` without `--reset-position-ids`",
            lambda a, c: a.reset_attention_mask and not a.reset_position_ids,
            "--reset-attention-mask with --dhp needs --reset-position-ids",
            "megatron-dhp trains each document as its own sequence (positions from 0) and finds documents "
            "where positions restart",
            "add `--reset-position-ids`"),
    Refusal("`--multiple-validation-sets` with virtual pipelining",
            lambda a, c: getattr(a, "multiple_validation_sets", False) and
            getattr(a, "virtual_pipeline_model_parallel_size", None),
            "--multiple-validation-sets with --virtual-pipeline-model-parallel-size {value}",
            "Megatron-LM nests the validation iterators per model chunk, then per set, and its evaluation reads "
            "the outer list as the sets (each set would be scored on another chunk's data)",
            "drop `--multiple-validation-sets`, or train without virtual pipelining"),
    Refusal("`--sft` with evaluation (`--eval-iters` > 0 or `--full-validation`)",
            lambda a, c: getattr(a, "sft", False) and (getattr(a, "full_validation", False) or a.eval_iters),
            "--sft with --eval-iters {args.eval_iters} under --dhp",
            "Megatron-LM scores SFT evaluation as the mean of each microbatch's mean loss, and megatron-dhp's "
            "microbatches are not Megatron's rows, so the figure would differ from upstream's (and a microbatch "
            "without loss tokens would give 0/0); training is exact",
            "set `--eval-iters 0` for the `--dhp` run, or evaluate its checkpoints without `--dhp`"),
    Refusal("`--iterations-to-skip`",
            lambda a, c: getattr(a, "iterations_to_skip", None),
            "--iterations-to-skip with --dhp",
            "skipped iterations read the loader outside the megatron-dhp schedule",
            "remove the skip list"),
    Refusal("CUDA graphs (`--cuda-graph-impl`)",
            lambda a, c: getattr(a, "cuda_graph_impl", "none") not in ("none", None) and a.cuda_graph_impl,
            "--cuda-graph-impl {value} with --dhp",
            "every step has other shapes and groups, which a captured graph cannot follow",
            "use `--cuda-graph-impl none`"),
    Refusal("`--rampup-batch-size` with `overlap_planning`",
            lambda a, c: c.overlap_planning and a.rampup_batch_size,
            "--rampup-batch-size with overlap_planning",
            "the step planned ahead would have the wrong size",
            "set `overlap_planning: false` in the `--dhp-config` YAML"),
    Refusal("`--attention-backend local`",
            lambda a, c: str(getattr(a, "attention_backend", "")).endswith("local"),
            "--attention-backend local with --dhp",
            "it replaces the core attention megatron-dhp puts in the layer spec",
            "leave `--attention-backend` at its default (`auto`)"),
    Refusal("`--attention-dropout` with `layer_spec: local`",
            lambda a, c: c.layer_spec == "local" and a.attention_dropout,
            "--attention-dropout {value} with layer_spec local",
            "megatron-dhp's attention has no dropout",
            "set `--attention-dropout 0` (or `layer_spec: te`, whose attention has its own)"),
    Refusal("`layer_spec: te` with a `--transformer-impl` other than `transformer_engine`",
            lambda a, c: c.layer_spec == "te" and a.transformer_impl != "transformer_engine" and a.transformer_impl,
            "layer_spec te needs --transformer-impl transformer_engine (got {value})",
            "its core attention is TransformerEngine's",
            "set `--transformer-impl transformer_engine`, or `layer_spec: local`"),
    Refusal("`layer_spec: te` with a `--cp-comm-type` other than `p2p` or `all_gather`",
            _non_thd_comm_types,
            "--cp-comm-type {value} with layer_spec te",
            "TransformerEngine's attention runs dynamic groups of any size with `p2p` or `all_gather` only (`a2a` "
            "needs the group size to divide the heads; `a2a+p2p` has no packed-sequence path)",
            "set `--cp-comm-type p2p` or `all_gather`"),
    Refusal("fp8 (`--fp8-format`)",
            lambda a, c: getattr(a, "fp8", None),
            "--fp8-format {value} with --dhp",
            "TransformerEngine's fp8 GEMMs need every rank's token rows in a multiple of 8 or 16, and a dynamic "
            "microbatch holds any count (most ranks' rows of a plan are not)",
            "train in bf16 (drop `--fp8-format`)"),
    Refusal("`--tp-comm-overlap`",
            lambda a, c: getattr(a, "tp_comm_overlap", False),
            "--tp-comm-overlap with --dhp",
            "TransformerEngine's userbuffers are sized once from `--seq-length` x `--micro-batch-size`, and a "
            "dynamic microbatch has other row counts every step",
            "drop `--tp-comm-overlap`"),
    Refusal("`--dhp-slow-rank` with `--pipeline-model-parallel-size` > 1",
            lambda a, c: " ".join(c.slow_ranks) if c.slow_ranks and a.pipeline_model_parallel_size > 1 else None,
            "--dhp-slow-rank {value} with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}",
            INJECTION_UNDER_PP,
            "drop `--dhp-slow-rank` (the closed loop, `--dhp-adaptive`, is off under pipeline parallelism too and "
            "says so at start-up)"),
    Refusal("`layer_spec: te` with `--dhp-comm`",
            lambda a, c: c.layer_spec == "te" and a.dhp_comm,
            "--dhp-comm {value} with layer_spec te",
            "`--dhp-comm` chooses the CP variant of layer_spec `local`",
            "set `--cp-comm-type p2p` or `all_gather` instead"),
)


def refusals(args: argparse.Namespace, config: DhpConfig, rules: tuple[Refusal, ...] = REFUSALS) -> list[str]:
    """The message of every rule of `rules` (Megatron-LM's table; the Bridge integration passes its own) this run
    breaks, in table order."""
    return [m for rule in rules if (m := rule.message(args, config)) is not None]
