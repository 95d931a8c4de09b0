"""Rank speeds as every part of the project rounds, judges and prints them: one grid, one rule for a slow rank.

A speed is relative to the rank the cost model's coefficients describe (1.0); a throttled or older GPU is below 1.

**The grid** (`SPEED_GRID`): powers of 1.02. The closed loop publishes each measured speed at the nearest power
(`on_speed_grid`, `closed_loop.speed_estimator`), and the step-time bounds price groups at speeds rounded *up*
to one (`cost.config.Domain.speed_levels`: up keeps a bound valid), so a published speed is priced exactly.
Powers rather than multiples of a step, because a time is work over speed: a speed rounded to a power is off
by the same ratio at any speed, at most 1 % (steps of 0.05 were off by up to 2.5 % at 1.0 and 12.5 % at 0.2).
2 %, a fifth of the loop's default hysteresis (10 %), so rounding never holds back a change the hysteresis lets
through; and the bounds used this grid before the loop did, so plans under stated speeds are what they were.
Few distinct speeds keep planning fast (each is a class that `dhp`'s fill scans): the loop publishes 1.0 or a
speed below 1 - hysteresis, and there are 41 powers between 0.4 and 0.9 (256 ranks at uniform speeds in
[0.4, 1], 2,048 samples: 47 distinct on the grid took 0.21 s of CPU to plan, 256 exact ones 0.38 s).

**A slow rank** (`slow_ranks`): one whose speed is below `SLOW_BELOW` of the fastest rank's. The plan summary,
the train loop's step line and the closed loop's summary name these, with one wording (`slow_ranks_text`),
and the closed loop's model fit leaves them out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SPEED_GRID = 1.02
"""Speeds are rounded to powers of this (the module docstring says why)."""
SLOW_BELOW = 0.9
"""A rank is slow when its speed is below this fraction of the fastest rank's."""


def on_speed_grid(speeds: np.ndarray | Sequence[float] | float, *, up: bool = False,
                  grid: float = SPEED_GRID) -> np.ndarray:
    """`speeds` at the nearest power of `grid` (`up`: the next power up, never below; a bound stays valid), each
    exactly as given where it already is one (1.0 stays 1.0)."""
    speeds = np.asarray(speeds, dtype=np.float64)
    step = np.log(grid)
    powers = np.round(np.log(speeds) / step, 9)
    rounded = np.exp((np.ceil(powers) if up else np.round(powers)) * step)
    return np.where(np.isclose(speeds, rounded, rtol=1e-12), speeds, rounded)


def slow_ranks(speeds: Sequence[float]) -> list[tuple[int, float]]:
    """(position, speed) of the slow ranks among `speeds` (one per position; empty: all at 1), slowest first."""
    top = max(speeds, default=1.0)
    return sorted(((r, float(v)) for r, v in enumerate(speeds) if v < SLOW_BELOW * top), key=lambda rv: (rv[1], rv[0]))


def rank_speeds_text(ranks: Sequence[tuple[int, float]], most: int | None = None) -> str:
    """(position, speed) pairs as the logs name them, `r3@0.50 r7@0.71`; at most `most` of them, then `...`."""
    shown = " ".join(f"r{r}@{v:.2f}" for r, v in ranks[:most])
    return shown + (" ..." if most is not None and len(ranks) > most else "")


def slow_ranks_text(speeds: Sequence[float], most: int | None = None) -> str:
    """The slow ranks among `speeds` as every log line names them, `slow r3@0.50 r7@0.71` (at most `most`, then
    `...`); empty when none is slow."""
    slow = slow_ranks(speeds)
    return f"slow {rank_speeds_text(slow, most)}" if slow else ""
