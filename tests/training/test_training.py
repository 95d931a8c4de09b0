"""Training end to end on spawned gloo ranks: equal loss curves under every planner and in one process,
exact resumption, clear errors for bad checkpoints, and the train / profile / demo commands."""

from __future__ import annotations

import json
import math

import pytest

from megatron_dhp.cli import main
from megatron_dhp.cost import CostConfig
from megatron_dhp.launch.ranks import launch
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, group_family
from megatron_dhp.training.job import rank_main
from megatron_dhp.training.profile import fit_report
from megatron_dhp.training.timing import CALIBRATION_WARMUP
from tests.training import workers

pytestmark = pytest.mark.slow  # every test here trains on spawned ranks, the two commands in-process included

RELATIVE = 1e-5
"""fp32: loss curves under different plans (different summation orders) agree to this relative error."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ckpt")
    config = workers.tiny_config()
    two = launch(rank_main, 2, workers.two_rank_runs, config, str(folder), timeout_s=400)
    single_config = workers.tiny_config(nproc=1, max_tokens_per_rank=96)
    one = launch(rank_main, 1, workers.single_process_run, single_config, str(folder), timeout_s=300)
    return {"two": two, "one": one[0]}


def test_loss_curves_equal_under_static_dhp_and_one_process(runs):
    single = workers.losses(runs["one"]["single"])
    for rank in runs["two"]:
        static, dhp = workers.losses(rank["static"]), workers.losses(rank["dhp"])
        assert len(static) == len(dhp) == len(single) == workers.STEPS >= 20
        for a, b, c in zip(static, dhp, single):
            assert math.isclose(a, c, rel_tol=RELATIVE) and math.isclose(b, c, rel_tol=RELATIVE), (a, b, c)
    assert single[-1] < 0.7 * single[0]  # the model learns the token chain


def test_a_slowed_rank_is_found_and_the_losses_stay_exact(runs):
    """Rank 1 held 4x as long per slot: the closed loop finds it within a few steps, the plans name it, and
    every step's loss is still the single process's."""
    single = workers.losses(runs["one"]["single"])
    for rank in runs["two"]:
        slowed = rank["slowed"]
        assert all(math.isclose(a, c, rel_tol=RELATIVE) for a, c in zip(workers.losses(slowed), single))
        named = [r.slow_ranks for r in slowed[8:]]
        assert all(line.startswith("r1@") for line in named), named
        speed = float(named[-1].split("@")[1])
        assert 0.1 <= speed <= 0.5, named


def test_the_planners_really_differ(runs):
    rank = runs["two"][0]
    assert rank["static_cp"] == 2
    assert {r.groups for r in rank["static"]} == {"1x2"}  # static CP 2: one group of both ranks every step
    assert any("2x1" in r.groups for r in rank["dhp"])  # dhp runs short samples on single ranks
    assert all(r.groups == "1x1" for r in runs["one"]["single"])


def test_no_communicator_is_created_after_start_up_with_the_group_family():
    config = workers.tiny_config(nproc=4, max_tokens_per_rank=24).with_overrides(train={"steps": 6})
    runs = launch(rank_main, 4, workers.family_runs, config, timeout_s=400)
    family = group_family(4, 4, DEFAULT_MAX_GROUPS_PER_RANK)
    for rank in runs:
        fixed, free = rank["family"], rank["any"]
        assert fixed["at_startup"] == len(family) == 5 and fixed["created"] == [0] * 6
        assert len({size for line in fixed["groups"] for size in line.split()}) >= 3  # plans did change groups
        assert free["at_startup"] == 0 and free["created"][-1] >= 2  # the same run without it creates groups
        assert fixed["losses"] == pytest.approx(free["losses"], rel=RELATIVE)
        mixed = rank["mixed"]  # any groups planned, the family created at start-up and nothing after it
        assert mixed["at_startup"] == 5 and mixed["created"] == [0] * 6
        assert mixed["losses"] == pytest.approx(free["losses"], rel=RELATIVE)


def test_a_vision_language_model_trains_alike_under_every_placement_and_in_one_process():
    two = launch(rank_main, 2, workers.vlm_runs, workers.vlm_config(2), timeout_s=400)
    one = launch(rank_main, 1, workers.vlm_runs, workers.vlm_config(1), timeout_s=300)[0]
    assert one["images"] >= 8
    single = one["dhp", "split"]
    for rank in two:
        for key, curve in rank.items():
            if key != "images":
                assert curve == pytest.approx(single, rel=RELATIVE), key
    assert single[-1] < single[0]


def test_resume_at_step_10_reproduces_steps_11_to_20_exactly(runs):
    for rank in runs["two"]:
        assert rank["resumed_from"] == workers.RESUME_AT
        resumed = rank["resumed"]
        assert [r.step for r in resumed] == list(range(workers.RESUME_AT + 1, workers.STEPS + 1))
        uninterrupted = rank["dhp"][workers.RESUME_AT:]
        assert [r.loss for r in resumed] == [r.loss for r in uninterrupted]
        assert [r.grad_norm for r in resumed] == [r.grad_norm for r in uninterrupted]
        assert [r.lr for r in resumed] == [r.lr for r in uninterrupted]
        assert rank["latest_step"] == workers.STEPS  # `latest` names the newest checkpoint


@pytest.mark.parametrize("case,rank_says", [
    ("truncated", r"checkpoint file '.*broken_truncated/rank1\.pt' is corrupt or truncated"),
    ("flipped", r"checkpoint file '.*broken_flipped/rank1\.pt' is corrupt or truncated"),
    ("missing", r"checkpoint file '.*broken_missing/rank0\.pt' is missing"),
    ("bad_meta", r"checkpoint metadata '.*broken_bad_meta/meta\.json' is not valid JSON \(.* at column 2\)"),
    ("other_model", r"saved with model\.hidden_size = 32 but this run has 48; resume with the saved settings"),
    ("other_data", r"saved with data\.seed = 3 but this run has 4"),
    ("empty_folder", r"no checkpoint in '.*nothing_here'"),
])
def test_bad_checkpoints_stop_every_rank_with_a_clear_error(runs, case, rank_says):
    import re

    messages = [rank["errors"][case] for rank in runs["two"]]
    assert all(m != "no error" for m in messages), messages
    assert any(re.search(rank_says, m) for m in messages), messages


def test_a_planner_that_plans_differently_on_every_rank_trains_rank_0s_plan(runs):
    ranks = [rank["rank_dependent"] for rank in runs["two"]]
    assert ranks[0]["own"] != ranks[1]["own"]  # left to itself, each rank would run another plan
    assert len(ranks[0]["held"]) == workers.STEPS
    assert ranks[1]["held"] == ranks[0]["held"]  # every step, every rank holds the broadcast plan
    assert ranks[0]["held"][-1] == ranks[0]["own"]  # and it is rank 0's
    assert ranks[0]["solves"] == workers.STEPS and ranks[1]["solves"] == 0  # one solve per step, on rank 0
    single = workers.losses(runs["one"]["single"])
    for rank in ranks:
        for a, c in zip(workers.losses(rank["records"]), single, strict=True):
            assert math.isclose(a, c, rel_tol=RELATIVE), (a, c)


def test_an_error_of_rank_0s_planner_stops_every_rank(runs):
    messages = [rank["failing_planner"] for rank in runs["two"]]
    assert messages[0] == "this planner plans nothing"
    assert messages[1] == "rank 0 could not plan the step: PlannerUnsupported: this planner plans nothing"


def test_a_plan_changed_after_the_broadcast_stops_every_rank(runs):
    messages = [rank["diverged"] for rank in runs["two"]]
    assert all(m.startswith("ranks hold different plans: rank") for m in messages), messages
    assert "ranks [1] have" in messages[0] and "ranks [0] have" in messages[1]


def test_checkpoint_of_another_world_size_is_refused(runs):
    assert "saved with world_size = 2 but this run has 1" in runs["one"]["world_mismatch"]


def test_train_command_logs_every_step_and_writes_json(tmp_path, capfd):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps(workers.tiny_config().to_dict()))  # JSON is YAML
    out = tmp_path / "run.json"
    code = main(["train", "--config", str(cfg), "--steps", "3", "--planner", "static", "--json", str(out),
                 "--save", str(tmp_path / "ck")])
    stdout = capfd.readouterr().out
    assert code == 0
    assert "step 3/3 | loss" in stdout and "| groups " in stdout and "pred" in stdout and "meas" in stdout
    assert "cost model vs measured" in stdout
    result = json.loads(out.read_text())["result"]
    assert [r["step"] for r in result["records"]] == [1, 2, 3] and result["planner"] == "static"
    (tmp_path / "ck" / "step_000003" / "rank0.pt").write_bytes(b"garbage")
    code = main(["train", "--config", str(cfg), "--steps", "4", "--load", str(tmp_path / "ck")])
    err = capfd.readouterr().err
    assert code == 2 and "rank0.pt' is corrupt or truncated" in err and len(err.strip().splitlines()) == 1


def test_profile_of_a_tiny_grid_fits_into_a_yaml_cost_config_accepts(runs, tmp_path):
    measured, steps, encoder = runs["two"][0]["profile"]
    assert encoder == 0.0  # a text-only GPT has no vision tower to time
    assert len(measured) == len(workers.PROFILE_GRID) and all(t > 0 for t in measured)
    assert [(name, step) for name, step, _, _ in steps] == [  # both planners in turn, after warm-up
        (name, step) for step in range(CALIBRATION_WARMUP + 1, workers.PROFILE_STEPS + 1) for name in ("static", "dhp")]
    assert all(m > 0 for *_, m in steps)
    groups = [[plan["groups"] for _, _, plan, _ in rank["profile"][1]] for rank in runs["two"]]
    assert groups[0] == groups[1]  # every rank trained the same plans
    report = fit_report(workers.tiny_config(), workers.PROFILE_GRID, measured, reps=1)
    assert len(report.fitted) == len(report.errors) == len(measured)
    path = tmp_path / "profiled.yaml"
    report.cost.save(path)
    cost = CostConfig.load(path)
    assert cost == report.cost and cost.kind == "profiled" and cost.world_size == 2 and cost.max_tokens_per_rank == 48
    assert cost.overlap_comm is False and cost.microbatch_overhead_s + cost.attn_s_per_token2 > 0


def test_demo_command_compares_planners_on_the_same_batches(tmp_path, capfd):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps(workers.tiny_config().to_dict()))
    code = main(["demo", "--config", str(cfg), "--steps", "3", "--out", str(tmp_path / "demo"), "--quiet"])
    stdout = capfd.readouterr().out
    assert code == 0, stdout
    assert "speed-up" in stdout and "loss at last step" in stdout and "plan.png" in stdout
    assert "calibration steps (static and dhp) predicted within 15%" in stdout  # the profile ran its steps
    assert (tmp_path / "demo" / "plan.png").stat().st_size > 0
    runs = json.loads((tmp_path / "demo" / "demo.json").read_text())["runs"]
    static, dhp = runs["static"]["records"], runs["dhp"]["records"]
    assert [r["num_tokens"] for r in static] == [r["num_tokens"] for r in dhp]  # the same batches
    assert math.isclose(static[-1]["loss"], dhp[-1]["loss"], rel_tol=RELATIVE)
