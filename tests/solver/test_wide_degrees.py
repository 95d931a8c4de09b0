"""dhp's wide degrees with rank speeds: a sample that is communication-bound on its fewest fast ranks takes a
larger degree that the slowest windows run within the target for fewer speed-weighted rank-seconds; nothing
changes without speeds or where no slow window exists."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.planner import slow_window_degrees, wide_degrees, window_speeds
from megatron_dhp.workload import LengthSource
from megatron_dhp.workload.sample import Batch, Sample


@pytest.mark.parametrize("uneven", [True, False])
def test_window_speeds_are_the_slowest_and_fastest_contiguous_windows(uneven):
    speeds = np.random.default_rng(0).uniform(0.3, 1.0, 40)
    slowest, fastest = window_speeds(speeds, 17, uneven)
    for d in range(1, 18):
        windows = [speeds[s : s + d].mean() if uneven else speeds[s : s + d].min() for s in range(40 - d + 1)]
        assert (slowest[d - 1], fastest[d - 1]) == pytest.approx((min(windows), max(windows)))


TARGET_S = 12.0
"""A step the 123K-token sample misses on its 16 ranks at 0.45 (14.0 s) but not on 19 of them (11.8 s)."""


def two_generations(n: int = 64) -> Instance:
    """Half the nodes at 0.45 and a batch with one 123K-token sample (16 ranks at M = 8,192, communication-bound
    there: 8.7 s on fast ranks)."""
    base = CostConfig.load("gpt7b-64").with_overrides(world_size=n, rank_speeds=())
    speeds = tuple([1.0] * (n // 2) + [0.45] * (n // 2))
    model = build_cost_model(base).with_speeds(speeds)
    drawn = LengthSource.from_args(dist="wlbllm").draw(global_batch=511, seed=0, index=1, capacity=model.domain.capacity)
    batch = Batch((*drawn.samples, Sample(511, 123_308)), seed=None)
    return Instance.from_batch(batch, model, model.domain.max_tokens_per_rank, None)


def test_a_communication_bound_sample_takes_a_degree_the_slow_ranks_run_within_the_target():
    inst = two_generations()
    giant = np.array([int(np.argmax(inst.tokens))])
    blind = Instance.from_batch(_blind(inst), inst.model.with_speeds(()), inst.cap, None)
    assert wide_degrees(blind, giant, TARGET_S)[0] == 16
    # the least that the slow ranks run it on within 12 s: 19 of them (11.8 s), 0.45 x 19 x 11.8 < 16 x 8.7
    assert wide_degrees(inst, giant, TARGET_S)[0] == 19
    assert wide_degrees(inst, giant, 15.0)[0] == 16  # 16 of them end it by then: no wider



def test_no_slow_window_no_wider_degree():
    inst = two_generations()
    one_slow = inst.model.with_speeds(tuple([1.0] * 63 + [0.5]))
    inst = Instance.from_batch(_blind(inst), one_slow, inst.cap, None)
    items = np.flatnonzero(inst.min_degree > 1)
    degrees = wide_degrees(Instance.from_batch(_blind(inst), one_slow.with_speeds(()), inst.cap, None), items, TARGET_S)
    assert (slow_window_degrees(inst, items, degrees, TARGET_S) == degrees).all()


def _blind(inst: Instance) -> Batch:
    return Batch(tuple(Sample(int(i), int(t)) for i, t in zip(inst.ids, inst.tokens)), seed=None)
