"""A tighter step-time lower bound: rank-seconds and the step's length, coupled through each sample's degree.

`CostModel.lower_bound` takes the larger of two separate bounds: every sample at its cheapest degree in
rank-seconds (the fewest ranks that hold it), and the longest sample at its fastest degree. A plan cannot do
both when they pull apart: if the step ends by T, a sample must run on a degree d with m + t(L, d) <= T,
and where that is wider than its cheapest degree it costs more rank-seconds (without overlap, every extra
rank adds communication time d t(L, d) - d' t(L, d') = gamma L (d - d') / bw). So the bound here is

    T* = min { T : sum_s min_{d feasible, m + t(L_s, d) <= T} d (t(L_s, d) + m f(L_s / (d M))) <= N T },

plus sigma, where the minimum is over every degree d in [ceil(L / M), N] at the placement that makes t
smallest. Any plan with step time T meets its own constraint (each sample's microbatch runs within the step
and the ranks are busy at most N T), so T* never exceeds a valid plan's simulated step time.

The second term charges each sample its share of the microbatch overheads: a microbatch on d ranks costs m
on each of them and holds samples whose per-rank fills u = L / (d M) sum to at most 1, so for any f with
sum f(u) <= 1 whenever sum u <= 1 (a dual feasible function of bin packing, Fekete and Schepers 2001) the
overheads cost at least m d sum f(u). f(u) = u is `lower_bound`'s m sum L / M; the others count a
microbatch per sample where samples too large to share one cannot (u > 1/2, say). Each f gives a valid
bound; the result is the largest. The lambda of multi-rank microbatches is left out: it only adds time.

T* is exact for the relaxation: each sample's cheapest area is a step function of T that falls at
T = m + t(L, d) as slower, cheaper degrees become allowed, so the sum is evaluated at every such event.
Memory and time are O(samples x N) (a few MB and about 0.2 s at 512 samples on 1,024 ranks), which is why
the planners do not call it: `megatron-dhp simulate` reports every plan's step against `best_lower_bound`,
and the benchmarks and tests check plans against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from megatron_dhp.cost.class_bound import class_lower_bound
from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.workload.sample import Sample

SLACK = 1e-9
"""How far `threshold_share` keeps its thresholds from the fills eps and 1 - eps themselves."""


def identity_share(u: np.ndarray) -> np.ndarray:
    """f(u) = u: the overheads spread over the tokens (as `lower_bound` charges them)."""
    return u


def threshold_share(eps: float) -> Callable[[np.ndarray], np.ndarray]:
    """Fekete-Schepers u^(eps), eps <= 1/2: 1 above 1 - eps, u in between, 0 below eps (a microbatch holding a
    fill above 1 - eps holds nothing else above eps). It is taken at eps - `SLACK`, so that fills of exactly
    eps or 1 - eps (L = d M / 3, say), which rounding may put on either side, sit clear of both thresholds."""

    def share(u: np.ndarray) -> np.ndarray:
        return np.where(u > 1.0 - eps + SLACK, 1.0, np.where(u < eps - SLACK, 0.0, u))

    return share


def staircase_share(k: int) -> Callable[[np.ndarray], np.ndarray]:
    """Fekete-Schepers U^(k): u where (k + 1) u is an integer, else floor((k + 1) u) / k."""

    def share(u: np.ndarray) -> np.ndarray:
        scaled = (k + 1) * u
        whole = np.isclose(scaled, np.round(scaled), rtol=0.0, atol=1e-12)
        return np.where(whole, u, np.floor(scaled) / k)

    return share


OVERHEAD_SHARES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tokens": identity_share,
    "half": threshold_share(0.5),
    "third": threshold_share(1 / 3),
    "stairs-2": staircase_share(2),
    "stairs-3": staircase_share(3),
}
"""The dual feasible functions the bound tries, by name; each gives a valid bound on its own."""


def best_times(model: CostModel, tokens: np.ndarray, work: np.ndarray, speed: np.ndarray | float = 1.0) -> np.ndarray:
    """(samples, N): t(L, d) for d = 1..N at whichever placement is faster (inside a node only when d fits one),
    on ranks at `speed` (one for all degrees, or one per degree)."""
    n, gpn = model.domain.world_size, model.domain.gpus_per_node
    d = np.arange(1, n + 1)
    speed = speed if np.isscalar(speed) else np.asarray(speed)[None, :]
    inter = model.sample_time(tokens[:, None], work[:, None], d[None, :], False, speed)
    intra = model.sample_time(tokens[:, None], work[:, None], d[None, :], True, speed)
    return np.where(d[None, :] <= gpn, np.minimum(intra, inter), inter)


def coupled_bound_arrays(model: CostModel, tokens: np.ndarray, work: np.ndarray, footprint: Footprint,
                         share: Callable[[np.ndarray], np.ndarray] = identity_share) -> float:
    """T* of the module docstring for one overhead share f (without sigma), from tokens, `sample_work` and the
    samples' `Footprint` (a sample's fill of a microbatch on d ranks: its memory per rank over the cap).

    With rank speeds, as `ReferenceCostModel.lower_bound_arrays` argues, the larger of two: the speed-blind
    T* over the fastest rank's speed (if above 1), and T* with each degree d's area priced at the mean speed
    of the d slowest ranks (`Domain.slowest_groups`) and spread over the sum of the speeds, each sample ending no sooner than on the d fastest
    (at the d-th fastest's speed, or with uneven shards the mean of the d fastest: `Domain.fastest_groups`)."""
    n, m = model.domain.world_size, model.microbatch_overhead(1)
    tokens = np.asarray(tokens, dtype=np.float64)
    lo = footprint.min_degree()
    if np.any(lo > n):
        raise ValueError("the bound needs every sample to fit the domain; check with fit_to_domain first")
    work = np.asanyarray(work)
    if model.domain.nominal:
        times = best_times(model, tokens, work)
        return _event_bound(times, times, m, m, lo, footprint, share, float(n))
    speeds = model.domain.speeds
    blind = coupled_bound_arrays(model.with_speeds(()), tokens, work, footprint, share) / max(1.0, float(speeds.max()))
    slow, fastest = model.domain.slowest_groups(), model.domain.fastest_groups(model.uneven_shards)
    times = best_times(model, tokens, work, fastest)
    area_times = slow[None, :] * best_times(model, tokens, work, slow)
    return max(blind, _event_bound(times, area_times, m, (m / fastest)[None, :], lo, footprint, share, float(speeds.sum())))


def _event_bound(times: np.ndarray, area_times: np.ndarray, m: float, end_overhead: np.ndarray | float,
                 lo: np.ndarray, footprint: Footprint, share: Callable[[np.ndarray], np.ndarray], capacity: float) -> float:
    """The sweep over T of the module docstring: `times` (samples, N) of every degree, `area_times` the same
    as the area prices them (with m per microbatch), `end_overhead` the overhead before a sample ends (m, or
    one per degree), `capacity` the rank-seconds the domain has per second."""
    n = times.shape[1]
    d = np.arange(1, n + 1, dtype=np.float64)
    fill = (footprint.shared[:, None] / d[None, :] + footprint.held[:, None]) / footprint.cap
    area = d[None, :] * (area_times + m * share(fill))
    feasible = d[None, :] >= lo[:, None]
    ends = np.where(feasible, end_overhead + times, np.inf)
    # Per sample, degrees by end: T allows a prefix of them, and its cheapest area is the prefix minimum.
    # (With one m for all degrees they are ordered by time, as the sum would order them but for rounding.)
    order = np.argsort(np.where(feasible, times, np.inf) if np.isscalar(end_overhead) else ends, axis=1, kind="stable")
    ends = np.take_along_axis(ends, order, axis=1)
    cheapest = np.minimum.accumulate(np.take_along_axis(np.where(feasible, area, np.inf), order, axis=1), axis=1)
    return sweep(ends, cheapest, capacity)


def sweep(ends: np.ndarray, cheapest: np.ndarray, capacity: float = 1.0) -> float:
    """The least T at which every sample's cheapest cost by T sums to at most `capacity` T: `ends` (samples,
    options), each row sorted, is when each option ends the sample (inf: not allowed), `cheapest` the least
    cost of the options that end by then (each row's prefix minimum). Each sample's cost is a step function
    of T, so the sum is evaluated at every event where one falls."""
    if not len(ends):
        return 0.0
    # Events: sample s's cheapest cost drops from cheapest[k - 1] to cheapest[k] at T = ends[k].
    drop = np.diff(cheapest, axis=1, prepend=np.inf)
    live = np.isfinite(ends) & (drop < 0)
    first = np.zeros_like(live)
    first[:, 0] = True
    at = ends[live]
    change = np.where(first, cheapest, drop)[live]
    k = np.argsort(at, kind="stable")
    at, total = at[k], np.cumsum(change[k])
    # No sample is placeable before its fastest end; the sum is finite from the last first event on.
    start = int(np.searchsorted(at, float(ends[:, 0].max()), side="right")) - 1
    at, total = at[start:], total[start:]
    fits = total / capacity < np.r_[at[1:], np.inf]
    j = int(np.argmax(fits))
    return max(float(at[j]), float(total[j]) / capacity)


def coupled_lower_bound(model: CostModel, samples: Sequence[Sample]) -> float:
    """The largest T* over `OVERHEAD_SHARES`, plus sigma and the bound on the encoder's step-level phase: a
    step time no plan of these samples can beat."""
    tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
    work = model.sample_work(samples)
    footprint = model.footprint(samples)
    best = max(coupled_bound_arrays(model, tokens, work, footprint, share) for share in OVERHEAD_SHARES.values())
    return model.step_overhead_s + model.encoder_phase(samples, bound=True).total_s + best


def best_lower_bound(model: CostModel, samples: Sequence[Sample]) -> float:
    """The largest of `CostModel.lower_bound`, `coupled_lower_bound` and, where ranks run at different
    speeds, `cost.class_bound.class_lower_bound` (each valid). Under encoder placement `auto`, which plans
    under each concrete placement and keeps the fastest, the least of that over the concrete placements whose
    memory holds the samples."""
    if model.encoder_placement == "auto":  # (split alone where none holds them: its error names the sample)
        n = model.domain.world_size
        held = [m for m in map(model.with_placement, CONCRETE_PLACEMENTS)
                if m.footprint(samples).min_degree().max(initial=1) <= n]
        return min(best_lower_bound(m, samples) for m in held or [model.with_placement("split")])
    return max(model.lower_bound(samples), coupled_lower_bound(model, samples), class_lower_bound(model, samples))
