"""Calibration: time the model's forward+backward on this device and fit the cost model's coefficients.

`profile` runs the steps in order: the grid (`cost.fit.default_grid`, plus `timing.data_grid` from the job's
data) -> its timing on the job's ranks (`timing.measure`) -> the fit (`cost.fit`) -> the step overhead from
calibration steps -> a `ProfileReport`.

The grid alone cannot see a step: between its rounds the job trains a few real steps (static and the
configured planner in turn), and the third optional term, the step overhead sigma (`step_overhead_s`),
becomes the median over those steps of measured minus predicted under the fit (`cost.fit.step_overhead`):
what a step adds to its microbatches (the gaps between them, the slower of two noisy ranks, caches cold
after the optimizer, the planning thread's share of the interpreter). The steps are then predicted under
the final model and printed against their measured time, the check of the whole model. (Refitting all
coefficients on the steps' own microbatches as well predicted the same fraction of later steps within
15 %, so the fit stays on the grid.)
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, replace

from megatron_dhp.cost.config import CostConfig
from megatron_dhp.cost.fit import GridPoint, default_grid, fit, predict, profiled_cost, step_overhead
from megatron_dhp.errors import DhpError
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.timing import data_grid, measure


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

    def calibration_summary(self) -> str:
        """One line on the calibration steps: sigma, and how many of them the final model predicts within 15 %."""
        from megatron_dhp.training.train import steps_within

        within = steps_within([p for _, _, p, _ in self.steps], [m for *_, m in self.steps])
        planners = " and ".join(dict.fromkeys(planner for planner, *_ in self.steps))
        return (f"step overhead sigma {self.cost.step_overhead_s * 1e3:.2f} ms; {within}/{len(self.steps)} "
                f"calibration steps ({planners}) predicted within 15%")


def profile(config: TrainConfig, *, grid: list[GridPoint] | None = None, reps: int = 5,
            steps: int = 16) -> ProfileReport:
    """Time the grid on the configured job (spawning its ranks) between `steps` calibration steps per
    planner, fit a `kind: profiled` cost model, and set its step overhead sigma from those steps."""
    from megatron_dhp.cost import build_cost_model, simulate
    from megatron_dhp.plan.plan import Plan
    from megatron_dhp.training.job import run_on_ranks

    if config.train.pp > 1:
        raise DhpError(f"train.pp = {config.train.pp}: profiling times groups without a pipeline and needs "
                       "train.pp = 1 (demo: add --no-calibrate)")
    ranks = config.train.num_ranks // config.train.tp
    cap = config.dhp.max_tokens_per_rank
    grid = grid or default_grid(num_ranks=ranks, max_tokens_per_rank=cap) + data_grid(config)
    too_big = [p for p in grid if p.group_size > ranks or sum(p.lengths) > p.group_size * cap]
    if too_big:
        p = too_big[0]
        raise DhpError(f"grid point of {p.describe()} tokens on {p.group_size} ranks does not fit "
                       f"{ranks} ranks of {cap} tokens; drop it or raise dhp.max_tokens_per_rank")
    import torch

    medians, checked, encoder = run_on_ranks(measure, config, grid, reps, steps)
    # the ranks ran gloo on CPU cores where no GPU is seen (`job.rank_main`): their collectives are core work
    report = fit_report(config, grid, medians, reps=reps, encoder_s_per_token=encoder,
                        comm_on_cores=not torch.cuda.is_available())
    model = build_cost_model(report.cost)
    predicted = [(name, step, simulate(Plan.from_dict(plan), model).step_time_s, measured)
                 for name, step, plan, measured in checked]
    sigma = step_overhead([(p, m) for _, _, p, m in predicted])
    return replace(report, cost=replace(report.cost, step_overhead_s=sigma),  # every step's start moves by sigma
                   steps=tuple((name, step, p + sigma, m) for name, step, p, m in predicted))


def fit_report(config: TrainConfig, grid: list[GridPoint], measured: list[float], *, reps: int,
               encoder_s_per_token: float = 0.0, comm_on_cores: bool = False) -> ProfileReport:
    """Fit the measured grid and build the `kind: profiled` cost config of this job's domain; a vision
    tower's measured seconds per encoder token become its linear term f (its blocks are all one tile long,
    so a per-block square term would not be told apart from it), with the job's encoder placement.
    `comm_on_cores`: the collectives ran on the ranks' cores (gloo on CPU), so a slow rank's slow them too
    (`CostConfig.speed_scales_comm`)."""
    ranks = config.train.num_ranks // config.train.tp
    c = fit(grid, measured)
    cost = profiled_cost(
        c, world_size=ranks, gpus_per_node=config.dhp.gpus_per_node or ranks,
        max_tokens_per_rank=config.dhp.max_tokens_per_rank,
        description=(f"profiled: GPT {config.model.num_layers}x{config.model.hidden_size}, {ranks} ranks "
                     f"({config.dhp.comm}), {len(grid)} points x {reps} reps, {platform.node()} "
                     f"{time.strftime('%Y-%m-%d')}"),
    )
    cost = replace(cost, speed_scales_comm=comm_on_cores)
    if encoder_s_per_token:
        cost = replace(cost, enc_linear_s_per_token=encoder_s_per_token,
                       encoder_placement=config.dhp.encoder_placement or cost.encoder_placement)
    return ProfileReport(grid, list(measured), predict(grid, c).tolist(), cost)
