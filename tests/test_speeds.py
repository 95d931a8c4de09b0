"""Rank speeds in the cost model: valid bounds, the speed-blind numbers at speed 1, dhp giving slow ranks less."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.cost.pipeline import lower_bound as pipeline_lower_bound
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import group_family
from megatron_dhp.plan.plan import Plan
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.base import PlannerUnsupported
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload import LengthSource
from megatron_dhp.workload.sample import Batch, Sample
from tests.configs import GPT7B
from tests.test_bound import random_batch, variants

BASE = GPT7B


def with_speeds(config: CostConfig, speeds) -> CostConfig:
    return config.with_overrides(rank_speeds=tuple(float(v) for v in speeds))


def wlb_batch(model, index: int = 0, size: int = 512):
    return LengthSource.from_args(dist="wlbllm").draw(global_batch=size, seed=0, index=index, capacity=model.domain.capacity)


@settings(max_examples=40, deadline=None)
@given(overrides=variants, seed=st.integers(0, 2**31 - 1), size=st.integers(1, 40),
       speeds=st.lists(st.sampled_from([0.25, 0.5, 0.7, 1.0, 1.0, 1.0, 1.3]), min_size=16, max_size=16),
       scales_comm=st.booleans(), uneven=st.booleans())
def test_speed_aware_bound_never_above_a_valid_plan(overrides, seed, size, speeds, scales_comm, uneven):
    """Also with uneven shards (`plan.shares`): random shares in most random plans' groups, and dhp's shares
    in proportion to the speeds, under the bound that allows them."""
    config = replace(BASE, **overrides, speed_scales_comm=scales_comm, uneven_shards=uneven)
    model = build_cost_model(with_speeds(config, speeds[: config.world_size]))
    rng = random.Random(seed)
    batch = random_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)
    bound = best_lower_bound(model, batch.samples)
    plans = [random_plan(batch, model.domain, rng, max_phases=3, memory=model.memory_rule(), uneven=0.7 * uneven)
             for _ in range(5)]
    for options in ({}, {"speed_aware": False}):
        plans.append(run_planner(build_planner("dhp", **options), batch, model))
    for name in ("static", "fcp-ref"):
        try:
            plans.append(run_planner(build_planner(name, {"dataset_max_tokens": int(batch.lengths.max())}), batch, model))
        except PlannerUnsupported:
            pass
    for plan in plans:
        step = simulate(plan, model).step_time_s
        assert bound <= step * (1 + 1e-9), (plan.planner, bound, step)
        assert model.lower_bound(batch.samples) <= step * (1 + 1e-9), (plan.planner, step)


def test_the_area_term_charges_communication_at_the_mean_of_the_slowest_ranks():
    """One rank at 0.25 and the rest at 0.8, no overlap: a 4-rank sample's communication costs at least the 4
    slowest ranks' speeds (2.65) in speed-weighted rank-seconds, not 4 x 0.25, so the bound rises 3 % above
    that older form and stays below a plan. Fails with the area priced at the slowest rank's speed alone."""
    config = replace(BASE, overlap_comm=False)
    speeds = (0.25,) + (0.8,) * (config.world_size - 1)
    model = build_cost_model(with_speeds(config, speeds))
    samples = [Sample(i, 4 * model.domain.max_tokens_per_rank) for i in range(config.world_size)]
    tokens, work = np.array([s.tokens for s in samples], dtype=np.float64), model.sample_work(samples)
    footprint = model.footprint(samples)
    assert (footprint.min_degree() == 4).all()
    overheads = config.microbatch_overhead_s * float(footprint.shared.sum()) / footprint.cap
    comm = config.comm_bytes_per_token * tokens * 3 / 4 / config.intra_node_bytes_per_s
    older = (float(work.sum() + 4 * 0.25 * comm.sum()) + overheads) / sum(speeds)
    bound = model.lower_bound_arrays(tokens, work, footprint)
    assert bound == pytest.approx((float(work.sum() + 2.65 * comm.sum()) + overheads) / sum(speeds), rel=1e-9)
    assert bound > older * 1.03
    plan = run_planner(build_planner("dhp"), Batch(tuple(samples)), model)
    assert best_lower_bound(model, samples) <= simulate(plan, model).step_time_s


@pytest.mark.parametrize("scales_comm", [False, True])
def test_speed_scales_comm_slows_the_whole_group(scales_comm):
    """With `speed_scales_comm` (collectives on the ranks' cores: gloo) a group at speed v takes exactly 1/v of
    its time at speed 1, lambda included; without it (links: NCCL) communication keeps its time."""
    config = replace(BASE, overlap_comm=False, cp_microbatch_overhead_s=0.02, sample_overhead_s=0.01,
                     speed_scales_comm=scales_comm)
    model = build_cost_model(config)
    samples = wlb_batch(model, size=2).samples
    work, tokens = model.sample_work(samples), np.array([float(s.tokens) for s in samples])
    at_one = model.sample_time(tokens, work, 4, True)
    at_half = model.sample_time(tokens, work, 4, True, 0.5)
    comm = config.comm_bytes_per_token * tokens * 3 / 4 / config.intra_node_bytes_per_s
    expected = 2 * at_one if scales_comm else 2 * at_one - comm
    np.testing.assert_allclose(at_half, expected, rtol=1e-12)
    lam = config.cp_microbatch_overhead_s
    assert model.microbatch_overhead(4, 0.5) == pytest.approx(2 * model.microbatch_overhead(4) - (0 if scales_comm else lam))
    assert CostConfig.from_dict(config.to_dict()).speed_scales_comm is scales_comm  # written only when set
    assert ("speed_scales_comm" in config.to_dict()) is scales_comm


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), speeds=st.lists(st.sampled_from([0.3, 0.6, 1.0, 1.0, 1.5]), min_size=8, max_size=8))
def test_pipeline_bound_with_speeds_never_above_a_plan(seed, speeds):
    model = build_cost_model(with_speeds(replace(BASE, world_size=8, max_tokens_per_rank=4096), speeds))
    batch = random_batch(random.Random(seed), model.domain.capacity // 4, 24)
    plan = run_planner(build_planner("dhp"), batch, model, pipeline_stages=4)
    assert pipeline_lower_bound(model, batch.samples, 4) <= simulate(plan, model).step_time_s * (1 + 1e-9)


CASES = {
    "wlbllm 64": dict(),
    "family": dict(family=True),
    "pp 4": dict(stages=4),
    "overlap off, lambda": dict(overrides={"overlap_comm": False, "cp_microbatch_overhead_s": 0.02, "sample_overhead_s": 0.01}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speeds_all_one_give_todays_plans_and_numbers(case):
    opts = CASES[case]
    config = replace(BASE, **opts.get("overrides", {}))
    blind = build_cost_model(config)
    ones = build_cost_model(with_speeds(config, [1.0] * config.world_size))
    family = group_family(64, 8, 32) if opts.get("family") else None
    stages = opts.get("stages", 1)
    for k in range(2):
        batch = wlb_batch(blind, k, 512 if stages == 1 else 128)
        a = run_planner(build_planner("dhp"), batch, blind, family=family, pipeline_stages=stages)
        b = run_planner(build_planner("dhp"), batch, ones, family=family, pipeline_stages=stages)
        assert a.fingerprint() == b.fingerprint()
        assert (a.predicted_step_time_s, a.lower_bound_s) == (b.predicted_step_time_s, b.lower_bound_s)
        assert best_lower_bound(blind, batch.samples) == best_lower_bound(ones, batch.samples)


def rank_work(plan: Plan, model) -> np.ndarray:
    """Each position's compute seconds at speed 1: its groups' samples' work over their group sizes."""
    out = np.zeros(plan.world_size)
    for g in plan.groups:
        work = float(model.sample_work([plan.sample(i) for i in g.sample_ids]).sum())
        out[list(g.ranks)] += work / g.size
    return out


def test_a_slow_rank_gets_less_work_and_the_step_is_shorter():
    speeds = np.ones(64)
    speeds[21] = 0.5
    model = build_cost_model(with_speeds(BASE, speeds))
    batch = wlb_batch(model)
    aware = run_planner(build_planner("dhp"), batch, model)
    blind = run_planner(build_planner("dhp", speed_aware=False), batch, model)
    work = rank_work(aware, model)
    assert work[21] < 0.75 * np.median(np.delete(work, 21))
    assert aware.predicted_step_time_s < blind.predicted_step_time_s
    assert aware.rank_speeds == tuple(speeds.tolist()) and aware.slow_ranks() == [(21, 0.5)]
    assert "slow r21@0.50" in aware.summary()


def test_a_very_slow_rank_idles():
    speeds = np.ones(16)
    speeds[3] = 0.01
    model = build_cost_model(with_speeds(replace(BASE, world_size=16), speeds))
    plan = run_planner(build_planner("dhp"), wlb_batch(model, size=96), model)
    assert rank_work(plan, model)[3] == 0.0


def test_peers_plan_speed_blind_and_are_priced_with_speeds():
    speeds = np.ones(64)
    speeds[0] = 0.5
    blind_model = build_cost_model(BASE)
    model = build_cost_model(with_speeds(BASE, speeds))
    batch = wlb_batch(model)
    for name in ("static", "fcp-ref"):
        planner = build_planner(name, {"dataset_max_tokens": int(batch.lengths.max())})
        a, b = run_planner(planner, batch, blind_model), run_planner(planner, batch, model)
        assert a.groups == b.groups
        assert b.predicted_step_time_s == simulate(b, model).step_time_s > a.predicted_step_time_s


def test_plan_json_records_the_speeds(tmp_path):
    speeds = [1.0, 0.5, 1.0, 0.75]
    model = build_cost_model(with_speeds(replace(BASE, world_size=4, gpus_per_node=4), speeds))
    plan = run_planner(build_planner("dhp"), wlb_batch(model, size=16), model)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.rank_speeds == tuple(speeds)
    assert loaded.fingerprint() == plan.fingerprint() == replace(plan, rank_speeds=()).fingerprint()


@pytest.mark.parametrize("speeds, message", [
    ((1.0, 0.5), "rank_speeds holds 2 speeds but the domain has 64 ranks"),
    ((0.0,) * 64, "rank speed 0.0 must be a finite number > 0"),
    ((float("nan"),) * 64, "rank_speeds' = nan must be a finite number"),
])
def test_bad_speeds_are_clear_errors(speeds, message):
    with pytest.raises(DhpError, match=message):
        BASE.with_overrides(rank_speeds=speeds)


def test_speed_levels_round_up_and_cover_every_degree():
    domain = with_speeds(replace(BASE, world_size=5), [0.5, 1.0, 0.71, 1.0, 0.5]).domain
    levels = domain.speed_levels()
    assert [(a, b) for _, a, b in levels] == [(1, 2), (3, 3), (4, 5)]
    assert levels[0][0] == 1.0 and 0.71 <= levels[1][0] < 0.71 * 1.02 and 0.5 <= levels[2][0] < 0.5 * 1.02


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.sampled_from([16, 96, 256]), uneven=st.booleans())
def test_the_screened_longest_sample_term_is_the_minimum_over_every_level_of_every_sample(seed, n, uneven):
    rng = np.random.default_rng(seed)
    speeds = tuple(np.round(rng.uniform(0.3, 1.0, n), 3).tolist())
    model = build_cost_model(replace(GPT7B.with_overrides(world_size=n, rank_speeds=speeds), uneven_shards=uneven))
    samples = LengthSource.from_args(dist="wlbllm").draw(global_batch=4 * n, seed=seed, capacity=model.domain.capacity)
    tokens = np.array([s.tokens for s in samples.samples], dtype=np.float64)
    work, lo = model.sample_work(samples.samples), model.footprint(samples.samples).min_degree()
    m, every = model.config.microbatch_overhead_s, np.full(len(tokens), np.inf)
    for v, a, b in model.domain.speed_levels(uneven):  # the term as it was: every level for every sample
        t, _ = model.best_time(tokens, work, lo=np.maximum(lo, a), hi=b, speed=v)
        every = np.minimum(every, np.where(lo <= b, m / v + t, np.inf))
    assert model._longest(tokens, work, lo) == float(every.max())
