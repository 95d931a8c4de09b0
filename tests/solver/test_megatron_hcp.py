"""megatron-hcp: upstream's BalancedCPScheduler output, converted faithfully or refused clearly."""

from __future__ import annotations

import pytest

from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner
from megatron_dhp.solver.megatron_hcp import set_to_groups, upstream_group_sizes
from megatron_dhp.workload import Batch, LengthSource
from tests.solver.conftest import model_for


def test_upstream_group_sizes_follow_parallel_state():
    assert upstream_group_sizes(64) == {1, 2, 4, 8, 16, 32, 64}
    assert upstream_group_sizes(48) == {1, 2, 4, 8, 16, 48}  # no 32: 2**(floor(log2 48) - 1) = 16
    assert upstream_group_sizes(2) == {1, 2}


def test_set_to_groups_converts_a_consistent_set():
    per_rank = [[7, 3], [7, 3], [1], [2, 5, 4]]
    groups = set_to_groups(per_rank, 2, upstream_group_sizes(4))
    assert [(g.ranks, g.microbatches, g.phase) for g in groups] == [
        ((0, 1), ((7,), (3,)), 2),
        ((2,), ((1,),), 2),
        ((3,), ((2,), (5,), (4,)), 2),
    ]


@pytest.mark.parametrize(
    "per_rank,match",
    [
        ([[7], [7, 3], [1], [2]], "inconsistent"),  # rank 1 runs 3 alone but 7 with rank 0
        ([[7, 3], [3, 7], [1], [2]], "inconsistent"),  # same samples, different order: a deadlock upstream
        ([[0], [1, 2], [1, 2], [3]], "aligned groups"),  # ranks 1-2 is not one of upstream's groups
    ],
)
def test_set_to_groups_refuses_what_upstream_cannot_run(per_rank, match):
    with pytest.raises(PlannerUnsupported, match=match):
        set_to_groups(per_rank, 0, upstream_group_sizes(4))


def test_set_to_groups_refuses_a_size_upstream_never_creates():
    per_rank = [[0]] * 32 + [[1]] * 16
    with pytest.raises(PlannerUnsupported, match="ranks 0..31|aligned groups"):
        set_to_groups(per_rank, 0, upstream_group_sizes(48))


def test_plan_is_upstreams_schedule(planners):
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    class Group:
        def size(self):
            return 64

    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=64 * 8192)
    _, sets = BalancedCPScheduler(8192, Group()).get_groups_and_subsamples(
        [(s.id, s.tokens) for s in batch.samples], None
    )
    expected = {
        (phase, rank, tuple(ids)) for phase, per_rank in enumerate(sets) for rank, ids in enumerate(per_rank) if ids
    }
    plan = run_planner(planners["megatron-hcp"], batch, model_for(64))
    got = {(g.phase, r, tuple(mb[0] for mb in g.microbatches)) for g in plan.groups for r in g.ranks}
    assert got == expected
    assert plan.phase_barrier and plan.num_phases == len(sets) > 1
    assert all(len(mb) == 1 for g in plan.groups for mb in g.microbatches)


def test_scheduler_failures_become_planner_unsupported():
    planner = build_planner("megatron-hcp")

    class Failing:
        def __init__(self, max_seq_len_per_rank, dp_cp_group):
            pass

        def gpus_needed(self, seq_len):
            return 1

        def get_groups_and_subsamples(self, pairs, config):
            raise IndexError("list assignment index out of range")

    planner._scheduler_cls = Failing
    with pytest.raises(PlannerUnsupported, match="BalancedCPScheduler raised IndexError: list assignment"):
        planner.solve(Batch.from_lengths([100, 200]), model_for(8))
