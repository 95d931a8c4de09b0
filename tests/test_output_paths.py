"""Every path a command writes is checked before the command plans or spawns: one line, exit status 2, and no
work lost at the end of a run to a path that could never be written."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_dhp.cli import main
from megatron_dhp.errors import DhpError
from megatron_dhp.files import check_writable


def _no_spawn(*args, **kwargs):
    raise AssertionError("ranks were spawned")


@pytest.fixture
def a_file(tmp_path):
    """A regular file: a path under it cannot be written, even by root."""
    path = tmp_path / "a_file"
    path.write_text("")
    return path


def test_a_path_under_a_regular_file_is_refused(a_file):
    with pytest.raises(DhpError) as info:
        check_writable(a_file / "sub" / "out.json", flag="--out")
    assert str(info.value) == (f"--out {str(a_file / 'sub' / 'out.json')!r} lies under {str(a_file)!r}, which is a "
                               "file, not a folder; name a path in a writable folder")


def test_a_folder_is_refused_where_a_file_is_due_and_the_other_way_round(tmp_path, a_file):
    pytest.raises(DhpError, check_writable, tmp_path, flag="--json").match("is a folder; name a file to write")
    pytest.raises(DhpError, check_writable, a_file, flag="--out", folder=True).match(
        "is a file, not a folder; name a folder to write into")


def test_a_writable_path_passes_and_its_folders_are_made(tmp_path, a_file):
    assert check_writable(a_file, flag="--out") == a_file  # an existing file is overwritten
    check_writable(tmp_path / "new" / "deeper" / "plan.json", flag="--out")
    assert (tmp_path / "new" / "deeper").is_dir() and not (tmp_path / "new" / "deeper" / "plan.json").exists()
    assert check_writable(tmp_path / "demo_out", flag="--out", folder=True).is_dir()


@pytest.mark.parametrize("args, flag", [
    (["train", "--nproc", "2", "--json", "{bad}"], "--json"),
    (["plan", "--dist", "wlbllm", "--global-batch", "8", "--out", "{bad}"], "--out"),
    (["simulate", "--batches", "1", "--json", "{bad}"], "--json"),
    (["simulate", "--batches", "1", "--plot", "{bad}"], "--plot"),
    (["demo", "--nproc", "2", "--out", "{bad}"], "--out"),
    (["profile", "--nproc", "2", "--out", "{bad}"], "--out"),
    (["profile", "--nproc", "2", "--tp", "2", "--tp-from", "x.yaml", "--tp-out", "{bad}"], "--tp-out"),
], ids=["train --json", "plan --out", "simulate --json", "simulate --plot", "demo --out", "profile --out",
        "profile --tp-out"])
def test_every_command_checks_its_output_paths_before_any_work(a_file, monkeypatch, capsys, args, flag):
    monkeypatch.setattr("megatron_dhp.launch.ranks.launch", _no_spawn)
    bad = a_file / "out"
    code = main([a.format(bad=bad) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"megatron-dhp {args[0]}: error: {flag} {str(bad)!r} lies under {str(a_file)!r}, "
                                 "which is a file, not a folder; name a path in a writable folder\n")


def test_an_unwritable_plan_path_fails_the_real_command_before_it_plans(a_file):
    bad = a_file / "plan.json"
    result = subprocess.run([sys.executable, "-m", "megatron_dhp", "plan", "--dist", "wlbllm", "--global-batch", "512",
                             "--out", str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and result.stderr == (
        f"megatron-dhp plan: error: --out {str(bad)!r} lies under {str(a_file)!r}, which is a file, not a folder; "
        "name a path in a writable folder\n")
