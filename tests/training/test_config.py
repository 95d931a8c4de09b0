"""The train config: the shipped YAML loads, every key is checked, values are validated with a clear fix."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_dhp.cli import main
from megatron_dhp.cost.config import Domain
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.training.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from tests.configs import GPT7B


def test_demo_config_loads_by_name_and_round_trips():
    config = TrainConfig.load("demo_cpu")
    assert config.dhp.max_tokens_per_rank == 512 and config.data.source == "wlbllm" and config.train.tp == 1
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_overrides_replace_only_the_given_keys():
    config = TrainConfig.load("demo_cpu")
    changed = config.with_overrides(train={"steps": 7, "nproc": None}, dhp={"planner": "static"})
    assert (changed.train.steps, changed.dhp.planner) == (7, "static")
    assert changed.train.nproc == config.train.nproc and changed.model == config.model and changed.data == config.data


@pytest.mark.parametrize("obj,match", [
    ({"train": {"step": 3}}, r"train config: key 'train': unknown key 'step'; did you mean 'steps'\?"),
    ({"modle": {}}, r"unknown key 'modle'; did you mean 'model'\?"),
    ({"train": {"steps": "ten"}}, r"key 'steps' = 'ten' must be an integer"),
    ({"train": {"steps": 0}}, r"train.steps = 0 must be >= 1"),
    ({"train": {"steps": 4, "warmup_steps": 4}}, r"train.warmup_steps = 4 must be below train.steps = 4"),
    ({"train": {"nproc": 3, "tp": 2}}, r"train.nproc = 3 must be a multiple of train.tp = 2"),
    ({"train": {"pp": 0}}, r"train.pp = 0 must be >= 1"),
    ({"train": {"vpp": 2}}, r"train.vpp = 2 interleaves model chunks of a pipeline: it needs train.pp >= 2 \(got "
                            r"train.pp = 1\)"),
    ({"train": {"pp": 2, "vpp": 2}}, r"model.num_layers = 2 must be a multiple of train.pp x train.vpp = 2 x 2"),
    ({"train": {"nproc": 6, "tp": 2, "pp": 2}}, r"train.nproc = 6 must be a multiple of train.tp x train.pp = 2 x 2"),
    ({"train": {"lr": 1e-3, "min_lr": 1e-2}}, r"min_lr = 0.01 between 0 and lr"),
    ({"model": {"hidden_size": 62}}, r"model.hidden_size 62 must be a multiple of num_attention_heads 4"),
    ({"model": {"num_query_groups": 3}}, r"num_attention_heads 4 must be a multiple of num_query_groups 3"),
    ({"data": {"length_scale": 0}}, r"data.length_scale = 0.0 must be > 0"),
    ({"data": {"noise": 2}}, r"data.noise = 2.0 must be between 0 and 1"),
    ({"dhp": {"planner": "magic"}}, r"planner 'magic' is unknown"),
    ({"train": {"save": 5}}, r"key 'save' = 5 must be a string"),
])
def test_bad_values_name_the_key_and_the_fix(obj, match):
    with pytest.raises(DhpError, match=match):
        TrainConfig.from_dict(obj)


@pytest.mark.parametrize("config", [
    GPT7B, Domain(8, 8, 1024), DhpConfig(), ModelConfig(), DataConfig(), RunConfig(), TrainConfig(),
], ids=lambda c: type(c).__name__)
def test_every_config_checks_the_type_of_every_key_on_construction(config):
    # from_mapping leaves types to the dataclass: a config that skipped check_fields would take any YAML value
    wrong = {"str": 5, "str | None": 5, "bool": "x", "int": "x", "int | None": "x", "float": "x"}
    for f in dataclasses.fields(config):
        with pytest.raises(DhpError, match=f"key '{f.name}' = .* must be "):
            dataclasses.replace(config, **{f.name: wrong.get(f.type, {})})


def test_missing_config_file_is_a_clear_error():
    with pytest.raises(DhpError, match="train config 'nope.yaml' is neither a file nor a config in configs/"):
        TrainConfig.load("nope.yaml")


def test_auto_rank_count_is_at_least_two_and_a_multiple_of_tp():
    assert RunConfig().num_ranks >= 2
    assert RunConfig(tp=2).num_ranks % 2 == 0
    assert RunConfig(nproc=3).num_ranks == 3
    assert RunConfig(tp=2, pp=3).num_ranks % 6 == 0


@pytest.mark.parametrize("command,words", [
    ("train", ["--config", "--planner", "--save", "--save-interval", "--load", "--nproc", "--cost", "--pp"]),
    ("demo", ["--config", "--nproc", "--planners", "--calibrate", "--out", "--pp"]),
    ("profile", ["--config", "--lengths", "--data-points", "--calibration-steps", "--reps", "--out", "--tp",
                 "--tp-from", "--tp-out"]),
])
def test_help(command, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(w in out for w in words), out


@pytest.mark.parametrize("argv,match", [
    (["train", "--config", "nope.yaml"], "train config 'nope.yaml' is neither a file"),
    (["profile", "--lengths", "64,x"], "--lengths '64,x' must be comma-separated integers"),
    (["profile", "--calibration-steps", "-1"], "--calibration-steps -1 must be 0 or more"),
    (["demo", "--planners", "dhp"], "--planners 'dhp': give at least two of"),
    (["profile", "--tp-from", "configs/tiny-gpt-cpu.yaml"], "--tp-from needs this job at tensor parallelism >= 2"),
    (["profile", "--tp", "2", "--nproc", "2", "--tp-from", "gpt7b-64"], "must be a profile written by `megatron-dhp "
                                                                         "profile` at TP 1 (kind profiled"),
])
def test_cli_errors_are_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_demo_calibration_refuses_a_pipeline_in_one_line(tmp_path, capsys):
    assert main(["demo", "--pp", "2", "--nproc", "4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.pp = 2" in err and "--no-calibrate" in err and len(err.strip().splitlines()) == 1


def test_bad_yaml_key_through_the_cli(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train:\n  stesp: 3\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown key 'stesp'; did you mean 'steps'?" in capsys.readouterr().err
