"""Rank speeds, estimated from what each rank measured against what was predicted.

Every step each rank reports rho = measured / predicted seconds of its slots (`closed_loop.loop`
forms it), the prediction taken at speed 1 under the configured coefficients. A rank that is twice as slow
reports about 2; a model whose coefficients are 3x too small makes every rank report about 3. So:

* per rank, the median of its last `window` reports (one outlier step moves no median), from its third
  report on (the first steps run with cold caches);
* the time scale kappa: the median of those over the fast ranks, the ones within `hysteresis` of the
  fastest (speed 1 is a healthy rank of this machine: the newer generation of a mixed cluster);
* each rank's raw speed kappa / rho_r, at the nearest point of the one speed grid (powers of 1.02,
  `plan.rank_speeds`: the grid the bounds price on); published only when it moved more than
  `hysteresis` from the published one, so noise within that band never re-plans, while a real straggler
  (or a recovery) is published as soon as its median moves.

Pure numbers: every rank feeds the same gathered reports and holds the same estimate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.rank_speeds import on_speed_grid, slow_ranks

MIN_REPORTS = 3
"""A rank's speed is estimated once it has reported this many steps (or the whole window, if shorter)."""


@dataclass(frozen=True)
class SpeedEstimate:
    """What the estimator publishes: each rank's speed and the factor the model's times need."""

    speeds: tuple[float, ...]
    """Relative speed per domain position (1.0 where a rank is within the hysteresis of typical)."""
    time_scale: float
    """kappa: measured over predicted of the fast ranks, the level the speeds are relative to (the model's own
    correction is `closed_loop.scale_fit`'s)."""
    steps: int
    """Reports taken in so far."""
    measured: tuple[float, ...] = ()
    """Each rank's speed as last measured (kappa over its median, neither rounded nor held by the hysteresis;
    the published speed where it has too few reports): what the loop predicts steps and fits the model's
    factors with, while plans use the published `speeds` (empty: the same)."""

    @property
    def measured_speeds(self) -> tuple[float, ...]:
        """`measured`, or `speeds` where none were measured yet."""
        return self.measured or self.speeds

    def slow_ranks(self) -> list[tuple[int, float]]:
        """(position, speed) of the ranks published slow (`plan.rank_speeds.slow_ranks`), slowest first."""
        return slow_ranks(self.speeds)


class SpeedEstimator:
    """Smoothed per-rank speeds from per-step measured / predicted ratios."""

    def __init__(self, world_size: int, *, window: int = 5, hysteresis: float = 0.1,
                 initial: Sequence[float] = ()) -> None:
        if window < 1:
            raise DhpError(f"adaptive_window = {window} must be at least 1 step")
        if not 0 <= hysteresis < 1:
            raise DhpError(f"adaptive_hysteresis = {hysteresis} must be in [0, 1) (a fraction of a rank's speed)")
        self.world_size = world_size
        self.window = window
        self.hysteresis = hysteresis
        self._history: list[deque[float]] = [deque(maxlen=window) for _ in range(world_size)]
        self._speeds = tuple(float(v) for v in initial) or (1.0,) * world_size
        self._scale = 1.0
        self._steps = 0
        self._measured: tuple[float, ...] = ()

    @property
    def estimate(self) -> SpeedEstimate:
        """The published speeds and their level."""
        return SpeedEstimate(self._speeds, self._scale, self._steps, self._measured)

    def update(self, ratios: Sequence[float]) -> SpeedEstimate:
        """Take one step's measured / predicted ratio of every rank (NaN: no measurement) and republish."""
        if len(ratios) != self.world_size:
            raise DhpError(f"{len(ratios)} speed reports for a domain of {self.world_size} ranks")
        seen = False
        for history, ratio in zip(self._history, ratios):
            if math.isfinite(ratio) and ratio > 0:
                history.append(float(ratio))
                seen = True
        if not seen:
            return self.estimate
        self._steps += 1
        # a rank's first reports (start-up: caches cold, the first step's set-up) estimate nothing alone
        enough = min(MIN_REPORTS, self.window)
        medians = np.array([np.median(h) if len(h) >= enough else np.nan for h in self._history])
        if not np.isfinite(medians).any():
            return self.estimate
        known = medians[np.isfinite(medians)]
        self._scale = float(np.median(known[known <= (1 + self.hysteresis) * known.min()]))
        raw = np.where(np.isfinite(medians), self._scale / medians, np.array(self._speeds))
        self._speeds = tuple(self._publish(old, float(new)) for old, new in zip(self._speeds, raw))
        self._measured = tuple(round(float(v), 6) for v in raw)
        return self.estimate

    def _publish(self, old: float, new: float) -> float:
        """The new speed where it left the band around the published one, else the published one; a rank back
        within the band around 1 publishes exactly 1 (the speed-blind plan's numbers)."""
        if abs(new - 1.0) <= self.hysteresis < abs(old - 1.0):
            return 1.0
        if abs(new / old - 1.0) <= self.hysteresis:
            return old
        return 1.0 if abs(new - 1.0) <= self.hysteresis else float(on_speed_grid(new))
