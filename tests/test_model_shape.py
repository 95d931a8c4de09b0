"""The cost model of the job that runs: the default preset scaled to the job's own GPT (cost.model_shape)."""

from __future__ import annotations

import argparse

import pytest

from megatron_dhp.cost import CostConfig
from megatron_dhp.cost.model_shape import GPT7B, ModelShape, scaled_cost
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.integration.job_spec import JobSpec
from megatron_dhp.megatron.model_flags import model_shape

BASE = CostConfig.load("gpt7b-64")
# Megatron-LM's flags of Llama-3-8B, as validate_args and the tokenizer leave them
LLAMA3_8B = argparse.Namespace(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                               group_query_attention=True, num_query_groups=8, kv_channels=128,
                               padded_vocab_size=128256, swiglu=True, bf16=True, fp16=False)


def test_the_reference_model_counts_llama_7b_s_weights_and_scales_to_itself():
    # LLaMA-7B: 6.74B weights, of which the input embedding (131M) and the norms (0.3M) do no GEMM
    assert GPT7B.linear_flops_per_token() == pytest.approx(6 * (6.738e9 - 32000 * 4096 - 266240), rel=1e-3)
    scaled, factors = scaled_cost(BASE, GPT7B)
    assert factors == {"linear": 1.0, "attention": 1.0, "comm": 1.0}
    assert (scaled.linear_s_per_token, scaled.attn_s_per_token2, scaled.comm_bytes_per_token) == (
        BASE.linear_s_per_token, BASE.attn_s_per_token2, BASE.comm_bytes_per_token)


def test_llama3_8b_at_tp_2_is_priced_by_its_own_work():
    shape = model_shape(LLAMA3_8B)
    assert shape == ModelShape(32, 4096, 14336, 32, 8, 128, 128256)
    scaled, factors = scaled_cost(BASE, shape, tensor_parallel=2)
    # hand counts: GEMM weights a token meets (QKV + projection + SwiGLU MLP per layer, the output layer)
    llama = 32 * (4096 * 128 * (32 + 8 + 8 + 32) + 3 * 4096 * 14336) + 4096 * 128256
    reference = 32 * (4096 * 128 * 128 + 3 * 4096 * 11008) + 4096 * 32000
    assert factors["linear"] == pytest.approx(llama / 2 / reference)
    assert factors["attention"] == pytest.approx(0.5)  # the same query heads, half on each TP rank
    assert factors["comm"] == pytest.approx(4 / 32)  # 4 of 8 kv heads a TP rank against 32
    assert scaled.linear_s_per_token == pytest.approx(BASE.linear_s_per_token * factors["linear"])
    assert scaled.microbatch_overhead_s == BASE.microbatch_overhead_s  # the rest is the preset's


def test_a_job_without_a_cost_plans_with_the_default_scaled_to_its_model_and_says_so():
    shape = model_shape(LLAMA3_8B)
    spec = JobSpec(DhpConfig(), 16, 8, tensor_parallel=2, shape=shape)
    expected, factors = scaled_cost(BASE, shape, tensor_parallel=2)
    assert spec.scaled == factors and spec.cost.attn_s_per_token2 == expected.attn_s_per_token2
    assert "gpt7b-64 (no cost given) scaled to this job's model, 32 layers of 4096" in spec.cost_line()
    assert "closed loop corrects" in spec.cost_line()
    # a cost named in the config plans as given, whatever the model
    given = JobSpec(DhpConfig(cost="gpt7b-64"), 16, 8, tensor_parallel=2, shape=shape)
    assert given.scaled is None and given.cost.attn_s_per_token2 == BASE.attn_s_per_token2
    assert "gpt7b-64 (given)" in given.cost_line()


def test_a_shape_that_cannot_be_is_refused():
    with pytest.raises(DhpError, match="model layers = 0 must be >= 1"):
        ModelShape(0, 4096, 14336, 32, 8, 128, 128256)
