"""The `megatron-dhp` command: plan, simulate, dists, and one clear line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_dhp.cli import COMMANDS, main
from tests import reference_eval


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_static_wlbllm_matches_independent_evaluation(tmp_path, capsys, gpt7b_config):
    out = tmp_path / "plan.json"
    code, stdout, _ = run_cli(["plan", "--dist", "wlbllm", "--global-batch", 512, "--seed", 0, "--cost", "gpt7b-64",
                               "--planner", "static", "--out", out], capsys)
    assert code == 0 and "static: groups 4x16" in stdout
    from megatron_dhp.plan import Plan

    plan = Plan.load(out)
    plan.validate(max_tokens_per_rank=8192)
    obj = json.loads(out.read_text())
    assert len(obj["samples"]) == 512 and obj["world_size"] == 64
    expected = reference_eval.step_time(gpt7b_config.to_dict(), obj)
    assert obj["predicted_step_time_s"] == pytest.approx(expected, rel=1e-6)
    assert obj["lower_bound_s"] == pytest.approx(reference_eval.lower_bound(gpt7b_config.to_dict(), obj["samples"]), rel=1e-6)


def test_plan_overrides_domain(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, _ = run_cli(["plan", "--dist", "bimodal", "--global-batch", 64, "--world-size", 12, "--gpus-per-node", 4,
                          "--max-tokens-per-rank", 16384, "--out", out], capsys)
    obj = json.loads(out.read_text())
    assert code == 0 and (obj["world_size"], obj["gpus_per_node"], obj["max_tokens_per_rank"]) == (12, 4, 16384)


def test_rank_speeds_reach_the_plan_and_simulate_adds_speed_blind_dhp(tmp_path, capsys):
    speeds, out, js = tmp_path / "speeds.json", tmp_path / "plan.json", tmp_path / "sim.json"
    speeds.write_text(json.dumps([1.0] * 5 + [0.5] + [1.0] * 10))
    common = ["--dist", "wlbllm", "--global-batch", 64, "--world-size", 16, "--rank-speeds", speeds]
    code, stdout, _ = run_cli(["plan", *common, "--out", out], capsys)
    assert code == 0 and "slow r5@0.50" in stdout
    assert json.loads(out.read_text())["rank_speeds"][5] == 0.5
    code, stdout, _ = run_cli(["simulate", *common, "--batches", 1, "--planners", "dhp,static", "--json", js], capsys)
    results = json.loads(js.read_text())["results"]
    assert code == 0 and set(results) == {"dhp", "dhp-blind", "static"}
    assert results["dhp"][0]["step_time_s"] < results["dhp-blind"][0]["step_time_s"]


def test_plan_whole_length_file(tmp_path, capsys):
    lengths = tmp_path / "l.json"
    lengths.write_text("[300, 9000, 120, 40]")
    out = tmp_path / "plan.json"
    assert run_cli(["plan", "--lengths", lengths, "--world-size", 4, "--out", out], capsys)[0] == 0
    assert [s["tokens"] for s in json.loads(out.read_text())["samples"]] == [300, 9000, 120, 40]


def test_simulate_table_json_and_plot(tmp_path, capsys):
    png, js = tmp_path / "sim.png", tmp_path / "sim.json"
    code, stdout, _ = run_cli(["simulate", "--batches", 2, "--global-batch", 128, "--plot", png, "--json", js,
                               "--planners", "static,megatron-hcp,fcp-ref"], capsys)  # flexsp-milp: seconds per MILP
    assert code == 0 and "step/LB" in stdout and "static" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(json.loads(js.read_text())["results"]["static"]) == 2


@pytest.mark.parametrize("tp_terms", [{}, {"tp_efficiency": 0.5, "tp_comm_bytes_per_token": 5e7, "attention_heads": 32}],
                         ids=["ideal-tp", "costly-tp"])
def test_simulate_tuned_adds_the_tuned_static_layout_never_slower_than_static(tmp_path, capsys, gpt7b_config, tp_terms):
    from dataclasses import replace

    cost, plain, tuned = tmp_path / "cost.yaml", tmp_path / "plain.json", tmp_path / "tuned.json"
    replace(gpt7b_config, **tp_terms).save(cost)
    common = ["simulate", "--cost", cost, "--world-size", 16, "--global-batch", 64, "--batches", 2, "--planners", "dhp,static"]
    assert run_cli([*common, "--json", plain], capsys)[0] == 0
    code, stdout, _ = run_cli([*common, "--tuned", "--json", tuned], capsys)
    text = " ".join(stdout.split())  # (rich wraps the lines)
    assert code == 0 and "static-best" in text and "the static layout with the shortest mean step" in text
    results = json.loads(tuned.read_text())["results"]
    assert list(results) == ["dhp", "static", "static-best"]
    best, static = results["static-best"], results["static"]
    assert all("unsupported" not in r and r["summary"].startswith("static-best: ") for r in best)
    mean = lambda rows: sum(r["step_time_s"] for r in rows) / len(rows)  # noqa: E731
    assert mean(best) <= mean(static)
    assert {r["tensor_parallel"] for r in best} == {1 if tp_terms else 8}  # TP free: the whole node; costly: none
    # the existing rows are as without --tuned
    before = json.loads(plain.read_text())["results"]
    for name in ("dhp", "static"):
        assert [(r["step_time_s"], r["lower_bound_s"]) for r in before[name]] == [(r["step_time_s"], r["lower_bound_s"]) for r in results[name]]
    assert ("so TP is priced ideal" in text) == (not tp_terms)


def test_simulate_reports_steps_against_the_best_bound(tmp_path, capsys, gpt7b_config):
    """Without overlap a 2-rank sample that must run wide to end early costs more than the reference bound
    charges: simulate's step / LB is over the coupled bound (`cost.bound.best_lower_bound`), the plan's
    own record keeps the reference bound."""
    from dataclasses import replace

    from megatron_dhp.cost import build_cost_model
    from megatron_dhp.cost.bound import best_lower_bound
    from megatron_dhp.workload.sample import Batch, Sample

    config = replace(gpt7b_config, world_size=16, overlap_comm=False)
    cost, lengths, js, out = tmp_path / "cost.yaml", tmp_path / "l.json", tmp_path / "sim.json", tmp_path / "plan.json"
    config.save(cost)
    tokens = [2 * 8192] + [1000] * 39
    lengths.write_text(json.dumps(tokens))
    code, _, _ = run_cli(["simulate", "--cost", cost, "--lengths", lengths, "--global-batch", 40, "--batches", 1,
                          "--planners", "dhp,static", "--json", js], capsys)  # the 40 lengths, reordered
    model, batch = build_cost_model(config), Batch(tuple(Sample(i, t) for i, t in enumerate(tokens)))
    best = best_lower_bound(model, batch.samples)
    assert code == 0 and best > 1.05 * model.lower_bound(batch.samples)
    for rows in json.loads(js.read_text())["results"].values():
        assert rows[0]["lower_bound_s"] == pytest.approx(best) and rows[0]["ratio"] >= 1.0
    assert run_cli(["plan", "--cost", cost, "--lengths", lengths, "--out", out], capsys)[0] == 0
    assert json.loads(out.read_text())["lower_bound_s"] == pytest.approx(model.lower_bound(batch.samples))


def test_dists_lists_every_distribution(capsys):
    code, stdout, _ = run_cli(["dists", "--samples", 2000], capsys)
    assert code == 0 and all(name in stdout for name in ("wlbllm", "lognormal-pareto", "bimodal", "giant", "multimodal"))


@pytest.mark.parametrize(
    "args,match",
    [
        (["plan", "--lengths", "{tmp}/missing.json"], "length file '.*missing.json' does not exist"),
        (["plan", "--lengths", "{tmp}/empty.json"], "is empty"),
        (["plan", "--lengths", "{tmp}/bad.json"], "is not valid JSON"),
        (["plan", "--lengths", "{tmp}/neg.json"], "entry 1: length -5 must be a positive integer"),
        (["plan", "--lengths", "{tmp}/float.json"], "entry 0: length 1.5 must be a positive integer"),
        (["plan", "--lengths", "{tmp}/long.json"], "sample 0 has 600000 tokens but the whole domain holds at most 524288"),
        (["plan", "--lengths", "{tmp}/ok.json", "--cost", "{tmp}/unknown.yaml"], "unknown key 'gpus_per_nod'; did you mean 'gpus_per_node'"),
        (["plan", "--lengths", "{tmp}/ok.json", "--cost", "{tmp}/missing.yaml"], "missing key 'world_size'"),
        (["plan", "--lengths", "{tmp}/ok.json", "--cost", "{tmp}/type.yaml"], "'overlap_comm' = 'sometimes' must be true or false"),
        (["plan", "--lengths", "{tmp}/ok.json", "--world-size", "0"], "world_size = 0 must be an integer >= 1"),
        (["plan", "--dist", "bimodal"], "needs --global-batch"),
        (["simulate", "--batches", "0"], "--batches 0 must be at least 1"),
        (["simulate", "--tuned", "--pp", "2"], "--tuned tunes single-stage layouts; it cannot be combined with --pp 2"),
        (["plan", "--lengths", "{tmp}/ok.json", "--rank-speeds", "{tmp}/missing.json"], "rank speeds file .* does not exist"),
        (["plan", "--lengths", "{tmp}/ok.json", "--rank-speeds", "{tmp}/bad.json"], "rank speeds file .* is not valid JSON"),
        (["plan", "--lengths", "{tmp}/ok.json", "--rank-speeds", "{tmp}/speeds_obj.json"], "must hold a JSON list of numbers"),
        (["plan", "--lengths", "{tmp}/ok.json", "--rank-speeds", "{tmp}/float.json"], "rank_speeds holds 1 speeds but the domain has 64 ranks"),
        (["plan", "--lengths", "{tmp}/ok.json", "--world-size", "2", "--rank-speeds", "{tmp}/neg.json"], "rank speed -5.0 must be a finite number > 0"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, capsys, gpt7b_config, args, match):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "bad.json").write_text("[1,")
    (tmp_path / "neg.json").write_text("[3, -5]")
    (tmp_path / "float.json").write_text("[1.5]")
    (tmp_path / "long.json").write_text("[600000]")
    (tmp_path / "ok.json").write_text("[1000, 2000]")
    (tmp_path / "speeds_obj.json").write_text('{"0": 1.0}')
    good = gpt7b_config.to_dict()
    (tmp_path / "unknown.yaml").write_text("\n".join(f"{k}: {v}" for k, v in {**good, "gpus_per_nod": 8}.items() if k != "overlap_comm") + "\noverlap_comm: true")
    (tmp_path / "missing.yaml").write_text("\n".join(f"{k}: {v}" for k, v in good.items() if k not in ("world_size", "overlap_comm")) + "\noverlap_comm: true")
    (tmp_path / "type.yaml").write_text("\n".join(f"{k}: {v}" for k, v in good.items() if k != "overlap_comm") + "\noverlap_comm: sometimes")
    code, _, err = run_cli([a.format(tmp=tmp_path) for a in args] + ["--out", str(tmp_path / "p.json")] * (args[0] == "plan"), capsys)
    import re

    assert code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(match, err), err
    assert "Traceback" not in err


def test_console_script_has_help_on_every_command():
    for command in [[]] + [[c] for c in COMMANDS]:
        result = subprocess.run([sys.executable, "-m", "megatron_dhp", *command, "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "usage: megatron-dhp" in result.stdout


def test_help_imports_no_torch_megatron_or_matplotlib():
    # --help on every command is instant only while no sub-command module imports them at its top
    code = ("import sys, contextlib, io\nfrom megatron_dhp.cli import COMMANDS, main\n"
            "for c in [[], *([c] for c in COMMANDS)]:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        main([*c, '--help'])\n"
            "print(sorted(m for m in ('torch', 'megatron', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_console_script_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "megatron_dhp", "plan", "--lengths", str(tmp_path / "nope.json")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("megatron-dhp plan: error: length file")


@pytest.mark.parametrize("args", [["plan", "--dist", "wlbllm", "--out"], ["train", "--config"]])
def test_a_path_the_system_refuses_is_one_line(args, tmp_path, capsys):
    # A file name over 255 bytes raised a traceback from deep inside pathlib.
    name = str(tmp_path / ("a" * 300 + (".json" if args[0] == "plan" else ".yaml")))
    assert main([*args, name]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "File name too long; give a path this system accepts" in err
