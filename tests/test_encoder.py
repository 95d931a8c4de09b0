"""Multimodal samples and the encoder's placements: file forms, per-block cost, placements, auto, plans."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.cost.encoder import FORWARD_SHARE
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.encoder import ENCODER_PLACEMENTS
from megatron_dhp.plan.memory import longest_first_makespan
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.encoder_auto import plan_best_placement
from megatron_dhp.workload import Batch, LengthSource, Sample, VisualItem, load_samples, truncate_sample

E, F = 2.0e-9, 6.0e-5  # gpt7b-64's encoder coefficients
A, B = 5.128e-9, 1.84e-4


@pytest.fixture
def mm_config(gpt7b_config) -> CostConfig:
    """gpt7b-64 with comm and overheads off, so a sample's time is its compute alone."""
    return replace(gpt7b_config, comm_bytes_per_token=0.0, microbatch_overhead_s=0.0)


def model_for(config: CostConfig, placement: str, **keys):
    return build_cost_model(replace(config, encoder_placement=placement, **keys))


# ---------------------------------------------------------------------- file forms
def test_short_and_long_forms(tmp_path):
    p = tmp_path / "mm.jsonl"
    p.write_text('{"tokens": 1100, "images": [1025, 16]}\n'
                 '{"tokens": 600, "images": [{"enc": 2048, "llm": 512, "blocks": [1024, 1024]}, {"enc": 8, "llm": 8}]}\n')
    a, b = load_samples(p)
    assert a.images == (VisualItem(1025, 257), VisualItem(16, 4))  # ceil(P / 4)
    assert b.images == (VisualItem(2048, 512, (1024, 1024)), VisualItem(8, 8, (8,)))
    assert load_samples(p, merge=1)[0].images == (VisualItem(1025, 1025), VisualItem(16, 16))


def test_merge_comes_from_the_cost_config(tmp_path):
    p = tmp_path / "mm.json"
    p.write_text(json.dumps([{"tokens": 100, "images": [64]}]))
    assert LengthSource.from_args(lengths=p, merge=2).samples[0].images == (VisualItem(64, 32),)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"tokens": 0}', "line 1: length 0 must be a positive integer"),
        ('{"tokens": -5, "images": [4]}', "line 1: length -5 must be a positive integer"),
        ('{"tokens": 300, "images": [1600]}', "line 1: sample 0: images take 400 LLM tokens, more than the sample's 300"),
        ('{"tokens": 300, "images": [{"enc": 1024, "llm": 301}]}', "images take 301 LLM tokens, more than the sample's 300"),
        ('{"tokens": 300, "images": ["big"]}', "line 1: visual item 'big' must be an encoder token count"),
        ('{"tokens": 300, "images": [{"enc": 1024}]}', "visual item .* needs 'enc' and 'llm'"),
        ('{"tokens": 300, "images": [{"enc": 8, "llm": 2, "tiles": 1}]}', "unknown key 'tiles' \\(allowed: enc, llm, blocks\\)"),
        ('{"tokens": 300, "images": [{"enc": 8, "llm": 2, "blocks": [4, 3]}]}', "blocks \\[4, 3\\] sum to 7, not to its 8"),
        ('{"tokens": 300, "images": [{"enc": 8, "llm": 2, "blocks": [8, 0]}]}', "block 0 must be a positive integer"),
        ('{"tokens": 300, "images": [{"enc": 8, "llm": 0}]}', "visual item llm = 0 must be a positive integer"),
        ('{"tokens": 300, "images": [{"enc": 8, "llm": 2, "blocks": 8}]}', "blocks 8 must be a list"),
        ('{"tokens": 300, "images": 5}', "'images' must be a list"),
    ],
)
def test_bad_multimodal_lines_name_file_line_and_sample(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(DhpError, match=match) as err:
        load_samples(p)
    assert "bad.jsonl" in str(err.value)


def test_long_form_round_trip_and_short_form_in_plans():
    s = Sample(3, 900, (VisualItem(2048, 512, (1024, 1024)), VisualItem(1024, 256)))
    assert s.to_dict() == {"id": 3, "tokens": 900,
                           "images": [{"enc": 2048, "llm": 512, "blocks": [1024, 1024]}, {"enc": 1024, "llm": 256}]}
    assert Sample.from_dict(s.to_dict()) == s
    assert Sample.from_dict({"id": 0, "tokens": 300, "images": [1024]}, merge=4).images == (VisualItem(1024, 256),)


def test_truncation_keeps_whole_items():
    s = Sample(0, 1000, (VisualItem(1024, 256), VisualItem(2048, 512), VisualItem(64, 16)))
    cut = truncate_sample(s, 700)
    assert cut.tokens == 700 and cut.images == (VisualItem(1024, 256),)


def test_multimodal_distribution_follows_real_models():
    batch = LengthSource.from_args(dist="multimodal").draw(global_batch=512, seed=0, capacity=64 * 8192)
    items = [i for s in batch.samples for i in s.images]
    assert {b for i in items for b in i.blocks} == {1024, 784}  # 448^2 tiles and video frames
    assert all(i.enc == 4 * i.llm for i in items)
    tiled = [i for i in items if i.blocks[0] == 1024 and len(i.blocks) > 1]
    videos = [i for i in items if i.blocks[0] == 784]
    assert tiled and max(len(i.blocks) for i in tiled) <= 13 and videos
    assert 8 <= min(len(v.blocks) for v in videos) and max(len(v.blocks) for v in videos) <= 256


# ---------------------------------------------------------------------- cost per block and placement
ITEM = VisualItem(3072, 768, (1024, 1024, 1024))
SAMPLE = Sample(0, 4096, (ITEM,))
LLM_WORK = A * 4096**2 + B * 4096
ENC_WORK = E * 3 * 1024**2 + F * 3072  # per block, never E * 3072^2


def test_encoder_attention_is_priced_per_block(mm_config):
    work = model_for(mm_config, "split").sample_work([SAMPLE])[0]
    assert work == pytest.approx(LLM_WORK + ENC_WORK)
    assert work < LLM_WORK + E * 3072**2 + F * 3072


@pytest.mark.parametrize(("placement", "expected"), [
    ("split", (LLM_WORK + ENC_WORK) / 4),
    ("replicate", LLM_WORK / 4 + ENC_WORK),
    ("global", LLM_WORK / 4),
])
def test_sample_time_per_placement(mm_config, placement, expected):
    model = model_for(mm_config, placement)
    t = model.sample_time(np.array([4096.0]), model.sample_work([SAMPLE]), 4, True)[0]
    assert t == pytest.approx(expected)
    table = model.time_table(np.array([4096.0]), model.sample_work([SAMPLE]), np.array([4]))
    assert table[0, 0] == pytest.approx(expected)



@pytest.mark.parametrize(("placement", "expected"), [
    ("split", (A * 4096**2 + E * 3 * 1024**2) / 4),
    ("replicate", A * 4096**2 / 4 + E * 3 * 1024**2),
    ("global", A * 4096**2 / 4),
])
def test_attention_time_is_the_quadratic_part_of_sample_time_that_the_group_runs(mm_config, placement, expected):
    # What the closed loop asks a model for (`CostModel.attention_time`): the part `scaled`'s attention factor grows.
    model = model_for(mm_config, placement)
    assert model.attention_time([SAMPLE], 4)[0] == pytest.approx(expected)
    tripled = model_for(mm_config.scaled(1.0, attention=3.0), placement)
    times = [m.sample_time(np.array([4096.0]), m.sample_work([SAMPLE]), 4, True)[0] for m in (model, tripled)]
    assert times[1] - times[0] == pytest.approx(2 * expected)

def test_replicate_keeps_the_fixed_part_through_planner_slices(mm_config):
    model = model_for(mm_config, "replicate")
    samples = [Sample(0, 100), SAMPLE]
    work = model.sample_work(samples)
    assert model.sample_time(np.array([4096.0]), work[[1]], 2, True)[0] == pytest.approx(LLM_WORK / 2 + ENC_WORK)
    assert model.sample_time(np.array([4096.0]), work[1:], 2, True)[0] == pytest.approx(LLM_WORK / 2 + ENC_WORK)


def test_frozen_encoder_runs_the_forward_only(mm_config):
    model = model_for(mm_config, "split", encoder_frozen=True)
    assert model.sample_work([SAMPLE])[0] == pytest.approx(LLM_WORK + FORWARD_SHARE * ENC_WORK)


def test_global_phase_balances_blocks_and_adds_the_all_to_all(mm_config):
    beta = 8192.0
    model = model_for(replace(mm_config, world_size=2, gpus_per_node=8), "global", enc_a2a_bytes_per_token=beta)
    samples = [SAMPLE, Sample(1, 2000, (VisualItem(1024, 256),))]
    phase = model.encoder_phase(samples)
    block = E * 1024**2 + F * 1024
    span = 2 * block  # 4 equal blocks on 2 ranks
    a2a = beta * (768 + 256) / 2 * (1 / 2) / 150e9 / 2
    assert phase.before_s == pytest.approx(FORWARD_SHARE * span + a2a)
    assert phase.after_s == pytest.approx((1 - FORWARD_SHARE) * span + a2a)
    frozen = model_for(replace(mm_config, world_size=2), "global", enc_a2a_bytes_per_token=beta, encoder_frozen=True)
    assert frozen.encoder_phase(samples).after_s == 0.0
    assert longest_first_makespan(np.array([3.0, 3.0, 2.0, 2.0, 2.0]), 2) == 7.0  # LPT, not the optimum 6


def test_simulate_keeps_the_encoder_apart(mm_config):
    samples = (SAMPLE, Sample(1, 2000))
    for placement, inside in (("split", ENC_WORK / 2), ("replicate", ENC_WORK), ("global", 0.0)):
        model = model_for(replace(mm_config, world_size=2), placement)
        plan = Plan("p", 2, 8, samples, (PlanGroup((0, 1), ((0, 1),)),), encoder_placement=placement)
        tl = simulate(plan, model)
        assert tl.encoder_in_groups_s == pytest.approx(inside)
        assert tl.spans[0].encoder_s == (pytest.approx(inside),)
        outside = tl.encoder_before_s + tl.encoder_after_s
        assert tl.step_time_s == pytest.approx(tl.spans[0].end_s + tl.encoder_after_s)
        assert (outside > 0) == (placement == "global")


def test_simulate_prices_a_plan_with_its_own_placement(mm_config):
    plan = Plan("p", 1, 8, (SAMPLE,), (PlanGroup((0,), ((0,),)),), encoder_placement="global")
    split_model = model_for(replace(mm_config, world_size=1), "split")
    assert simulate(plan, split_model).step_time_s == pytest.approx(
        simulate(plan, model_for(replace(mm_config, world_size=1), "global")).step_time_s)
    with pytest.raises(DhpError, match="encoder_placement 'auto' must be one of split, replicate, global"):
        simulate(replace(plan, encoder_placement="auto"), split_model)


def test_placement_names_and_config_check(mm_config):
    assert list(ENCODER_PLACEMENTS) == ["split", "replicate", "global", "auto"]
    with pytest.raises(DhpError, match="encoder_placement' = 'host' is unknown"):
        replace(mm_config, encoder_placement="host")
    with pytest.raises(DhpError, match="'merge' = 0 must be an integer >= 1"):
        replace(mm_config, merge=0)


# ---------------------------------------------------------------------- plans and auto
def test_plan_json_round_trip_of_images_and_placement(tmp_path):
    samples = (SAMPLE, Sample(1, 20))
    plan = Plan("p", 1, 8, samples, (PlanGroup((0,), ((0, 1),)),), encoder_placement="replicate")
    plan.save(tmp_path / "p.json")
    obj = json.loads((tmp_path / "p.json").read_text())
    assert obj["encoder_placement"] == "replicate" and obj["samples"][0]["images"][0]["blocks"] == [1024] * 3
    assert Plan.load(tmp_path / "p.json") == plan
    assert "encoder_placement" not in replace(plan, encoder_placement="split").to_dict()
    assert Plan.from_dict(replace(plan, encoder_placement="split").to_dict()).encoder_placement == "split"


def mm_batch() -> Batch:
    return LengthSource.from_args(dist="multimodal").draw(global_batch=96, seed=3, capacity=16 * 8192)


@pytest.mark.parametrize("name", ["dhp", "fcp-ref"])
def test_auto_keeps_the_lowest_predicted_step(gpt7b_config, name):
    config = replace(gpt7b_config, world_size=16, enc_a2a_bytes_per_token=16384.0)
    batch = mm_batch()
    planner = build_planner(name, {"dataset_max_tokens": int(batch.lengths.max())})
    steps = {p: run_planner(planner, batch, model_for(config, p)).predicted_step_time_s for p in ("split", "replicate", "global")}
    auto = run_planner(planner, batch, model_for(config, "auto"))
    assert auto.predicted_step_time_s == min(steps.values())
    assert auto.encoder_placement == min(steps, key=steps.get)


def test_auto_picks_the_lower_of_given_plans(gpt7b_config):
    batch = Batch((SAMPLE,))
    priced = {"split": 3.0, "replicate": 1.0, "global": 2.0}

    def solve(model):
        return Plan("p", 1, 8, batch.samples, (PlanGroup((0,), ((0,),)),), encoder_placement=model.encoder_placement,
                    predicted_step_time_s=priced[model.encoder_placement], solve_time_ms=1.0)

    best = plan_best_placement(solve, batch, model_for(gpt7b_config, "auto"))
    assert (best.encoder_placement, best.solve_time_ms) == ("replicate", 3.0)
    text = plan_best_placement(solve, Batch((Sample(0, 10),)), model_for(gpt7b_config, "auto"))
    assert (text.encoder_placement, text.solve_time_ms) == ("split", 1.0)  # no encoder work: planned once
