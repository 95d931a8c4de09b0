"""A diverged run, on real ranks of `megatron-dhp train`: a NaN or infinite loss or gradient stops the step
before the optimizer applies it (exit 2, one line naming the step, `latest` unchanged), or, with
`--on-nonfinite skip`, drops the update and goes on with finite weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.training.test_faults import config_file, train_here

pytestmark = pytest.mark.slow  # trains on ranks (train_here)

DIVERGING = {"lr": 1e20, "min_lr": 0.0, "warmup_steps": 1}
"""A learning rate whose first update leaves weights that overflow at step 2's forward."""


def finite_checkpoint(folder) -> bool:
    """Every tensor of every rank file in `folder` is finite."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for value in obj.values():
                yield from tensors(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                yield from tensors(value)

    states = [torch.load(f, weights_only=True) for f in sorted(folder.glob("rank*.pt"))]
    return bool(states) and all(t.isfinite().all() for s in states for t in tensors(s["model"]) if t.is_floating_point())


def test_a_diverged_step_stops_the_run_before_the_update_and_saves_nothing(tmp_path, capfd):
    # --json was not written when a run stopped with an error: the records of the steps that ran were lost.
    save, report = tmp_path / "ckpt", tmp_path / "run.json"
    config = config_file(tmp_path, "job", steps=4, save=str(save), save_interval=1, **DIVERGING)
    code, out, err = train_here(capfd, config, "--json", str(report))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("megatron-dhp train: error: step 2: non-finite loss"), err
    assert "--on-nonfinite skip" in lines[0] and "train.lr = 1e+20" in lines[0]
    assert (save / "latest").read_text() == "step_000001" and not (save / "step_000002").exists()
    assert finite_checkpoint(save / "step_000001")
    written = json.loads(report.read_text())
    assert [r["step"] for r in written["result"]["records"]] == [1] and written["error"] == lines[0].split(": error: ")[1]
    assert f"wrote {report} (1 step before the error)" in out


def test_skip_drops_every_non_finite_update_and_keeps_the_weights_finite(tmp_path, capfd):
    # A run that ends on a skipped step exits 1 with one line (it exited 0, as if it had trained).
    save, report = tmp_path / "ckpt", tmp_path / "run.json"
    config = config_file(tmp_path, "job", steps=4, save=str(save), **DIVERGING)
    code, out, err = train_here(capfd, config, "--on-nonfinite", "skip", "--json", str(report))
    assert code == 1, err
    assert [line for line in err.splitlines() if line.strip()] == [
        "megatron-dhp train: the run ended on step 4, skipped (non-finite loss and gradients); its update was "
        "dropped. Lower train.lr"]
    records = json.loads(report.read_text())["result"]["records"]
    assert [r["skipped"] for r in records] == ["", "loss and gradients", "loss and gradients", "loss and gradients"]
    assert (save / "latest").read_text() == "step_000004" and finite_checkpoint(save / "step_000004")
    assert "3 steps skipped (non-finite loss or gradients): 2, 3, 4" in out


def test_skipping_gives_up_after_max_skipped_steps_in_a_row(tmp_path, capfd):
    # `skip` never gave up: a run whose every later step is non-finite skipped them all and exited 0.
    save = tmp_path / "ckpt"
    config = config_file(tmp_path, "job", steps=4, save=str(save), save_interval=1, max_skipped_steps=1, **DIVERGING)
    code, out, err = train_here(capfd, config, "--on-nonfinite", "skip")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("megatron-dhp train: error: steps 2-3: non-finite loss and gradients "
                                                   "in 2 steps in a row, more than train.max_skipped_steps = 1"), err
    assert (save / "latest").read_text() == "step_000002"  # step 3 is not saved
