"""`megatron-dhp selftest`: prove on this machine (or cluster) that the runtime is exact.

Builds a tiny GPT on every rank, runs K random plans (group sizes that are not powers of two, several
phases, each communication variant in turn, every other plan with uneven shards: random shares on its groups
of several ranks within the token cap, `plan.shares`), or one given plan (`--plan FILE`, a plan JSON from a job,
under each variant), and compares the loss and every parameter gradient with a single-process run of
megatron-core's own attention on the same batch. With `--pp P` the model is split into P pipeline stages
run by megatron-core's 1F1B (`runtime.pipeline`); with `--model moe` every MLP is megatron-core's MoE layer
(4 experts, top-2), its experts split over `--ep` ranks carved from the domain; with `--model vlm` the model
is an InternVL-shaped vision-language model (`models.vlm`) whose samples carry images, encoded under each
`--placement` in turn (vision tower and projector gradients compared too). Exits 1 on any mismatch.

Without a torchrun environment it spawns `--nproc` local ranks itself; under torchrun (any backend,
e.g. NCCL on a cluster) it runs as one of the ranks and rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace

from megatron_dhp.cost.speeds import parse_slowdowns
from megatron_dhp.plan.comm import STEP_COMMS
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK
from megatron_dhp.plan.pipeline import interleaving_problem
from megatron_dhp.runtime.attention import BACKENDS


@dataclass(frozen=True)
class SelftestOptions:
    """Everything a rank needs; built from the command line, sent to spawned ranks as is."""

    tensor_parallel: int
    pipeline_parallel: int
    sequence_parallel: bool
    plans: int
    seed: int
    comms: tuple[str, ...]
    backend: str
    samples: int
    max_len: int
    attention: str
    timeout_s: int
    model: str = "gpt"
    """`gpt` (dense), `moe` (megatron-core's MoE layer in every layer), `mla` (multi-latent attention) or `vlm`."""
    expert_parallel: int = 1
    moe_dispatcher: str = "alltoall"
    plan_file: str | None = None
    """A plan JSON to replay instead of random plans (its domain size must be nproc / (tp x pp))."""
    placements: tuple[str, ...] = CONCRETE_PLACEMENTS
    """Encoder placements used in turn (--model vlm)."""
    family: int = DEFAULT_MAX_GROUPS_PER_RANK
    """Create the group family of this bound at start-up and draw the random plans' groups from it; 0: any
    groups, non-contiguous ones included, created as plans need them."""
    mtp_layers: int = 0
    """Multi-token prediction layers on the model (megatron-core's MTP block); 0: none."""
    slow_ranks: tuple[str, ...] = ()
    """`RANK:FACTOR`: those ranks hold each slot FACTOR times as long, and `dhp` plans every batch with the
    matching speeds (1 / FACTOR) instead of random plans."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B); 1: non-interleaved."""
    fsdp: bool = False
    """Shard the model over the domain with megatron-core's torch FSDP2 wrapper instead of its DDP."""
    gpus_per_node: int = 0
    """The domain's positions per node (0: all, one node): the family and the random plans' groups cross nodes
    where it is smaller."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `selftest`."""
    every_comm = ",".join(STEP_COMMS)
    p = sub.add_parser(
        "selftest",
        help="check the runtime against a single-process run (loss and every gradient)",
        description="Run K random plans on a tiny GPT over N ranks and compare loss and every parameter "
        "gradient with a single-process megatron-core run on the same batch. Runs under torchrun "
        "as is; otherwise spawns --nproc local ranks.",
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not under torchrun (default 4)")
    p.add_argument("--tp", type=int, default=1, help="static tensor-parallel size (default 1)")
    p.add_argument("--sp", action="store_true",
                   help="megatron's sequence parallelism over the --tp ranks (needs --tp > 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel stages, run by megatron-core's non-interleaved 1F1B (default 1)")
    p.add_argument("--vpp", type=int, default=1, metavar="V",
                   help="model chunks per pipeline stage, run by megatron-core's interleaved 1F1B (needs --pp 2 "
                        "or more; the model gets --pp x V layers if it has fewer; default 1)")
    p.add_argument("--model", choices=("gpt", "moe", "mla", "vlm"), default="gpt",
                   help="tiny dense GPT; with megatron-core's MoE layer (4 experts, top-2); with DeepSeek's "
                        "multi-latent attention (V heads narrower than Q/K, a separate RoPE part); or an "
                        "InternVL-shaped vision-language model whose samples carry images (default gpt)")
    p.add_argument("--placement", default=",".join(CONCRETE_PLACEMENTS),
                   help=f"with --model vlm: comma-separated encoder placements, used in turn (default {','.join(CONCRETE_PLACEMENTS)})")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size, carved from the domain's ranks (with --model moe; default 1)")
    p.add_argument("--mtp", type=int, default=0, metavar="K",
                   help="K multi-token prediction layers (megatron-core's MTP block, its loss and its token roll "
                        "checked too; --tp 1, not with --model vlm; default 0)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights and gradients over the domain with megatron-core's torch FSDP2 wrapper "
                        "(--tp 1, --pp 1, a dense text model) instead of its DDP")
    p.add_argument("--moe-dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                   help="megatron-core's MoE token dispatcher (default alltoall)")
    p.add_argument("--plans", type=int, default=6, metavar="K", help="random plans to check (default 6)")
    p.add_argument("--plan", metavar="FILE", default=None,
                   help="check this plan JSON (e.g. one saved by a job) under each --comm variant instead of "
                        "random plans; its world size must be the domain size nproc / (tp x pp)")
    p.add_argument("--family", type=int, default=DEFAULT_MAX_GROUPS_PER_RANK, metavar="K",
                   help="create the group family of at most K groups per rank at start-up (as training does) and "
                        "draw the random plans' groups from it; 0: any groups, non-contiguous ones included "
                        f"(default {DEFAULT_MAX_GROUPS_PER_RANK})")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                   help="the domain's positions per node (default 0: one node); smaller, the family's groups and the "
                        "random plans' (with --family 0, any rank sets) cross nodes")
    p.add_argument("--slow-rank", action="append", metavar="RANK:FACTOR",
                   help="make global rank RANK hold each slot FACTOR times as long, and plan every batch with dhp "
                        "at the matching rank speeds instead of at random (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of batches, plans and weights (default 0)")
    p.add_argument("--comm", default=every_comm,
                   help=f"comma-separated CP variants, used in turn (default {every_comm})")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="torch.distributed backend (default gloo)")
    p.add_argument("--samples", type=int, default=12, metavar="B", help="samples per batch (default 12)")
    p.add_argument("--max-len", type=int, default=40, metavar="L", help="longest sample in tokens (default 40)")
    p.add_argument("--attention", choices=tuple(BACKENDS), default="auto",
                   help="local attention kernel (default auto)")
    p.add_argument("--timeout", type=int, default=120, metavar="S", help="collective timeout in seconds (default 120)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="spawn more than twice as many ranks as there are cores (refused otherwise)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then run as a torchrun rank or spawn the ranks and wait for them."""
    from megatron_dhp.closed_loop.injection import check_injected_ranks, check_injection
    from megatron_dhp.errors import DhpError

    comms = tuple(c.strip() for c in args.comm.split(",") if c.strip())
    unknown = [c for c in comms if c not in STEP_COMMS]
    if unknown or not comms:
        raise DhpError(f"--comm {args.comm!r}: use a comma-separated subset of {','.join(STEP_COMMS)}")
    if args.family < 0:
        raise DhpError(f"--family {args.family} must be >= 0 (0: any groups)")
    if args.gpus_per_node < 0:
        raise DhpError(f"--gpus-per-node {args.gpus_per_node} must be >= 0 (0: the whole domain is one node)")
    for flag, value in (("--plans", args.plans), ("--samples", args.samples), ("--max-len", args.max_len),
                        ("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep), ("--vpp", args.vpp)):
        if value < 1:
            raise DhpError(f"{flag} {value} must be at least 1")
    problem = interleaving_problem(args.pp, args.vpp, ("--pp", "--vpp"))
    if problem is not None:
        raise DhpError(problem)
    if args.vpp > 1 and (args.model not in ("gpt", "moe") or args.mtp or args.plan):
        raise DhpError(f"--vpp {args.vpp} runs a text model without --mtp or --plan (got --model {args.model}, "
                       f"--mtp {args.mtp}{', --plan' if args.plan else ''})")
    if args.fsdp and (args.tp > 1 or args.pp > 1 or args.model not in ("gpt", "mla") or args.mtp):
        raise DhpError(f"--fsdp shards a dense text model over the domain: it needs --tp 1, --pp 1, --model gpt or "
                       f"mla and no --mtp (got --tp {args.tp}, --pp {args.pp}, --model {args.model}, --mtp {args.mtp})")
    if args.sp and args.tp < 2:
        raise DhpError(f"--sp splits sequences over the tensor-parallel ranks; it needs --tp 2 or more (got --tp {args.tp})")
    placements = tuple(c.strip() for c in args.placement.split(",") if c.strip())
    if not placements or any(p not in CONCRETE_PLACEMENTS for p in placements):
        raise DhpError(f"--placement {args.placement!r}: use a comma-separated subset of {','.join(CONCRETE_PLACEMENTS)}")
    if args.model == "mla" and args.tp > 1:
        raise DhpError(f"--model mla runs with --tp 1 (got --tp {args.tp}): under TP megatron-core 0.16.1's local "
                       "MLA does not sum the gradient of its shared RoPE key part over the TP ranks' heads (the rows "
                       "of linear_kv_down_proj differ from one process's even with groups of one rank)")
    if args.model == "vlm" and (args.tp > 1 or args.pp > 1):
        raise DhpError(f"--model vlm runs with --tp 1 and --pp 1 (got --tp {args.tp} --pp {args.pp}): its vision tower "
                       "is replicated over the domain")
    if args.ep > 1 and (args.model != "moe" or args.pp > 1):
        raise DhpError(f"--ep {args.ep} splits the experts of --model moe; it needs --model moe and --pp 1")
    if args.mtp < 0 or (args.mtp and (args.tp > 1 or args.ep > 1 or args.model == "vlm")):
        raise DhpError(f"--mtp {args.mtp} must be >= 0, with --tp 1, --ep 1 and a text model (got --tp {args.tp}, "
                       f"--ep {args.ep}, --model {args.model}): the one-process oracle runs megatron's MTP block, "
                       "whose cross entropy reads the job's tensor-parallel group and whose MoE layer takes its "
                       "experts from the job's expert-parallel state")
    plan_file = None
    if args.plan is not None:
        from megatron_dhp.plan.plan import Plan

        Plan.load(args.plan)  # a missing or malformed file fails here, before any rank starts
        plan_file = os.path.abspath(args.plan)
    options = SelftestOptions(args.tp, args.pp, args.sp, args.plans, args.seed, comms, args.backend, args.samples,
                              args.max_len, args.attention, args.timeout, args.model, args.ep, args.moe_dispatcher,
                              plan_file, placements, args.family, args.mtp, tuple(args.slow_rank or ()), args.vpp,
                              args.fsdp, args.gpus_per_node)
    parse_slowdowns(options.slow_ranks)  # a malformed RANK:FACTOR fails here, before any rank starts
    check_injection(options.slow_ranks, args.pp, given="--slow-rank", stages="--pp")  # untimed under 1F1B
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_torchrun and (args.nproc < 1 or args.nproc % (args.tp * args.pp * args.ep)):
        stages = f" x --pp {args.pp}" if args.pp > 1 else ""
        experts = f" x --ep {args.ep}" if args.ep > 1 else ""
        raise DhpError(f"--nproc {args.nproc} must be a positive multiple of --tp {args.tp}{stages}{experts}")
    check_injected_ranks(options.slow_ranks, int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc)
    if under_torchrun:
        return worker(options)

    from megatron_dhp.launch.ranks import LaunchError, check_oversubscription, launch

    check_oversubscription(args.nproc, oversubscribe=args.oversubscribe, timeout="--timeout")

    try:
        statuses = launch(worker, args.nproc, options, timeout_s=max(600, 4 * args.timeout))
    except LaunchError as e:
        print(f"megatron-dhp selftest: {e}", file=sys.stderr)
        return 1
    return max(statuses)


def worker(options: SelftestOptions) -> int:
    """One rank: check every plan; rank 0 prints. Returns 0 if all plans matched, 1 on a mismatch, 2 on an error."""
    import random
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from megatron_dhp.cost.config import Domain
    from megatron_dhp.errors import DhpError
    from megatron_dhp.launch.cpu_shim import apply_cpu_compat
    from megatron_dhp.models.gpt import TinyGPTConfig
    from megatron_dhp.models.vlm import TinyVLMConfig, random_vlm_samples
    from megatron_dhp.plan.plan import Plan
    from megatron_dhp.runtime.attention.kernels import describe
    from megatron_dhp.runtime.distributed import init_distributed
    from megatron_dhp.solver.random_plan import random_plan
    from megatron_dhp.verify.selfcheck import TOLERANCE, SelfCheck, random_samples
    from megatron_dhp.workload.sample import Batch

    if options.backend == "gloo":
        apply_cpu_compat()
    init_distributed(backend=options.backend, tensor_parallel=options.tensor_parallel,
                     pipeline_parallel=options.pipeline_parallel, expert_parallel=options.expert_parallel,
                     virtual_pipeline=options.virtual_pipeline, seed=options.seed,
                     timeout=timedelta(seconds=options.timeout_s))
    lead = dist.get_rank() == 0
    try:
        given = Plan.load(options.plan_file) if options.plan_file is not None else None
        longest = max((s.tokens for s in given.samples), default=0) if given is not None else options.max_len
        chunks = options.pipeline_parallel * options.virtual_pipeline if options.virtual_pipeline > 1 else 0
        config = TinyGPTConfig(max_sequence_length=max(TinyGPTConfig.max_sequence_length, longest),
                               num_layers=max(TinyGPTConfig.num_layers, chunks),
                               sequence_parallel=options.sequence_parallel,
                               num_experts=4 if options.model == "moe" else 0,
                               moe_token_dispatcher=options.moe_dispatcher, mtp_num_layers=options.mtp_layers,
                               multi_latent_attention=options.model == "mla")
        vlm = TinyVLMConfig(language=config) if options.model == "vlm" else None
        slowdowns = parse_slowdowns(options.slow_ranks)
        check = SelfCheck(config=config, seed=options.seed, backend=options.attention, vlm=vlm,
                          slowdowns=slowdowns, virtual=options.virtual_pipeline,
                          fsdp=options.fsdp, gpus_per_node=options.gpus_per_node or None)
        n = check.domain.size
        check.use_family(options.family)
        if lead:
            pp = f", PP {options.pipeline_parallel}" if options.pipeline_parallel > 1 else ""
            pp += f" x VPP {options.virtual_pipeline} ({config.num_layers} layers)" if options.virtual_pipeline > 1 else ""
            pp += ", torch FSDP2 over the domain" if options.fsdp else ""
            sp = " + SP" if options.sequence_parallel else ""
            moe = (f", MoE 4 experts top-2 ({options.moe_dispatcher}), EP {options.expert_parallel}"
                   if options.model == "moe" else "")
            if vlm is not None:
                tower = vlm.tower
                moe = (f", VLM: ViT {tower.layers}x{tower.hidden_size} over tiles of {tower.patches_per_tile} "
                       f"patches -> {tower.tokens_per_tile} tokens, placements {','.join(options.placements)}")
            mtp = f", MTP {options.mtp_layers}" if options.mtp_layers else ""
            mtp += ", MLA (Q/K 16 + 8 RoPE, V 12, latents 32 / 24)" if options.model == "mla" else ""
            nodes = f" ({check.gpus_per_node} a node)" if check.gpus_per_node < n else ""
            print(f"selftest: {dist.get_world_size()} ranks ({dist.get_backend()}), TP {options.tensor_parallel}"
                  f"{sp}{pp}{moe}{mtp}, domain of {n}{nodes}, tolerance {TOLERANCE:g}, "
                  f"{describe(options.attention, check.domain.device, (torch.float32,))}", flush=True)
            family = check.policy("mixed").family
            print(family.summary() if family is not None else "groups: any (--family 0)", flush=True)
        rng = random.Random(options.seed)
        domain = Domain(world_size=n, gpus_per_node=check.gpus_per_node, max_tokens_per_rank=options.max_len)
        failures = 0
        runs = len(options.comms) if given is not None else options.plans
        for k in range(runs):
            comm = options.comms[k % len(options.comms)]
            if given is not None:
                plan, batch = given, Batch(given.samples)
            else:
                batch = Batch.from_lengths([rng.randint(1, options.max_len) for _ in range(options.samples)])
                # on the family the planner would keep to under this comm (none under p2p and mixed)
                family = check.policy(comm).planning_family
                plan = (speed_plan(batch, check.domain.global_ranks, slowdowns, options.max_len, family,
                                   check.gpus_per_node) if slowdowns
                        else random_plan(batch, domain, rng, family=family, uneven=float(k % 2)))
                if options.virtual_pipeline > 1:  # its slot order; random plans check exactness, not memory
                    plan = replace(plan, pipeline_stages=options.pipeline_parallel,
                                   virtual_stages=options.virtual_pipeline, max_tokens_per_rank=None)
            placement = options.placements[k % len(options.placements)]
            samples = (random_vlm_samples(batch, vlm, seed=options.seed + k) if vlm is not None
                       else random_samples(batch, vocab_size=check.config.vocab_size, seed=options.seed + k))
            result = check.check(plan, samples, comm, placement=placement)
            failures += not result.ok
            if lead:
                sizes = "+".join(f"{len(g.ranks)}" + (f"({':'.join(map(str, g.shares))})" if g.shares else "")
                                 + ("" if is_window(g.ranks) else "@" + ".".join(map(str, sorted(g.ranks))))
                                 for g in plan.groups)
                images = f" | {sum(len(s.images) for s in samples)} images, {placement:9s}" if vlm is not None else ""
                label = comm if comm != "mixed" else (  # how rank 0's slots resolved it
                    "mixed: " + ",".join(f"{c} {n}" for c, n in sorted(result.slots_by_comm.items())))
                print(f"plan {k}: {plan.summary()} [sizes {sizes}] | {label:9s}{images} | loss {result.loss:.6f} | "
                      f"max abs dloss {result.max_loss_diff:.1e} | max abs dgrad {result.max_grad_diff:.1e} | "
                      f"tokens {result.tokens_computed}/{result.batch_tokens} | {'ok' if result.ok else 'MISMATCH'}",
                      flush=True)
        if lead:
            print(f"{check.pool.summary()}; "
                  f"{'all plans exact' if not failures else f'{failures} of {runs} plans MISMATCH'}", flush=True)
        return 1 if failures else 0
    except DhpError as e:
        print(f"megatron-dhp selftest: rank {dist.get_rank()}: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()


def is_window(ranks) -> bool:
    """Whether a group's ranks are contiguous (the step line names the ranks of any other group)."""
    return max(ranks) - min(ranks) + 1 == len(ranks)


def speed_plan(batch, global_ranks, slowdowns: dict[int, float], max_len: int, family, gpus_per_node: int):
    """dhp's plan of `batch` on the domain of `global_ranks`, each rank at speed 1 / its slowdown (the CPU
    preset's coefficients, half of `max_len` tokens per rank, so that long samples need groups)."""
    from megatron_dhp.cost import CostConfig, build_cost_model
    from megatron_dhp.solver import build_planner, run_planner

    n = len(global_ranks)
    speeds = tuple(1.0 / slowdowns.get(rank, 1.0) for rank in global_ranks)
    cap = max(-(-max_len // n), max_len // 2)
    cost = CostConfig.load("tiny-gpt-cpu").with_overrides(world_size=n, gpus_per_node=gpus_per_node, max_tokens_per_rank=cap,
                                                         rank_speeds=speeds)
    return run_planner(build_planner("dhp"), batch, build_cost_model(cost), family=family)
