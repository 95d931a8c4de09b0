"""Rank speeds, estimated from what each rank measured against what was predicted, and predicted for the step
they plan.

Every step each rank reports rho = measured / predicted seconds of its slots (`closed_loop.loop` forms it), the
prediction taken at speed 1 under the configured coefficients. A rank that is twice as slow reports about 2; a
model whose coefficients are 3x too small makes every rank report about 3. So:

* each step's reports are taken against the step's median rank, log(median rho / rho_r): a rank's speed beside
  the others in the same step. What every rank shares cancels: the machine's load, cold caches, the model's
  error on that batch. (Each rank's median of its own rho did not cancel it: on the 2-rank multimodal demo,
  steps swung between 0.5 and 1.3 of predicted on both ranks together, each rank's median picked a different
  step's level, and equal ranks were published at 0.80 while their step-by-step ratio was within 3 % in 6 of
  7 steps);
* per rank, `LogSpeedPredictor` over those: the median of its last `window` reports (one outlier step moves
  no median) carried along its trend to the step the estimate plans, from its third report on (the first
  steps run with cold caches);
* the fast ranks are those whose median is within `hysteresis` of the fastest one's; each rank's speed is its
  prediction over theirs (speed 1 is a healthy rank of this machine: the newer generation of a mixed cluster),
  and the time scale kappa is their measured over predicted;
* a speed is published at the nearest point of the one speed grid (powers of 1.02, `plan.rank_speeds`: the
  grid the bounds price on), and only once it left a band around the published one: `hysteresis`, or
  `NOISE_Z` standard errors of a rank's median where the reports are noisier than that. The noise is
  measured, not assumed: the reports' mean absolute change from step to step over `TREND_WINDOWS` windows,
  pooled over the ranks. A rank leaves 1 only when its median, not its trend, is out of the band (a few slow
  steps in a row are a trend to a line fit). On the shared 2-core VM one rank's slots ran 20-35 % long for 2 to
  4 steps in a row in some runs, which the fixed 10 % band published as a straggler after it had passed; a
  rank at half speed (0.69 in log, against a band of 0.14 in the median step there, 0.28 at the 90th
  percentile) is still published at its third slow report.

Pure numbers: every rank feeds the same gathered reports and holds the same estimate.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.rank_speeds import on_speed_grid, slow_ranks

MIN_REPORTS = 3
"""A rank's speed is estimated once it has reported this many steps (or the whole window, if shorter)."""
TREND_WINDOWS = 4
"""Trends and the reports' noise are measured over this many windows of steps."""
NOISE_Z = 4.0
"""A speed moves only past this many standard errors of a rank's median (and past the hysteresis): under
+-15 % uniform noise on every report no step of 2,000 published a slow rank, on 2 ranks or 8 (at 3: 13 and 40
steps did); under +-5 % a rank at half speed was published at its third report, as under the hysteresis alone."""
MEDIAN_SE = math.sqrt(math.pi / 2)
"""A median of n normal draws scatters this many times as much as their mean: sigma * MEDIAN_SE / sqrt(n)."""


def _median(values: np.ndarray, axis: int | None = 0) -> np.ndarray:
    """`np.nanmedian`, NaN without a warning where a slice holds no value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=axis)


def theil_sen(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Each column's Theil-Sen slope over its rows taken at `steps` (the median of its pairwise slopes: one outlier
    in five moves it little), NaN rows skipped; 0 where a column has fewer than two values."""
    first, second = np.triu_indices(len(steps), 1)
    slopes = (values[second] - values[first]) / (steps[second] - steps[first])[:, None]
    return np.nan_to_num(_median(slopes)) if len(first) else np.zeros(values.shape[1])


def predict_log_speeds(history: np.ndarray, *, window: int, lead: float = 1.0) -> np.ndarray:
    """`LogSpeedPredictor`'s prediction `lead` steps after the last row of `history` (steps x ranks, log speeds,
    NaN where a rank did not report; at most `TREND_WINDOWS` windows of rows), fed one row at a time."""
    predictor = LogSpeedPredictor(window)
    for row in history:
        predictor.update(row)
    return predictor.predict(lead)


class LogSpeedPredictor:
    """Each rank's log speed predicted from its reports, by whichever of two predictors was closer one step
    ahead over the last `window` steps (pooled over the ranks): `smoothed_log_speeds` (noisy reports, trends),
    or each rank's last report (a random walk, whose best prediction it is: a smoothed walk lags). The data
    decides, not a setting. Each predictor is scored on the predictions it made, so an update prices one
    smoothing. One-step-ahead RMS error (log), window 5, 64 ranks, 200 steps, 3 % lognormal noise,
    smoothed -> this fed step by step (the last report alone): 0.029 -> 0.029 (0.036) on a ramp of 2 % a
    step, 0.017 -> 0.017 (0.030) on a flat speed, 0.089 -> 0.074 (0.060) on a step to half speed, 0.048 ->
    0.044 (0.043) on `bench/straggler_sim.py`'s drift walk, and without the noise 0.045 -> 0.030 (0.030) on
    that walk."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._rows: deque[np.ndarray] = deque(maxlen=TREND_WINDOWS * window)
        self._ahead: tuple[np.ndarray, np.ndarray] | None = None
        """(smoothed, last report) one step after the last row, where the smoothing had its trend there."""
        self._errors: deque[tuple[float, int, float, int]] = deque(maxlen=window)
        """Per scored step: the smoothed and the last report's squared errors summed over the ranks, and counts."""
        self.history = np.zeros((0, 0))
        """The rows it keeps, as one array (steps x ranks)."""
        self._smoothed = Smoothed(np.zeros(0), 0.0)  # (nothing reported yet: no rank)

    def update(self, row: np.ndarray) -> None:
        """Take one step's log speeds (NaN where a rank did not report)."""
        if self._ahead is not None:
            errors = [np.square(row - guess) for guess in self._ahead]
            known = [np.isfinite(e) for e in errors]
            self._errors.append((float(errors[0][known[0]].sum()), int(known[0].sum()),
                                 float(errors[1][known[1]].sum()), int(known[1].sum())))
        self._rows.append(np.asarray(row, dtype=np.float64))
        self.history = np.array(self._rows)
        self._smoothed = Smoothed.of(self.history, self.window)
        self._ahead = (self._smoothed.at(1.0), _last_report(self.history)) if len(self.history) >= 2 * self.window else None

    def predict(self, lead: float = 1.0) -> np.ndarray:
        """Each rank's log speed `lead` steps after the last row."""
        smoothed = self._smoothed.at(lead)
        smooth_sum, smooth_n, last_sum, last_n = (sum(column) for column in zip(*self._errors)) if self._errors else (0, 0, 0, 0)
        if not (smooth_n and last_n and last_sum / last_n < smooth_sum / smooth_n):
            return smoothed
        last = _last_report(self.history)
        return np.where(np.isnan(last), smoothed, last)


def _last_report(history: np.ndarray) -> np.ndarray:
    """Each column's last non-NaN value (NaN where it has none)."""
    known = np.isfinite(history)
    row = len(history) - 1 - np.argmax(known[::-1], axis=0)
    return np.where(known.any(axis=0), history[row, np.arange(history.shape[1])], np.nan)


def smoothed_log_speeds(history: np.ndarray, *, window: int, lead: float = 1.0) -> np.ndarray:
    """Each column of `history` predicted `lead` steps after its last row (`Smoothed`)."""
    return Smoothed.of(history, window).at(lead)


@dataclass(frozen=True)
class Smoothed:
    """The median of each column's last `window` reports, moved along its trend from their middle.

    The trend is the smaller of the Theil-Sen slopes over the last `window` rows and over all of the history
    (at least two windows), 0 where they disagree in sign (after a step change the short window is flat
    again: no overshoot), shrunk by 1 - var / slope^2 (at least 0), var the long slope's own variance: a slope
    within its noise is noise. Log speeds, because a time is work over speed. One-step-ahead RMS error (log)
    with window 5, 64 ranks, 200 steps, 3 % noise, the lagged median -> this: 0.033 -> 0.021 on a ramp of 2 %
    a step, 0.022 -> 0.020 on 0.5 % a step, 0.048 -> 0.046 on `bench/straggler_sim.py`'s drift walk, 0.089 ->
    0.089 on a step to half speed, 0.016 -> 0.017 on a flat speed (the noise it adds). A plain line through the
    history had 0.022, 0.018, 0.051, 0.092 and 0.019; the last report alone 0.032, 0.030, 0.042 (a random
    walk has no trend to find), 0.059 and 0.030.
    """

    level: np.ndarray
    rate: np.ndarray | float
    """The shrunk trend per step (0 before two windows)."""
    last: float = 0.0
    """The last row's step."""
    middle: np.ndarray | float = 0.0
    """The step in the middle of each column's last `window` reports."""

    @classmethod
    def of(cls, history: np.ndarray, window: int) -> Smoothed:
        """The level and trend of `history`'s columns (steps x ranks)."""
        steps = np.arange(len(history), dtype=np.float64)
        recent, recent_steps = history[-window:], steps[-window:]
        level = _median(recent)
        if len(history) < 2 * window:  # a slope needs more than one window to be told from the noise
            return cls(level, 0.0)
        times = np.where(np.isnan(history), np.nan, steps[:, None])
        middle = _median(times[-window:])
        slope, short = theil_sen(history, steps), theil_sen(recent, recent_steps)
        trend = np.where(np.sign(slope) == np.sign(short), np.sign(slope) * np.minimum(abs(slope), abs(short)), 0.0)
        residuals = history - slope * steps[:, None]
        sigma = 1.4826 * _median(np.abs(residuals - _median(residuals)))  # the long line's noise, robust to outliers
        mean_time = np.nansum(times, axis=0) / np.maximum(np.isfinite(times).sum(axis=0), 1)
        spread = np.nansum((times - mean_time) ** 2, axis=0)  # the long slope's variance is sigma^2 / spread
        with np.errstate(divide="ignore", invalid="ignore"):
            shrink = np.nan_to_num(np.clip(1 - sigma**2 / spread / trend**2, 0.0, 1.0))
        return cls(level, shrink * trend, float(steps[-1]), middle)

    def at(self, lead: float) -> np.ndarray:
        """The prediction `lead` steps after the last row."""
        if np.isscalar(self.rate):  # before two windows: the level
            return self.level
        return self.level + self.rate * (self.last + lead - self.middle)


@dataclass(frozen=True)
class SpeedEstimate:
    """What the estimator publishes: each rank's speed and the factor the model's times need."""

    speeds: tuple[float, ...]
    """Relative speed per domain position (1.0 where a rank is within the band of the fast ranks)."""
    time_scale: float
    """kappa: measured over predicted of the fast ranks, the level the speeds are relative to (the model's own
    correction is `closed_loop.scale_fit`'s)."""
    steps: int
    """Reports taken in so far."""
    measured: tuple[float, ...] = ()
    """Each rank's speed as predicted for the step planned next (neither rounded nor held by the band; the
    published speed where it has too few reports): what the loop predicts steps and fits the model's factors
    with, while plans use the published `speeds` (empty: the same)."""

    @property
    def measured_speeds(self) -> tuple[float, ...]:
        """`measured`, or `speeds` where none were measured yet."""
        return self.measured or self.speeds

    def slow_ranks(self) -> list[tuple[int, float]]:
        """(position, speed) of the ranks published slow (`plan.rank_speeds.slow_ranks`), slowest first."""
        return slow_ranks(self.speeds)


class SpeedEstimator:
    """Per-rank speeds, predicted `lead` steps after the last report, from per-step measured / predicted ratios."""

    def __init__(self, world_size: int, *, window: int = 5, hysteresis: float = 0.1, lead: float = 1.0,
                 initial: Sequence[float] = ()) -> None:
        if window < 1:
            raise DhpError(f"adaptive_window = {window} must be at least 1 step")
        if not 0 <= hysteresis < 1:
            raise DhpError(f"adaptive_hysteresis = {hysteresis} must be in [0, 1) (a fraction of a rank's speed)")
        self.world_size = world_size
        self.window = window
        self.hysteresis = hysteresis
        self.lead = lead
        """Steps from the last report to the step the estimate plans (`closed_loop.loop.LEAD`)."""
        self._speeds = tuple(float(v) for v in initial) or (1.0,) * world_size
        self._relative = LogSpeedPredictor(window)
        """Per step, each rank's log speed against the step's median rank (NaN: no report, or no other rank's)."""
        self._levels: deque[float] = deque(maxlen=window)
        """Per step, log rho of its median rank."""
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
        rho = np.asarray(ratios, dtype=np.float64)
        log_rho = np.log(np.where(np.isfinite(rho) & (rho > 0), rho, np.nan))
        known = np.isfinite(log_rho)
        if not known.any():
            return self.estimate
        self._steps += 1
        level = float(_median(log_rho, axis=None))
        self._levels.append(level)
        self._relative.update(level - log_rho if known.sum() > 1 else np.full(self.world_size, np.nan))
        history = self._relative.history
        reports = np.isfinite(history[-self.window :]).sum(axis=0)
        enough = reports >= min(MIN_REPORTS, self.window)
        if not enough.any():
            return self.estimate
        median = np.where(enough, _median(history[-self.window :]), np.nan)
        predicted = self._relative.predict(self.lead)
        fast = enough & (median >= np.nanmax(median) + math.log(1 - self.hysteresis))
        top, top_predicted = float(np.median(median[fast])), float(np.median(predicted[fast]))
        self._scale = math.exp(float(np.median(self._levels)) - top)
        raw = np.where(enough, np.exp(predicted - top_predicted), np.array(self._speeds))
        band = np.maximum(-math.log(1 - self.hysteresis), NOISE_Z * self._standard_error(history, reports, fast))
        self._speeds = tuple(self._publish(old, math.exp(m - top), new, b) if ok else old
                             for old, ok, m, new, b in zip(self._speeds, enough, median, raw.tolist(), band.tolist()))
        self._measured = tuple(round(float(v), 6) for v in raw)
        return self.estimate

    def _standard_error(self, history: np.ndarray, reports: np.ndarray, fast: np.ndarray) -> np.ndarray:
        """Per rank, the standard error (log) of its median against the fast ranks': sigma, the reports' noise, is
        sqrt(pi) / 2 of their mean absolute change from step to step (normal noise; a speed that steps once adds one
        large change among many), its variance taken N / (N - 1) times (each report is against the step's median
        rank, which holds 1/N of the rank's noise), the fast ranks' median's error added to the rank's."""
        changes = np.abs(np.diff(history, axis=0))
        if not np.isfinite(changes).any():
            return np.zeros(self.world_size)
        sigma = math.sqrt(math.pi) / 2 * float(np.nanmean(changes))
        n = self.world_size
        return MEDIAN_SE * sigma * np.sqrt(n / max(n - 1, 1) * (1 + 1 / fast.sum()) / np.maximum(reports, 1))

    @staticmethod
    def _publish(old: float, median: float, predicted: float, band: float) -> float:
        """The predicted speed where it left the band (log) around the published one, else the published one;
        exactly 1 (the speed-blind plan's numbers) where the rank's median or its prediction is within the band
        of the fast ranks."""
        if abs(math.log(median)) <= band or abs(math.log(predicted)) <= band:
            return 1.0
        if abs(math.log(predicted / old)) <= band:
            return old
        return float(on_speed_grid(predicted))
