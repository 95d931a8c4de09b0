"""Calibration: time the model's forward+backward on this device and fit the cost model's coefficients.

Every grid point is a microbatch shape, k samples of about L tokens on groups of d ranks, run three times back
to back at 3/4, 7/8 and all of L. All ranks work at once (n // d disjoint groups of d; the remaining ranks
idle), as they do in training, so the timing includes the contention of a busy machine. Each point is timed
like the train loop's "meas": from a barrier to the slowest group rank's end of backward, the median of a
few repetitions; repetitions go round the whole grid after a warm-up round.

The fit is a least-squares fit of the reference form (BENCHMARK.md section 2, overlap_comm false, since
gloo collectives block), relative to each measurement so that short microbatches count as much as long:

    T(L, d, k) = m + lambda [d > 1] + k (s + (a L^2 + b L) / d + c L (d - 1) / d)

where c = gamma / bw is what the data determine about communication, and s (`sample_overhead_s`) and
lambda (`cp_microbatch_overhead_s`) are the cost model's two optional terms: per-sample work every rank of
a group repeats, and the collective latency of a multi-rank microbatch (see README). Coefficients are kept
non-negative by an exact non-negative least-squares fit (`fit`).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.errors import DhpError
from megatron_dhp.training.config import TrainConfig

LENGTH_FACTORS = (0.75, 0.875, 1.0)
"""A grid point runs three microbatches back to back, its samples at these fractions of its length: a step's
microbatches follow one another with new shapes each time, and a lone microbatch would pay warm-up that a
step does not (allocator, caches)."""

TERMS = ("microbatch_overhead_s", "cp_microbatch_overhead_s", "sample_overhead_s", "attn_s_per_token2",
         "linear_s_per_token", "comm_s_per_token")


@dataclass(frozen=True)
class GridPoint:
    """One microbatch shape: `samples` samples of about `length` tokens on groups of `group_size` ranks."""

    length: int
    group_size: int
    samples: int = 1

    def microbatches(self) -> list[list[int]]:
        """The lengths of the point's microbatches, in the order they run."""
        return [[max(1, round(self.length * f))] * self.samples for f in LENGTH_FACTORS]

    def features(self) -> np.ndarray:
        """The point's row of the fit (per microbatch, averaged): coefficients of m, lambda, s, a, b, c."""
        d = float(self.group_size)
        rows = [[1.0, float(d > 1), len(mb), sum(L * L for L in mb) / d, sum(mb) / d, sum(mb) * (d - 1) / d]
                for mb in self.microbatches()]
        return np.mean(np.array(rows, dtype=np.float64), axis=0)


def default_grid(*, num_ranks: int, max_tokens_per_rank: int, lengths: tuple[int, ...] = ()) -> list[GridPoint]:
    """Lengths (default: powers of two from 64 to the domain's capacity) x group sizes 1..n that fit, each
    alone and packed 4 and 16 to a microbatch where that fits, so that m, s and the token terms separate."""
    cap = max_tokens_per_rank
    if not lengths:
        lengths = tuple(2**i for i in range(6, 40) if 2**i <= num_ranks * cap)
    return [GridPoint(L, d, k) for d in range(1, num_ranks + 1) for L in lengths for k in (1, 4, 16)
            if -(-k * L // d) <= cap]


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
            seen.append(float(elapsed) / len(LENGTH_FACTORS))

    def medians(self, *, skip: int = 0) -> list[float]:
        """Each point's median over its rounds, leaving out the first `skip` (warm-up)."""
        return [statistics.median(seen[skip:]) for seen in self.times]


def measure(config: TrainConfig, grid: list[GridPoint], reps: int) -> list[float]:
    """The median seconds per microbatch of every grid point: a warm-up round, then `reps` rounds."""
    timer = GridTimer(config, grid)
    for _ in range(reps + 1):
        timer.round()
    return timer.medians(skip=1)


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
    """Every grid point's measured and fitted seconds, and the cost model they give."""

    grid: list[GridPoint]
    measured: list[float]
    fitted: list[float]
    cost: CostConfig

    @property
    def errors(self) -> list[float]:
        """Relative error of the fit at each point: (fitted - measured) / measured."""
        return [(f - m) / m for f, m in zip(self.fitted, self.measured)]


def profile(config: TrainConfig, *, grid: list[GridPoint] | None = None, reps: int = 5) -> ProfileReport:
    """Time the grid on the configured job (spawning its ranks) and fit a `kind: profiled` cost model."""
    from megatron_dhp.training.job import run_on_ranks

    ranks = config.train.num_ranks // config.train.tp
    cap = config.dhp.max_tokens_per_rank
    grid = grid or default_grid(num_ranks=ranks, max_tokens_per_rank=cap)
    too_big = [p for p in grid if p.group_size > ranks or -(-p.samples * p.length // p.group_size) > cap]
    if too_big:
        p = too_big[0]
        raise DhpError(f"grid point of {p.samples} x {p.length} tokens on {p.group_size} ranks does not fit "
                       f"{ranks} ranks of {cap} tokens; drop it or raise dhp.max_tokens_per_rank")
    return fit_report(config, grid, run_on_ranks(measure, config, grid, reps), reps=reps)


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
