"""Encoder activations count against memory (`plan.memory`): footprints by hand, the plan rule, every planner."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.pipeline import lower_bound as pipeline_lower_bound
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.memory import UNPLACEABLE, Footprint, MemoryRule
from megatron_dhp.plan.plan import Plan, PlanError, PlanGroup
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.base import PlannerUnsupported
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload import Batch, Sample, VisualItem
from tests.configs import GPT7B

W = 0.25
SAMPLES = (
    Sample(0, 1000, (VisualItem(2048, 512, (1024, 1024)),)),  # encoder memory 512
    Sample(1, 600, (VisualItem(400, 100), VisualItem(100, 25))),  # 125
    Sample(2, 300),
)


# ---------------------------------------------------------------------- footprints by hand
def test_split_divides_llm_and_encoder_memory_over_the_group():
    fp = MemoryRule(1000, W, "split").footprint(SAMPLES, 8)
    assert fp.shared.tolist() == [1000 + 512, 600 + 125, 300] and fp.held.tolist() == [0, 0, 0] and fp.cap == 1000
    assert fp.min_degree().tolist() == [2, 1, 1]
    assert fp.per_rank([0, 1], 3) == pytest.approx((1512 + 725) / 3)
    assert fp.fits([0, 1], 3) and not fp.fits([0, 1, 2], 2)


def test_replicate_holds_the_group_s_images_on_every_rank():
    fp = MemoryRule(1000, W, "replicate").footprint(SAMPLES, 8)
    assert fp.shared.tolist() == [1000, 600, 300] and fp.held.tolist() == [512, 125, 0]
    # 1000 / d + 512 <= 1000 first at d = 3 (333 + 512); split needs only 2
    assert fp.min_degree().tolist() == [3, 1, 1]
    assert fp.per_rank([0, 1], 4) == pytest.approx(1600 / 4 + 637)
    assert fp.load(0, 4) == 1000 + 4 * 512  # its share of a microbatch's 4 x cap
    assert fp.min_ranks([0, 1]) == math.ceil(1600 / (1000 - 637))
    big = MemoryRule(1000, W, "replicate").footprint([Sample(0, 10, (VisualItem(4000, 10),))], 8)
    assert big.min_degree().tolist() == [UNPLACEABLE]  # 1000 held on each rank: no group is wide enough


def test_global_keeps_each_rank_s_longest_first_share_all_step():
    # items 2048, 400, 100 on 2 ranks, longest first: {2048}, {400, 100}; the larger share is 2048 -> 512
    fp = MemoryRule(1000, W, "global").footprint(SAMPLES, 2)
    assert fp.cap == 1000 - 512 and fp.held.tolist() == [0, 0, 0] and fp.shared.tolist() == [1000, 600, 300]
    assert fp.min_degree().tolist() == [math.ceil(1000 / 488), 2, 1]


def test_without_encoder_memory_only_llm_tokens_count():
    for placement in ("split", "replicate", "global"):
        fp = MemoryRule(1000, 0.0, placement).footprint(SAMPLES, 8)
        assert (fp.shared.tolist(), fp.held.tolist(), fp.cap) == ([1000, 600, 300], [0, 0, 0], 1000)


@pytest.mark.parametrize(("placement", "world", "llm", "enc", "match"), [
    ("replicate", 8, 10, 4000, "sample 7's images hold 1000 tokens of encoder activations .* every rank of its group "
                               "under encoder_placement replicate, which fills the cap of 1000 per rank; use "
                               "encoder_placement split"),
    ("global", 1, 10, 4000, "every rank keeps its share of the batch's encoder activations for the whole step, 1000 "
                            "tokens"),
    ("replicate", 2, 1000, 3000, "sample 7 needs 4 ranks for its 1000 LLM tokens beside 750 tokens of its images' "
                                 "encoder activations on each rank .* more than the domain's 2"),
    ("global", 2, 1000, 3000, "sample 7 needs 4 ranks for its 1000 LLM tokens beside 750 tokens of global's encoder "
                              "share on each rank all step .* more than the domain's 2"),
    ("split", 4, 10, 16000, "sample 7 holds 4010 tokens of memory .* more than the domain's 4 ranks of 1000"),
])
def test_a_sample_no_group_holds_is_a_clear_error(placement, world, llm, enc, match):
    with pytest.raises(DhpError, match=match):
        MemoryRule(1000, W, placement).check([Sample(7, llm, (VisualItem(enc, 10),))], world)


# ---------------------------------------------------------------------- the plan rule
def _plan(placement: str, w: float, groups, stages: int = 1) -> Plan:
    return Plan("t", 4, 4, SAMPLES, tuple(groups), max_tokens_per_rank=1000, encoder_placement=placement,
                enc_memory_per_token=w, pipeline_stages=stages)


def test_validate_counts_encoder_memory_per_placement():
    two = [PlanGroup((0, 1), ((0,),)), PlanGroup((2,), ((1,),)), PlanGroup((3,), ((2,),))]
    _plan("split", W, two).validate()  # 1512 / 2 = 756
    _plan("replicate", 0.0, two).validate()
    with pytest.raises(PlanError, match=r"puts 1012 tokens on each of its 2 ranks, encoder activations included, "
                                        r"above the cap of 1000"):
        _plan("replicate", W, two).validate()  # 500 + 512
    three = [PlanGroup((0, 1, 2), ((0,),)), PlanGroup((3,), ((1,), (2,)))]
    _plan("replicate", W, three).validate()  # 333 + 512
    pair = [PlanGroup((0, 1), ((0, 1),)), PlanGroup((2, 3), ((2,),))]
    _plan("split", 0.0, pair).validate()  # 1600 / 2
    with pytest.raises(PlanError, match="puts 1118 tokens on each of its 2 ranks"):
        _plan("split", W, pair).validate()  # 2237 / 2


def test_the_in_flight_rule_counts_encoder_memory_under_pipelining():
    # Position 0 keeps samples 1 and 2 in flight together at 2 stages: 725 + 300 split, 600 + 125 + 300 replicate.
    groups = [PlanGroup((0,), ((1,), (2,))), PlanGroup((1, 2, 3), ((0,),))]
    _plan("split", 0.0, groups, stages=2).validate()  # 900
    with pytest.raises(PlanError, match="position 0 holds 1025 tokens per rank over slots 0..1"):
        _plan("split", W, groups, stages=2).validate()


def test_the_memory_rule_travels_with_the_plan_json():
    plan = _plan("replicate", W, [PlanGroup((0, 1, 2), ((0,),)), PlanGroup((3,), ((1,), (2,)))])
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.enc_memory_per_token == W and back.encoder_placement == "replicate"
    assert "enc_memory_per_token" not in _plan("split", 0.0, [PlanGroup((0, 1, 2, 3), ((0, 1, 2),))]).to_dict()


# ---------------------------------------------------------------------- planners and bounds
def _video_batch(seed: int, size: int = 40) -> Batch:
    """Text, images and a few long videos whose encoder memory moves their memory minimum."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(size):
        kind = rng.integers(0, 4)
        if kind == 0:
            frames = int(rng.integers(8, 40))
            items = (VisualItem(196 * frames, 49 * frames, (196,) * frames),)
        elif kind == 1:
            items = tuple(VisualItem(1024, 256) for _ in range(int(rng.integers(1, 4))))
        else:
            items = ()
        llm = sum(item.llm for item in items)
        samples.append(Sample(i, llm + int(rng.integers(16, 3000)), items))
    return Batch(tuple(samples))


@pytest.fixture(scope="module")
def small() -> CostConfig:
    """16 ranks of 4,096 tokens (8 per node), gpt7b's coefficients, encoder activations at w = 0.25."""
    return replace(GPT7B, world_size=16, max_tokens_per_rank=4096, enc_memory_per_token=W,
                   enc_a2a_bytes_per_token=16384.0)


@pytest.mark.parametrize("placement", ["split", "replicate", "global"])
@pytest.mark.parametrize("stages", [1, 2])
def test_every_planner_s_plan_holds_the_encoder_memory(small, placement, stages):
    model = build_cost_model(replace(small, encoder_placement=placement))
    for seed in range(3):
        batch = _video_batch(seed)
        fp = model.footprint(batch.samples)
        text_only = MemoryRule(small.max_tokens_per_rank).footprint(batch.samples, 16)
        assert (fp.min_degree() > text_only.min_degree()).any() or placement == "global"  # memory moves them
        bound = pipeline_lower_bound(model, batch.samples, stages)
        for name in ("dhp", "static", "megatron-hcp", "fcp-ref"):
            try:
                plan = run_planner(build_planner(name, {}), batch, model, pipeline_stages=stages)
            except PlannerUnsupported:
                continue
            assert plan.enc_memory_per_token == W
            plan.validate()  # run_planner validated it too; the rule is the plan's own
            with pytest.raises(PlanError):  # and it would not hold twice the encoder memory: the rule binds
                replace(plan, enc_memory_per_token=50 * W).validate()
            assert bound <= plan.predicted_step_time_s * (1 + 1e-9), (name, seed)


def test_random_plans_follow_the_memory_rule_and_stay_above_the_bound(small):
    for placement in ("split", "replicate", "global"):
        model = build_cost_model(replace(small, encoder_placement=placement))
        rng = random.Random(0)
        for seed in range(4):
            batch = _video_batch(seed, 25)
            bound = pipeline_lower_bound(model, batch.samples, 1)
            for _ in range(5):
                plan = random_plan(batch, model.domain, rng, memory=model.memory_rule())
                assert (plan.encoder_placement, plan.enc_memory_per_token) == (placement, W)
                assert bound <= simulate(plan, model).step_time_s * (1 + 1e-9)


def test_auto_plans_only_placements_whose_encoder_memory_fits(small):
    batch = Batch((Sample(0, 500, (VisualItem(20_000, 500),)), Sample(1, 100)))  # replicate holds 5000 > 4096
    with pytest.raises(DhpError, match="sample 0's images hold 5000 tokens of encoder activations"):
        run_planner(build_planner("dhp", {}), batch, build_cost_model(replace(small, encoder_placement="replicate")))
    plan = run_planner(build_planner("dhp", {}), batch, build_cost_model(replace(small, encoder_placement="auto")))
    assert plan.encoder_placement in ("split", "global")
    plan.validate()


def test_footprint_linear_is_safe_on_any_group_up_to_its_degree():
    fp = Footprint(np.array([1000, 600]), np.array([512, 0]), 1000)
    for d in range(1, 9):
        assert fp.per_rank([0, 1], d) * d <= fp.linear(8)[[0, 1]].sum()


def test_global_under_pipelining_is_its_encoder_phase_around_the_1f1b_slots(small):
    # The encoder sits on the first stage, whose ranks are the domain's: the phase of P = 1, outside the slots.
    model = build_cost_model(replace(small, encoder_placement="global"))
    batch = _video_batch(0, 12)
    plan = run_planner(build_planner("dhp", {}), batch, model, pipeline_stages=2)
    text = replace(plan, samples=tuple(replace(s, images=()) for s in plan.samples))  # the same slots, no encoder
    phase = model.encoder_phase(batch.samples)
    assert phase.before_s > 0 and phase.after_s > 0
    timeline = simulate(plan, model)
    assert timeline.step_time_s == pytest.approx(simulate(text, model).step_time_s + phase.total_s)
    assert (timeline.encoder_before_s, timeline.encoder_after_s) == (phase.before_s, phase.after_s)
    # The memory rule from its definition: each rank keeps w x its longest-first share of the batch's items all
    # step, so a microbatch has M less the largest share (whole tokens) for its sum_S L / d.
    loads = [0] * small.world_size
    for enc in sorted((item.enc for s in batch.samples for item in s.images), reverse=True):
        loads[loads.index(min(loads))] += enc
    fp = model.footprint(batch.samples)
    assert fp.cap == small.max_tokens_per_rank - math.ceil(W * max(loads))
    assert fp.shared.tolist() == [s.tokens for s in batch.samples] and not fp.held.any()


# ---------------------------------------------------------------------- gathered keys and values
def test_gathered_keys_and_values_sit_whole_on_every_rank_of_the_group():
    """g L beside the shard, whatever d: a wide group no longer divides a sample's memory away."""
    fp = MemoryRule(1000, kv_memory_per_token=0.1).footprint(SAMPLES, 8)
    assert fp.shared.tolist() == [1000, 600, 300] and fp.held.tolist() == [100, 60, 30]
    assert fp.min_degree().tolist() == [2, 1, 1]  # 1000 / 2 + 100 <= 1000
    assert fp.per_rank([0, 1], 4) == pytest.approx(1600 / 4 + 160)
    assert not MemoryRule(1000, kv_memory_per_token=0.1).footprint([Sample(0, 9000)], 16).fits([0], 16)  # 562 + 900
    both = MemoryRule(1000, W, "replicate", kv_memory_per_token=0.1).footprint(SAMPLES, 8)
    assert both.held.tolist() == [512 + 100, 125 + 60, 30]
    with pytest.raises(DhpError, match=r"sample 0 \(9000 tokens\) fits no group .* keeps the group's keys and values"):
        MemoryRule(1000, kv_memory_per_token=0.1).check([Sample(0, 9000)], 16)


def test_model_memory_is_megatron_lm_s_count_and_the_kv_share_follows_it():
    """Llama-3-8B (h 4,096, ffn 14,336, 32 layers, 8 query groups of 128): 18 h + 4 f = 128 KiB per layer and
    token in bf16, its keys and values 4 KiB: g = 1/32."""
    from megatron_dhp.plan.memory import ModelMemory

    llama = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024)
    assert llama.activation_mb == pytest.approx(4.0) and llama.kv_memory_per_token == pytest.approx(1 / 32)
    staged = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024, tensor_parallel=2,
                                pipeline_stages=4, element_bytes=4)
    assert staged.activation_mb == pytest.approx(4.0 / 2 / 4 * 2) and staged.kv_memory_per_token == pytest.approx(1 / 32)
    recompute = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024, full_recompute=True)
    assert recompute.activation_mb == pytest.approx(32 * 2 * 4096 / 2**20)  # each layer's input only
    assert recompute.gathered_kv_mb == pytest.approx(4096 / 2**20)  # one layer recomputed at a time


def test_every_planner_s_plan_holds_the_gathered_keys_and_values(small):
    model = build_cost_model(replace(small, enc_memory_per_token=0.0, kv_memory_per_token=0.05))
    batch = Batch.from_lengths([30000, 9000, 5000, *range(100, 3000, 150)])
    assert (model.footprint(batch.samples).min_degree()
            > MemoryRule(small.max_tokens_per_rank).footprint(batch.samples, 16).min_degree()).any()
    for name in ("dhp", "static", "megatron-hcp", "fcp-ref"):
        plan = run_planner(build_planner(name, {}), batch, model)
        back = Plan.from_dict(json.loads(plan.to_json()))
        assert back.kv_memory_per_token == 0.05
        back.validate()
        with pytest.raises(PlanError, match="gathered keys and values included"):
            replace(plan, kv_memory_per_token=0.5).validate()


def test_the_longest_sample_a_domain_holds_leaves_room_for_its_gathered_keys_and_values():
    """L + N ceil(g L) <= N cap, exactly: the largest such L, and the least cap that holds a given L."""
    from megatron_dhp.plan.memory import longest_sample, ranks_cap_for

    assert longest_sample(1000, 8) == 8000 and ranks_cap_for(8000, 8) == 1000
    for cap, n, g in ((1000, 8, 0.1), (4096, 64, 1 / 32), (777, 5, 0.013), (10, 3, 0.5)):
        longest = longest_sample(cap, n, g)
        fp = MemoryRule(cap, kv_memory_per_token=g).footprint([Sample(0, longest), Sample(1, longest + 1)], n)
        assert fp.fits([0], n) and not fp.fits([1], n)
        assert ranks_cap_for(longest, n, g) <= cap < ranks_cap_for(longest + 1, n, g)
