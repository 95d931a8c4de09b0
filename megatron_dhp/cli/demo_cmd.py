"""`megatron-dhp demo`: train the tiny GPT with static CP, then with DHP, on the same batches, and compare.

The README's main job. Spawns as many gloo ranks as the machine has cores (at least 2, one compute thread
each), trains `configs/demo_cpu.yaml` under each planner, and ends with a table: median step time, the
speed-up, the loss at the last step of each run, and where the plot of one step's plans was written.
`--config mllm_demo_cpu` runs the same comparison on a vision-language model and multimodal batches.
"""

from __future__ import annotations

import argparse

from megatron_dhp.cli.train_cmd import add_pp_arg, add_straggler_args, add_train_args, straggler_overrides


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `demo`."""
    p = sub.add_parser("demo", help="train the tiny GPT with static CP, then DHP, and compare (a few minutes on CPU)",
                       description="Train the tiny GPT of configs/demo_cpu.yaml first with Megatron's static CP "
                                   "planner, then with DHP, on the same batches and weights, and print step "
                                   "time, speed-up and final loss side by side. --config mllm_demo_cpu does the "
                                   "same for an InternVL-shaped vision-language model on multimodal batches.")
    add_train_args(p)
    add_pp_arg(p)
    add_straggler_args(p)
    p.add_argument("--planners", default="static,dhp", metavar="A,B",
                   help="planners to compare, the first is the baseline (default static,dhp)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="profile this machine first and plan with the fitted cost model, so that predicted "
                        "step times are this machine's (default; adds under a minute); --no-calibrate uses "
                        "the config's cost model (needed with --pp > 1)")
    p.add_argument("--out", default="demo_out", metavar="DIR", help="folder for the plot and JSON (default demo_out)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines (progress bars and the table only)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the output folder, run every planner, then print the comparison."""
    from megatron_dhp.cli.train_cmd import console as make_console
    from megatron_dhp.cli.train_cmd import quiet_megatron
    from megatron_dhp.files import check_writable

    out = check_writable(args.out, flag="--out", folder=True)
    quiet_megatron()
    import json
    import os

    from rich.table import Table

    from megatron_dhp.cli.train_cmd import load_config
    from megatron_dhp.errors import DhpError
    from megatron_dhp.solver import PLANNERS
    from megatron_dhp.training.demo import run_demo, save_plan_plot

    planners = tuple(p.strip() for p in args.planners.split(",") if p.strip())
    unknown = [p for p in planners if p not in PLANNERS]
    if len(planners) < 2 or unknown:
        raise DhpError(f"--planners {args.planners!r}: give at least two of {', '.join(PLANNERS)}")
    config = load_config(args, train={"pp": args.pp, "vpp": args.vpp}, dhp=straggler_overrides(args))
    console = make_console()
    if args.calibrate:
        from megatron_dhp.training.profile import profile

        console.print("calibrating the cost model on this machine ...")
        report = profile(config)
        report.cost.save(out / "profiled_cost.yaml")
        errors = [abs(e) for e in report.errors]
        console.print(f"fitted {len(errors)} points (max error {100 * max(errors):.1f}%); "
                      f"{report.calibration_summary()}; wrote {out / 'profiled_cost.yaml'}")
        config = config.with_overrides(dhp={"cost": str(out / "profiled_cost.yaml")})
    result = run_demo(config, planners, lines=not args.quiet)
    if os.environ.get("RANK", "0") != "0":
        return 0

    base, *others = planners
    first = result.runs[base]
    table = Table(title=f"{first.world_size} ranks, {len(first.records)} steps, same batches and weights "
                        f"(static CP for this data: {first.static_cp})")
    for col in ("planner", "step time median", "speed-up", "tokens/s", "fwd+bwd pred / meas", "pred within 15%",
                "loss at last step"):
        table.add_column(col, justify="right")
    for name, run_ in result.runs.items():
        records = run_.records
        speedup = "1.00x (baseline)" if name == base else f"{result.speedup(base, name):.2f}x"
        pred = sorted(r.predicted_s for r in records)[len(records) // 2]
        meas = sorted(r.measured_s for r in records)[len(records) // 2]
        table.add_row(name, f"{run_.median_step_s:.3f}s", speedup,
                      f"{sorted(r.tokens_per_s for r in records)[len(records) // 2]:,.0f}",
                      f"{pred:.3f}s / {meas:.3f}s", f"{run_.steps_within()}/{len(records)} steps", f"{records[-1].loss:.6f}")
    console.print(table)
    for name in others:
        a, b = first.records[-1].loss, result.runs[name].records[-1].loss
        console.print(f"{name} vs {base}: speed-up {result.speedup(base, name):.2f}x (median of per-step ratios "
                      f"{result.paired_speedup(base, name):.2f}x); last-step loss differs by {abs(a - b) / abs(a):.1e} "
                      "(relative)")
    plot = out / "plan.png"
    step = save_plan_plot(result, plot)
    with open(out / "demo.json", "w") as f:
        json.dump({"config": config.to_dict(), "runs": {k: v.to_dict() for k, v in result.runs.items()}}, f, indent=1)
    console.print(f"plan of step {step} under each planner: {plot}; every step's record: {out / 'demo.json'}")
    return 0
