"""`megatron-dhp plan`: plan one batch and write the validated plan JSON."""

from __future__ import annotations

import argparse

from megatron_dhp.cli.common import (
    add_cost_args,
    add_planner_args,
    add_workload_args,
    dataset_max_tokens,
    draw_batches,
    load_cost,
    planner_context,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `plan`."""
    p = sub.add_parser("plan", help="plan one batch and write plan.json",
                       description="Plan one global batch with a planner and write the validated plan as JSON.")
    add_workload_args(p)
    add_cost_args(p)
    add_planner_args(p)
    from megatron_dhp.solver import PLANNERS

    p.add_argument("--planner", default="dhp", choices=sorted(PLANNERS), help="planner (default dhp)")
    p.add_argument("--batch-index", type=int, default=0, help="which batch of the seeded sequence to plan")
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Draw the batch, solve, validate, write."""
    from megatron_dhp.cost import build_cost_model
    from megatron_dhp.solver import build_planner, run_planner

    config = load_cost(args)
    source, batches = draw_batches(args, config, args.batch_index + 1)
    batch = batches[-1]
    longest = dataset_max_tokens(source, [batch], config.domain.capacity)
    planner = build_planner(args.planner, planner_context(args, longest))
    plan = run_planner(planner, batch, build_cost_model(config))
    plan.save(args.out)
    print(plan.summary())
    print(f"wrote {args.out} ({len(plan.samples)} samples, {len(plan.groups)} groups, fingerprint {plan.fingerprint()})")
    return 0
