"""Megatron-LM command-line flags of megatron-dhp, and the checks that run right after Megatron's own.

`add_dhp_args` adds one argument group in the style of Megatron's `_add_*_args`. The `--dhp-*` flags
override the same keys of the `--dhp-config` YAML; `dhp_config_from_args` merges them into the one
`DhpConfig` the run uses. `validate_dhp_args` rejects, before anything is built, every flag combination
that cannot work with dynamic groups, each with a message that names the flag and the fix.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_dhp.config_io import to_mapping
from megatron_dhp.cost import CostConfig
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.runtime.attention import COMM_VARIANTS

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# flag attribute -> DhpConfig field it overrides
_OVERRIDES = {
    "dhp_planner": "planner",
    "dhp_max_tokens_per_rank": "max_tokens_per_rank",
    "dhp_comm": "comm",
    "dhp_cost": "cost",
    "dhp_log_plans": "log_plans",
}

# TransformerEngine's CP variants that take THD (packed) input
_TE_THD_COMM_TYPES = ("p2p", "all_gather")


def add_dhp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron-dhp argument group; returns the parser, as Megatron's extra_args_provider must."""
    group = parser.add_argument_group(title="dynamic hybrid parallelism (megatron-dhp)")
    group.add_argument("--dhp", action="store_true",
                       help="Form context-parallel groups of any size every step from the DP x CP ranks "
                       "(keep --context-parallel-size 1; needs --calculate-per-token-loss).")
    group.add_argument("--dhp-config", type=str, default=None, metavar="YAML",
                       help="DhpConfig YAML (see configs/*_dhp.yaml); the --dhp-* flags below override its keys.")
    group.add_argument("--dhp-planner", type=str, default=None,
                       help="Planner: dhp (default) or static; more when installed (megatron-dhp simulate lists them).")
    group.add_argument("--dhp-max-tokens-per-rank", type=int, default=None, metavar="M",
                       help="Most tokens one rank holds in a microbatch; a longer sequence gets more ranks.")
    group.add_argument("--dhp-comm", type=str, default=None, choices=tuple(COMM_VARIANTS),
                       help="CP communication of the 'local' layer spec: "
                       + "; ".join(f"{name}: {what}" for name, what in COMM_VARIANTS.items()) + ".")
    group.add_argument("--dhp-cost", type=str, default=None, metavar="YAML",
                       help="Cost model: a YAML written by megatron-dhp profile, or a preset name from configs/.")
    group.add_argument("--dhp-log-plans", action="store_true", default=None,
                       help="Log each step's plan in one line.")
    return parser


def with_dhp_args(other: ArgsProvider | None = None) -> ArgsProvider:
    """An extra_args_provider that adds the megatron-dhp flags after `other`'s (e.g. ModelOpt's)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_dhp_args(other(parser) if other is not None else parser)

    return provider


def dhp_config_from_args(args: argparse.Namespace) -> DhpConfig:
    """The `--dhp-config` YAML (or the defaults) with the `--dhp-*` flags applied, validated."""
    base = DhpConfig.load(args.dhp_config) if args.dhp_config else DhpConfig()
    flags = {field: getattr(args, attr) for attr, field in _OVERRIDES.items() if getattr(args, attr) is not None}
    if not flags:
        return base
    return DhpConfig.from_dict({**to_mapping(base), **flags}, source="--dhp flags")


def validate_dhp_args(args: argparse.Namespace) -> DhpConfig | None:
    """Check the parsed Megatron arguments for DHP; returns the run's `DhpConfig` (None without --dhp).

    Call it after Megatron's own `validate_args`, which fills in the derived sizes read here.
    """
    if not args.dhp:
        given = [f"--{a.replace('_', '-')}" for a in ("dhp_config", *_OVERRIDES) if getattr(args, a) is not None]
        if given:
            raise DhpError(f"{', '.join(given)} given without --dhp; add --dhp to train with dynamic hybrid parallelism")
        return None
    config = dhp_config_from_args(args)
    CostConfig.load(config.cost)  # a missing or malformed cost YAML fails now, not at the first step
    problems = _conflicts(args, config)
    if problems:
        raise DhpError("; ".join(problems))
    return config


def _conflicts(args: argparse.Namespace, config: DhpConfig) -> list[str]:
    """Every flag combination that cannot work with --dhp, as messages naming the flag and the fix."""
    problems = []
    if args.context_parallel_size > 1:
        problems.append(f"--context-parallel-size {args.context_parallel_size} with --dhp: megatron-dhp forms the "
                        "context-parallel groups itself every step; set --context-parallel-size 1 (the DP ranks "
                        "become the dynamic domain)")
    if not args.calculate_per_token_loss:
        problems.append("--dhp needs --calculate-per-token-loss: with groups that change every step only a loss "
                        "summed per token and divided by the global token count keeps gradients exact")
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        problems.append(f"interleaved pipelining (virtual pipeline size {vpp}) with --dhp: its schedule needs "
                        "per-chunk slot alignment that megatron-dhp does not implement; drop "
                        "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if getattr(args, "hybrid_context_parallel", False):
        problems.append("--hybrid-context-parallel and --dhp both form dynamic CP groups; drop --hybrid-context-parallel")
    if args.sequence_parallel:
        problems.append("--sequence-parallel with --dhp: a microbatch's token count need not divide by the "
                        "tensor-parallel size, which sequence parallelism requires; drop --sequence-parallel")
    if getattr(args, "num_experts", None):
        problems.append(f"--num-experts {args.num_experts} with --dhp: MoE layers are not supported yet; use a dense model")
    if getattr(args, "mtp_num_layers", None):
        problems.append("--mtp-num-layers with --dhp: multi-token prediction is not supported yet; drop it")
    if getattr(args, "multi_latent_attention", False):
        problems.append("--multi-latent-attention with --dhp: only standard self-attention takes dynamic groups")
    if getattr(args, "use_legacy_models", False):
        problems.append("--use-legacy-models with --dhp: only megatron-core models take dynamic groups")
    if args.reset_attention_mask and not args.reset_position_ids:
        problems.append("--reset-attention-mask with --dhp needs --reset-position-ids: megatron-dhp trains each "
                        "document as its own sequence (positions from 0) and finds documents where positions restart")
    if getattr(args, "iterations_to_skip", None):
        problems.append("--iterations-to-skip with --dhp: skipped iterations read the loader outside the "
                        "megatron-dhp schedule; remove the skip list")
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        problems.append(f"--cuda-graph-impl {args.cuda_graph_impl} with --dhp: every step has other shapes and "
                        "groups, which a captured graph cannot follow; use --cuda-graph-impl none")
    if config.overlap_planning and args.rampup_batch_size:
        problems.append("--rampup-batch-size with overlap_planning: the step planned ahead would have the "
                        "wrong size; set overlap_planning: false in the --dhp-config YAML")
    problems += _layer_spec_conflicts(args, config)
    return problems


def _layer_spec_conflicts(args: argparse.Namespace, config: DhpConfig) -> list[str]:
    problems = []
    if str(getattr(args, "attention_backend", "")).endswith("local"):
        problems.append("--attention-backend local with --dhp: it replaces the core attention megatron-dhp puts in "
                        "the layer spec; leave --attention-backend at its default (auto)")
    if config.layer_spec == "local":
        if args.attention_dropout:
            problems.append(f"--attention-dropout {args.attention_dropout} with layer_spec local: megatron-dhp's "
                            "attention has no dropout; set --attention-dropout 0")
        return problems
    if args.transformer_impl != "transformer_engine":
        problems.append(f"layer_spec te needs --transformer-impl transformer_engine (got {args.transformer_impl}); "
                        "or set layer_spec: local")
    comm_types = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    bad = sorted({c for c in comm_types if c not in _TE_THD_COMM_TYPES})
    if bad:
        problems.append(f"--cp-comm-type {' '.join(bad)} with layer_spec te: TransformerEngine runs packed (THD) "
                        f"sequences with {' or '.join(_TE_THD_COMM_TYPES)} only")
    if args.dhp_comm is not None:
        problems.append("--dhp-comm chooses the CP variant of layer_spec local; with layer_spec te set "
                        "--cp-comm-type p2p or all_gather instead")
    return problems
