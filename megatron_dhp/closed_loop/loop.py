"""The closed loop's deciding: the model plans use, from what each rank measured.

Each rank times its slots (`closed_loop.slot_clock`); after a step it compares them with what the configured
cost model predicts for them at speed 1 and reports one ratio, rho = measured / predicted of its fastest
group (a multi-rank group's slot also holds the wait for its slowest member, so a rank's own speed shows in
the group where it waited least), with the least-squares statistics of its slots against the model's
attention and other seconds. The report rides with the next step's length gather, so every rank takes in
every report and holds the same estimate: each rank's speed (`closed_loop.speed_estimator`) and two factors on
the model's own coefficients (`closed_loop.scale_fit`). The planner plans each step on the configured model so
corrected, with those speeds: slow ranks get less work, and predicted step times converge on measured ones
without a separate `profile` run.

Timing lags (the report of step t rides with the gather of step t + 2 under read-ahead), so the speeds are
predicted `LEAD` steps on along the trend they show; they move only past a band that is the hysteresis or the
reports' own noise, so a few noisy steps neither re-plan nor hide a real straggler.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from megatron_dhp.closed_loop.scale_fit import STATS, ScaleFit
from megatron_dhp.closed_loop.speed_estimator import SpeedEstimate, SpeedEstimator
from megatron_dhp.cost import CostConfig, CostModel, build_cost_model, simulate
from megatron_dhp.cost.simulate import PlanTimes
from megatron_dhp.plan.plan import Plan
from megatron_dhp.plan.rank_speeds import slow_ranks_text
from megatron_dhp.runtime.slot_timer import UNTIMED_UNDER_PP

FIT_WINDOWS = 4
"""The model's factors are fitted over this many speed windows of steps."""
COLD_STEPS = 1
"""The first timed steps fit nothing: they run cold (allocator, caches, lazy initialisation), up to several
times as long as the same work later."""
LEAD = 2
"""The report of step t plans step t + 2: under read-ahead (`runtime.engine`) step t + 1 is gathered, and its plan
begun, before step t runs. The speeds are predicted that many steps past the last report."""
MIN_SHARE = 0.1
"""A group counts toward a rank's speed when it holds at least this share of the rank's predicted time
(shorter ones are mostly timer noise and launch gaps)."""


@dataclass(frozen=True)
class RankReport:
    """One rank's report of a timed step (`ClosedLoop.report`). It travels as `WIDTH` floats with the next
    step's length gather (`collectives.gather_batch`), NaN-padded where a rank measured nothing."""

    ratio: float
    """rho: measured / predicted of its fastest group; NaN where every group it counts holds the whole domain
    (each rank measures the same there, which tells no rank's speed from the others')."""
    span: float
    """Seconds from its first slot's start to its last slot's end."""
    step: float
    """The plan's step under the current model, without sigma."""
    stats: tuple[float, ...]
    """The `scale_fit` statistics (`STATS` of them) of the groups it did not wait in."""

    WIDTH: ClassVar[int] = 3 + STATS

    def floats(self) -> tuple[float, ...]:
        """The report as it travels."""
        return (self.ratio, self.span, self.step, *self.stats)

    @staticmethod
    def ratio_in(row: Sequence[float]) -> float:
        """rho of a gathered row (NaN where it holds none)."""
        return float(row[0]) if len(row) and math.isfinite(row[0]) else math.nan

    @classmethod
    def read(cls, row: Sequence[float]) -> RankReport | None:
        """The report a gathered row holds; None where the rank measured nothing (a row of NaN) or sent only rho."""
        if len(row) != cls.WIDTH or not math.isfinite(row[1]):
            return None
        return cls(float(row[0]), float(row[1]), float(row[2]), tuple(float(x) for x in row[3:]))


class ClosedLoop:
    """Measured slots in, the model the planner plans with out (a `runtime.engine.Feedback`)."""

    def __init__(self, cost: CostConfig, *, adaptive: bool = True, window: int = 5, hysteresis: float = 0.1,
                 stated: tuple[float, ...] = (), pipeline_stages: int = 1) -> None:
        self.base = cost.with_overrides(rank_speeds=())
        """The configured coefficients at speed 1: what every report is measured against."""
        self.adaptive = adaptive and pipeline_stages == 1
        """Whether reports move the estimate (off: the stated speeds and the configured coefficients stay). Off
        under pipeline parallelism, whatever was asked: its slots are not timed (`UNTIMED_UNDER_PP`)."""
        self.off_note = (f"adaptive is off under pipeline parallelism ({pipeline_stages} stages): {UNTIMED_UNDER_PP}, "
                         "so plans use the stated speeds and the configured cost model"
                         if adaptive and not self.adaptive else None)
        """The start-up line that says why an `adaptive` job's loop is off (None where it runs or was not asked)."""
        self._nominal = build_cost_model(self.base)
        self.estimator = SpeedEstimator(cost.world_size, window=window, hysteresis=hysteresis, lead=LEAD,
                                        initial=stated or cost.rank_speeds)
        self.fit = ScaleFit(FIT_WINDOWS * window)
        """The model's own correction: factors on its attention and on its other seconds (over a longer window
        than the speeds: steps with long samples, which tell attention apart, come every few steps)."""
        self.hysteresis = hysteresis
        self._gaps: deque[float] = deque(maxlen=FIT_WINDOWS * window)
        self._sigma = cost.step_overhead_s
        """sigma, the step's seconds outside its slots' work (gaps between slots, Python, the first barrier):
        the median over the fit's window of the slowest rank's span less the plan's step without sigma."""
        self.last_step: tuple[float, float] | None = None
        """(predicted step with the fitted sigma, slowest rank's slot span) of the last step reported, in seconds."""
        self._timed = 0
        """Steps whose timings were reported so far."""
        self._lock = threading.Lock()  # the planning thread reads the model while the main thread observes
        self._models: dict[tuple, CostModel] = {}

    @property
    def estimate(self) -> SpeedEstimate:
        """The speeds the next plan uses."""
        with self._lock:
            return self.estimator.estimate

    def model(self) -> CostModel:
        """The configured model with its fitted factors, its measured sigma and the published speeds: what plans
        are made with."""
        with self._lock:
            return self._cached(self.estimator.estimate.speeds)

    def predictor(self) -> CostModel:
        """`model` with every rank at its measured speed (not rounded or held by the hysteresis, which keep
        plans steady): what the loop predicts a step's time with (`JobPlanner`)."""
        with self._lock:
            return self._cached(self.estimator.estimate.measured_speeds)

    def _cached(self, speeds: tuple[float, ...]) -> CostModel:
        """The configured model corrected as now, at `speeds` (one object per correction: equal speeds, same model)."""
        scales = self.fit.scales
        key = (speeds, scales, self._sigma if self.adaptive else None)
        if key not in self._models:
            config = self.base.scaled(scales.rest, scales.attention)
            if self.adaptive:  # sigma changes no decision: the measured one
                config = replace(config, step_overhead_s=self._sigma)
            nominal = () if all(v == 1.0 for v in speeds) else speeds
            if len(self._models) >= 2:  # the planning and the predicting model of now
                self._models.pop(next(iter(self._models)))
            self._models[key] = build_cost_model(config.with_overrides(rank_speeds=nominal))
        return self._models[key]

    width = RankReport.WIDTH
    """Floats in a report (the engine's `Feedback`: the length gather carries this many per rank)."""

    def report(self, plan: Plan, position: int, slots: Sequence[tuple[tuple[int, ...], float]],
               span: float) -> tuple[float, ...]:
        """This rank's `RankReport` of its timed slots of `plan`, as floats (() without any)."""
        if plan.pipeline_stages > 1:
            return ()
        predicted = self._slot_predictions(plan, position)
        sums: dict[int, list[float]] = {}
        rows: dict[int, list[tuple[float, float, float]]] = {}
        for key, seconds in slots:
            hit = predicted.get(tuple(sorted(key)))
            if hit is not None:
                group, p, attention = hit
                acc = sums.setdefault(group, [0.0, 0.0])
                acc[0] += seconds
                acc[1] += p
                rows.setdefault(group, []).append((seconds, attention, p - attention))
        total = sum(p for _, p in sums.values())
        ratios = {g: m / p for g, (m, p) in sums.items() if p > 0 and p >= MIN_SHARE * total}
        if not ratios:
            return ()
        fastest = min(ratios.values())
        stats = np.zeros(STATS)
        for group, ratio in ratios.items():  # groups where this rank hardly waited: its own time
            if ratio <= (1 + self.hysteresis) * fastest:
                for y, a, r in rows[group]:
                    stats += (a * a, a * r, r * r, a * y, r * y)
        # the plan's step under the current model without sigma (every rank starts at it, so it only adds):
        # what the span's excess is measured against
        model = self.model()
        step = simulate(plan, model).step_time_s - model.step_overhead_s
        alone = any(plan.groups[g].size < plan.world_size for g in ratios)
        return RankReport(fastest if alone else math.nan, span, step, tuple(stats.tolist())).floats()

    def observe(self, reports: Sequence[Sequence[float]]) -> None:
        """Every rank's report of one step: update the speeds and the model's factors (adaptive only)."""
        if not self.adaptive:
            return
        ratios = [RankReport.ratio_in(r) for r in reports]
        read = [RankReport.read(r) for r in reports]
        full = [r for r in read if r is not None]
        with self._lock:
            estimate = self.estimator.update(ratios)
            speeds = estimate.measured_speeds
            if not full:
                return
            self._timed += 1
            step, span = full[0].step, max(r.span for r in full)
            if self._timed > COLD_STEPS:
                rows = [r.stats if r is not None else (math.nan,) * STATS for r in read]
                before = self.fit.scales
                # each rank's seconds at speed 1 by its speed as now measured (slow ranks left out)
                slow = {r for r, _ in estimate.slow_ranks()}
                counted = [r not in slow for r in range(len(estimate.speeds))]
                after = self.fit.update(rows, speeds, counted=counted)
                if max(abs(after.attention / before.attention - 1), abs(after.rest / before.rest - 1)) > self.hysteresis:
                    self._gaps.clear()  # measured against a model that far off, the excess says little of sigma
                self._gaps.append(span - step)  # sigma: the slowest rank's span beyond the step without sigma
                self._sigma = max(0.0, float(np.median(self._gaps)))
            self.last_step = (step + self._sigma, span)

    def summary(self) -> str:
        """One line: the slow ranks (`plan.rank_speeds.slow_ranks_text`), the model's fitted factors and the last
        reported step."""
        estimate = self.estimate
        slow = slow_ranks_text(estimate.speeds) or "no slow ranks"
        scales = self.fit.scales
        last = "" if self.last_step is None else (f" | last reported step: pred {self.last_step[0]:.3f}s meas "
                                                   f"{self.last_step[1]:.3f}s")
        return (f"closed loop: {slow} | model x{scales.attention:.2f} attention, x{scales.rest:.2f} rest "
                f"| {estimate.steps} steps measured{last}")

    def _slot_predictions(self, plan: Plan, position: int) -> dict[tuple[int, ...], tuple[int, float, float]]:
        """(group index, predicted seconds at speed 1, its attention part as the model prices it,
        `CostModel.attention_time`) of each microbatch `position` runs, by its sample ids."""
        model = self._nominal.with_placement(plan.encoder_placement)
        own = [k for k, g in enumerate(plan.groups) if position in g.ranks]  # priced alone: a plan of thousands
        times = PlanTimes(replace(plan, groups=tuple(plan.groups[k] for k in own)), model)  # of groups costs ms
        out = {}
        for j, k in enumerate(own):
            group = plan.groups[k]
            for mb, seconds in zip(group.microbatches, times.group(j)[0]):
                attention = float(model.attention_time([plan.sample(i) for i in mb], group.size).sum())
                out[tuple(sorted(mb))] = (k, seconds, min(attention, seconds))
        return out
