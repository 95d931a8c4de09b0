"""`megatron-dhp doctor`: what this machine would run, without a job; a non-zero exit where a job would be
refused."""

from __future__ import annotations

import importlib.metadata

from megatron_dhp.cli import doctor_cmd, main
from megatron_dhp.runtime.distributed import GPU_ENVIRONMENT


def test_this_machine_has_no_problem_and_every_question_has_a_line(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for topic in ("torch", "megatron-core", "TransformerEngine", "flash-attn", "attention on this CPU", "copy kernels",
                  "environment"):
        assert f"] {topic}: " in out, topic
    assert "bfloat16 -> sdpa; float32 -> sdpa" in out  # the CPU's auto, under every comm variant
    assert all(f"{name}={value}" in out for name, value in GPU_ENVIRONMENT.items())
    assert out.strip().splitlines()[-1] == "megatron-dhp doctor: 0 problems"


def test_a_megatron_core_too_old_is_a_problem_named_with_its_fix(monkeypatch, capsys):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.15.2" if name == "megatron-core" else real(name))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] megatron-core: 0.15.2 is older than 0.16.1" in out and "pip install 'megatron-core>=0.16.1'" in out
    assert out.strip().endswith("1 problem (megatron-core)")


def test_a_folder_that_is_no_megatron_lm_checkout_is_a_problem(tmp_path, capsys):
    assert main(["doctor", "--megatron-lm", str(tmp_path)]) == 1
    assert "[FAIL] Megatron-LM:" in capsys.readouterr().out


def test_a_checkout_without_hooks_says_how_to_add_them(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    (tmp_path / "pretrain_gpt.py").write_text("")
    finding = doctor_cmd._checkout(str(tmp_path))
    assert finding.level == doctor_cmd.NOTE and "apply-patches --megatron-lm" in finding.text


def test_copy_kernels_switched_off_say_so(monkeypatch):
    monkeypatch.setenv("MEGATRON_DHP_CSRC", "0")
    assert doctor_cmd._copy_kernels(False).text == "torch (MEGATRON_DHP_CSRC=0)"
