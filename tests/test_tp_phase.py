"""bench/tp_phase.py's per-group TP model: each sample at its fastest TP among those dividing its group, the
best degree and the bound searched over every degree (TP breaks the reference model's closed forms)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model
from megatron_dhp.workload.sample import Sample
from tests.bench_scripts import load_bench
from tests.configs import GPT7B
from tests.test_bound import assert_best_bound_holds

tp_phase = load_bench("tp_phase")
CONFIG = replace(GPT7B, world_size=16, tp_efficiency=0.9, **tp_phase.GPT7B)


@pytest.mark.parametrize("reshard", [False, True])
def test_a_sample_runs_at_its_fastest_tp_dividing_its_group(reshard):
    model = tp_phase.PerGroupTP(CONFIG, reshard)
    samples = [Sample(0, 1024), Sample(1, 100_000)]
    tokens, work = np.array([1024.0, 100_000.0]), model.sample_work(samples)
    for d, intra in ((1, True), (6, True), (8, True), (12, False), (16, False)):
        expected = build_cost_model(CONFIG).sample_time(tokens, work, d, intra)
        for t in (2, 4, 8):
            if d % t == 0:
                position = build_cost_model(replace(CONFIG, tensor_parallel=t))
                at_t = position.sample_time(tokens, position.sample_work(samples), d // t, intra)
                expected = np.minimum(expected, at_t + model.reshard_s[t])
        np.testing.assert_allclose(model.sample_time(tokens, work, d, intra), expected, rtol=1e-12)
    # the long sample across nodes is faster at a TP above 1, the short one inside a node at TP 1
    assert model.sample_time(tokens, work, 16, False)[1] < build_cost_model(CONFIG).sample_time(tokens, work, 16, False)[1]
    assert model.sample_time(tokens, work, 1, True)[0] == build_cost_model(CONFIG).sample_time(tokens, work, 1, True)[0]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 30), reshard=st.booleans())
def test_the_bound_stays_a_bound_with_per_group_tp(seed, size, reshard):
    assert_best_bound_holds(tp_phase.PerGroupTP(CONFIG, reshard), seed, size)
