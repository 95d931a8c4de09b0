"""Tensor parallelism in the cost model: a position of t GPUs priced from one GPU's coefficients; t = 1 is
the config itself; the bound stays a bound; bad TP is a clear error."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model, simulate
from megatron_dhp.cost.tensor_parallel import fit_tensor_parallel, per_position
from megatron_dhp.errors import DhpError
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.workload.sample import Sample
from tests.configs import GPT7B
from tests.test_bound import assert_best_bound_holds, random_batch

BASE = GPT7B
GPT7B_TP_BYTES = 8 * 4096 * 2 * 32
"""All-gathers and reduce-scatters of one token's bf16 activations, 4 per layer each way, 32 layers of 4096."""


def test_tensor_parallel_1_is_the_config_itself():
    assert per_position(BASE) is BASE
    assert "tensor_parallel" not in BASE.to_dict()  # reference files stay as they were
    same = replace(BASE, tp_efficiency=0.5, tp_comm_bytes_per_token=1e9)  # no effect without TP
    batch = random_batch(random.Random(0), BASE.world_size * BASE.max_tokens_per_rank, 64)
    plan = run_planner(build_planner("dhp"), batch, build_cost_model(BASE))
    assert simulate(plan, build_cost_model(same)).step_time_s == simulate(plan, build_cost_model(BASE)).step_time_s


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("t", [2, 8])
def test_a_position_of_t_gpus_by_hand(t, overlap):
    config = replace(BASE, tensor_parallel=t, tp_efficiency=0.9, tp_comm_bytes_per_token=GPT7B_TP_BYTES,
                     overlap_comm=overlap, attention_heads=32)
    model = build_cost_model(config)
    assert (model.domain.world_size, model.domain.gpus_per_node) == (64 // t, 8 // t)
    assert model.domain.max_tokens_per_rank == 8192 * t  # sequence parallelism splits every activation t ways
    speedup = t * 0.9 ** np.log2(t)
    tp_comm = GPT7B_TP_BYTES * (t - 1) / t / BASE.intra_node_bytes_per_s
    samples = [Sample(0, 4096), Sample(1, 65536)]
    tokens, work = np.array([4096.0, 65536.0]), model.sample_work(samples)
    linear = BASE.linear_s_per_token / speedup
    compute = BASE.attn_s_per_token2 / speedup * tokens**2 + (max(linear, tp_comm) if overlap else linear + tp_comm) * tokens
    np.testing.assert_allclose(model.sample_time(tokens, work, 1, True), compute, rtol=1e-12)
    # a context-parallel pair of positions: each GPU moves 1 / t of the keys and values over its own link
    cp = BASE.comm_bytes_per_token / t * tokens * 0.5 / BASE.intra_node_bytes_per_s
    expected = np.maximum(compute / 2, cp) if overlap else compute / 2 + cp
    np.testing.assert_allclose(model.sample_time(tokens, work, 2, True), expected, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.sampled_from([2, 4, 8]), size=st.integers(1, 40),
       overlap=st.booleans())
def test_the_bound_stays_a_bound_under_tensor_parallelism(seed, t, size, overlap):
    config = replace(BASE, world_size=16, tensor_parallel=t, tp_efficiency=0.85, tp_comm_bytes_per_token=GPT7B_TP_BYTES,
                     overlap_comm=overlap)
    assert_best_bound_holds(build_cost_model(config), seed, size)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tensor_parallel": 3}, "'tensor_parallel' = 3 must be >= 1 and divide gpus_per_node = 8"),
    ({"tensor_parallel": 0}, "'tensor_parallel' = 0 must be >= 1"),
    ({"tensor_parallel": 4, "attention_heads": 6}, "'tensor_parallel' = 4 must divide attention_heads = 6"),
    ({"tp_efficiency": 0.0}, "'tp_efficiency' = 0.0 must be in (0, 1]"),
    ({"tensor_parallel": 2, "moe_expert_s_per_token": 1e-6}, "with MoE terms is not priced"),
    ({"tensor_parallel": 2, "rank_speeds": (1.0,) * 64}, "speeds are per domain position"),
])
def test_bad_tensor_parallelism_is_a_clear_error(overrides, message):
    with pytest.raises(DhpError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_cost_model(replace(BASE, **overrides))


def test_a_training_job_refuses_a_cost_model_with_tensor_parallelism(tmp_path):
    from megatron_dhp.integration.dhp_config import DhpConfig
    from megatron_dhp.integration.job_spec import JobSpec

    path = tmp_path / "tp.yaml"
    replace(BASE, tensor_parallel=2).save(path)
    with pytest.raises(DhpError, match="prices simulated layouts; a job's TP is its own"):
        JobSpec(DhpConfig(cost=str(path)), 4, 4)


def test_static_best_is_never_slower_than_static_at_tp_1_and_tries_every_tp():
    from megatron_dhp.solver.static_best import tp_degrees, tune_static
    from megatron_dhp.workload import LengthSource
    from tests.bench_scripts import load_bench

    tune_dhp = load_bench("tuning").tune_dhp

    base = replace(BASE, tp_efficiency=0.9, tp_comm_bytes_per_token=GPT7B_TP_BYTES, attention_heads=32)
    assert tp_degrees(base) == [1, 2, 4, 8] and tp_degrees(replace(base, attention_heads=12)) == [1, 2, 4]
    source = LengthSource.from_args(dist="wlbllm")
    batches = [source.draw(global_batch=128, seed=0, index=k, capacity=64 * 8192) for k in range(2)]
    static, dhp = tune_static(base, batches), tune_dhp(base, batches)
    at_tp1 = min((s for s in static if s.tp == 1), key=lambda s: s.cp)  # Megatron's static CP at TP 1
    assert static[0].step_s <= at_tp1.step_s and {s.tp for s in static} == {1, 2, 4, 8}
    assert [d.step_s for d in dhp] == sorted(d.step_s for d in dhp) and {d.tp for d in dhp} == {1, 2, 4, 8}
    assert all(s.cp & (s.cp - 1) == 0 for s in static)  # powers of two, as a user runs CP


def test_the_token_cap_of_a_position_from_a_memory_budget():
    # GPT-7B in bf16 with fp32 Adam states (16 bytes per parameter) on 80 GB GPUs; 34 x hidden bytes per token
    # per layer of activations with sequence parallelism and selective recomputation (Korthikanti et al. 2022)
    states, activations = 16 * 6.74e9, 34 * 4096 * 32
    config = replace(BASE, memory_budget_bytes=80e9, model_state_bytes=states, activation_bytes_per_token=activations)
    for t in (2, 4, 8):
        cap = build_cost_model(replace(config, tensor_parallel=t)).domain.max_tokens_per_rank
        assert cap == int((80e9 * t - states) // activations)  # 11704, 47607, 119413 tokens
    with pytest.raises(DhpError, match="at tensor_parallel = 1 the model's states"):
        build_cost_model(config)  # 108 GB of states do not fit one 80 GB GPU
    from megatron_dhp.solver.static_best import tune_static
    from megatron_dhp.workload import LengthSource

    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=64, seed=0, index=0, capacity=64 * 8192)
    assert {layout.tp for layout in tune_static(config, [batch])} == {2, 4, 8}  # TP 1 does not fit memory


def test_a_memory_budget_needs_the_activations_per_token():
    with pytest.raises(DhpError, match="'memory_budget_bytes' needs activation_bytes_per_token"):
        replace(BASE, memory_budget_bytes=80e9)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_fitting_the_tp_terms_recovers_them(t):
    # A position priced from known terms, read back as a profile would (tensor_parallel 1, non-overlapped):
    # the fit returns the efficiency and the collectives' bytes it was made with.
    one = replace(BASE, kind="profiled", overlap_comm=False)
    truth = replace(one, tensor_parallel=t, tp_efficiency=0.83, tp_comm_bytes_per_token=GPT7B_TP_BYTES)
    position = replace(per_position(truth), description="position")
    fitted = fit_tensor_parallel(one, position, t)
    assert fitted.tp_efficiency == pytest.approx(0.83, rel=1e-12)
    assert fitted.tp_comm_bytes_per_token == pytest.approx(GPT7B_TP_BYTES, rel=1e-9)
    again = per_position(replace(fitted, tensor_parallel=t))
    assert again.attn_s_per_token2 == pytest.approx(position.attn_s_per_token2, rel=1e-12)
    assert again.linear_s_per_token == pytest.approx(position.linear_s_per_token, rel=1e-12)


def test_fitting_the_tp_terms_refuses_what_it_cannot_measure():
    one = replace(BASE, kind="profiled", overlap_comm=False)
    with pytest.raises(DhpError, match="needs a position profiled at TP >= 2, not 1"):
        fit_tensor_parallel(one, one, 1)
    with pytest.raises(DhpError, match="attention coefficient a > 0"):
        fit_tensor_parallel(one, replace(one, attn_s_per_token2=0.0), 2)
    # faster than t GPUs (caches): efficiency 1, never above
    assert fit_tensor_parallel(one, replace(one, attn_s_per_token2=one.attn_s_per_token2 / 3), 2).tp_efficiency == 1.0
