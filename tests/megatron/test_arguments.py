"""The --dhp flags: parsing in a Megatron-style parser, YAML plus flag overrides, and every rejected combination."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields
from operator import attrgetter
from pathlib import Path

import pytest

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.arguments import (
    add_dhp_args,
    dhp_config_from_args,
    refuse_or_config,
    validate_dhp_args,
    with_dhp_args,
)
from megatron_dhp.megatron.refusals import REFUSALS

REPO = Path(__file__).resolve().parents[2]

# What Megatron's own parser and validate_args leave in args for a plain dense GPT run
MEGATRON_DEFAULTS = dict(
    context_parallel_size=1, calculate_per_token_loss=True, pipeline_model_parallel_size=1,
    hybrid_context_parallel=False, sequence_parallel=False, num_experts=None, mtp_num_layers=None,
    expert_model_parallel_size=1, moe_token_dispatcher_type="allgather",
    multi_latent_attention=False, use_legacy_models=False, reset_attention_mask=False, reset_position_ids=False,
    iterations_to_skip=[], rampup_batch_size=None, attention_dropout=0.0, transformer_impl="local",
    cp_comm_type=["p2p"], cuda_graph_impl="none", attention_backend="AttnBackend.auto",
)


def parse(argv: list[str], **megatron: object) -> argparse.Namespace:
    """Parse like Megatron does with our extra_args_provider, then fill in Megatron's own arguments."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    args = add_dhp_args(parser).parse_args(argv)
    for key, value in {**MEGATRON_DEFAULTS, **megatron}.items():
        setattr(args, key, value)
    return args


def test_flags_parse_into_the_argument_group():
    parser = add_dhp_args(argparse.ArgumentParser(allow_abbrev=False))
    groups = [g.title for g in parser._action_groups]
    assert "dynamic hybrid parallelism (megatron-dhp)" in groups
    args = parser.parse_args(["--dhp", "--dhp-planner", "static", "--dhp-max-tokens-per-rank", "4096",
                              "--dhp-comm", "ring", "--dhp-cost", "gpt7b-48", "--dhp-log-plans"])
    assert (args.dhp, args.dhp_planner, args.dhp_max_tokens_per_rank, args.dhp_comm, args.dhp_cost, args.dhp_log_plans) == (
        True, "static", 4096, "ring", "gpt7b-48", True)
    unset = parser.parse_args([])
    assert unset.dhp is False and unset.dhp_config is None and unset.dhp_log_plans is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--dhp-comm", "a2a"])


def test_every_dhp_config_key_is_a_flag_that_overrides_the_yaml_only_when_given(tmp_path):
    from megatron_dhp.integration.dhp_config import DhpConfig

    parser = add_dhp_args(argparse.ArgumentParser(allow_abbrev=False))
    dests = {a.dest for a in parser._actions}
    assert {"dhp_" + ("slow_rank" if f == "slow_ranks" else f) for f in map(attrgetter("name"), fields(DhpConfig))} <= dests
    config = tmp_path / "dhp.yaml"
    config.write_text("layer_spec: te\ntruncate: true\nrank_speeds: [1.0, 0.5]\n")
    yaml_only = dhp_config_from_args(parser.parse_args(["--dhp-config", str(config)]))
    assert (yaml_only.layer_spec, yaml_only.truncate, yaml_only.rank_speeds, yaml_only.log_plans) == ("te", True, (1.0, 0.5), True)
    flags = parser.parse_args(["--dhp-config", str(config), "--dhp-layer-spec", "local", "--no-dhp-truncate",
                               "--dhp-rank-speeds", "1", "0.25", "--no-dhp-log-plans", "--dhp-attention-backend", "math",
                               "--dhp-slow-rank", "1:2", "--dhp-slow-rank", "3:1.5"])
    got = dhp_config_from_args(flags)
    assert (got.layer_spec, got.truncate, got.rank_speeds, got.log_plans, got.attention_backend, got.slow_ranks) == (
        "local", False, (1.0, 0.25), False, "math", ("1:2", "3:1.5"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--dhp-layer-spec", "fast"])


def test_the_loader_s_attention_mask_is_switched_off_in_one_line(caplog):
    args = parse(["--dhp"], create_attention_mask_in_dataloader=True, seq_length=131072)
    with caplog.at_level("WARNING"):
        refuse_or_config(args)
    assert args.create_attention_mask_in_dataloader is False
    (record,) = caplog.records
    assert "--no-create-attention-mask-in-dataloader set: the loader's 131072 x 131072 mask (65,536 MiB a row)" in (
        record.getMessage())


def test_dhp_config_takes_a_preset_name():
    args = add_dhp_args(argparse.ArgumentParser()).parse_args(["--dhp-config", "llama3_8b_dhp"])
    assert dhp_config_from_args(args).layer_spec == "te"


def test_with_dhp_args_keeps_the_other_provider():
    def other(parser):
        parser.add_argument("--modelopt-thing", type=int, default=3)
        return parser

    args = with_dhp_args(other)(argparse.ArgumentParser()).parse_args(["--dhp"])
    assert args.dhp and args.modelopt_thing == 3
    assert with_dhp_args(None)(argparse.ArgumentParser()).parse_args([]).dhp is False


def test_flags_override_the_yaml(tmp_path):
    yaml = tmp_path / "dhp.yaml"
    yaml.write_text("planner: static\nmax_tokens_per_rank: 2048\ncomm: ulysses\nlog_plans: false\noverlap_planning: false\n")
    config = dhp_config_from_args(parse(["--dhp", "--dhp-config", str(yaml), "--dhp-comm", "ring", "--dhp-log-plans"]))
    assert (config.planner, config.max_tokens_per_rank, config.comm, config.log_plans, config.overlap_planning) == (
        "static", 2048, "ring", True, False)
    assert validate_dhp_args(parse(["--dhp", "--dhp-config", str(yaml)])).comm == "ulysses"
    assert dhp_config_from_args(parse(["--dhp"])).planner == "dhp"  # no YAML: the defaults
    assert dhp_config_from_args(parse(["--dhp"])).max_groups_per_rank is None  # the planner's own
    assert dhp_config_from_args(parse(["--dhp", "--dhp-max-groups-per-rank", "0"])).max_groups_per_rank == 0


@pytest.mark.parametrize(
    "argv,megatron,match",
    [
        ([], dict(context_parallel_size=4), "--context-parallel-size 4 with --dhp.*set --context-parallel-size 1"),
        ([], dict(calculate_per_token_loss=False), "--dhp needs --calculate-per-token-loss"),
        ([], dict(hybrid_context_parallel=True), "drop --hybrid-context-parallel"),
        ([], dict(num_experts=8, expert_model_parallel_size=2, pipeline_model_parallel_size=2),
         "--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2 and --pipeline-model-parallel-size 2"
         ".*use --moe-token-dispatcher-type alltoall"),
        ([], dict(num_experts=8, moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type flex with --dhp"),
        ([], dict(multi_latent_attention=True, tensor_model_parallel_size=2), "--multi-latent-attention with "
         "--tensor-model-parallel-size 2"),
        ([], dict(use_legacy_models=True), "--use-legacy-models"),
        ([], dict(use_megatron_fsdp=True), "--use-megatron-fsdp with --dhp.*use --use-torch-fsdp2 .* or "
                                           "--use-distributed-optimizer"),
        ([], dict(reset_attention_mask=True), "--reset-attention-mask with --dhp needs --reset-position-ids"),
        ([], dict(iterations_to_skip=[5]), "--iterations-to-skip"),
        ([], dict(sft=True, eval_iters=10), "--sft with --eval-iters 10 under --dhp: .*mean of each microbatch's mean "
         "loss.*set --eval-iters 0"),
        ([], dict(multiple_validation_sets=True, virtual_pipeline_model_parallel_size=2),
         "--multiple-validation-sets with --virtual-pipeline-model-parallel-size 2: .*each set would be scored"),
        ([], dict(rampup_batch_size=[16, 16, 1000]), "--rampup-batch-size with overlap_planning"),
        ([], dict(cuda_graph_impl="local"), "--cuda-graph-impl local with --dhp"),
        ([], dict(attention_backend="AttnBackend.local"), "--attention-backend local with --dhp"),
        ([], dict(attention_dropout=0.1), "--attention-dropout 0.1 with layer_spec local"),
        ([], dict(fp8="hybrid"), "--fp8-format hybrid with --dhp.*multiple of 8 or 16.*drop --fp8-format"),
        ([], dict(tp_comm_overlap=True), "--tp-comm-overlap with --dhp.*userbuffers"),
        (["--dhp-slow-rank", "1:2.0"], dict(pipeline_model_parallel_size=2),
         "--dhp-slow-rank 1:2.0 with --pipeline-model-parallel-size 2: megatron-core's 1F1B runs the slots under "
         "pipeline parallelism, and megatron-dhp does not time them.*drop --dhp-slow-rank"),
        (["--dhp-planner", "magic"], {}, "planner 'magic' is unknown; choose one of dhp, static"),
        (["--dhp-max-tokens-per-rank", "0"], {}, "max_tokens_per_rank = 0 must be >= 1"),
        (["--dhp-cost", "nope"], {}, "cost config 'nope' is neither a file nor a preset"),
        (["--dhp-config", "missing.yaml"], {}, "dhp config 'missing.yaml' is neither a file nor a preset in configs/; "
         "presets: .*llama3_8b_dhp"),
    ],
)
def test_combinations_that_cannot_work_are_rejected(argv, megatron, match):
    with pytest.raises(DhpError, match=match):
        validate_dhp_args(parse(["--dhp", *argv], **megatron))


@pytest.mark.parametrize("ep,dispatcher", [(1, "allgather"), (1, "alltoall"), (4, "alltoall"), (2, "allgather")])
def test_moe_is_accepted(ep, dispatcher):
    args = parse(["--dhp"], num_experts=8, expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher)
    assert validate_dhp_args(args).planner == "dhp"


def test_multi_latent_attention_is_accepted_at_tp_1():
    assert validate_dhp_args(parse(["--dhp"], multi_latent_attention=True)).layer_spec == "local"


def test_sequence_parallelism_is_accepted():
    assert validate_dhp_args(parse(["--dhp"], sequence_parallel=True)).planner == "dhp"


@pytest.mark.parametrize("pp,vpp", [(2, None), (3, None), (4, None), (2, 2), (4, 3)])
def test_pipeline_parallelism_interleaved_or_not_is_accepted(pp, vpp):
    assert validate_dhp_args(parse(["--dhp"], pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vpp)).planner == "dhp"


def test_torch_fsdp2_is_accepted():
    assert validate_dhp_args(parse(["--dhp"], use_torch_fsdp2=True)).planner == "dhp"


def test_every_problem_is_reported_at_once():
    with pytest.raises(DhpError) as e:
        validate_dhp_args(parse(["--dhp"], context_parallel_size=2, calculate_per_token_loss=False))
    assert "--context-parallel-size 2" in str(e.value) and "--calculate-per-token-loss" in str(e.value)


def test_each_refusal_is_one_line_naming_the_value_and_the_fix():
    with pytest.raises(DhpError) as e:
        validate_dhp_args(parse(["--dhp"], context_parallel_size=2, calculate_per_token_loss=False,
                                multi_latent_attention=True, tensor_model_parallel_size=2))
    assert str(e.value).splitlines() == [
        "--context-parallel-size 2 with --dhp: megatron-dhp forms the context-parallel groups itself every step; "
        "set --context-parallel-size 1 (the DP ranks become the dynamic domain)",
        "--dhp needs --calculate-per-token-loss: with groups that change every step only a loss summed per token "
        "and divided by the global token count keeps gradients exact; add --calculate-per-token-loss",
        "--multi-latent-attention with --tensor-model-parallel-size 2 and --dhp: MLA over dynamic groups is checked "
        "at TP 1 with the local spec only (under TP megatron-core 0.16.1's local MLA does not sum its shared RoPE "
        "key's gradient over the TP ranks, even without context parallelism; TE's is unverified here); use "
        "--tensor-model-parallel-size 1 and layer_spec: local",
    ]
    assert all(rule.refused and rule.why and rule.fix for rule in REFUSALS)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_megatron_entry_prints_refusals_once_and_exits_without_a_traceback(rank):
    """What the patched Megatron-LM calls: rank 0 prints one line per problem, every rank exits 2."""
    args = parse(["--dhp"], context_parallel_size=2, calculate_per_token_loss=False)
    code = ("import argparse\nfrom megatron_dhp.megatron import refuse_or_config\n"
            f"refuse_or_config(argparse.Namespace(**{vars(args)!r}))\nprint('not reached')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RANK": rank, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2 and "not reached" not in out.stdout
    assert "Traceback" not in out.stderr
    printed = [line for line in out.stderr.splitlines() if "megatron-dhp" in line]
    if rank == "0":
        assert len(printed) == 2 and all(line.startswith("megatron-dhp: ") for line in printed), out.stderr
        assert printed[0].startswith("megatron-dhp: --context-parallel-size 2 with --dhp: ")
        assert printed[1].startswith("megatron-dhp: --dhp needs --calculate-per-token-loss: ")
    else:
        assert printed == [], out.stderr


def test_an_invalid_dhp_flag_is_named_with_the_runs_other_refusals():
    # The planner's error alone was printed: the user fixed it, ran again, and only then met the rest.
    args = parse(["--dhp", "--dhp-planner", "bogus"], context_parallel_size=2, calculate_per_token_loss=False)
    with pytest.raises(DhpError) as refused:
        validate_dhp_args(args)
    lines = str(refused.value).splitlines()
    assert lines[0] == ("--dhp flags: planner 'bogus' is unknown; choose one of dhp, static, megatron-hcp, fcp-ref, "
                        "flexsp-milp")
    assert [line.split(":")[0] for line in lines[1:]] == ["--context-parallel-size 2 with --dhp",
                                                          "--dhp needs --calculate-per-token-loss"]


def test_megatron_entry_returns_the_config_of_a_run_that_can_work():
    assert refuse_or_config(parse(["--dhp", "--dhp-comm", "ring"])).comm == "ring"
    assert refuse_or_config(parse([])) is None


def test_te_layer_spec_takes_te_with_a_thd_cp_type(tmp_path):
    te = tmp_path / "te.yaml"
    te.write_text("layer_spec: te\n")
    ok = parse(["--dhp", "--dhp-config", str(te)], transformer_impl="transformer_engine", cp_comm_type=["all_gather"],
               attention_dropout=0.1)
    assert validate_dhp_args(ok).layer_spec == "te"  # TE has its own dropout
    with pytest.raises(DhpError, match="layer_spec te needs --transformer-impl transformer_engine"):
        validate_dhp_args(parse(["--dhp", "--dhp-config", str(te)]))
    with pytest.raises(DhpError, match="--cp-comm-type a2a with layer_spec te"):
        validate_dhp_args(parse(["--dhp", "--dhp-config", str(te)], transformer_impl="transformer_engine", cp_comm_type=["a2a"]))
    with pytest.raises(DhpError, match="--dhp-comm chooses the CP variant of layer_spec local"):
        validate_dhp_args(parse(["--dhp", "--dhp-config", str(te), "--dhp-comm", "ring"], transformer_impl="transformer_engine"))


def test_without_dhp_nothing_is_checked_but_stray_flags_are_named():
    assert validate_dhp_args(parse([], context_parallel_size=4, calculate_per_token_loss=False)) is None
    with pytest.raises(DhpError, match="--dhp-config, --dhp-comm given without --dhp"):
        validate_dhp_args(parse(["--dhp-config", "x.yaml", "--dhp-comm", "ring"]))


def test_ulysses_needs_no_head_divisibility_check():
    # the runtime's Ulysses handles heads that do not divide by the group size (tests/runtime), so it is allowed
    assert validate_dhp_args(parse(["--dhp", "--dhp-comm", "ulysses"])).comm == "ulysses"


def test_a_gpu_run_gets_the_gpu_environment_before_megatron_starts_nccl(monkeypatch):
    """Validation runs before Megatron-LM's init_process_group, which is when NCCL reads its variables once
    (NCCL_COMM_SPLIT_SHARE_RESOURCES among them) and before CUDA's allocator reads its configuration."""
    import torch

    from megatron_dhp.runtime.distributed import GPU_ENVIRONMENT

    for name in GPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    validate_dhp_args(parse(["--dhp"], distributed_backend="nccl"))
    assert not set(GPU_ENVIRONMENT) & set(os.environ)  # no CUDA: a CPU run's environment is its own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    validate_dhp_args(parse(["--dhp"], distributed_backend="gloo"))
    assert not set(GPU_ENVIRONMENT) & set(os.environ)
    validate_dhp_args(parse(["--dhp"], distributed_backend="nccl"))
    assert {name: os.environ[name] for name in GPU_ENVIRONMENT} == GPU_ENVIRONMENT


def test_a_dhp_config_object_stands_in_for_the_yaml_and_flags_still_override_it():
    """The Bridge integration hands its `dhp` section over as it is, with no YAML written."""
    from megatron_dhp.integration.dhp_config import DhpConfig

    args = add_dhp_args(argparse.ArgumentParser()).parse_args([])
    args.dhp_config = DhpConfig(max_tokens_per_rank=123, planner="static")
    assert dhp_config_from_args(args) == DhpConfig(max_tokens_per_rank=123, planner="static")
    args.dhp_max_tokens_per_rank = 64
    assert dhp_config_from_args(args) == DhpConfig(max_tokens_per_rank=64, planner="static")
