"""Stragglers and mixed GPUs: dhp planning with the ranks' speeds, beside itself and the peers planning without.

Simulated under the reference cost model (gpt7b-64 coefficients, 8 ranks per node, the domain size
overridden) on WLB-LLM lengths at (global batch, ranks) = (512, 64), (2048, 256) and (8192, 1024). Each
scenario gives every domain position a relative speed (1.0 the nominal rank; numpy seed `--seed`, so a run
repeats exactly):

    nominal    every rank at 1.0 (speed-aware dhp must plan as the speed-blind one)
    one-0.5    rank N // 3 at 0.5
    node-0.7   the second node (ranks 8..15) at 0.7
    1pct-0.5   1 % of the ranks (at least one, drawn at random) at 0.5
    two-gen    the first half of the nodes at 1.0, the second half at 0.45 (two GPU generations)
    drift      a trace of `--drift-steps` steps: every rank on a bounded random walk (x exp(N(0, 3 %)) a step,
               clipped to [0.4, 1.0], from 1.0), and two ranks held at 0.5 from a quarter of the trace on, one
               recovering at half of it and one at three quarters. A fresh batch per step (index = step - 1);
               dhp plans with the speeds the closed loop predicts (its predictor,
               `closed_loop.speed_estimator.LogSpeedPredictor`, at its default window) from the steps up to
               `--lead` before (default the loop's `LEAD`, 2: with read-ahead, `overlap_planning`, a step is
               planned before the one before it has reported; 1 without), rounded to powers of
               1 + `--speed-grid` as the closed loop publishes them (its grid by default); every plan is
               priced under the current exact speeds. dhp-prev plans with the last reported step's (rounded)
               speeds, dhp-nolag with the current ones: beside them, dhp shows what the lag costs and how
               much of it the predictor wins back.

Planners: dhp (speed-aware), dhp-blind (dhp on the speed-blind model), static and fcp-ref (speed-blind as
published; static and fcp-ref take the batch's longest sample as the dataset's). Every plan is priced under
the true speeds against the speed-aware bound (`cost.bound.best_lower_bound` under the same speeds). Per
size and scenario it prints mean step / bound of each planner, the mean per-batch ratios dhp-blind / dhp,
static / dhp and fcp-ref / dhp, and dhp's solve ms p50 and p99 (`Plan.solve_time_ms`, wall time); then the
targets, each with its measured value:

    dhp step / bound, the mean of the (size, scenario) means, <= 1.05
    dhp-blind / dhp, mean over one-0.5 at N = 64, >= 1.5
    dhp / dhp-blind, worst nominal batch, <= 1.005

Cost: `best_lower_bound` is O(samples x N) (seconds a batch at N = 1,024), so from `LARGE_RANKS` ranks on a
fixed scenario runs `--batches-large` batches and drift plans `--drift-steps-large` of its steps, evenly spaced
over the whole trace (each still planned from the steps before it); the run prints what it used. dhp's solve
grows with the number of distinct speeds, hence the loop's grid (`--speed-grid`). The default run takes about
2 minutes on 2 CPU cores.

    python bench/straggler_sim.py [--sizes 512x64,2048x256,8192x1024] [--batches 3] [--drift-steps 200]
                                  [--batches-large 2] [--drift-steps-large 5] [--json out.json] [--markdown]
    python bench/straggler_sim.py --sizes 512x64 --batches 2 --scenarios one-0.5,two-gen   # a quick look
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.closed_loop.loop import LEAD
from megatron_dhp.closed_loop.speed_estimator import LogSpeedPredictor
from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.cost.model import CostModel
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.plan.rank_speeds import SPEED_GRID, on_speed_grid
from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner
from megatron_dhp.workload import LengthSource

SIZES = ((512, 64), (2048, 256), (8192, 1024))
SCENARIOS = ("nominal", "one-0.5", "node-0.7", "1pct-0.5", "two-gen", "drift")
PLANNERS = ("dhp", "dhp-blind", "static", "fcp-ref")
NOLAG = "dhp-nolag"
"""dhp planned with the current step's speeds (drift only): the closed loop without its step of lag."""
PREV = "dhp-prev"
"""dhp planned with the last reported step's speeds (drift only): the lag, nothing predicted."""
LARGE_RANKS = 256
"""From this many ranks on, a cell runs `--batches-large` batches and drift plans `--drift-steps-large` of its steps."""
DRIFT_STD, DRIFT_FLOOR, DRIFT_DIP = 0.03, 0.4, 0.5
"""The drift walk's log-step std and floor (its ceiling is 1.0), and the speed the two dipping ranks drop to."""


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """`512x64,2048x256` as ((512, 64), (2048, 256))."""
    try:
        return tuple((int(b), int(n)) for b, n in (pair.split("x") for pair in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of BATCHxRANKS such as 512x64,2048x256") from None


def fixed_speeds(scenario: str, n: int, gpn: int, seed: int) -> np.ndarray:
    """Every position's speed under one of the fixed scenarios."""
    speeds = np.ones(n)
    if scenario == "one-0.5":
        speeds[n // 3] = 0.5
    elif scenario == "node-0.7":
        speeds[gpn : 2 * gpn] = 0.7
    elif scenario == "1pct-0.5":
        speeds[np.random.default_rng(seed).choice(n, max(1, round(n / 100)), replace=False)] = 0.5
    elif scenario == "two-gen":
        speeds[(n // gpn) // 2 * gpn :] = 0.45
    elif scenario != "nominal":
        raise ValueError(f"unknown scenario {scenario!r}")
    return speeds


def drift_trace(n: int, steps: int, seed: int) -> np.ndarray:
    """(steps + 1, n) speeds: row 0 is what the first step is planned with, row t what step t runs at."""
    rng = np.random.default_rng(seed)
    factors = np.exp(rng.normal(0.0, DRIFT_STD, (steps, n)))
    trace = np.ones((steps + 1, n))
    for t in range(1, steps + 1):  # clipped as it goes, so it wanders back from either end
        trace[t] = np.clip(trace[t - 1] * factors[t - 1], DRIFT_FLOOR, 1.0)
    start = max(1, steps // 4)
    for rank, end in zip(rng.choice(n, min(2, n), replace=False), (steps // 2, 3 * steps // 4)):
        rows = slice(start, max(start + 1, end))  # back on its walk from step `end` on
        trace[rows, rank] = np.minimum(trace[rows, rank], DRIFT_DIP)
    return trace


def on_grid(speeds: np.ndarray, grid: float) -> np.ndarray:
    """`speeds` rounded to the nearest power of 1 + `grid` (0: as they are), as the closed loop reports them at the
    default `grid` (`plan.rank_speeds.on_speed_grid`)."""
    if not grid:
        return speeds
    return np.minimum(on_speed_grid(speeds, grid=1 + grid), 1.0)


def predicted(trace: np.ndarray, lead: int) -> np.ndarray:
    """Row t: step t's speeds as the closed loop predicts them from the trace's steps up to t - `lead` (its
    `LogSpeedPredictor` at the loop's default window, fed one step at a time; the trace's first row until a
    step has reported)."""
    predictor, out = LogSpeedPredictor(DhpConfig.adaptive_window), np.repeat(trace[:1], len(trace), axis=0)
    for t in range(len(trace) - lead):
        predictor.update(np.log(trace[t]))
        out[t + lead] = np.exp(predictor.predict(float(lead)))
    return out


def cell_units(scenario: str, n: int, gpn: int,
               args: argparse.Namespace) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(batch index, speeds dhp plans with, speeds dhp-nolag plans with, speeds dhp-prev plans with, speeds the
    step runs at) of every batch of one cell."""
    large = n >= LARGE_RANKS
    if scenario == "drift":
        trace = drift_trace(n, args.drift_steps, args.seed)
        measured, ahead = on_grid(trace, args.speed_grid), on_grid(predicted(trace, args.lead), args.speed_grid)
        steps = range(1, args.drift_steps + 1) if not large else \
            np.unique(np.linspace(1, args.drift_steps, min(args.drift_steps_large, args.drift_steps)).round().astype(int))
        return [(int(t) - 1, ahead[t], measured[t], measured[max(0, t - args.lead)], trace[t]) for t in steps]
    speeds = fixed_speeds(scenario, n, gpn, args.seed)
    return [(k, speeds, speeds, speeds, speeds) for k in range(args.batches_large if large else args.batches)]


def fluid_floor(planned_with: np.ndarray, runs_at: np.ndarray) -> float:
    """Step / bound of the ideal plan made on `planned_with`: every rank's work in proportion to the speed it is
    planned with, perfectly divisible. At the speeds it runs at, rank r ends at p_r / s_r of the balanced
    time, so the step is max_r(p_r / s_r) sum s / sum p of the bound's fluid step: what planning ahead of
    the speeds costs before any planner's own loss (1 where the speeds are known)."""
    return float(np.max(planned_with / runs_at) * runs_at.sum() / planned_with.sum())


def price(planner_name: str, batch, seen: CostModel, true: CostModel) -> tuple[float | None, float | None]:
    """(step seconds under `true`, solve ms) of one planner's plan made on `seen`; None where it cannot plan."""
    if planner_name in ("dhp", NOLAG, PREV):
        planner = build_planner("dhp")
    elif planner_name == "dhp-blind":
        planner = build_planner("dhp", speed_aware=False)
    else:
        planner = build_planner(planner_name, {"dataset_max_tokens": int(batch.lengths.max())})
    try:
        plan = run_planner(planner, batch, seen)
    except PlannerUnsupported:
        return None, None
    step = plan.predicted_step_time_s if seen is true else simulate(plan, true).step_time_s
    return step, plan.solve_time_ms


def run(args: argparse.Namespace, console: Console) -> list[dict]:
    """Plan every batch of every (size, scenario) with every planner; one record per (cell, batch, planner)."""
    base = CostConfig.load(args.cost)
    source = LengthSource.from_args(dist=args.dist)
    cells = [(size, scenario) for size in args.sizes for scenario in args.scenarios]
    units = {cell: cell_units(cell[1], cell[0][1], base.gpus_per_node, args) for cell in cells}
    records = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=sum(len(u) for u in units.values()))
        for (global_batch, n), scenario in cells:
            progress.update(task, description=f"{global_batch}x{n} {scenario}")
            model = build_cost_model(base.with_overrides(world_size=n, rank_speeds=()))
            planners = [*PLANNERS, *([NOLAG, PREV] if scenario == "drift" else [])]
            for k, planned_with, nolag_with, prev_with, runs_at in units[((global_batch, n), scenario)]:
                batch = source.draw(global_batch=global_batch, seed=args.seed, index=k, capacity=model.domain.capacity)
                true = model.with_speeds(tuple(runs_at.tolist()))
                seen = {p: true if speeds is runs_at else model.with_speeds(tuple(speeds.tolist()))
                        for p, speeds in (("dhp", planned_with), (NOLAG, nolag_with), (PREV, prev_with))}
                lb = best_lower_bound(true, batch.samples)
                for name in planners:
                    step, solve_ms = price(name, batch, seen.get(name, true), true)
                    records.append({"size": f"{global_batch}x{n}", "ranks": n, "global_batch": global_batch,
                                    "scenario": scenario, "batch": k, "planner": name, "step_s": step, "lb_s": lb,
                                    "ratio": None if step is None else step / lb, "solve_ms": solve_ms,
                                    "min_speed": float(runs_at.min()), "mean_speed": float(runs_at.mean()),
                                    "fluid_floor": fluid_floor(planned_with, runs_at)})
                progress.advance(task)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per (size, scenario): each planner's mean step / bound, the mean per-batch ratio of each peer
    to dhp, dhp's worst dhp / dhp-blind, and dhp's solve ms p50 and p99."""
    cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in records:
        cells[(r["size"], r["ranks"], r["scenario"])][(r["batch"], r["planner"])] = r
    rows = []
    for (size, ranks, scenario), done in cells.items():
        dhp = {b: r for (b, p), r in done.items() if p == "dhp"}
        row = {"size": size, "ranks": ranks, "scenario": scenario, "batches": len(dhp)}
        for p in (*PLANNERS, NOLAG, PREV):
            ratios = [r["ratio"] for (_, q), r in done.items() if q == p and r["ratio"] is not None]
            row[f"{p}/LB"] = float(np.mean(ratios)) if ratios else None
            vs = [done[(b, p)]["step_s"] / d["step_s"] for b, d in dhp.items()
                  if p != "dhp" and (b, p) in done and done[(b, p)]["step_s"] is not None]
            row[f"{p}/dhp"] = float(np.mean(vs)) if vs else None
            if p == "dhp-blind":
                row["worst dhp/dhp-blind"] = float(1 / np.min(vs)) if vs else None
        row["fluid floor"] = float(np.mean([r["fluid_floor"] for r in dhp.values()]))
        solve = np.array([r["solve_ms"] for r in dhp.values()])
        row["solve p50 ms"], row["solve p99 ms"] = (float(np.percentile(solve, q)) for q in (50, 99))
        rows.append(row)
    return rows


def targets(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    """The targets for speed-aware dhp: (what, measured, met; None where this run holds no such cell)."""
    out: list[tuple[str, str, bool | None]] = []
    means = [r["dhp/LB"] for r in rows]
    out.append((f"dhp step / speed-aware LB, mean of {len(means)} (size, scenario) means (<= 1.05)",
                f"{np.mean(means):.4f}", bool(np.mean(means) <= 1.05)))
    one = [r["dhp-blind/dhp"] for r in rows if r["scenario"] == "one-0.5" and r["ranks"] == 64]
    out.append(("dhp-blind / dhp, mean, one rank at 0.5 on 64 ranks (>= 1.5)",
                f"{one[0]:.3f}" if one else "not run", bool(one[0] >= 1.5) if one else None))
    nominal = [r["worst dhp/dhp-blind"] for r in rows if r["scenario"] == "nominal"]
    out.append(("dhp / dhp-blind, worst nominal batch over every size (<= 1.005)",
                f"{max(nominal):.4f}" if nominal else "not run", bool(max(nominal) <= 1.005) if nominal else None))
    return out


COLUMNS = ("scenario", "batches", "dhp/LB", "dhp-blind/LB", "static/LB", "fcp-ref/LB", "dhp-blind/dhp",
           "static/dhp", "fcp-ref/dhp", "dhp-nolag/LB", "dhp-prev/LB", "fluid floor", "solve p50 ms", "solve p99 ms")


def cells_of(row: dict) -> list[str]:
    """A summary row as table cells (`COLUMNS`), ratios to 3 decimals, '-' where a value is absent."""
    def fmt(key: str) -> str:
        v = row[key]
        return "-" if v is None else f"{v:.1f}" if key.endswith("ms") else f"{v:.3f}x" if key.endswith("/dhp") else f"{v:.3f}"
    return [row["scenario"], str(row["batches"]), *(fmt(c) for c in COLUMNS[2:])]


def report(records: list[dict], args: argparse.Namespace, console: Console) -> list[tuple[str, str, bool | None]]:
    """One table per size, the targets table, and with `--markdown` one markdown table of every size."""
    rows = summarize(records)
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        table = Table(title=f"{args.dist} on {size.split('x')[1]} ranks, global batch {size.split('x')[0]}, cost "
                            f"{args.cost}: step / speed-aware lower bound")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for r in mine:
            table.add_row(*cells_of(r))
        console.print(table)
    for r in rows:
        if r["scenario"] == "drift":
            nolag = r[f"{NOLAG}/LB"]
            console.print(f"drift on {r['ranks']} ranks, what the lag costs over {NOLAG} (mean step / bound): "
                          f"{PREV} {r[f'{PREV}/LB'] / nolag - 1:+.2%}, dhp (predicted) {r['dhp/LB'] / nolag - 1:+.2%}")
    results = targets(rows)
    table = Table(title="targets for speed-aware dhp")
    for col in ("target", "measured", "met"):
        table.add_column(col)
    for what, value, met in results:
        table.add_row(what, value, "n/a" if met is None else "[green]yes" if met else "[red]no")
    console.print(table)
    if args.markdown:
        lines = [["N", *COLUMNS]] + [[str(r["ranks"]), *cells_of(r)] for r in rows]
        print("\n".join(["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0]),
                         *("| " + " | ".join(line) + " |" for line in lines[1:])]))
    return results


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_sizes, default=SIZES, metavar="BxN,...",
                        help="(global batch, ranks) pairs (default 512x64,2048x256,8192x1024)")
    parser.add_argument("--batches", type=int, default=3, help="batches per fixed scenario (default 3)")
    parser.add_argument("--batches-large", type=int, default=2,
                        help=f"batches per fixed scenario from {LARGE_RANKS} ranks on (default 2)")
    parser.add_argument("--drift-steps", type=int, default=200, help="steps of the drift trace (default 200)")
    parser.add_argument("--drift-steps-large", type=int, default=5,
                        help=f"from {LARGE_RANKS} ranks on, plan this many of the trace's steps, evenly spaced (default 5)")
    parser.add_argument("--speed-grid", type=float, default=round(SPEED_GRID - 1, 9), metavar="G",
                        help=f"drift: dhp plans with the speeds rounded to powers of 1 + G (default "
                             f"{SPEED_GRID - 1:g}, the closed loop's grid; 0: the exact speeds, whose solve is "
                             "O(samples x distinct speeds): seconds a step at N = 256)")
    parser.add_argument("--lead", type=int, default=LEAD, metavar="K",
                        help=f"drift: steps from the last report to the step it plans (default {LEAD}, the closed "
                             "loop's under read-ahead; 1 without overlap_planning)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"default {','.join(SCENARIOS)}")
    parser.add_argument("--dist", default="wlbllm", help="length distribution (default wlbllm)")
    parser.add_argument("--cost", default="gpt7b-64", help="cost preset or YAML; its world size is overridden (default gpt7b-64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches and of the speeds (default 0)")
    parser.add_argument("--json", metavar="FILE", help="write every per-batch record, the summary and the targets")
    parser.add_argument("--markdown", action="store_true", help="also print the summary as one markdown table")
    args = parser.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    if args.lead < 1:
        parser.error(f"--lead {args.lead}: a step is planned at least 1 step after the last report")
    gpn = CostConfig.load(args.cost).gpus_per_node
    small = [n for _, n in args.sizes if n < 2 * gpn]
    if small:
        parser.error(f"{small[0]} ranks is less than two nodes of {gpn}; node-0.7 and two-gen need two")

    console = Console(width=170)
    for _, n in args.sizes:
        large = n >= LARGE_RANKS
        drift = (f"{min(args.drift_steps_large, args.drift_steps)} of the {args.drift_steps} drift steps, evenly spaced"
                 if large else f"all {args.drift_steps} drift steps")
        console.print(f"N = {n}: {args.batches_large if large else args.batches} batches per fixed scenario, {drift}"
                      + (" (--batches-large, --drift-steps-large)" if large else ""))
    if "drift" in args.scenarios:
        console.print(f"drift: dhp plans with speeds rounded to powers of {1 + args.speed_grid:g} (--speed-grid)"
                      if args.speed_grid else "drift: dhp plans with the exact speeds (--speed-grid 0)")
    records = run(args, console)
    results = report(records, args, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dist": args.dist, "cost": args.cost, "seed": args.seed, "records": records,
                       "summary": summarize(records),
                       "targets": [dict(target=w, measured=v, met=m) for w, v, m in results]}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
