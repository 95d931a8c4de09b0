"""The forced-width bound (`cost.forced_comm`): never above a valid plan's simulated step, whichever planner
made it, over random domains and both overlap modes; the coupled bound where the width counts as its share."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.bound import OVERHEAD_SHARES, best_lower_bound, coupled_bound_arrays
from megatron_dhp.cost.forced_comm import WIDTH_SHARES, forced_width_lower_bound, width_bound_arrays
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.solver import PLANNERS, build_planner, run_planner
from megatron_dhp.solver.base import PlannerUnsupported
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload.sample import Batch, Sample, VisualItem
from tests.bench_scripts import load_bench
from tests.configs import GPT7B

gap_bench = load_bench("no_overlap_gap")

# Small domains with a small M, so that samples are forced onto several ranks, some onto more than half.
variants = st.fixed_dictionaries({
    "world_size": st.sampled_from([2, 3, 8, 12, 16]),
    "gpus_per_node": st.sampled_from([2, 4, 8]),
    "max_tokens_per_rank": st.sampled_from([512, 1024, 4096]),
    "overlap_comm": st.booleans(),
    "microbatch_overhead_s": st.sampled_from([0.0, 0.05, 0.5]),
    "inter_node_bytes_per_s": st.sampled_from([5.0e9, 20.0e9]),
    "sample_overhead_s": st.sampled_from([0.0, 0.01]),
    "cp_microbatch_overhead_s": st.sampled_from([0.0, 0.03]),
    "step_overhead_s": st.sampled_from([0.0, 0.5]),
    "encoder_placement": st.sampled_from(["split", "replicate", "global"]),
    "enc_memory_per_token": st.sampled_from([0.0, 0.25]),
    "cp_comm": st.sampled_from(["ring", "all-to-all"]),
})


def long_batch(rng: random.Random, capacity: int, size: int) -> Batch:
    """Lengths up to the whole domain, a third of them above half of it, some with images."""
    samples = []
    for i in range(size):
        share = rng.uniform(0.5, 1.0) if rng.random() < 1 / 3 else rng.random() ** 3
        tokens = max(1, min(capacity, int(capacity * share)))
        llm = rng.randint(1, tokens)
        images = (VisualItem(2 * llm, llm, (llm, llm)),) if rng.random() < 0.2 else ()
        samples.append(Sample(i, tokens, images))
    return Batch(tuple(samples))


def every_plan(batch: Batch, model, rng: random.Random) -> list[Plan]:
    """Every registered planner's plan that it can make, the bench's witness and five random valid plans."""
    context = {"dataset_max_tokens": int(batch.lengths.max()), "time_limit_s": 1.0}
    out = []
    for name in PLANNERS:
        try:
            out.append(run_planner(build_planner(name, context), batch, model))
        except PlannerUnsupported:
            pass
    out.append(gap_bench.witness_plan(batch, model, tries=4, seed=rng.randrange(100)))
    return out + [random_plan(batch, model.domain, rng, max_phases=3, memory=model.memory_rule()) for _ in range(5)]


@settings(max_examples=120, deadline=None)
@given(overrides=variants, seed=st.integers(0, 2**31 - 1), size=st.integers(1, 12))
def test_bound_never_above_a_valid_plan(overrides, seed, size):
    """Every plan's simulated step is at least the bound (each width weight with each overhead share)."""
    model = build_cost_model(replace(GPT7B, **overrides))
    rng = random.Random(seed)
    batch = long_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)
    bound = forced_width_lower_bound(model, batch.samples)
    for plan in every_plan(batch, model, rng):
        step = simulate(plan, model).step_time_s
        assert bound <= step * (1 + 1e-9), (plan.planner, bound, step)


@settings(max_examples=30, deadline=None)
@given(overrides=variants, seed=st.integers(0, 2**31 - 1), size=st.integers(1, 12))
def test_bound_holds_with_rank_speeds(overrides, seed, size):
    """With ranks at speeds 0.5-1.5 (uneven shards as the model's default allows) the speed-blind bound over the
    fastest speed stays below every plan."""
    rng = random.Random(seed)
    speeds = tuple(rng.choice([0.5, 0.8, 1.0, 1.25, 1.5]) for _ in range(overrides["world_size"]))
    model = build_cost_model(replace(GPT7B, **overrides, rank_speeds=speeds))
    batch = long_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)
    bound = forced_width_lower_bound(model, batch.samples)
    for plan in every_plan(batch, model, rng):
        assert bound <= simulate(plan, model).step_time_s * (1 + 1e-9), plan.planner


@pytest.mark.parametrize("name", list(WIDTH_SHARES))
def test_width_shares_are_dual_feasible(name):
    """Group widths that fit the domain at one instant (sum u <= 1) weigh at most 1 together."""
    f = WIDTH_SHARES[name]
    rng = np.random.default_rng(1)
    for _ in range(2000):
        n = int(rng.integers(1, 65))
        widths = np.diff(np.sort(np.r_[0, rng.choice(np.arange(1, n + 1), size=rng.integers(0, n), replace=False), n]))
        kept = widths[rng.random(len(widths)) < 0.8]
        assert f(kept / n).sum() <= 1 + 1e-9, (n, kept)


@pytest.mark.parametrize("overlap", [True, False])
def test_identity_width_is_the_coupled_bound(overlap):
    """With f(u) = u the sweep is `cost.bound`'s coupled T*, for every overhead share."""
    model = build_cost_model(replace(GPT7B, world_size=16, max_tokens_per_rank=1024, overlap_comm=overlap))
    rng = random.Random(7)
    for _ in range(20):
        batch = long_batch(rng, model.domain.capacity, 30)
        tokens, work = batch.lengths, model.sample_work(batch.samples)
        footprint = model.footprint(batch.samples)
        for share in OVERHEAD_SHARES.values():
            assert width_bound_arrays(model, tokens, work, footprint, share=share) == pytest.approx(
                coupled_bound_arrays(model, tokens, work, footprint, share), rel=1e-12)


def test_two_samples_forced_above_half_the_domain_run_one_after_the_other():
    """Two samples of 5 M tokens on 8 ranks need 5 each, so they never overlap: the bound is both on all 8
    ranks one after the other, which a plan reaches, where the best bound only has their area over 8 ranks."""
    model = build_cost_model(replace(GPT7B, world_size=8, gpus_per_node=8, max_tokens_per_rank=1024,
                                     overlap_comm=False))
    batch = Batch((Sample(0, 5 * 1024), Sample(1, 5 * 1024)))
    plan = Plan("sequence", 8, 8, batch.samples, (PlanGroup(tuple(range(8)), ((0,), (1,))),), max_tokens_per_rank=1024)
    plan.validate()
    t8 = float(model.sample_time(np.array([5120.0]), model.sample_work(batch.samples)[:1], 8, True)[0])
    step = simulate(plan, model).step_time_s
    assert step == pytest.approx(2 * (model.microbatch_overhead(8) + t8))
    assert forced_width_lower_bound(model, batch.samples) == pytest.approx(step, rel=1e-12)
    t5 = float(model.sample_time(np.array([5120.0]), model.sample_work(batch.samples)[:1], 5, True)[0])
    overhead = model.microbatch_overhead(1)  # each sample fills its microbatch on 5 ranks: one m each
    assert best_lower_bound(model, batch.samples) == pytest.approx(2 * 5 * (t5 + overhead) / 8, rel=1e-12)
    assert best_lower_bound(model, batch.samples) < step / 1.15


def test_witness_is_a_valid_plan_of_every_sample():
    """The bench's witness for a long-context batch holds every sample once and is above both bounds."""
    model = build_cost_model(replace(GPT7B, overlap_comm=False))
    source = gap_bench.LengthSource(name="long-context", distribution=gap_bench.LONG_CONTEXT)
    batch = source.draw(global_batch=128, seed=0, index=0, capacity=model.domain.capacity)
    plan = gap_bench.witness_plan(batch, model, tries=3)
    assert sorted(i for g in plan.groups for mb in g.microbatches for i in mb) == [s.id for s in batch.samples]
    step = simulate(plan, model).step_time_s
    assert max(best_lower_bound(model, batch.samples), forced_width_lower_bound(model, batch.samples)) <= step


def test_the_verdict_names_the_part_of_the_gap_that_is_proven():
    """A witness below dhp proves the planner loose, a new bound above the best one the bound; under 0.5 %
    of gap it is tight, and where neither proves half of it, open."""
    assert gap_bench.verdict(gap_bench.split_gap(1.10, 1.01, 1.0, 1.0)) == "planner"
    assert gap_bench.verdict(gap_bench.split_gap(1.10, 1.20, 1.0, 1.08)) == "bound"
    assert gap_bench.verdict(gap_bench.split_gap(1.004, 1.2, 1.0, 1.0)) == "tight"
    assert gap_bench.verdict(gap_bench.split_gap(1.04, 1.03, 1.0, 1.0)) == "open"
    assert gap_bench.split_gap(1.10, 1.01, 1.0, 1.0) == pytest.approx(
        {"gap": 0.10, "bound": 0.0, "planner": 0.09, "open": 0.01})
