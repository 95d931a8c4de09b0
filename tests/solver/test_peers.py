"""Properties every planner shares: valid plans, determinism, the lower bound, clear errors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dhp.errors import DhpError
from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner
from megatron_dhp.workload import Batch, LengthSource
from tests import reference_eval
from tests.solver.conftest import PEERS, model_for


def is_pow2(n: int) -> bool:
    return n & (n - 1) == 0


def may_be_unsupported(name: str, n: int) -> bool:
    """Where a planner's docstring says its source cannot plan: odd N always, non-power-of-two N sometimes."""
    return name in ("megatron-hcp", "flexsp-milp") and not (is_pow2(n) and n >= 2)


def must_be_unsupported(name: str, n: int) -> bool:
    return name in ("megatron-hcp", "flexsp-milp") and n % 2 == 1


@st.composite
def domains_and_batches(draw):
    n = draw(st.integers(1, 80))
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    cap = draw(st.sampled_from([256, 1024, 8192]))
    short = st.integers(1, cap)
    anything = st.integers(1, n * cap)
    lengths = draw(st.lists(st.one_of(short, short, anything), min_size=1, max_size=24))
    return n, gpus_per_node, cap, Batch.from_lengths(lengths, seed=draw(st.integers(0, 3)))


@pytest.mark.parametrize("name", ["static", *PEERS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=domains_and_batches())
def test_plans_validate_and_respect_the_lower_bound(planners, name, case):
    n, gpus_per_node, cap, batch = case
    model = model_for(n, gpus_per_node, cap)
    try:
        plan = run_planner(planners[name], batch, model)  # validates every invariant of Plan.validate
    except PlannerUnsupported:
        assert may_be_unsupported(name, n), f"{name} refused a batch on N={n}, which it documents as supported"
        return
    assert not must_be_unsupported(name, n), f"{name} planned on N={n}, which its source cannot run"
    assert plan.predicted_step_time_s >= plan.lower_bound_s * (1 - 1e-9)
    assert plan.predicted_step_time_s == pytest.approx(
        reference_eval.step_time(model.config.to_dict(), plan.to_dict()), rel=1e-9
    )


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("n", [16, 48])
def test_deterministic(planners, name, n):
    batch = LengthSource.from_args(dist="lognormal-pareto").draw(global_batch=48, seed=3, capacity=n * 8192)
    model = model_for(n)
    first = run_planner(planners[name], batch, model).to_dict(timings=False)
    assert run_planner(planners[name], batch, model).to_dict(timings=False) == first


@pytest.mark.parametrize("name", ["static", *PEERS])
def test_a_sample_longer_than_the_domain_is_a_clear_error(planners, name):
    batch = Batch.from_lengths([100, 8 * 8192 + 1, 3000])
    with pytest.raises(DhpError, match="65537-token sample needs 9 ranks|sample 1 has 65537 tokens but the whole") as info:
        run_planner(planners[name], batch, model_for(8))  # run_planner is the one check, for every planner
    assert not isinstance(info.value, PlannerUnsupported)


@pytest.mark.parametrize("name", ["megatron-hcp", "flexsp-milp"])
def test_power_of_two_planners_refuse_what_their_source_cannot_run(planners, name):
    odd = Batch.from_lengths([1000, 2000])
    with pytest.raises(PlannerUnsupported, match="odd|even"):
        planners[name].solve(odd, model_for(7))
    giant = Batch.from_lengths([1000, 40 * 8192])  # 40 ranks: more than the 32 of the largest power of two
    with pytest.raises(PlannerUnsupported, match="40960|64 ranks|32 ranks"):
        planners[name].solve(giant, model_for(48))
    assert run_planner(planners["fcp-ref"], giant, model_for(48)).groups  # a ring of 40 is fine for FCP


@pytest.mark.parametrize("name", PEERS)
def test_real_batch_plans_beat_nothing_worse_than_serial(planners, name):
    """On a real 512-sample batch every peer's plan is valid and at most the all-ranks-serial time."""
    model = model_for(64)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=64 * 8192)
    planner = build_planner(name, {"time_limit_s": 0.2})  # ~26 MILPs here; 0.2 s each keeps the test short
    plan = run_planner(planner, batch, model)
    serial = sum(model.microbatch_time([s], range(64)) for s in batch.samples)  # each sample alone on all ranks
    assert plan.lower_bound_s <= plan.predicted_step_time_s < serial
