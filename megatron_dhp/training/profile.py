"""Calibration: time the model's forward+backward on this device and fit the cost model's coefficients.

Every grid point is a microbatch shape, k samples of L tokens on groups of d ranks, run three times back to
back; a few points are microbatches packed from the job's own data (mixed lengths, as training runs them).
All ranks work at once (n // d disjoint groups of d; the remaining ranks
idle), as they do in training, so the timing includes the contention of a busy machine. Each point is timed
like the train loop's "meas": from a barrier to the slowest group rank's end of backward, the median of a
few repetitions; repetitions go round the whole grid after a warm-up round.

The fit is a least-squares fit of the reference form (BENCHMARK.md section 2, overlap_comm false, since
gloo collectives block), relative to each measurement so that short microbatches count as much as long:

    T(L, d, k) = m + lambda [d > 1] + k (s + (a L^2 + b L) / d + c L (d - 1) / d)

where c = gamma / bw is what the data determine about communication, and s (`sample_overhead_s`) and
lambda (`cp_microbatch_overhead_s`) are the cost model's optional terms for per-sample work every rank of a
group repeats and the collective latency of a multi-rank microbatch (see README). Coefficients are kept
non-negative by an exact non-negative least-squares fit (`fit`).

The grid alone cannot see a step: between its rounds the job trains a few real steps (static and the
configured planner in turn), and the third optional term, the step overhead sigma (`step_overhead_s`),
becomes the median over those steps of measured minus predicted under the fit (`step_overhead`):
what a step adds to its microbatches (the gaps between them, the slower of two noisy ranks, caches cold
after the optimizer, the planning thread's share of the interpreter). The steps are then predicted under
the final model and printed against their measured time, the check of the whole model. (Refitting all
coefficients on the steps' own microbatches as well predicted the same fraction of later steps within
15 %, so the fit stays on the grid.)
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.errors import DhpError
from megatron_dhp.training.config import TrainConfig

REPEATS = 3
"""A grid point runs its microbatch this many times back to back: a lone microbatch would pay warm-up that a
step's microbatches do not (allocator, caches). All at exactly its shape: on a CPU a 1024-token sample on 2
ranks costs more than a L^2 curve through 768 and 896 tokens says, and mixing those in predicted it short."""

SAMPLE_COUNTS = (1, 2, 4, 8, 16)
"""Samples per microbatch at each grid length (where they fit): one rank's points then separate the linear
term b from the per-sample s and the fixed m, and a group's points separate b / d from communication."""

TERMS = ("microbatch_overhead_s", "cp_microbatch_overhead_s", "sample_overhead_s", "attn_s_per_token2",
         "linear_s_per_token", "comm_s_per_token")


@dataclass(frozen=True)
class GridPoint:
    """One microbatch shape: `samples` samples of `length` tokens on groups of `group_size` ranks, or, when
    `drawn` is set, samples of those lengths (a microbatch packed from the job's own data)."""

    length: int
    group_size: int
    samples: int = 1
    drawn: tuple[int, ...] = ()
    """The sample lengths of a data point (then `length` is the longest and `samples` their count)."""

    @classmethod
    def from_data(cls, lengths: Sequence[int], group_size: int) -> GridPoint:
        """A point of the given sample lengths, as the job's data packs them."""
        return cls(max(lengths), group_size, len(lengths), tuple(int(L) for L in lengths))

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sample lengths of the point's microbatch."""
        return self.drawn or (self.length,) * self.samples

    def microbatches(self) -> list[list[int]]:
        """The lengths of the point's microbatches, in the order they run."""
        return [list(self.lengths) for _ in range(REPEATS)]

    def describe(self) -> str:
        """The point's samples in a few characters: `4 x 128`, or `5 of 27-191 (data)`."""
        if self.drawn:
            return f"{self.samples} of {min(self.drawn)}-{self.length} (data)"
        return f"{self.samples} x {self.length}"

    def features(self) -> np.ndarray:
        """The point's row of the fit (per microbatch): coefficients of m, lambda, s, a, b, c."""
        d, lengths = float(self.group_size), self.lengths
        tokens = float(sum(lengths))
        return np.array([1.0, float(d > 1), len(lengths), sum(L * L for L in lengths) / d, tokens / d,
                         tokens * (d - 1) / d])


def default_grid(*, num_ranks: int, max_tokens_per_rank: int, lengths: tuple[int, ...] = ()) -> list[GridPoint]:
    """Lengths (default: powers of two from 64 to the domain's capacity) x group sizes 1..n, each packed
    `SAMPLE_COUNTS` to a microbatch where that fits, so that m, s and the token terms separate."""
    cap = max_tokens_per_rank
    if not lengths:
        lengths = tuple(2**i for i in range(6, 40) if 2**i <= num_ranks * cap)
    return [GridPoint(L, d, k) for d in range(1, num_ranks + 1) for L in lengths for k in SAMPLE_COUNTS
            if k * L <= d * cap]


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


class GridTimer:
    """Times every grid point on a live job, one round at a time (collective: every rank calls the same).

    Rounds go over the whole grid, so a burst of load from elsewhere on the machine spreads over all points
    instead of spoiling a few; a caller may also interleave rounds with training steps.
    """

    def __init__(self, config: TrainConfig, grid: list[GridPoint]) -> None:
        from megatron_dhp.runtime.dispatch import local_slice
        from megatron_dhp.runtime.domain import DynamicDomain
        from megatron_dhp.runtime.group_pool import GroupPool
        from megatron_dhp.training.model import build_model

        self.config = config
        self.domain = DynamicDomain.from_parallel_state()
        self.pool = GroupPool(self.domain, max_groups=config.dhp.max_groups)
        self.model = build_model(config.model, seed=config.train.seed, layer_spec=config.dhp.layer_spec)
        n, position = self.domain.size, self.domain.position
        self.steps = []
        for point in grid:
            plan, samples = _point_plan(point, n, config)
            self.steps.append((plan, local_slice(samples, position, n)))
        self.times: list[list[float]] = [[] for _ in grid]

    def round(self) -> None:
        """Time every point once: a barrier, its microbatches, the slowest rank's seconds per microbatch."""
        import torch
        import torch.distributed as dist

        from megatron_dhp.runtime.dispatch import dispatch
        from megatron_dhp.runtime.step import run_step

        dhp = self.config.dhp
        for (plan, local), seen in zip(self.steps, self.times):
            inputs = dispatch(local, self.domain, plan=plan)  # fresh every round, as every training step's are
            self.pool.prepare(plan)
            self.model.zero_grad_buffer()
            dist.barrier(group=self.domain.group)
            start = time.perf_counter()
            run_step(self.model, inputs, self.pool, self.domain, comm=dhp.comm, backend=dhp.attention_backend,
                     grad_sync=False)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=self.domain.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seen.append(float(elapsed) / REPEATS)

    def medians(self, *, skip: int = 0) -> list[float]:
        """Each point's median over its rounds, leaving out the first `skip` (warm-up)."""
        return [statistics.median(seen[skip:]) for seen in self.times]


CALIBRATION_WARMUP = 2
"""Calibration steps per planner left out of the step overhead: the first steps create groups, warm caches."""


def measure(config: TrainConfig, grid: list[GridPoint], reps: int,
            steps: int = 0) -> tuple[list[float], list[tuple[str, int, dict, float]]]:
    """One rank: every grid point's median seconds per microbatch over `reps` rounds (after a warm-up round),
    and, with `steps`, that many training steps under `static` and under the configured planner in turn:
    (planner, step, plan JSON, measured forward+backward seconds) of each step after warm-up.

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
    return timer.medians(skip=1), checked


def _point_plan(point: GridPoint, n: int, config: TrainConfig):
    """The plan of one grid point: n // d groups of d ranks, each running the point's microbatches."""
    from megatron_dhp.plan.plan import Plan, PlanGroup
    from megatron_dhp.runtime.selfcheck import random_samples
    from megatron_dhp.workload.sample import Batch

    d = point.group_size
    lengths, groups = [], []
    for g in range(n // d):
        microbatches = []
        for mb in point.microbatches():
            microbatches.append(tuple(range(len(lengths), len(lengths) + len(mb))))
            lengths += mb
        groups.append(PlanGroup(tuple(range(g * d, (g + 1) * d)), tuple(microbatches)))
    groups += [PlanGroup((r,), ()) for r in range(n // d * d, n)]
    batch = Batch.from_lengths(lengths)
    plan = Plan("profile", n, n, batch.samples, tuple(groups), max_tokens_per_rank=config.dhp.max_tokens_per_rank)
    return plan, random_samples(batch, vocab_size=config.model.vocab_size, seed=0)


def fit(grid: list[GridPoint], measured: list[float], *, terms: tuple[str, ...] = TERMS) -> dict[str, float]:
    """Non-negative relative least squares of `measured` on the grid's features; unused terms are 0.

    Exact: the non-negative optimum is the least-squares fit on some subset of the terms whose coefficients
    all come out non-negative, the one with the smallest residual, and six terms make 63 subsets to try.
    (Dropping the most negative term and refitting can drop one the data need, e.g. b when gloo's
    collectives also grow with L.)"""
    x = np.stack([p.features() for p in grid])
    y = np.asarray(measured, dtype=np.float64)
    w = x / y[:, None]
    target = np.ones_like(y)
    usable = [i for i, name in enumerate(TERMS) if name in terms]
    best: tuple[float, list[int], np.ndarray] | None = None
    for mask in range(1, 1 << len(usable)):
        active = [i for j, i in enumerate(usable) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(w[:, active], target, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(np.sum((w[:, active] @ coef - target) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, active, coef)
    out = dict.fromkeys(TERMS, 0.0)
    if best is not None:
        for i, c in zip(best[1], best[2]):
            out[TERMS[i]] = float(c)
    return out


def predict(grid: list[GridPoint], coefficients: dict[str, float]) -> np.ndarray:
    """The fitted seconds of every grid point."""
    c = np.array([coefficients[name] for name in TERMS])
    return np.stack([p.features() for p in grid]) @ c


NOMINAL_BYTES_PER_S = 1.0e9
"""The bandwidth written into a profiled YAML: the fit determines gamma / bw, so gamma is reported for it."""


@dataclass(frozen=True)
class ProfileReport:
    """Every grid point's measured and fitted seconds, the cost model they give, and its calibration steps."""

    grid: list[GridPoint]
    measured: list[float]
    fitted: list[float]
    cost: CostConfig
    steps: tuple[tuple[str, int, float, float], ...] = ()
    """(planner, step, predicted under `cost`, measured forward+backward seconds) of each calibration step
    after warm-up."""

    @property
    def errors(self) -> list[float]:
        """Relative error of the fit at each point: (fitted - measured) / measured."""
        return [(f - m) / m for f, m in zip(self.fitted, self.measured)]


def profile(config: TrainConfig, *, grid: list[GridPoint] | None = None, reps: int = 5,
            steps: int = 16) -> ProfileReport:
    """Time the grid on the configured job (spawning its ranks) between `steps` calibration steps per
    planner, fit a `kind: profiled` cost model, and set its step overhead sigma from those steps."""
    from megatron_dhp.cost import build_cost_model, simulate
    from megatron_dhp.plan.plan import Plan
    from megatron_dhp.training.job import run_on_ranks

    ranks = config.train.num_ranks // config.train.tp
    cap = config.dhp.max_tokens_per_rank
    grid = grid or default_grid(num_ranks=ranks, max_tokens_per_rank=cap) + data_grid(config)
    too_big = [p for p in grid if p.group_size > ranks or sum(p.lengths) > p.group_size * cap]
    if too_big:
        p = too_big[0]
        raise DhpError(f"grid point of {p.describe()} tokens on {p.group_size} ranks does not fit "
                       f"{ranks} ranks of {cap} tokens; drop it or raise dhp.max_tokens_per_rank")
    medians, checked = run_on_ranks(measure, config, grid, reps, steps)
    report = fit_report(config, grid, medians, reps=reps)
    model = build_cost_model(report.cost)
    predicted = [(name, step, simulate(Plan.from_dict(plan), model).step_time_s, measured)
                 for name, step, plan, measured in checked]
    sigma = step_overhead([(p, m) for _, _, p, m in predicted])
    return replace(report, cost=replace(report.cost, step_overhead_s=sigma),  # every step's start moves by sigma
                   steps=tuple((name, step, p + sigma, m) for name, step, p, m in predicted))


def step_overhead(steps: Sequence[tuple[float, float]]) -> float:
    """sigma: the median over (predicted, measured) steps of measured - predicted, at least 0 (the median
    keeps a step slowed by load from elsewhere from setting it)."""
    gaps = [measured - predicted for predicted, measured in steps]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def fit_report(config: TrainConfig, grid: list[GridPoint], measured: list[float], *, reps: int) -> ProfileReport:
    """Fit the measured grid and build the `kind: profiled` cost config of this job's domain."""
    ranks = config.train.num_ranks // config.train.tp
    c = fit(grid, measured)
    cost = CostConfig(
        kind="profiled", world_size=ranks, gpus_per_node=config.dhp.gpus_per_node or ranks,
        max_tokens_per_rank=config.dhp.max_tokens_per_rank, attn_s_per_token2=c["attn_s_per_token2"],
        linear_s_per_token=c["linear_s_per_token"], microbatch_overhead_s=c["microbatch_overhead_s"],
        comm_bytes_per_token=c["comm_s_per_token"] * NOMINAL_BYTES_PER_S, intra_node_bytes_per_s=NOMINAL_BYTES_PER_S,
        inter_node_bytes_per_s=NOMINAL_BYTES_PER_S, overlap_comm=False, sample_overhead_s=c["sample_overhead_s"],
        cp_microbatch_overhead_s=c["cp_microbatch_overhead_s"],
        description=(f"profiled: GPT {config.model.num_layers}x{config.model.hidden_size}, {ranks} ranks "
                     f"({config.dhp.comm}), {len(grid)} points x {reps} reps, {platform.node()} "
                     f"{time.strftime('%Y-%m-%d')}"),
    )
    return ProfileReport(grid, list(measured), predict(grid, c).tolist(), cost)
