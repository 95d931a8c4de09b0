"""dhp's wide samples on the ranks that free up first (`solver.dhp.scatter`): the list schedules in C equal the
Python to the last bit, every wide sample gets exactly its degree of ranks at a time they are free, dhp takes
such groups where the comm allows any rank set and only there, and plans where no wide sample waits are
the ones it made before."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.bound import best_lower_bound
from megatron_dhp.plan.family import group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.dhp import native, planner, scatter
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import Skyline
from megatron_dhp.solver.dhp.planner import DhpPlanner
from megatron_dhp.workload import LengthSource, get_distribution
from megatron_dhp.workload.sample import Batch, Sample
from tests.configs import GPT7B
from tests.solver.test_draft_native import both_ways, needs_native

LONG = dataclasses.replace(get_distribution("bimodal"), name="long-context",
                           params=dict(long_prob=0.05, short=(128, 4096), long=(32768, 131072)))
"""bench/no_overlap_gap.py's long-context batches: 5 % documents of 32K-128K tokens among 128-4K ones."""


def long_context_batch(model, index: int = 0, global_batch: int = 512):
    source = LengthSource(name="long-context", distribution=LONG)
    return source.draw(global_batch=global_batch, seed=0, index=index, capacity=model.domain.capacity)


@st.composite
def schedules(draw):
    """Orders of wide samples on a small domain, their times on a coarse grid (finishes and readies tie as often
    as they differ, which puts [L1] - [L4]'s ties to work) or any float."""
    gpn = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n = draw(st.integers(1, 24))
    w = draw(st.integers(1, 12))
    value = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]), st.floats(0.0, 4.0))
    degree = np.array(draw(st.lists(st.integers(1, n), min_size=w, max_size=w)), dtype=np.int64)
    t_in = np.array(draw(st.lists(value, min_size=w, max_size=w)))
    t_out = t_in + np.array(draw(st.lists(value, min_size=w, max_size=w)))
    overhead = np.array(draw(st.lists(st.sampled_from([0.0, 0.25, 0.1]), min_size=w, max_size=w)))
    rows = draw(st.integers(1, 5))
    orders = np.array([draw(st.permutations(range(w))) for _ in range(rows)], dtype=np.int64)
    spare = draw(st.sampled_from([0.0, 1.0, 10.0, 100.0]))
    return orders, degree, t_in, t_out, overhead, n, gpn, spare


@needs_native
@settings(max_examples=200, deadline=None)
@given(schedules())
def test_list_schedules_in_c_equal_the_python(problem):
    orders, degree, t_in, t_out, overhead, n, gpn, spare = problem
    compiled, python = both_ways(lambda: [a.tolist() for a in scatter.list_schedules(*problem)])
    assert compiled == python
    compiled, python = both_ways(lambda: scatter.list_placement(orders[0], degree, t_in, t_out, overhead, n, gpn))
    assert compiled == python


@settings(max_examples=100, deadline=None)
@given(schedules())
def test_each_wide_sample_gets_its_degree_of_free_ranks(problem):
    # Replayed from its placement: exactly d distinct ranks each, started when the last of them is free, and
    # the end the schedule reports is the last finish.
    orders, degree, t_in, t_out, overhead, n, gpn, spare = problem
    order = orders[0]
    ready = np.zeros(n)
    for k, (ranks, begin) in zip(order.tolist(), scatter.list_placement(order, degree, t_in, t_out, overhead, n, gpn)):
        assert len(set(ranks)) == len(ranks) == degree[k] and all(0 <= r < n for r in ranks)
        assert begin == ready[list(ranks)].max()
        intra = len({r // gpn for r in ranks}) == 1
        ready[list(ranks)] = begin + (t_in[k] if intra else t_out[k]) + overhead[k]
    ends, _, _ = scatter.list_schedules(orders[:1], degree, t_in, t_out, overhead, n, gpn, spare)
    assert ends[0] == ready.max()


def test_a_sample_that_fits_a_node_waits_for_one_where_that_ends_it_sooner():
    # Two nodes of 4: a 3-rank sample takes ranks 0-2 first. The next one finds ranks 3-5 free first (across
    # the nodes, slow); node 1's free first three end it sooner: it takes 4-6, inside node 1.
    degree = np.array([3, 3], dtype=np.int64)
    steps = scatter.list_placement(np.array([0, 1]), degree, np.array([1.0, 1.0]), np.array([5.0, 5.0]), np.zeros(2), 8, 4)
    assert steps == [((0, 1, 2), 0.0), ((4, 5, 6), 0.0)]


def test_dhp_starts_wide_samples_on_the_ranks_free_first_without_overlap():
    # bench/no_overlap_gap.py's long-context batch, 64 ranks without overlap: aligned windows left dhp 5-11 %
    # above the bound; the list schedules' groups (across nodes, not contiguous) bring it within 3 %.
    model = build_cost_model(GPT7B.with_overrides(overlap_comm=False))
    batch = long_context_batch(model, index=1)
    plan = run_planner(build_planner("dhp"), batch, model)
    plan.validate()
    assert plan.predicted_step_time_s == pytest.approx(simulate(plan, model).step_time_s, rel=1e-12)
    scattered = [g.ranks for g in plan.groups if sorted(g.ranks) != list(range(min(g.ranks), max(g.ranks) + 1))]
    assert scattered and any(not model.is_intra(r) for r in scattered)
    assert plan.predicted_step_time_s <= 1.03 * best_lower_bound(model, batch.samples)
    aligned = aligned_plan(batch, model)
    assert plan.predicted_step_time_s < 0.97 * aligned.predicted_step_time_s


def aligned_plan(batch, model, family=None):
    """dhp's plan without list schedules."""
    with mock.patch.object(DhpPlanner, "list_tries", 0):
        return run_planner(build_planner("dhp"), batch, model, family=family)


def test_a_family_keeps_every_group_in_it():
    model = build_cost_model(GPT7B.with_overrides(overlap_comm=False))
    batch = long_context_batch(model, index=1)
    family = group_family(64, 8, 32)
    plan = run_planner(build_planner("dhp"), batch, model, family=family)
    assert all(family.contains(g.ranks) for g in plan.groups)
    assert plan.to_dict(timings=False) == aligned_plan(batch, model, family).to_dict(timings=False)


def test_plans_where_no_wide_sample_waits_are_unchanged():
    # Eight 2-rank samples among short ones on 64 ranks: each starts on its window at once, so no list schedule
    # is tried and the plan is the one dhp made without them.
    model = build_cost_model(GPT7B)
    batch = Batch(tuple(Sample(i, 16384 if i < 8 else 1024 + 37 * i) for i in range(300)))
    with mock.patch.object(planner, "scattered", wraps=planner.scattered) as tried:
        plan = run_planner(build_planner("dhp"), batch, model)
    assert not tried.called
    assert any(len(g.ranks) > 1 and g.microbatches for g in plan.groups)
    assert plan.to_dict(timings=False) == aligned_plan(batch, model).to_dict(timings=False)


def test_list_schedules_run_on_an_empty_skyline_only():
    model = build_cost_model(GPT7B)
    inst = Instance.from_batch(long_context_batch(model, global_batch=64), model)
    skyline = Skyline.empty(64)
    wide = np.flatnonzero(inst.min_degree > 1)
    scatter.place_scattered(inst, skyline, wide, inst.min_degree)
    assert len(skyline.wide) >= 1
    with pytest.raises(AssertionError, match="free ranks"):
        scatter.place_scattered(inst, skyline, wide, inst.min_degree)


@needs_native
def test_bad_orders_are_refused_by_name():
    with pytest.raises(ValueError, match="an order entry or degree out of range"):
        native.draft.list_ends(np.array([[0, 3]]), np.array([1, 1]), np.ones(2), np.ones(2), np.zeros(2), 4, 2, 0.0)
    with pytest.raises(TypeError, match="placed must be a list"):
        native.draft.list_ends(np.array([[0, 1]]), np.array([1, 1]), np.ones(2), np.ones(2), np.zeros(2), 4, 2, 0.0, ())


def test_a_draft_far_from_its_bound_is_list_scheduled_even_where_no_wide_sample_waits():
    # `giant` without overlap: the aligned draft starts every wide sample at once yet ends 2.5 % above the bound
    # (its degrees hold it back); the list schedule at balanced degrees reaches the bound.
    model = build_cost_model(GPT7B.with_overrides(overlap_comm=False))
    batch = LengthSource.from_args(dist="giant").draw(global_batch=512, seed=0, index=0, capacity=model.domain.capacity)
    bound = best_lower_bound(model, batch.samples)
    assert aligned_plan(batch, model).predicted_step_time_s > 1.02 * bound
    assert run_planner(build_planner("dhp"), batch, model).predicted_step_time_s <= 1.001 * bound
