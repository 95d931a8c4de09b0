"""Timing microbatch shapes (`GridPoint`s) on a live job, for the cost model's fit.

Every grid point is a microbatch shape, k samples of L tokens on groups of d ranks, run `REPEATS` times back
to back; a few points are microbatches packed from the job's own data (`data_grid`: mixed lengths, as
training runs them). All ranks work at once (n // d disjoint groups of d; the remaining ranks idle), as they
do in training, so the timing includes the contention of a busy machine. Each point is timed like the train
loop's "meas": from a barrier to the slowest group rank's end of backward, the median of a few repetitions;
repetitions go round the whole grid after a warm-up round (`GridTimer`). `measure` spreads those rounds
between a few real training steps, the calibration steps that set the step overhead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from megatron_dhp.cost.fit import GridPoint
from megatron_dhp.training.config import TrainConfig

REPEATS = 3
"""A grid point runs its microbatch this many times back to back: a lone microbatch would pay warm-up that a
step's microbatches do not (allocator, caches). All at exactly its shape: on a CPU a 1024-token sample on 2
ranks costs more than a L^2 curve through 768 and 896 tokens says, and mixing those in predicted it short."""

ENCODER_TILES = 64
"""Tiles each rank encodes (forward and backward) per round to time a vision tower, when the model has one."""

CALIBRATION_WARMUP = 2
"""Calibration steps per planner left out of the step overhead: the first steps create groups, warm caches."""


def data_grid(config: TrainConfig, *, per_size: int = 4) -> list[GridPoint]:
    """`per_size` microbatches for each group size, packed from the job's first batches in data order.

    Training microbatches mix lengths (a few long samples and many short ones, none a round number); uniform
    points alone leave the fit to extrapolate to them, and on a CPU it then predicted such microbatches
    about 7 % short. Packing keeps the plans' cap (`Plan.validate`): samples in order while sum L <= d M."""
    from megatron_dhp.training.data import TokenPipeline

    if per_size < 1:
        return []
    ranks = config.train.num_ranks // config.train.tp
    cap = config.dhp.max_tokens_per_rank
    pipeline = TokenPipeline(config.data, vocab_size=config.model.vocab_size, capacity=ranks * cap,
                             truncate=config.dhp.truncate)
    lengths = [int(L) for k in range(max(1, config.train.steps)) for L in pipeline.batch(k).lengths]
    points = []
    for d in range(1, ranks + 1):
        packed: list[int] = []
        for L in (L for L in lengths if L <= d * cap):
            if packed and sum(packed) + L > d * cap:
                points.append(GridPoint.from_data(packed, d))
                packed = []
                if sum(p.group_size == d for p in points) == per_size:
                    break
            packed.append(L)
    return points


def microbatches(point: GridPoint) -> list[list[int]]:
    """The lengths of a point's microbatches, in the order they run: its one shape, `REPEATS` times."""
    return [list(point.lengths) for _ in range(REPEATS)]


def point_plan(point: GridPoint, n: int, config: TrainConfig):
    """The plan of one grid point: n // d groups of d ranks, each running the point's microbatches."""
    from megatron_dhp.plan.plan import Plan, PlanGroup
    from megatron_dhp.verify.selfcheck import random_samples
    from megatron_dhp.workload.sample import Batch

    d = point.group_size
    lengths, groups = [], []
    for g in range(n // d):
        group = []
        for mb in microbatches(point):
            group.append(tuple(range(len(lengths), len(lengths) + len(mb))))
            lengths += mb
        groups.append(PlanGroup(tuple(range(g * d, (g + 1) * d)), tuple(group)))
    groups += [PlanGroup((r,), ()) for r in range(n // d * d, n)]
    batch = Batch.from_lengths(lengths)
    plan = Plan("profile", n, n, batch.samples, tuple(groups), max_tokens_per_rank=config.dhp.max_tokens_per_rank)
    return plan, random_samples(batch, vocab_size=config.model.vocab_size, seed=0)


class GridTimer:
    """Times every grid point on a live job, one round at a time (collective: every rank calls the same).

    Rounds go over the whole grid, so a burst of load from elsewhere on the machine spreads over all points
    instead of spoiling a few; a caller may also interleave rounds with training steps.
    """

    def __init__(self, config: TrainConfig, grid: list[GridPoint]) -> None:
        import torch.distributed as dist

        from megatron_dhp.integration.job_spec import JobSpec
        from megatron_dhp.runtime.domain import DynamicDomain
        from megatron_dhp.runtime.group_pool import GroupPool
        from megatron_dhp.runtime.step_data import local_slice
        from megatron_dhp.training.model import build_model

        self.config = config
        self.domain = DynamicDomain.from_parallel_state()
        self.model = build_model(config.model, seed=config.train.seed, layer_spec=config.dhp.layer_spec,
                                 vision=config.vision)
        spec = JobSpec.for_domain(config.dhp, self.domain, world_size=dist.get_world_size(),
                                  tensor_parallel=config.train.tp, sequence_parallel=config.model.sequence_parallel)
        self.engine = spec.engine(self.domain, GroupPool(self.domain, max_groups=config.dhp.max_groups),
                                  policy=spec.policy.for_profiling())
        n, position = self.domain.size, self.domain.position
        self.steps = []
        for point in grid:
            plan, samples = point_plan(point, n, config)
            self.steps.append((plan, local_slice(samples, position, n)))
        self.times: list[list[float]] = [[] for _ in grid]
        self.encoder_times: list[float] = []
        """Seconds per encoder token of each round's tiles (a vision-language model only)."""

    def round(self) -> None:
        """Time every point once: a barrier, its microbatches, the slowest rank's seconds per microbatch."""
        import torch
        import torch.distributed as dist

        from megatron_dhp.runtime.step import run_step

        for (plan, local), seen in zip(self.steps, self.times):
            inputs = self.engine.prepare(local, plan)  # fresh every round, as every training step's are
            self.model.zero_grad_buffer()
            dist.barrier(group=self.domain.group)
            start = time.perf_counter()
            run_step(self.engine, self.model, inputs)
            walked = time.perf_counter() - start - self.engine.finish_s  # forward and backward, not the reduction
            elapsed = torch.tensor([walked], dtype=torch.float64, device=self.domain.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seen.append(float(elapsed) / REPEATS)
        vlm = self.model.module
        if hasattr(vlm, "encode"):  # the encoder's forward and backward, every rank at once, as a step runs it
            tower = vlm.vlm_config.tower
            pixels = torch.randn(ENCODER_TILES, 3, tower.tile_px, tower.tile_px, generator=torch.Generator().manual_seed(0))
            dist.barrier(group=self.domain.group)
            start = time.perf_counter()
            vlm.encode(pixels).sum().backward()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=self.domain.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            self.encoder_times.append(float(elapsed) / (ENCODER_TILES * tower.patches_per_tile))

    def medians(self, *, skip: int = 0) -> list[float]:
        """Each point's median over its rounds, leaving out the first `skip` (warm-up)."""
        return [statistics.median(seen[skip:]) for seen in self.times]


def measure(config: TrainConfig, grid: list[GridPoint], reps: int,
            steps: int = 0) -> tuple[list[float], list[tuple[str, int, dict, float]], float]:
    """One rank: every grid point's median seconds per microbatch over `reps` rounds (after a warm-up round);
    with `steps`, that many training steps under `static` and under the configured planner in turn:
    (planner, step, plan JSON, measured forward+backward seconds) of each step after warm-up; and the vision
    tower's median seconds per encoder token (0 without one).

    The rounds are spread between the steps, so that the grid and the steps see the same machine: on a shared
    one, load from other jobs changes speed by 10-20 % from one minute to the next. The steps plan with the
    configured cost model; `profile` re-predicts them under the fitted one."""
    from megatron_dhp.training.loop import Trainer

    timer = GridTimer(config, grid)
    timer.round()  # warm-up
    checked, rounds = [], 0
    if steps:
        run = replace(config, train=replace(config.train, steps=steps, save=None, load=None))
        trainers = [Trainer(run.with_overrides(dhp={"planner": p})) for p in dict.fromkeys(("static", config.dhp.planner))]
        for k, records in enumerate(zip(*(t.steps() for t in trainers))):
            if k >= CALIBRATION_WARMUP:
                checked += [(t.config.dhp.planner, r.step, t.last_plan.to_dict(), r.measured_s)
                            for t, r in zip(trainers, records)]
            while rounds < (k + 1) * reps // steps:
                timer.round()
                rounds += 1
    for _ in range(rounds, reps):
        timer.round()
    encoder = statistics.median(timer.encoder_times[1:]) if timer.encoder_times else 0.0
    return timer.medians(skip=1), checked, encoder
