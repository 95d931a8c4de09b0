"""bench/plan_quality.py: its targets and README table with dhp alone and beside a peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "plan_quality.py"


plan_quality = load_bench("plan_quality")


def _record(planner: str, step_s: float, lb_s: float = 1.6) -> dict:
    return {"domain": "gpt7b-48", "workload": "w", "batch": 0, "planner": planner, "step_s": step_s, "lb_s": lb_s,
            "ratio": step_s / lb_s, "solve_ms": 1.0}


def test_dhp_alone_has_no_peer_targets_or_columns():
    records = [_record("dhp", 2.0)]
    assert plan_quality.targets(records) == [
        ("dhp step / LB, mean over all batches (<= 1.03)", "1.2500", False),
        ("dhp step / LB, worst batch (<= 1.08)", "1.2500", False),
    ]
    assert plan_quality.markdown_summary(records, ["dhp"]) == (
        "| workload | N | dhp step / LB |\n|---|---|---|\n| w | 48 | 1.2500 |")


def test_a_peer_adds_its_targets_and_column():
    records = [_record("dhp", 2.0), _record("fcp-ref", 2.5)]
    assert plan_quality.targets(records)[2:] == [
        ("dhp / peer step, worst batch (<= 1.005)", "0.8000 (vs fcp-ref)", True),
        ("best peer / dhp where best peer > 1.05 LB, mean over 1 batches (>= 1.05)", "1.2500", True),
    ]
    assert plan_quality.markdown_summary(records, ["dhp", "fcp-ref"]).splitlines()[2] == "| w | 48 | 1.2500 | 1.250x (1) |"


def test_the_script_with_dhp_alone_prints_its_markdown_table(tmp_path):
    out = tmp_path / "records.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--markdown", "--planners", "dhp", "--batches", "1",
                           "--workloads", "bimodal", "--domains", "gpt7b-48", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    (record,) = json.loads(out.read_text())["records"]
    assert proc.stdout.splitlines()[-3:] == [
        "| workload | N | dhp step / LB |", "|---|---|---|", f"| bimodal | 48 | {record['ratio']:.4f} |"]
