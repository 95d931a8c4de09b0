"""The cost model's own correction: how much longer than predicted attention and everything else really take.

Each step every rank sums, over its timed slots, the least-squares statistics of y = k_A A + k_R R, y the slot's
measured seconds, A the model's attention seconds of the slot (`CostModel.attention_time`: a sum L^2 / d over
its samples, and the encoder's where the group runs it) and R the rest of its predicted seconds. The sums ride
with the length gather (`closed_loop.loop`); `ScaleFit` keeps each rank's over the last `window` steps and
solves the 2 x 2 normal equations over the ranks that are not slow (`counted`, `plan.rank_speeds.slow_ranks`),
each rank's y brought to speed 1 by its *current* speed estimate: a rank found slow leaves the fit, the steps it
measured before it was known to be slow included (without that, its early steps inflated both factors for a
whole window), and so does the noise of its speed (a core shared with a busy process gives its rank 40-60 % from
step to step, which the speed estimate smooths and its slots' seconds do not: fitted through it, the attention
factor swung by a third). Two factors, not one, because a preset priced for another model or GPU is off by
different amounts in its quadratic and its linear terms: one factor fits short-sample steps or long-sample ones,
not both. Where the slots cannot tell the terms apart (all samples alike) it fits one factor for both. A factor
is published when it moves more than `SCALE_STEP`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SCALE_STEP = 0.02
"""A fitted factor is republished only when it moved more than this fraction (a fifth of the 10 % that
predicted steps are judged by: bench/straggler_train.py)."""
STATS = 5
"""The statistics one rank sends per step: sum A^2, A R, R^2, A y, R y."""
COLLINEAR = 1e-3
"""Below this 1 - (sum A R)^2 / (sum A^2 sum R^2) the two terms are fitted as one."""
MAX_SPLIT = 10.0
"""Two factors further apart than this are fitted as one: no preset is off by ten times more in one term than
in the other, while slots whose attention is a sliver of their time (short rows) let noise push its factor
to thousands."""


@dataclass(frozen=True)
class TimeScales:
    """Factors on the model's attention seconds and on all its other seconds."""

    attention: float = 1.0
    rest: float = 1.0


class ScaleFit:
    """Least squares of measured on predicted seconds, split into attention and the rest, over a window."""

    def __init__(self, window: int = 5) -> None:
        self._steps: deque[np.ndarray] = deque(maxlen=window)
        self._scales = TimeScales()

    @property
    def scales(self) -> TimeScales:
        """The published factors."""
        return self._scales

    def update(self, stats: Sequence[float] | np.ndarray, speeds: Sequence[float] | None = None,
               counted: Sequence[bool] | None = None) -> TimeScales:
        """Take one step's statistics (`STATS` numbers, or one row of them per rank, NaN where a rank sent none)
        with every rank's current speed (default 1), and republish from the ranks `counted` (default all; the
        window's every step of them)."""
        step = np.atleast_2d(np.asarray(stats, dtype=np.float64))
        if step.shape[1] != STATS:
            return self._scales
        step = np.where(np.all(np.isfinite(step), axis=1, keepdims=True), step, 0.0)
        if not (step[:, 0] + step[:, 2]).sum() > 0:
            return self._scales
        self._steps.append(step)
        speed = np.ones(len(step)) if speeds is None else np.asarray(speeds, dtype=np.float64)
        total = np.sum(self._steps, axis=0)  # per rank, over the window
        if counted is not None and len(counted) == len(total):
            kept = total * np.asarray(counted, dtype=np.float64)[:, None]
            total = kept if (kept[:, 0] + kept[:, 2]).sum() > 0 else total  # none of them timed a slot: all count
        aa, ar, rr = total[:, :3].sum(axis=0)
        ay, ry = (total[:, 3:] * speed[:, None]).sum(axis=0)
        fit = None
        if aa > 0 and rr > 0 and 1 - ar * ar / (aa * rr) > COLLINEAR:
            det = aa * rr - ar * ar
            k_a, k_r = (ay * rr - ry * ar) / det, (ry * aa - ay * ar) / det
            fit = TimeScales(k_a, k_r) if k_a > 0 and k_r > 0 and max(k_a / k_r, k_r / k_a) <= MAX_SPLIT else None
        if fit is None:  # one factor: sum (A + R) y / sum (A + R)^2
            k = (ay + ry) / (aa + 2 * ar + rr)
            fit = TimeScales(k, k)
        old = self._scales
        if abs(fit.attention / old.attention - 1) > SCALE_STEP or abs(fit.rest / old.rest - 1) > SCALE_STEP:
            self._scales = TimeScales(float(round(fit.attention, 6)), float(round(fit.rest, 6)))
        return self._scales
