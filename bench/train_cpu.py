"""Static CP against DHP in real training on this machine: wall time, and predicted vs measured step time.

Trains configs/demo_cpu.yaml (or --config) under each planner on the same batches from the same weights.
By default the runs are interleaved inside one job (each rank holds one trainer per planner and steps them
in turn), so that both planners see the same load on a shared machine at the same moments; --sequential
runs them one after the other, as `megatron-dhp demo` does. Prints, per planner, the median step time,
tokens/s, the cost model's predicted against the measured forward+backward time, the last loss, and the
static/dhp wall-time ratio; --json writes every step.

Predicted times come from the config's cost model, and (interleaved runs) also from a calibration done in
the same job: a round of `megatron-dhp profile`'s grid after every few steps, fitted at the end, so that the
calibration saw the same machine load as the steps it predicts (on a shared machine, load from other jobs
changes step times by up to 2x from one minute to the next).

    PYTHONPATH=$PWD python bench/train_cpu.py [--steps 60] [--nproc N] [--cost YAML] [--sequential] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from megatron_dhp.training.config import TrainConfig
    from megatron_dhp.training.loop import StepRecord

TARGET = 1.2
"""Issue 5: dhp at least 1.2x faster than static (the baseline) on the long-tailed demo workload."""


def interleaved(config: TrainConfig, planners: tuple[str, ...], every: int) -> dict:
    """One rank: a trainer per planner, stepped in turn, with a calibration round of the profile grid every
    `every` steps; returns each planner's records and plans and the calibration's per-point medians."""
    from megatron_dhp.training.loop import Trainer
    from megatron_dhp.training.profile import GridTimer, data_grid, default_grid

    grid = default_grid(num_ranks=config.train.num_ranks // config.train.tp,
                        max_tokens_per_rank=config.dhp.max_tokens_per_rank) + data_grid(config)
    timer = GridTimer(config, grid)
    timer.round()  # warm-up
    trainers = [Trainer(config.with_overrides(dhp={"planner": p})) for p in planners]
    out = {"records": {p: [] for p in planners}, "plans": {p: [] for p in planners}}
    for k, records in enumerate(zip(*(t.steps() for t in trainers))):
        for planner, trainer, record in zip(planners, trainers, records):
            out["records"][planner].append(record)
            out["plans"][planner].append(trainer.last_plan.to_dict())
        if k % every == 0:
            timer.round()
    out["grid"], out["calibration"] = grid, timer.medians(skip=1)
    return out


def recalibrated(config: TrainConfig, run: dict) -> tuple[dict[str, list[float]], object]:
    """Every step's plan re-simulated under the cost model fitted to the in-run calibration."""
    from megatron_dhp.cost import build_cost_model, simulate
    from megatron_dhp.plan.plan import Plan
    from megatron_dhp.training.profile import fit_report

    report = fit_report(config, run["grid"], run["calibration"], reps=len(run["calibration"]))
    model = build_cost_model(report.cost)
    return {p: [simulate(Plan.from_dict(d), model).step_time_s for d in plans] for p, plans in run["plans"].items()}, report


def sequential(config: TrainConfig, planners: tuple[str, ...]) -> dict[str, list[StepRecord]]:
    """Each planner's whole run, one after the other."""
    from megatron_dhp.training.train import train

    return {p: train(config.with_overrides(dhp={"planner": p}), show=False).records for p in planners}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo_cpu", help="train config (default demo_cpu)")
    parser.add_argument("--steps", type=int, default=60, help="steps per planner (default 60)")
    parser.add_argument("--nproc", type=int, help="ranks (default: the config's, i.e. one per core)")
    parser.add_argument("--cost", help="cost model YAML or preset (default: the config's)")
    parser.add_argument("--planners", default="static,dhp", help="comma-separated, baseline first (default static,dhp)")
    parser.add_argument("--calibrate-every", type=int, default=3, metavar="K",
                        help="interleaved runs: a calibration round every K steps (default 3)")
    parser.add_argument("--sequential", action="store_true", help="one run after the other instead of interleaved")
    parser.add_argument("--json", help="write every step's record here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", module=r"megatron\.")  # import-time notes about TransformerEngine / Apex
    from megatron_dhp.errors import DhpError
    from megatron_dhp.training.config import TrainConfig
    from megatron_dhp.training.job import run_on_ranks
    from megatron_dhp.training.train import steps_within

    planners = tuple(p.strip() for p in args.planners.split(",") if p.strip())
    try:
        config = TrainConfig.load(args.config).with_overrides(train={"steps": args.steps, "nproc": args.nproc},
                                                              dhp={"cost": args.cost})
    except DhpError as e:
        parser.error(str(e))
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    mode = "sequential" if args.sequential else "interleaved"
    console.print(f"{mode} runs of {', '.join(planners)}: {args.steps} steps on {config.train.num_ranks} ranks, "
                  f"{args.config}, cost {config.dhp.cost}")
    start = time.perf_counter()
    in_run = None
    if args.sequential:
        runs = sequential(config, planners)
    else:
        run = run_on_ranks(interleaved, config, planners, args.calibrate_every)
        runs = run["records"]
        in_run, report = recalibrated(config, run)
        errors = [abs(e) for e in report.errors]
        console.print(f"in-run calibration: {len(run['grid'])} grid points x {args.steps // args.calibrate_every + 1} "
                      f"rounds, fit error median {100 * statistics.median(errors):.1f}% max {100 * max(errors):.1f}%")
    elapsed = time.perf_counter() - start

    table = Table(title=f"{mode}, {args.steps} steps per planner, {config.train.num_ranks} ranks ({elapsed:.0f} s in all)")
    columns = ["planner", "step median", "step total", "tokens/s", "fwd+bwd meas", f"pred ({config.dhp.cost})",
               "within 15%"]
    if in_run:
        columns += ["pred (in-run fit)", "within 15%"]
    for col in columns + ["last loss"]:
        table.add_column(col, justify="right")
    summary: dict = {}
    for name, records in runs.items():
        pred = [r.predicted_s for r in records]
        summary[name] = {
            "step_median_s": statistics.median(r.wall_s for r in records),
            "step_total_s": sum(r.wall_s for r in records),
            "pred_over_meas_median": statistics.median(p / r.measured_s for p, r in zip(pred, records)),
            "within_15pct": steps_within(pred, records),
            "last_loss": records[-1].loss,
        }
        row = [name, f"{summary[name]['step_median_s']:.3f}s", f"{summary[name]['step_total_s']:.1f}s",
               f"{statistics.median(r.tokens_per_s for r in records):,.0f}",
               f"{statistics.median(r.measured_s for r in records):.3f}s",
               f"{statistics.median(pred):.3f}s", f"{steps_within(pred, records)}/{len(records)}"]
        if in_run:
            fitted = in_run[name]
            summary[name]["in_run_pred_over_meas_median"] = statistics.median(p / r.measured_s for p, r in zip(fitted, records))
            summary[name]["in_run_within_15pct"] = steps_within(fitted, records)
            row += [f"{statistics.median(fitted):.3f}s", f"{steps_within(fitted, records)}/{len(records)}"]
        table.add_row(*row, f"{records[-1].loss:.6f}")
    console.print(table)
    base = planners[0]
    for name in planners[1:]:
        paired = statistics.median(a.wall_s / b.wall_s for a, b in zip(runs[base], runs[name]))
        median_ratio = summary[base]["step_median_s"] / summary[name]["step_median_s"]
        total_ratio = summary[base]["step_total_s"] / summary[name]["step_total_s"]
        verdict = f"; {'meets' if median_ratio >= TARGET else 'misses'} the {TARGET}x target" if name == "dhp" else ""
        console.print(f"wall time {base}/{name}: {median_ratio:.2f}x (median step), {total_ratio:.2f}x (total), "
                      f"{paired:.2f}x (median of per-step ratios on the same batch){verdict}")
        summary[f"{base}/{name}"] = {"median": median_ratio, "total": total_ratio, "paired": paired}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "config": config.to_dict(), "summary": summary, "in_run_pred": in_run,
                       "steps": {k: [vars(r) for r in v] for k, v in runs.items()}}, f, indent=1)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
