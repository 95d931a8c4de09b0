"""`megatron-dhp selftest` as a user runs it: flags checked up front, a real end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dhp.cli import main
from megatron_dhp.runtime.attention import COMM_VARIANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--comm", "ring,bogus"], "--comm 'ring,bogus'"),
        (["--nproc", "3", "--tp", "2"], "--nproc 3 must be a positive multiple of --tp 2"),
        (["--plans", "0"], "--plans 0 must be at least 1"),
    ],
)
def test_bad_flags_fail_before_launching(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["selftest", *args]) == 2
    assert message in capsys.readouterr().err


def test_selftest_runs_two_ranks_end_to_end():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dhp", "selftest", "--nproc", "2", "--plans", "3", "--seed", "1"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(lines) == 3 and all(line.endswith("| ok") for line in lines), proc.stdout
    assert set(COMM_VARIANTS) == {line.split("|")[-6].strip() for line in lines}
    assert "all plans exact" in proc.stdout
