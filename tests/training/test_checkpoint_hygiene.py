"""The `--save` folder of `megatron-dhp train` on real spawned ranks: one run at a time, only provable debris
swept, another run's checkpoints refused unless `--overwrite`, `--load auto` past an unreadable checkpoint,
retention, and one line for an unwritable folder, a full disk and malformed metadata.

The runs are few and short (CI runs every test on 2 cores): one pair of runs started at once makes the
folder that the other tests copy and damage."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from megatron_dhp.training.checkpoint import CheckpointMeta, UnloadableCheckpoint
from megatron_dhp.training.save_lock import LOCK_NAME, LockRecord
from tests.training.test_faults import config_file, finish, start, train_here

STEPS = 4
KEEP = 2

pytestmark = [pytest.mark.slow,  # trains on ranks, some through train_here
              pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="tells live runs from gone ones by /proc")]


def assert_loadable(folder: Path) -> None:
    """What loading checks of every rank's file, without ranks: size and sha256 as meta.json says, and a
    weights-only load of the step it names."""
    meta = json.loads((folder / "meta.json").read_text())
    assert sorted(meta["files"]) == ["rank0.pt", "rank1.pt"]
    for name, expected in meta["files"].items():
        data = (folder / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (expected["bytes"], expected["sha256"])
        assert torch.load(folder / name, weights_only=True)["step"] == meta["step"]


def one_line_error(code: int, out: str, err: str) -> str:
    """The error of a run refused before its first step: exit 2, one line on stderr, no step trained."""
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "dhp on 2 ranks" not in out, out  # the run's summary: it trained
    return err


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """Two identical `--load auto` runs started at once into one folder holding what two interrupted saves
    left, step_000007 with complete rank files but no meta.json and step_000008 with only a temporary file,
    and the lock file of a run stopped by Ctrl-C (naming a process that still lives: this one)."""
    root = tmp_path_factory.mktemp("pair")
    save = root / "ckpt"
    save.mkdir()
    (save / LOCK_NAME).write_text(json.dumps(asdict(LockRecord.of_this_process())))
    (save / "step_000007").mkdir()
    for rank in range(2):
        torch.save({"step": 7, "rank": rank}, save / "step_000007" / f"rank{rank}.pt")
    (save / "step_000008").mkdir()
    (save / "step_000008" / "rank1.pt.tmp").write_bytes(b"\x00" * 100)
    config = config_file(root, "pair", steps=STEPS, save=str(save), save_interval=1, load="auto", keep_checkpoints=KEEP)
    # a slowed rank (sleeps) holds the winner's lock for seconds, so the other run meets it whichever starts first
    procs = [start(config, "--slow-rank", "1:30.0") for _ in range(2)]
    return {"save": save, "runs": [finish(p, 240) for p in procs]}


def winner(pair: dict) -> str:
    done = [out for code, out, _ in pair["runs"] if code == 0]
    assert len(done) == 1, pair["runs"]
    return done[0]


def test_two_runs_at_once_one_is_refused_by_the_lock_the_other_saves_checkpoints_that_load(pair):
    refused = [run for run in pair["runs"] if run[0] != 0]
    assert len(refused) == 1, pair["runs"]
    code, out, err = refused[0]
    assert f"--save {pair['save']} is in use by the run of pid" in one_line_error(code, out, err)
    assert "wait for it, or pass another --save" in err
    assert f"steps 1-{STEPS}" in winner(pair)
    # the file another run left is no lock: nobody holds it (it refused every restart while its pid lived)
    assert f"took over {pair['save'] / LOCK_NAME} from the run of pid {os.getpid()} on " in winner(pair)
    save = pair["save"]
    assert (save / "latest").read_text() == f"step_{STEPS:06d}" and not (save / LOCK_NAME).exists()
    assert_loadable(save / f"step_{STEPS:06d}")


def test_a_run_holding_the_lock_is_seen_whatever_its_pid_means_here(tmp_path, capfd):
    # A run in another PID namespace on this host name (containers with the host's network): its pid is no
    # process here, and the lock was taken over as stale while that run trained into the folder.
    save = tmp_path / "ckpt"
    save.mkdir()
    lock = save / LOCK_NAME
    lock.write_text(json.dumps(asdict(replace(LockRecord.of_this_process(), pid=2**22 + 1))))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        code, out, err = train_here(capfd, config_file(tmp_path, "job", steps=STEPS, save=str(save)))
    assert f"--save {save} is in use by the run of pid {2**22 + 1} on host " in one_line_error(code, out, err)
    assert lock.is_file()  # still the other run's


def test_the_sweep_keeps_complete_rank_files_without_metadata_and_removes_a_temporary_file(pair):
    out, save = winner(pair), pair["save"]
    assert (f"kept step_000007 in {save}: 2 complete rank files but no meta.json (a save cut off before its "
            "metadata); move it away or delete it if unwanted") in out
    assert f"removed step_000008 from {save}: an interrupted save" in out
    assert "load: auto found no checkpoint" in out  # neither is a checkpoint to resume from
    assert (save / "step_000007" / "rank1.pt").is_file() and not (save / "step_000008").exists()


def test_retention_keeps_the_k_newest_checkpoints(pair):
    winner(pair)
    saved = sorted(f.name for f in pair["save"].glob("step_*") if (f / "meta.json").is_file())
    assert saved == [f"step_{step:06d}" for step in range(STEPS - KEEP + 1, STEPS + 1)]


def copy_of(pair: dict, folder: Path) -> Path:
    """A copy of the folder the pair's finished run saved into."""
    winner(pair)
    return Path(shutil.copytree(pair["save"], folder))


def test_a_fresh_run_into_another_runs_checkpoints_is_refused(pair, tmp_path, capfd):
    save = copy_of(pair, tmp_path / "ckpt")
    err = one_line_error(*train_here(capfd, config_file(tmp_path, "fresh", steps=3, save=str(save), save_interval=1)))
    assert (f"--save {save} holds checkpoints of another run (latest step_{STEPS:06d}); resume with --load auto, "
            "or pass --overwrite to replace them, or another --save") in err
    assert (save / "latest").read_text() == f"step_{STEPS:06d}"  # untouched


def test_rolling_back_to_an_earlier_checkpoint_of_the_folder_needs_overwrite(pair, tmp_path, capfd):
    save = copy_of(pair, tmp_path / "ckpt")
    config = config_file(tmp_path, "rollback", steps=STEPS, save=str(save), save_interval=1)
    earlier = save / f"step_{STEPS - 1:06d}"
    err = one_line_error(*train_here(capfd, config, "--load", str(earlier)))
    assert (f"--load {earlier} resumes at step {STEPS - 1}, but --save {save} holds later checkpoints of the run it "
            f"rolls back (step_{STEPS:06d}); pass --overwrite to remove them, or another --save") in err
    code, out, err = train_here(capfd, config, "--load", str(earlier), "--overwrite")
    assert code == 0, err
    assert f"removed 1 later checkpoint than step_{STEPS - 1:06d} from {save}: --overwrite" in out
    assert (save / "latest").read_text() == f"step_{STEPS:06d}"
    assert_loadable(save / f"step_{STEPS:06d}")


def test_latest_naming_anything_but_a_later_step_folder_of_the_save_folder_is_refused(pair, tmp_path, capfd):
    # It was followed: `../` or an absolute path resumed from another folder's checkpoint, and an earlier step
    # resumed there and saved over the later checkpoints of the run it rolled back, which no guard saw.
    save = copy_of(pair, tmp_path / "ckpt")
    config = config_file(tmp_path, "job", steps=STEPS + 1, save=str(save), save_interval=1, load="auto")
    for elsewhere in ("../other/step_000004", str(pair["save"] / f"step_{STEPS:06d}")):
        (save / "latest").write_text(elsewhere)
        err = one_line_error(*train_here(capfd, config))
        assert f"{save / 'latest'} names '{elsewhere[:8]}" in err  # an excerpt of a long one
        assert f", not a step folder of {save} (step_ and a number)" in err
    (save / "latest").write_text(f"step_{STEPS - 1:06d}")
    err = one_line_error(*train_here(capfd, config))
    assert (f"{save / 'latest'} names step_{STEPS - 1:06d}, which resumes at step {STEPS - 1}, but --save {save} "
            f"holds later checkpoints of the run it rolls back (step_{STEPS:06d}); pass --overwrite") in err
    assert_loadable(save / f"step_{STEPS:06d}")  # untouched


def test_the_start_up_sweep_and_retention_never_reach_through_a_link(pair, tmp_path, capfd):
    # A step folder linked to another folder: the sweep deleted a temporary file there, then stopped with a
    # traceback.
    save, outside = copy_of(pair, tmp_path / "ckpt"), tmp_path / "outside"
    outside.mkdir()
    (outside / "rank0.pt.tmp").write_bytes(b"not ours")
    (save / "step_000009").symlink_to(outside)
    config = config_file(tmp_path, "job", steps=STEPS + KEEP, save=str(save), save_interval=1, load="auto")
    code, out, err = train_here(capfd, config)
    assert code == 0, err
    assert f"left step_000009 in {save} alone: a link, which no save writes" in out
    assert (outside / "rank0.pt.tmp").read_bytes() == b"not ours" and (save / "step_000009").is_symlink()
    assert (save / "latest").read_text() == f"step_{STEPS + KEEP:06d}"


def test_a_file_named_like_a_step_folder_is_refused_in_one_line(tmp_path, capfd):
    # It stopped the run with a traceback at the save of that step.
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "step_000002").write_text("notes")
    err = one_line_error(*train_here(capfd, config_file(tmp_path, "job", steps=3, save=str(save), save_interval=1)))
    assert f"--save {save} holds a file named like a step folder (step_000002)" in err
    assert (save / "step_000002").read_text() == "notes"


@pytest.fixture
def resumed(pair, tmp_path, capfd) -> dict:
    """Two runs from step STEPS - 1 of the pair's run to STEPS + 1: `--load auto` in a copy of its folder whose
    newest checkpoint is truncated, and by hand (`--load DIR/step_...`) into another copy with `--overwrite`.
    (Per test: two runs in this process take seconds, one in a process of its own takes twenty.)"""
    root = tmp_path
    auto, by_hand = (copy_of(pair, root / name) for name in ("auto", "by_hand"))
    newest = auto / f"step_{STEPS:06d}" / "rank1.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    runs = {"auto": train_here(capfd, config_file(root, "auto", steps=STEPS + 1, save=str(auto), save_interval=1,
                                                  load="auto"), "--json", str(root / "auto.json")),
            "by_hand": train_here(capfd, config_file(root, "by_hand", steps=STEPS + 1, save=str(by_hand), save_interval=1),
                                  "--load", str(pair["save"] / f"step_{STEPS - 1:06d}"), "--overwrite",
                                  "--json", str(root / "by_hand.json"))}
    for code, _, err in runs.values():
        assert code == 0, err
    losses = {name: [(r["step"], r["loss"]) for r in json.loads((root / f"{name}.json").read_text())["result"]["records"]]
              for name in runs}
    return {"auto": auto, "by_hand": by_hand, "out": {name: out for name, (_, out, _) in runs.items()}, "losses": losses}


def test_load_auto_falls_back_past_an_unreadable_newest_checkpoint(resumed):
    save, newest = resumed["auto"], f"step_{STEPS:06d}"
    assert (f"{newest} cannot be loaded (rank 1: checkpoint file '{save / newest / 'rank1.pt'}' is corrupt or "
            f"truncated") in resumed["out"]["auto"]
    assert f"resumed from step_{STEPS - 1:06d}" in resumed["out"]["auto"]
    assert resumed["losses"]["auto"] == resumed["losses"]["by_hand"]  # as resumed from that folder by hand
    assert [step for step, _ in resumed["losses"]["auto"]] == [STEPS, STEPS + 1]


def test_overwrite_replaces_another_runs_checkpoints(resumed):
    save = resumed["by_hand"]
    assert f"removed 3 step folders ({KEEP} checkpoints) and latest of another run from {save}" in resumed["out"]["by_hand"]
    assert sorted(f.name for f in save.glob("step_*")) == [f"step_{STEPS:06d}", f"step_{STEPS + 1:06d}"]
    assert (save / "latest").read_text() == f"step_{STEPS + 1:06d}"


def test_an_unwritable_save_folder_is_refused_before_the_first_step(tmp_path, capfd):
    (tmp_path / "a_file").write_text("")
    save = tmp_path / "a_file" / "ckpt"  # root writes anywhere, but not under a regular file
    err = one_line_error(*train_here(capfd, config_file(tmp_path, "job", steps=3, save=str(save), save_interval=1)))
    assert f"--save {save} cannot be written (" in err and "pass a folder this user can write" in err


def test_malformed_metadata_is_named_in_one_line(pair, tmp_path, capfd):
    save = copy_of(pair, tmp_path / "ckpt")
    meta_path = save / f"step_{STEPS:06d}" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["rank1.pt"]["bytes"] = "x"  # every rank reads it: the metadata is at fault, not rank 1
    meta_path.write_text(json.dumps(meta))
    err = one_line_error(*train_here(capfd, config_file(tmp_path, "job", steps=STEPS + 1), "--load", str(save)))
    assert f"checkpoint metadata '{meta_path}' is unreadable (files['rank1.pt'] = " in err
    assert "cannot load" not in err
    for field, value, named in [("step", "abc", "step 'abc' is not a step count"),
                                ("files", ["rank0.pt"], "files is a JSON list, not an object of rank files")]:
        meta_path.write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ValueError, match=f"is unreadable \\({named}\\)"):
            CheckpointMeta.read(meta_path)
    with open(meta_path, "r+b") as f:  # a meta.json far larger than any checkpoint writes is never read whole
        f.truncate(17 * 2**20)
    with pytest.raises(UnloadableCheckpoint, match=r"is 17\.0 MB, over the 16 MB a checkpoint metadata may hold"):
        CheckpointMeta.read(meta_path)
    meta_path.write_bytes(b"\xff{}")
    with pytest.raises(UnloadableCheckpoint, match=r"is not UTF-8 text \(byte 0xff at offset 0\)"):
        CheckpointMeta.read(meta_path)


def test_a_lock_file_is_read_only_as_far_as_a_lock_record_goes(tmp_path):
    lock = tmp_path / LOCK_NAME
    record = LockRecord.of_this_process()
    lock.write_text(json.dumps(asdict(record)))
    assert LockRecord.read(lock) == record
    lock.write_text(json.dumps(asdict(record)) + " " * 5000)
    with pytest.raises(ValueError, match="holds more than 4096 characters, not a lock record"):
        LockRecord.read(lock)


def test_a_full_disk_stops_every_rank_in_one_line_and_keeps_the_last_checkpoint(pair, tmp_path):
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (unshare --user --mount is not permitted)")
    winner(pair)
    checkpoint = sum(f.stat().st_size for f in pair["save"].glob(f"step_{STEPS:06d}/rank*.pt"))
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    config = config_file(tmp_path, "job", steps=3, save=str(disk / "ckpt"), save_interval=1)
    command = [sys.executable, "-m", "megatron_dhp", "train", "--config", str(config), "--quiet"]
    # room for one checkpoint and a half: the second save runs out of space; copy the folder out of the mount
    script = (f'mount -t tmpfs -o size={checkpoint * 3 // 2 // 1024}k tmpfs "{disk}" && {{ "$@"; code=$?; '
              f'cp -r "{disk / "ckpt"}" "{kept}"; exit $code; }}')
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *command],
                          capture_output=True, text=True, timeout=180)
    err = proc.stderr
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no space left on device writing {disk / 'ckpt' / 'step_000002'} (rank " in err
    assert "free space or point --save at another disk; latest still names step_000001" in err
    assert (kept / "latest").read_text() == "step_000001" and not list(kept.rglob("*.tmp"))
    assert_loadable(kept / "step_000001")
