"""Inputs of any size or encoding: every user file is read bounded, as UTF-8 text, its numbers within what a
machine holds, its YAML aliases bounded, and every refusal is one line naming the file and an excerpt of the
value; oversized batches, ranks beyond the cores and injections naming a missing rank are refused before work."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dhp import files
from megatron_dhp.cli import main
from megatron_dhp.closed_loop.injection import check_injected_ranks
from megatron_dhp.config_io import MAX_YAML_NODES, load_yaml_file
from megatron_dhp.cost.config import CostConfig
from megatron_dhp.cost.speeds import load_rank_speeds
from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.launch.ranks import check_oversubscription, usable_cores
from megatron_dhp.plan.plan import Plan
from megatron_dhp.training.config import TrainConfig
from megatron_dhp.workload import batches
from megatron_dhp.workload.batches import MAX_BATCH_SAMPLES, LengthSource
from megatron_dhp.workload.sources import load_samples

KINDS = {  # kind: (file name, what the messages call it, its size bound, the loader)
    "train config": ("train.yaml", "train config", files.CONFIG_BYTES, TrainConfig.load),
    "cost config": ("cost.yaml", "cost config", files.CONFIG_BYTES, CostConfig.load),
    "dhp config": ("dhp.yaml", "dhp config", files.CONFIG_BYTES, DhpConfig.load),
    "plan": ("plan.json", "plan file", files.PLAN_BYTES, Plan.load),
    "rank speeds": ("speeds.json", "rank speeds file", files.SPEEDS_BYTES, load_rank_speeds),
    "lengths .json": ("lengths.json", "length file", files.LENGTHS_BYTES, load_samples),
    "lengths .jsonl": ("lengths.jsonl", "length file", files.LENGTHS_BYTES, load_samples),
}

BOMB = "\n".join([f"l0: &l0 [{', '.join(['1.0'] * 9)}]"]
                 + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]) + "\n"
"""A YAML "billion laughs": 9 ** 9 values from under 1 KB."""


def refusal(call, *args) -> str:
    """The one-line `DhpError` `call(*args)` raises."""
    with pytest.raises(DhpError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def cli(args, capsys) -> str:
    """The one line `megatron-dhp ARGS` prints when it refuses (exit status 2)."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "error: " in err, err
    return err


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("content, match", [
    (b'[1, 2, "caf\xe9"]\n', r"is not UTF-8 text \(byte 0xe9 at offset 11\); save it as UTF-8"),
    (b"\x7fELF\x02\x01\x01\x00\xff\xff", r"is a binary file \(a NUL byte at offset 7\), not UTF-8 text"),
])
def test_a_file_that_is_not_utf8_text_is_one_line_naming_it(tmp_path, kind, content, match):
    name, what, _, load = KINDS[kind]
    path = tmp_path / name
    path.write_bytes(content)
    assert refusal(load, path).startswith(f"{what} {str(path)!r} ")
    assert refusal(load, path) == refusal(load, path)  # the same line every time
    pytest.raises(DhpError, load, path).match(match)


@pytest.mark.parametrize("kind", KINDS)
def test_an_oversized_file_is_refused_from_its_size_before_it_is_read(tmp_path, kind):
    name, what, limit, load = KINDS[kind]
    path = tmp_path / name
    with open(path, "wb") as f:  # sparse: read, it would be NUL bytes, refused as binary instead
        f.truncate(limit + 1)
    message = refusal(load, path)
    assert message.startswith(f"{what} {str(path)!r} is {(limit + 1) / files.MB:,.1f} MB, over the "
                              f"{limit // files.MB} MB a {what} may hold")


def test_a_utf8_file_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_bytes(b"\xef\xbb\xbf[3, 4]")
    assert [s.tokens for s in load_samples(path)] == [3, 4]


def test_a_non_utf8_length_file_is_one_line_from_the_real_command(tmp_path, capsys):
    path = tmp_path / "lengths.json"
    path.write_bytes(b"[1, 2]\xff")
    assert cli(["plan", "--lengths", path, "--out", tmp_path / "plan.json"], capsys) == (
        f"megatron-dhp plan: error: length file {str(path)!r} is not UTF-8 text (byte 0xff at offset 6); save it "
        "as UTF-8\n")


@pytest.mark.parametrize("text, match", [
    ("[1.0, NaN]", "holds NaN, which JSON does not allow"),
    ("[1.0, -Infinity]", "holds -Infinity, which JSON does not allow"),
    ("[1.0, 1e400]", "holds the number '1e400', beyond a 64-bit float's range"),
    (f"[1, {2**63}]", f"holds the integer '{2**63}', beyond the 64-bit range"),
    (f"[1, {'9' * 5000}]", r"holds the integer '9999.*' \(5,000 characters\), beyond the 64-bit range"),
    ("[" * 100_000, "nests its lists or objects too deeply to read"),
], ids=["nan", "infinity", "1e400", "2**63", "5000 digits", "deep"])
@pytest.mark.parametrize("kind", ["rank speeds", "lengths .json", "plan"])
def test_json_numbers_must_fit_a_machine(tmp_path, kind, text, match):
    name, what, _, load = KINDS[kind]
    path = tmp_path / name
    path.write_text(text)
    message = refusal(load, path)
    assert message.startswith(f"{what} {str(path)!r} ") and len(message) < 300
    pytest.raises(DhpError, load, path).match(match)


def test_jsonl_lengths_must_fit_a_machine(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"tokens": 3}\n{"tokens": NaN}\n')
    assert refusal(load_samples, path) == (f"length file {str(path)!r}, line 2 holds NaN, which JSON does not allow; "
                                           "write finite numbers within int64")


def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    """In a process of at most 512 MB and a minute, so that a regression fails rather than eats the machine."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "train: {lr: *l8}\n")
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
        from megatron_dhp.config_io import load_yaml_file
        from megatron_dhp.errors import DhpError
        try:
            load_yaml_file({str(path)!r}, what="train config")
        except DhpError as e:
            print(e)
        print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])  # peak kB since exec
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    message, peak_kb = result.stdout.splitlines()
    assert message == (f"train config {str(path)!r} expands to more than {MAX_YAML_NODES:,} values through its "
                       "anchors and aliases (&name, *name); write the values out, or use fewer aliases")
    assert int(peak_kb) < 200 << 10


def test_a_yaml_alias_bomb_is_one_line_from_the_real_command(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "train: {lr: *l8}\n")

    def at_most_4_gb():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    result = subprocess.run([sys.executable, "-m", "megatron_dhp", "train", "--config", str(path)], capture_output=True,
                            text=True, timeout=120, preexec_fn=at_most_4_gb)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"megatron-dhp train: error: train config {str(path)!r} expands to more than")


@pytest.mark.parametrize("text, match", [
    ("a: &a [1, *a]\n", r"holds an alias inside the value it names \(line 1\)"),
    ("a: " + "[" * 1500 + "]" * 1500 + "\n", "nests its lists or mappings too deeply to read"),
    (f"a: {'9' * 5000}\n", "holds a value YAML cannot convert: Exceeds the limit"),
], ids=["recursive", "deep", "5000 digits"])
def test_other_yaml_that_no_config_holds_is_one_line(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    message = refusal(lambda: load_yaml_file(path, what="cost config"))
    assert message.startswith(f"cost config {str(path)!r} ")
    pytest.raises(DhpError, load_yaml_file, path, what="cost config").match(match)


def test_aliases_below_the_bound_still_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b [1, 2, 3]\nthree: [*b, *b, *b]\n")
    assert load_yaml_file(path, what="cost config") == {"base": [1, 2, 3], "three": [[1, 2, 3]] * 3}


@pytest.mark.parametrize("make", [lambda: "x" * 10_000_000, lambda: list(range(10_000_000)), lambda: 10**5000,
                                  lambda: b"\xff" * 10_000_000, lambda: {str(i): [[i] * 100] * 100 for i in range(10_000)}],
                         ids=["str", "list", "int", "bytes", "nested"])
def test_an_excerpt_is_short_whatever_the_value(make):
    assert len(excerpt(make())) < 130


def test_a_huge_value_in_a_config_is_an_excerpt_in_its_error():
    message = refusal(TrainConfig.from_dict, {"train": {"lr": ["x" * 10_000_000]}})
    assert message.startswith("train config: key 'train': key 'lr' = ['xxxxx") and len(message) < 300


@pytest.mark.parametrize("build", [
    lambda v: TrainConfig.from_dict({"train": {"on_nonfinite": v}}),
    lambda v: DhpConfig(planner=v), lambda v: DhpConfig(comm=v), lambda v: DhpConfig(encoder_placement=v),
    lambda v: CostConfig.from_dict({**CostConfig.load("gpt7b-64").to_dict(), "kind": v}),
    lambda v: CostConfig.from_dict({**CostConfig.load("gpt7b-64").to_dict(), "cp_comm": v}),
    lambda v: DhpConfig(slow_ranks=(v,)),
], ids=["on_nonfinite", "planner", "comm", "encoder_placement", "cost-kind", "cp_comm", "slow_ranks"])
def test_a_huge_name_checked_against_its_choices_is_an_excerpt_in_its_error(build):
    message = refusal(build, "x" * 1_000_000)
    assert "xxxx" in message and len(message) < 300, message[:400]


def test_a_huge_value_in_a_length_file_is_an_excerpt_from_the_real_command(tmp_path, capsys):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"tokens": 3}\n' + json.dumps({"tokens": "x" * 10_000_000}) + "\n")
    err = cli(["plan", "--lengths", path, "--out", tmp_path / "plan.json"], capsys)
    assert f"length file {str(path)!r}, line 2: length 'xxxx" in err and "(10,000,000 characters)" in err
    assert len(err) < 300 + len(str(path))


CONFIGS = {  # a config kind: (its loader, the YAML of one int key and one float key holding VALUE)
    "train": (TrainConfig.load, "train:\n  steps: {int}\n  lr: {float}\n"),
    "dhp": (DhpConfig.load, "max_tokens_per_rank: {int}\ntime_limit_s: {float}\n"),
    "cost": (CostConfig.load, None),
}


def _cost_yaml(int_value: str, float_value: str) -> str:
    mapping = CostConfig.load("tiny-gpt-cpu").to_dict()
    lines = [f"{k}: {json.dumps(v)}" for k, v in mapping.items() if k not in ("world_size", "attn_s_per_token2")]
    return "\n".join(lines + [f"world_size: {int_value}", f"attn_s_per_token2: {float_value}"]) + "\n"


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("int_value, float_value, match", [
    (str(2**63), "1.0", r"= 9223372036854775808 is too large: give a number of magnitude below 2\*\*63"),
    (str(-2**70), "1.0", "is too large"),
    ("8", ".inf", "= inf must be a finite number"),
    ("8", "-.inf", "= -inf must be a finite number"),
    ("8", ".nan", "= nan must be a finite number"),
    ("8", "1e400", "= inf must be a finite number"),
])
def test_config_numbers_must_fit_a_machine(tmp_path, kind, int_value, float_value, match):
    load, template = CONFIGS[kind]
    path = tmp_path / f"{kind}.yaml"
    path.write_text(_cost_yaml(int_value, float_value) if template is None
                    else template.format(int=int_value, float=float_value))
    message = refusal(load, path)
    assert message.startswith(f"{kind} config {str(path)!r}")
    pytest.raises(DhpError, load, path).match(match)


def test_an_infinite_learning_rate_is_one_line_from_the_real_command(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text("train:\n  lr: .inf\n")
    assert cli(["train", "--config", path], capsys) == (
        f"megatron-dhp train: error: train config {str(path)!r}: key 'train': key 'lr' = inf must be a finite number\n")


def test_no_config_default_or_shipped_config_relies_on_an_infinite_float():
    """The number rule refuses nothing the project ships: no key's default, no shipped config."""
    def numbers(config):
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            yield from numbers(value) if dataclasses.is_dataclass(value) else [value]

    defaults = [*numbers(TrainConfig()), *numbers(DhpConfig())]
    assert defaults and all(math.isfinite(v) for v in defaults if isinstance(v, float))
    for path in sorted(Path(__file__).parents[1].joinpath("configs").glob("*.yaml")):
        assert not re.search(r"\.inf|\.nan", path.read_text(), re.IGNORECASE), path


@pytest.mark.parametrize("draw, match", [
    (dict(global_batch=MAX_BATCH_SAMPLES + 1), f"--global-batch {MAX_BATCH_SAMPLES + 1:,} is more samples than a "
                                               f"batch may hold \\({MAX_BATCH_SAMPLES:,}\\)"),
    (dict(global_batch=10**15), "pass --global-batch 262144 or less"),
])
def test_a_batch_over_the_bound_is_refused_before_it_is_drawn(draw, match):
    source = LengthSource.from_args(dist="wlbllm")
    pytest.raises(DhpError, source.draw, seed=0, capacity=1 << 20, **draw).match(match)


def test_a_length_file_over_the_bound_is_not_taken_whole(tmp_path, monkeypatch):
    path = tmp_path / "lengths.json"
    path.write_text("[1, 2, 3, 4]")
    monkeypatch.setattr(batches, "MAX_BATCH_SAMPLES", 3)
    source = LengthSource.from_args(lengths=path)
    assert refusal(lambda: source.draw(global_batch=None, seed=0, capacity=100)) == (
        "length file 'lengths.json' holds 4 samples, more than a batch may hold (3), and without --global-batch it "
        "is taken whole as one batch; pass --global-batch B to draw batches of B samples from it")
    assert len(source.draw(global_batch=3, seed=0, capacity=100)) == 3


@pytest.mark.parametrize("suffix, text", [(".json", "[1, 2, 3, 4]"), (".jsonl", "1\n2\n\n3\n4\n")])
def test_a_length_file_taken_whole_is_refused_once_counted_before_its_samples_are_built(tmp_path, monkeypatch,
                                                                                         suffix, text):
    path = tmp_path / f"lengths{suffix}"
    path.write_text(text)
    monkeypatch.setattr(batches, "MAX_BATCH_SAMPLES", 3)
    built = []
    monkeypatch.setattr("megatron_dhp.workload.sources._sample", lambda *a: built.append(a))
    message = refusal(lambda: LengthSource.from_args(lengths=path, whole=True))
    assert message.startswith(f"length file 'lengths{suffix}' holds 4 samples, more than a batch may hold (3)")
    assert built == []


def test_a_batch_over_the_bound_is_one_line_from_the_real_command(tmp_path, capsys):
    err = cli(["plan", "--dist", "wlbllm", "--global-batch", MAX_BATCH_SAMPLES + 1, "--out", tmp_path / "p.json"],
              capsys)
    assert "--global-batch 262,145 is more samples than a batch may hold (262,144)" in err


def test_ranks_beyond_twice_the_cores_are_refused_unless_oversubscribed(monkeypatch):
    monkeypatch.setattr("megatron_dhp.launch.ranks.usable_cores", lambda: 2)
    check_oversubscription(4, oversubscribe=False)  # 2 x the cores: the tests' own 4 ranks on 2 cores
    check_oversubscription(64, oversubscribe=True)
    assert refusal(lambda: check_oversubscription(64, oversubscribe=False)) == (
        "--nproc 64 spawns 64 ranks on 2 cores: ranks time-slice, step times say nothing and collectives may reach "
        "train.timeout_s; pass --nproc 4 or less, or --oversubscribe")


def test_usable_cores_are_this_process_s_share():
    assert usable_cores() == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def _no_spawn(*args, **kwargs):
    raise AssertionError("ranks were spawned")


def test_selftest_refuses_ranks_beyond_the_cores_before_spawning(monkeypatch, capsys):
    monkeypatch.setattr("megatron_dhp.launch.ranks.launch", _no_spawn)
    nproc = 2 * usable_cores() + 1
    assert cli(["selftest", "--nproc", nproc], capsys).startswith(
        f"megatron-dhp selftest: error: --nproc {nproc} spawns {nproc} ranks on {usable_cores()} core")
    assert "collectives may reach --timeout" in cli(["selftest", "--nproc", nproc], capsys)


def test_train_refuses_ranks_beyond_the_cores_before_spawning(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    nproc = 2 * usable_cores() + 1
    assert main(["train", "--nproc", str(nproc)]) == 2
    assert capsys.readouterr().err == (
        f"megatron-dhp train: error: --nproc {nproc} spawns {nproc} ranks on {usable_cores()} "
        f"core{'s' * (usable_cores() > 1)}: ranks time-slice, step times say nothing and collectives may reach "
        f"train.timeout_s; pass --nproc {2 * usable_cores()} or less, or --oversubscribe\n")


def test_an_injection_naming_a_missing_rank_is_refused():
    check_injected_ranks(("0:2", "1:3"), 2)
    assert refusal(lambda: check_injected_ranks(("1:2", "7:2.5"), 2)) == (
        "--slow-rank 7:2.5 names rank 7, but the job has 2 ranks (0 to 1); slow one of those")


def test_selftest_refuses_an_injection_naming_a_missing_rank_before_spawning(monkeypatch, capsys):
    monkeypatch.setattr("megatron_dhp.launch.ranks.launch", _no_spawn)
    assert cli(["selftest", "--nproc", 2, "--slow-rank", "2:2"], capsys) == (
        "megatron-dhp selftest: error: --slow-rank 2:2 names rank 2, but the job has 2 ranks (0 to 1); slow one of "
        "those\n")


def test_train_refuses_an_injection_naming_a_missing_rank_before_spawning(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--nproc", "2", "--slow-rank", "7:2"]) == 2
    assert capsys.readouterr().err == (
        "megatron-dhp train: error: --slow-rank 7:2 names rank 7, but the job has 2 ranks (0 to 1); slow one of "
        "those\n")
