"""Calibration: time the model's forward+backward on this device and fit the cost model's coefficients.

Every grid point is a microbatch shape, k samples of L tokens on groups of d ranks, run three times back to back. All ranks work at once
(n // d disjoint groups of d; the remaining ranks idle), as they do in training, so the timing includes the
contention of a busy machine. Each point is timed like the train loop's "meas": from a barrier to the
slowest group rank's end of backward, the median of a few repetitions after a warm-up.

The fit is a least-squares fit of the reference form (BENCHMARK.md section 2, overlap_comm false, since
gloo collectives block), relative to each measurement so that short microbatches count as much as long:

    T(L, d, k) = m + lambda [d > 1] + k (s + (a L^2 + b L) / d + c L (d - 1) / d)

where c = gamma / bw is what the data determine about communication, and s (`sample_overhead_s`) and
lambda (`cp_microbatch_overhead_s`) are the cost model's two optional terms: per-sample work every rank of
a group repeats, and the collective latency of a multi-rank microbatch (see README). Coefficients are kept
non-negative by dropping a term that would go negative and fitting the rest again.
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

MICROBATCHES_PER_POINT = 3
"""Identical microbatches a group runs back to back per timing: a step's microbatches follow one another,
and a lone microbatch pays warm-up (allocator, caches) that a step amortises."""

TERMS = ("microbatch_overhead_s", "cp_microbatch_overhead_s", "sample_overhead_s", "attn_s_per_token2",
         "linear_s_per_token", "comm_s_per_token")


@dataclass(frozen=True)
class GridPoint:
    """One microbatch shape: `samples` samples of `length` tokens on groups of `group_size` ranks."""

    length: int
    group_size: int
    samples: int = 1

    def features(self) -> np.ndarray:
        """The point's row of the fit: coefficients of m, lambda, s, a, b, c."""
        L, d, k = float(self.length), float(self.group_size), float(self.samples)
        return np.array([1.0, float(d > 1), k, k * L * L / d, k * L / d, k * L * (d - 1) / d])


def default_grid(*, num_ranks: int, max_tokens_per_rank: int, lengths: tuple[int, ...] = ()) -> list[GridPoint]:
    """Lengths (default: powers of two from 64 to the domain's capacity) x group sizes 1..n that fit, each
    alone and packed 4 and 16 to a microbatch where that fits, so that m, s and the token terms separate."""
    cap = max_tokens_per_rank
    if not lengths:
        lengths = tuple(2**i for i in range(6, 40) if 2**i <= num_ranks * cap)
    return [GridPoint(L, d, k) for d in range(1, num_ranks + 1) for L in lengths for k in (1, 4, 16)
            if -(-k * L // d) <= cap]


def measure(config: TrainConfig, grid: list[GridPoint], reps: int) -> list[float]:
    """The median seconds of every grid point on this job (collective: every rank runs it).

    Repetitions go round the whole grid (a warm-up round first), so a burst of load from elsewhere on the
    machine spreads over all points instead of spoiling a few.
    """
    import torch
    import torch.distributed as dist

    from megatron_dhp.runtime.dispatch import dispatch, local_slice
    from megatron_dhp.runtime.domain import DynamicDomain
    from megatron_dhp.runtime.group_pool import GroupPool
    from megatron_dhp.runtime.step import run_step
    from megatron_dhp.training.model import build_model

    domain = DynamicDomain.from_parallel_state()
    pool = GroupPool(domain, max_groups=config.dhp.max_groups)
    model = build_model(config.model, seed=config.train.seed, layer_spec=config.dhp.layer_spec)
    steps = []
    for point in grid:
        plan, samples = _point_plan(point, domain.size, config)
        steps.append((plan, dispatch(local_slice(samples, domain.position, domain.size), domain, plan=plan)))
    times: list[list[float]] = [[] for _ in grid]
    for _ in range(reps + 1):
        for (plan, inputs), seen in zip(steps, times):
            pool.prepare(plan)
            model.zero_grad_buffer()
            dist.barrier(group=domain.group)
            start = time.perf_counter()
            run_step(model, inputs, pool, domain, comm=config.dhp.comm, backend=config.dhp.attention_backend,
                     grad_sync=False)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=domain.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seen.append(float(elapsed))
    return [statistics.median(seen[1:]) / MICROBATCHES_PER_POINT for seen in times]


def _point_plan(point: GridPoint, n: int, config: TrainConfig):
    """The plan of one grid point: n // d groups of d ranks, each `MICROBATCHES_PER_POINT` microbatches."""
    from megatron_dhp.plan.plan import Plan, PlanGroup
    from megatron_dhp.runtime.selfcheck import random_samples
    from megatron_dhp.workload.sample import Batch

    d, k, r = point.group_size, point.samples, MICROBATCHES_PER_POINT
    num_groups = n // d
    batch = Batch.from_lengths([point.length] * (k * r * num_groups))
    groups = [PlanGroup(tuple(range(g * d, (g + 1) * d)),
                        tuple(tuple(range((g * r + j) * k, (g * r + j + 1) * k)) for j in range(r)))
              for g in range(num_groups)]
    groups += [PlanGroup((r,), ()) for r in range(num_groups * d, n)]
    plan = Plan("profile", n, n, batch.samples, tuple(groups), max_tokens_per_rank=config.dhp.max_tokens_per_rank)
    return plan, random_samples(batch, vocab_size=config.model.vocab_size, seed=0)


def fit(grid: list[GridPoint], measured: list[float], *, terms: tuple[str, ...] = TERMS) -> dict[str, float]:
    """Non-negative relative least squares of `measured` on the grid's features; unused terms are 0."""
    x = np.stack([p.features() for p in grid])
    y = np.asarray(measured, dtype=np.float64)
    active = [i for i, name in enumerate(TERMS) if name in terms]
    while True:
        w = x[:, active] / y[:, None]
        coef, *_ = np.linalg.lstsq(w, np.ones_like(y), rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    out = dict.fromkeys(TERMS, 0.0)
    for i, c in zip(active, coef):
        out[TERMS[i]] = max(float(c), 0.0)
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
    return fit_report(config, grid, run_on_ranks(_measure_rank, config, grid, reps), reps=reps)


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


def _measure_rank(config: TrainConfig, grid: list[GridPoint], reps: int) -> list[float]:
    return measure(config, grid, reps)
