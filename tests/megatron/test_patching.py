"""apply-patches without an upstream checkout: tag detection, refusals and conflicts on small fake trees."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_dhp.cli import main
from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.patching import SUPPORTED_TAGS, apply, detect, patch_file, patched_files


def fake_tree(root: Path, version: tuple[int, int, int]) -> Path:
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version))
    (root / "pretrain_gpt.py").write_text("print('not the upstream file')\n")
    return root


@pytest.mark.parametrize("tag", SUPPORTED_TAGS)
def test_every_supported_tag_has_a_small_patch_of_calls(tag):
    patch = patch_file(tag)
    text = patch.read_text()
    assert len(text.splitlines()) < 150
    lines = text.splitlines()
    removed = [line for line in lines if line.startswith("-") and not line.startswith("---")]
    assert "pretrain_gpt.py" in patched_files(patch) and "megatron/training/training.py" in patched_files(patch)
    assert len(removed) == 1 and "extra_args_provider" in removed[0]  # the one upstream line replaced
    # every block of added lines is a call into megatron_dhp (guarded by --dhp), nothing else
    blocks, block = [], []
    for line in lines:
        if line.startswith("+") and not line.startswith("+++"):
            block.append(line[1:])
        elif block:
            blocks.append("\n".join(block))
            block = []
    assert blocks and all("dhp" in b for b in blocks), [b for b in blocks if "dhp" not in b]


@pytest.mark.parametrize("version,tag", [((0, 16, 1), "core_v0.16.1"), ((0, 16, 3), "core_v0.16.1"), ((0, 19, 1), "core_v0.19.0")])
def test_tag_from_package_info_series(tmp_path, version, tag):
    checkout = detect(fake_tree(tmp_path, version))
    assert checkout.tag == tag and checkout.found_by == f"package_info {'.'.join(map(str, version))}"


def test_tag_from_git_when_the_checkout_sits_on_one(tmp_path):
    tree = fake_tree(tmp_path, (0, 19, 1))
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tree)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"], ["tag", "core_v0.16.1"]):
        subprocess.run(git + cmd, check=True)
    assert detect(tree).tag == "core_v0.16.1" and detect(tree).found_by == "git tag"


def test_unknown_version_lists_the_supported_tags(tmp_path):
    with pytest.raises(DhpError, match=r"megatron-core 0\.17\.0, which megatron-dhp has no patch for; supported tags: "
                       r"core_v0\.16\.1, core_v0\.19\.0"):
        apply(fake_tree(tmp_path, (0, 17, 0)))


def test_not_a_checkout(tmp_path):
    with pytest.raises(DhpError, match="is not a Megatron-LM checkout"):
        detect(tmp_path)


def test_conflict_names_the_file_and_what_to_do(tmp_path):
    tree = fake_tree(tmp_path, (0, 16, 1))
    with pytest.raises(DhpError, match=r"core_v0\.16\.1\.patch does not apply to .*: gpt_builders\.py is missing; "
                       r"start from a clean checkout of the tag \(git -C .* checkout core_v0\.16\.1 -- gpt_builders\.py\)"):
        apply(tree)
    (tree / "gpt_builders.py").write_text("print('not the upstream file either')\n")
    with pytest.raises(DhpError, match=r"gpt_builders\.py differs from Megatron-LM core_v0\.16\.1"):
        apply(tree)
    assert (tree / "pretrain_gpt.py").read_text() == "print('not the upstream file')\n"  # nothing half-applied


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    assert main(["apply-patches", "--megatron-lm", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dhp apply-patches: error: ") and len(err.strip().splitlines()) == 1
