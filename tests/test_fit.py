"""The profiled cost model's fit: grid points' features, the non-negative fit, its cost config, sigma."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron_dhp.cost import build_cost_model
from megatron_dhp.cost.fit import (
    TERMS,
    GridPoint,
    default_grid,
    fit,
    predict,
    profiled_cost,
    step_overhead,
)
from megatron_dhp.workload import Batch


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


def test_microbatches_that_are_all_overhead_still_fit_a_token_term():
    # A tiny model on a CPU: each microbatch takes its fixed overhead whatever its tokens. The best fit is m
    # alone, which prices no token and which CostConfig refuses; the fit keeps the best one with a token term.
    grid = [GridPoint(L, d, k) for L in (64, 256, 512) for d in (1, 2) for k in (1, 4)]
    noise = np.random.default_rng(0).normal(1.0, 0.02, len(grid))
    fitted = fit(grid, (0.01 * noise).tolist())
    assert fitted["attn_s_per_token2"] + fitted["linear_s_per_token"] > 0
    profiled_cost(fitted, world_size=2, gpus_per_node=2, max_tokens_per_rank=512, description="overhead only")


def test_a_data_point_describes_and_fits_its_exact_lengths():
    point = GridPoint.from_data([100, 8, 40], 2)
    assert point.describe() == "3 of 8-100 (data)" and GridPoint(64, 1, 4).describe() == "4 x 64"
    assert point.features()[2] == 3 and point.features()[1] == 1.0  # k samples, lambda on


def test_the_profiled_cost_model_times_every_point_as_the_fit_predicts():
    coefficients = dict(zip(TERMS, (0.013, 0.016, 0.003, 2e-7, 5e-6, 1e-5)))
    cost = profiled_cost(coefficients, world_size=4, gpus_per_node=4, max_tokens_per_rank=512, description="test")
    assert cost.kind == "profiled" and cost.overlap_comm is False and cost.step_overhead_s == 0.0
    model = build_cost_model(cost)
    grid = default_grid(num_ranks=4, max_tokens_per_rank=512) + [GridPoint.from_data([100, 8, 40], 2)]
    for point, fitted in zip(grid, predict(grid, coefficients)):
        samples = Batch.from_lengths(list(point.lengths)).samples
        assert model.microbatch_time(samples, range(point.group_size)) == pytest.approx(fitted, rel=1e-12), point


def test_step_overhead_is_the_median_gap_and_never_negative():
    assert step_overhead([(0.010, 0.013), (0.020, 0.021), (0.030, 0.040)]) == pytest.approx(0.003)
    assert step_overhead([(0.010, 0.013), (0.020, 5.0), (0.030, 0.031)]) == pytest.approx(0.003)  # a load burst
    assert step_overhead([(0.010, 0.009), (0.020, 0.018)]) == 0.0
    assert step_overhead([]) == 0.0


def test_the_fit_imports_no_torch():
    code = "import sys, megatron_dhp.cost.fit; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
