"""The two-speed-class bound (`cost.class_bound`): each split's least time exact, the bound below every valid
plan, and above the area bound where memory-full samples meet mixed groups."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound, coupled_lower_bound
from megatron_dhp.cost.class_bound import SpeedClasses, class_lower_bound, split_times
from megatron_dhp.plan.shares import pace
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload.sample import Batch, Sample
from tests.configs import GPT7B
from tests.test_bound import random_batch

COST_VARIANTS = [
    {"overlap_comm": True},
    {"overlap_comm": False},
    {"overlap_comm": True, "speed_scales_comm": True, "sample_overhead_s": 0.01},
    {"overlap_comm": False, "cp_comm": "all-to-all"},
    {"overlap_comm": True, "inter_node_bytes_per_s": 2.0e9, "encoder_placement": "replicate"},
]


def two_speed_model(fast: int, slow: int, speed: float, **overrides):
    speeds = (1.0,) * fast + (speed,) * slow
    return build_cost_model(replace(GPT7B, world_size=fast + slow, gpus_per_node=4, max_tokens_per_rank=2048,
                                    rank_speeds=speeds, **overrides))


def grid_paces(k: int, j: int, speed: float, points: int = 4001) -> tuple[np.ndarray, list]:
    """A grid of splits of k ranks at 1.0 and j at `speed` (a fast rank's share a, a slow one's
    (1 - k a) / j): each split's largest share and its `plan.shares.pace`, as `simulate` prices shares."""
    speeds = [1.0] * k + [speed] * j
    a = np.linspace(0.0, 1.0 / k, points)
    b = (1.0 - k * a) / j
    return np.maximum(a, b), [pace(speeds, [x] * k + [y] * j) for x, y in zip(a.tolist(), b.tolist())]


def brute_force(model, tokens: float, work, limit: float, degree: int, grid: tuple[np.ndarray, list]) -> float:
    """The least time of one sample on `degree` ranks over the grid's splits whose largest share fits `limit`."""
    largest, paces = grid
    fits = [p for p, m in zip(paces, largest.tolist()) if m <= limit + 1e-12]
    if not fits:
        return np.inf
    t = model.sample_time(np.array([tokens]), work, degree, False, np.array([p.speed for p in fits]),
                          slowest=np.array([p.slowest for p in fits]), comm_scale=np.array([p.comm_scale for p in fits]))
    return float(t.min())


@pytest.mark.parametrize("variant", range(len(COST_VARIANTS)))
def test_split_times_is_the_least_time_over_every_split(variant):
    """On mixed groups of 2 to 6 ranks, for samples from short (compute-bound) to memory-full: no split on a
    fine grid is faster than `split_times`, and the grid's best is within its resolution of it. A split time
    one candidate short (the crossing of compute and communication) or above the grid fails it."""
    model = two_speed_model(4, 4, 0.45, **COST_VARIANTS[variant])
    classes = SpeedClasses.of(model.domain.speeds, model.domain.gpus_per_node)
    rng = np.random.default_rng(variant)
    samples = [Sample(i, int(v)) for i, v in enumerate(rng.integers(64, 6 * 2048, size=8))]
    tokens = np.array([s.tokens for s in samples], dtype=np.float64)
    work = model.sample_work(samples)
    footprint = model.footprint(samples)
    limit = (footprint.cap - footprint.held) / footprint.shared
    times = split_times(model, tokens, work, limit, classes)
    checked = 0
    for c in np.nonzero((classes.k > 0) & (classes.j > 0))[0]:
        k, j = int(classes.k[c]), int(classes.j[c])
        splits = grid_paces(k, j, 0.45)
        for i in range(len(samples)):
            grid = brute_force(model, tokens[i], work[i:i + 1], limit[i], k + j, splits)
            if not np.isfinite(grid):
                assert times[i, c] == np.inf
                continue
            assert times[i, c] <= grid * (1 + 1e-12)
            assert times[i, c] >= grid * (1 - 2e-3), (k, j, tokens[i])
            checked += 1
    assert checked > 50


def test_uneven_splits_within_a_class_are_never_faster():
    """Random per-rank splits (not equal within a class) within the memory limit take at least the
    configuration's split time: equal shares within each class lose nothing."""
    model = two_speed_model(4, 4, 0.5, overlap_comm=True)
    classes = SpeedClasses.of(model.domain.speeds, model.domain.gpus_per_node)
    samples = [Sample(0, 5000), Sample(1, 900)]
    tokens = np.array([s.tokens for s in samples], dtype=np.float64)
    work = model.sample_work(samples)
    footprint = model.footprint(samples)
    limit = (footprint.cap - footprint.held) / footprint.shared
    times = split_times(model, tokens, work, limit, classes)
    rng = np.random.default_rng(1)
    for c in range(classes.k.size):
        k, j = int(classes.k[c]), int(classes.j[c])
        speeds = [1.0] * k + [0.5] * j
        for _ in range(40):
            phi = rng.dirichlet(np.ones(k + j))
            for i in range(len(samples)):
                if phi.max() > limit[i]:
                    continue
                p = pace(speeds, phi)
                t = model.sample_time(tokens[i:i + 1], work[i:i + 1], k + j, False, p.speed, slowest=p.slowest,
                                      comm_scale=p.comm_scale)
                assert times[i, c] <= float(t[0]) * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(variant=st.integers(0, len(COST_VARIANTS) - 1), seed=st.integers(0, 2**31 - 1), size=st.integers(1, 30),
       fast=st.integers(1, 8), slow=st.integers(1, 8), speed=st.sampled_from([0.3, 0.45, 0.7, 0.9]),
       overhead=st.sampled_from([0.0, 0.05, 0.3]))
def test_class_bound_never_above_a_valid_plan(variant, seed, size, fast, slow, speed, overhead):
    """dhp's plan and five random valid plans (most groups with random uneven shares) on ranks of two speeds
    (in either order across the nodes) never step faster than the class bound."""
    model = two_speed_model(fast, slow, speed, microbatch_overhead_s=overhead, **COST_VARIANTS[variant])
    rng = random.Random(seed)
    if rng.random() < 0.5:  # slow ranks first
        model = model.with_speeds(tuple(sorted(model.domain.rank_speeds)))
    batch = random_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)
    bound = class_lower_bound(model, batch.samples)
    assert bound > 0
    plans = [random_plan(batch, model.domain, rng, max_phases=3, memory=model.memory_rule(), uneven=0.7)
             for _ in range(5)]
    plans.append(run_planner(build_planner("dhp"), batch, model))
    for plan in plans:
        step = simulate(plan, model).step_time_s
        assert bound <= step, (plan.planner, bound, step)


def test_memory_full_samples_on_two_generations_lift_the_bound():
    """Two samples that each fill all four ranks' memory, two ranks at 1.0 and two at 0.45: neither can take
    shares in proportion to the speeds, so each runs at the slow ranks' pace. The area bound spreads their
    work over the speed sum as if they could; the class bound prices the even split, 60 % higher, and dhp's
    plan reaches it."""
    model = two_speed_model(2, 2, 0.45)
    batch = Batch((Sample(0, 4 * 2048), Sample(1, 4 * 2048)))
    area = max(model.lower_bound(batch.samples), coupled_lower_bound(model, batch.samples))
    bound = class_lower_bound(model, batch.samples)
    assert bound > 1.6 * area
    assert best_lower_bound(model, batch.samples) == bound
    step = run_planner(build_planner("dhp"), batch, model).predicted_step_time_s
    assert bound <= step <= bound * (1 + 1e-9)


def test_one_speed_or_too_many_configurations_take_no_class_bound(monkeypatch):
    assert class_lower_bound(two_speed_model(4, 0, 1.0), (Sample(0, 4000),)) == 0.0
    model = two_speed_model(4, 4, 0.5)  # 24 configurations
    assert class_lower_bound(model, (Sample(0, 4000),)) > 0
    monkeypatch.setattr("megatron_dhp.cost.class_bound.MAX_ENTRIES", 23)
    assert class_lower_bound(model, (Sample(0, 4000),)) == 0.0
    assert SpeedClasses.of(np.ones(8), 4) is None
    classes = SpeedClasses.of(np.array([1.0, 0.9, 0.5, 0.45]), 2)  # largest gap between 0.9 and 0.5
    assert (classes.fast, classes.slow, classes.n_fast, classes.n_slow) == (1.0, 0.5, 2, 2)
    assert classes.intra.tolist() == [k + j <= 2 and (j == 0 or k == 0) for k, j in zip(classes.k, classes.j)]
