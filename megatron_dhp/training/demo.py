"""The demo: the same training job under several planners, on the same batches, compared side by side.

Only the planner changes between runs: same config, same weights, same data order, same ranks. Each run's
steps are timed as the train loop times them, so the comparison is wall time on this machine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.train import TrainResult, train


@dataclass(frozen=True)
class DemoResult:
    """Every planner's run, in the order they ran."""

    runs: dict[str, TrainResult]

    def speedup(self, baseline: str = "static", candidate: str = "dhp") -> float:
        """Median step time of `baseline` over that of `candidate`."""
        return self.runs[baseline].median_step_s / self.runs[candidate].median_step_s

    def paired_speedup(self, baseline: str = "static", candidate: str = "dhp") -> float:
        """Median over steps of the per-step ratio (the same batch under both planners)."""
        a, b = self.runs[baseline].records, self.runs[candidate].records
        return statistics.median(x.wall_s / y.wall_s for x, y in zip(a, b))

    def showcase_step(self, planner: str) -> int:
        """Index of the step whose plan under `planner` mixes the most group sizes (the one worth plotting)."""
        plans = self.runs[planner].plans
        return max(range(len(plans)), key=lambda i: (len({len(g["ranks"]) for g in plans[i]["groups"]}), -i))


def run_demo(config: TrainConfig, planners: tuple[str, ...] = ("static", "dhp"), *, lines: bool = True) -> DemoResult:
    """Train `config` once per planner (changing nothing else) and collect the runs."""
    runs = {}
    fresh = replace(config, train=replace(config.train, save=None, load=None))  # every run starts from the same weights
    for name in planners:
        runs[name] = train(fresh.with_overrides(dhp={"planner": name}), show=True, lines=lines)
    return DemoResult(runs)


def save_plan_plot(result: DemoResult, path: str | Path) -> int:
    """Draw each planner's plan of the showcase step (Gantt under the run's cost model); returns the step."""
    from megatron_dhp.cost import build_cost_model, simulate
    from megatron_dhp.plan.plan import Plan
    from megatron_dhp.viz import save_simulation_figure

    index = result.showcase_step(list(result.runs)[-1])
    any_run = next(iter(result.runs.values()))
    model = build_cost_model(any_run.cost)  # the one the runs planned with
    plans = [Plan.from_dict(run.plans[index]) for run in result.runs.values()]
    ratios = {name: statistics.mean(p["predicted_step_time_s"] / p["lower_bound_s"] for p in run.plans)
              for name, run in result.runs.items()}
    save_simulation_figure(path, [(p, simulate(p, model)) for p in plans], ratios)
    return any_run.records[index].step
