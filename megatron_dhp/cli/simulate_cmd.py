"""`megatron-dhp simulate`: several planners on the same batches, side by side under one cost model."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from megatron_dhp.cli.common import (
    add_planning_args,
    comm_policy,
    group_usage,
    planning_inputs,
)

if TYPE_CHECKING:
    from megatron_dhp.cost.config import CostConfig
    from megatron_dhp.workload.megatron_corpus import MegatronCorpus
    from megatron_dhp.workload.sample import Batch

TUNED = "static-best"
"""The row of --tuned: static at the (TP, CP) layout a user would tune (`solver.static_best`)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `simulate`."""
    from megatron_dhp.solver import PLANNERS

    p = sub.add_parser("simulate", help="compare planners on K batches under a cost model",
                       description="Draw K batches, plan each with every planner, and print step time, "
                                   "step / lower bound and solver time side by side. The lower bound is the best "
                                   "one the cost model knows (the larger of the reference bound and the coupled "
                                   "one, cost.bound; under --pp the pipeline bound), so a plan's LB here may be "
                                   "above the one `plan` records. With --data-path it is the dry run of a "
                                   "Megatron-LM run: its first K steps, as Megatron feeds them, planned for the "
                                   "domain, with dhp's predicted step and its speed-up over static (and "
                                   "static-best with --tuned).")
    add_planning_args(p, default_dist="wlbllm", default_batch=512)
    p.add_argument("--batches", type=int, default=5, metavar="K",
                   help="batches to draw (default 5); with --data-path, the run's first K steps")
    fast = [n for n in PLANNERS if n != "flexsp-milp"]
    p.add_argument("--planners", default=",".join(fast),
                   help=f"comma-separated planners out of {', '.join(PLANNERS)} (default {','.join(fast)}; "
                        "flexsp-milp solves MILPs for up to --time-limit seconds each)")
    p.add_argument("--placements", metavar="LIST",
                   help="comma-separated encoder placements out of split, replicate, global, auto: every planner "
                        "runs under each, one row per pair (default: the cost config's encoder_placement)")
    p.add_argument("--tuned", action="store_true",
                   help="add a row 'static-best': the static (TP, CP) layout a user would tune once for the run, "
                        "the one with the shortest mean step over the K batches out of every power-of-two TP "
                        "dividing the node (and the cost config's attention_heads, when stated) whose memory holds "
                        "and every power-of-two CP from the smallest that holds the longest sample, packed as "
                        "static packs; TP is priced with the cost config's tp_efficiency and "
                        "tp_comm_bytes_per_token (docs/cost-model.md#tensor-parallelism), and its step / LB is over "
                        "the bound at its TP. It includes static's own layout, so its mean step is never above "
                        "static's (single-stage: not with --pp)")
    p.add_argument("--plot", metavar="PNG", help="write a per-rank Gantt of batch 0 and a bar chart of the planners")
    p.add_argument("--json", metavar="FILE", help="write the per-batch results as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the output paths, plan every batch with every planner; print the table."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from megatron_dhp.cost import build_cost_model, simulate
    from megatron_dhp.cost.bound import best_lower_bound
    from megatron_dhp.errors import DhpError
    from megatron_dhp.files import check_writable
    from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, flag=flag)
    if args.batches < 1:
        raise DhpError(f"--batches {args.batches} must be at least 1")
    if args.tuned and args.pp > 1:
        raise DhpError(f"--tuned tunes single-stage layouts; it cannot be combined with --pp {args.pp}")
    names = [n.strip() for n in args.planners.split(",") if n.strip()]
    inputs = planning_inputs(args, count=args.batches)
    config, source, batches = inputs.config, inputs.source_name, inputs.batches
    model = build_cost_model(config)
    planners = [(n, build_planner(n, inputs.context)) for n in names]
    if not config.domain.nominal and "dhp" in names:  # what knowing the speeds buys: dhp planning without them
        planners.insert(names.index("dhp") + 1, ("dhp-blind", build_planner("dhp", inputs.context, speed_aware=False)))
    policies = {p.name: comm_policy(args, p.name, config) for _, p in planners}
    # One row per planner, or per (planner, encoder placement) with --placements: (label, planner, its cost
    # model, the family it plans on, the tuned layout or None).
    placements = [p.strip() for p in args.placements.split(",") if p.strip()] if args.placements else [None]
    runs = [(n if pl is None else f"{n} @{pl}", p, model if pl is None else model.with_placement(pl),
             policies[p.name].planning_family, None) for pl in placements for n, p in planners]
    tuned = tuned_rows(config, placements, batches, inputs.context["dataset_max_tokens"]) if args.tuned else []
    runs += tuned
    names = [label for label, *_ in runs]

    results: dict[str, list[dict]] = {n: [] for n in names}
    first_plans, first_models, best_bounds = {}, {}, {}
    used = {p.name: (policies[p.name], set()) for _, p in planners}
    console = Console()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(batches) * len(runs))
        for k, batch in enumerate(batches):
            for label, planner, row_model, family, layout in runs:
                if planner is None:  # --tuned found no static layout that plans every batch
                    results[label].append({"batch": k, "unsupported": "no static (TP, CP) layout plans every batch"})
                    progress.advance(task)
                    continue
                try:
                    plan = run_planner(planner, batch, row_model, family=family,
                                       pipeline_stages=inputs.pipeline_stages, virtual_stages=inputs.virtual_stages)
                except PlannerUnsupported as e:  # the planner's source cannot plan this batch: "n/a"
                    results[label].append({"batch": k, "unsupported": str(e)})
                else:
                    if plan.pipeline_stages == 1:  # the best bound (one per batch and cost model); P > 1: the plan's
                        key = (k, id(row_model))
                        if key not in best_bounds:
                            best_bounds[key] = best_lower_bound(row_model, batch.samples)
                        plan = replace(plan, lower_bound_s=best_bounds[key])
                    if layout is not None:
                        plan = replace(plan, planner=TUNED)
                    results[label].append({
                        "batch": k, "step_time_s": plan.predicted_step_time_s, "lower_bound_s": plan.lower_bound_s,
                        "ratio": plan.predicted_step_time_s / plan.lower_bound_s,
                        "solve_time_ms": plan.solve_time_ms, "summary": plan.summary(),
                        "encoder_placement": plan.encoder_placement,
                        **({"tensor_parallel": layout.tp, "context_parallel": layout.cp} if layout else {}),
                    })
                    if layout is None:
                        used[planner.name][1].update(plan.multi_rank_groups())
                    if k == 0:
                        first_plans[label], first_models[label] = plan, row_model
                progress.advance(task)

    d = config.domain
    shape = (f"{len(batches)} steps of {inputs.corpus.spec.global_batch_size} rows" if inputs.corpus is not None
             else f"{len(batches)} batches of {len(batches[0])} samples")
    table = Table(title=f"{source}: {shape}, "
                        f"N={d.world_size} ({d.gpus_per_node}/node), M={d.max_tokens_per_rank}, cost {args.cost}"
                        + (f", PP={inputs.pipeline_stages}" if inputs.pipeline_stages > 1 else "")
                        + (f" x VPP={inputs.virtual_stages}" if inputs.virtual_stages > 1 else ""))
    for col in ("planner", "step s (mean)", "step/LB mean", "step/LB max", "solve ms p50", "solve ms p95", "n/a"):
        table.add_column(col, justify="right", no_wrap=col == "planner")
    mean_ratio = {}
    for n in names:
        rows = [r for r in results[n] if "unsupported" not in r]
        skipped = f"{len(results[n]) - len(rows)}/{len(batches)}"
        if not rows:
            table.add_row(n, *["n/a"] * 5, skipped)
            continue
        ratio = np.array([r["ratio"] for r in rows])
        solve = np.array([r["solve_time_ms"] for r in rows])
        mean_ratio[n] = float(ratio.mean())
        table.add_row(n, f"{np.mean([r['step_time_s'] for r in rows]):.3f}", f"{ratio.mean():.3f}",
                      f"{ratio.max():.3f}", f"{np.percentile(solve, 50):.1f}", f"{np.percentile(solve, 95):.1f}",
                      skipped)
    console.print(table)
    if inputs.pipeline_stages > 1:
        bounds = [r["lower_bound_s"] for rows in results.values() for r in rows if "lower_bound_s" in r]
        if bounds:
            console.print(f"lower bound at {inputs.pipeline_stages} pipeline stages: mean {np.mean(bounds):.3f}s", highlight=False)
    for label, _, tuned_model, _, layout in tuned:
        if layout is not None:
            console.print(tuned_line(label, layout, tuned_model, config), highlight=False)
    for n in names:
        if n in first_plans:
            console.print(first_plans[n].summary(), highlight=False)
        unsupported = [r for r in results[n] if "unsupported" in r]
        if unsupported:
            batches_na = ", ".join(str(r["batch"]) for r in unsupported)
            console.print(f"{n}: n/a on batch {batches_na}: {unsupported[0]['unsupported']}", highlight=False)
    console.print(group_usage(used), highlight=False)
    if inputs.corpus is not None:
        for line in corpus_notes(inputs.corpus, batches, config):
            console.print(line, highlight=False, soft_wrap=True)
    line = speedup_line(results, ("static", *(label for label, *_ in tuned)))
    if line:
        console.print(line, highlight=False, soft_wrap=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source, "cost": config.to_dict(), "results": results}, f, indent=1)
        console.print(f"wrote {args.json}")
    if args.plot:
        from megatron_dhp.viz import save_simulation_figure

        save_simulation_figure(args.plot, [(p, simulate(p, first_models[n])) for n, p in first_plans.items()], mean_ratio)
        console.print(f"wrote {args.plot}")
    return 0


def tuned_rows(config, placements: list[str | None], batches: list, longest: int) -> list[tuple]:
    """--tuned's rows, one per encoder placement: ('static-best', its planner, the cost model at its TP, no
    family, its `Layout`), or a row without planner where no static layout plans every batch
    (`solver.static_best.best_static`)."""
    from megatron_dhp.solver.static_best import best_static

    rows = []
    for pl in placements:
        label = TUNED if pl is None else f"{TUNED} @{pl}"
        best = best_static(config if pl is None else config.with_overrides(encoder_placement=pl), batches, longest)
        layout, model, planner = best if best is not None else (None, None, None)
        rows.append((label, planner, model, None, layout))
    return rows


def tuned_line(label: str, layout, model, config) -> str:
    """One line on the tuned layout: its TP and CP, and whether the cost config prices TP's costs."""
    gpus = f"{layout.tp} GPU" + "s" * (layout.tp > 1)
    line = (f"{label}: TP {layout.tp} x CP {layout.cp} of {model.domain.world_size} positions of {gpus} "
            f"(M {model.domain.max_tokens_per_rank} tokens each), the static layout with the shortest mean step")
    if layout.tp > 1 and config.tp_efficiency == 1.0 and not config.tp_comm_bytes_per_token:
        line += ("; the cost config states no tensor-parallel costs (tp_efficiency 1, tp_comm_bytes_per_token 0), "
                 "so TP is priced ideal")
    return line


def speedup_line(results: dict[str, list[dict]], peers: tuple[str, ...]) -> str | None:
    """dhp's predicted step and its mean speed-up over each peer that ran (peer step / dhp step, over the
    batches both planned), or None without dhp."""
    mine = {r["batch"]: r["step_time_s"] for r in results.get("dhp", []) if "step_time_s" in r}
    if not mine:
        return None
    line = f"dhp: predicted step {np.mean(list(mine.values())):.3f} s (mean of {len(mine)})"
    speedups = []
    for peer in peers:
        ratios = [r["step_time_s"] / mine[r["batch"]] for r in results.get(peer, [])
                  if "step_time_s" in r and r["batch"] in mine]
        if ratios:
            speedups.append(f"{np.mean(ratios):.3f}x over {peer}")
    return line + (f"; speed-up {', '.join(speedups)}" if speedups else "")


def corpus_notes(corpus: MegatronCorpus, batches: list[Batch], config: CostConfig) -> list[str]:
    """What a Megatron corpus's steps hold against the domain's M, and whether the rows are the run's."""
    m, spec = config.domain.max_tokens_per_rank, corpus.spec
    lengths = np.concatenate([b.lengths for b in batches])
    notes = [f"sequences a step: {len(lengths) / len(batches):.1f} (mean) from {spec.global_batch_size} rows; length "
             f"p50 {np.percentile(lengths, 50):,.0f}, p90 {np.percentile(lengths, 90):,.0f}, max {lengths.max():,}; "
             f"{int((lengths > m).sum())} of {len(lengths)} longer than M {m:,}"]
    if spec.seq_length <= m:
        notes.append(f"note: --seq-length {spec.seq_length:,} <= M {m:,}: every sequence fits one rank, so static "
                     "needs no context parallelism and dhp has little to gain (it gains where --seq-length > M)")
    if spec.train_samples is None:
        notes.append("note: rows as for a run of these steps only; pass the run's --train-iters (or --train-samples): "
                     "the epochs a run needs shape Megatron's shuffle")
    return notes
