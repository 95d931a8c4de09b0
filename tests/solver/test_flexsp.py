"""flexsp-milp: the MILP against brute force, its warm start, bucketing, and the plan's shape."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.flexsp_milp import bucket_cuts
from megatron_dhp.solver.flexsp_model import BucketProblem, group_times, homogeneous_greedy, solve_bucket_milp
from megatron_dhp.workload import Batch, LengthSource
from tests.solver.conftest import model_for


def pow2_splits(n: int, largest: int):
    """Multisets of powers of two >= 2 summing to n, non-increasing."""
    if n == 0:
        yield []
    size = largest
    while size >= 2:
        if size <= n:
            for rest in pow2_splits(n - size, size):
                yield [size, *rest]
        size //= 2


def brute_force(problem: BucketProblem) -> float:
    """Every grouping of N into powers of two >= 2 and every assignment of samples to its groups."""
    buckets = np.repeat(np.arange(len(problem.counts)), problem.counts)
    best = np.inf
    for sizes in pow2_splits(problem.world_size, problem.world_size):
        for assign in itertools.product(range(len(sizes)), repeat=len(buckets)):
            counts = np.zeros((len(sizes), len(problem.counts)), dtype=np.int64)
            np.add.at(counts, (np.array(assign), buckets), 1)
            if (counts.sum(axis=1) == 0).any():
                continue
            if (counts @ problem.tokens > np.array(sizes) * problem.max_tokens_per_rank).any():
                continue
            best = min(best, float(group_times(problem, np.array(sizes), counts).max()))
    return best


@st.composite
def tiny_problems(draw):
    n = draw(st.sampled_from([2, 4, 8]))
    cap = 1000
    model = model_for(n, gpus_per_node=draw(st.sampled_from([2, 8])), max_tokens_per_rank=cap)
    num_buckets = draw(st.integers(1, 3))
    tokens = np.array(sorted(draw(st.lists(st.integers(50, n * cap // 2), min_size=num_buckets,
                                           max_size=num_buckets, unique=True))))
    counts = np.array(draw(st.lists(st.integers(1, 2), min_size=num_buckets, max_size=num_buckets)))
    sizes = 2 ** np.arange(1, int(np.log2(n)) + 1)
    times = model.time_table(tokens, model.sample_work(Batch.from_lengths(tokens).samples), sizes)
    # beta per size, as a cost model with a multi-rank latency (or any other size dependence) gives it
    overhead = np.array(draw(st.lists(st.sampled_from([0.0, 0.01, 0.05, 0.3]), min_size=len(sizes), max_size=len(sizes))))
    return BucketProblem(counts, tokens, times, sizes, n, cap, overhead)


@settings(max_examples=40, deadline=None)
@given(problem=tiny_problems())
def test_milp_matches_brute_force(problem):
    optimum = brute_force(problem)
    solution = solve_bucket_milp(problem, time_limit_s=5.0)
    if not np.isfinite(optimum):
        assert solution is None
        return
    sizes = np.array(solution.sizes)
    assert sizes.sum() == problem.world_size and (solution.counts.sum(axis=0) == problem.counts).all()
    assert (solution.counts.sum(axis=1) > 0).all()
    assert (solution.counts @ problem.tokens <= sizes * problem.max_tokens_per_rank).all()
    assert solution.makespan_s == pytest.approx(group_times(problem, sizes, solution.counts).max())
    # HiGHS stops at a 1e-4 relative gap; the solution can never beat the exhaustive optimum
    assert optimum - 1e-12 <= solution.makespan_s <= optimum * (1 + 1e-4)
    assert solution.optimal


@settings(max_examples=30, deadline=None)
@given(problem=tiny_problems())
def test_warm_start_is_feasible_and_no_better_than_the_optimum(problem):
    warm = homogeneous_greedy(problem)
    if warm is None:
        return
    sizes = np.array(warm.sizes)
    assert len(set(warm.sizes)) == 1 and sizes.sum() == problem.world_size
    assert (warm.counts @ problem.tokens <= sizes * problem.max_tokens_per_rank).all()
    assert (warm.counts.sum(axis=0) == problem.counts).all() and (warm.counts.sum(axis=1) > 0).all()
    assert warm.makespan_s >= brute_force(problem) - 1e-12


def test_slots_are_pruned_below_the_largest_required_size():
    problem = BucketProblem(np.array([1, 3]), np.array([3500, 100]), np.zeros((2, 3)), np.array([2, 4, 8]),
                            8, 1000, np.full(3, 0.05))
    assert problem.slot_sizes().tolist() == [2, 2, 4, 4, 8]  # a 4-rank group is needed: 4 ranks left for 2s


def test_bucketing_stops_at_the_first_count_whose_padding_fits():
    lengths = np.sort(np.random.default_rng(0).integers(100, 20000, 200)).astype(float)
    capacity = lengths.sum() + 20000.0  # 10000 tokens of padding allowed
    cuts = bucket_cuts(lengths, capacity)
    pad = [sum(lengths[b - 1] - x for x in lengths[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    assert len(cuts) - 1 >= 16 and sum(pad) <= 10000
    fewer = bucket_cuts(lengths, lengths.sum() + 1e9)
    assert len(fewer) - 1 == 16  # plenty of room: the starting 16 buckets
    assert bucket_cuts(np.array([5.0, 5.0, 7.0]), 17.0) == [0, 1, 2, 3]  # fewer samples than 16: one each


def test_plan_shape(planners):
    batch = LengthSource.from_args(dist="bimodal").draw(global_batch=96, seed=0, capacity=16 * 8192)
    plan = run_planner(planners["flexsp-milp"], batch, model_for(16))
    assert plan.num_phases >= 1 and not plan.phase_barrier
    for phase in range(plan.num_phases):
        groups = sorted((g for g in plan.groups if g.phase == phase), key=lambda g: g.ranks[0])
        assert [r for g in groups for r in g.ranks] == list(range(16))  # every rank, contiguous
        sizes = [g.size for g in groups]
        assert sizes == sorted(sizes) and all(s >= 2 and s & (s - 1) == 0 for s in sizes)  # FlexSP's layout
        assert all(len(g.microbatches) == 1 for g in groups)
    longest = max(batch.samples, key=lambda s: s.tokens).id
    assert any(longest in g.sample_ids for g in plan.groups if g.phase == 0)  # the Blaster puts long ones first


def test_time_limit_reaches_the_planner():
    assert build_planner("flexsp-milp", time_limit_s=2.5).time_limit_s == 2.5
    assert build_planner("flexsp-milp").time_limit_s == 10.0


def test_non_power_of_two_domain(planners):
    """48 ranks: power-of-two groups up to 32 that still fill the domain in every microbatch."""
    plan = run_planner(planners["flexsp-milp"], Batch.from_lengths([20000, 30000, 500, 700]), model_for(48))
    for phase in range(plan.num_phases):
        sizes = [g.size for g in plan.groups if g.phase == phase]
        assert sum(sizes) == 48 and len(sizes) >= 2 and all(s & (s - 1) == 0 for s in sizes)


def _small_problem() -> BucketProblem:
    times = np.array([[0.4, 0.25, 0.15], [0.1, 0.06, 0.04]])
    return BucketProblem(np.array([2, 6]), np.array([1500, 200]), times, np.array([2, 4, 8]), 8, 1000, np.full(3, 0.01))


def test_a_milp_past_its_hard_deadline_keeps_the_warm_start(monkeypatch, caplog):
    """HiGHS may ignore its time limit; the process is stopped and the homogeneous warm start returned."""
    import megatron_dhp.solver.flexsp_model as flexsp_model

    problem = _small_problem()
    monkeypatch.setattr(flexsp_model, "hard_deadline_s", lambda limit: 0.0)
    solution = solve_bucket_milp(problem, time_limit_s=5.0)
    warm = homogeneous_greedy(problem)
    assert solution.sizes == warm.sizes and (solution.counts == warm.counts).all() and not solution.optimal
    assert "its process was stopped" in caplog.text


def test_a_failing_solver_process_is_an_error_not_a_hang():
    bad = BucketProblem(np.array([2, 6]), np.array([1500, 200]), np.zeros((1, 1)), np.array([2, 4, 8]), 8, 1000, np.zeros(3))
    with pytest.raises(RuntimeError, match="solver process failed"):
        solve_bucket_milp(bad, time_limit_s=5.0)
