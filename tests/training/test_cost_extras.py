"""The cost model's optional terms (per-sample s, per-CP-microbatch lambda, per-step sigma) and the grid
points the profile times: packed from the job's data, planned within the cap, repeated as they run; the
profile's one-line summary of its calibration steps.
(The fit itself is tested in tests/test_fit.py.)"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.fit import GridPoint
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.training.profile import ProfileReport
from megatron_dhp.training.timing import data_grid, microbatches, point_plan
from megatron_dhp.workload import Batch, LengthSource
from tests import reference_eval
from tests.cost_defaults import assert_defaults_change_nothing


def test_zero_extras_leave_every_reference_number_unchanged(tmp_path, gpt7b_config):
    reference = gpt7b_config
    explicit = replace(reference, sample_overhead_s=0.0, cp_microbatch_overhead_s=0.0, step_overhead_s=0.0)
    assert_defaults_change_nothing(reference, explicit, ("sample_overhead_s", "cp_microbatch_overhead_s", "step_overhead_s"),
                                   tmp_path)


def test_extras_add_exactly_their_time(gpt7b_config):
    base = replace(gpt7b_config, world_size=4, gpus_per_node=4)
    extra = replace(base, sample_overhead_s=0.01, cp_microbatch_overhead_s=0.5)
    m0, m1 = build_cost_model(base), build_cost_model(extra)
    samples = Batch.from_lengths([1000, 3000]).samples
    assert m1.microbatch_time(samples, [0]) == pytest.approx(m0.microbatch_time(samples, [0]) + 0.02)
    assert m1.microbatch_time(samples, [0, 1]) == pytest.approx(m0.microbatch_time(samples, [0, 1]) + 0.02 + 0.5)


def test_step_overhead_adds_exactly_sigma_to_every_step_and_to_the_bound(tiny_cpu_config):
    base = replace(tiny_cpu_config, world_size=4, gpus_per_node=4, step_overhead_s=0.0)
    slow = replace(base, step_overhead_s=0.004)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=32, seed=1, capacity=4 * 512)
    batch = Batch.from_lengths([max(1, L // 32) for L in batch.lengths])
    m0, m1 = build_cost_model(base), build_cost_model(slow)
    assert m1.lower_bound(batch.samples) == pytest.approx(m0.lower_bound(batch.samples) + 0.004)
    for name in ("static", "dhp", "fcp-ref"):
        a, b = run_planner(build_planner(name), batch, m0), run_planner(build_planner(name), batch, m1)
        assert a.groups == b.groups  # a constant every plan pays changes no decision
        assert b.predicted_step_time_s == pytest.approx(a.predicted_step_time_s + 0.004)
        assert all(s.start_s >= 0.004 for s in simulate(b, m1).spans)


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_stays_valid_with_the_extras(seed, tiny_cpu_config):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4, 8])
    cost = replace(tiny_cpu_config, world_size=n, gpus_per_node=rng.choice([1, 2, n]),
                   sample_overhead_s=rng.choice([0.0, 0.003, 0.02]), cp_microbatch_overhead_s=rng.choice([0.0, 0.015, 0.2]),
                   comm_bytes_per_token=rng.choice([0.0, 2e4]), step_overhead_s=rng.choice([0.0, 0.005]))
    model = build_cost_model(cost)
    lengths = [rng.randint(1, n * cost.max_tokens_per_rank) for _ in range(rng.randint(1, 30))]
    batch = Batch.from_lengths(lengths)
    bound = model.lower_bound(batch.samples)
    assert bound == pytest.approx(reference_eval.lower_bound(cost.to_dict(), [s.to_dict() for s in batch.samples]), rel=1e-12)
    plans = [run_planner(build_planner(p, {"dataset_max_tokens": max(lengths)}), batch, model) for p in ("static", "dhp")]
    plans += [random_plan(batch, cost.domain, rng) for _ in range(20)]
    for plan in plans:
        step = simulate(plan, model).step_time_s
        assert step >= bound * (1 - 1e-12), plan.summary()
        assert step == pytest.approx(reference_eval.step_time(cost.to_dict(), plan.to_dict()), rel=1e-12), plan.summary()


def test_data_grid_packs_the_jobs_own_batches_within_the_cap():
    config = TrainConfig.load("demo_cpu")
    cap = config.dhp.max_tokens_per_rank
    points = data_grid(config, per_size=3)
    assert [p.group_size for p in points] == [1, 1, 1, 2, 2, 2]
    from megatron_dhp.training.data import TokenPipeline

    pipeline = TokenPipeline(config.data, vocab_size=config.model.vocab_size, capacity=2 * cap, truncate=True)
    order = [int(L) for k in range(config.train.steps) for L in pipeline.batch(k).lengths]
    for d in (1, 2):
        mine = [p for p in points if p.group_size == d]
        packed = [L for p in mine for L in p.drawn]
        fitting = [L for L in order if -(-L // d) <= cap]
        assert packed == fitting[:len(packed)]  # data order, nothing skipped
        for p in mine:
            assert p.samples == len(p.drawn) and p.length == max(p.drawn)
            plan, _ = point_plan(p, 2, config)
            plan.validate()  # within the cap, as every plan must be
    assert data_grid(config, per_size=0) == []


def test_a_data_point_runs_its_exact_lengths_like_a_uniform_point():
    point = GridPoint.from_data([100, 8, 40], 2)
    assert microbatches(point) == [[100, 8, 40]] * 3 and microbatches(GridPoint(64, 1, 2)) == [[64, 64]] * 3


def test_the_calibration_summary_counts_the_steps_predicted_within_15_percent(tiny_cpu_config):
    cost = replace(tiny_cpu_config, step_overhead_s=0.003)
    steps = (("static", 3, 0.100, 0.100), ("dhp", 3, 0.100, 0.200), ("static", 4, 0.114, 0.100))
    assert ProfileReport([], [], [], cost, steps).calibration_summary() == (
        "step overhead sigma 3.00 ms; 2/3 calibration steps (static and dhp) predicted within 15%")
