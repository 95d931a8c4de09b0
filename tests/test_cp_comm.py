"""The all-to-all (Ulysses) comm form of the cost model: its formula by hand, the best degree still the best,
the bound still a bound, a bad form a clear error; ring stays the default and the reference files' form."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model
from megatron_dhp.errors import DhpError
from megatron_dhp.workload.sample import Sample
from tests.configs import GPT7B
from tests.test_bound import assert_best_bound_holds

BASE = GPT7B
ULYSSES_BYTES = 4 * 2 * 4096 * 2 * 32
"""4 all-to-alls (q, k, v, out) each way of one token's bf16 hidden state, 32 layers."""


def test_ring_is_the_default_and_reference_files_do_not_state_it():
    assert BASE.cp_comm == "ring" and "cp_comm" not in BASE.to_dict()


@pytest.mark.parametrize("overlap", [False, True])
def test_all_to_all_comm_by_hand(overlap):
    config = replace(BASE, cp_comm="all-to-all", comm_bytes_per_token=ULYSSES_BYTES, overlap_comm=overlap)
    model = build_cost_model(config)
    tokens = np.array([2048.0, 131072.0])
    work = model.sample_work([Sample(0, 2048), Sample(1, 131072)])
    for d, intra in ((1, True), (2, True), (8, True), (16, False), (64, False)):
        bw = BASE.intra_node_bytes_per_s if intra else BASE.inter_node_bytes_per_s
        comm = ULYSSES_BYTES * tokens / d * (d - 1) / d / bw  # each rank's L / d tokens, (d - 1) / d leave it
        expected = np.maximum(work / d, comm) if overlap else work / d + comm
        np.testing.assert_allclose(model.sample_time(tokens, work, d, intra), expected, rtol=1e-12)
    ring = build_cost_model(replace(config, cp_comm="ring"))
    assert np.all(model.sample_time(tokens, work, 16, False) <= ring.sample_time(tokens, work, 16, False))


@pytest.mark.parametrize("overlap", [False, True])
def test_the_best_degree_is_the_brute_force_minimum(overlap):
    config = replace(BASE, cp_comm="all-to-all", comm_bytes_per_token=ULYSSES_BYTES, overlap_comm=overlap,
                     inter_node_bytes_per_s=2e9)
    model = build_cost_model(config)
    lengths = [64, 512, 3000, 20000, 70000, 250000]
    tokens = np.array(lengths, dtype=np.float64)
    work = model.sample_work([Sample(i, n) for i, n in enumerate(lengths)])
    lo = np.maximum(1, np.ceil(tokens / BASE.max_tokens_per_rank)).astype(np.int64)
    best_t, best_d = model.best_time(tokens, work, lo=lo, hi=64)
    table = model.time_table(tokens, work, np.arange(1, 65))
    table[np.arange(64)[None, :] + 1 < lo[:, None]] = np.inf
    np.testing.assert_allclose(best_t, table.min(axis=1), rtol=1e-12)
    np.testing.assert_allclose(table[np.arange(len(lengths)), best_d - 1], best_t, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 40), overlap=st.booleans())
def test_the_bound_stays_a_bound_under_all_to_all(seed, size, overlap):
    config = replace(BASE, world_size=16, cp_comm="all-to-all", comm_bytes_per_token=ULYSSES_BYTES,
                     overlap_comm=overlap)
    assert_best_bound_holds(build_cost_model(config), seed, size)


def test_an_unknown_comm_form_is_a_clear_error():
    with pytest.raises(DhpError, match="'cp_comm' = 'ulysses' is unknown; use one of ring, all-to-all"):
        replace(BASE, cp_comm="ulysses")
