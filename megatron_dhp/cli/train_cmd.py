"""`megatron-dhp train`: train a megatron-core GPT with dynamic hybrid parallelism from a YAML config.

Spawns `train.nproc` gloo ranks (one compute thread each) unless it already runs under torchrun, where it
is one rank. Rank 0 logs one line per step (loss, tokens, tokens/s, the plan's groups, predicted and
measured forward+backward time, gradient sync and optimizer time) above a progress bar.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from megatron_dhp.errors import DhpRunError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `train`."""
    from megatron_dhp.solver import PLANNERS

    p = sub.add_parser("train", help="train a GPT with per-step dynamic CP groups (spawns ranks or runs under torchrun)",
                       description="Train megatron-core's GPT with the DHP layer spec: each step is planned while "
                                   "the previous one trains, dispatched, run as per-group context parallelism, "
                                   "reduced and stepped by megatron-core's optimizer.")
    add_train_args(p)
    add_pp_arg(p)
    add_straggler_args(p)
    p.add_argument("--planner", choices=sorted(PLANNERS), help="planner (overrides dhp.planner; nothing else changes)")
    p.add_argument("--save", metavar="DIR", help="checkpoint folder (overrides train.save)")
    p.add_argument("--save-interval", type=int, metavar="K", help="save every K steps (overrides train.save_interval)")
    p.add_argument("--load", metavar="DIR", help="resume from the latest checkpoint in DIR; 'auto': from --save's "
                                                 "latest if it has one, else start fresh (overrides train.load)")
    p.add_argument("--keep-checkpoints", type=int, metavar="K",
                   help="checkpoints kept in --save after each save, newest first; 0: all (overrides train.keep_checkpoints)")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="without --load: replace the checkpoints another run left in --save (refused otherwise)")
    p.add_argument("--on-nonfinite", metavar="{stop,skip}",
                   help="a step with a NaN or infinite loss or gradient norm: stop the run (default) or skip the "
                        "update (overrides train.on_nonfinite)")
    p.add_argument("--json", metavar="FILE", help="write every step's record as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-step lines (progress bar and summary only)")
    p.set_defaults(run=run)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """--config and the overrides that `train`, `demo` and `profile` share."""
    p.add_argument("--config", default="demo_cpu", metavar="YAML",
                   help="train config: a YAML path or a name in configs/ (default demo_cpu)")
    p.add_argument("--nproc", type=int, metavar="N", help="ranks to spawn when not under torchrun (overrides train.nproc)")
    p.add_argument("--steps", type=int, metavar="N", help="steps to train (overrides train.steps)")
    p.add_argument("--cost", metavar="YAML", help="cost model: preset name or YAML, e.g. from `megatron-dhp profile` "
                                                  "(overrides dhp.cost)")
    p.add_argument("--oversubscribe", action="store_true", default=None,
                   help="spawn more than twice as many ranks as there are cores (overrides train.oversubscribe)")


def add_pp_arg(p: argparse.ArgumentParser) -> None:
    """--pp and --vpp, which `train` and `demo` take (`profile` times groups without a pipeline)."""
    p.add_argument("--pp", type=int, metavar="P", help="pipeline stages, run by megatron-core's 1F1B; nproc must "
                                                       "be a multiple of tp x P (overrides train.pp)")
    p.add_argument("--vpp", type=int, metavar="V", help="model chunks per pipeline stage, run by megatron-core's "
                                                        "interleaved 1F1B; model.num_layers must be a multiple of "
                                                        "P x V (overrides train.vpp)")


def add_straggler_args(p: argparse.ArgumentParser) -> None:
    """--adaptive / --no-adaptive and --slow-rank, which `train` and `demo` take."""
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="closed-loop planning from measured rank speeds (overrides dhp.adaptive, on by default)")
    p.add_argument("--slow-rank", action="append", metavar="RANK:FACTOR",
                   help="make global rank RANK hold each slot FACTOR times as long (fault injection; repeatable; "
                        "overrides dhp.slow_ranks)")


def straggler_overrides(args: argparse.Namespace) -> dict:
    """The dhp overrides of `add_straggler_args`' flags."""
    return {"adaptive": args.adaptive, "slow_ranks": tuple(args.slow_rank) if args.slow_rank else None}


def quiet_megatron() -> None:
    """Silence megatron-core's import-time notes about missing TransformerEngine / Apex (call before importing it)."""
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")


def console():
    """A rich console for these commands: full-width lines and tables also when stdout is a file or pipe."""
    import sys

    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def load_config(args: argparse.Namespace, **extra: dict):
    """The YAML named by --config with the shared flags (and `extra` per-section overrides) applied."""
    from megatron_dhp.training.config import TrainConfig

    config = TrainConfig.load(args.config)
    train = {"nproc": args.nproc, "steps": args.steps, "oversubscribe": args.oversubscribe, **extra.pop("train", {})}
    dhp = {"cost": args.cost, **extra.pop("dhp", {})}
    return config.with_overrides(train=train, dhp=dhp, **extra)


def write_report(path: str, config, result, *, error: str = "") -> None:
    """--json: the config, every step's record, and the error that stopped the run, if one did."""
    with open(path, "w") as f:
        json.dump({"config": config.to_dict(), "result": result.to_dict(), **({"error": error} if error else {})},
                  f, indent=1)
    n = len(result.records)
    console().print(f"wrote {path}" + (f" ({n} step{'s' * (n != 1)} before the error)" if error else ""))


def run(args: argparse.Namespace) -> int:
    """Check the output path, load and override the config, train, print the summary."""
    from megatron_dhp.files import check_writable

    if args.json:
        check_writable(args.json, flag="--json")
    quiet_megatron()
    from megatron_dhp.training.train import train

    config = load_config(args, train={"save": args.save, "save_interval": args.save_interval, "load": args.load,
                                      "pp": args.pp, "vpp": args.vpp, "keep_checkpoints": args.keep_checkpoints,
                                      "overwrite": args.overwrite, "on_nonfinite": args.on_nonfinite},
                         dhp={"planner": args.planner, **straggler_overrides(args)})
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        result = train(config, show=True, lines=not args.quiet)
    except DhpRunError as e:  # the steps that ran are recorded beside the error (the CLI prints it)
        if args.json and rank0:
            write_report(args.json, config, e.partial, error=str(e))
        raise
    if not rank0:
        return 0
    out = console()
    for line in result.summary_lines():
        out.print(line)
    if args.json:
        write_report(args.json, config, result)
    if result.stopped_by:  # a scheduler's SIGTERM: the status a signal's exit has, after the checkpoint
        return 128 + signal.Signals[result.stopped_by]
    if result.records and result.records[-1].skipped:  # its last update was dropped: not a finished run
        print(f"megatron-dhp train: the run ended on step {result.records[-1].step}, skipped (non-finite "
              f"{result.records[-1].skipped}); its update was dropped. Lower train.lr", file=sys.stderr)
        return 1
    return 0
