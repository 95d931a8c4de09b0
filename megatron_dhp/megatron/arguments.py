"""Megatron-LM command-line flags of megatron-dhp, and the checks that run right after Megatron's own.

`add_dhp_args` adds one argument group in the style of Megatron's `_add_*_args`. The `--dhp-*` flags
override the same keys of the `--dhp-config` YAML; `dhp_config_from_args` merges them into the one
`DhpConfig` the run uses. `validate_dhp_args` rejects, before anything is built, every flag combination
of the `refusals.REFUSALS` table, each in one line that names the flag and the nearest supported setting;
`refuse_or_config` is its Megatron-LM entry, which prints them once and exits instead of raising, as the
hooks do with any `DhpError` at start-up (`exits_on_dhp_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from megatron_dhp.config_io import field_docs, to_mapping
from megatron_dhp.cost import CostConfig
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.megatron.refusals import refusals
from megatron_dhp.presets import resolve_preset

logger = logging.getLogger(__name__)

# torchrun stops every rank within 0.1 s of the first one's exit: the silent ranks wait that long and more, so
# that rank 0 has printed before the job is stopped
_SILENT_RANK_EXIT_DELAY_S = 3.0

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

_REPEATED = {"slow_ranks": "slow_rank"}
"""DhpConfig fields given by a repeatable flag, one value each time, named in the singular."""
_METAVARS = {"max_tokens_per_rank": "M", "max_groups_per_rank": "K", "cost": "YAML|PRESET", "slow_ranks": "RANK:FACTOR",
             "rank_speeds": "SPEED", "node_speeds": "SPEED"}


def _flag_dest(field: str) -> str:
    """The argparse attribute of the flag that overrides DhpConfig `field`."""
    return "dhp_" + _REPEATED.get(field, field)


def dhp_flag(field: str) -> str:
    """The Megatron-LM flag of DhpConfig key `field` (`--dhp-max-tokens-per-rank` for max_tokens_per_rank)."""
    return "--" + _flag_dest(field).replace("_", "-")


def add_dhp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron-dhp argument group; returns the parser, as Megatron's extra_args_provider must.

    Every `DhpConfig` key is a flag `--dhp-<key>`, generated from the dataclass (type, choices, the field's
    docstring as help) as Megatron-LM's own `ArgumentGroupFactory` does for its configs. Unlike Megatron's, every
    default is None: a flag overrides the `--dhp-config` YAML only when given.
    """
    group = parser.add_argument_group(title="dynamic hybrid parallelism (megatron-dhp)")
    group.add_argument("--dhp", action="store_true",
                       help="Form context-parallel groups of any size every step from the DP x CP ranks "
                       "(keep --context-parallel-size 1; needs --calculate-per-token-loss).")
    group.add_argument("--dhp-config", type=str, default=None, metavar="YAML|PRESET",
                       help="DhpConfig YAML, or a preset name of configs/ (e.g. llama3_8b_dhp); the --dhp-* flags "
                       "below override its keys.")
    docs = field_docs(DhpConfig)
    hints = typing.get_type_hints(DhpConfig)
    for f in dataclasses.fields(DhpConfig):
        group.add_argument(dhp_flag(f.name), dest=_flag_dest(f.name), default=None, help=docs[f.name],
                           **_flag_kwargs(f.name, hints[f.name]))
    return parser


def _flag_kwargs(field: str, hint: object) -> dict:
    """argparse's type, action, choices and metavar for a DhpConfig field of type `hint`."""
    if isinstance(hint, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    kind, kwargs = hint, {}
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: several values
        kind = typing.get_args(hint)[0]
        kwargs = {"action": "append"} if field in _REPEATED else {"nargs": "+"}
    if field in DhpConfig.CHOICES:
        return {**kwargs, "type": kind, "choices": DhpConfig.CHOICES[field]}
    return {**kwargs, "type": kind, "metavar": _METAVARS.get(field, {int: "N", float: "X"}.get(kind, "NAME"))}


def with_dhp_args(other: ArgsProvider | None = None) -> ArgsProvider:
    """An extra_args_provider that adds the megatron-dhp flags after `other`'s (e.g. ModelOpt's); `other` itself
    where it adds them already (a script that passes `with_dhp_args` to a hooked `parse_args`)."""
    if getattr(other, "adds_dhp_args", False):
        return other

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_dhp_args(other(parser) if other is not None else parser)

    provider.adds_dhp_args = True
    return provider


def dhp_config_from_args(args: argparse.Namespace) -> DhpConfig:
    """The `--dhp-config` YAML (or the defaults) with the `--dhp-*` flags applied, validated."""
    base = _base_config(args)
    flags = {f.name: getattr(args, _flag_dest(f.name), None) for f in dataclasses.fields(DhpConfig)}
    flags = {name: tuple(v) if isinstance(v, list) else v for name, v in flags.items() if v is not None}
    if not flags:
        return base
    return DhpConfig.from_dict({**to_mapping(base), **flags}, source="--dhp flags")


def _base_config(args: argparse.Namespace) -> DhpConfig:
    """The `--dhp-config` YAML (or the defaults), before the `--dhp-*` flags."""
    given = args.dhp_config  # a DhpConfig in place of the path: a caller that holds one (the Bridge integration)
    if isinstance(given, DhpConfig):
        return given
    return DhpConfig.load(resolve_preset(given, what="dhp config")) if given else DhpConfig()


def validate_dhp_args(args: argparse.Namespace) -> DhpConfig | None:
    """Check the parsed Megatron arguments for DHP; returns the run's `DhpConfig` (None without --dhp).

    Call it after Megatron's own `validate_args`, which fills in the derived sizes read here.
    """
    if not args.dhp:
        dests = ["dhp_config", *(_flag_dest(f.name) for f in dataclasses.fields(DhpConfig))]
        given = [f"--{a.replace('_', '-')}" for a in dests if getattr(args, a, None) is not None]
        if given:
            raise DhpError(f"{', '.join(given)} given without --dhp; add --dhp to train with dynamic hybrid parallelism")
        return None
    try:
        config = dhp_config_from_args(args)
    except DhpError as e:  # with the run's other refusals (judged without the flags): one try names every problem
        try:
            others = refusals(args, _base_config(args))
        except DhpError:  # the YAML itself: its error is the news
            others = []
        raise DhpError("\n".join([str(e), *others])) from None
    CostConfig.load(config.cost_name)  # a missing or malformed cost YAML fails now, not at the first step
    problems = refusals(args, config)
    if problems:
        raise DhpError("\n".join(problems))
    if getattr(args, "distributed_backend", "nccl") == "nccl":
        import torch

        from megatron_dhp.runtime.distributed import gpu_environment

        if torch.cuda.is_available():
            gpu_environment()  # before Megatron-LM initialises NCCL (which caches its variables) and CUDA's allocator
    return config


@contextmanager
def exits_on_dhp_error() -> Iterator[None]:
    """A `DhpError` raised inside (e.g. by the Megatron-LM hooks at start-up) becomes each of its lines on rank
    0, then exit 2 on every rank; also a decorator.

    Such an error is the user's to fix, not a crash: every rank raising would print one traceback per rank and
    hide the message under them.
    """
    try:
        yield
    except DhpError as e:
        if _rank() == 0:
            sys.stderr.writelines(f"megatron-dhp: {line}\n" for line in str(e).splitlines())
            sys.stderr.flush()
        else:
            time.sleep(_SILENT_RANK_EXIT_DELAY_S)
        raise SystemExit(2) from None


@exits_on_dhp_error()
def refuse_or_config(args: argparse.Namespace) -> DhpConfig | None:
    """`validate_dhp_args` for a Megatron-LM run: each problem one line on rank 0, then exit 2 on every rank.
    A run with multi-token prediction has its MTP blocks built with dynamic-CP attention from here on."""
    config = validate_dhp_args(args)
    if config is not None:
        drop_loader_attention_mask(args)
        route_mtp_blocks(args, config)
    return config


def drop_loader_attention_mask(args: argparse.Namespace) -> None:
    """Have Megatron's loader build no attention mask, in one line on rank 0 when it would have.

    megatron-dhp never reads it (documents come from the position ids), and the loader's mask is a dense
    S x S fp32 tensor per row: 64 GiB at --seq-length 131072, the lengths where dhp gains.
    """
    if getattr(args, "create_attention_mask_in_dataloader", False):
        args.create_attention_mask_in_dataloader = False
        if _rank() == 0:
            mib = 4 * args.seq_length ** 2 / 2 ** 20
            logger.warning("megatron-dhp: --no-create-attention-mask-in-dataloader set: the loader's %d x %d mask "
                           "(%s MiB a row) is never read under --dhp", args.seq_length, args.seq_length, f"{mib:,.0f}")


def route_mtp_blocks(args: argparse.Namespace, config: DhpConfig) -> None:
    """With multi-token prediction, build the MTP blocks with dynamic-CP attention from here on (Megatron-LM's
    builders make them from a spec of their own, which the layer-spec hook never sees). Before the model."""
    if getattr(args, "mtp_num_layers", None):
        from megatron_dhp.runtime.layer_spec import dynamic_mtp_blocks

        dynamic_mtp_blocks(config.layer_spec)


def _rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else torchrun's RANK."""
    dist = sys.modules.get("torch.distributed")  # never imported: no process group to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
