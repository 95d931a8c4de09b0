"""The cost model's two optional terms (per-sample s, per-CP-microbatch lambda) and the profile fit."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.plan.random_plan import random_plan
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.training.profile import TERMS, GridPoint, default_grid, fit, predict
from megatron_dhp.workload import Batch, LengthSource


def test_zero_extras_leave_every_reference_number_unchanged(tmp_path):
    reference = CostConfig.load("gpt7b-64")
    explicit = replace(reference, sample_overhead_s=0.0, cp_microbatch_overhead_s=0.0)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=256, seed=0, capacity=64 * 8192)
    for name in ("static", "dhp"):
        a = run_planner(build_planner(name), batch, build_cost_model(reference))
        b = run_planner(build_planner(name), batch, build_cost_model(explicit))
        assert a.predicted_step_time_s == b.predicted_step_time_s and a.lower_bound_s == b.lower_bound_s
    reference.save(tmp_path / "ref.yaml")
    text = (tmp_path / "ref.yaml").read_text()
    assert "sample_overhead_s" not in text and "cp_microbatch_overhead_s" not in text  # files stay as they were
    assert CostConfig.load(tmp_path / "ref.yaml") == reference


def test_extras_add_exactly_their_time():
    base = replace(CostConfig.load("gpt7b-64"), world_size=4, gpus_per_node=4)
    extra = replace(base, sample_overhead_s=0.01, cp_microbatch_overhead_s=0.5)
    m0, m1 = build_cost_model(base), build_cost_model(extra)
    samples = Batch.from_lengths([1000, 3000]).samples
    assert m1.microbatch_time(samples, [0]) == pytest.approx(m0.microbatch_time(samples, [0]) + 0.02)
    assert m1.microbatch_time(samples, [0, 1]) == pytest.approx(m0.microbatch_time(samples, [0, 1]) + 0.02 + 0.5)


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_stays_valid_with_the_extras(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4, 8])
    cost = replace(CostConfig.load("tiny-gpt-cpu"), world_size=n, gpus_per_node=rng.choice([1, 2, n]),
                   sample_overhead_s=rng.choice([0.0, 0.003, 0.02]), cp_microbatch_overhead_s=rng.choice([0.0, 0.015, 0.2]),
                   comm_bytes_per_token=rng.choice([0.0, 2e4]))
    model = build_cost_model(cost)
    lengths = [rng.randint(1, n * cost.max_tokens_per_rank) for _ in range(rng.randint(1, 30))]
    batch = Batch.from_lengths(lengths)
    bound = model.lower_bound(batch.samples)
    plans = [run_planner(build_planner(p, dataset_max_tokens=max(lengths)), batch, model) for p in ("static", "dhp")]
    plans += [random_plan(batch, cost.domain, rng) for _ in range(20)]
    for plan in plans:
        assert simulate(plan, model).step_time_s >= bound * (1 - 1e-12), plan.summary()


def test_fit_recovers_the_coefficients_that_made_the_timings():
    truth = dict(zip(TERMS, (0.013, 0.016, 0.003, 2e-7, 5e-6, 1e-5)))
    grid = default_grid(num_ranks=2, max_tokens_per_rank=512)
    measured = predict(grid, truth)
    fitted = fit(grid, measured.tolist())
    for name in TERMS:
        assert fitted[name] == pytest.approx(truth[name], rel=1e-6), name


def test_fit_keeps_coefficients_non_negative():
    truth = dict(zip(TERMS, (0.01, 0.0, 0.0, 1e-7, 0.0, 0.0)))
    grid = [GridPoint(L, d, k) for L in (64, 256, 512) for d in (1, 2) for k in (1, 4)]
    noise = np.random.default_rng(0).normal(1.0, 0.05, len(grid))
    fitted = fit(grid, (predict(grid, truth) * noise).tolist())
    assert all(v >= 0 for v in fitted.values()) and fitted["attn_s_per_token2"] > 0
