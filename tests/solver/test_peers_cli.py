"""The peers through the CLI: `n/a` for batches a planner's source cannot plan, and `--time-limit`."""

from __future__ import annotations

import json

from megatron_dhp.cli import build_parser, main
from megatron_dhp.cli.common import planner_context


def test_simulate_reports_na_instead_of_failing(tmp_path, capsys):
    js = tmp_path / "sim.json"
    code = main(["simulate", "--dist", "giant", "--global-batch", "16", "--batches", "2", "--cost", "gpt7b-48",
                 "--planners", "static,megatron-hcp,fcp-ref,flexsp-milp", "--time-limit", "1", "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0
    assert "megatron-hcp: n/a on batch 0, 1: upstream cannot plan this batch" in " ".join(out.split())
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert rows["megatron-hcp"].count("n/a") == 5 and "2/2" in rows["megatron-hcp"]
    assert "n/a" not in rows["fcp-ref"] and "0/2" in rows["fcp-ref"]
    results = json.loads(js.read_text())["results"]
    assert "unsupported" in results["flexsp-milp"][0] and "step_time_s" in results["fcp-ref"][0]


def test_plan_command_fails_clearly_for_an_unsupported_batch(tmp_path, capsys):
    code = main(["plan", "--dist", "giant", "--global-batch", "16", "--cost", "gpt7b-48", "--planner",
                 "megatron-hcp", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and "megatron-dhp plan: error: upstream cannot plan this batch" in err
    assert not (tmp_path / "p.json").exists()


def test_time_limit_flag():
    args = build_parser().parse_args(["simulate", "--time-limit", "2.5"])
    assert planner_context(args, 1000) == {"dataset_max_tokens": 1000, "time_limit_s": 2.5}
    args = build_parser().parse_args(["plan", "--dist", "wlbllm", "--global-batch", "4"])
    assert "time_limit_s" not in planner_context(args, 1000)  # each planner keeps its own default


def test_time_limit_must_be_positive(capsys):
    code = main(["simulate", "--time-limit", "0", "--batches", "1", "--global-batch", "8"])
    assert code == 2 and "--time-limit 0.0 must be a positive number of seconds" in capsys.readouterr().err
