"""A lower bound on the step for samples forced onto wide groups: how wide each group is, not only its area.

`cost.bound`'s coupled bound already counts the communication a sample forced onto several ranks pays: each
sample is charged d t(L, d) rank-seconds at a degree d >= its fewest ranks (ceil(L / M) without encoder
memory), so without overlap it pays gamma L (d - 1) / bw on top of its compute at d = ceil(L / M), and more
for every rank it is widened by. What that bound lets through is where the rank-seconds sit: it spreads them
over N ranks as if they were fluid. Without overlap the forced communication makes the long samples rigid
(every rank one is widened by costs gamma L / bw rank-seconds more, so each sits on about its fewest ranks),
and rigid groups wider than N / 2 cannot run side by side at all, however the area adds up.

The bound here weighs each sample by a dual feasible function f of its width d / N (any f with
sum f(u) <= 1 whenever sum u <= 1; Fekete and Schepers 2001), as `cost.bound` weighs microbatch overheads by
one of its fill:

    T* = min { T : sum_s min_{d feasible, m + t(L_s, d) <= T} f(d / N) (t(L_s, d) + m g(u_s(d))) <= T },

plus sigma and the bound on `global`'s encoder phase, with d over [min degree, N] at the placement that
makes t smallest, u_s(d) the sample's fill of a microbatch on d ranks (memory per rank over the cap) and g
any of `cost.bound.OVERHEAD_SHARES`. With f(u) = u it is the coupled bound itself.

Proof (any valid plan with step time T + sigma + the encoder phase satisfies the constraint). A microbatch
of samples S on d ranks runs m + lambda + sum_S t(L, d) >= sum_S (t(L, d) + m g(u)), since its fills sum to
at most 1 (the memory rule) and g is dual feasible; so its span cuts into disjoint pieces, one per sample,
each at least t(L, d) + m g(u) long at the best placement, and each inside the step: m + t(L, d) <= T. At
any instant the pieces in progress belong to groups that run then, whose ranks are disjoint: their widths
sum to at most N, so their f(d / N) sum to at most 1. Integrating over the step, sum_s f(d_s / N) piece_s
<= T, and each piece is at least the minimum above. T* is the least T that passes, so it is no more than the
plan's. With rank speeds no time is shorter than at speed 1 over the fastest rank's speed (if above 1), as
`ReferenceCostModel.lower_bound_arrays` argues, so the speed-blind T* over that speed holds. The bound is for
P = 1 (no pipeline stages), like `cost.bound.best_lower_bound`.

The weights tried are the threshold functions at 1/2 and 1/3 (a sample wider than N / 2, or 2 N / 3, counts
its whole time: no two of them overlap) and the staircases U^(2) and U^(3). Each is an event sweep over T as
in `cost.bound`, O(samples x N) each (20 sweeps: about 50 ms at 512 samples on 64 ranks).

Where it counts: batches with two or more samples forced past N / 2 (or three past N / 3, ...), such as
two 5 M-token samples on 8 ranks (tests/test_forced_comm.py: the bound is then a plan's step, 1.2x the best
bound). On the shipped workloads and on a long-context batch of 32K-128K documents on 64 ranks
(`bench/no_overlap_gap.py`) it adds nothing: no sample there needs more than a quarter of the domain but the
one giant sample (alone past N / 2, which the longest-sample term counts already), and those widths pack
without waste in a fractional relaxation (a configuration LP over the multi-rank samples, the one-rank ones
as divisible work, solved by column generation with HiGHS, 3 batches of each workload in both overlap
modes: its optimum is at most the coupled bound, but on lognormal-pareto without overlap, where it did not
converge, at most 1.1 % above), so no weight of the width alone can raise it there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from megatron_dhp.cost.bound import (
    OVERHEAD_SHARES,
    best_times,
    identity_share,
    staircase_share,
    sweep,
    threshold_share,
)
from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.workload.sample import Sample

Share = Callable[[np.ndarray], np.ndarray]

WIDTH_SHARES: dict[str, Share] = {
    "half": threshold_share(0.5),
    "third": threshold_share(1 / 3),
    "stairs-2": staircase_share(2),
    "stairs-3": staircase_share(3),
}
"""The dual feasible functions of a group's width d / N the bound tries (identity is the coupled bound)."""


def width_bound_arrays(model: CostModel, tokens: np.ndarray, work: np.ndarray, footprint: Footprint,
                       width: Share = identity_share, share: Share = identity_share) -> float:
    """T* of the module docstring (without sigma) for one width weight f (`width`) and one overhead share g
    (`share`), from tokens, `sample_work` and the samples' `Footprint`."""
    n, m = model.domain.world_size, model.microbatch_overhead(1)
    lo = footprint.min_degree()
    if np.any(lo > n):
        raise ValueError("the bound needs every sample to fit the domain; check with fit_to_domain first")
    if not model.domain.nominal:
        blind = width_bound_arrays(model.with_speeds(()), tokens, work, footprint, width, share)
        return blind / max(1.0, float(model.domain.speeds.max()))
    times = best_times(model, np.asarray(tokens, dtype=np.float64), np.asanyarray(work))
    d = np.arange(1, n + 1, dtype=np.float64)
    fill = (footprint.shared[:, None] / d[None, :] + footprint.held[:, None]) / footprint.cap
    weight = width(d / n)[None, :] * (times + m * share(fill))
    feasible = d[None, :] >= lo[:, None]
    return least_step(np.where(feasible, m + times, np.inf), np.where(feasible, weight, np.inf))


def least_step(ends: np.ndarray, weight: np.ndarray) -> float:
    """The least T with sum_s min {weight[s, d] : ends[s, d] <= T} <= T: `ends` (samples, degrees) is when a
    sample on each degree ends at the earliest (inf: not allowed), `weight` what it then costs the step.

    Each sample's cheapest weight is a step function of T that falls where a slower degree becomes allowed,
    so the sum is evaluated at every such event."""
    order = np.argsort(ends, axis=1, kind="stable")
    return sweep(np.take_along_axis(ends, order, axis=1),
                 np.minimum.accumulate(np.take_along_axis(weight, order, axis=1), axis=1))


def forced_width_lower_bound(model: CostModel, samples: Sequence[Sample]) -> float:
    """The largest T* over `WIDTH_SHARES` x `cost.bound.OVERHEAD_SHARES`, plus sigma and the bound on the
    encoder's step-level phase: a step time no plan of these samples can beat (P = 1). Under encoder
    placement `auto`, the least over the concrete placements whose memory holds the samples (as
    `best_lower_bound`)."""
    if model.encoder_placement == "auto":
        n = model.domain.world_size
        held = [m for m in map(model.with_placement, CONCRETE_PLACEMENTS)
                if m.footprint(samples).min_degree().max(initial=1) <= n]
        return min(forced_width_lower_bound(m, samples) for m in held or [model.with_placement("split")])
    tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
    work = model.sample_work(samples)
    footprint = model.footprint(samples)
    best = max(width_bound_arrays(model, tokens, work, footprint, width, share)
               for width in WIDTH_SHARES.values() for share in OVERHEAD_SHARES.values())
    return model.step_overhead_s + model.encoder_phase(samples, bound=True).total_s + best
