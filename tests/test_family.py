"""The group family: bounded membership, determinism, every size placeable, and dhp plans only with it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, _windows, group_family, straddling_sizes
from megatron_dhp.solver import PlannerUnsupported, build_planner, run_planner
from megatron_dhp.workload import LengthSource
from tests.solver.conftest import model_for

DOMAINS = [(n, g) for n in (1, 2, 3, 5, 8, 48, 64, 1024, 16384) for g in (4, 8, 72)]


def slack_bound(family, d: int) -> int:
    """The most ranks the module promises a sample of degree d: one ladder step up (whole nodes from 2g)."""
    n, g, step = family.world_size, family.gpus_per_node, 1 + 1 / family.steps_per_octave
    if d < 2 * g:
        return min(n, math.floor(d * step), 2 * g) if d > g else min(n, math.floor(d * step), g)
    return min(n, g * math.ceil(math.ceil(d / g) * step))


@pytest.mark.parametrize("n,g", DOMAINS)
def test_invariants(n, g):
    family = group_family(n, g)
    assert family.max_membership <= DEFAULT_MAX_GROUPS_PER_RANK
    assert int(family.membership.max(initial=0)) == family.max_membership
    assert len(set(family.windows)) == len(family.windows)  # no duplicate groups
    assert list(family.windows) == sorted(family.windows, key=lambda w: (w[1], w[0]))  # one creation order
    rebuilt = group_family.__wrapped__(n, g)  # built afresh, not the cached one
    assert rebuilt == family and rebuilt.groups == family.groups
    for start, size in family.windows:
        assert 2 <= size <= n and 0 <= start and start + size <= n
        first, last = start // g, (start + size - 1) // g
        if size <= g and first != last:  # across a node boundary: a domain tiling of a size that fits once
            assert size in straddling_sizes(g, list(family.sizes)) and start % size == 0, (start, size)
        elif size >= 2 * g and size != n:
            assert start % g == 0 and ((start + size) % g == 0 or start + size == n), (start, size)  # whole nodes
    for d in range(1, n + 1, max(1, n // 512)):
        size = family.ceil_size(d)
        assert d <= size <= slack_bound(family, d), (d, size)
        assert len(family.starts(size)) and family.contains(family.placements(size)[0])


def test_sizes_over_half_a_node_tile_the_domain_across_nodes():
    family = group_family(64, 8)
    assert straddling_sizes(8, list(family.sizes)) == [5, 6, 7]
    for s in (5, 6, 7):
        assert all(family.contains(tuple(range(a, a + s))) for a in range(0, 64 - s + 1, s))  # 10 of 6 side by side
        assert all(family.contains(tuple(range(a, a + s))) for a in range(0, 64, 8))  # and one inside each node


def test_cells_and_power_of_two_blocks_are_in_it():
    for n, g in ((64, 8), (48, 8), (1024, 8), (64, 4)):
        family = group_family(n, g)
        for c in (d for d in range(2, g + 1) if g % d == 0):  # dhp's cells, at cell-aligned offsets
            assert all(family.contains(tuple(range(a, a + c))) for a in range(0, n - c + 1, c))
        size = 2
        while size < n:  # megatron-core's hybrid CP blocks
            assert all(family.contains(tuple(range(a, a + size))) for a in range(0, n - size + 1, size)), size
            size *= 2
        assert family.contains(tuple(range(n)))


def test_contains_and_queries():
    family = group_family(64, 8)
    assert family.contains((5,)) and family.contains((1, 0)) and not family.contains((0, 2))
    assert not family.contains(tuple(range(1, 4))) or (1, 3) in family.windows
    assert family.largest_at(0, 64) == 64 and family.largest_at(0, 63) == 56 and family.largest_at(3, 1) == 1
    assert family.sizes[0] == 1 and family.sizes[-1] == 64


def test_membership_at_scale():
    family = group_family.__wrapped__(16384, 8)
    rows = {n: group_family(n, 8) for n in (64, 1024, 16384)}
    assert family.max_membership <= 32 and rows[64].steps_per_octave == 8


def test_too_small_a_bound_is_a_clear_error():
    with pytest.raises(DhpError, match="max_groups_per_rank = 3 is below"):
        group_family(1024, 8, 3)
    assert len(_windows(1, 8, 8)) == 0


@pytest.mark.parametrize("n,dist", [(64, "wlbllm"), (48, "bimodal"), (256, "wlbllm"), (40, "giant"), (13, "multimodal")])
def test_dhp_plans_only_with_the_family(n, dist):
    model = model_for(n, 8)
    family = group_family(n, 8)
    for k in range(2):
        batch = LengthSource.from_args(dist=dist).draw(global_batch=256, seed=1, index=k, capacity=model.domain.capacity)
        plan = run_planner(build_planner("dhp"), batch, model, family=family)
        assert all(family.contains(g.ranks) for g in plan.groups), plan.summary()
        again = run_planner(build_planner("dhp"), batch, model, family=family)
        assert again.to_dict(timings=False) == plan.to_dict(timings=False)


def test_dhp_with_the_family_under_pipeline_parallelism():
    model = model_for(64, 8)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=256, seed=2, capacity=model.domain.capacity)
    plan = run_planner(build_planner("dhp"), batch, model, family=group_family(64, 8), pipeline_stages=4)
    assert all(group_family(64, 8).contains(g.ranks) for g in plan.groups)


def test_without_a_family_dhp_forms_any_window_and_the_family_costs_at_most_one_percent():
    model = model_for(64, 8)
    batch = LengthSource.from_args(dist="lognormal-pareto").draw(global_batch=512, seed=0, capacity=model.domain.capacity)
    off = run_planner(build_planner("dhp"), batch, model)
    assert not all(group_family(64, 8).contains(g.ranks) for g in off.groups)  # windows of any size and offset
    on = run_planner(build_planner("dhp"), batch, model, family=group_family(64, 8))
    assert on.predicted_step_time_s <= 1.01 * off.predicted_step_time_s


def test_peers_are_held_to_the_family_on_request():
    model = model_for(64, 8)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=512, seed=0, capacity=model.domain.capacity)
    static = run_planner(build_planner("static"), batch, model, family=group_family(64, 8))  # unchanged
    assert static.groups == run_planner(build_planner("static"), batch, model).groups
    with pytest.raises(PlannerUnsupported, match="not in the fixed group family"):
        run_planner(build_planner("fcp-ref"), batch, model, family=group_family(64, 8))
    assert np.all(group_family(8, 8).membership >= 1)


def test_runs_that_are_not_family_groups_are_cut_into_family_groups():
    from megatron_dhp.solver.dhp.instance import Instance
    from megatron_dhp.solver.dhp.layout import Skyline, open_bins
    from megatron_dhp.workload import Batch

    family = group_family(8, 8)
    inst = Instance.from_batch(Batch.from_lengths([100]), model_for(8, 8), family=family)
    skyline = Skyline.empty(8)
    skyline.ready[[0, 7]] = 1.0  # ranks 1-6 free first: a run of 6 at rank 1, which is no family group
    bins = open_bins(inst, skyline, 8)
    assert all(family.contains(b.ranks) for b in bins)
    assert sorted(r for b in bins for r in b.ranks) == list(range(8))


@pytest.mark.parametrize("n,g", [(64, 8), (48, 8), (13, 4), (1024, 8)])
def test_first_free_is_the_first_window_whose_positions_are_all_free(n, g):
    family = group_family(n, g)
    rng = np.random.default_rng(n)
    for _ in range(20):
        free_positions = rng.random(n) < rng.uniform(0.3, 1.0)
        mask = sum(1 << r for r in np.flatnonzero(free_positions).tolist())
        for size in family.sizes:
            expected = next((a for a in family.starts(size).tolist() if free_positions[a:a + size].all()), None)
            assert family.first_free(size, mask) == expected, (size, expected)
    assert family.first_free(7 * n, (1 << n) - 1) is None  # no such size
