"""Uneven shards in the plan and the model (`plan.shares`): the split rule, the plan format, the memory rule
per rank, the pricing, the bounds that allow for it, and dhp's use of it."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.plan.plan import Plan, PlanError, PlanGroup
from megatron_dhp.plan.shares import (
    blend,
    blended_pace,
    chunk_unit,
    mix,
    normalize_shares,
    pace,
    shard_chunks,
    share_fractions,
    shares_for_speeds,
    shares_within,
)
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload import LengthSource
from megatron_dhp.workload.sample import Batch, Sample
from tests.configs import GPT7B


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 100_000), shares=st.lists(st.integers(1, 9), min_size=2, max_size=8),
       sp=st.sampled_from([1, 2, 4, 8]))
def test_chunks_cover_the_sample_in_units_and_follow_the_shares(length, shares, sp):
    chunks = shard_chunks(length, shares, sp)
    unit, d = chunk_unit(sp), len(shares)
    assert all(c >= unit and c % unit == 0 and 2 * c % sp == 0 for c in chunks)
    padded = 2 * sum(chunks)
    assert length <= padded < length + 2 * unit + 2 * d * unit  # at most one unit of padding but the ones per rank
    units = padded // (2 * unit)
    if units > d:  # one unit each, the rest within one unit of its exact part
        spare = np.array(chunks) // unit - 1
        exact = (units - d) * np.array(shares) / sum(shares)
        assert np.all(np.abs(spare - exact) < 1)


def test_causal_work_follows_the_chunk_whatever_its_offset():
    """A front chunk at offset o and its mirror, c tokens each, hold c (L + 1) causal pairs: the balance the
    zigzag gives even shards holds for each share."""
    length = 1000
    for c, o in ((10, 0), (10, 300), (37, 120), (250, 250)):
        front = sum(p + 1 for p in range(o, o + c))
        back = sum(p + 1 for p in range(length - o - c, length - o))
        assert front + back == c * (length + 1)


def test_shares_are_checked_and_stored_in_one_form():
    assert normalize_shares([2, 2, 2], 3) == ()
    assert normalize_shares([4, 2], 2) == (2, 1)
    assert normalize_shares([], 5) == ()
    with pytest.raises(ValueError, match="give one per rank"):
        normalize_shares([1, 2], 3)
    with pytest.raises(ValueError, match="share 0 must be a positive integer"):
        normalize_shares([0, 2], 2)
    with pytest.raises(ValueError, match="share 1.5"):
        normalize_shares([1.5, 2], 2)
    with pytest.raises(PlanError, match=r"group of ranks \[0, 1\]: share -1"):
        PlanGroup((0, 1), ((0,),), shares=(-1, 2))
    assert shares_for_speeds([1.0, 0.5]) == (2, 1)
    assert shares_for_speeds([0.7, 0.7]) == ()


TWO_SAMPLES = (Sample(0, 3000), Sample(1, 500))


def plan_of(groups) -> Plan:
    return Plan("test", 4, 4, TWO_SAMPLES, groups, max_tokens_per_rank=2048)


def test_plan_json_records_shares_only_where_uneven_and_keeps_even_plans_unchanged(tmp_path):
    even = plan_of((PlanGroup((0, 1), ((0,),)), PlanGroup((2, 3), ((1,),))))
    uneven = plan_of((PlanGroup((1, 0), ((0,),), shares=(3, 2)), PlanGroup((2, 3), ((1,),), shares=(1, 1))))
    assert "shares" not in json.dumps(even.to_dict())
    assert uneven.to_dict()["groups"][0]["shares"] == [3, 2] and "shares" not in uneven.to_dict()["groups"][1]
    assert uneven.groups[0].sorted_shares == (2, 3)  # rank 0 holds 2 parts, rank 1 three
    path = tmp_path / "plan.json"
    uneven.save(path)
    assert Plan.load(path) == uneven and Plan.load(path).fingerprint() == uneven.fingerprint()
    assert uneven.fingerprint() != even.fingerprint()
    # a plan written before shares existed reads back as even, with the same fingerprint
    assert Plan.from_dict(json.loads(even.to_json())).fingerprint() == even.fingerprint()
    bad = uneven.to_dict()
    bad["groups"][0]["shares"] = [1, 2, 3]
    with pytest.raises(PlanError, match="3 values for a group of 2 ranks"):
        Plan.from_dict(bad)


def test_memory_rule_holds_on_the_rank_of_the_largest_share():
    """3,000 tokens on 2 ranks at a cap of 2,048: even (1,500 each) fits; 3:2 puts 1,800 on one rank, fits;
    3:1 puts 2,250 there, refused, naming the share and the fix."""
    plan_of((PlanGroup((0, 1), ((0,),)), PlanGroup((2, 3), ((1,),)))).validate()
    plan_of((PlanGroup((0, 1), ((0,),), shares=(3, 2)), PlanGroup((2, 3), ((1,),)))).validate()
    with pytest.raises(PlanError, match=r"2250 tokens on its rank of the largest share \(3 of 4\).*evener shares"):
        plan_of((PlanGroup((0, 1), ((0,),), shares=(3, 1)), PlanGroup((2, 3), ((1,),)))).validate()


def test_pace_even_is_the_slowest_and_proportional_is_the_mean():
    assert pace([1.0, 0.5]).speed == 0.5 and pace([1.0, 0.5]).comm_scale == 1.0
    p = pace([1.0, 0.5, 0.5], (2, 1, 1))
    assert p.speed == pytest.approx(2 / 3) and p.slowest == 0.5 and p.comm_scale == pytest.approx(1.5)
    assert pace([1.0, 1.0], (3, 1)).speed == pytest.approx(2 / 3)  # uneven on equal ranks is slower
    # the vectorised blend the planner prices windows with agrees with the exact pace of the mixed shares
    speeds = np.array([1.0, 0.8, 0.45, 0.45])
    shares = shares_for_speeds(speeds)
    for alpha in (0.0, 0.3, 1.0):
        v, scale = blended_pace(alpha, 4, speeds.sum(), speeds.min(), speeds.max())
        exact = pace(speeds, mix(shares, alpha)) if alpha else pace(speeds)
        assert v == pytest.approx(exact.speed, rel=2e-3) and scale == pytest.approx(exact.comm_scale, rel=2e-3)


def test_shares_within_memory_go_only_as_far_toward_the_speeds_as_the_cap_lets_them():
    shares = (5, 1)  # the fast rank wants 5/6 of the sample
    limit = 0.7
    phi = share_fractions(shares, 2)
    assert float(blend(limit, 2, phi.max())) == pytest.approx((0.7 - 0.5) / (5 / 6 - 0.5))
    within = shares_within(shares, limit, lambda w: max(w) / sum(w) <= limit)
    assert within and max(within) / sum(within) <= limit and max(within) / sum(within) > 0.65
    assert shares_within(shares, 0.5, lambda w: max(w) / sum(w) <= 0.5) == ()


def mixed_model(speeds, **overrides):
    return build_cost_model(replace(GPT7B, world_size=len(speeds), gpus_per_node=4, max_tokens_per_rank=4096,
                                    rank_speeds=tuple(speeds), **overrides))


def test_a_long_sample_on_mixed_ranks_ends_sooner_with_shares_and_the_bound_allows_it():
    """One sample that needs all 4 ranks, two at 1.0 and two at 0.5: with shares 2:2:1:1 it computes at the
    mean (0.75) instead of 0.5. The bound's end term at the 4th fastest speed would be above that plan (not
    a bound); at the mean of the 4 fastest it is below."""
    model = mixed_model([1.0, 1.0, 0.5, 0.5])
    batch = Batch((Sample(0, 3 * 4096),))
    even = Plan("even", 4, 4, batch.samples, (PlanGroup((0, 1, 2, 3), ((0,),)),), max_tokens_per_rank=4096)
    shared = replace(even, groups=(PlanGroup((0, 1, 2, 3), ((0,),), shares=(2, 2, 1, 1)),))
    shared.validate()
    t_even, t_shared = simulate(even, model).step_time_s, simulate(shared, model).step_time_s
    assert t_shared < 0.8 * t_even
    assert best_lower_bound(model, batch.samples) <= t_shared
    blind = mixed_model([1.0, 1.0, 0.5, 0.5], uneven_shards=False)
    assert best_lower_bound(blind, batch.samples) > t_shared  # the even-shards bound does not hold for it
    plan = run_planner(build_planner("dhp"), batch, model)
    assert plan.groups[0].shares and plan.predicted_step_time_s == pytest.approx(t_shared)
    assert "| 1 uneven |" in plan.summary() and "uneven" not in even.summary()
    assert run_planner(build_planner("dhp"), batch, blind).groups[0].shares == ()


def test_equal_speeds_plan_without_shares_and_the_same_plans_as_before():
    model = build_cost_model(GPT7B)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, index=0,
                                                        capacity=model.domain.capacity)
    on = run_planner(build_planner("dhp"), batch, model)
    off = run_planner(build_planner("dhp"), batch, build_cost_model(replace(GPT7B, uneven_shards=False)))
    assert not any(g.shares for g in on.groups) and on.fingerprint() == off.fingerprint()
    stated = build_cost_model(replace(GPT7B, rank_speeds=(0.5,) * 32 + (1.0,) * 32))  # nodes of one speed each
    assert all(len({stated.domain.speeds[r] for r in g.ranks}) > 1 for g in
               run_planner(build_planner("dhp"), batch, stated).groups if g.shares)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       speeds=st.lists(st.sampled_from([0.3, 0.45, 0.7, 0.9, 1.0]), min_size=16, max_size=16),
       cap=st.sampled_from([512, 1024, 4096]))
def test_dhp_never_gives_a_rank_more_than_its_memory_holds(seed, speeds, cap):
    """With scattered speeds and a tight cap, every group dhp gives shares holds each microbatch on its rank of
    the largest share (`Plan.validate`, which `run_planner` runs, checks it; asserted here directly too)."""
    model = build_cost_model(replace(GPT7B, world_size=16, gpus_per_node=8, max_tokens_per_rank=cap,
                                     rank_speeds=tuple(speeds)))
    rng = random.Random(seed)
    lengths = [max(1, int(16 * cap * rng.random() ** 3)) for _ in range(rng.randint(1, 40))]
    batch = Batch(tuple(Sample(i, n) for i, n in enumerate(lengths)))
    plan = run_planner(build_planner("dhp"), batch, model)
    footprint = model.footprint(batch.samples)
    for g in plan.groups:
        for mb in g.microbatches:
            held = footprint.per_rank(plan.positions(mb), g.size, g.sorted_shares)
            assert held <= cap * (1 + 1e-12), (g, held)
    random_plan(batch, model.domain, rng, memory=model.memory_rule(), uneven=1.0).validate()


def test_simulate_prices_each_group_at_its_pace():
    model = mixed_model([1.0, 0.5, 1.0, 1.0], overlap_comm=False)
    sample = Sample(0, 6000)
    even = Plan("t", 4, 4, (sample,), (PlanGroup((0, 1), ((0,),)), PlanGroup((2,), ()), PlanGroup((3,), ())),
                max_tokens_per_rank=4096)
    shared = replace(even, groups=(PlanGroup((0, 1), ((0,),), shares=(2, 1)), *even.groups[1:]))
    work = float(model.sample_work([sample])[0])
    comm = GPT7B.comm_bytes_per_token * 6000 * 0.5 / GPT7B.intra_node_bytes_per_s
    m = GPT7B.microbatch_overhead_s
    assert simulate(even, model).step_time_s == pytest.approx(m / 0.5 + work / 2 / 0.5 + comm)
    # compute at the mean speed 0.75, m at the slowest, comm for the larger block (2/3 of the sample: x 4/3)
    assert simulate(shared, model).step_time_s == pytest.approx(m / 0.5 + work / 2 / 0.75 + comm * 4 / 3)
    assert math.isclose(model.microbatch_time([sample], (0, 1), (2, 1)), simulate(shared, model).step_time_s)
