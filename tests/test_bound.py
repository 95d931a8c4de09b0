"""The coupled lower bound (`cost.bound`): never above a valid plan's simulated step, over cost-model variants."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.bound import OVERHEAD_SHARES, best_lower_bound, coupled_lower_bound
from megatron_dhp.plan.encoder import CONCRETE_PLACEMENTS
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.base import PlannerUnsupported
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload.sample import Batch, Sample, VisualItem
from tests.configs import GPT7B

BASE = GPT7B

# Small domains with a small M, so that samples need several ranks and the planners see every regime.
variants = st.fixed_dictionaries({
    "world_size": st.sampled_from([3, 8, 12, 16]),
    "gpus_per_node": st.sampled_from([2, 4, 8, 72]),
    "max_tokens_per_rank": st.sampled_from([512, 1024, 4096]),
    "overlap_comm": st.booleans(),
    "microbatch_overhead_s": st.sampled_from([0.0, 0.05, 0.2, 1.0]),
    "inter_node_bytes_per_s": st.sampled_from([5.0e9, 20.0e9]),
    "sample_overhead_s": st.sampled_from([0.0, 0.01]),
    "cp_microbatch_overhead_s": st.sampled_from([0.0, 0.03]),
    "step_overhead_s": st.sampled_from([0.0, 0.5]),
    "encoder_placement": st.sampled_from(["split", "replicate", "global"]),
    "encoder_frozen": st.booleans(),
    "enc_a2a_bytes_per_token": st.sampled_from([0.0, 16384.0]),
    "enc_attn_s_per_token2": st.sampled_from([2.0e-9, 2.0e-7]),
    "enc_memory_per_token": st.sampled_from([0.0, 0.05, 0.25]),
})


def random_batch(rng: random.Random, capacity: int, size: int) -> Batch:
    """Lengths from 1 token to the whole domain, some with images, skewed toward short ones."""
    samples = []
    for i in range(size):
        tokens = max(1, min(capacity, int(capacity * rng.random() ** 3)))
        llm = rng.randint(1, tokens)
        blocks = [rng.randint(1, 4 * llm) for _ in range(rng.randint(1, 3))]
        images = (VisualItem(sum(blocks), llm, blocks),) if rng.random() < 0.2 else ()
        samples.append(Sample(i, tokens, images))
    return Batch(tuple(samples))


def plans(batch: Batch, model, rng: random.Random) -> list:
    """Every planner's plan that it can make, and random valid plans."""
    out = []
    for name in ("dhp", "static", "megatron-hcp", "fcp-ref"):
        try:
            out.append(run_planner(build_planner(name, {"dataset_max_tokens": int(batch.lengths.max())}), batch, model))
        except PlannerUnsupported:
            pass
    return out + [random_plan(batch, model.domain, rng, max_phases=3, memory=model.memory_rule()) for _ in range(5)]


def assert_best_bound_holds(model, seed: int, size: int) -> None:
    """`best_lower_bound` is never above dhp's or five random valid plans' simulated steps (a random batch of
    `size` samples that fits the model's domain)."""
    rng = random.Random(seed)
    batch = random_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)
    bound = best_lower_bound(model, batch.samples)
    candidates = [random_plan(batch, model.domain, rng, max_phases=3, memory=model.memory_rule()) for _ in range(5)]
    candidates.append(run_planner(build_planner("dhp"), batch, model))
    for plan in candidates:
        assert bound <= simulate(plan, model).step_time_s * (1 + 1e-9), plan.planner


@settings(max_examples=40, deadline=None)
@given(overrides=variants, seed=st.integers(0, 2**31 - 1), size=st.integers(1, 40))
def test_bound_never_above_a_valid_plan(overrides, seed, size):
    model = build_cost_model(replace(BASE, **overrides))
    rng = random.Random(seed)
    batch = random_batch(rng, model.domain.capacity, size)
    assume(model.footprint(batch.samples).min_degree().max() <= model.domain.world_size)  # encoder memory fits
    bound = coupled_lower_bound(model, batch.samples)
    for plan in plans(batch, model, rng):
        assert plan.encoder_placement == model.encoder_placement
        step = simulate(plan, model).step_time_s
        assert bound <= step * (1 + 1e-9), (plan.planner, bound, step)
        assert model.lower_bound(batch.samples) <= step * (1 + 1e-9), (plan.planner, step)
    # The coupled bound with f(u) = u contains the reference bound (both take the best placement).
    assert bound >= model.lower_bound(batch.samples) * (1 - 1e-9)


@pytest.mark.parametrize("name", list(OVERHEAD_SHARES))
def test_overhead_shares_are_dual_feasible(name):
    """Any fills that fit one microbatch (sum u <= 1) are charged at most one microbatch (sum f(u) <= 1)."""
    f = OVERHEAD_SHARES[name]
    rng = np.random.default_rng(0)
    for _ in range(2000):
        u = rng.dirichlet(np.ones(rng.integers(1, 6))) * rng.uniform(0.5, 1.0)
        assert f(u).sum() <= 1 + 1e-9, (u, f(u))
    for exact in ([0.5, 0.5], [1 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.75], [1.0]):
        assert f(np.array(exact)).sum() <= 1 + 1e-9


@settings(max_examples=15, deadline=None)
@given(overrides=variants, seed=st.integers(0, 2**31 - 1), size=st.integers(1, 30))
def test_auto_placement_bound_is_the_least_over_the_placements_that_hold_the_batch(overrides, seed, size):
    """Under `auto` the best bound is the least over the concrete placements the planners may pick, and never
    above any planner's plan (each planned under the placement it predicts fastest)."""
    model = build_cost_model(replace(BASE, **{**overrides, "encoder_placement": "auto"}))
    rng = random.Random(seed)
    batch = random_batch(rng, model.domain.capacity, size)
    n = model.domain.world_size
    held = [m for m in map(model.with_placement, CONCRETE_PLACEMENTS) if m.footprint(batch.samples).min_degree().max() <= n]
    assume(held)
    bound = best_lower_bound(model, batch.samples)
    assert bound == min(best_lower_bound(m, batch.samples) for m in held)
    for plan in plans(batch, model, rng)[:-5]:  # the planners' (random plans are made for one placement)
        assert bound <= simulate(plan, model).step_time_s * (1 + 1e-9), (plan.planner, plan.encoder_placement)


def test_bound_is_tighter_where_the_longest_sample_needs_wide_groups():
    """Without overlap, a sample that fits 2 ranks but must run on 8 to end by the reference bound costs 6
    ranks' communication more; the coupled bound charges it and the reference bound does not."""
    model = build_cost_model(replace(BASE, world_size=16, gpus_per_node=8, overlap_comm=False))
    batch = Batch((Sample(0, 2 * 8192), *(Sample(i, 1000) for i in range(1, 40))))
    reference, coupled = model.lower_bound(batch.samples), coupled_lower_bound(model, batch.samples)
    assert coupled > 1.05 * reference
    plan = run_planner(build_planner("dhp"), batch, model)
    assert coupled <= plan.predicted_step_time_s
    assert best_lower_bound(model, batch.samples) == coupled


def test_half_share_counts_one_microbatch_per_sample_above_half_a_rank():
    """Samples of 0.6 M tokens on one rank cannot share a microbatch: the 'half' share charges m for each
    (the tokens' share, m sum L / M, only 0.6 m), so the bound is the plan itself."""
    model = build_cost_model(replace(BASE, world_size=1, gpus_per_node=1, microbatch_overhead_s=1.0))
    cap = model.domain.max_tokens_per_rank
    batch = Batch(tuple(Sample(i, int(0.6 * cap)) for i in range(40)))
    work = model.sample_work(batch.samples)
    per_sample = float(model.sample_time(batch.lengths.astype(float), work, 1, True)[0])
    assert coupled_lower_bound(model, batch.samples) == pytest.approx(40 * (1.0 + per_sample))
    assert run_planner(build_planner("dhp"), batch, model).predicted_step_time_s == pytest.approx(40 * (1.0 + per_sample))
