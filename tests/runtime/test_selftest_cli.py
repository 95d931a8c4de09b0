"""`megatron-dhp selftest` as a user runs it: flags checked up front, a real end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dhp.cli import main
from megatron_dhp.plan.comm import COMM_VARIANTS
from megatron_dhp.plan.plan import Plan
from tests.runtime import pipeline_workers
from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--comm", "ring,bogus"], "--comm 'ring,bogus'"),
        (["--nproc", "3", "--tp", "2"], "--nproc 3 must be a positive multiple of --tp 2"),
        (["--plans", "0"], "--plans 0 must be at least 1"),
        (["--gpus-per-node", "-1"], "--gpus-per-node -1 must be >= 0"),
        (["--nproc", "4", "--tp", "2", "--pp", "3"], "--nproc 4 must be a positive multiple of --tp 2 x --pp 3"),
        (["--pp", "0"], "--pp 0 must be at least 1"),
        (["--plan", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
        (["--ep", "2"], "--ep 2 splits the experts of --model moe; it needs --model moe and --pp 1"),
        (["--model", "moe", "--ep", "2", "--nproc", "6", "--tp", "2"], "--nproc 6 must be a positive multiple of --tp 2 x --ep 2"),
        (["--mtp", "1", "--tp", "2", "--nproc", "2"], "--mtp 1 must be >= 0, with --tp 1, --ep 1 and a text model"),
        (["--mtp", "-1"], "--mtp -1 must be >= 0"),
        (["--model", "mla", "--tp", "2"], "--model mla runs with --tp 1 (got --tp 2)"),
        (["--vpp", "2"], "--vpp 2 interleaves model chunks of a pipeline: it needs --pp >= 2 (got --pp 1)"),
        (["--vpp", "0"], "--vpp 0 must be at least 1"),
        (["--fsdp", "--pp", "2"], "--fsdp shards a dense text model over the domain: it needs --tp 1, --pp 1"),
        (["--fsdp", "--model", "moe"], "(got --tp 1, --pp 1, --model moe, --mtp 0)"),
        (["--vpp", "2", "--pp", "2", "--model", "vlm"], "--vpp 2 runs a text model without --mtp or --plan (got --model vlm, --mtp 0)"),
        (["--slow-rank", "1:2.0", "--pp", "2"], "--slow-rank 1:2.0 with --pp 2: megatron-core's 1F1B runs the slots"),
    ],
)
def test_bad_flags_fail_before_launching(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["selftest", *args]) == 2
    assert message in capsys.readouterr().err


def selftest_command(*args: str) -> subprocess.CompletedProcess:
    """`megatron-dhp selftest` in its own process, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "megatron_dhp", "selftest", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.fixture
def selftest(capfd, monkeypatch):
    """`megatron-dhp selftest` in this process: the same command and ranks (started from the tests' fork server
    in a second, where a process of its own spends ten importing), its exit code and output."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()  # this command's output only
        return subprocess.CompletedProcess(["selftest", *args], *run_cli(["selftest", *args], capfd))

    return run


def test_selftest_runs_two_ranks_end_to_end():
    proc = selftest_command("--nproc", "2", "--plans", str(len(COMM_VARIANTS)), "--seed", "1")  # one plan per variant
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(lines) == len(COMM_VARIANTS) and all(line.endswith("| ok") for line in lines), proc.stdout
    assert set(COMM_VARIANTS) == {line.split("|")[-6].strip() for line in lines}
    assert "all plans exact" in proc.stdout


def test_selftest_pp2_checks_every_gradient_through_the_pipeline(selftest):
    proc = selftest("--nproc", "4", "--pp", "2", "--plans", "2", "--seed", "2", "--samples", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP 1, PP 2, domain of 2" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(lines) == 2 and all(line.endswith("| ok") for line in lines), proc.stdout


def test_selftest_replays_a_plan_file_under_each_variant(tmp_path, selftest):
    plan = pipeline_workers.plans_of_two()["naive deadlock [g, h] vs [g, b1, h]"]
    plan.save(tmp_path / "plan.json")
    proc = selftest("--nproc", "2", "--plan", str(tmp_path / "plan.json"), "--comm", "ring,ulysses")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert [line.split("|")[-6].strip() for line in lines] == ["ring", "ulysses"], proc.stdout
    assert all(plan.summary() in line and line.endswith("| ok") for line in lines), proc.stdout
    wrong = selftest("--nproc", "3", "--plan", str(tmp_path / "plan.json"), "--comm", "ring")
    assert wrong.returncode == 2 and "the plan is for a domain of 2 ranks but this domain has 3" in wrong.stderr


def test_selftest_is_exact_on_groups_scattered_across_nodes(selftest):
    # Two nodes of two: rings over non-contiguous ranks that cross the node boundary (as dhp's list schedules
    # make them), under every comm; under mixed they run on the domain's communicator (p2p).
    path = ROOT / "configs" / "plan_scattered_2x2.json"  # rings over {0, 3}, {0, 2} and {1, 3}, nodes {0, 1} {2, 3}
    plan = Plan.load(path)
    plan.validate()
    assert plan.gpus_per_node == 2 and {(0, 3), (0, 2), (1, 3)} <= {tuple(sorted(g.ranks)) for g in plan.groups}
    comms = ("mixed", "p2p", "ring", "allgather", "ulysses")
    proc = selftest("--nproc", "4", "--gpus-per-node", "2", "--plan", str(path), "--comm", ",".join(comms))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(lines) == len(comms) and all(line.endswith("| ok") for line in lines), proc.stdout
    assert "2@0.3" in lines[0] and "2@1.3" in lines[0] and "mixed: " in lines[0] and "p2p" in lines[0].split("|")[-6]
    assert "domain of 4 (2 a node)" in proc.stdout


def test_selftest_moe_expert_parallel_two_with_uneven_microbatch_counts(selftest):
    proc = selftest("--model", "moe", "--ep", "2", "--nproc", "4", "--plans", "2", "--seed", "3", "--samples", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MoE 4 experts top-2 (alltoall), EP 2, domain of 4" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert len(lines) == 2 and all(line.endswith("| ok") for line in lines), proc.stdout
    # The plans drew their groups from the family made at start-up: no communicator after it.
    assert "group family: 5 groups, at most 4 per rank" in proc.stdout
    assert "groups: 5 created at start-up, 0 created after start-up" in proc.stdout


def test_selftest_moe_allgather_dispatcher_at_ep_one(selftest):
    proc = selftest("--model", "moe", "--moe-dispatcher", "allgather", "--nproc", "2", "--plans", "2", "--seed", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(allgather), EP 1" in proc.stdout and "all plans exact" in proc.stdout


def test_selftest_vlm_checks_each_encoder_placement(selftest):
    proc = selftest("--model", "vlm", "--nproc", "2", "--plans", "3", "--seed", "5", "--max-len", "48")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert [line.split("|")[-6].split(",")[-1].strip() for line in lines] == ["split", "replicate", "global"], proc.stdout
    assert all(line.endswith("| ok") for line in lines) and "all plans exact" in proc.stdout
    bad = selftest("--model", "vlm", "--tp", "2", "--nproc", "2")
    assert bad.returncode == 2 and "--model vlm runs with --tp 1 and --pp 1" in bad.stderr


@pytest.mark.parametrize("extra", [("--nproc", "3", "--mtp", "2", "--plans", "3"),
                                   ("--nproc", "4", "--pp", "2", "--mtp", "1", "--plans", "2", "--samples", "6")],
                         ids=["groups-of-3", "pp2"])
def test_selftest_multi_token_prediction_is_exact(extra, selftest):
    # The MTP layers' tokens, positions, labels and loss mask roll across each sample's shards on its
    # dynamic group (runtime.mtp); a roll that drops the boundary token from the next rank mismatches the
    # oracle's gradients by ~1e-2 (tests/runtime/test_mtp_roll.py checks the roll itself).
    proc = selftest(*extra, "--seed", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert lines and all(line.endswith("| ok") for line in lines), proc.stdout
    assert ", MTP " in proc.stdout and "all plans exact" in proc.stdout


@pytest.mark.parametrize("extra", [("--nproc", "3", "--plans", "4"),
                                   ("--nproc", "4", "--pp", "2", "--mtp", "1", "--plans", "2", "--samples", "6")],
                         ids=["every-variant", "pp2-mtp"])
def test_selftest_multi_latent_attention_is_exact(extra, selftest):
    # megatron-core's MLA (V heads narrower than Q/K, RoPE on a separate part, q/k LayerNorms) over dynamic
    # groups: its RoPE on the group, its table kept whole (config CP size = the group's while it runs: without
    # that MLA cuts the table to the local length and fails), values narrower than keys in every variant.
    proc = selftest("--model", "mla", *extra, "--seed", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    assert lines and all(line.endswith("| ok") for line in lines), proc.stdout
    assert ", MLA " in proc.stdout and "all plans exact" in proc.stdout


def test_selftest_fsdp_shards_over_the_domain_and_is_exact(selftest):
    # megatron-core's torch FSDP2 wrapper over a domain of 4: its per-layer gathers and scatters run on the whole
    # domain in every slot, so every rank runs the same slots while the CP groups change (sizes 1 to 4)
    proc = selftest("--nproc", "4", "--fsdp", "--plans", "3", "--seed", "3", "--samples", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch FSDP2 over the domain, domain of 4" in proc.stdout
    assert "all plans exact" in proc.stdout
