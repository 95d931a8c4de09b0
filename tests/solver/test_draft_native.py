"""dhp's draft loops in C (`csrc/solver/draft.c`) give the results the Python gives, to the last bit.

Property tests: each of the three loops on freely drawn inputs (`Drawn` stands in for an `Instance`, its
times on a coarse grid mixed with arbitrary floats, so that finishes, loads and rooms tie as often as they
differ, which puts the tie-breaks of `native`'s docstring to work), then the whole planner on random
batches, domains, caps, rank speeds, families and pipelines. Every float is compared by its bits.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dhp.cost import build_cost_model
from megatron_dhp.errors import DhpError
from megatron_dhp.plan.family import group_family
from megatron_dhp.solver import build_planner, run_planner
from megatron_dhp.solver.dhp import fill, layout, native, scatter
from megatron_dhp.solver.dhp.layout import (
    DraftGroup,
    Skyline,
    Windows,
    choose_window,
    fill_holes,
    native_choose_window,
)
from megatron_dhp.workload import LengthSource
from tests.configs import GPT7B
from tests.solver.test_dhp import problems

needs_native = pytest.mark.skipif(native.draft is None, reason="the C extension was not built (no C compiler)")
PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

GRID = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)
SPEEDS = (0.5, 0.7, 1.0)


def seconds(low: float = 0.0) -> st.SearchStrategy[float]:
    """Mostly on a coarse grid (sums of grid values tie exactly), else any float in [low, 4]."""
    grid = st.sampled_from([s for s in GRID if s >= low])
    return st.one_of(grid, grid, st.floats(low, 4.0, allow_nan=False, allow_infinity=False, allow_subnormal=False))


def palette(draw, values: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    """One of a few values drawn once: lists of it repeat values, as a sample's seconds on windows of one
    size or the free times of ranks that ended one group do."""
    return st.sampled_from(draw(st.lists(values, min_size=1, max_size=3)))


def exact(value):
    """`value` with every float as its bits (float.hex), so that == compares to the last bit (and -0.0 != 0.0)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [exact(v) for v in value]
    return value


@contextmanager
def in_python():
    """The draft loops' Python (as where the install built no C)."""
    with mock.patch.object(native, "draft", None):
        yield


def both_ways(run, *args):
    """`run(*args)` with the C loops, then with the Python ones, each result by its bits."""
    compiled = exact(run(*args))
    with in_python():
        return compiled, exact(run(*args))


@dataclasses.dataclass
class Drawn:
    """What the draft loops read of an `Instance`, drawn freely: each sample's memory (`footprint`: shared,
    held, cap), minimum degree and id, its seconds per (size, placement, speed) class (`tables`), a
    microbatch's overhead per size (over the speed), and the domain (ranks, speeds, a family of windows)."""

    num_ranks: int
    gpus_per_node: int
    speeds: np.ndarray
    footprint: SimpleNamespace
    min_degree: np.ndarray
    ids: np.ndarray
    per_size: list[float]
    tables: dict = dataclasses.field(default_factory=dict)
    family: SimpleNamespace | None = None
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def model(self) -> SimpleNamespace:
        return SimpleNamespace(domain=SimpleNamespace(gpus_per_node=self.gpus_per_node))

    @property
    def nominal(self) -> bool:
        return bool((self.speeds == 1.0).all())

    @property
    def loads(self) -> tuple[list[int], list[int]]:
        return self.footprint.shared.tolist(), self.footprint.held.tolist()

    def load(self, item: int, size: int) -> int:
        return int(self.footprint.shared[item] + size * self.footprint.held[item])

    def overhead(self, size: int, speed: float = 1.0) -> float:
        return self.per_size[size] / speed

    def speed(self, first: int, size: int) -> float:
        return float(self.speeds[first : first + size].min())

    def times(self, size: int, intra: bool, speed: float = 1.0) -> np.ndarray:
        return self.tables[size, intra, speed]


@st.composite
def domains(draw, max_ranks: int, max_items: int) -> Drawn:
    """A domain of up to `max_ranks` ranks (nominal or with slow ranks) and up to `max_items` samples whose
    loads are about a cap, some of them over it (a microbatch of their own, its room negative)."""
    n = draw(st.integers(1, max_ranks))
    count = draw(st.integers(1, max_items))
    cap = draw(st.sampled_from([2, 4, 16]))
    speeds = draw(st.one_of(st.just([1.0] * n), st.lists(st.sampled_from(SPEEDS), min_size=n, max_size=n)))
    items = st.lists(st.integers(0, 2 * cap), min_size=count, max_size=count)
    return Drawn(n, draw(st.sampled_from([1, 2, 4, 8])), np.array(speeds),
                 SimpleNamespace(shared=np.array(draw(items), dtype=np.int64),
                                 held=np.array(draw(st.lists(st.integers(0, 2), min_size=count, max_size=count)),
                                               dtype=np.int64), cap=cap),
                 np.ones(count, dtype=np.int64), np.array(draw(st.permutations(range(count))), dtype=np.int64),
                 draw(st.lists(seconds(), min_size=n + 1, max_size=n + 1)))


def draw_tables(draw, inst: Drawn, keys) -> None:
    """Every sample's seconds on each (size, placement, speed) class of `keys`."""
    for key in sorted(set(keys)):
        inst.tables[key] = np.array(draw(st.lists(seconds(0.25), min_size=len(inst.ids), max_size=len(inst.ids))))


@st.composite
def window_choices(draw):
    """`place_wide`'s question for one sample: a domain, the windows of a few sizes (any subset of each size's
    starts, as a family has), when each rank is free, the sample's seconds on each window, and `by` / speeds."""
    inst = draw(domains(16, 1))
    if draw(st.booleans()):  # slow ranks half the time: windows then weigh their ranks' speeds
        inst.speeds = np.array(draw(st.lists(st.sampled_from(SPEEDS), min_size=inst.num_ranks, max_size=inst.num_ranks)))
    n = inst.num_ranks
    sizes = sorted(draw(st.sets(st.integers(1, n), min_size=1, max_size=4)))
    starts = {d: np.array(sorted(draw(st.sets(st.integers(0, n - d)))), dtype=np.int64) for d in sizes}
    if not any(len(s) for s in starts.values()):
        starts[sizes[0]] = np.array([draw(st.integers(0, n - sizes[0]))], dtype=np.int64)
    inst.family = SimpleNamespace(starts=starts.__getitem__)
    w = Windows.of(inst, sizes, 1, False)
    ready = np.array(draw(st.lists(palette(draw, seconds()), min_size=n, max_size=n)))
    time = np.array(draw(st.lists(palette(draw, seconds(0.25)), min_size=len(w.start), max_size=len(w.start))))
    by = draw(st.one_of(st.none(), seconds()))
    speeds = None if inst.nominal or not draw(st.booleans()) else inst.speeds
    return w, ready, time, by, speeds


@needs_native
@settings(PROPERTY, max_examples=300)
@given(window_choices())
def test_choose_window_matches(choice):
    # Python's choose_window ignores `speeds` without `by` (place_wide never passes them apart); the wrapper
    # hands the C the same question.
    compiled, python = native_choose_window(*choice), choose_window(*choice)
    assert exact(compiled) == exact(python)


@st.composite
def bin_fills(draw):
    """`fill_in_order`'s inputs: empty bins tiling a domain (runs of 1-8 ranks, across nodes or not, each at
    its slowest rank's speed and starting at a drawn time), the samples in any order (not only LPT's, which
    leaves the local moves little to do), a floor, a move budget and the scan's length."""
    inst = draw(domains(24, 40))
    bins, r = [], 0
    while r < inst.num_ranks:
        size = draw(st.integers(1, min(8, inst.num_ranks - r)))
        speed = inst.speed(r, size)
        bins.append(DraftGroup(r, size, 0, draw(seconds()), inst.footprint.cap, inst.overhead(size, speed), speed=speed))
        r += size
    widest = max(b.size for b in bins)
    inst.min_degree = np.array(draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, widest]), min_size=len(inst.ids),
                                             max_size=len(inst.ids))), dtype=np.int64)
    draw_tables(draw, inst, fill.bin_classes(inst, bins)[0])
    order = draw(st.permutations(range(len(inst.ids))))[: draw(st.integers(0, len(inst.ids)))]
    return (inst, bins, np.array(order, dtype=np.int64), draw(st.one_of(st.just(0.0), seconds())),
            draw(st.integers(0, 60)), draw(st.sampled_from([1, 2, 3, fill.SCAN])))


def groups_of(groups: list[DraftGroup]) -> list[tuple]:
    return [(g.first, g.size, g.microbatches, g.rooms, g.finish_s) for g in groups]


@needs_native
@settings(PROPERTY, max_examples=300)
@given(bin_fills())
def test_lpt_fill_and_its_moves_match(problem):
    inst, bins, order, floor_s, max_moves, scan = problem

    def run():
        fresh = [dataclasses.replace(b, microbatches=[], rooms=[]) for b in bins]
        try:
            fill.fill_in_order(inst, fresh, order, floor_s=floor_s, max_moves=max_moves)
        except AssertionError as error:  # a sample wider than every bin: refused both ways, by the same words
            return str(error)
        return groups_of(fresh)

    with mock.patch.object(fill, "SCAN", scan):
        compiled, python = both_ways(run)
    assert compiled == python


@st.composite
def hole_fills(draw):
    """`fill_holes`' inputs: waits (rank, free from, busy again at) on a domain, and samples (some needing
    two ranks) with their one-rank seconds."""
    inst = draw(domains(16, 30))
    inst.min_degree = np.array(draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=len(inst.ids),
                                             max_size=len(inst.ids))), dtype=np.int64)
    draw_tables(draw, inst, [(1, True, 1.0)])
    holes = draw(st.lists(st.tuples(st.integers(0, inst.num_ranks - 1), seconds(), seconds(0.25)), min_size=1, max_size=20))
    items = np.array(sorted(draw(st.sets(st.integers(0, len(inst.ids) - 1)))), dtype=np.int64)
    return inst, [(rank, start, start + length) for rank, start, length in holes], items


@needs_native
@settings(PROPERTY, max_examples=300)
@given(hole_fills())
def test_hole_fill_matches(problem):
    inst, holes, items = problem

    def run():
        skyline = Skyline.empty(inst.num_ranks)
        skyline.holes = list(holes)
        groups, rest = fill_holes(inst, skyline, items)
        return groups_of(groups), rest.tolist()

    compiled, python = both_ways(run)
    assert compiled == python


@needs_native
@settings(PROPERTY, max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problems(), st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.7]), min_size=80, max_size=80),
       st.sampled_from([0, 0, 8, 32]), st.sampled_from([1, 1, 2, 4]))
def test_same_plans_on_random_batches(gpt7b_config, problem, speeds, max_groups_per_rank, stages):
    # The whole planner (every draft, rebuild, multifit, column and hole fill of its search), on a family (of
    # at most 8 or 32 groups per rank) or not, pipelined or not, nominal and with slow ranks. Where it
    # refuses a batch, it refuses it both ways.
    n, gpn, cap, overlap, extras, batch = problem
    config = dataclasses.replace(gpt7b_config, world_size=n, gpus_per_node=gpn, max_tokens_per_rank=cap,
                                 overlap_comm=overlap, **extras)
    family = group_family(n, gpn, max_groups_per_rank) if max_groups_per_rank else None
    for rank_speeds in ((), tuple(speeds[:n])):
        model = build_cost_model(dataclasses.replace(config, rank_speeds=rank_speeds))
        compiled, python = both_ways(plan_or_refusal, batch, model, family, stages)
        assert compiled == python


def plan_or_refusal(batch, model, family=None, stages=1):
    """dhp's plan (timings left out), or the error it refuses the batch with."""
    try:
        return run_planner(build_planner("dhp"), batch, model, family=family, pipeline_stages=stages).to_dict(timings=False)
    except DhpError as error:
        return type(error).__name__, str(error)


VARIANTS = ({}, {"overlap_comm": False}, {"gpus_per_node": 4}, {"max_tokens_per_rank": 4096},
            {"microbatch_overhead_s": 0.2}, {"rank_speeds": (0.5,) + (1.0,) * 63},
            {"rank_speeds": (1.0,) * 32 + (0.45,) * 32})


@needs_native
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "reference")
@pytest.mark.parametrize("dist", ["wlbllm", "bimodal", "multimodal", "lognormal-pareto"])
def test_same_plans_on_the_benchmark_batches(variant, dist):
    # The solver bench's 512 samples on 64 ranks: more samples and drafts per search (rebuilds, multifit,
    # columns, holes) than the random batches above reach.
    model = build_cost_model(GPT7B.with_overrides(**variant))
    batch = LengthSource.from_args(dist=dist).draw(global_batch=512, seed=0, index=1, capacity=model.domain.capacity)
    compiled, python = both_ways(plan_or_refusal, batch, model)
    assert compiled == python


def test_the_extension_is_built_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert native.draft is not None, "pip install -e . should have compiled csrc/solver/draft.c"


@needs_native
def test_bad_arrays_are_refused_by_name():
    with pytest.raises(TypeError, match="start: expected a C-contiguous int64 array"):
        native.draft.choose_window(np.zeros(4), np.zeros(2), np.ones(2, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                   np.zeros(2), np.zeros(2), None, None, None)
    with pytest.raises(ValueError, match="a window outside the ranks"):
        native.draft.choose_window(np.zeros(4), np.array([3]), np.array([2]), np.zeros(1, dtype=np.int64),
                                   np.zeros(1), np.zeros(1), None, None, None)


def test_the_rules_both_keep_are_stated_once_and_named_where_kept():
    # native's docstring states the tie-breaks and the order of the arithmetic; draft.c and the Python of the
    # loops name them by tag. Every tag they name is stated, and the Python names every one.
    stated = re.findall(r"^\[([WBHL]\d)\]", native.__doc__, re.MULTILINE)
    assert stated and len(stated) == len(set(stated))
    tag = re.compile(r"\[([WBHL]\d)\]")
    source = Path(__file__).resolve().parents[2] / "csrc" / "solver" / "draft.c"
    in_c = set(tag.findall(source.read_text())) if source.exists() else set()
    in_python = set(tag.findall(inspect.getsource(fill) + inspect.getsource(layout) + inspect.getsource(scatter)))
    assert in_c <= set(stated) and in_python == set(stated)
