"""bench/gpu_check.py: its CPU run (every section skipped, exit 3), its report schema and its arithmetic."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
REPORT_KEYS = {"device", "peak_gb_per_s", "torch", "cuda", "quick", "status", "exit_code", "total_seconds", "sections"}
SECTION_KEYS = {"name", "status", "seconds", "reason", "checks"}
CHECK_KEYS = {"name", "status", "error", "tolerance", "metric", "reason", "numbers"}


gpu_check = load_bench("gpu_check")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--out" in proc.stdout and "Exit status" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA run")
def test_cpu_run_skips_every_section_and_exits_3(tmp_path):
    out = tmp_path / "report.json"
    proc = _run("--out", str(out))
    assert proc.returncode == gpu_check.EXIT_NOTHING_CHECKED == 3, proc.stderr
    assert "no CUDA device: every GPU check skipped" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS
    assert report["device"] is None and report["status"] == "nothing checked" and report["exit_code"] == 3
    assert [s["name"] for s in report["sections"]] == ["kernels", "attention", "calibration", "closed_loop", "sharding"]
    for section in report["sections"]:
        assert set(section) == SECTION_KEYS
        assert section["status"] == "skipped" and section["reason"] == "no CUDA device" and section["checks"] == []


def test_bandwidth_arithmetic():
    assert gpu_check.gb_per_s(4_000_000_000, 2.0) == 2.0
    # 10 rows read, 12 written, 256-byte rows, a 10-entry int64 index
    assert gpu_check.copy_bytes(10, 12, 256, 10) == 22 * 256 + 80
    # 4 blocks of [3 tokens, 2 heads, 8 dims] bf16 + their fp32 lse read, one block written
    assert gpu_check.merge_bytes(4, 3, 2, 8, 2) == 5 * 3 * 2 * 8 * 2 + 4 * 3 * 2 * 4


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-PCIE-40GB", 1555.0), ("Tesla T4", None),
])
def test_peak_bandwidth_by_device_name(name, peak):
    assert gpu_check.peak_gb_per_s(name) == peak


def _check(status: str) -> object:
    return gpu_check.Check(status, status)


@pytest.mark.parametrize("statuses,section,code", [
    (["ok", "skipped"], "ok", 0), (["ok", "fail", "skipped"], "fail", 1), (["skipped", "skipped"], "skipped", 3),
    ([], "skipped", 3),
])
def test_statuses_add_up(statuses, section, code):
    checks = [_check(s) for s in statuses]
    assert gpu_check.section_status(checks) == section
    assert gpu_check.exit_code([gpu_check.Section("a", section, 1.0), gpu_check.Section("b", "skipped", 0.0)]) == code


def test_compared_fails_nan_and_errors_above_tolerance():
    assert gpu_check.compared("x", 0.01, 0.03, "m").status == "ok"
    assert gpu_check.compared("x", 0.04, 0.03, "m").status == "fail"
    assert gpu_check.compared("x", math.nan, 0.03, "m").status == "fail"
    assert gpu_check.compared("x", 0.0, 0.0, "m").status == "ok"  # an exact comparison passes at tolerance 0


def test_guarded_turns_an_exception_into_one_failed_check():
    def broken():
        raise RuntimeError("no kernel image")

    (check,) = gpu_check.guarded("flash", broken)
    assert check.status == "fail" and "RuntimeError: no kernel image" in check.reason


def test_report_schema_is_strict_json():
    checks = [gpu_check.compared("lse_merge", math.nan, 1e-5, "m", kernel_gb_per_s=math.inf), _check("skipped")]
    sections = [gpu_check.Section("kernels", gpu_check.section_status(checks), 2.5, gpu_check.skip_reason(checks), checks)]
    report = gpu_check.build_report(sections, device="NVIDIA H200", quick=True, total_seconds=3.0)
    text = json.dumps(report, allow_nan=False)
    back = json.loads(text)
    assert set(back) == REPORT_KEYS and back["peak_gb_per_s"] == 4800.0
    assert back["status"] == "fail" and back["exit_code"] == 1
    (section,) = back["sections"]
    assert set(section) == SECTION_KEYS and section["status"] == "fail"
    assert all(set(c) == CHECK_KEYS for c in section["checks"])
    assert section["checks"][0]["error"] == "nan" and section["checks"][0]["numbers"]["kernel_gb_per_s"] == "inf"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_gpu_run_passes(tmp_path):
    out = tmp_path / "report.json"
    proc = _run("--quick", "--out", str(out))
    report = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(report["sections"], indent=1)[-4000:]
    assert report["device"] and {s["status"] for s in report["sections"]} <= {"ok", "skipped"}
