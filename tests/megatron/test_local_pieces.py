"""The hooks' single-process pieces: layer spec, loader rows to sequences, the schedule's work list, errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.step_data import StepInputs
from megatron_dhp.workload.sample import Batch


def dhp_args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"dhp": True, "dhp_config": None, "dhp_planner": None, "dhp_max_tokens_per_rank": None,
                                 "dhp_comm": None, "dhp_cost": None, "dhp_log_plans": None, "dhp_max_groups_per_rank": None, **kw})


LLAMA3_8B = {"hidden_size": 4096, "ffn_hidden_size": 14336, "num_layers": 32, "num_attention_heads": 32,
             "group_query_attention": True, "num_query_groups": 8, "kv_channels": 128,
             "tensor_model_parallel_size": 1, "bf16": True, "fp16": False, "recompute_granularity": None}
"""Megatron-LM's model flags of upstream's Llama-3-8B recipe, as validate_args leaves them."""


def test_a_megatron_lm_run_s_token_memory_comes_from_its_model_flags():
    """4 MB per token (Megatron-LM's count, bf16) and keys and values 1/32 of it; over TP 2 and 4 stages an eighth."""
    from megatron_dhp.megatron.model_flags import model_memory

    memory = model_memory(dhp_args(**LLAMA3_8B), stages=1)
    assert memory.activation_mb == pytest.approx(4.0) and memory.kv_memory_per_token == pytest.approx(1 / 32)
    staged = model_memory(dhp_args(**{**LLAMA3_8B, "tensor_model_parallel_size": 2}), stages=4)
    assert staged.activation_mb == pytest.approx(0.5)
    mha = model_memory(dhp_args(**{**LLAMA3_8B, "group_query_attention": False, "bf16": False}), stages=1)
    assert mha.activation_mb == pytest.approx(8.0) and mha.kv_memory_per_token == pytest.approx(1 / 8)


def test_layer_spec_swaps_attention_in_megatron_specs():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dhp.megatron import layer_spec
    from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention, DynamicCPSelfAttention

    base = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    spec = layer_spec(base, dhp_args())
    attention = spec.submodules.self_attention
    assert attention.module is DynamicCPSelfAttention and attention.submodules.core_attention is DynamicCPAttention
    assert attention.submodules.q_layernorm is base.submodules.self_attention.submodules.q_layernorm  # the rest kept
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention  # a copy, not in place


def refused(capsys: pytest.CaptureFixture, hook: Callable[[], object]) -> list[str]:
    """What a hook that refuses the run leaves: it exits 2 (no traceback), and the lines it printed."""
    with pytest.raises(SystemExit) as exited:
        hook()
    assert exited.value.code == 2 and exited.value.__suppress_context__
    return capsys.readouterr().err.splitlines()


def test_layer_spec_refuses_what_it_cannot_convert_in_one_line(tmp_path, capsys, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_dhp.megatron import layer_spec
    from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention, DynamicCPMLASelfAttention

    monkeypatch.delenv("RANK", raising=False)
    odd = get_gpt_layer_local_spec()
    odd.submodules.self_attention = ModuleSpec(module=torch.nn.Identity)
    (line,) = refused(capsys, lambda: layer_spec(odd, dhp_args()))
    assert line.startswith("megatron-dhp: ") and "self_attention is megatron's SelfAttention or MLASelfAttention" in line
    mla = layer_spec(get_gpt_layer_local_spec(multi_latent_attention=True), dhp_args()).submodules.self_attention
    assert mla.module is DynamicCPMLASelfAttention and mla.submodules.core_attention is DynamicCPAttention
    te = tmp_path / "te.yaml"
    te.write_text("layer_spec: te\n")
    if not torch.cuda.is_available():
        (line,) = refused(capsys, lambda: layer_spec(get_gpt_layer_local_spec(), dhp_args(dhp_config=str(te))))
        assert line.startswith("megatron-dhp: ") and "'te' layer spec needs" in line


@pytest.mark.parametrize("rank", ["0", "1"])
def test_setup_refuses_a_seq_length_the_domain_cannot_hold_under_pp_in_one_line(capsys, monkeypatch, rank):
    """A new user's PP 2 run at --dhp-max-tokens-per-rank 32: 2 ranks hold 2 x 32 // 2 = 32 tokens, not 64;
    rank 0 says so in one line, every rank exits 2 (the domain and PP stubbed: no process group here)."""
    from megatron_dhp.megatron import arguments, hooks

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(arguments, "_SILENT_RANK_EXIT_DELAY_S", 0.0)
    domain = SimpleNamespace(size=2, global_ranks=(0, 1), device=torch.device("cpu"))
    monkeypatch.setattr(hooks, "DynamicDomain", SimpleNamespace(from_parallel_state=lambda timeout: domain))
    monkeypatch.setattr(hooks.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(hooks.parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(hooks.parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(hooks, "check_pipeline", lambda domain: None)
    args = dhp_args(dhp_max_tokens_per_rank=32, seq_length=64, distributed_timeout_minutes=1, sequence_parallel=False,
                    **LLAMA3_8B)
    printed = refused(capsys, lambda: hooks.setup(args, None, None, None))
    assert printed == ([] if rank == "1" else [
        "megatron-dhp: --seq-length 64 exceeds what the domain of 2 ranks holds at max_tokens_per_rank 32 // 2 "
        "pipeline stages (32 tokens); raise --dhp-max-tokens-per-rank to at least 64 or set truncate: true"])
    monkeypatch.setattr(hooks.parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    printed = refused(capsys, lambda: hooks.setup(args, None, None, None))
    assert printed == ([] if rank == "1" else [  # 5 chunks of 1/2 in flight: M x 2 // 5 = 12 tokens a microbatch
        "megatron-dhp: --seq-length 64 exceeds what the domain of 2 ranks holds at max_tokens_per_rank 32 at 2 "
        "pipeline stages of 2 chunks (24 tokens); raise --dhp-max-tokens-per-rank to at least 80 or set truncate: true"])


def test_layer_spec_provider_resolves_megatron_019_choices():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dhp.megatron import layer_spec_provider
    from megatron_dhp.runtime.attention.core_attention import DynamicCPSelfAttention

    seen = []

    def by_stage(config, vp_stage=None):
        seen.append((config, vp_stage))
        return get_gpt_layer_local_spec()

    for given in (get_gpt_layer_local_spec(), by_stage, lambda config: get_gpt_layer_local_spec()):
        spec = layer_spec_provider(given, dhp_args())("cfg", vp_stage=1)
        assert spec.submodules.self_attention.module is DynamicCPSelfAttention
    assert seen == [("cfg", 1)]


def test_rows_become_sequences():
    from megatron_dhp.megatron.data import sequences

    tokens = torch.arange(20).view(2, 10)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 10),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])}
    assert [len(s[0]) for s in sequences(batch, split_documents=False)] == [10, 10]
    docs = sequences(batch, split_documents=True)
    assert [len(s[0]) for s in docs] == [3, 2, 5, 7, 3]
    assert docs[2][0].tolist() == [5, 6, 7, 8, 9] and docs[2][1].tolist() == [6, 7, 8, 9, 10]
    # cu_seqlens (packed SFT / inter-document masking) win, padded entries repeat the last boundary
    packed = dict(batch, cu_seqlens=torch.tensor([[0, 4, 10, 10, 10], [0, 1, 10, 10, 10]], dtype=torch.int32))
    assert [len(s[0]) for s in sequences(packed, split_documents=False)] == [4, 6, 1, 9]


PAD, EOD, IGNORE = 99, 96, -100


def sft_row(conversations: list[tuple[list[int], list[int]]], seq_length: int) -> dict[str, torch.Tensor]:
    """One row as Megatron-LM's `SFTDataset.__getitem__` packs it (core_v0.16.1, training/datasets/sft_dataset.py):
    each conversation's tokens and targets (IGNORE on its prompt) end with EOD; the pack is padded to
    seq_length + 1 with PAD as token and target, the padding counted into the last sequence of `cu_seqlens`;
    then shifted by one, and the loss masked where the label is PAD or IGNORE."""
    tokens, targets, cu_seqlens = [], [], [0]
    for conv_tokens, conv_targets in conversations:
        tokens, targets = tokens + conv_tokens + [EOD], targets + conv_targets + [EOD]
        cu_seqlens.append(len(tokens))
    padding = seq_length + 1 - len(tokens)
    tokens, targets = tokens + [PAD] * padding, targets + [PAD] * padding
    cu_seqlens[-1] = seq_length
    labels = torch.tensor(targets[1:])
    return {"tokens": torch.tensor(tokens[:-1]), "labels": labels, "loss_mask": ((labels != PAD) & (labels != IGNORE)).float(),
            "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32)}


def test_a_packed_sft_row_yields_its_conversations_without_the_padding():
    """Megatron-LM's SFT rows (`--sft`): the padding after the last conversation (counted into its sequence by
    `cu_seqlens`, or marked as a sequence of its own, or with boundaries repeated) is never a sequence nor part of
    one; every conversation comes out whole, token for token, with every loss token."""
    from megatron_dhp.megatron.data import sequences

    prompt = [IGNORE] * 3
    padded = sft_row([([10, 11, 12, 13], [*prompt, 13]), ([20, 21, 22], [*prompt])], seq_length=16)  # 9 real, 7 pad
    full = sft_row([([30 + i for i in range(15)], [*prompt, *range(33, 45)])], seq_length=16)  # 16 real, no pad
    assert padded["cu_seqlens"].tolist() == [0, 5, 16] and padded["tokens"][9:].tolist() == [PAD] * 7
    # two rows in one batch (upstream's --sft loads one): the shorter cu_seqlens repeats its last boundary
    batch = {key: torch.stack([padded[key], full[key]]) for key in ("tokens", "labels", "loss_mask")}
    batch["cu_seqlens"] = torch.tensor([[0, 5, 16], [0, 16, 16]], dtype=torch.int32)
    got = sequences(batch, split_documents=False)
    assert [len(s[0]) for s in got] == [5, 4, 16]
    for (tokens, labels, loss_mask), (row, start, end) in zip(got, [(0, 0, 5), (0, 5, 9), (1, 0, 16)]):
        assert tokens.tolist() == batch["tokens"][row, start:end].tolist()
        assert labels.tolist() == batch["labels"][row, start:end].tolist()
        assert loss_mask.tolist() == batch["loss_mask"][row, start:end].tolist()
    assert got[1][0].tolist() == [20, 21, 22, EOD] and got[1][1].tolist() == [*prompt[:2], EOD, PAD]
    assert sum(float(s[2].sum()) for s in got) == float(batch["loss_mask"].sum())  # no loss token dropped
    # the padding as a pseudo-sequence of its own, or boundaries repeated to a fixed width
    for cu_seqlens in ([0, 5, 9, 16], [0, 5, 16, 16, 16], [0, 5, 9, 16, 16]):
        row = dict(padded, cu_seqlens=torch.tensor([cu_seqlens], dtype=torch.int32))
        row = {key: value.view(1, -1) for key, value in row.items()}
        assert [s[0].tolist() for s in sequences(row, split_documents=False)] == [[10, 11, 12, 13, EOD], [20, 21, 22, EOD]]
    # a tokenizer whose pad is its eod: the last conversation's eod carries no loss, and goes with the padding
    row = {key: value.view(1, -1) for key, value in padded.items()}
    row["tokens"] = torch.where(row["tokens"] == PAD, EOD, row["tokens"])
    row["labels"] = torch.where(row["labels"] == PAD, EOD, row["labels"])
    assert [len(s[0]) for s in sequences(row, split_documents=False)] == [5, 3]


def _plan(groups, *, barrier=False, n=3) -> Plan:
    return Plan("t", n, n, Batch.from_lengths([4, 4, 4, 4]).samples, tuple(groups), phase_barrier=barrier)


def test_work_items_follow_phases_with_barriers_and_fill_idle_ranks():
    from megatron_dhp.runtime.layout import MicrobatchLayout
    from megatron_dhp.runtime.slots import PHASE_BARRIER as BARRIER
    from megatron_dhp.runtime.slots import work_items
    from megatron_dhp.runtime.step_data import MicrobatchInputs

    def mb(phase):
        layout = MicrobatchLayout((0,), (4,), 1, 0)
        z = torch.zeros(4, dtype=torch.int64)
        return MicrobatchInputs((0,), phase, layout, z, z, torch.ones(4), z)

    plan = _plan([PlanGroup((0,), ((0,), (1,))), PlanGroup((1, 2), ((2, 3),)), PlanGroup((0, 1, 2), (), phase=1),
                  PlanGroup((1,), (), phase=2), PlanGroup((0, 2), (), phase=2)])
    mbs = (mb(0), mb(0))
    assert work_items(StepInputs(plan, mbs, 16, 16), 0) == list(mbs)
    barrier = _plan(plan.groups, barrier=True)
    assert work_items(StepInputs(barrier, mbs, 16, 16), 0) == [*mbs, BARRIER, BARRIER]
    idle = work_items(StepInputs(barrier, (), 16, 16), 2)
    assert idle[1:] == [BARRIER, BARRIER] and idle[0].group_ranks == (2,)
    assert float(idle[0].loss_mask.sum()) == 0 and idle[0].layout.num_slots == 1


def test_forward_step_refuses_a_two_value_loss():
    from megatron_dhp.megatron.forward import _per_token

    with pytest.raises(DhpError, match="returned 2 values; --dhp needs the per-token form"):
        _per_token(lambda out: (out.sum(), {}))(torch.ones(3))
    assert len(_per_token(lambda out: (out.sum(), 3, {}))(torch.ones(3))) == 3
    assert _per_token(lambda out, non_loss_data=False: out)(torch.ones(3), non_loss_data=True).shape == (3,)


def test_schedule_without_setup_or_wrapped_iterator_says_what_to_do():
    from megatron_dhp.megatron.data import step_iterator
    from megatron_dhp.megatron.schedule import dhp_forward_backward

    # the runtime comes with the iterators setup returns: without them the schedule has none to run with
    with pytest.raises(DhpError, match="megatron-dhp is not set up"):
        dhp_forward_backward(forward_step_func=None, data_iterator=iter([]), model=torch.nn.Linear(1, 1),
                             num_microbatches=1)
    with pytest.raises(DhpError, match="not a planned-step iterator"):
        step_iterator(iter([]))


@pytest.mark.parametrize("iterator, shape, match", [
    ([object(), object()], {}, "a list of 2 data iterators where its arguments ask for one"),
    (object(), {"sets": 2}, "one per validation set .* handed one object"),
    (object(), {"chunks": True}, "one per model chunk .* handed one object"),
])
def test_iterators_nested_otherwise_than_the_arguments_say_are_refused(iterator, shape, match):
    from megatron_dhp.megatron.data import IteratorShape, wrap_data_iterator

    # the nesting comes from the arguments; the runtime is never reached
    with pytest.raises(DhpError, match=match):
        wrap_data_iterator(iterator, None, lookahead=False, shape=IteratorShape(**shape))


def test_a_seq_length_one_rank_holds_is_named_at_start_up(caplog):
    from megatron_dhp.integration.dhp_config import DhpConfig
    from megatron_dhp.integration.job_spec import JobSpec
    from megatron_dhp.megatron.hooks import warn_if_rows_fit_one_rank

    spec = JobSpec(DhpConfig(max_tokens_per_rank=8192), 16, 8)
    with caplog.at_level("WARNING"):
        warn_if_rows_fit_one_rank(131072, spec)
        assert caplog.records == []
        warn_if_rows_fit_one_rank(8192, spec)
    (record,) = caplog.records
    assert "--seq-length 8192 is no longer than the 8192 tokens a rank holds" in record.getMessage()


@pytest.mark.parametrize("split_documents, cause", [(True, "--append-eod"), (False, "--reset-position-ids")])
def test_rows_of_one_sequence_each_are_named_once_after_the_first_steps(caplog, split_documents, cause):
    from megatron_dhp.megatron.data import DocumentCheck

    check = DocumentCheck(split_documents)
    with caplog.at_level("WARNING"):
        for _ in range(2 * DocumentCheck.STEPS):
            check.see(rows=4, sequences=4)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the first 3 steps' 12 rows were one sequence each" in warnings[0]
    assert cause in warnings[0]
    caplog.clear()
    documents = DocumentCheck(split_documents)
    for _ in range(DocumentCheck.STEPS):
        documents.see(rows=4, sequences=4 if _ else 5)  # one row held two documents
    assert caplog.records == []


def test_te_layer_spec_allocates_te_cp_stream_and_states_comm_type_and_padding_at_static_cp_one(monkeypatch):
    """With a stand-in for TransformerEngine's attention (no TE or GPU here): the stream is made once; the
    attention keeps the job's --cp-comm-type (per layer when a list), which megatron-core passes TE only at
    static CP > 1 while its per-call switch to the dynamic group hands TE that attribute; TE's forward receives
    each microbatch's `pad_between_seqs` (megatron-core 0.16 has no field to pass it); a TE below the comm
    type's floor is refused at construction."""
    import dataclasses
    import sys
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_dhp.runtime.attention import te
    from megatron_dhp.runtime.attention.context import DhpPackedSeqParams
    from megatron_dhp.runtime.attention.core_attention import DynamicCPSelfAttention
    from megatron_dhp.runtime.layer_spec import with_dynamic_cp

    class DotProductAttention:
        """TE's own attention: records the keyword arguments its forward receives."""

        def forward(self, query, key, value, attention_mask, **kwargs):
            self.received = kwargs
            return query

    class TEDotProductAttention(DotProductAttention):
        """megatron-core's: no cp_comm_type at static CP 1; its forward passes PackedSeqParams' own fields."""

        cp_stream = None

        def __init__(self, config, layer_number, *args, cp_comm_type=None, **kwargs):
            self.cp_comm_type = "p2p"  # TE's default, what its per-call group switch would pass on

        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, num_splits=None):
            kept = {f.name: getattr(packed_seq_params, f.name) for f in dataclasses.fields(PackedSeqParams)}
            return super().forward(query, key, value, attention_mask, **kept)

    stub = types.ModuleType("megatron.core.extensions.transformer_engine")
    stub.TEDotProductAttention = TEDotProductAttention
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "a stream")
    monkeypatch.setattr(te, "te_version", lambda: "2.18.0")
    te_spec = get_gpt_layer_local_spec()
    te_spec.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    spec = with_dynamic_cp(te_spec, backend="te")
    assert TEDotProductAttention.cp_stream == "a stream"
    assert spec.submodules.self_attention.module is DynamicCPSelfAttention
    core = spec.submodules.self_attention.submodules.core_attention
    assert issubclass(core, TEDotProductAttention)  # TE's own attention, with the job's --cp-comm-type
    assert with_dynamic_cp(spec, backend="te").submodules.self_attention.submodules.core_attention is core
    config = types.SimpleNamespace(cp_comm_type="all_gather")
    assert core(config, 1, cp_comm_type=None).cp_comm_type == "all_gather"
    assert core(types.SimpleNamespace(cp_comm_type=["p2p", "all_gather"]), 2).cp_comm_type == "all_gather"
    attention = core(types.SimpleNamespace(cp_comm_type=None), 1)
    assert attention.cp_comm_type == "p2p"
    for padded in (True, False):
        attention.forward("q", "k", "v", None, "causal", packed_seq_params=DhpPackedSeqParams(pad_between_seqs=padded))
        assert attention.received["pad_between_seqs"] is padded
    monkeypatch.setattr(te, "te_version", lambda: "2.17.1")
    with pytest.raises(DhpError, match="TransformerEngine 2.17.1 is older than 2.18.*--cp-comm-type all_gather"):
        core(config, 1)
    assert core(types.SimpleNamespace(cp_comm_type="p2p"), 1).cp_comm_type == "p2p"
    with pytest.raises(DhpError, match="layer spec 'te' needs TEDotProductAttention as core attention"):
        with_dynamic_cp(get_gpt_layer_local_spec(), backend="te")


def test_te_floors_by_comm_type():
    """Each comm type's THD floor, one per layer; a2a (group sizes that need not divide the heads) and a2a+p2p
    (no THD path) refused by name."""
    from megatron_dhp.runtime.attention.te import te_refusal

    assert te_refusal("p2p", "2.2") is None and te_refusal(None, "2.2.0") is None
    assert "older than 2.2" in te_refusal("p2p", "2.1.0")
    assert te_refusal(["p2p", "all_gather"], "2.18") is None
    assert "older than 2.18" in te_refusal(["all_gather", None], "2.17.1")
    assert "--cp-comm-type a2a a2a+p2p with layer_spec te" in te_refusal(["a2a", "a2a+p2p", "p2p"], "2.18")


def test_a_decoder_block_spec_gets_dynamic_cp_attention_in_every_layer():
    """megatron-core builds MoE models from a block spec, one layer spec per layer (some dense, some MoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dhp.runtime.attention.core_attention import DynamicCPAttention, DynamicCPSelfAttention
    from megatron_dhp.runtime.layer_spec import with_dynamic_cp

    config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2, num_moe_experts=2,
                               moe_layer_freq=[0, 1, 1], use_cpu_initialization=True)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    swapped = with_dynamic_cp(block, backend="local")
    assert len(swapped.layer_specs) == 3
    for layer in swapped.layer_specs:
        assert layer.submodules.self_attention.module is DynamicCPSelfAttention
        assert layer.submodules.self_attention.submodules.core_attention is DynamicCPAttention
    assert all(layer.submodules.self_attention.module is not DynamicCPSelfAttention for layer in block.layer_specs)


def test_the_sequence_cap_leaves_room_for_gathered_keys_and_values():
    """64 ranks of 4,096 tokens hold 262,144 tokens; keys and values at g = 1/32 on every rank take 2 x 4,096 per
    131,072-token sample (64 x 2,048 + 64 x 4,096 = 64 x 6,144 is too much), so the cap says so and what M holds it."""
    from dataclasses import replace

    from megatron_dhp.integration.dhp_config import DhpConfig
    from megatron_dhp.integration.job_spec import JobSpec
    from megatron_dhp.megatron.hooks import _sample_cap
    from megatron_dhp.plan.memory import ModelMemory, longest_sample

    llama = ModelMemory.of_gpt(hidden=4096, ffn_hidden=14336, layers=32, kv_channels=1024)
    config = DhpConfig(max_tokens_per_rank=4096, memory_mb_per_token=0.0)  # communicators left out: keys alone
    spec = JobSpec(config, 64, 8, device_type="cuda", model=llama)
    assert spec.kv_memory_per_token == pytest.approx(1 / 32) and spec.caps.planner == 4096
    assert _sample_cap(87000, spec) is None
    longest = longest_sample(4096, 64, 1 / 32)
    assert spec.caps.longest_sample == longest and 87000 <= longest < 131072
    assert _sample_cap(131072, replace(spec, config=replace(config, truncate=True))) == longest
    with pytest.raises(DhpError, match=r"--seq-length 131072 exceeds .* \(\d+ tokens, its keys and values on every "
                                       r"rank at kv_memory_per_token 0.0312\); raise --dhp-max-tokens-per-rank to at "
                                       r"least 6144 or set truncate: true"):
        _sample_cap(131072, spec)
