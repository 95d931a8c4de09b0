"""Plan invariants, JSON form and the simulator's timeline."""

from __future__ import annotations

import json

import pytest

from megatron_dhp.cost import simulate
from megatron_dhp.plan import Plan, PlanError, PlanGroup, pipeline_token_cap
from megatron_dhp.workload import Sample, VisualItem
from tests import reference_eval

SAMPLES = (Sample(0, 6000), Sample(1, 3000), Sample(2, 20000, (VisualItem.short(1024, 4),)), Sample(3, 500))


def make_plan(groups, samples=SAMPLES, world_size=4, **kw) -> Plan:
    return Plan("test", world_size, 2, samples, tuple(PlanGroup(*g) for g in groups), **kw)


GOOD = [((0,), ((0,), (3,))), ((1,), ((1,),)), ((2, 3), ((2,),))]


def test_valid_plan_passes():
    make_plan(GOOD).validate(max_tokens_per_rank=10000)


@pytest.mark.parametrize(
    "groups,match",
    [
        ([((0,), ((0, 3),)), ((1,), ((1,),)), ((2, 3), ())], "sample 2 is in no group"),
        ([((0,), ((0, 3),)), ((1,), ((1, 0),)), ((2, 3), ((2,),))], r"sample 0 is assigned twice \(groups 0 and 1\)"),
        ([((0,), ((0, 3),)), ((1,), ((1, 9),)), ((2, 3), ((2,),))], "unknown sample id 9"),
        ([((0, 1), ((0, 3),)), ((1,), ((1,),)), ((2, 3), ((2,),))], "rank 1 is in group 0 and group 1 of phase 0"),
        ([((0,), ((0, 3),)), ((1,), ((1,),)), ((2, 4), ((2,),))], "rank 4 is outside the domain 0..3"),
        ([((0,), ((0, 3),)), ((1,), ((1,), ())), ((2, 3), ((2,),))], "group 1, microbatch 1 is empty"),
        ([((), ((0,),))], "group 0 has no ranks"),
        ([((0,), ((0, 3),)), ((1,), ((1,),)), ((2, 3), ((2,),), -1)], "negative phase"),
        ([((0,), ((0, 1, 3),)), ((1,), ()), ((2, 3), ((2,),))], "puts 9500 tokens on each of its 1 ranks, above the cap of 8192"),
    ],
)
def test_invalid_plans_name_the_offender(groups, match):
    with pytest.raises(PlanError, match=match):
        make_plan(groups).validate(max_tokens_per_rank=8192)


def test_memory_cap_is_per_rank_of_the_group():
    make_plan([((0, 1, 2, 3), ((0, 1, 2, 3),))]).validate(max_tokens_per_rank=7375)  # 29500 / 4 = 7375
    with pytest.raises(PlanError, match="above the cap of 7374"):
        make_plan([((0, 1, 2, 3), ((0, 1, 2, 3),))]).validate(max_tokens_per_rank=7374)


def test_a_rank_may_change_group_between_phases():
    plan = make_plan([((0, 1), ((0,),), 0), ((2, 3), ((1,),), 0), ((0, 1, 2, 3), ((2, 3),), 1)])
    plan.validate(max_tokens_per_rank=8192)
    assert plan.num_phases == 2 and [g.phase for g in plan.groups_of_rank(2)] == [0, 1]


def test_idle_rank_is_rejected():
    with pytest.raises(PlanError, match=r"rank 4 is in no group \(1 ranks idle\)"):
        make_plan(GOOD, world_size=5).validate(max_tokens_per_rank=10000)


def test_duplicate_sample_in_list_and_bad_world():
    with pytest.raises(PlanError, match="sample id 1 is listed twice"):
        make_plan(GOOD, samples=SAMPLES + (Sample(1, 5),)).validate()
    with pytest.raises(PlanError, match="world_size 0 must be a positive integer"):
        make_plan(GOOD, world_size=0).validate()


def test_json_roundtrip_and_fingerprint(tmp_path):
    plan = make_plan(GOOD, max_tokens_per_rank=8192, predicted_step_time_s=1.5, solve_time_ms=0.3)
    path = tmp_path / "p.json"
    plan.save(path)
    obj = json.loads(path.read_text())
    assert obj["schema"] == "megatron-dhp/plan/v1" and obj["samples"][2] == {"id": 2, "tokens": 20000, "images": [{"enc": 1024, "llm": 256}]}
    assert obj["groups"][0] == {"phase": 0, "ranks": [0], "microbatches": [[0], [3]]}
    again = Plan.load(path)
    assert again == plan
    from dataclasses import replace

    assert replace(plan, solve_time_ms=9.0).fingerprint() == plan.fingerprint()
    assert make_plan(GOOD[::-1]).fingerprint() != plan.fingerprint()


@pytest.mark.parametrize(
    "text,match",
    [("{", "is not valid JSON"), ('{"schema": "x"}', "schema 'x' is not"),
     ('{"schema": "megatron-dhp/plan/v1", "planner": "a"}', "missing the key 'groups'"),
     ('{"schema": "megatron-dhp/plan/v1", "planner": "a", "world_size": 1, "gpus_per_node": 1, '
      '"samples": [{"id": 0, "tokens": -1}], "groups": []}', "length -1 must be a positive integer")],
)
def test_bad_plan_json(tmp_path, text, match):
    p = tmp_path / "p.json"
    p.write_text(text)
    with pytest.raises(PlanError if "length" not in match else Exception, match=match):
        Plan.load(p)


def test_summary_line():
    plan = make_plan(GOOD, predicted_step_time_s=2.0, lower_bound_s=1.6, solve_time_ms=1.25)
    assert plan.summary() == "test: groups 2x1 1x2 | 4 mb | pred 2.000s (1.250x LB) | solve 1.2 ms"


def test_simulate_phases_start_when_ranks_are_free(gpt7b_config, gpt7b):
    samples = (Sample(0, 8000), Sample(1, 2000), Sample(2, 30000), Sample(3, 4000))
    plan = Plan("t", 4, 2, samples, (
        PlanGroup((0,), ((0,), (1,)), 0),
        PlanGroup((1,), ((3,),), 0),
        PlanGroup((1, 2, 3), ((2,),), 1),
    ))
    tl = simulate(plan, gpt7b)
    t = {i: gpt7b.microbatch_time([s], r) for i, s, r in [(0, samples[0], [0]), (1, samples[1], [0]), (3, samples[3], [1])]}
    t2 = gpt7b.microbatch_time([samples[2]], [1, 2, 3])
    assert tl.spans[0].end_s == pytest.approx(t[0] + t[1])
    assert tl.spans[2].start_s == pytest.approx(t[3])  # rank 1 finished phase 0; ranks 2-3 were idle
    assert tl.step_time_s == pytest.approx(max(t[0] + t[1], t[3] + t2))
    assert tl.step_time_s == pytest.approx(reference_eval.step_time(gpt7b_config.to_dict(), {**plan.to_dict()}))
    barrier = simulate(Plan("t", 4, 2, samples, plan.groups, phase_barrier=True), gpt7b)
    assert barrier.spans[2].start_s == pytest.approx(max(t[0] + t[1], t[3]))
    assert 0 < tl.idle_fraction < 1


@pytest.mark.parametrize(("m", "p"), [(8192, 1), (8192, 4), (8191, 4), (3, 4)])
def test_pipeline_token_cap_is_the_largest_whose_p_microbatches_in_flight_fit_m(m, p):
    cap = pipeline_token_cap(m, p)
    assert p * cap <= m < p * (cap + 1)
