"""Faults a cluster job meets, on real spawned ranks of `megatron-dhp train`: a scheduler's SIGTERM (save
at the step boundary, exit 143, resume to the uninterrupted losses), a rank killed or frozen (named), and
a launcher killed outright (no rank outlives it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_dhp.launch.parent import alive, children, wait_until
from megatron_dhp.launch.ranks import free_port
from megatron_dhp.training.save_lock import LOCK_NAME
from megatron_dhp.training.train import train
from tests.test_cli import run_cli
from tests.training import workers

STEPS = 12


def config_file(tmp_path: Path, name: str, **run: object) -> Path:
    """The tiny two-rank job as a YAML file, closed loop off (bitwise-equal resumption), saving every step."""
    config = workers.tiny_config().with_overrides(train={"steps": STEPS, **run}, dhp={"adaptive": False})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def start(config: Path, *flags: str) -> subprocess.Popen:
    """`megatron-dhp train` in its own session (the test's signals go where it sends them)."""
    return subprocess.Popen([sys.executable, "-m", "megatron_dhp", "train", "--config", str(config), "--quiet", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def train_here(capfd, config: Path, *flags: str) -> tuple[int, str, str]:
    """`megatron-dhp train` run in this process: the same command, its ranks forked from the tests' fork server
    (a second to start; a process of its own spends ten importing). For what needs no process of its own."""
    capfd.readouterr()  # this command's output only
    return run_cli(["train", "--config", config, "--quiet", *flags], capfd)


def wait_for(condition, timeout_s: float = 180.0) -> None:
    """Until `condition` holds; `timeout_s` only guards against a hang (no test measures how long it took)."""
    assert wait_until(condition, timeout_s), "timed out waiting"


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, str]:
    """The job's exit code and output once it ends; `timeout_s` only guards against a hang."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the job did not end within {timeout_s} s")
    return proc.returncode, out, err


pytestmark = [pytest.mark.slow,  # trains on ranks, some through train_here
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from Linux /proc")]


def uninterrupted_losses() -> list[float]:
    return [r.loss for r in train(workers.tiny_config().with_overrides(train={"steps": STEPS}, dhp={"adaptive": False}),
                                  show=False).records]


def test_sigterm_saves_at_the_step_boundary_exits_143_and_resumes_to_the_same_losses(tmp_path, capfd):
    save = tmp_path / "ckpt"
    # injected slots (4x on rank 1) make the steps slow enough to signal mid-run; results do not change
    slow = config_file(tmp_path, "slow", save=str(save), save_interval=1)
    proc = start(slow, "--slow-rank", "1:4.0")
    wait_for(lambda: (save / "latest").is_file())
    ranks = children(proc.pid)
    assert len(ranks) == 2
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 90)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step" in out
    stopped_at = int((save / "latest").read_text().strip().removeprefix("step_"))
    assert 1 <= stopped_at < STEPS and (save / f"step_{stopped_at:06d}" / "meta.json").is_file()
    wait_for(lambda: not any(alive(r) for r in ranks))

    resumed = tmp_path / "resumed.json"
    code, out, err = train_here(capfd, slow, "--load", str(save), "--json", str(resumed))
    assert code == 0, err
    records = json.loads(resumed.read_text())["result"]["records"]
    assert records[0]["step"] == stopped_at + 1 and records[-1]["step"] == STEPS
    assert [r["loss"] for r in records] == uninterrupted_losses()[stopped_at:]


def test_sigterm_during_start_up_exits_143_in_one_line(tmp_path):
    # The ranks are still importing when SIGTERM comes: they die of it before they can stop at a step boundary.
    # It exited 2 ("rank 0 was killed by SIGTERM"), which a scheduler requeueing on 143 takes for a failure.
    proc = start(config_file(tmp_path, "job"))
    wait_for(lambda: len(children(proc.pid)) == 2)
    ranks = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 90)
    assert code == 128 + signal.SIGTERM, (out, err)
    assert [line for line in err.splitlines() if line.strip()] == [
        "megatron-dhp train: stopped by SIGTERM before a step boundary (the ranks were starting): nothing saved"]
    wait_for(lambda: not any(alive(r) for r in ranks))


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_frozen_rank_is_named_and_the_job_ends(tmp_path, fault):
    save = tmp_path / "ckpt"
    # a frozen rank is found when its peers' collectives time out: train.timeout_s bounds the wait
    proc = start(config_file(tmp_path, "job", save=str(save), save_interval=1, timeout_s=10), "--slow-rank", "1:4.0")
    wait_for(lambda: (save / "latest").is_file())
    ranks = children(proc.pid)
    os.kill(ranks[1], getattr(signal, fault))
    code, out, err = finish(proc, 90)
    assert code == 2, err
    expected = "rank 1 was killed by SIGKILL" if fault == "SIGKILL" else "rank 1 stopped responding (its process is stopped"
    assert expected in err, err
    assert len(err.strip().splitlines()) <= 4, err  # the survivors' tracebacks are one line each
    wait_for(lambda: not any(alive(r) for r in ranks))


def test_sigint_to_the_launcher_alone_reaches_the_ranks_and_releases_the_save_folder(tmp_path):
    # The launcher killed its ranks at once: rank 0 never removed DIR/.lock (harmless since the lock is a
    # flock, but the docs say it goes), and a SIGINT sent to the launcher alone never reached the ranks.
    save = tmp_path / "ckpt"
    proc = start(config_file(tmp_path, "job", save=str(save), save_interval=1), "--slow-rank", "1:4.0")
    wait_for(lambda: (save / "latest").is_file())
    ranks = children(proc.pid)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc, 60)
    assert code == 130 and [line for line in err.splitlines() if line.strip()] == ["megatron-dhp train: interrupted"]
    assert not (save / LOCK_NAME).exists()
    wait_for(lambda: not any(alive(r) for r in ranks))


def test_no_rank_outlives_a_launcher_killed_outright(tmp_path):
    save = tmp_path / "ckpt"
    proc = start(config_file(tmp_path, "job", save=str(save), save_interval=1), "--slow-rank", "1:4.0")
    wait_for(lambda: (save / "latest").is_file())
    ranks = children(proc.pid)
    proc.kill()
    proc.communicate()
    wait_for(lambda: not any(alive(r) for r in ranks))


def test_no_rank_outlives_a_launcher_killed_while_its_ranks_start(tmp_path):
    # Killed before its ranks have imported torch: they watched their parent only after those imports, by
    # which time it was already gone, and trained the whole job as orphans.
    proc = start(config_file(tmp_path, "job", steps=100_000))
    wait_for(lambda: len(children(proc.pid)) == 2)
    ranks = children(proc.pid)
    time.sleep(1.0)  # they have their start-up data and are importing (seconds)
    proc.kill()
    proc.wait()  # not its output: an orphan would hold the pipes open
    try:
        assert wait_until(lambda: not any(alive(r) for r in ranks), 30), "a rank outlived its launcher"
    finally:
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)
        proc.communicate()


def test_a_resumed_run_follows_its_configs_schedule_and_says_what_changed(tmp_path, capfd):
    # megatron-core took lr, min_lr, warm-up and the step count from the checkpoint: a lowered train.lr (what
    # the non-finite stop advises) was silently ignored, and --json recorded the value that was not used.
    save = tmp_path / "ckpt"
    base = workers.tiny_config().with_overrides(train={"steps": 4}, dhp={"adaptive": False})
    train(base.with_overrides(train={"save": str(save), "save_interval": 4}), show=False)
    changed = {"steps": 8, "lr": 5e-3, "min_lr": 1e-4, "warmup_steps": 3}
    capfd.readouterr()
    resumed = train(base.with_overrides(train={**changed, "load": str(save)}), show=True, lines=False).records
    assert ("resumed on this config's schedule, not the checkpoint's: train.lr 0.01 -> 0.005, train.min_lr 0.001 "
            "-> 0.0001, train.warmup_steps 2 -> 3, train.steps 4 -> 8") in capfd.readouterr().out
    fresh = train(base.with_overrides(train=changed), show=False).records
    assert [r.step for r in resumed] == [5, 6, 7, 8]
    assert [r.lr for r in resumed] == [r.lr for r in fresh[4:]]


def test_a_torchrun_restart_resumes_with_load_auto_to_the_same_losses(tmp_path):
    # one command line for the first start and the restart: --load auto starts fresh, then resumes
    save, out = tmp_path / "ckpt", tmp_path / "out.json"
    config = config_file(tmp_path, "job", save=str(save), save_interval=1, load="auto")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                             "--master-port", str(free_port()),
                             "--monitor-interval", "1", "-m", "megatron_dhp", "train", "--config", str(config), "--quiet",
                             "--slow-rank", "1:20.0", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: (save / "latest").is_file())
    first = children(proc.pid, "megatron_dhp")
    assert len(first) == 2
    os.kill(first[1], signal.SIGKILL)
    code, _, err = finish(proc, 240)
    assert code == 0, err[-3000:]
    records = json.loads(out.read_text())["result"]["records"]
    resumed_at = records[0]["step"] - 1
    assert 1 <= resumed_at < STEPS and records[-1]["step"] == STEPS
    assert [r["loss"] for r in records] == uninterrupted_losses()[resumed_at:]


def test_a_half_written_checkpoint_is_named_when_loaded(tmp_path, capfd):
    # the start-up sweep of such folders, and what it keeps, is in test_checkpoint_hygiene.py
    save = tmp_path / "ckpt"
    (save / "step_000005").mkdir(parents=True)
    (save / "step_000005" / "rank0.pt.tmp").write_bytes(b"")  # a save cut off by a kill
    code, _, err = train_here(capfd, config_file(tmp_path, "job"), "--load", str(save / "step_000005"))
    assert code == 2 and "is incomplete (no meta.json: its save was interrupted)" in err, err


def test_load_auto_needs_a_save_folder():
    from megatron_dhp.errors import DhpError

    with pytest.raises(DhpError, match="train.load = auto resumes from train.save"):
        workers.tiny_config().with_overrides(train={"load": "auto"})
