"""dhp under pipeline parallelism: its candidate layouts, priced by the 1F1B simulator, and the best one kept."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_dhp.cost import simulate
from megatron_dhp.plan import Plan, pipeline_slots
from megatron_dhp.plan.family import group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.dhp.family_rounds import family_round_layouts
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.planner import fastest
from megatron_dhp.solver.dhp.rounds import pipeline_order_of, round_layouts, spaced_round_groups
from megatron_dhp.workload import Batch, LengthSource, Sample


def long_tailed(seed: int, n: int = 256) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch([Sample(i, int(x)) for i, x in enumerate(rng.lognormal(8.5, 1.2, n).astype(int) + 1) if x < 100000])


def test_pipeline_order_puts_the_shortest_last_and_the_second_shortest_first():
    assert pipeline_order_of([5, 4, 3, 2, 1]) == [2, 5, 4, 3, 1]
    assert pipeline_order_of([2, 1]) == [1, 2]
    assert pipeline_order_of([]) == []


def instance(batch: Batch, model, stages: int = 4) -> Instance:
    return Instance.from_batch(batch, model, model.domain.max_tokens_per_rank // stages)


def sorted_group(g):
    return g.ranks, g.microbatches


def pp_plan(model, batch: Batch, groups, stages: int = 4) -> Plan:
    return Plan("t", model.domain.world_size, model.domain.gpus_per_node, batch.samples, tuple(groups),
                max_tokens_per_rank=model.domain.max_tokens_per_rank, pipeline_stages=stages)


def test_rounds_cover_every_rank_once_per_phase_so_no_slot_is_idle(gpt7b):
    batch = long_tailed(0)
    ordered, own = round_layouts(instance(batch, gpt7b), batch)
    assert sorted(map(sorted_group, ordered)) == sorted(map(sorted_group, own))  # the same rounds, reordered
    groups = ordered
    plan = pp_plan(gpt7b, batch, groups)
    plan.validate()
    slots = pipeline_slots(plan)
    assert all(len(g.microbatches) == 1 for g in groups)
    assert {len(row) for row in slots} == {plan.num_phases} and not any(s is None for row in slots for s in row)


@pytest.mark.parametrize("stages", [2, 4])
def test_spaced_rounds_put_p_minus_1_fillers_between_full_rounds_and_keep_the_memory_rule(gpt7b, stages):
    batch = long_tailed(1)
    groups = spaced_round_groups(instance(batch, gpt7b, stages), batch, stages)
    plan = pp_plan(gpt7b, batch, groups, stages)
    plan.validate()  # every sample once; any P consecutive slots within M per rank
    fillers = [g for g in groups if g.phase % 2]
    assert fillers and all(g.ranks == tuple(range(gpt7b.domain.world_size)) for g in fillers)
    assert all(len(g.microbatches) >= stages - 1 for g in fillers) and len(fillers) == plan.num_phases // 2
    cap = gpt7b.domain.max_tokens_per_rank
    fullest = max(sum(plan.sample(i).tokens for i in g.microbatches[0]) / g.size for g in groups if g.phase % 2 == 0)
    assert fullest > cap // stages  # fuller than the M // P rounds: the in-flight budget is used
    assert not any(s is None for row in pipeline_slots(plan) for s in row)


def test_spaced_rounds_need_more_than_one_round(gpt7b):
    batch = Batch([Sample(i, 1000) for i in range(8)])
    assert spaced_round_groups(instance(batch, gpt7b), batch, 4) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dhp_keeps_the_fastest_layout_and_is_never_behind_the_peers(gpt7b, seed):
    batch = long_tailed(seed)
    dhp = run_planner(build_planner("dhp"), batch, gpt7b, pipeline_stages=4)  # any groups
    inst = instance(batch, gpt7b)
    for groups in (*round_layouts(inst, batch), spaced_round_groups(inst, batch, 4)):
        assert dhp.predicted_step_time_s <= simulate(dataclasses.replace(dhp, groups=tuple(groups)), gpt7b).step_time_s
    for name in ("static", "megatron-hcp", "fcp-ref"):
        peer = run_planner(build_planner(name), batch, gpt7b, pipeline_stages=4)
        assert dhp.predicted_step_time_s <= peer.predicted_step_time_s * 1.005, name


def test_fastest_under_pipelining_prices_like_simulate(gpt7b):
    # Two layouts of the same samples: one round of packed microbatches, and each sample a microbatch of its own.
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=128, seed=0, index=0, capacity=gpt7b.domain.capacity)
    cap = gpt7b.domain.max_tokens_per_rank // 4
    packed = [g for g in round_layouts(Instance.from_batch(batch, gpt7b, cap), batch)[0] if g.phase == 0]
    part = Batch([batch.samples[k] for k, s in enumerate(batch.samples) if any(s.id in g.microbatches[0] for g in packed)])
    split = [dataclasses.replace(g, microbatches=tuple((i,) for i in g.microbatches[0])) for g in packed]
    chosen = fastest(Instance.from_batch(part, gpt7b, cap), part, [split, packed], stages=4)
    times = [simulate(pp_plan(gpt7b, part, c), gpt7b).step_time_s for c in (split, packed)]
    assert times[0] != times[1] and chosen is (split, packed)[times.index(min(times))]


def test_layout_times_are_the_models_microbatch_times(gpt7b):
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=128, seed=0, index=1, capacity=gpt7b.domain.capacity)
    inst = Instance.from_batch(batch, gpt7b, gpt7b.domain.max_tokens_per_rank // 4)
    by_id = {s.id: s for s in batch.samples}
    for groups in (*round_layouts(inst, batch), spaced_round_groups(inst, batch, 4)):
        for g, times in zip(groups, inst.layout_times(groups)):
            expected = [gpt7b.microbatch_time([by_id[i] for i in mb], g.ranks) for mb in g.microbatches]
            assert times == pytest.approx(expected, rel=1e-12)


def test_dhp_is_never_behind_static_or_fcp_ref_on_small_domains():
    # Small random batches on small domains: static's one group size, or fcp-ref's rounds in their own order,
    # is sometimes the fastest layout, and dhp prices both.
    from tests.solver.conftest import model_for

    rng = np.random.default_rng(0)
    for trial, (n, gpn, stages) in enumerate([(3, 4, 3), (8, 2, 2), (5, 4, 3), (16, 4, 2), (12, 4, 4)]):
        model = model_for(n, gpn)
        batch = Batch([Sample(i, int(x)) for i, x in enumerate(np.minimum(rng.lognormal(6, 1.5, 30).astype(int) + 1, n * 8192))])
        dhp = run_planner(build_planner("dhp"), batch, model, pipeline_stages=stages).predicted_step_time_s
        for name in ("static", "fcp-ref"):
            assert dhp <= run_planner(build_planner(name), batch, model, pipeline_stages=stages).predicted_step_time_s, (trial, name)


def test_family_rounds_are_family_groups_that_partition_each_round(gpt7b):
    batch = long_tailed(0)
    family = group_family(64, 8)
    inst = Instance.from_batch(batch, gpt7b, gpt7b.domain.max_tokens_per_rank // 4, family)
    ordered, own = family_round_layouts(inst, batch, family)
    assert sorted(map(sorted_group, ordered)) == sorted(map(sorted_group, own))  # the same rounds, reordered
    pp_plan(gpt7b, batch, ordered).validate()  # every sample once; any 4 consecutive slots within M per rank
    for phase in {g.phase for g in ordered}:
        ranks = sorted(r for g in ordered if g.phase == phase for r in g.ranks)
        assert ranks == list(range(64))  # a partition of the domain: no idle slot inside a round
    assert all(family.contains(g.ranks) and len(g.microbatches) <= 1 for g in ordered)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dhp_with_the_family_under_pipeline_parallelism_is_close_to_any_groups(gpt7b, seed):
    # fcp-ref's rounds moved onto the family did not fit on these batches, so dhp lost them: 24-31 % slower
    # than with any groups. Built on family windows (`family_rounds`) they cost 3-8 %.
    batch = long_tailed(seed)
    family = run_planner(build_planner("dhp"), batch, gpt7b, pipeline_stages=4).predicted_step_time_s
    free = run_planner(build_planner("dhp"), batch, gpt7b, pipeline_stages=4).predicted_step_time_s
    assert family <= 1.10 * free
