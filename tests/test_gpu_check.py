"""bench/gpu_check.py: its CPU run (every section skipped, exit 3), its CPU smoke (the attention and train-step
code paths on tiny sizes), its report schema and its arithmetic."""

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
SECTIONS = ["attention", "train_step", "kernels", "calibration", "closed_loop", "sharding", "safety"]
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
    assert "--cpu-smoke" in proc.stdout and "--only" in proc.stdout and "--step-limit" in proc.stdout


def test_unknown_section_is_refused():
    proc = _run("--only", "atention")
    assert proc.returncode == 2 and "unknown section(s) atention" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA run")
def test_cpu_run_skips_every_section_and_exits_3(tmp_path):
    out = tmp_path / "report.json"
    proc = _run("--out", str(out))
    assert proc.returncode == gpu_check.EXIT_NOTHING_CHECKED == 3, proc.stderr
    assert "no CUDA device: every GPU check skipped" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS
    assert report["device"] is None and report["status"] == "nothing checked" and report["exit_code"] == 3
    assert [s["name"] for s in report["sections"]] == SECTIONS
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


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None),
])
def test_peak_bf16_flops_by_device_name(name, peak):
    assert gpu_check.peak_bf16_tflops(name) == peak


@pytest.mark.parametrize("total,longest", [(3000, 750), (32768, 8192), (131072, 32768), (128, 32), (512, 128)])
def test_long_tailed_lengths(total, longest):
    lengths = gpu_check.long_tailed(total, longest)
    assert sum(lengths) == total and max(lengths) == longest and min(lengths) == 1
    assert sum(n % 2 for n in lengths) >= 2  # odd lengths: zigzag chunks get padded
    assert lengths == gpu_check.long_tailed(total, longest)  # deterministic
    if total >= 3000:
        assert sorted(lengths)[len(lengths) // 2] < longest // 4  # a long tail of short samples


def test_attention_arithmetic():
    assert gpu_check.causal_pairs((1, 2, 3)) == 1 + 3 + 6
    # 12 FLOPs per pair, head and dimension: 4 forward (QK^T, PV), 8 backward
    assert gpu_check.attention_flops((4,), 2, 8) == 12 * 10 * 2 * 8
    assert gpu_check.tokens_label(32768) == "32K" and gpu_check.tokens_label(512) == "512"


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


def _smoke(tmp_path, section: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`scripts/gpu_check.sh --quick --cpu-smoke` on one section, as a user would run it."""
    out = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--quick", "--cpu-smoke", "--only", section,
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    report = json.loads(out.read_text())
    sections = {s["name"]: s for s in report["sections"]}
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert all(s["status"] == "skipped" for name, s in sections.items() if name != section)
    return proc, report, {c["name"]: c for c in sections[section]["checks"]}


def test_cpu_smoke_of_the_attention_section(tmp_path):
    """Every kernel and comm on the CPU against the fp32 oracle (sdpa with gradients, flex forward only; varlen
    and flash skipped), and the timing code paths (recorded, not judged)."""
    proc, report, checks = _smoke(tmp_path, "attention")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["device"] == "cpu (smoke)" and report["status"] == "ok"
    for where in ("d=1", *(f"d={d} {c}" for d in (2, 4) for c in ("allgather", "ulysses", "ring"))):
        for part in ("forward", "backward"):
            assert checks[f"sdpa {where} bfloat16 {part}"]["status"] == "ok"
        assert checks[f"flex {where} bfloat16 forward"]["status"] == "ok"
        assert checks[f"flex {where} bfloat16 backward"]["status"] == "skipped"
        assert "CUDA" in checks[f"varlen {where} bfloat16"]["reason"]
    assert checks["sdpa d=2 ring mla bfloat16 backward"]["status"] == "ok"
    timings = [c for name, c in checks.items() if name.startswith(("one rank", "ring of"))]
    assert len(timings) == 3 and all(c["status"] == "ok" and "not judged" in c["reason"] for c in timings)
    assert all(c["numbers"]["output_vs_reference"] <= 3e-2 for c in timings)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke of a step runs where there is no CUDA")
def test_cpu_smoke_of_the_train_step_section(tmp_path):
    """A tiny GPT's steps on a gloo rank through the step engine: timed, host syncs probed."""
    proc, report, checks = _smoke(tmp_path, "train_step")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (share,) = [c for name, c in checks.items() if "share of the step" in name]
    n = share["numbers"]
    assert n["tokens_per_step"] == 512 and n["steps_measured"] >= 1 and n["tokens_per_s"] > 0
    assert 0 <= share["error"] <= 1 and math.isfinite(n["loss"])
    assert any(name.startswith("no host sync in megatron-dhp's core attention") for name in checks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_gpu_run_passes(tmp_path):
    out = tmp_path / "report.json"
    proc = _run("--quick", "--out", str(out))
    report = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(report["sections"], indent=1)[-4000:]
    assert report["device"] and {s["status"] for s in report["sections"]} <= {"ok", "skipped"}


def test_a_rings_bound_is_its_tile_work_over_one_calls():
    # A flash-attention tile is 128 rows: zigzag chunks of short samples fill few of them, so a ring of 4 or 8
    # does 1.41x and 2.65x one call's tile work on the timing's 32K-token batch before any overhead.
    assert (gpu_check.tiles(128, 128, True), gpu_check.tiles(256, 256, True), gpu_check.tiles(100, 300, False)) == (1, 3, 3)
    lengths = gpu_check.long_tailed(32768, 8192, seed=1)
    ratios = [gpu_check.ring_tile_ratio(lengths, d) for d in (1, 2, 4, 8)]
    assert ratios[0] == 1.0 and ratios == sorted(ratios)
    assert [round(r, 2) for r in ratios[2:]] == [1.41, 2.65]
    assert gpu_check.ring_tile_ratio((1 << 20,), 8) == pytest.approx(1.0, abs=0.01)  # one long sample: no waste


def test_a_section_past_its_cap_starts_no_more_checks(monkeypatch):
    monkeypatch.setitem(gpu_check.SECTION_CAP_S, "kernels", (0.0, 0.0))
    monkeypatch.setitem(gpu_check.SECTIONS, "kernels",
                        lambda opts: gpu_check.guarded("one", lambda: [gpu_check.Check("one", "ok")]))
    section = gpu_check.run_section("kernels", gpu_check.Options(quick=True))
    assert section.status == "skipped" and "time cap of 0 s" in section.checks[0].reason
    assert gpu_check.guarded("after", lambda: [gpu_check.Check("after", "ok")])[0].status == "ok"  # cap lifted


def test_quick_runs_the_attention_train_step_and_safety_sections(tmp_path, monkeypatch):
    ran = []
    for name in gpu_check.SECTIONS:
        monkeypatch.setitem(gpu_check.SECTIONS, name, lambda opts, name=name: ran.append(name) or [])
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda: "NVIDIA H100")
    gpu_check.main(["--quick", "--out", str(tmp_path / "report.json")])
    assert ran == list(gpu_check.QUICK_SECTIONS)
    report = json.loads((tmp_path / "report.json").read_text())
    assert {s["reason"] for s in report["sections"] if s["name"] not in ran} == {"not part of --quick"}
