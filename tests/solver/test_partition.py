"""The contiguous-partition DPs (FlexSP's Sequence Blaster and bucketing) against exhaustive search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dhp.solver.partition import PartitionDP, max_sum_partition, padding_cost


def all_splits(n: int, parts: int):
    for inner in itertools.combinations(range(1, n), parts - 1):
        yield [0, *inner, n]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(1, 50), min_size=1, max_size=8), data=st.data())
def test_max_sum_partition_is_optimal(values, data):
    parts = data.draw(st.integers(1, len(values)))
    v = np.array(sorted(values, reverse=True), dtype=float)
    cuts = max_sum_partition(v, parts)
    assert cuts[0] == 0 and cuts[-1] == len(v) and len(cuts) == parts + 1
    assert all(a < b for a, b in zip(cuts[:-1], cuts[1:]))  # every run non-empty
    worst = max(v[a:b].sum() for a, b in zip(cuts[:-1], cuts[1:]))
    assert worst == min(max(v[a:b].sum() for a, b in zip(c[:-1], c[1:])) for c in all_splits(len(v), parts))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_padding_layers_are_optimal(values):
    v = np.array(sorted(values), dtype=float)
    dp = PartitionDP(padding_cost(v), np.add)

    def padding(c):
        return sum((b - a) * v[b - 1] - v[a:b].sum() for a, b in zip(c[:-1], c[1:]))

    for parts, best in dp.layers(len(v)):
        assert best == pytest.approx(min(padding(c) for c in all_splits(len(v), parts)))
        assert padding(dp.cuts(parts)) == pytest.approx(best)
