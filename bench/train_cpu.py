"""Static CP against DHP in real training on this machine: wall time, and predicted vs measured step time.

Trains configs/demo_cpu.yaml (or --config) under each planner on the same batches from the same weights.
First it calibrates the cost model on this machine (`megatron-dhp profile`: the grid, the fit, and the step
overhead from a few real steps), as `megatron-dhp demo` does, and every run plans and predicts with that
model (--cost YAML or --no-calibrate use a given one instead). By default the runs are interleaved inside one
job (each rank holds one trainer per planner and steps them in turn), so that the planners see the same load
on a shared machine at the same moments; --sequential runs them one after the other, as the demo does.
Prints, per planner, the median step time, tokens/s, the predicted against the measured forward+backward
time (steps within 15 %), the last loss, and the static/dhp wall-time ratio; --json writes every step's
record and plan.

    PYTHONPATH=$PWD python bench/train_cpu.py [--steps 60] [--nproc N] [--planners A,B,...] [--sequential]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from megatron_dhp.training.config import TrainConfig
    from megatron_dhp.training.loop import StepRecord

TARGET = 1.2
"""The target: dhp at least 1.2x faster than static (the baseline) on the long-tailed demo workload."""


def interleaved(config: TrainConfig, planners: tuple[str, ...]) -> tuple[dict[str, list[StepRecord]], dict[str, list[dict]]]:
    """One rank: a trainer per planner, stepped in turn; returns each planner's records and plans."""
    from megatron_dhp.training.loop import Trainer

    trainers = [Trainer(config.with_overrides(dhp={"planner": p})) for p in planners]
    records: dict[str, list[StepRecord]] = {p: [] for p in planners}
    plans: dict[str, list[dict]] = {p: [] for p in planners}
    for step in zip(*(t.steps() for t in trainers)):  # one record per planner, in turn
        for p, trainer, record in zip(planners, trainers, step):
            records[p].append(record)
            plans[p].append(trainer.last_plan.to_dict())
    return records, plans


def sequential(config: TrainConfig, planners: tuple[str, ...]) -> tuple[dict[str, list[StepRecord]], dict[str, list[dict]]]:
    """Each planner's whole run, one after the other; records and plans as `interleaved`."""
    from megatron_dhp.training.train import train

    results = {p: train(config.with_overrides(dhp={"planner": p}), show=False) for p in planners}
    return {p: r.records for p, r in results.items()}, {p: r.plans for p, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo_cpu", help="train config (default demo_cpu)")
    parser.add_argument("--steps", type=int, default=60, help="steps per planner (default 60)")
    parser.add_argument("--nproc", type=int, help="ranks (default: the config's, i.e. one per core)")
    parser.add_argument("--cost", help="cost model YAML or preset to use instead of calibrating first")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="profile this machine first (default); --no-calibrate uses the config's cost model")
    parser.add_argument("--planners", default="static,dhp", help="comma-separated, baseline first (default static,dhp)")
    parser.add_argument("--sequential", action="store_true", help="one run after the other instead of interleaved")
    parser.add_argument("--json", help="write every step's record and plan here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", module=r"megatron\.")  # import-time notes about TransformerEngine / Apex
    from megatron_dhp.errors import DhpError
    from megatron_dhp.training.config import TrainConfig
    from megatron_dhp.training.job import run_on_ranks
    from megatron_dhp.training.profile import profile
    from megatron_dhp.training.train import steps_within

    planners = tuple(p.strip() for p in args.planners.split(",") if p.strip())
    try:
        config = TrainConfig.load(args.config).with_overrides(train={"steps": args.steps, "nproc": args.nproc},
                                                              dhp={"cost": args.cost})
    except DhpError as e:
        parser.error(str(e))
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    start = time.perf_counter()
    if args.calibrate and not args.cost:
        report = profile(config)
        path = Path(tempfile.mkdtemp(prefix="train_cpu_")) / "profiled_cost.yaml"
        report.cost.save(path)
        console.print(f"calibrated in {time.perf_counter() - start:.0f} s on {len(report.grid)} grid points: "
                      f"{report.calibration_summary()}; {path}")
        config = config.with_overrides(dhp={"cost": str(path)})
    mode = "sequential" if args.sequential else "interleaved"
    console.print(f"{mode} runs of {', '.join(planners)}: {args.steps} steps on {config.train.num_ranks} ranks, "
                  f"{args.config}, cost {config.dhp.cost}")
    runs, plans = sequential(config, planners) if args.sequential else run_on_ranks(interleaved, config, planners)
    elapsed = time.perf_counter() - start

    table = Table(title=f"{mode}, {args.steps} steps per planner, {config.train.num_ranks} ranks ({elapsed:.0f} s in all)")
    for col in ("planner", "step median", "step total", "tokens/s", "fwd+bwd pred", "fwd+bwd meas",
                "pred / meas median", "within 15%", "last loss"):
        table.add_column(col, justify="right")
    summary: dict = {}
    for name, records in runs.items():
        pred = [r.predicted_s for r in records]
        summary[name] = {
            "step_median_s": statistics.median(r.wall_s for r in records),
            "step_total_s": sum(r.wall_s for r in records),
            "pred_over_meas_median": statistics.median(p / r.measured_s for p, r in zip(pred, records)),
            "within_15pct": steps_within(pred, [r.measured_s for r in records]),
            "last_loss": records[-1].loss,
        }
        table.add_row(name, f"{summary[name]['step_median_s']:.3f}s", f"{summary[name]['step_total_s']:.1f}s",
                      f"{statistics.median(r.tokens_per_s for r in records):,.0f}", f"{statistics.median(pred):.3f}s",
                      f"{statistics.median(r.measured_s for r in records):.3f}s",
                      f"{summary[name]['pred_over_meas_median']:.3f}", f"{summary[name]['within_15pct']}/{len(records)}",
                      f"{records[-1].loss:.6f}")
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
            json.dump({"mode": mode, "config": config.to_dict(), "summary": summary,
                       "steps": {k: [vars(r) for r in v] for k, v in runs.items()}, "plans": plans}, f, indent=1)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
