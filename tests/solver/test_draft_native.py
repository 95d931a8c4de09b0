"""dhp's draft loops in C (`csrc/solver/draft.c`) give the plans the Python gives, to the last bit."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import CostConfig, build_cost_model
from megatron_dhp.plan.family import group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.dhp import native
from megatron_dhp.solver.dhp.fill import fill_in_order
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import (
    DraftGroup,
    Skyline,
    Windows,
    choose_window,
    fill_holes,
    native_choose_window,
)
from megatron_dhp.workload import LengthSource
from tests.solver.test_dhp import problems

needs_native = pytest.mark.skipif(native.draft is None, reason="the C extension was not built (no C compiler)")


def test_the_extension_is_built_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert native.draft is not None, "pip install -e . should have compiled csrc/solver/draft.c"


def plans_both_ways(monkeypatch, batch, model, family=None, pipeline_stages=1):
    """The plan with the C loops and with the Python ones (timings left out)."""
    native_plan = run_planner(build_planner("dhp"), batch, model, family=family, pipeline_stages=pipeline_stages)
    with monkeypatch.context() as patch:
        patch.setattr(native, "draft", None)
        python_plan = run_planner(build_planner("dhp"), batch, model, family=family, pipeline_stages=pipeline_stages)
    return native_plan.to_dict(timings=False), python_plan.to_dict(timings=False)


VARIANTS = ({}, {"overlap_comm": False}, {"gpus_per_node": 4}, {"max_tokens_per_rank": 4096},
            {"microbatch_overhead_s": 0.2}, {"rank_speeds": (0.5,) + (1.0,) * 63},
            {"rank_speeds": (1.0,) * 32 + (0.45,) * 32})


@needs_native
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "reference")
@pytest.mark.parametrize("dist", ["wlbllm", "bimodal", "multimodal", "lognormal-pareto"])
def test_same_plans_on_the_benchmark_batches(monkeypatch, variant, dist):
    # The solver bench's 512 samples on 64 ranks, where the search builds the most drafts (rebuilds,
    # multifit, columns, holes) and, with speeds, weighs windows by speed.
    model = build_cost_model(CostConfig.load("gpt7b-64").with_overrides(**variant))
    batch = LengthSource.from_args(dist=dist).draw(global_batch=512, seed=0, index=1, capacity=model.domain.capacity)
    fast, slow = plans_both_ways(monkeypatch, batch, model)
    assert fast == slow


@needs_native
def test_same_plans_on_a_family_and_under_pipelining(monkeypatch, gpt7b):
    batch = LengthSource.from_args(dist="bimodal").draw(global_batch=256, seed=3, capacity=gpt7b.domain.capacity)
    fast, slow = plans_both_ways(monkeypatch, batch, gpt7b, family=group_family(64, 8, 8))
    assert fast == slow
    fast, slow = plans_both_ways(monkeypatch, batch, gpt7b, pipeline_stages=4)
    assert fast == slow


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problems(), st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.7]), min_size=80, max_size=80))
def test_same_plans_on_random_problems(monkeypatch, gpt7b_config, problem, speeds):
    n, gpn, cap, overlap, extras, batch = problem
    config = dataclasses.replace(gpt7b_config, world_size=n, gpus_per_node=gpn, max_tokens_per_rank=cap,
                                 overlap_comm=overlap, **extras)
    for rank_speeds in ((), tuple(speeds[:n])):
        model = build_cost_model(dataclasses.replace(config, rank_speeds=rank_speeds))
        fast, slow = plans_both_ways(monkeypatch, batch, model)
        assert fast == slow


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_choose_window_ties_and_limits(gpt7b, seed):
    # Ready times on a coarse grid, so windows tie on finish, waste and order: the tie-breaks must agree.
    rng = np.random.default_rng(seed)
    speeds = tuple(rng.choice([1.0, 0.5, 0.8], 64).tolist()) if seed % 2 else ()
    inst = Instance.from_batch(LengthSource.from_args(dist="wlbllm").draw(global_batch=64, seed=seed, capacity=gpt7b.domain.capacity),
                               gpt7b.with_speeds(speeds))
    degree = int(rng.integers(1, 9))
    w = Windows.of(inst, [d for d in range(degree, 2 * degree + 1)], 8, bool(seed % 3))
    ready = rng.integers(0, 4, 64).astype(np.float64)
    time = rng.integers(1, 3, len(w.start)).astype(np.float64)
    for by in (None, 2.0, 3.5, 100.0):
        for weighted in (False, True) if speeds and by is not None else (False,):
            args = (w, ready, time, by, inst.speeds if weighted else None)
            assert native_choose_window(*args) == choose_window(*args)


@needs_native
def test_bad_arrays_are_refused_by_name():
    with pytest.raises(TypeError, match="start: expected a C-contiguous int64 array"):
        native.draft.choose_window(np.zeros(4), np.zeros(2), np.ones(2, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                   np.zeros(2), np.zeros(2), None, None, None)
    with pytest.raises(ValueError, match="a window outside the ranks"):
        native.draft.choose_window(np.zeros(4), np.array([3]), np.array([2]), np.zeros(1, dtype=np.int64),
                                   np.zeros(1), np.zeros(1), None, None, None)


def random_bins(inst: Instance, rng: np.random.Generator) -> list[DraftGroup]:
    """Empty bins tiling the domain in runs of 1-8 ranks inside nodes, starting at uneven times (as
    `open_bins` leaves them after wide groups), each at its slowest rank's speed."""
    bins, r, gpn = [], 0, inst.model.domain.gpus_per_node
    while r < inst.num_ranks:
        size = int(min(rng.integers(1, 9), gpn - r % gpn, inst.num_ranks - r))
        speed = inst.speed(r, size)
        bins.append(DraftGroup(r, size, 0, float(rng.choice([0.0, 0.0, 0.5, 1.5])), inst.footprint.cap,
                               inst.overhead(size, speed), speed=speed))
        r += size
    return bins


def filled(bins: list[DraftGroup]) -> list[tuple]:
    return [(b.first, b.size, b.microbatches, b.rooms, b.finish_s) for b in bins]


@needs_native
@pytest.mark.parametrize("seed", range(30))
def test_fill_and_its_moves_match(monkeypatch, gpt7b_config, seed):
    # LPT's own order leaves the local moves nothing to do on every batch measured (the benches' 160 and 300
    # random problems: no move), so the items also go in shortest first, which leaves a latest bin to shorten.
    rng = np.random.default_rng(seed)
    speeds = tuple(rng.choice([1.0, 0.5, 0.8], 64).tolist()) if seed % 2 else ()
    batch = LengthSource.from_args(dist=("wlbllm", "bimodal", "multimodal")[seed % 4 % 3]).draw(
        global_batch=256, seed=seed, capacity=64 * 2048)
    # small M: a sample alone fills a microbatch, so a move empties one; a large m makes that matter
    config = gpt7b_config.with_overrides(max_tokens_per_rank=(8192, 2048, 32768)[seed % 3],
                                         microbatch_overhead_s=(0.0, 0.05, 0.2)[seed // 3 % 3], rank_speeds=speeds)
    inst = Instance.from_batch(batch, build_cost_model(config))
    items = np.flatnonzero(inst.min_degree <= 1)
    lpt = items[np.lexsort((inst.ids[items], -inst.tokens[items], -inst.work[items]))]
    max_moves = int(rng.integers(1, 300))
    compiled = native.draft
    for order in (lpt, lpt[::-1].copy()):
        results = []
        for draft in (compiled, None):
            monkeypatch.setattr(native, "draft", draft)
            bins = random_bins(inst, np.random.default_rng(seed))
            fill_in_order(inst, bins, order, floor_s=0.0, max_moves=max_moves)
            results.append(filled(bins))
        assert results[0] == results[1]


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_hole_fill_matches(monkeypatch, gpt7b, seed):
    rng = np.random.default_rng(seed)
    batch = LengthSource.from_args(dist="wlbllm").draw(global_batch=256, seed=seed, capacity=gpt7b.domain.capacity)
    inst = Instance.from_batch(batch, gpt7b)
    holes = [(int(r), float(s), float(s + rng.choice([0.1, 0.5, 2.0]))) for r, s in
             zip(rng.integers(0, 64, 40), rng.integers(0, 4, 40))]
    results = []
    for draft in (native.draft, None):
        monkeypatch.setattr(native, "draft", draft)
        skyline = Skyline.empty(64)
        skyline.holes = list(holes)
        groups, rest = fill_holes(inst, skyline, np.arange(len(inst.ids)))
        results.append((filled(groups), rest.tolist()))
    assert results[0] == results[1]
    assert results[0][0], "some sample went into a hole"
