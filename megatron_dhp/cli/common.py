"""Arguments and set-up shared by the planning sub-commands."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.cost.speeds import load_rank_speeds
from megatron_dhp.plan.comm import STEP_COMMS, CommPolicy
from megatron_dhp.plan.pipeline import interleaving_problem
from megatron_dhp.solver import PlannerContext
from megatron_dhp.workload.batches import LengthSource, fit_to_domain
from megatron_dhp.workload.megatron_corpus import (
    MEGATRON_SEED,
    MEGATRON_SPLIT,
    MEGATRON_SURPLUS,
    CorpusSpec,
    MegatronCorpus,
)
from megatron_dhp.workload.sample import Batch
from megatron_dhp.workload.synthetic import DISTRIBUTIONS


def add_workload_args(p: argparse.ArgumentParser, *, default_dist: str | None = None, default_batch: int | None = None) -> None:
    """--lengths/--dist/--data-path, --global-batch, --seed, --truncate, and Megatron-LM's data flags."""
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group(required=default_dist is None)
    src.add_argument("--lengths", metavar="FILE",
                     help="JSON array, JSONL or Megatron .bin/.idx prefix of sample lengths; a prefix is planned as "
                          "whole documents, drawn at random: for the rows Megatron feeds a run, use --data-path")
    src.add_argument("--dist", metavar="NAME", choices=sorted(DISTRIBUTIONS), default=default_dist,
                     help=f"named length distribution: {', '.join(DISTRIBUTIONS)} (see `megatron-dhp dists`)")
    src.add_argument("--data-path", nargs="+", metavar="PREFIX",
                     help="a Megatron corpus as Megatron-LM's --data-path takes it (PREFIX, PREFIX1 PREFIX2 ..., or "
                          "0.3 PREFIX1 0.7 PREFIX2): plan the steps of its train rows, shuffled and batched as "
                          "Megatron feeds them (needs --seq-length and --global-batch-size; see 'Megatron corpus')")
    g.add_argument("--global-batch", type=int, metavar="B",
                   help="samples per batch (" + (f"default {default_batch}; " if default_batch else "") +
                        "a --lengths file without it is taken whole as one batch; with --data-path a step is "
                        "--global-batch-size rows)")
    p.set_defaults(global_batch_default=default_batch)
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the batch draws (default 0); with --data-path Megatron's --seed, the seed of its "
                        f"shuffles (default {MEGATRON_SEED}, as Megatron-LM)")
    g.add_argument("--truncate", action="store_true",
                   help="cut samples longer than world_size x max_tokens_per_rank instead of failing")
    add_corpus_args(p)


def add_corpus_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's data flags, named and read as Megatron-LM reads them, for --data-path."""
    g = p.add_argument_group("Megatron corpus", "with --data-path: copy these from the run's command line; the rows "
                             "are Megatron's (megatron-core's GPTDataset, BlendedDataset and sampler)")
    g.add_argument("--seq-length", type=int, metavar="L", help="Megatron's --seq-length: tokens of a row (required)")
    g.add_argument("--global-batch-size", type=int, metavar="ROWS",
                   help="Megatron's --global-batch-size: rows per step over every data-parallel rank (required)")
    g.add_argument("--micro-batch-size", type=int, default=1, metavar="ROWS",
                   help="Megatron's --micro-batch-size: which data-parallel rank reads which row (default 1); the "
                        "data-parallel size is the domain's world size (--world-size)")
    g.add_argument("--split", default=MEGATRON_SPLIT,
                   help=f"Megatron's --split: train, valid, test weights; training reads the train part only "
                        f"(default {MEGATRON_SPLIT!r}, Megatron-LM's)")
    runs = g.add_mutually_exclusive_group()
    runs.add_argument("--train-iters", type=int, metavar="STEPS",
                      help="the run's --train-iters: the epochs it needs shape Megatron's shuffle, so the rows equal "
                           "the run's only with its value (default: as if the run were the steps planned here)")
    runs.add_argument("--train-samples", type=int, metavar="ROWS", help="the run's --train-samples (as --train-iters)")
    g.add_argument("--reset-position-ids", action="store_true", help="the run's --reset-position-ids")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="the run's --reset-attention-mask: plan each document piece of a row (the row cut after "
                        "every EOD, where positions restart) as megatron-dhp's run does; without it each row is one "
                        "sequence of --seq-length tokens")
    g.add_argument("--eod-token", type=int, metavar="ID",
                   help="the tokenizer's EOD id (NullTokenizer --vocab-size V: V); default: the token every "
                        "document of the corpus ends with (preprocessed with --append-eod)")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=MEGATRON_SURPLUS, metavar="F",
                   help=f"Megatron's --mid-level-dataset-surplus (default {MEGATRON_SURPLUS}): a blend's extra rows")


CORPUS_FLAGS = {
    "seq_length": ("--seq-length", None), "global_batch_size": ("--global-batch-size", None),
    "micro_batch_size": ("--micro-batch-size", 1), "split": ("--split", MEGATRON_SPLIT),
    "train_iters": ("--train-iters", None), "train_samples": ("--train-samples", None),
    "reset_position_ids": ("--reset-position-ids", False), "reset_attention_mask": ("--reset-attention-mask", False),
    "eod_token": ("--eod-token", None), "mid_level_dataset_surplus": ("--mid-level-dataset-surplus", MEGATRON_SURPLUS),
}
"""The Megatron corpus flags, which mean something only with --data-path: dest -> (flag, its default)."""


def corpus_spec(args: argparse.Namespace) -> CorpusSpec:
    """The `CorpusSpec` of --data-path and Megatron's data flags, with every combination the run refuses."""
    from megatron_dhp.errors import DhpError

    for dest, flag in (("seq_length", "--seq-length"), ("global_batch_size", "--global-batch-size")):
        if getattr(args, dest) is None:
            raise DhpError(f"--data-path needs {flag} (the run's Megatron flag)")
    if args.global_batch is not None:
        raise DhpError("--global-batch counts samples of --lengths or --dist; with --data-path a step is "
                       "--global-batch-size rows, as Megatron counts it")
    if args.reset_attention_mask and not args.reset_position_ids:
        raise DhpError("--reset-attention-mask needs --reset-position-ids, as megatron-dhp's run refuses it without: "
                       "it finds documents where positions restart")
    if args.train_iters is not None and args.train_iters < 1:
        raise DhpError(f"--train-iters {args.train_iters} must be a positive integer")
    train = args.train_samples if args.train_iters is None else args.train_iters * args.global_batch_size
    return CorpusSpec(tuple(args.data_path), seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                      micro_batch_size=args.micro_batch_size, split=args.split,
                      seed=MEGATRON_SEED if args.seed is None else args.seed, train_samples=train,
                      split_documents=args.reset_attention_mask, eod=args.eod_token,
                      mid_level_dataset_surplus=args.mid_level_dataset_surplus)


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
    problem = interleaving_problem(args.pp, args.vpp, ("--pp", "--vpp"))
    if problem is not None:
        raise DhpError(problem)
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
    source_name: str
    """What reports call the batches' source: a file's name, a distribution's, or the corpus's blend."""
    batches: list[Batch]
    context: PlannerContext
    pipeline_stages: int
    """P of --pp: the stages every plan is planned and priced at."""
    virtual_stages: int = 1
    """V of --vpp: model chunks per stage (interleaved 1F1B)."""
    corpus: MegatronCorpus | None = None
    """With --data-path: the corpus the batches are steps of (batch k is step first + k)."""


def planning_inputs(args: argparse.Namespace, *, first: int = 0, count: int = 1) -> PlanningInputs:
    """Batches `first` .. `first + count - 1` of the flags' workload (batch k depends only on the seed and k;
    with --data-path, step k of the run), the cost config of --cost with the domain flags, and the planner
    context of those batches."""
    config = CostConfig.load(args.cost).with_overrides(
        world_size=args.world_size, gpus_per_node=args.gpus_per_node, max_tokens_per_rank=args.max_tokens_per_rank,
        rank_speeds=load_rank_speeds(args.rank_speeds) if args.rank_speeds else None,
    )
    indices = range(first, first + count)
    capacity = config.domain.capacity
    if args.data_path:
        corpus, batches = corpus_steps(args, config, indices)
        # The run plans for --seq-length, its longest possible sequence, whatever this step's longest is.
        longest = min(corpus.spec.seq_length, capacity)
        return PlanningInputs(config, corpus.describe(), batches, planner_context(args, longest), args.pp, args.vpp,
                              corpus)
    _refuse_corpus_flags(args)
    source, batches = draw_batches(args, config, indices)
    return PlanningInputs(config, source.name, batches,
                          planner_context(args, dataset_max_tokens(source, batches, capacity)), args.pp, args.vpp)


def corpus_steps(args: argparse.Namespace, config: CostConfig, indices: range) -> tuple[MegatronCorpus, list[Batch]]:
    """Megatron's train dataset of --data-path, built with a spinner (minutes on a large corpus), and the
    batches of steps `indices` on the domain's data-parallel ranks, cut to the domain with --truncate."""
    from rich.console import Console
    from rich.progress import Progress

    spec = corpus_spec(args)
    console = Console(stderr=True)
    with console.status("building Megatron's train dataset (document, sample and shuffle indices) with megatron-core"):
        corpus = MegatronCorpus.open(spec, data_parallel=config.world_size, steps=indices.stop)
    batches = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"reading the rows of {len(indices)} step(s)", total=len(indices))
        for k in indices:
            batches.append(corpus.batch(k))
            progress.advance(task)
    if args.truncate:
        batches = [fit_to_domain(b, config.domain.capacity, truncate=True) for b in batches]
    return corpus, batches


def _refuse_corpus_flags(args: argparse.Namespace) -> None:
    """Megatron's data flags read a corpus: without --data-path they would be ignored, so they are refused."""
    from megatron_dhp.errors import DhpError

    given = [flag for dest, (flag, default) in CORPUS_FLAGS.items() if getattr(args, dest) != default]
    if given:
        raise DhpError(f"{given[0]} is a flag of a Megatron corpus; it needs --data-path PREFIX (or drop it)")


def draw_batches(args: argparse.Namespace, config: CostConfig, indices: range) -> tuple[LengthSource, list[Batch]]:
    """The batches of the workload flags at these indices, cut to the domain with --truncate.

    Without --truncate a sample the domain cannot hold is left for `run_planner`, the one check of every plan.
    """
    global_batch = args.global_batch if args.global_batch is not None else args.global_batch_default
    source = LengthSource.from_args(lengths=args.lengths, dist=None if args.lengths else args.dist,
                                    merge=config.merge, whole=global_batch is None)
    capacity = config.domain.capacity
    seed = 0 if args.seed is None else args.seed
    batches = [source.draw(global_batch=global_batch, seed=seed, index=k, capacity=capacity) for k in indices]
    if args.truncate:
        batches = [fit_to_domain(b, capacity, truncate=True) for b in batches]
    return source, batches


def dataset_max_tokens(source: LengthSource, batches: list[Batch], capacity: int) -> int:
    """The longest sample of the dataset: the whole file, or every batch this run draws (capped at N x M)."""
    longest = source.max_tokens() or max(int(b.lengths.max()) for b in batches)
    return min(longest, capacity)
