"""`megatron-dhp profile`: calibrate the cost model on this device and write a `kind: profiled` YAML.

Times the configured model's forward+backward over a grid of lengths and group sizes (and microbatches
packed from the config's data) on the job's own ranks, fits the reference form by least squares, prints
measured, fitted and error per point, sets the step overhead from a few real steps trained between the
grid's rounds (printing their predicted vs measured time), and writes a YAML that `train --cost`,
`plan --cost` and `simulate --cost` accept.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megatron_dhp.cli.train_cmd import add_train_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `profile`."""
    p = sub.add_parser("profile", help="time the model on this device and fit a profiled cost model",
                       description="Time forward+backward of single microbatches over lengths x group sizes "
                                   "on the configured ranks, fit the cost model by least squares (error per "
                                   "point) and write a kind: profiled YAML.")
    add_train_args(p)
    p.add_argument("--lengths", metavar="L,L,...",
                   help="sample lengths of the grid (default: powers of two from 64 to the domain's capacity)")
    p.add_argument("--data-points", type=int, default=4, metavar="K",
                   help="also K microbatches per group size packed from the config's data, mixed lengths as "
                        "training runs them (default 4; 0 for the uniform grid only)")
    p.add_argument("--calibration-steps", type=int, default=16, metavar="K",
                   help="between the grid's rounds, train K real steps under static and under the config's "
                        "planner; the step overhead is the median gap between their measured and fitted time "
                        "(all but the first 2 steps), each printed (default 16; 0 skips them)")
    p.add_argument("--reps", type=int, default=5, metavar="R", help="timed repetitions per point, median kept (default 5)")
    p.add_argument("--out", default="profiled_cost.yaml", metavar="YAML", help="where to write the cost model")
    p.add_argument("--tp", type=int, metavar="T", help="tensor-parallel size the ranks profile at; the domain is "
                                                       "their positions (overrides train.tp)")
    p.add_argument("--tp-from", metavar="YAML",
                   help="with --tp > 1: this job's profile at TP 1 (same model and device); fit the tensor-parallel "
                        "efficiency and collectives from the two and write them into a copy of it (--tp-out), "
                        "the one-GPU form that prices TP layouts (docs/cost-model.md#tensor-parallelism)")
    p.add_argument("--tp-out", default="profiled_cost_tp.yaml", metavar="YAML",
                   help="where --tp-from writes the one-GPU config with the fitted TP terms")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the output paths, profile, fit, print the table, write the YAML."""
    from megatron_dhp.cli.train_cmd import console as make_console
    from megatron_dhp.cli.train_cmd import quiet_megatron
    from megatron_dhp.files import check_writable

    check_writable(args.out, flag="--out")
    if args.tp_from is not None:
        check_writable(args.tp_out, flag="--tp-out")
    quiet_megatron()
    import os

    from rich.table import Table

    from megatron_dhp.cost.fit import default_grid
    from megatron_dhp.errors import DhpError
    from megatron_dhp.training.profile import profile
    from megatron_dhp.training.timing import data_grid

    config = load_profile_config(args)
    if args.reps < 1:
        raise DhpError(f"--reps {args.reps} must be at least 1")
    for flag, value in (("--data-points", args.data_points), ("--calibration-steps", args.calibration_steps)):
        if value < 0:
            raise DhpError(f"{flag} {value} must be 0 or more")
    one_gpu = _tp_baseline(args, config)
    lengths = _parse_lengths(args.lengths)
    ranks = config.train.num_ranks // config.train.tp
    grid = default_grid(num_ranks=ranks, max_tokens_per_rank=config.dhp.max_tokens_per_rank, lengths=lengths)
    if not grid:
        raise DhpError(f"no grid point fits {ranks} ranks of {config.dhp.max_tokens_per_rank} tokens; "
                       "give shorter --lengths")
    grid += data_grid(config, per_size=args.data_points)
    report = profile(config, grid=grid, reps=args.reps, steps=args.calibration_steps)
    if os.environ.get("RANK", "0") != "0":
        return 0
    console = make_console()
    table = Table(title=f"forward+backward of one microbatch, median of {args.reps} ({ranks} ranks)")
    for col in ("samples x tokens", "group size", "measured ms", "fitted ms", "error"):
        table.add_column(col, justify="right")
    for point, measured, fitted, error in zip(report.grid, report.measured, report.fitted, report.errors):
        table.add_row(point.describe(), str(point.group_size), f"{measured * 1e3:.1f}",
                      f"{fitted * 1e3:.1f}", f"{100 * error:+.1f}%")
    console.print(table)
    c = report.cost
    errors = [abs(e) for e in report.errors]
    console.print(f"a {c.attn_s_per_token2:.3e} s/token^2 | b {c.linear_s_per_token:.3e} s/token | m "
                  f"{c.microbatch_overhead_s * 1e3:.2f} ms | s {c.sample_overhead_s * 1e3:.2f} ms | lambda "
                  f"{c.cp_microbatch_overhead_s * 1e3:.2f} ms | "
                  f"gamma/bw {c.comm_bytes_per_token / c.intra_node_bytes_per_s:.3e} s/token")
    console.print(f"fit error: median {100 * sorted(errors)[len(errors) // 2]:.1f}%, max {100 * max(errors):.1f}% "
                  f"over {len(errors)} points")
    if report.steps:
        console.print(report.calibration_summary() + ":")
        for planner, step, predicted, measured in report.steps:
            console.print(f"  {planner} step {step}: pred {predicted:.3f}s meas {measured:.3f}s "
                          f"({100 * (predicted / measured - 1):+.1f}%)")
    c.save(args.out)
    console.print(f"wrote {args.out}; use it with `megatron-dhp train --cost {args.out}` (or plan / simulate --cost)")
    if one_gpu is not None:
        from megatron_dhp.cost.tensor_parallel import fit_tensor_parallel

        t = config.train.tp
        fitted = replace(fit_tensor_parallel(one_gpu, c, t), attention_heads=config.model.num_attention_heads)
        console.print(f"TP {t} against {args.tp_from}: speed-up {one_gpu.attn_s_per_token2 / c.attn_s_per_token2:.2f}x "
                      f"on attention -> tp_efficiency {fitted.tp_efficiency:.3f}; linear {c.linear_s_per_token:.3e} "
                      f"s/token vs {one_gpu.linear_s_per_token:.3e} at TP 1 -> tp_comm_bytes_per_token "
                      f"{fitted.tp_comm_bytes_per_token:.4g}")
        fitted.save(args.tp_out)
        console.print(f"wrote {args.tp_out}: the TP 1 profile with these terms (set tensor_parallel: {t} in it to price "
                      "positions of that TP)")
    return 0


def _tp_baseline(args: argparse.Namespace, config):
    """The TP 1 profile `--tp-from` names (None without it), checked against this job before any timing."""
    from megatron_dhp.cost import CostConfig
    from megatron_dhp.errors import DhpError

    if args.tp_from is None:
        return None
    if config.train.tp < 2:
        raise DhpError(f"--tp-from needs this job at tensor parallelism >= 2 (train.tp = {config.train.tp}): "
                       "profile once at --tp 1, then at --tp t with --tp-from the first profile")
    one = CostConfig.load(args.tp_from)
    if one.kind != "profiled" or one.tensor_parallel != 1:
        raise DhpError(f"--tp-from {args.tp_from!r} must be a profile written by `megatron-dhp profile` at TP 1 "
                       f"(kind profiled, tensor_parallel 1; it has kind {one.kind}, tensor_parallel {one.tensor_parallel})")
    return one


def load_profile_config(args: argparse.Namespace):
    """The train config with the shared flags applied (`--steps` is meaningless here and ignored)."""
    from megatron_dhp.cli.train_cmd import load_config

    args.steps = None
    return load_config(args, train={"tp": getattr(args, "tp", None)})


def _parse_lengths(text: str | None) -> tuple[int, ...]:
    from megatron_dhp.errors import DhpError

    if not text:
        return ()
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DhpError(f"--lengths {text!r} must be comma-separated integers, e.g. 64,256,1024") from None
    if not lengths or min(lengths) < 1:
        raise DhpError(f"--lengths {text!r} must hold positive integers")
    return lengths
