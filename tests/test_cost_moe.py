"""The mixture-of-experts terms of the cost model: expert seconds and the all-to-all on the EP group.

Hand-computed times at d = 1 and d = 4, the dense defaults leaving every number as it was, the checks on bad
values, the Mixtral preset through `plan` and `simulate`, and the lower bound against the loop-by-loop
oracle and valid plans on MoE domains.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dhp.cli import main
from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload import Batch, Sample
from tests import reference_eval
from tests.cost_defaults import assert_defaults_change_nothing

MOE_KEYS = ("moe_expert_s_per_token", "moe_a2a_bytes_per_token", "expert_parallel_size")


@pytest.fixture(scope="module")
def mixtral_config() -> CostConfig:
    return CostConfig.load("mixtral-8x7b-64")


@pytest.fixture(scope="module")
def round_config(gpt7b_config) -> CostConfig:
    """Round numbers for hand computation: a = 1e-9, b = 1e-4, x = 3e-4, alpha = 1.5e6 (alpha / bw = 1e-5
    inside a node, 7.5e-5 across nodes), gamma = 1.5e6, 16 ranks, 8 per node, EP 8, no overlap."""
    return dataclasses.replace(gpt7b_config, world_size=16, attn_s_per_token2=1e-9, linear_s_per_token=1e-4,
                               enc_attn_s_per_token2=0.0, enc_linear_s_per_token=0.0, overlap_comm=False,
                               moe_expert_s_per_token=3e-4, moe_a2a_bytes_per_token=1.5e6, expert_parallel_size=8)


def t(model, tokens: int, d: int, intra: bool) -> float:
    return float(model.sample_time(tokens, model.sample_work([Sample(0, tokens)]), d, intra)[0])


# ---------------------------------------------------------------------- hand-computed times
def test_one_sample_at_d1_and_d4_by_hand(round_config):
    model = build_cost_model(round_config)
    # L = 10000: a L^2 = 0.1; (b + x + alpha / bw_intra) L = (1e-4 + 3e-4 + 1e-5) * 1e4 = 4.1.
    assert t(model, 10_000, 1, True) == pytest.approx(4.2, rel=1e-12)
    # d = 4 in one node: compute 4.2 / 4 = 1.05, CP comm 1.5e6 * 1e4 * 3/4 / 150e9 = 0.075, added.
    assert t(model, 10_000, 4, True) == pytest.approx(1.05 + 0.075, rel=1e-12)
    # d = 4 across nodes: the CP comm takes the inter-node bandwidth (0.5625), the all-to-all does not
    # (it runs on the EP group, whatever the sample's group).
    assert t(model, 10_000, 4, False) == pytest.approx(1.05 + 0.5625, rel=1e-12)
    # With overlap the CP comm hides under compute, the all-to-all does not: it is part of compute.
    overlapped = build_cost_model(dataclasses.replace(round_config, overlap_comm=True))
    assert t(overlapped, 10_000, 4, False) == pytest.approx(1.05, rel=1e-12)


def test_ep_group_across_nodes_takes_the_inter_node_bandwidth(round_config):
    # EP 16 on 8 ranks per node: alpha / bw = 1.5e6 / 20e9 = 7.5e-5; work = 0.1 + 4.75e-4 * 1e4 = 4.85.
    model = build_cost_model(dataclasses.replace(round_config, expert_parallel_size=16))
    assert t(model, 10_000, 1, True) == pytest.approx(4.85, rel=1e-12)
    assert t(model, 10_000, 4, True) == pytest.approx(4.85 / 4 + 0.075, rel=1e-12)
    # EP 3 on 48 ranks, 8 per node: the group of ranks 6, 7, 8 spans two nodes, so the step waits on it.
    spans = build_cost_model(dataclasses.replace(round_config, world_size=48, expert_parallel_size=3))
    assert t(spans, 10_000, 1, True) == pytest.approx(4.85, rel=1e-12)
    # EP 3 on a 3-rank domain of one node (4 per node): inside it, 4.2 again.
    one_node = build_cost_model(dataclasses.replace(round_config, world_size=3, gpus_per_node=4, expert_parallel_size=3))
    assert t(one_node, 10_000, 1, True) == pytest.approx(4.2, rel=1e-12)


def test_mixtral_preset_by_hand(mixtral_config):
    c = mixtral_config
    assert (c.world_size, c.gpus_per_node, c.max_tokens_per_rank, c.expert_parallel_size) == (64, 8, 4096, 8)
    assert c.attn_s_per_token2 == 5.128e-9  # gpt7b's: the same layers and hidden size
    model = build_cost_model(c)
    # L = 4096 on one rank: 5.128e-9 * 4096^2 + (4.08e-5 + 3.12e-4 + 1.835e6 / 150e9) * 4096.
    per_token = 4.08e-5 + 3.12e-4 + 1.835e6 / 150e9
    assert t(model, 4096, 1, True) == pytest.approx(5.128e-9 * 4096**2 + per_token * 4096, rel=1e-12)
    # L = 16384 on 4 ranks of a node: compute / 4, CP comm 3.75e5 * 16384 * 3/4 / 150e9 hides under it.
    compute = (5.128e-9 * 16384**2 + per_token * 16384) / 4
    assert 3.75e5 * 16384 * 0.75 / 150e9 < compute
    assert t(model, 16_384, 4, True) == pytest.approx(compute, rel=1e-12)


# ---------------------------------------------------------------------- dense defaults
def test_dense_defaults_leave_every_reference_number_unchanged(tmp_path, gpt7b_config):
    explicit = dataclasses.replace(gpt7b_config, moe_expert_s_per_token=0.0, moe_a2a_bytes_per_token=0.0,
                                   expert_parallel_size=1)
    assert build_cost_model(gpt7b_config).per_token_s == gpt7b_config.linear_s_per_token  # exactly b
    assert_defaults_change_nothing(gpt7b_config, explicit, MOE_KEYS, tmp_path)


def test_moe_keys_round_trip(tmp_path, mixtral_config):
    mixtral_config.save(tmp_path / "moe.yaml")
    assert all(key in mixtral_config.to_dict() for key in MOE_KEYS)
    assert CostConfig.load(tmp_path / "moe.yaml") == mixtral_config


# ---------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "changes,match",
    [
        ({"moe_expert_s_per_token": -1e-4}, "cost key 'moe_expert_s_per_token' = -0.0001 must be >= 0"),
        ({"moe_a2a_bytes_per_token": -1.0}, "cost key 'moe_a2a_bytes_per_token' = -1.0 must be >= 0"),
        ({"expert_parallel_size": 0}, "cost key 'expert_parallel_size' = 0 must be >= 1 and divide world_size = 64"),
        ({"expert_parallel_size": -8}, "cost key 'expert_parallel_size' = -8 must be >= 1"),
        ({"expert_parallel_size": 3}, "cost key 'expert_parallel_size' = 3 must be >= 1 and divide world_size = 64"),
        ({"expert_parallel_size": 8.0}, "key 'expert_parallel_size' = 8.0 must be an integer"),
        ({"expert_parallel_size": 1}, "cost key 'moe_a2a_bytes_per_token' = 1835000.0 needs expert_parallel_size > 1"),
        ({"world_size": 12}, "cost key 'expert_parallel_size' = 8 must be >= 1 and divide world_size = 12"),
    ],
)
def test_bad_moe_values_name_the_key(mixtral_config, changes, match):
    with pytest.raises(DhpError, match=match):
        dataclasses.replace(mixtral_config, **changes)


def test_bad_moe_value_from_yaml_names_key_and_file(tmp_path, mixtral_config):
    path = tmp_path / "moe.yaml"
    keys = {**mixtral_config.to_dict(), "expert_parallel_size": 5}
    path.write_text("\n".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()))
    with pytest.raises(DhpError, match=r"moe.yaml': cost key 'expert_parallel_size' = 5 must be >= 1 and divide"):
        CostConfig.load(path)
    with pytest.raises(DhpError, match="'expert_parallel_size' = 8 must be >= 1 and divide world_size = 4"):
        mixtral_config.with_overrides(world_size=4)


# ---------------------------------------------------------------------- the preset through the CLI
def test_plan_and_simulate_run_the_mixtral_preset(tmp_path, capsys, mixtral_config):
    out = tmp_path / "plan.json"
    assert main(["plan", "--cost", "mixtral-8x7b-64", "--dist", "wlbllm", "--global-batch", "128", "--out", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert (obj["world_size"], obj["max_tokens_per_rank"]) == (64, 4096)
    cfg = mixtral_config.to_dict()
    assert obj["predicted_step_time_s"] == pytest.approx(reference_eval.step_time(cfg, obj), rel=1e-6)
    assert obj["lower_bound_s"] == pytest.approx(reference_eval.lower_bound(cfg, obj["samples"]), rel=1e-6)
    assert main(["simulate", "--cost", "mixtral-8x7b-64", "--dist", "bimodal", "--global-batch", "64", "--batches", "1",
                 "--planners", "dhp,static,megatron-hcp,fcp-ref"]) == 0
    assert "cost mixtral-8x7b-64" in capsys.readouterr().out


# ---------------------------------------------------------------------- the bound on MoE domains
@pytest.mark.parametrize("overlap", [True, False])
def test_best_time_matches_exhaustive_search_with_moe(mixtral_config, overlap):
    model = build_cost_model(dataclasses.replace(mixtral_config, overlap_comm=overlap))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3000, 250_000, 100)
    samples = [Sample(i, int(n)) for i, n in enumerate(tokens)]
    work = model.sample_work(samples)
    lo = model.footprint(samples).min_degree()
    best_t, _ = model.best_time(tokens, work, lo=lo, hi=64)
    for i in range(len(tokens)):
        ds = np.arange(lo[i], 65)
        assert best_t[i] == pytest.approx(model.sample_time(tokens[i], work[i], ds, ds <= 8).min(), rel=1e-12)


@st.composite
def moe_problems(draw):
    """A small MoE domain (any EP dividing N, inside a node or not) and a batch up to N x M tokens a sample."""
    n = draw(st.integers(2, 16))
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    ep = draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))
    cap = draw(st.sampled_from([512, 2048]))
    lengths = draw(st.lists(st.integers(1, n * cap), min_size=1, max_size=30))
    moe = {"expert_parallel_size": ep, "moe_expert_s_per_token": draw(st.sampled_from([0.0, 3e-4, 3e-3])),
           "moe_a2a_bytes_per_token": 0.0 if ep == 1 else draw(st.sampled_from([0.0, 1.8e6, 5e8]))}
    return n, gpn, cap, draw(st.booleans()), moe, Batch.from_lengths(lengths), draw(st.integers(0, 2**32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_problems())
def test_lower_bound_holds_for_moe_plans(mixtral_config, problem):
    """The bound equals the oracle's and no valid plan (planned or random) beats it; plans time as the oracle."""
    n, gpn, cap, overlap, moe, batch, seed = problem
    cfg = dataclasses.replace(mixtral_config, world_size=n, gpus_per_node=gpn, max_tokens_per_rank=cap,
                              overlap_comm=overlap, **moe)
    model = build_cost_model(cfg)
    bound = model.lower_bound(batch.samples)
    samples = [s.to_dict() for s in batch.samples]
    assert bound == pytest.approx(reference_eval.lower_bound(cfg.to_dict(), samples), rel=1e-12)
    rng = random.Random(seed)
    plans = [run_planner(build_planner(p, {"dataset_max_tokens": max(batch.lengths)}), batch, model)
             for p in ("dhp", "static", "fcp-ref")]
    plans += [random_plan(batch, cfg.domain, rng) for _ in range(5)]
    for plan in plans:
        plan.validate()
        step = simulate(plan, model).step_time_s
        assert step >= bound * (1 - 1e-12), plan.summary()
        assert step == pytest.approx(reference_eval.step_time(cfg.to_dict(), plan.to_dict()), rel=1e-12), plan.summary()
