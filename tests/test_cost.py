"""The reference cost model against hand-computed values and the loop-by-loop oracle."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from megatron_dhp.cli import main
from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.errors import DhpError
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload import Batch, Sample, VisualItem
from tests import reference_eval

# The optional terms s, lambda and sigma, all nonzero, so the oracle checks see each of them.
EXTRAS = {"sample_overhead_s": 0.004, "cp_microbatch_overhead_s": 0.03, "step_overhead_s": 0.007}


def test_preset_matches_benchmark(gpt7b_config):
    c = gpt7b_config
    assert (c.world_size, c.gpus_per_node, c.max_tokens_per_rank) == (64, 8, 8192)
    assert c.attn_s_per_token2 == 5.128e-9 and c.linear_s_per_token == 1.84e-4
    assert c.microbatch_overhead_s == 0.05 and c.comm_bytes_per_token == 1.5e6
    assert c.intra_node_bytes_per_s == 150e9 and c.inter_node_bytes_per_s == 20e9
    assert c.overlap_comm is True and c.enc_attn_s_per_token2 == 2.0e-9 and c.enc_linear_s_per_token == 6.0e-5


def test_sample_time_by_hand(gpt7b):
    # L = 8192 on one rank: 5.128e-9 * 8192^2 + 1.84e-4 * 8192, no communication.
    assert gpt7b.sample_time(8192, gpt7b.sample_work([Sample(0, 8192)]), 1, True)[0] == pytest.approx(
        0.34413 + 1.507328, rel=1e-4
    )
    # L = 100000 on 16 ranks across nodes: compute = (51.28 + 18.4) / 16 = 4.355; comm = 1.5e6 * 1e5 * 15/16 / 20e9 = 7.03125
    work = gpt7b.sample_work([Sample(0, 100_000)])
    assert gpt7b.sample_time(100_000, work, 16, False)[0] == pytest.approx(7.03125)
    # the same group inside one node (bw 150e9): comm = 0.9375 < compute 4.355
    assert gpt7b.sample_time(100_000, work, 16, True)[0] == pytest.approx(69.68 / 16)


def test_images_add_encoder_terms(gpt7b):
    work = gpt7b.sample_work([Sample(0, 2048, (VisualItem.short(1024, 4), VisualItem.short(256, 4)))])[0]
    text = 5.128e-9 * 2048**2 + 1.84e-4 * 2048
    enc = 2e-9 * (1024**2 + 256**2) + 6e-5 * (1024 + 256)
    assert work == pytest.approx(text + enc)


def test_no_overlap_adds(gpt7b_config):
    model = build_cost_model(dataclasses.replace(gpt7b_config, overlap_comm=False))
    work = model.sample_work([Sample(0, 100_000)])
    assert model.sample_time(100_000, work, 16, False)[0] == pytest.approx(69.68 / 16 + 7.03125)


@pytest.mark.parametrize("overlap", [True, False])
def test_best_time_matches_exhaustive_search(gpt7b_config, overlap):
    cfg = dataclasses.replace(gpt7b_config, overlap_comm=overlap)
    model = build_cost_model(cfg)
    rng = np.random.default_rng(0)
    samples = [Sample(i, int(n), tuple(VisualItem.short(int(p), 1) for p in rng.integers(256, 4096, rng.integers(0, 3))))
               for i, n in enumerate(rng.integers(5000, 500_000, 200))]
    tokens, work = np.array([s.tokens for s in samples]), model.sample_work(samples)
    lo = model.footprint(samples).min_degree()
    best_t, best_d = model.best_time(tokens, work, lo=lo, hi=64)
    for i in range(len(samples)):
        ds = np.arange(lo[i], 65)
        t = model.sample_time(tokens[i], work[i], ds, ds <= 8)
        assert best_t[i] == pytest.approx(t.min(), rel=1e-12)
        assert model.sample_time(tokens[i], work[i], best_d[i], best_d[i] <= 8) == pytest.approx(t.min(), rel=1e-12)


@pytest.mark.parametrize("extras", [{}, EXTRAS])
@pytest.mark.parametrize("overlap", [True, False])
def test_lower_bound_matches_oracle(gpt7b_config, overlap, extras):
    cfg = dataclasses.replace(gpt7b_config, overlap_comm=overlap, world_size=24, **extras)
    model = build_cost_model(cfg)
    rng = np.random.default_rng(1)
    samples = [Sample(i, int(n), (VisualItem.short(int(rng.integers(256, 16384)), 1),) if i % 3 == 0 else ())
               for i, n in enumerate(rng.integers(17000, 150_000, 60))]
    oracle = reference_eval.lower_bound(cfg.to_dict(), [s.to_dict() for s in samples])
    assert model.lower_bound(samples) == pytest.approx(oracle, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_simulate_matches_oracle_on_random_plans(gpt7b_config, seed):
    """Random groups (any size, placement and phase, barrier or not) with s, lambda and sigma all set."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 8, 12, 16])
    cfg = dataclasses.replace(gpt7b_config, world_size=n, gpus_per_node=rng.choice([1, 2, 4, 8]), max_tokens_per_rank=2048,
                              overlap_comm=rng.random() < 0.5, **EXTRAS)
    model = build_cost_model(cfg)
    samples = tuple(Sample(i, L, (VisualItem.short(L // 4, 1),) if L >= 64 and i % 3 == 0 else ())
                    for i, L in enumerate(rng.randint(1, n * 2048) for _ in range(rng.randint(1, 25))))
    for _ in range(10):
        plan = dataclasses.replace(random_plan(Batch(samples), cfg.domain, rng), phase_barrier=rng.random() < 0.5)
        assert simulate(plan, model).step_time_s == pytest.approx(
            reference_eval.step_time(cfg.to_dict(), plan.to_dict()), rel=1e-12), plan.summary()


def test_lower_bound_longest_sample_term(gpt7b):
    # One 100K sample alone: LB is m + the best t over feasible d (13..64).
    samples = [Sample(0, 100_000)]
    work = gpt7b.sample_work(samples)
    ds = np.arange(13, 65)
    best = gpt7b.sample_time(100_000, work, ds, ds <= 8).min()
    assert gpt7b.lower_bound(samples) == pytest.approx(0.05 + best)


def test_min_degree(gpt7b):
    samples = [Sample(i, n) for i, n in enumerate([1, 8192, 8193, 124_913])]
    assert list(gpt7b.footprint(samples).min_degree()) == [1, 1, 2, 16]


def test_is_intra(gpt7b):
    assert gpt7b.is_intra([0, 1, 7]) and not gpt7b.is_intra([7, 8]) and gpt7b.is_intra([8, 9, 10])


# ---------------------------------------------------------------------- YAML
def _write(tmp_path, text):
    p = tmp_path / "cost.yaml"
    p.write_text(text)
    return p


def _preset_text(gpt7b_config, **changes) -> str:
    d = {**gpt7b_config.to_dict(), **changes}
    return "\n".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items() if v is not None)


def test_yaml_roundtrip(tmp_path, gpt7b_config):
    p = tmp_path / "c.yaml"
    gpt7b_config.save(p)
    assert CostConfig.load(p) == gpt7b_config


def test_yaml_unknown_key_suggests(tmp_path, gpt7b_config):
    p = _write(tmp_path, _preset_text(gpt7b_config) + "\nmax_token_per_rank: 4096")
    with pytest.raises(DhpError, match="unknown key 'max_token_per_rank'; did you mean 'max_tokens_per_rank'"):
        CostConfig.load(p)


def test_yaml_missing_key(tmp_path, gpt7b_config):
    text = "\n".join(line for line in _preset_text(gpt7b_config).splitlines() if not line.startswith("linear_s"))
    with pytest.raises(DhpError, match="missing key 'linear_s_per_token'"):
        CostConfig.load(_write(tmp_path, text))


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("attn_s_per_token2", "fast", "'attn_s_per_token2' = 'fast' must be a number"),
        ("overlap_comm", "1", "'overlap_comm' = 1 must be true or false"),
        ("world_size", "0", "world_size = 0 must be an integer >= 1"),
        ("world_size", "4.5", "key .world_size. = 4.5 must be an integer"),
        ("kind", "magic", "cost kind 'magic' is unknown"),
        ("inter_node_bytes_per_s", "0", "must be > 0"),
        ("linear_s_per_token", "-1.0", "must be >= 0"),
    ],
)
def test_yaml_wrong_values(tmp_path, gpt7b_config, key, value, match):
    with pytest.raises(DhpError, match=match):
        CostConfig.load(_write(tmp_path, _preset_text(gpt7b_config, **{key: value})))


def test_a_bad_value_gets_one_message_from_python_and_from_yaml(tmp_path, gpt7b_config):
    with pytest.raises(DhpError) as direct:
        dataclasses.replace(gpt7b_config, overlap_comm="sometimes")
    with pytest.raises(DhpError) as loaded:
        CostConfig.load(_write(tmp_path, _preset_text(gpt7b_config, overlap_comm="sometimes")))
    assert str(direct.value) == "key 'overlap_comm' = 'sometimes' must be true or false"
    assert str(loaded.value).endswith(f".yaml': {direct.value}")


def test_yaml_not_a_mapping_and_invalid(tmp_path):
    with pytest.raises(DhpError, match="expected a mapping"):
        CostConfig.load(_write(tmp_path, "- 1\n- 2\n"))
    # the place of the error, and where the construct it broke began
    with pytest.raises(DhpError, match=r"is not valid YAML at line 3, column 1: expected ',' or '\]', but got "
                                       r"'<stream end>' \(a flow sequence from line 2, column 4\)"):
        CostConfig.load(_write(tmp_path, "b: 1\na: [1, 2\n"))
    with pytest.raises(DhpError, match="is not valid YAML at line 2, column 4: mapping values are not allowed here"):
        CostConfig.load(_write(tmp_path, "b: 1\n  a: 2\n"))


def test_a_model_whose_tokens_take_no_time_is_refused_in_one_line(tmp_path, gpt7b_config):
    # It passed the checks, and plan and simulate then divided by a bound of 0 (ZeroDivisionError).
    text = _preset_text(gpt7b_config, attn_s_per_token2="0.0", linear_s_per_token="0.0")
    with pytest.raises(DhpError, match="'attn_s_per_token2' and 'linear_s_per_token' are both 0: a token would take no"):
        CostConfig.load(_write(tmp_path, text))
    assert main(["plan", "--cost", str(tmp_path / "cost.yaml"), "--dist", "wlbllm"]) == 2


def test_yaml_never_constructs_objects(tmp_path):
    with pytest.raises(DhpError):
        CostConfig.load(_write(tmp_path, "kind: !!python/object/apply:os.system ['true']\n"))


def test_unknown_preset_lists_presets():
    with pytest.raises(DhpError, match="presets: .*gpt7b-64"):
        CostConfig.load("no-such-preset")


def test_overrides_and_world_size_below_one(gpt7b_config):
    c = gpt7b_config.with_overrides(world_size=48, gpus_per_node=None)
    assert c.world_size == 48 and c.gpus_per_node == 8
    with pytest.raises(DhpError, match="world_size = 0 must be an integer >= 1"):
        gpt7b_config.with_overrides(world_size=0)
