"""The closed loop: plans that follow the ranks as they run, from what each rank measured.

Each rank times its slots (`runtime.slot_timer`); after a step it compares them with what the configured
cost model predicts for them at speed 1 and reports one ratio, rho = measured / predicted of its fastest
group (a multi-rank group's slot also holds the wait for its slowest member, so a rank's own speed shows in
the group where it waited least). The report rides with the next step's length gather, so every rank takes
in every report and holds the same estimate (`cost.speed_estimator`): each rank's speed, and the time scale
that brings the model's seconds to the machine's. The planner plans each step on the configured model
with those speeds, and its predicted times are scaled by that factor: slow ranks get less work, and
predicted step times converge on measured ones without a separate `profile` run.

Timing lags a step (the report of step t rides with the gather of step t + 2 under read-ahead), and the
estimate moves only past its hysteresis, so one slow step neither re-plans nor hides a real straggler.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import replace

from megatron_dhp.cost import CostConfig, CostModel, build_cost_model, simulate
from megatron_dhp.cost.speed_estimator import SpeedEstimate, SpeedEstimator
from megatron_dhp.plan.plan import Plan

MIN_SHARE = 0.1
"""A group counts toward a rank's speed when it holds at least this share of the rank's predicted time
(shorter ones are mostly timer noise and launch gaps)."""


class ClosedLoop:
    """Measured slots in, the model the planner plans with out (a `runtime.engine.Feedback`)."""

    def __init__(self, cost: CostConfig, *, adaptive: bool = True, window: int = 5, hysteresis: float = 0.1,
                 stated: tuple[float, ...] = ()) -> None:
        self.base = cost.with_overrides(rank_speeds=())
        """The configured coefficients at speed 1: what every report is measured against."""
        self.adaptive = adaptive
        """Whether reports move the estimate (off: the stated speeds and the configured scale stay)."""
        self._nominal = build_cost_model(self.base)
        self.estimator = SpeedEstimator(cost.world_size, window=window, hysteresis=hysteresis,
                                        initial=stated or cost.rank_speeds)
        self.last_step: tuple[float, float] | None = None
        """(predicted step, slowest rank's measured slots) of the last step reported, in seconds."""
        self._lock = threading.Lock()  # the planning thread reads the model while the main thread observes
        self._model: tuple[SpeedEstimate, CostModel] | None = None

    @property
    def estimate(self) -> SpeedEstimate:
        """The speeds and time scale the next plan uses."""
        with self._lock:
            return self.estimator.estimate

    def model(self) -> tuple[CostModel, float]:
        """The configured model with the estimated speeds, and the time scale its seconds need. Plans are made
        on the unscaled model (a uniform scale changes no decision, so all speeds 1 give the speed-blind
        plans exactly) and their times scaled (`rescale`)."""
        with self._lock:
            estimate = self.estimator.estimate
            if self._model is None or self._model[0].speeds != estimate.speeds:
                speeds = () if all(v == 1.0 for v in estimate.speeds) else estimate.speeds
                self._model = (estimate, build_cost_model(self.base.with_overrides(rank_speeds=speeds)))
            return self._model[1], estimate.time_scale

    @staticmethod
    def rescale(plan: Plan, time_scale: float) -> Plan:
        """The plan with its predicted step and lower bound in the machine's seconds."""
        if time_scale == 1.0 or plan.predicted_step_time_s is None:
            return plan
        bound = plan.lower_bound_s * time_scale if plan.lower_bound_s is not None else None
        return replace(plan, predicted_step_time_s=plan.predicted_step_time_s * time_scale, lower_bound_s=bound)

    def report(self, plan: Plan, position: int, slots: Sequence[tuple[tuple[int, ...], float]]) -> tuple[float, ...]:
        """(rho, seconds of this rank's timed slots of `plan`, the plan's predicted step); () without any."""
        if plan.pipeline_stages > 1:
            return ()
        predicted = self._slot_predictions(plan, position)
        sums: dict[int, list[float]] = {}
        for key, seconds in slots:
            hit = predicted.get(tuple(sorted(key)))
            if hit is not None:
                group, p = hit
                acc = sums.setdefault(group, [0.0, 0.0])
                acc[0] += seconds
                acc[1] += p
        total = sum(p for _, p in sums.values())
        ratios = [m / p for m, p in sums.values() if p > 0 and p >= MIN_SHARE * total]
        if not ratios:
            return ()
        return (min(ratios), sum(seconds for _, seconds in slots), plan.predicted_step_time_s or math.nan)

    def observe(self, reports: Sequence[Sequence[float]]) -> None:
        """Every rank's report of one step: update the estimate (adaptive only)."""
        if not self.adaptive:
            return
        ratios = [float(r[0]) if len(r) and math.isfinite(r[0]) else math.nan for r in reports]
        busy = [r[1] for r in reports if len(r) > 2 and math.isfinite(r[1])]
        if busy:
            self.last_step = (next(r[2] for r in reports if len(r) > 2 and math.isfinite(r[1])), max(busy))
        with self._lock:
            self.estimator.update(ratios)

    def summary(self) -> str:
        """One line: the slow ranks and the time scale."""
        estimate = self.estimate
        slow = " ".join(f"r{r}@{v:.2f}" for r, v in estimate.slow_ranks()) or "none"
        last = "" if self.last_step is None else (f" | last reported step: pred {self.last_step[0]:.3f}s meas "
                                                   f"{self.last_step[1]:.3f}s")
        return (f"closed loop: slow ranks {slow} | model time x{estimate.time_scale:.2f} | {estimate.steps} steps "
                f"measured{last}")

    def _slot_predictions(self, plan: Plan, position: int) -> dict[tuple[int, ...], tuple[int, float]]:
        """(group index, predicted seconds at speed 1) of each microbatch `position` runs, by its sample ids."""
        timeline = simulate(plan, self._nominal)
        out = {}
        for span in timeline.spans:
            group = plan.groups[span.group_index]
            if position in group.ranks:
                for mb, seconds in zip(group.microbatches, span.microbatch_s):
                    out[tuple(sorted(mb))] = (span.group_index, seconds)
        return out
