"""How fast `dhp` plans a step, from a 64-rank job to a 16K-rank one.

Prints solve time p50/p95/p99/max (and step / lower bound) for (global batch, ranks) = (512, 64), (4096, 1024) and
(16384, 16384) on the WLB-LLM lengths under the gpt7b-64 cost model with the domain size overridden.
Targets: p50 <= 10 ms, <= 100 ms, <= 1 s.

    python bench/solver_speed.py [--batches 10] [--planner dhp] [--pp 4] [--sizes 512x64,4096x1024] [--cpu] [--json out.json]
    python bench/solver_speed.py --max-groups-per-rank 32 ...   # dhp held to its group family (comm allgather)
    python bench/solver_speed.py --variants --cpu [--batches 4]  # 512 x 64 over plan_quality's workloads and variants
    python bench/solver_speed.py --long-context --cpu --batches 3  # no_overlap_gap.py's long-context batches

`--variants` times the batches the planner meets beyond one distribution: every workload of
`bench/plan_quality.py` under every cost-model variant of its `--variants` that keeps the 64-rank domain
(targets: p50 <= 10 ms, p99 <= 50 ms).

dhp plans with any group by default, as under the training default `comm: mixed`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.plan.family import group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.base import pipeline_planning_model
from megatron_dhp.workload import LengthSource

SIZES = ((512, 64), (4096, 1024), (16384, 16384))
TARGET_P50_MS = {64: 10.0, 1024: 100.0, 16384: 1000.0}
TARGET_P99_MS = 50.0
"""The tail target at 512 samples on 64 ranks over the workloads and variants (`--variants`)."""


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """`512x64,4096x1024` as ((512, 64), (4096, 1024))."""
    return tuple(tuple(int(v) for v in pair.split("x")) for pair in text.split(","))


def timed_solve(planner, batch, model, args: argparse.Namespace) -> tuple[float, float]:
    """One plan: its solve in ms (CPU time of the solve with `--cpu`, else run_planner's wall time) and step / LB."""
    d = model.domain
    family = group_family(d.world_size, d.gpus_per_node, args.max_groups_per_rank) if args.max_groups_per_rank else None
    if args.cpu:  # the solve alone, in CPU seconds: wall time on a shared VM swings with its load
        start = time.process_time()
        if planner.plans_pipeline:  # the call run_planner makes
            planner.solve(batch, model, family=family, pipeline_stages=args.pp)
        else:
            planner.solve(batch, pipeline_planning_model(planner, batch, model, args.pp))
        cpu_ms = (time.process_time() - start) * 1e3
    plan = run_planner(planner, batch, model, family=family, pipeline_stages=args.pp)
    return cpu_ms if args.cpu else plan.solve_time_ms, plan.predicted_step_time_s / plan.lower_bound_s


def percentiles(times: list[float]) -> dict[str, float]:
    """p50, p95, p99 and max of solve times in ms."""
    return {"p50_ms": float(np.percentile(times, 50)), "p95_ms": float(np.percentile(times, 95)),
            "p99_ms": float(np.percentile(times, 99)), "max_ms": float(np.max(times))}


def variants(args: argparse.Namespace) -> None:
    """512 samples on 64 ranks: every plan_quality workload under every variant that keeps the domain."""
    from plan_quality import VARIANT_BASE, VARIANTS, WORKLOADS  # bench/ is the script's own directory

    base = CostConfig.load(VARIANT_BASE)
    kept = {name: over for name, over in VARIANTS.items() if "world_size" not in over}
    console = Console()
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("solving", total=len(kept) * len(WORKLOADS) * args.batches)
        for name, over in kept.items():
            model = build_cost_model(base.with_overrides(**over))
            for workload in WORKLOADS:
                source, planner = LengthSource.from_args(dist=workload), build_planner(args.planner)
                for k in range(args.batches):
                    batch = source.draw(global_batch=512, seed=0, index=k, capacity=model.domain.capacity)
                    ms, ratio = timed_solve(planner, batch, model, args)
                    times.setdefault(name, []).append(ms)
                    ratios.setdefault(name, []).append(ratio)
                    progress.advance(task)
    clock = "CPU" if args.cpu else "wall"
    table = Table(title=f"{args.planner} solve {clock} time, 512 samples on 64 ranks: {len(WORKLOADS)} workloads x "
                        f"{args.batches} batches per variant of {VARIANT_BASE}")
    for col in ("variant", "p50 ms", "p95 ms", "p99 ms", "max ms", "step/LB mean"):
        table.add_column(col, justify="right")
    rows = [(name, percentiles(times[name]), float(np.mean(ratios[name]))) for name in kept]
    every = [t for name in kept for t in times[name]]
    rows.append(("all", percentiles(every), float(np.mean([r for name in kept for r in ratios[name]]))))
    for name, pct, ratio in rows:
        table.add_row(name, f"{pct['p50_ms']:.1f}", f"{pct['p95_ms']:.1f}", f"{pct['p99_ms']:.1f}", f"{pct['max_ms']:.1f}",
                      f"{ratio:.5f}")
    console.print(table)
    total = rows[-1][1]
    console.print(f"all {len(every)} solves: p50 {total['p50_ms']:.1f} ms (target <= {TARGET_P50_MS[64]:.0f}), "
                  f"p99 {total['p99_ms']:.1f} ms (target <= {TARGET_P99_MS:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planner": args.planner, "clock": clock, "variants": [
                {"variant": name, **pct, "mean_step_over_lb": ratio} for name, pct, ratio in rows]}, f, indent=1)


LONG_SIZES = ((512, 64), (512, 256), (4096, 1024))


def long_context(args: argparse.Namespace) -> None:
    """bench/no_overlap_gap.py's long-context workloads (seed 1) with and without overlap at 64, 256 and 1,024
    ranks: the batches where dhp list-schedules wide samples on any free ranks."""
    from no_overlap_gap import LONG_WORKLOADS  # bench/ is the script's own directory
    from plan_quality import VARIANT_BASE, VARIANTS

    from megatron_dhp.solver import PlannerContext

    base = CostConfig.load(VARIANT_BASE)
    console = Console()
    clock = "CPU" if args.cpu else "wall"
    table = Table(title=f"{args.planner} solve {clock} time on the long-context batches ({', '.join(LONG_WORKLOADS)}, "
                        f"with and without overlap, {args.batches} batches each)")
    for col in ("batch", "ranks", "solves", "p50 ms", "p99 ms", "max ms", "step/LB mean"):
        table.add_column(col, justify="right")
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("solving", total=len(LONG_SIZES) * 2 * len(LONG_WORKLOADS) * args.batches)
        for batch_size, ranks in LONG_SIZES:
            times, ratios = [], []
            for variant in ("reference", "no overlap"):
                model = build_cost_model(base.with_overrides(**VARIANTS[variant], world_size=ranks))
                for name, distribution in LONG_WORKLOADS.items():
                    source = LengthSource(name=name, distribution=distribution)
                    planner = build_planner(args.planner, PlannerContext(dataset_max_tokens=262144))
                    for k in range(args.batches):
                        batch = source.draw(global_batch=batch_size, seed=1, index=k, capacity=model.domain.capacity)
                        ms, ratio = timed_solve(planner, batch, model, args)
                        times.append(ms)
                        ratios.append(ratio)
                        progress.advance(task)
            rows.append({"global_batch": batch_size, "ranks": ranks, "solves": len(times), **percentiles(times),
                         "mean_step_over_lb": float(np.mean(ratios))})
    for r in rows:
        table.add_row(str(r["global_batch"]), str(r["ranks"]), str(r["solves"]), f"{r['p50_ms']:.1f}",
                      f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", f"{r['mean_step_over_lb']:.4f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planner": args.planner, "clock": clock, "long_context": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=10, help="batches per size (default 10)")
    parser.add_argument("--planner", default="dhp", help="planner to time (default dhp)")
    parser.add_argument("--max-groups-per-rank", type=int, default=0, metavar="K",
                        help="plan with the group family of K per rank, as under comm allgather (default 0: any group, "
                             "as under the default comm mixed)")
    parser.add_argument("--dist", default="wlbllm", help="length distribution (default wlbllm)")
    parser.add_argument("--cost", default="gpt7b-64", help="cost preset or YAML (default gpt7b-64)")
    parser.add_argument("--pp", type=int, default=1, metavar="P",
                        help="pipeline stages: plan (dhp) and price as 1F1B slots, as plan_quality.py --pp (default 1)")
    parser.add_argument("--sizes", type=parse_sizes, default=SIZES, metavar="BxN,...",
                        help="(global batch, ranks) pairs to time (default 512x64,4096x1024,16384x16384)")
    parser.add_argument("--cpu", action="store_true", help="time the planner's solve in CPU time instead of run_planner's wall time")
    parser.add_argument("--variants", action="store_true",
                        help="time 512 samples on 64 ranks over plan_quality's workloads and cost-model variants instead")
    parser.add_argument("--long-context", action="store_true",
                        help="time no_overlap_gap.py's long-context batches at 64, 256 and 1,024 ranks instead")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()

    if args.variants:
        return variants(args)
    if args.long_context:
        return long_context(args)
    base = CostConfig.load(args.cost)
    source = LengthSource.from_args(dist=args.dist)
    console = Console()
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("solving", total=len(args.sizes) * (args.batches + 1))
        for batch_size, ranks in args.sizes:
            model = build_cost_model(base.with_overrides(world_size=ranks))
            planner = build_planner(args.planner)
            times, ratios = [], []
            for k in range(args.batches + 1):  # the first solve warms caches and is not counted
                batch = source.draw(global_batch=batch_size, seed=0, index=k, capacity=model.domain.capacity)
                ms, ratio = timed_solve(planner, batch, model, args)
                if k:
                    times.append(ms)
                    ratios.append(ratio)
                progress.advance(task)
            rows.append({"global_batch": batch_size, "ranks": ranks, **percentiles(times),
                         "target_p50_ms": TARGET_P50_MS.get(ranks), "mean_step_over_lb": float(np.mean(ratios))})

    pp = f", PP {args.pp}" if args.pp > 1 else ""
    clock = "CPU" if args.cpu else "wall"
    table = Table(title=f"{args.planner} solve {clock} time on {args.dist}, {args.batches} batches per size, cost {args.cost}{pp}")
    for col in ("batch", "ranks", "p50 ms", "p95 ms", "p99 ms", "max ms", "target p50", "step/LB mean"):
        table.add_column(col, justify="right")
    for r in rows:
        target = r["target_p50_ms"]
        ok = "" if target is None else "[green]" if r["p50_ms"] <= target else "[red]"
        table.add_row(str(r["global_batch"]), str(r["ranks"]), f"{ok}{r['p50_ms']:.1f}", f"{r['p95_ms']:.1f}",
                      f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", "-" if target is None else f"{target:.0f}",
                      f"{r['mean_step_over_lb']:.4f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            pp_key = {"pp": args.pp} if args.pp > 1 else {}
            json.dump({"planner": args.planner, "dist": args.dist, "cost": args.cost, **pp_key, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
