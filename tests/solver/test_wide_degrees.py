"""dhp's wide degrees with rank speeds: a sample that is communication-bound on its fewest fast ranks takes a
larger degree that the slowest windows run within the target for fewer speed-weighted rank-seconds; nothing
changes without speeds or where no slow window exists."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.dhp import planner as planner_module
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import Skyline, put
from megatron_dhp.solver.dhp.planner import one_speed_cell, slow_window_degrees, wide_degrees, window_speeds
from megatron_dhp.workload import LengthSource
from megatron_dhp.workload.sample import Batch, Sample
from tests.configs import GPT7B


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


def test_one_speed_cell():
    speeds = np.random.default_rng(0).uniform(0.4, 1.0, 64)
    assert not one_speed_cell(speeds, 8) and one_speed_cell(speeds, 1)
    speeds[8:16] = 0.7
    assert one_speed_cell(speeds, 8)


@pytest.mark.parametrize("uniform_node, cells", [(False, [1]), (True, [1, 8])])
def test_cells_of_mixed_speeds_are_not_candidates(monkeypatch, uniform_node, cells):
    """Where no node runs at one speed, dhp builds only the one-rank candidate (a whole-node cell's bins would
    be its runs of one speed anyway, and its samples sized for the cell would find no bin); where one node
    does, the whole-node cell is still tried. Fails if every cell is built."""
    base = CostConfig.load("gpt7b-64").with_overrides(world_size=64, rank_speeds=())
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, index=0, capacity=64 * 8192)
    speeds = np.random.default_rng(1).uniform(0.4, 1.0, 64)
    if uniform_node:
        speeds[8:16] = 0.7
    built, real = [], planner_module.build
    monkeypatch.setattr(planner_module, "build", lambda inst, cand, *a, **k: built.append(cand.cell) or real(inst, cand, *a, **k))
    run_planner(build_planner("dhp"), batch, build_cost_model(base).with_speeds(tuple(speeds.tolist())))
    assert sorted(set(built)) == cells


def test_a_sample_at_its_memory_minimum_on_mixed_windows_may_take_one_more_rank_for_shares():
    """A sample that fills 3 ranks' memory holds even shards there (at the slowest rank's speed); with every
    3-rank window mixing speeds it takes the 4-rank window, where shares follow the speeds: 2:2:1:1, 31 %
    sooner. Fails with wide samples kept to their degree's windows."""
    base = CostConfig.load("gpt7b-64").with_overrides(world_size=4, gpus_per_node=4, rank_speeds=())
    model = build_cost_model(base).with_speeds((1.0, 1.0, 0.5, 0.5))
    batch = Batch((Sample(0, 3 * base.max_tokens_per_rank),))
    plan = run_planner(build_planner("dhp"), batch, model)
    assert [(g.ranks, g.shares) for g in plan.groups if g.microbatches] == [((0, 1, 2, 3), (2, 2, 1, 1))]
    even = replace(plan, groups=(PlanGroup((1, 2, 3), ((0,),)), PlanGroup((0,), ())))
    assert plan.predicted_step_time_s < 0.7 * simulate(even, model).step_time_s


def test_a_wide_group_of_two_samples_on_mixed_speeds_is_priced_with_its_one_split():
    """The plan gives a group one split for all its microbatches, as even as its fullest needs; the draft
    prices a second sample joining a wide group that way, so its end is the simulated one (8.97 s). Fails with
    each sample priced at its own split (the second, smaller one, as if it held shares in proportion to the
    speeds: the group ended at 8.34 s)."""
    base = CostConfig.load("gpt7b-64").with_overrides(world_size=8, gpus_per_node=8, rank_speeds=())
    model = build_cost_model(base).with_speeds((1.0, 0.9, 0.8, 0.7, 1.0, 0.6, 0.9, 0.8))
    cap = base.max_tokens_per_rank
    batch = Batch((Sample(0, 7 * cap + cap // 2), Sample(1, 5 * cap)))
    inst = Instance.from_batch(batch, model, cap, None)
    skyline = Skyline.empty(8)
    for item in (0, 1):
        begin = float(skyline.ready.max())
        put(inst, skyline, item, 0, 8, begin, inst.window_seconds(item, 0, 8))
    (group,) = skyline.wide
    assert group.microbatches == [[0], [1]]
    planned = inst.plan_groups([(group.ranks, group.microbatches, 0)])
    plan = Plan("dhp", 8, 8, batch.samples, tuple(planned), max_tokens_per_rank=cap)
    assert planned[0].shares and simulate(plan, model).step_time_s == pytest.approx(group.finish_s, rel=1e-3)


def test_static_layouts_far_from_the_bound_take_the_shares_dhp_groups_take():
    """Where dhp's draft is far from the bound it also weighs static CP's layouts. On 4 ranks, one at 0.45, a
    4,351-token sample needs 3 ranks' memory, so static CP's layout is one group of all 4 with the batch in
    one microbatch; with shares in proportion to the speeds (as dhp's own groups take them) it beats the
    draft by 30 %. Fails with static layouts at even shards (dhp then kept its 0.72 s draft)."""
    config = replace(GPT7B, world_size=4, gpus_per_node=4, max_tokens_per_rank=2048, overlap_comm=False)
    model = build_cost_model(config).with_speeds((0.45, 1.0, 1.0, 1.0))
    batch = Batch((Sample(0, 4351), Sample(1, 1516), Sample(2, 1)))
    plan = run_planner(build_planner("dhp"), batch, model)
    assert [(g.ranks, g.microbatches) for g in plan.groups] == [((0, 1, 2, 3), ((0, 1, 2),))]
    assert plan.groups[0].shares == (9, 20, 20, 20)
    even = replace(plan, groups=(PlanGroup((0, 1, 2, 3), ((0, 1, 2),)),))
    assert plan.predicted_step_time_s < 0.75 * simulate(even, model).step_time_s
    assert plan.predicted_step_time_s == pytest.approx(0.5067, abs=1e-4)


def test_dhp_groups_are_in_the_normal_form_plan_group_gives_them():
    """`Instance.plan_groups` builds its groups without `PlanGroup.__post_init__`'s copies: each must equal the
    group built through it, field by field and type by type (Python ints, normalized shares), so the plan
    round-trips through JSON."""
    base = CostConfig.load("gpt7b-64").with_overrides(world_size=64, rank_speeds=())
    speeds = np.random.default_rng(0).uniform(0.4, 1.0, 64).round(2)
    model = build_cost_model(base).with_speeds(tuple(speeds.tolist()))
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=model.domain.capacity)
    plan = run_planner(build_planner("dhp"), batch, model)
    assert any(g.shares for g in plan.groups)
    for g in plan.groups:
        rebuilt = PlanGroup(g.ranks, g.microbatches, g.phase, g.shares)
        assert rebuilt == g and rebuilt.shares == g.shares
        assert {type(v) for v in (*g.ranks, *(i for mb in g.microbatches for i in mb), g.phase, *g.shares)} == {int}
    assert Plan.from_dict(json.loads(plan.to_json())).groups == plan.groups


def test_static_layouts_with_speeds_also_run_one_sample_a_microbatch():
    """Two samples that each fill two ranks' memory, on two ranks at 1.0 and two at 0.45. Static CP packs both
    into one microbatch on all four ranks, whose memory then holds only even shards (at 0.45); one sample a
    microbatch lets each take shares in proportion to the speeds: 0.80 s, where dhp's draft (two 3-rank groups
    in two phases) took 1.03 s. Fails without the one-sample layouts."""
    config = replace(GPT7B, world_size=4, gpus_per_node=4, max_tokens_per_rank=2048)
    model = build_cost_model(config).with_speeds((1.0, 1.0, 0.45, 0.45))
    batch = Batch((Sample(0, 4096), Sample(1, 4096)))
    plan = run_planner(build_planner("dhp"), batch, model)
    assert [(g.ranks, g.microbatches, g.shares) for g in plan.groups] == [((0, 1, 2, 3), ((0,), (1,)), (20, 20, 9, 9))]
    assert plan.predicted_step_time_s == pytest.approx(0.8013, abs=1e-4)
