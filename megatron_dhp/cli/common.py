"""Arguments and set-up shared by the planning sub-commands."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.cost.speeds import load_rank_speeds
from megatron_dhp.plan.comm import STEP_COMMS, CommPolicy
from megatron_dhp.solver import PlannerContext
from megatron_dhp.workload.batches import LengthSource, fit_to_domain
from megatron_dhp.workload.sample import Batch
from megatron_dhp.workload.synthetic import DISTRIBUTIONS


def add_workload_args(p: argparse.ArgumentParser, *, default_dist: str | None = None, default_batch: int | None = None) -> None:
    """--lengths/--dist, --global-batch, --seed, --truncate."""
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group(required=default_dist is None)
    src.add_argument("--lengths", metavar="FILE", help="JSON array, JSONL or Megatron .bin/.idx prefix of sample lengths")
    src.add_argument("--dist", metavar="NAME", choices=sorted(DISTRIBUTIONS), default=default_dist,
                     help=f"named length distribution: {', '.join(DISTRIBUTIONS)} (see `megatron-dhp dists`)")
    g.add_argument("--global-batch", type=int, default=default_batch, metavar="B",
                   help="samples per batch (a --lengths file without it is taken whole as one batch)")
    g.add_argument("--seed", type=int, default=0, help="seed of the batch draws (default 0)")
    g.add_argument("--truncate", action="store_true",
                   help="cut samples longer than world_size x max_tokens_per_rank instead of failing")


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """--cost and the domain overrides."""
    g = p.add_argument_group("cost model and domain")
    g.add_argument("--cost", default="gpt7b-64", metavar="CONFIG",
                   help="cost-model YAML or preset name from configs/ (default gpt7b-64)")
    g.add_argument("--world-size", type=int, metavar="N", help="ranks in the dynamic domain (overrides the YAML)")
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="ranks per node (overrides the YAML)")
    g.add_argument("--max-tokens-per-rank", type=int, metavar="M", help="per-rank token cap (overrides the YAML)")
    g.add_argument("--rank-speeds", metavar="FILE",
                   help="JSON list of N relative rank speeds (1.0: the cost model's rank; 0.5: half as fast): dhp "
                        "plans with them, the peers stay speed-blind, every plan is priced with them")


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """Job facts some planners read (see `solver.PlannerContext`)."""
    g = p.add_argument_group("planner options")
    g.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="time limit of each MILP a planner solves (flexsp-milp; default 10)")
    g.add_argument("--comm", choices=tuple(STEP_COMMS), default="mixed",
                   help="the training comm to plan for: under mixed (default) and p2p a group outside the family "
                        "costs no communicator, so planners use any group; under allgather, ring and ulysses "
                        "they keep to --max-groups-per-rank")
    g.add_argument("--max-groups-per-rank", type=int, metavar="K",
                   help="with --comm allgather, ring or ulysses: plan only with the fixed group family of at most K "
                        "groups per rank; 0: any groups (default: each planner's own, dhp 32, the peers 0)")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline-parallel stages: plan and price each position's microbatches as 1F1B slots (default 1)")
    g.add_argument("--vpp", type=int, default=1, metavar="V",
                   help="model chunks per pipeline stage: plan and price megatron-core's interleaved 1F1B "
                        "(needs --pp 2 or more; default 1)")


def planner_context(args: argparse.Namespace, longest: int) -> PlannerContext:
    """The facts `build_planner` hands to every planner: the longest sample, and the flags that were given."""
    from megatron_dhp.errors import DhpError

    if args.time_limit is not None and not args.time_limit > 0:
        raise DhpError(f"--time-limit {args.time_limit} must be a positive number of seconds")
    if args.pp < 1:
        raise DhpError(f"--pp {args.pp} must be at least 1")
    if args.vpp < 1 or (args.vpp > 1 and args.pp < 2):
        raise DhpError(f"--vpp {args.vpp} must be at least 1, and interleaves chunks only with --pp 2 or more "
                       f"(got --pp {args.pp})")
    context = PlannerContext(dataset_max_tokens=longest)
    if args.time_limit is not None:
        context["time_limit_s"] = args.time_limit
    if args.max_groups_per_rank is not None and args.max_groups_per_rank < 0:
        raise DhpError(f"--max-groups-per-rank {args.max_groups_per_rank} must be >= 0 (0: no group family)")
    return context


def comm_policy(args: argparse.Namespace, name: str, config: CostConfig) -> CommPolicy:
    """The comm policy planner `name` plans under for the flags (--comm, --max-groups-per-rank) on the domain."""
    from megatron_dhp.solver import planner_comm_policy

    return planner_comm_policy(name, args.comm, world_size=config.world_size, gpus_per_node=config.gpus_per_node,
                               max_groups_per_rank=args.max_groups_per_rank)


def group_usage(used: dict[str, tuple[CommPolicy, set]]) -> str:
    """One line: the group family and, per planner, the distinct multi-rank groups its plans used (`used`:
    name -> (its comm policy, the rank tuples)) and, where it formed any group, how many ran p2p."""
    family = next((policy.family for policy, _ in used.values() if policy.family is not None), None)

    def count(policy: CommPolicy, groups: set) -> str:
        if policy.planning_family is not None:
            return f"{len(groups)}"
        if not policy.any_group:
            return f"{len(groups)} (any groups, each created when first needed)"
        return f"{len(groups)} (any groups; {policy.on_domain(groups)} on p2p)"

    counts = ", ".join(f"{name} {count(policy, groups)}" for name, (policy, groups) in used.items())
    return f"{family.summary() if family is not None else 'no group family'}; distinct multi-rank groups used: {counts}"


def add_planning_args(p: argparse.ArgumentParser, *, default_dist: str | None = None,
                      default_batch: int | None = None) -> None:
    """The workload, cost-model and planner flags of a command that plans batches."""
    add_workload_args(p, default_dist=default_dist, default_batch=default_batch)
    add_cost_args(p)
    add_planner_args(p)


@dataclass(frozen=True)
class PlanningInputs:
    """What a planning command plans: its batches under one cost config, and the facts planners get."""

    config: CostConfig
    source: LengthSource
    batches: list[Batch]
    context: PlannerContext
    pipeline_stages: int
    """P of --pp: the stages every plan is planned and priced at."""
    virtual_stages: int = 1
    """V of --vpp: model chunks per stage (interleaved 1F1B)."""


def planning_inputs(args: argparse.Namespace, *, first: int = 0, count: int = 1) -> PlanningInputs:
    """Batches `first` .. `first + count - 1` of the flags' workload (batch k depends only on the seed and k),
    the cost config of --cost with the domain flags, and the planner context of those batches."""
    config = CostConfig.load(args.cost).with_overrides(
        world_size=args.world_size, gpus_per_node=args.gpus_per_node, max_tokens_per_rank=args.max_tokens_per_rank,
        rank_speeds=load_rank_speeds(args.rank_speeds) if args.rank_speeds else None,
    )
    source, batches = draw_batches(args, config, range(first, first + count))
    return PlanningInputs(config, source, batches,
                          planner_context(args, dataset_max_tokens(source, batches, config.domain.capacity)), args.pp,
                          args.vpp)


def draw_batches(args: argparse.Namespace, config: CostConfig, indices: range) -> tuple[LengthSource, list[Batch]]:
    """The batches of the workload flags at these indices, cut to the domain with --truncate.

    Without --truncate a sample the domain cannot hold is left for `run_planner`, the one check of every plan.
    """
    source = LengthSource.from_args(lengths=args.lengths, dist=None if args.lengths else args.dist,
                                    merge=config.merge, whole=args.global_batch is None)
    capacity = config.domain.capacity
    batches = [source.draw(global_batch=args.global_batch, seed=args.seed, index=k, capacity=capacity) for k in indices]
    if args.truncate:
        batches = [fit_to_domain(b, capacity, truncate=True) for b in batches]
    return source, batches


def dataset_max_tokens(source: LengthSource, batches: list[Batch], capacity: int) -> int:
    """The longest sample of the dataset: the whole file, or every batch this run draws (capped at N x M)."""
    longest = source.max_tokens() or max(int(b.lengths.max()) for b in batches)
    return min(longest, capacity)
