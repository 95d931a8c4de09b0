"""apply-patches and the launcher without an upstream checkout: hook sites found by their code in small fake
trees shaped like Megatron-LM 0.16 (the layer spec in gpt_builders.py) and 0.19+ (in pretrain_gpt.py's model
config), refusals, conflicts, the diff and the in-memory hooks."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dhp.cli import main
from megatron_dhp.errors import DhpError
from megatron_dhp.megatron import run, sites
from megatron_dhp.megatron.patching import apply, detect, diff

REPO = Path(__file__).resolve().parents[2]

ARGUMENTS = '''
def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse all arguments."""
    import argparse
    parser = argparse.ArgumentParser(allow_abbrev=False)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args([])


def validate_args(args, defaults={}):
    args.validated = True
    return args
'''

TRAINING = '''
def pretrain(args, build):
    timers = Timers()
    if args.virtual_pipeline_model_parallel_size is not None:
        train_data_iterator, valid_data_iterator, test_data_iterator = [], [], []
    else:
        train_data_iterator, valid_data_iterator, test_data_iterator = (
            build(args)
        )
    timers('train/valid/test-data-iterators-setup').stop()
    return train_data_iterator


def train(args):
    forward_backward_func = get_forward_backward_func(
        schedule_pg_collection=None
    )
    return forward_backward_func


def evaluate(args):
    forward_backward_func = get_forward_backward_func()
    return forward_backward_func


def get_forward_backward_func(schedule_pg_collection=None):
    return "upstream schedule"


class Timers:
    def __call__(self, name):
        return self

    def stop(self):
        pass
'''

PRETRAIN_GPT = '''
from megatron.training.arguments import parse_args


def loss_func(output):
    return output


def forward_step(data_iterator, model, return_schedule_plan=False):
    """One microbatch."""
    args = get_args()
    return "upstream forward"
'''

GPT_BUILDERS = '''
def gpt_builder(args, pre_process, post_process):
    if args.spec is not None:
        transformer_layer_spec = args.spec
    else:
        transformer_layer_spec = "local spec"
    model = GPTModel(
        transformer_layer_spec=transformer_layer_spec,
    )
    return model
'''

MAIN_019 = '''

if __name__ == "__main__":
    args = parse_args()
    if args.modelopt:
        model_cfg = gpt_config_from_args(args, model_config_cls=None)
    else:
        model_cfg = gpt_config_from_args(args)
    pretrain(model_cfg)
'''


def fake_tree(root: Path, version: str = "0.16.1", *, layer_spec_in: str = "gpt_builders") -> Path:
    """A checkout whose site files have the shapes (not the bulk) of Megatron-LM's."""
    files = {
        "megatron/core/package_info.py": "MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version.split(".")),
        "megatron/training/arguments.py": ARGUMENTS,
        "megatron/training/training.py": TRAINING,
        "pretrain_gpt.py": PRETRAIN_GPT + (MAIN_019 if layer_spec_in == "pretrain_gpt" else ""),
    }
    if layer_spec_in == "gpt_builders":
        files["gpt_builders.py"] = GPT_BUILDERS
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


def texts(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): p.read_text() for p in sorted(tree.rglob("*.py"))}


@pytest.mark.parametrize("layer_spec_in", ["gpt_builders", "pretrain_gpt"])
def test_every_hook_goes_in_by_its_code_once_and_comes_out_exactly(tmp_path, layer_spec_in):
    tree = fake_tree(tmp_path, layer_spec_in=layer_spec_in)
    before = texts(tree)
    files = [f for f in sites.SITE_FILES if (tree / f).exists()]
    assert apply(tree, check=True).endswith(f"applies cleanly (7 hooks in {len(files)} files: {', '.join(files)})")
    assert texts(tree) == before  # --check writes nothing
    assert "applied (7 hooks" in apply(tree)
    after = texts(tree)
    assert "hooks already in place, nothing to do" in apply(tree) and texts(tree) == after
    hooked = [name for text in after.values() for name in sites.applied_sites(text)]
    assert sorted(hooked) == sorted(s.name for s in sites.SITES)  # each site exactly once
    for path, text in after.items():
        compile(text, path, "exec")
        # each hook is one block that imports its call from megatron_dhp.megatron, nothing else changes
        assert text.count("from megatron_dhp.megatron import ") == len(sites.applied_sites(text))
        assert sites.remove(text, path) == before[path]
    assert "reverted (7 hooks" in apply(tree, revert=True)
    assert texts(tree) == before
    assert "nothing to revert" in apply(tree, revert=True)


def test_hooked_code_calls_megatron_dhp_only_under_dhp(tmp_path):
    """The inserted blocks run: the training loop's schedule is megatron-dhp's with --dhp and upstream's
    without, the flags parse, and validation reaches megatron-dhp's."""
    import megatron_dhp.megatron as dhp

    tree = fake_tree(tmp_path)
    apply(tree)
    training: dict = {}
    exec(compile((tree / "megatron/training/training.py").read_text(), "training.py", "exec"), training)
    assert training["train"](argparse.Namespace(dhp=True)) is dhp.dhp_forward_backward
    assert training["evaluate"](argparse.Namespace(dhp=True)) is dhp.dhp_forward_backward
    assert training["train"](argparse.Namespace(dhp=False)) == "upstream schedule"
    arguments: dict = {}
    exec(compile((tree / "megatron/training/arguments.py").read_text(), "arguments.py", "exec"), arguments)
    args = arguments["parse_args"]()
    assert args.dhp is False and hasattr(args, "dhp_max_tokens_per_rank")  # the --dhp flags were added
    assert arguments["validate_args"](args).validated  # refuse_or_config passes a run without --dhp


def test_a_site_that_moved_is_named_in_one_line_and_nothing_is_written(tmp_path):
    tree = fake_tree(tmp_path)
    training = tree / "megatron/training/training.py"
    training.write_text(training.read_text().replace("timers('train/valid/test-data-iterators-setup').stop()",
                                                     "timers('data-setup').stop()"))
    before = texts(tree)
    with pytest.raises(DhpError, match=r"cannot find where megatron-dhp's 'setup' hook \(groups and planner; the data "
                       r"iterators yield planned steps\) goes: looked for pretrain\(\) in megatron/training/training.py: "
                       r"timers\('train/valid/test-data-iterators-setup'\).stop\(\); this Megatron-LM moved it"):
        apply(tree)
    assert texts(tree) == before


def test_the_layer_spec_site_falls_back_to_gpt_builders_and_names_both_when_neither_is_there(tmp_path):
    tree = fake_tree(tmp_path)
    (tree / "gpt_builders.py").write_text("def gpt_builder(args):\n    return build(args)\n")
    with pytest.raises(DhpError, match=r"'layer_spec' hook .* looked for the if __name__ == \"__main__\" block in "
                       r"pretrain_gpt.py: .*model_cfg = gpt_config_from_args\( or gpt_builder\(\) in gpt_builders.py: "
                       r".*model = GPTModel\("):
        apply(tree, check=True)


def test_partly_hooked_edited_or_old_patch_trees_are_refused_with_the_fix(tmp_path):
    tree = fake_tree(tmp_path)
    apply(tree)
    script = tree / "pretrain_gpt.py"
    hooked = script.read_text()
    script.write_text(sites.remove(hooked, "pretrain_gpt.py"))
    with pytest.raises(DhpError, match=r"has only some of megatron-dhp's hooks \(flags, layer_spec, schedule_evaluate, "
                       r"schedule_train, setup, validate\); run apply-patches --revert, then apply again"):
        apply(tree)
    script.write_text(hooked.replace("return dhp_forward_step(data_iterator, model, loss_func)",
                                     "return dhp_forward_step(data_iterator, model, my_loss)"))
    with pytest.raises(DhpError, match=r"cannot revert megatron-dhp's 'forward_step' hook in pretrain_gpt.py: its lines "
                       r"have changed since it was inserted"):
        apply(tree, revert=True)
    old = fake_tree(tmp_path / "old")
    (old / "pretrain_gpt.py").write_text(PRETRAIN_GPT + "import megatron_dhp.megatron as dhp\n")
    with pytest.raises(DhpError, match=r"pretrain_gpt.py calls megatron_dhp without this version's markers \(an older "
                       r"megatron-dhp patch\?\); restore it"):
        apply(old)


def test_diff_is_a_patch_git_applies_to_the_same_result(tmp_path):
    tree = fake_tree(tmp_path / "a")
    copy = fake_tree(tmp_path / "b")
    patch = tmp_path / "dhp.patch"
    patch.write_text(diff(tree))
    apply(tree)
    subprocess.run(["git", "apply", str(patch)], cwd=copy, check=True, capture_output=True)
    assert texts(copy) == texts(tree)


def test_version_comes_from_package_info_and_unchecked_ones_are_said_so(tmp_path):
    assert detect(fake_tree(tmp_path / "a", "0.18.2")).version == "0.18.2"
    assert "not a checked version" in apply(fake_tree(tmp_path / "b", "0.21.0"), check=True)
    assert "not a checked version" not in apply(fake_tree(tmp_path / "c", "0.17.1"), check=True)


def test_not_a_checkout(tmp_path):
    with pytest.raises(DhpError, match="is not a Megatron-LM checkout"):
        detect(tmp_path)


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    assert main(["apply-patches", "--megatron-lm", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dhp apply-patches: error: ") and len(err.strip().splitlines()) == 1


LAUNCHED = '''
import sys
from types import SimpleNamespace
from megatron.training import training
from megatron.training.arguments import parse_args, validate_args


def loss_func(output):
    return output


def get_args():
    return SimpleNamespace(dhp=True)


def gpt_config_from_args(args):
    return SimpleNamespace(transformer_layer_spec="local spec")


def forward_step(data_iterator, model, return_schedule_plan=False):
    args = get_args()
    return "upstream forward"


if __name__ == "__main__":
    args = validate_args(parse_args())
    model_cfg = gpt_config_from_args(args)
    print("FLAGS", args.dhp, "SCHEDULE", training.train(args), "SPEC", model_cfg.transformer_layer_spec,
          "FORWARD", forward_step(None, None))
'''


def test_the_launcher_hooks_modules_and_script_in_memory_and_leaves_the_files_alone(tmp_path):
    """`python -m megatron_dhp.megatron.run pretrain_gpt.py --dhp`: the site modules imported from the checkout
    carry the hooks, so does the script run as __main__, and no file changes (megatron-dhp's calls stubbed:
    the fake checkout's `megatron` package hides megatron-core)."""
    tree = fake_tree(tmp_path, layer_spec_in="pretrain_gpt")
    for package in ("megatron", "megatron/training"):
        (tree / package / "__init__.py").touch()
    (tree / "pretrain_gpt.py").write_text(LAUNCHED)
    arguments = tree / "megatron/training/arguments.py"
    arguments.write_text(arguments.read_text().replace("parser.parse_args([])", "parser.parse_args(sys.argv[1:])")
                         .replace("import argparse", "import argparse, sys"))
    before = texts(tree)
    code = ("import sys, megatron_dhp.megatron as dhp, megatron_dhp.megatron.run as run\n"
            "dhp.refuse_or_config = lambda args: setattr(args, 'refused_or_configured', True)\n"
            "dhp.dhp_forward_backward = 'dhp schedule'\n"
            "dhp.layer_spec_provider = lambda spec, args: 'dhp spec'\n"
            "dhp.forward_step = lambda *a: 'dhp forward'\n"
            "sys.exit(run.main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, str(tree / "pretrain_gpt.py"), "--dhp"], capture_output=True,
                         text=True, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FLAGS True SCHEDULE dhp schedule SPEC dhp spec FORWARD dhp forward" in out.stdout, out.stdout
    assert texts(tree) == before
    assert not [p for p in tree.rglob("*.pyc") if "__init__" not in p.name]  # no bytecode of hooked sources


def test_the_launcher_refuses_a_moved_site_before_running_anything(tmp_path):
    tree = fake_tree(tmp_path)
    (tree / "megatron/training/training.py").write_text("def pretrain():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "megatron_dhp.megatron.run", str(tree / "pretrain_gpt.py")],
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("megatron-dhp: error: cannot find where megatron-dhp's 'setup'")


def test_the_launcher_names_a_missing_script(tmp_path, capsys):
    # It searched the script's folder for hook sites and named a missing one instead.
    for script in (tmp_path / "pretrain_gpt.py", tmp_path):
        with pytest.raises(SystemExit) as stop:
            run.main([str(script), "--dhp"])
        assert stop.value.code == 2
        assert capsys.readouterr().err == (f"megatron-dhp: error: script {str(script)!r} is not a file; pass the "
                                           "script inside a Megatron-LM checkout, e.g. "
                                           "path/to/Megatron-LM/pretrain_gpt.py\n")


def test_a_file_that_cannot_be_written_leaves_the_tree_as_it_was(tmp_path, monkeypatch):
    # It stopped with a traceback and left three of four files hooked (root ignores file modes, so the failure
    # is injected: the third file's write is refused).
    tree = fake_tree(tmp_path)
    before = texts(tree)
    real, calls = Path.write_text, []

    def refuse_third(self, text, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse_third)
    with pytest.raises(DhpError, match=r"cannot write .*: Permission denied; nothing was changed"):
        apply(tree)
    monkeypatch.setattr(Path, "write_text", real)
    assert texts(tree) == before and not list(tree.rglob(".*.megatron-dhp"))
    apply(tree)  # and once writable, it applies
    assert texts(tree) != before
