"""fcp-ref: BFD packing, the makespan DP against brute force, rounds, and the published corner cases."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner
from megatron_dhp.solver.fcp_ref import Bin, allocate_degrees, bfd_pack, degree_table, split_rounds
from megatron_dhp.workload import Batch, LengthSource
from tests import reference_eval
from tests.solver.conftest import model_for


def tokens_only(tokens: np.ndarray, cap: int) -> Footprint:
    """The footprint of text samples: their tokens, nothing held."""
    return Footprint(tokens, np.zeros_like(tokens), cap)


def test_bfd_packs_best_fit_into_bins_of_enough_degree():
    tokens = np.array([3, 25, 8, 12, 2, 5])
    bins = bfd_pack(tokens_only(tokens, 10), -(-tokens // 10))
    # 25 opens a 3-rank bin (room 5); 12 cannot fit there: a 2-rank bin (room 8); 8 fills that one exactly;
    # 5 fills the first; 3 opens a 1-rank bin that 2 then joins.
    assert [(b.min_cp, tokens[b.members].tolist(), b.used) for b in bins] == [
        (3, [25, 5], 30), (2, [12, 8], 20), (1, [3, 2], 5)
    ]


def test_bfd_never_puts_a_sample_in_a_bin_of_smaller_degree():
    tokens = np.array([15, 4])
    bins = bfd_pack(tokens_only(tokens, 10), np.array([2, 1]))
    assert len(bins) == 1 and bins[0].min_cp == 2  # the short one joins the long one's 2-rank bin
    bins = bfd_pack(tokens_only(np.array([4, 15]), 10), np.array([1, 2]))
    assert [b.members for b in bins] == [[1, 0]]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_allocate_degrees_matches_brute_force(data):
    n = data.draw(st.integers(1, 8))
    num_bins = data.draw(st.integers(1, min(n, 4)))
    min_cp = data.draw(st.lists(st.integers(1, 3), min_size=num_bins, max_size=num_bins))
    if sum(min_cp) > n:
        min_cp = [1] * num_bins
    table = np.array(data.draw(st.lists(st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n),
                                        min_size=num_bins, max_size=num_bins)))
    for b, lo in enumerate(min_cp):
        table[b, : lo - 1] = np.inf
    degrees = allocate_degrees(table, n)
    brute = min(
        max(table[b, d - 1] for b, d in enumerate(ds))
        for ds in itertools.product(range(1, n + 1), repeat=num_bins) if sum(ds) == n
    )
    assert sum(degrees) == n and all(d >= lo for d, lo in zip(degrees, min_cp))
    assert max(table[b, d - 1] for b, d in enumerate(degrees)) == pytest.approx(brute)


def test_rank_conservation_grows_round_robin_when_degrees_are_capped():
    table = np.array([[5.0, 3.0], [4.0, 2.0]])  # two bins, max degree 2, but 7 ranks to fill
    assert allocate_degrees(table, 7) == [4, 3]


def test_split_rounds_first_fit_decreasing():
    bins = [Bin(cp, 0, []) for cp in (5, 4, 3, 2, 2, 1)]
    rounds = split_rounds(bins, 8)
    assert [[b.min_cp for b in r] for r in rounds] == [[5, 3], [4, 2, 2], [1]]


def test_a_large_batch_runs_in_rounds_each_filling_the_domain(planners):
    model = model_for(64)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=64 * 8192)
    plan = run_planner(planners["fcp-ref"], batch, model)
    assert plan.num_phases > 1 and not plan.phase_barrier
    for phase in range(plan.num_phases):
        groups = sorted((g for g in plan.groups if g.phase == phase), key=lambda g: g.ranks[0])
        assert [r for g in groups for r in g.ranks] == list(range(64))  # contiguous, every rank
        assert all(len(g.microbatches) == 1 for g in groups)  # one packed microbatch per atomic group


def test_non_power_of_two_rings(planners):
    """One node of 12: the long sample's ring takes every rank the short bin does not need."""
    plan = run_planner(planners["fcp-ref"], Batch.from_lengths([5 * 8192, 300, 200]), model_for(12, 16))
    assert sorted((g.size, g.sample_ids) for g in plan.groups) == [(1, [1, 2]), (11, [0])]


def test_max_cp_degree_caps_and_reports():
    planner = build_planner("fcp-ref", max_cp_degree=2)
    plan = run_planner(planner, Batch.from_lengths([1000]), model_for(8))
    assert [g.size for g in plan.groups] == [8]  # DP capped at 2, then grown round-robin to all 8 ranks
    with pytest.raises(PlannerUnsupported, match="needs 3 ranks of 8192 tokens, above max_cp_degree 2"):
        planner.solve(Batch.from_lengths([3 * 8192]), model_for(8))


def test_the_dp_prices_a_group_as_the_simulator_does(gpt7b_config):
    """With s and lambda set, the DP's makespan of the degrees it picks is the simulated step (one round, one
    node: the DP's placement guess is then exact)."""
    cfg = dataclasses.replace(gpt7b_config, world_size=8, gpus_per_node=8, sample_overhead_s=0.01,
                              cp_microbatch_overhead_s=0.3)
    model = build_cost_model(cfg)
    batch = Batch.from_lengths([20000, 9000, 5000, 3000, 700, 6000])
    footprint = model.footprint(batch.samples)
    tokens, min_cp = batch.lengths, footprint.min_degree()
    bins = bfd_pack(footprint, min_cp)
    assert len(split_rounds(bins, 8)) == 1
    degrees = np.arange(1, 9)
    per_sample = model.time_table(tokens, model.sample_work(batch.samples), degrees)
    table = degree_table(model, per_sample, bins)
    chosen = allocate_degrees(table, 8)
    estimate = max(table[b, d - 1] for b, d in enumerate(chosen))
    plan = run_planner(build_planner("fcp-ref"), batch, model)
    assert sorted(g.size for g in plan.groups) == sorted(chosen)
    assert plan.predicted_step_time_s == pytest.approx(estimate, rel=1e-12)
    assert plan.predicted_step_time_s == pytest.approx(reference_eval.step_time(cfg.to_dict(), plan.to_dict()), rel=1e-12)


def test_a_multi_rank_latency_keeps_a_bin_on_one_rank(gpt7b_config):
    """Two 5000-token bins on 4 ranks: without lambda, 2 + 2 ranks is fastest; with lambda = 1 s, splitting
    both pays it twice over and 1 + 3 is faster under the simulator, so the DP must pick that."""
    batch = Batch.from_lengths([5000, 5000])
    base = dataclasses.replace(gpt7b_config, world_size=4, gpus_per_node=4)
    plain = run_planner(build_planner("fcp-ref"), batch, build_cost_model(base))
    assert sorted(g.size for g in plain.groups) == [2, 2]
    model = build_cost_model(dataclasses.replace(base, cp_microbatch_overhead_s=1.0))
    plan = run_planner(build_planner("fcp-ref"), batch, model)
    assert sorted(g.size for g in plan.groups) == [1, 3]
    halves = simulate(plain, model).step_time_s
    assert plan.predicted_step_time_s < halves
