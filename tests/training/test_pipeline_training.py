"""Training under pipeline parallelism (PP 2, megatron-core's 1F1B) on spawned gloo ranks: the loss curve
equals the same run without a pipeline under every planner, and a stage-keyed checkpoint resumes exactly."""

from __future__ import annotations

import math

import pytest

from megatron_dhp.launch.ranks import launch
from megatron_dhp.training.job import rank_main
from tests.training import workers

RELATIVE = 1e-5
"""fp32: different plans and a pipeline only change summation orders."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pp_ckpt")
    # Samples of at most 71 tokens and M 72: planners that do not plan for the pipeline pack microbatches of
    # M // P = 36 tokens per rank, so static runs CP 2 while dhp runs short samples on one rank.
    short = {"train": {"steps": workers.PP_STEPS}, "data": {"length_scale": 1 / 1024}}
    config = workers.tiny_config(nproc=4, max_tokens_per_rank=72, pp=2).with_overrides(**short)
    pipelined = launch(rank_main, 4, workers.pipeline_runs, config, str(folder), timeout_s=400)
    plain = workers.tiny_config(nproc=2, max_tokens_per_rank=72, planner="static").with_overrides(**short)
    return {"pp2": pipelined, "pp1": launch(rank_main, 2, workers.plain_run, plain, timeout_s=300)[0]}


def test_pp2_loss_curves_equal_pp1_under_static_and_dhp(runs):
    plain = workers.losses(runs["pp1"])
    assert len(plain) == workers.PP_STEPS
    assert sorted(r["stage"] for r in runs["pp2"]) == [0, 0, 1, 1]
    for rank in runs["pp2"]:  # every rank reports the last stage's loss
        static, dhp = workers.losses(rank["static"]), workers.losses(rank["dhp"])
        assert len(static) == len(dhp) == workers.PP_STEPS
        for a, b, c in zip(static, dhp, plain):
            assert math.isclose(a, c, rel_tol=RELATIVE) and math.isclose(b, c, rel_tol=RELATIVE), (a, b, c)
        assert [r.num_tokens for r in rank["dhp"]] == [r.num_tokens for r in runs["pp1"]]
        assert [r.groups for r in rank["static"]] != [r.groups for r in rank["dhp"]]  # the plans really differ
        assert rank["capacity"] == 2 * (72 // 2)  # the data is checked against N x M // P, what a plan can hold


def test_pp2_checkpoint_resumes_exactly_and_refuses_another_pp(runs):
    for rank in runs["pp2"]:
        resumed, uninterrupted = rank["resumed"], rank["dhp"][workers.PP_SAVE_AT:]
        assert [r.step for r in resumed] == list(range(workers.PP_SAVE_AT + 1, workers.PP_STEPS + 1))
        assert [r.loss for r in resumed] == [r.loss for r in uninterrupted]
        assert [r.grad_norm for r in resumed] == [r.grad_norm for r in uninterrupted]
        assert "pp" in rank["other_pp"] and "--load" in rank["other_pp"], rank["other_pp"]


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory) -> dict:
    # 4 layers, one per chunk. Stage 0 keeps 5 chunks of 1/2 in flight, so a microbatch holds 2 x 90 // 5 = 36
    # tokens per rank and the domain of 2 holds every sample (at most 71 tokens) whole, as the plain run does.
    short = {"train": {"steps": workers.PP_STEPS}, "data": {"length_scale": 1 / 1024}, "model": {"num_layers": 4}}
    interleave = {**short, "train": {**short["train"], "vpp": 2}}
    config = workers.tiny_config(nproc=4, max_tokens_per_rank=90, pp=2).with_overrides(**interleave)
    folder = tmp_path_factory.mktemp("vpp_ckpt")
    plain = workers.tiny_config(nproc=2, max_tokens_per_rank=90, planner="static").with_overrides(**short)
    return {"vpp": launch(rank_main, 4, workers.interleaved_runs, config, str(folder), timeout_s=400),
            "plain": launch(rank_main, 2, workers.plain_run, plain, timeout_s=300)[0]}


def test_pp2_vpp2_training_equals_the_run_without_a_pipeline_and_resumes_exactly(interleaved):
    plain = workers.losses(interleaved["plain"])
    for rank in interleaved["vpp"]:
        assert rank["chunks"] == 2 and "PP 2 x VPP 2" in rank["describe"] and rank["capacity"] == 2 * (2 * 90 // 5)
        dhp = workers.losses(rank["dhp"])
        assert len(dhp) == len(plain) == workers.PP_STEPS
        assert all(math.isclose(a, b, rel_tol=RELATIVE) for a, b in zip(dhp, plain)), (dhp, plain)
        resumed, uninterrupted = rank["resumed"], rank["dhp"][workers.PP_SAVE_AT:]
        assert [r.loss for r in resumed] == [r.loss for r in uninterrupted]
        assert [r.grad_norm for r in resumed] == [r.grad_norm for r in uninterrupted]
