"""A step-time lower bound for ranks of two speeds that prices each sample's best split on every group.

The speed-aware area bound (`ReferenceCostModel.lower_bound_arrays`) spreads all work over the sum of the
speeds, as if every sample could take shares in proportion to its ranks' speeds. A sample that fills its
fewest ranks' memory cannot: its shares must stay within the cap, so on a group that mixes speeds it runs
near its slowest member's pace, and its fast ranks wait. Where half the ranks are a generation slower that
is most of the gap between a good plan and the area bound.

Here the ranks fall into two classes, fast (N_f ranks, each at most at v_f) and slow (N_s, at most v_s < v_f),
every speed rounded up to its class's fastest (a faster rank never makes a sample slower, so the bound stays
valid). A group is a configuration (k, j): k fast and j slow ranks. For each sample and configuration,
t(k, j) is the least time over every split its memory allows (`split_times`), so every plan's group of that
configuration takes at least that long for the sample, and it holds its k + j ranks that long. Any plan with
step time T then gives a feasible point of the linear program

    min T  s.t.  sum_s sum_c x_sc k_c (t_sc + o_sc) <= N_f T,   sum_s sum_c x_sc j_c (t_sc + o_sc) <= N_s T,
                 sum_c x_sc = 1,  x >= 0,

(x_sc = 1 for the configuration sample s runs on; o_sc its share of the microbatch overhead, m over the
group's slowest speed times its fill, as `cost.bound` charges it), so the LP's optimum, or the longest
sample's least end, whichever is larger, bounds every plan. It is taken through the LP's dual
(`class_bound_arrays`), a concave function of one weight.

The least time over splits. Shares within a class may as well be equal: a group's compute is W max_r(phi_r /
s_r) and its communication d phi_max times the even split's (`plan.shares.pace`), and replacing a class's
shares by their mean raises neither maximum nor the largest share memory sees. With a the fast ranks' share
and b = (1 - k a) / j the slow ones', compute is convex and piecewise linear in a (one kink, where shares
follow speeds) and so is communication (one kink, at even shares); their maximum or sum is convex, and
between the two kinks both are linear. The least time on a's feasible interval (memory: a, b <= (cap -
held) / shared) is therefore at the unconstrained optimum clipped to the interval, and that optimum is one
of the two kinks or the point between them where compute meets communication: `split_times` evaluates all
three, clipped, under the cost model itself.

Cost: O(samples x (N_f + 1)(N_s + 1)) times; above `MAX_ENTRIES` (about 256 ranks of two equal halves) the
bound is not taken and `class_lower_bound` returns 0 (the other bounds still hold).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.workload.sample import Sample

MAX_ENTRIES = 2_000_000
"""The most (sample, configuration) times the bound evaluates; beyond it the bound is not taken."""
ROUNDING = 1e-12
"""The bound is lowered by this fraction: it prices a sample in another order of float operations than
`simulate` does, and where a plan attains it exactly (one sample on its best split) it must not read above."""
CHUNK = 64
"""Samples priced at once (memory: CHUNK x configurations float arrays)."""


@dataclass(frozen=True)
class SpeedClasses:
    """Two speed classes of a domain, and every group configuration (k fast, j slow ranks) they allow."""

    fast: float
    """v_f: the fast class's speed (its fastest rank's)."""
    slow: float
    """v_s: the slow class's (its fastest rank's), below v_f."""
    n_fast: int
    n_slow: int
    k: np.ndarray
    """Fast ranks of each configuration."""
    j: np.ndarray
    """Slow ranks of each configuration (k + j >= 1)."""
    intra: np.ndarray
    """Whether some node holds k fast and j slow ranks (the group may communicate inside it)."""

    @classmethod
    def of(cls, speeds: np.ndarray, gpus_per_node: int) -> SpeedClasses | None:
        """The classes split at the largest ratio between consecutive distinct speeds (None: one speed)."""
        levels = np.unique(speeds)
        if levels.size < 2:
            return None
        cut = int(np.argmax(levels[1:] / levels[:-1]))
        is_fast = speeds > levels[cut]
        n_fast = int(is_fast.sum())
        k, j = (a.ravel() for a in np.meshgrid(np.arange(n_fast + 1), np.arange(speeds.size - n_fast + 1), indexing="ij"))
        keep = k + j >= 1
        k, j = k[keep], j[keep]
        nodes = is_fast.size // gpus_per_node + (is_fast.size % gpus_per_node > 0)
        per_node = [(int(f.sum()), int(f.size - f.sum())) for f in np.array_split(is_fast, np.arange(1, nodes) * gpus_per_node)]
        intra = np.zeros(k.size, dtype=bool)
        for f, s in per_node:
            intra |= (k <= f) & (j <= s)
        return cls(float(levels[-1]), float(levels[cut]), n_fast, speeds.size - n_fast, k, j, intra)

    @property
    def degree(self) -> np.ndarray:
        """Each configuration's group size."""
        return self.k + self.j

    @property
    def slowest(self) -> np.ndarray:
        """Each configuration's slowest member's speed."""
        return np.where(self.j > 0, self.slow, self.fast)


def split_times(model: CostModel, tokens: np.ndarray, work: np.ndarray, limit: np.ndarray,
                classes: SpeedClasses) -> np.ndarray:
    """(samples, configurations): each sample's least time on each configuration over every split whose
    largest part is at most `limit` (the sample's (cap - held) / shared), at the best placement the
    configuration allows; inf where no split fits (the module docstring)."""
    k, j = classes.k.astype(np.float64), classes.j.astype(np.float64)
    d, vf, vs = k + j, classes.fast, classes.slow
    mixed = (k > 0) & (j > 0)
    even = 1.0 / d
    prop = np.where(mixed, vf / (k * vf + j * vs), even)
    lim = limit[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        low = np.where(k > 0, np.maximum(0.0, (1.0 - j * lim) / k), 0.0)
        high = np.where(k > 0, np.minimum(lim, 1.0 / k), 0.0)
    # pure configurations split evenly; a mixed one fits where its interval of a is not empty
    feasible = np.where(mixed, low <= high, d * lim >= 1.0 - 1e-12)
    tok, wk = tokens[:, None], work[:, None]

    def priced(a: np.ndarray, intra: np.ndarray | bool, part: str = "") -> np.ndarray:
        b = np.where(j > 0, (1.0 - k * a) / np.maximum(j, 1.0), 0.0)
        per_speed = np.maximum(np.where(k > 0, a / vf, 0.0), np.where(j > 0, b / vs, 0.0))
        speed, scale = 1.0 / (d * per_speed), d * np.maximum(np.where(k > 0, a, 0.0), b)
        if part == "compute":
            return model.sample_time(tok, wk, d, intra, speed, slowest=classes.slowest, comm_scale=0.0)
        if part == "comm":
            return model.sample_time(tok, np.zeros_like(wk, dtype=np.float64), d, intra, speed,
                                     slowest=classes.slowest, comm_scale=scale)
        return model.sample_time(tok, wk, d, intra, speed, slowest=classes.slowest, comm_scale=scale)

    def least(intra: np.ndarray | bool) -> np.ndarray:
        at_even, at_prop = np.broadcast_to(even, low.shape), np.broadcast_to(prop, low.shape)
        # between the kinks compute and comm are both linear in a: where they cross, if they do
        gap_even = priced(at_even, intra, "compute") - priced(at_even, intra, "comm")
        gap_prop = priced(at_prop, intra, "compute") - priced(at_prop, intra, "comm")
        with np.errstate(divide="ignore", invalid="ignore"):
            cross = at_even + gap_even / (gap_even - gap_prop) * (at_prop - at_even)
        cross = np.where(np.isfinite(cross) & (gap_even * gap_prop < 0), cross, at_even)
        best = np.full(low.shape, np.inf)
        for a in (at_even, at_prop, cross):
            a = np.where(mixed, np.clip(a, low, np.maximum(low, high)), even)
            best = np.minimum(best, priced(a, intra))
        return best

    times = least(False)
    if classes.intra.any():
        times = np.where(classes.intra, np.minimum(times, least(classes.intra)), times)
    return np.where(feasible, times, np.inf)


def class_lower_bound(model: CostModel, samples: Sequence[Sample]) -> float:
    """The module docstring's bound, plus sigma and the bound on the encoder's step-level phase; 0 where the
    domain has one speed or the bound would evaluate more than `MAX_ENTRIES` times."""
    classes = SpeedClasses.of(model.domain.speeds, model.domain.gpus_per_node)
    if classes is None or len(samples) * classes.k.size > MAX_ENTRIES or not len(samples):
        return 0.0
    tokens = np.fromiter((s.tokens for s in samples), dtype=np.float64, count=len(samples))
    work = model.sample_work(samples)
    bound = class_bound_arrays(model, tokens, work, model.footprint(samples), classes)
    return model.step_overhead_s + model.encoder_phase(samples, bound=True).total_s + bound


def class_bound_arrays(model: CostModel, tokens: np.ndarray, work: np.ndarray, footprint: Footprint,
                       classes: SpeedClasses) -> float:
    """The bound without sigma: the LP's dual at its best, or the longest sample's least end (overhead and
    time), whichever is larger.

    For weights w_f, w_s >= 0 with N_f w_f + N_s w_s = 1, every plan's step T is at least
    g(w) = sum_s min_c (w_f k_c + w_s j_c) (t_sc + o_sc) (add the two capacity rows so weighted), and the
    largest g over w is the LP's optimum (duality). g is concave in w_f, so a golden-section search finds it;
    each g it evaluates is a valid bound by itself, whatever the search's tolerance."""
    d = classes.degree
    slowest = classes.slowest
    m = np.where(slowest == classes.fast, model.microbatch_overhead(1, classes.fast),
                 model.microbatch_overhead(1, classes.slow))
    ends = np.array([model.microbatch_overhead(int(g), float(v)) for g, v in zip(d, slowest)])
    limit = footprint.largest_parts()
    costs = np.empty((tokens.size, d.size))  # a sample's time and overhead on each configuration (inf: no fit)
    longest = 0.0
    for start in range(0, tokens.size, CHUNK):
        part = slice(start, start + CHUNK)
        t = split_times(model, tokens[part], work[part], limit[part], classes)
        fill = (footprint.shared[part, None] / d[None, :] + footprint.held[part, None]) / footprint.cap
        area = t + m[None, :] * fill
        longest = max(longest, float(np.min(t + ends[None, :], axis=1).max()))
        costs[part] = area
    fits = np.isfinite(costs)
    costs[~fits] = 0.0

    def dual(w_fast: float) -> float:
        w_slow = (1.0 - classes.n_fast * w_fast) / classes.n_slow
        ranks = w_fast * classes.k + w_slow * classes.j  # the configuration's weighted rank count
        return float(np.min(np.where(fits, ranks * costs, np.inf), axis=1).sum())

    return max(longest, golden_max(dual, 0.0, 1.0 / classes.n_fast)) * (1.0 - ROUNDING)


GOLDEN_STEPS = 60
"""Golden-section steps: the interval shrinks to 0.618^60, about 3e-13, of its length."""


def golden_max(f: Callable[[float], float], low: float, high: float) -> float:
    """The largest value `f` (concave on [low, high]) takes at the points a golden-section search visits."""
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = f(a), f(b)
    best = max(f(low), f(high), fa, fb)
    for _ in range(GOLDEN_STEPS):
        if fa < fb:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = f(b)
        else:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = f(a)
        best = max(best, fa, fb)
    return best
