"""`megatron-dhp plan`: plan one batch and write the validated plan JSON."""

from __future__ import annotations

import argparse

from megatron_dhp.cli.common import (
    add_planning_args,
    comm_policy,
    group_usage,
    planning_inputs,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `plan`."""
    p = sub.add_parser("plan", help="plan one batch and write plan.json",
                       description="Plan one global batch with a planner and write the validated plan as JSON. With "
                                   "--data-path the batch is step --batch-index of a Megatron-LM run.")
    add_planning_args(p)
    from megatron_dhp.solver import PLANNERS

    p.add_argument("--planner", default="dhp", choices=sorted(PLANNERS), help="planner (default dhp)")
    p.add_argument("--batch-index", type=int, default=0,
                   help="which batch of the seeded sequence to plan (with --data-path: which step of the run)")
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the output path, draw the batch, solve, validate, write."""
    from megatron_dhp.cost import build_cost_model
    from megatron_dhp.files import check_writable
    from megatron_dhp.solver import build_planner, run_planner

    check_writable(args.out, flag="--out")

    inputs = planning_inputs(args, first=args.batch_index)
    planner = build_planner(args.planner, inputs.context)
    policy = comm_policy(args, args.planner, inputs.config)
    plan = run_planner(planner, inputs.batches[0], build_cost_model(inputs.config), family=policy.planning_family,
                       pipeline_stages=inputs.pipeline_stages, virtual_stages=inputs.virtual_stages)
    plan.save(args.out)
    if inputs.corpus is not None:
        print(f"step {args.batch_index} of {inputs.source_name}: {len(inputs.batches[0])} sequences")
    print(plan.summary())
    if plan.pipeline_stages > 1:
        print(f"lower bound at {plan.pipeline_stages} pipeline stages: {plan.lower_bound_s:.3f}s")
    print(group_usage({planner.name: (policy, set(plan.multi_rank_groups()))}))
    print(f"wrote {args.out} ({len(plan.samples)} samples, {len(plan.groups)} groups, fingerprint {plan.fingerprint()})")
    return 0
