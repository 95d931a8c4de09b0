"""The `static` planner: Megatron's one-CP-size-for-the-run layout."""

from __future__ import annotations

import pytest

from megatron_dhp.cost import Domain
from megatron_dhp.errors import DhpError
from megatron_dhp.solver import build_planner, run_planner, static_cp_size
from megatron_dhp.workload import Batch, LengthSource


@pytest.mark.parametrize(
    "longest,n,expected",
    [(8192, 64, 1), (8193, 64, 2), (124_913, 64, 16), (124_913, 48, 16), (300_000, 48, 48), (5000, 3, 1), (20000, 6, 3)],
)
def test_static_cp_size(longest, n, expected):
    assert static_cp_size(longest, Domain(n, 8, 8192)) == expected


def test_static_cp_size_too_long():
    with pytest.raises(DhpError, match="needs 62 ranks of 8192 tokens but the domain has 48"):
        static_cp_size(500_000, Domain(48, 8, 8192))


def test_static_plan_on_wlbllm(gpt7b):
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=64 * 8192)
    plan = run_planner(build_planner("static", dataset_max_tokens=124_913), batch, gpt7b)
    plan.validate()
    assert {g.size for g in plan.groups} == {16} and len(plan.groups) == 4
    assert [g.ranks for g in plan.groups] == [tuple(range(i * 16, i * 16 + 16)) for i in range(4)]
    counts = {len(g.microbatches) for g in plan.groups}
    assert len(counts) == 1  # the same number of microbatches on every replica
    assert plan.predicted_step_time_s >= plan.lower_bound_s


def test_static_uses_the_dataset_longest_not_the_batch(gpt7b):
    batch = Batch.from_lengths([1000] * 64)
    assert {g.size for g in run_planner(build_planner("static"), batch, gpt7b).groups} == {1}
    planner = build_planner("static", dataset_max_tokens=60_000)
    assert {g.size for g in run_planner(planner, batch, gpt7b).groups} == {8}


def test_static_with_fewer_samples_than_replicas(gpt7b):
    plan = run_planner(build_planner("static"), Batch.from_lengths([100, 200]), gpt7b)
    plan.validate()
    assert sum(1 for g in plan.groups if g.microbatches) == 2 and len(plan.groups) == 64


def test_every_planner_rejects_a_sample_no_group_can_hold(gpt7b):
    with pytest.raises(DhpError, match="sample 1 has 600000 tokens but the whole domain holds at most 524288"):
        run_planner(build_planner("static"), Batch.from_lengths([10, 600_000]), gpt7b)


def test_unknown_planner():
    with pytest.raises(DhpError, match="unknown planner 'magic'; choose one of"):
        build_planner("magic")


def test_an_option_the_planner_does_not_take_is_an_error():
    with pytest.raises(DhpError, match=r"^planner 'dhp' has no option 'time_limit_s'; it accepts cells, max_moves, gap, speed_aware$"):
        build_planner("dhp", time_limit_s=5.0)
    with pytest.raises(DhpError, match=r"^planner 'megatron-hcp' has no option 'max_cp_degree'; it takes no options$"):
        build_planner("megatron-hcp", max_cp_degree=2)
    with pytest.raises(DhpError, match=r"^planner context has no key 'time_limit'; it holds dataset_max_tokens, time_limit_s$"):
        build_planner("flexsp-milp", {"time_limit": 5.0})


def test_context_facts_reach_only_the_planners_that_read_them():
    context = {"dataset_max_tokens": 60_000, "time_limit_s": 2.5}
    assert build_planner("static", context).dataset_max_tokens == 60_000
    assert build_planner("flexsp-milp", context).time_limit_s == 2.5
    assert build_planner("fcp-ref", context, max_cp_degree=2).max_cp_degree == 2
