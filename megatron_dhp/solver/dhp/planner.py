"""`dhp`: this project's planner.

For each candidate cell size (the divisors of the node size), samples that need more ranks than a cell, or
would run longer than the lower bound on one, become wide groups of just enough ranks, placed skyline-style;
everything else is packed into the cells' remaining rank runs by LPT with microbatch best-fit, then
rebalanced by local moves. The candidate whose draft is fastest, if still far from its bound, is built again
with wide samples grown, in columns of their own degree (`columns.py`) and multifit-packed (`multifit`). Far
from its bound, static CP's layouts are tried too (at the batch's smallest CP and each double of it: one
group of the whole domain can hold a giant sample and all the short ones in one microbatch). The shortest
simulated step wins. With rank speeds every group is priced at its pace (`CostModel.group_pace`: its slowest
rank's speed, or a window of mixed speeds with shares in proportion to them, `plan.shares`) and bins never
mix speeds, so slow ranks get less work, share groups with each other, or idle. Every
choice is a sort with
explicit tie-breaks on sample ids, so the same input gives the same plan on every machine.

Under pipeline parallelism (P > 1 stages) dhp prices five layouts with the 1F1B simulator and keeps the
fastest: its own (microbatches of at most M // P tokens per rank, so any P consecutive slots hold at most
M; the first candidate's draft, the bins all in one last phase after every wide group, each group's
microbatches in 1F1B order: second shortest, the rest longest first, shortest last), rounds of at most
M // P per rank (`rounds.py`, or with a group family `family_rounds.py`: every phase a partition of the
domain with one microbatch per group, so no idle slot and equal slot counts) in that 1F1B order and in fcp-ref's own, and rounds of nearly M per rank
spaced by P - 1 filler slots (the whole in-flight budget on one round) in the 1F1B order, and static CP's
layout sized by the batch (one group size in one phase: no idle slot; it wins on some small batches).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.pipeline import pipeline_step_time
from megatron_dhp.cost.simulate import simulate
from megatron_dhp.plan.family import DEFAULT_MAX_GROUPS_PER_RANK, GroupFamily, group_family
from megatron_dhp.plan.pipeline import pipeline_token_cap
from megatron_dhp.plan.plan import Plan, PlanError, PlanGroup, memory_fields
from megatron_dhp.solver.base import Planner, PlannerUnsupported
from megatron_dhp.solver.dhp.columns import column_layout
from megatron_dhp.solver.dhp.family_rounds import family_round_layouts
from megatron_dhp.solver.dhp.fill import fill
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import (
    DraftGroup,
    Skyline,
    fill_holes,
    open_bins,
    place_columns,
    place_wide,
    renumber_phases,
    window_starts,
)
from megatron_dhp.solver.dhp.rounds import (
    fit_to_family,
    pipeline_order_of,
    round_layouts,
    spaced_round_groups,
)
from megatron_dhp.solver.dhp.scatter import FIRST_ORDERS, climb, list_ends, orders_of, place_scattered
from megatron_dhp.solver.static import StaticPlanner, static_cp_size
from megatron_dhp.workload.sample import Batch

LIST_WORK = 2_000_000
"""`scattered` scores at most this many (order, wide sample, rank) steps for its first orders, and as many for
its climbs: `DhpPlanner.list_tries` orders where 25 samples are wide on 64 ranks, the first three where hundreds
are on 1,024."""
LIST_FAR = 0.01
"""Without a wide sample waiting for its window, list schedules are tried only where the best draft ends this
fraction or more above the bound (its wide samples' degrees, not their places, may be what holds it back)."""
BALANCE_STEPS = 30
"""Bisection steps of `balanced_degrees` (to 1e-9 of the range)."""
STALE_PROBES = 3
"""`multifit` stops after this many probes in a row that beat no draft (on replicate batches its last probes
repeat one layout; the gains come within two misses of each other)."""


@dataclass
class Draft:
    """A candidate plan before conversion: its groups and the step time they give."""

    groups: list[DraftGroup]
    makespan_s: float
    num_wide: int
    """The first `num_wide` groups are wide groups, the rest bins."""


def cell_sizes(num_ranks: int, gpus_per_node: int) -> list[int]:
    """Cell sizes worth trying: divisors of the node size that fit the domain, and a smaller domain whole."""
    sizes = {d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and d <= num_ranks}
    if num_ranks < gpus_per_node:
        sizes.add(num_ranks)
    return sorted(sizes)


def wide_degrees(inst: Instance, items: np.ndarray, target_s: float) -> np.ndarray:
    """Fewest ranks (>= memory minimum) that run each sample within the target; else its fastest degree.

    The degrees are group sizes the instance allows (with a family, the next family size up)."""
    n = inst.num_ranks
    degrees = np.empty(len(items), dtype=np.int64)
    ds = inst.sizes
    overhead = np.array([inst.overhead(int(d)) for d in ds])
    step = max(1, 2**20 // n)  # bounded memory: items x N per chunk
    for begin in range(0, len(items), step):
        chunk = items[begin : begin + step]
        t = inst.model.time_table(inst.tokens[chunk], inst.work[chunk], ds)
        t = np.where(ds[None, :] >= inst.min_degree[chunk, None], t + overhead[None, :], np.inf)
        within = np.isfinite(t) & (t <= target_s)  # inf <= inf: without isfinite, an inf target picks degree 1
        first = np.argmax(within, axis=1)
        degrees[begin : begin + len(chunk)] = ds[np.where(within.any(axis=1), first, np.argmin(t, axis=1))]
    return degrees if inst.nominal or not len(items) else slow_window_degrees(inst, items, degrees, target_s)


def slow_window_degrees(inst: Instance, items: np.ndarray, degrees: np.ndarray, target_s: float) -> np.ndarray:
    """With rank speeds, `degrees` widened where slow ranks run a sample for less: a sample bound by
    communication on its fewest fast ranks makes them wait, while on the slowest window of some larger size d
    (contiguous ranks, at the speed their group runs at) it may still end within the target and use less
    speed-weighted rank time (d x speed x seconds). There it takes the least such d (up to twice its degree),
    so that `layout.place_wide`'s speed-weighted choice can put it on slow ranks: two GPU generations, a
    123K-token sample on 19 or more ranks at 0.45 instead of 16 at 1.0 (bench/straggler_sim.py's two-gen)."""
    ds = inst.sizes
    top = int(min(ds[-1], 2 * degrees.max()))
    slowest, fastest = window_speeds(inst.speeds, top, inst.model.uneven_shards)
    ds = ds[ds <= top]
    intra = inst.model.best_placement_intra(ds)
    overhead = np.array([inst.overhead(int(d)) for d in ds])
    t = inst.model.sample_time(inst.tokens[items][:, None], inst.work[items][:, None], ds[None, :], intra[None, :],
                               slowest[ds - 1][None, :]) + overhead[None, :]
    ok = (ds[None, :] >= degrees[:, None]) & (t <= target_s)
    first = np.argmax(ok, axis=1)
    wider = ok.any(axis=1) & (ds[first] > degrees)
    if not wider.any():
        return degrees
    at = np.searchsorted(ds, degrees)  # each degree's column (degrees are allowed sizes, at most `top`)
    fast = inst.model.sample_time(inst.tokens[items], inst.work[items], degrees, intra[at], fastest[degrees - 1])
    rows = np.arange(len(items))
    slow_cost = ds[first] * slowest[ds[first] - 1] * t[rows, first]
    fast_cost = degrees * fastest[degrees - 1] * (fast + overhead[at])
    return np.where(wider & (slow_cost < fast_cost), ds[first], degrees)


def window_speeds(speeds: np.ndarray, top: int, uneven: bool) -> tuple[np.ndarray, np.ndarray]:
    """(slowest, fastest): for d = 1..top, the speed the slowest and the fastest window of d contiguous ranks
    computes at (uneven shards: the mean of its speeds; even: its slowest rank's), each window grown from
    the one a rank shorter (O(N) per size)."""
    slowest, fastest = np.empty(top), np.empty(top)
    level = speeds.astype(np.float64)  # per start: the sum (uneven) or the minimum (even) of its window
    for d in range(1, top + 1):
        if d > 1:
            level = level[:-1] + speeds[d - 1 :] if uneven else np.minimum(level[:-1], speeds[d - 1 :])
        value = level / d if uneven else level
        slowest[d - 1], fastest[d - 1] = value.min(), value.max()
    return slowest, fastest


def one_speed_cell(speeds: np.ndarray, cell: int) -> bool:
    """Whether some cell of `cell` ranks (from a multiple of it) runs at one speed. Where none does (speeds
    that drift on every rank), `open_bins` cuts each cell into runs of one speed, so the cell's bins are
    the one-rank candidate's and the samples sized for the cell find no bin: they become wide at their
    fastest degree, and on bench/straggler_sim.py's drift such a draft took 3 to 6 times the step of the
    one-rank candidate's, and a third of the solve."""
    whole = len(speeds) // cell * cell
    cells = speeds[:whole].reshape(-1, cell)
    return bool((cells.min(axis=1) == cells.max(axis=1)).any())


def is_wide_for(inst: Instance, cell: int, target_s: float) -> np.ndarray:
    """Samples that need more ranks than a cell holds, or would run past the target on one cell."""
    return (inst.min_degree > cell) | (inst.times(cell, True) + inst.overhead(cell) > target_s)


@dataclass
class Candidate:
    """A cell size with its wide samples, their degrees, and an area bound on the step it can reach."""

    cell: int
    wide: np.ndarray
    degrees: np.ndarray
    bound_s: float
    target_s: float
    """The batch's lower bound: with rank speeds, wide samples prefer windows that end them by the tighter of it
    and `bound_s` (the area bound prices all work as slowing with its rank, so it can sit above the end of a
    slow window that a fast one would beat by half)."""

    @classmethod
    def make(cls, inst: Instance, cell: int, target_s: float, degrees_of: np.ndarray) -> Candidate:
        """Split samples into wide and cell ones; bound the step by rank-seconds / N and the longest sample.

        `degrees_of` holds the wide degree of every sample that is wide for some candidate.
        """
        # Only the base overhead m: a multi-rank latency would only add time, so the bound stays a bound.
        gpn, n, m = inst.model.domain.gpus_per_node, inst.num_ranks, inst.overhead(1)
        t_cell = inst.times(cell, True)
        is_wide = is_wide_for(inst, cell, target_s)
        wide = np.flatnonzero(is_wide)
        degrees = degrees_of[wide]
        t_wide = inst.model.sample_time(inst.tokens[wide], inst.work[wide], degrees, degrees <= gpn)
        area = float((cell * t_cell[~is_wide]).sum()) + float((degrees * t_wide).sum())
        # With rank speeds, the work over the sum of the speeds: what a draft can reach (not a bound where
        # slow ranks could run communication-bound groups at no loss; it only decides when to stop trying).
        capacity = n if inst.nominal else float(inst.speeds.sum())
        area_bound = (area + m * float(inst.footprint.shared.sum()) / inst.footprint.cap) / capacity
        longest = m + max(float(t_wide.max(initial=0.0)), float(t_cell[~is_wide].max(initial=0.0)))
        return cls(cell, wide, degrees, max(area_bound, longest), target_s)


def build(inst: Instance, cand: Candidate, degrees_of: np.ndarray, *, max_moves: int, grow: int = 1,
          backfill: bool = False, limit_s: float | None = None, straddle: bool = False,
          columns: int = 0, beat_s: float = math.inf) -> Draft | None:
    """One candidate: wide groups first (up to `grow` times their degree, or filling columns to `limit_s`,
    on windows across nodes too with `straddle`: `place_wide`; or with `columns` > 0 in columns of their
    degree, `columns.column_layout` with that many probes below `limit_s`: None where they tile no part of
    the domain), then the cells' bins filled and rebalanced. None also where a wide group ends at or after
    `beat_s` and after `limit_s` (the draft could beat neither: the rest is not placed or filled).

    Wide groups can split cells into runs smaller than some samples need; those samples become wide too
    and the layout is redone (at most a few rounds: the wide set only grows).
    """
    n, cell = inst.num_ranks, cand.cell
    wide = cand.wide
    # a wide group that ends this late makes a draft that can win nothing: placement stops there
    stop_s = beat_s if limit_s is None else max(beat_s, math.nextafter(limit_s, math.inf))
    while True:
        skyline = Skyline.empty(n)
        if columns:
            placed = column_layout(inst, wide, degrees_of[wide], cand.bound_s, limit_s, window_test(inst, cell), columns)
            if placed is None:
                return None
            place_columns(inst, skyline, placed)
        else:
            if not place_wide(inst, skyline, wide, degrees_of[wide], cell, grow, limit_s, straddle,
                              bound_s=min(cand.bound_s, cand.target_s), stop_s=stop_s):
                return None
        bins = open_bins(inst, skyline, cell)
        rest = np.setdiff1d(np.arange(len(inst.ids)), wide)
        homeless = rest[inst.min_degree[rest] > max(b.size for b in bins)]
        if not len(homeless):
            break
        degrees_of[homeless] = wide_degrees(inst, homeless, float("inf"))
        wide = np.union1d(wide, homeless)
    # The same wide groups give the same draft: multifit's probes often place them alike (a limit between two
    # that settle the same columns), and the rest of the draft, the costly part, is not redone.
    key = ("draft", cell, backfill, max_moves, *((g.first, g.size, g.start_s, g.finish_s, *map(tuple, g.microbatches))
                                                   for g in skyline.wide))
    if key not in inst.memo:
        wide_end = float(skyline.ready.max())
        holes, rest = fill_holes(inst, skyline, rest) if backfill and inst.nominal else ([], rest)
        fill(inst, bins, rest, floor_s=wide_end, max_moves=max_moves)
        groups = skyline.wide + [b for b in bins if b.microbatches or b.phase == 0]
        if holes:
            groups += holes
            renumber_phases(groups)
        inst.memo[key] = Draft(groups, max(g.finish_s for g in groups), len(skyline.wide))
    return inst.memo[key]


def waits(draft: Draft) -> bool:
    """Whether some wide group of the draft starts after one of its ranks is free (it waits for a window)."""
    ready: dict[int, float] = {}
    for g in sorted(draft.groups[: draft.num_wide], key=lambda g: g.start_s):
        if any(ready.get(r, 0.0) < g.start_s for r in g.ranks):
            return True
        ready.update(dict.fromkeys(g.ranks, g.finish_s))
    return False


def balanced_degrees(inst: Instance, items: np.ndarray, spare_s: float) -> np.ndarray:
    """Degrees of the wide `items` for a list schedule: each sample's fewest ranks that end it within T, for
    the least T (bisected) at which all their rank-seconds and the rest's `spare_s` fit N ranks by T. Wider
    samples end sooner but cost more rank-seconds (their communication); the lower bound alone as T gives
    the longest ones most of the domain on 256 ranks, their memory minimum leaves them the longest."""
    sizes = inst.sizes
    table = inst.model.time_table(inst.tokens[items], inst.work[items], sizes)
    table = table + np.array([inst.overhead(int(d)) for d in sizes])[None, :]
    table = np.where(sizes[None, :] >= inst.min_degree[items, None], table, np.inf)
    rows = np.arange(len(items))

    def at(limit: float) -> tuple[np.ndarray, float]:
        within = table <= limit
        first = np.where(within.any(axis=1), np.argmax(within, axis=1), np.argmin(table, axis=1))
        return first, float((sizes[first] * table[rows, first]).sum() + spare_s) / inst.num_ranks

    lo, hi = float(table.min(axis=1).max()), float(table[rows, np.argmax(np.isfinite(table), axis=1)].max())
    for _ in range(BALANCE_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if at(mid)[1] <= mid else (mid, hi)
    return sizes[at(hi)[0]]


def scattered(inst: Instance, target_s: float, degrees_of: np.ndarray, *, tries: int, starts: int, climbs: int,
              drafts: int, max_moves: int, beat_s: float) -> Draft | None:
    """The fastest draft whose wide samples (those of the one-rank cell) are list-scheduled on the ranks that
    free up first (`scatter`), at the search's degrees, at `balanced_degrees` and at their memory's minimum
    (packing rigid groups, wider is not always sooner): for each, `tries` orders scored at once and a
    `scatter.climb` of up to `climbs` rounds from each of the `starts` best; then a draft of each of the
    `drafts` orders that promise the shortest step (`scatter.list_ends`: the later of the wide samples' end
    and the level the rest fill to). None where none ends before `beat_s`. Any rank set is a group, so only
    where the comm gives one without a family."""
    wide = np.flatnonzero(is_wide_for(inst, 1, target_s))
    if not len(wide):
        return None
    rest = np.setdiff1d(np.arange(len(inst.ids)), wide)
    # what the one-rank samples add: their seconds and a microbatch's overhead per cap of their memory
    spare = float(inst.times(1, True)[rest].sum()) + inst.overhead(1) * float(inst.footprint.shared[rest].sum()) / inst.footprint.cap
    searched = degrees_of.copy()
    missing = wide[searched[wide] == 0]  # wide for no candidate cell the planner was given
    searched[missing] = wide_degrees(inst, missing, target_s)
    balanced = searched.copy()
    balanced[wide] = balanced_degrees(inst, wide, spare)
    fewest = searched.copy()
    fewest[wide] = inst.min_degree[wide]
    sets = [d for k, d in enumerate((searched, balanced, fewest))
            if not any(np.array_equal(d[wide], e[wide]) for e in (searched, balanced, fewest)[:k])]
    tries = min(tries, max(len(FIRST_ORDERS), LIST_WORK // (len(sets) * len(wide) * inst.num_ranks)))
    drafts = min(drafts, max(1, LIST_WORK // (len(inst.ids) * inst.num_ranks)))  # (4,096 samples on 1,024 ranks: 1)
    found = []  # (promise, end, degrees, order) of every order scored
    for degrees in sets:
        orders = orders_of(inst, wide, degrees[wide], tries)
        scored = list_ends(inst, orders, degrees, spare)
        promise = np.maximum(scored[0], scored[2])  # its wide samples' end, or the level the rest fill to if later
        for k in np.lexsort((scored[0], promise))[:starts].tolist():
            more = climb(inst, orders[k], degrees, spare, climbs, LIST_WORK // (len(sets) * starts))
            orders = np.concatenate([orders, more[0]])
            scored = tuple(np.concatenate(pair) for pair in zip(scored, more[1:]))
        ends, levels = scored[0], scored[2]
        promise = np.maximum(ends, levels)
        found += [(float(promise[k]), float(ends[k]), degrees, orders[k]) for k in np.lexsort((ends, promise))[:drafts]]
    best_draft = None
    for promise_s, _, degrees, order in sorted(found, key=lambda f: f[:2])[:drafts]:
        if promise_s >= min(beat_s, best_draft.makespan_s if best_draft else math.inf):
            break  # the level is where the rest would end with no gap left: a draft rarely ends sooner
        skyline = Skyline.empty(inst.num_ranks)
        place_scattered(inst, skyline, order, degrees)
        bins = open_bins(inst, skyline, 1)
        holes, left = fill_holes(inst, skyline, rest)
        fill(inst, bins, left, floor_s=float(skyline.ready.max()), max_moves=max_moves)
        groups = skyline.wide + [b for b in bins if b.microbatches or b.phase == 0] + holes
        if holes:
            renumber_phases(groups)
        draft = Draft(groups, max(g.finish_s for g in groups), len(skyline.wide))
        if draft.makespan_s < min(beat_s, best_draft.makespan_s if best_draft else math.inf):
            best_draft = draft
    return best_draft


def window_test(inst: Instance, cell: int) -> Callable[[int, int], bool]:
    """Whether ranks [start, start + size) may form a group: a family window, or without a family one of
    `window_starts` (across nodes too)."""
    n, gpn = inst.num_ranks, inst.model.domain.gpus_per_node
    starts = functools.cache(lambda size: set((inst.family.starts(size) if inst.family else
                                               window_starts(n, size, cell, gpn, True)).tolist()))
    return lambda start, size: start in starts(size)


def multifit(inst: Instance, cand: Candidate, degrees_of: np.ndarray, draft: Draft, *, max_moves: int,
             probes: int, straddle: bool = False, beat_s: float = math.inf) -> Draft:
    """The fastest of `draft` and drafts whose wide samples fill columns up to a limit, the limit bisected
    between the candidate's bound and the best draft's step (multifit, Coffman, Garey and Johnson 1978).

    Earliest-end placement spreads wide samples evenly over the columns and leaves each with a last item
    that overshoots; when wide samples are most of the work (long videos under the `replicate` encoder
    placement, each 6-7 ranks for most of the step) that overshoot sets the step, and the limit packs them
    tighter.
    """
    lo, hi = cand.bound_s, draft.makespan_s
    misses = 0
    for _ in range(probes):
        limit = (lo + hi) / 2
        fit = build(inst, cand, degrees_of.copy(), max_moves=max_moves, backfill=True, limit_s=limit, straddle=straddle,
                    beat_s=min(draft.makespan_s, beat_s))  # None: its wide groups end after the limit and either
        misses = 0 if fit is not None and fit.makespan_s < draft.makespan_s else misses + 1
        if misses == STALE_PROBES:  # the limit has settled where it packs no better than the best draft
            break
        draft = fit if fit is not None and fit.makespan_s < draft.makespan_s else draft
        lo, hi = (lo, limit) if fit is not None and fit.makespan_s <= limit else (limit, hi)
    return draft


@dataclass
class DhpPlanner(Planner):
    """Groups of any size per step (of the fixed group family by default), minimising the simulated step time
    under the cost model."""

    cells: tuple[int, ...] | None = None
    """Cell sizes to try (default: every divisor of gpus_per_node)."""
    max_moves: int = 200
    """Local-search moves per candidate."""
    gap: float = 5e-3
    """Skip a candidate whose area bound is within this fraction of the best step found so far."""
    grow: ClassVar[int] = 2
    """A candidate whose draft ends more than `gap` above its bound is built again with wide samples free
    to take up to this many times their degree (`place_wide`); the faster draft counts. Not an option:
    the rebuild only ever keeps the faster draft."""
    probes: ClassVar[int] = 6
    """A candidate still more than `gap` above its bound is then built with its wide samples filling columns
    up to limits bisected this many times (`multifit`), without a family also on windows across nodes; the
    fastest draft counts."""
    column_probes: ClassVar[int] = 10
    """Such a candidate is also built with its wide samples in columns of their degree (`columns`), packed
    to heights bisected this many times (cheap: no draft per probe); the faster draft counts."""
    rebuilds: ClassVar[int] = 1
    """How many candidates are built again (`rebuilt`), fastest plain draft first, among those whose bound the
    best draft misses by more than `gap`. Each rebuild costs about a dozen drafts; rebuilding every such
    candidate, as dhp did, made plans 0.04 % faster on average over plan_quality's variants and took up to
    3.5x as long (bench/solver_speed.py --variants)."""
    list_tries: ClassVar[int] = 100
    """Where some wide sample of the best draft waits for its window and any rank set is a group, up to this
    many orders of the wide samples are list-scheduled on the ranks that free up first (`scattered`; fewer
    where wide samples x ranks x orders passes `LIST_WORK`)."""
    list_starts: ClassVar[int] = 2
    """The best orders of each degree set that `scatter.climb` starts from."""
    list_climbs: ClassVar[int] = 3
    """Rounds of each climb (the sample ending last moved earlier, neighbours swapped)."""
    list_drafts: ClassVar[int] = 2
    """The best orders drafted in full, their bins filled; the fastest draft counts where it beats the rest."""
    speed_aware: bool = True
    """Plan with the ranks' speeds (False: as if every rank ran at 1, the speed-blind baseline of the benches)."""
    name: str = "dhp"
    plans_pipeline: ClassVar[bool] = True
    plans_on_family: ClassVar[bool] = True

    def solve(self, batch: Batch, model: CostModel, family: GroupFamily | None = None,
              pipeline_stages: int = 1, virtual_stages: int = 1) -> list[PlanGroup]:
        """Build candidates in order of their area bound and return the one with the shortest step: every
        group one of `family`'s, or any contiguous window without one."""
        found = self.search(batch, model, family, pipeline_stages, virtual=virtual_stages)
        assert found is not None  # nothing to beat: some draft always stands
        return found[0]

    def search(self, batch: Batch, model: CostModel, family: GroupFamily | None, pipeline_stages: int,
               beat_s: float = math.inf, virtual: int = 1) -> tuple[list[PlanGroup], float | None] | None:
        """`solve`'s groups, with their draft's makespan where they are a draft as built (None where a
        simulation chose them among other layouts); or None where no draft ends before `beat_s` (a step
        another search already reached: its drafts stop as soon as they cannot beat it). Interleaved
        (`virtual` chunks per stage), microbatches hold at most M V // C tokens per rank."""
        p = pipeline_stages
        domain = model.domain
        inst = Instance.from_batch(batch, model, pipeline_token_cap(domain.max_tokens_per_rank, p, virtual), family)
        too_long = inst.min_degree > inst.num_ranks
        if too_long.any():
            raise PlannerUnsupported(
                f"dhp packs microbatches of at most {inst.cap} tokens per rank at {p} pipeline stages"
                f"{f' of {virtual} virtual chunks' if virtual > 1 else ' (M // P)'}, "
                f"and a {int(inst.tokens[too_long].max())}-token sample needs more than the domain's "
                f"{inst.num_ranks} ranks of that")
        # The bound is at the model's cap M: the instance's own footprint at P = 1, at M // P under PP.
        target = model.lower_bound_arrays(inst.tokens, inst.work, inst.footprint if p == 1 else model.footprint(batch.samples))
        cells = self.cells or cell_sizes(domain.world_size, domain.gpus_per_node)
        if not self.cells and not inst.nominal:  # with rank speeds the ends: bins of one rank, or whole nodes
            cells = sorted({cells[0], cells[-1]})  # (the middle ones changed dhp's drift step by <= 0.02 %)
            cells = [c for c in cells if c == cells[0] or one_speed_cell(inst.speeds, c)]
        maybe_wide = np.flatnonzero(np.logical_or.reduce([is_wide_for(inst, c, target) for c in cells]))
        degrees_of = np.zeros(len(inst.ids), dtype=np.int64)
        degrees_of[maybe_wide] = wide_degrees(inst, maybe_wide, target)
        # Bounds equal up to rounding tie; larger cells first then (finer balance, fewer bins).
        candidates = sorted((Candidate.make(inst, c, target, degrees_of) for c in cells),
                            key=lambda c: (round(c.bound_s / target, 9), -c.cell))
        # Every candidate's plain draft, in order of bound until the best is within `gap` of the next bound;
        # then the fastest of them that is still far from its bound is built again (`rebuilt`, `rebuilds`).
        # Under PP the makespan this search minimises is not the step (1F1B prices it below), and the wide
        # chain that M // P makes usually ties every candidate: the first one is the draft.
        drafts: list[tuple[Candidate, Draft]] = []
        for cand in candidates[: 1 if p > 1 else None]:
            best_s = min((d.makespan_s for _, d in drafts), default=beat_s)
            if best_s <= cand.bound_s * (1 + self.gap):
                break
            # None: its wide groups alone end after the best draft (one slower draft is never rebuilt)
            draft = build(inst, cand, degrees_of.copy(), max_moves=self.max_moves, backfill=p == 1,
                          beat_s=best_s if self.rebuilds == 1 else math.inf)
            drafts += [(cand, draft)] if draft is not None else []
        if not drafts:
            return None
        best = min((d for _, d in drafts), key=lambda d: d.makespan_s)  # the first of equals
        # With rank speeds the speed-aware bound sits further from every draft, so every candidate counts as
        # far; rebuilding them, and the family's plan below, changed dhp's mean step by at most 0.08 % on
        # bench/straggler_sim.py's scenarios at 64, 256 and 1,024 ranks and took up to half of a 1,024-rank
        # solve. So there only a draft whose wide groups all came from samples that no bin of one speed holds
        # (`build`'s homeless: their windows were never weighed) is built again.
        far = [(c, d) for c, d in sorted(drafts, key=lambda cd: cd[1].makespan_s)
               if p == 1 and (len(c.wide) if inst.nominal else not len(c.wide) and d.num_wide)
               and min(best.makespan_s, beat_s) > c.bound_s * (1 + self.gap)]
        for cand, draft in far[: self.rebuilds]:
            draft = self.rebuilt(inst, cand, degrees_of, draft, family, beat_s)
            best = draft if draft.makespan_s < best.makespan_s else best
        if (self.list_tries and p == 1 and family is None and inst.nominal and best.makespan_s > target * (1 + self.gap)
                and (waits(best) or best.makespan_s > target * (1 + LIST_FAR))):
            listed = scattered(inst, target, degrees_of, tries=self.list_tries, starts=self.list_starts,
                               climbs=self.list_climbs, drafts=self.list_drafts, max_moves=self.max_moves,
                               beat_s=best.makespan_s)
            best = listed if listed is not None else best
        if best.makespan_s >= beat_s:
            return None
        if p > 1:
            spaced = spaced_round_groups(inst, batch, p)
            static = StaticPlanner().solve(batch, model.with_token_cap(inst.cap))
            peers = [*([spaced] if spaced else []), static]
            if family is not None:  # the spaced rounds and static's replicas moved onto the family where they fit
                peers = [fit_to_family(family, groups, inst) for groups in peers]
            if family is not None or virtual > 1:  # the spaced rounds keep 1F1B's rule, not the interleaved one's
                peers = [groups for groups in peers if groups is not None and valid(inst, batch, p, groups, virtual)]
            # fcp-ref's rounds; with a family, built on its windows (`family_rounds`: moved there, they rarely fit)
            peers = [*(round_layouts(inst, batch) if family is None else family_round_layouts(inst, batch, family)), *peers]
            return fastest(inst, batch, [pipeline_groups(inst, best), *peers], stages=p, virtual=virtual), None
        groups = inst.plan_groups([(g.ranks, g.microbatches, g.phase) for g in best.groups])
        if best.makespan_s <= target * (1 + self.gap):
            return groups, best.makespan_s
        # Far from the bound: a static CP layout may still be faster, at the batch's smallest CP or a larger one
        # (one group of the whole domain can hold a giant sample and every short one in one microbatch). A
        # layout whose longest replica's microbatches back to back end no sooner than the draft (whose makespan
        # is its simulated step, from the same tables) is dropped without simulating either.
        others = []
        for static in static_layouts(inst, batch, best.makespan_s):
            floor = max((sum(times) for times in inst.layout_times(static)), default=0.0)
            if floor < best.makespan_s and (family is None or all(family.contains(g.ranks) for g in static)):
                others.append(static)
        if family is None and inst.nominal:  # with any groups, a default family's plan too: its few sizes can
            # pack wide samples better (with rank speeds: see `far` above)
            shape = group_family(domain.world_size, domain.gpus_per_node, DEFAULT_MAX_GROUPS_PER_RANK)
            found = self.search(batch, model, shape, 1, beat_s=best.makespan_s)
            if found is not None and found[1] is not None and not others:
                return found  # a draft that ends before this one (the only kind it returns): no need to simulate
            others += [found[0]] if found is not None else []
        return (fastest(inst, batch, [groups, *others]), None) if others else (groups, best.makespan_s)

    def rebuilt(self, inst: Instance, cand: Candidate, degrees_of: np.ndarray, draft: Draft,
                family: GroupFamily | None, beat_s: float = math.inf) -> Draft:
        """The fastest of `draft` and the candidate built again: wide samples grown, in columns, multifit
        (whose probes stop once they cannot beat `beat_s` either)."""
        wider = build(inst, cand, degrees_of.copy(), max_moves=self.max_moves, grow=self.grow, backfill=True)
        draft = wider if wider.makespan_s < draft.makespan_s else draft
        cols = build(inst, cand, degrees_of.copy(), max_moves=self.max_moves, backfill=True,
                     limit_s=draft.makespan_s, columns=self.column_probes) if self.column_probes and inst.nominal else None
        draft = cols if cols is not None and cols.makespan_s < draft.makespan_s else draft
        if draft.makespan_s > cand.bound_s * (1 + self.gap):
            for straddle in (False,) if family else (False, True):  # a family's groups stay in nodes
                draft = multifit(inst, cand, degrees_of, draft, max_moves=self.max_moves, probes=self.probes,
                                 straddle=straddle, beat_s=beat_s)
        return draft


def static_layouts(inst: Instance, batch: Batch, beat_s: float) -> list[list[PlanGroup]]:
    """Static CP's layouts of the batch: at its smallest CP (`StaticPlanner`'s choice) and at every double of it
    that divides the domain, but those whose replicas' mean time alone reaches `beat_s`: replica r takes its
    samples' time T_r at speed v_r, so the longest is at least sum T / sum v, and such a layout cannot beat
    the draft. With rank speeds each replica runs with the shares dhp's groups take (`Instance.plan_groups`),
    so v_r is its ranks' mean speed where shards may be uneven, else its slowest's; and each layout comes
    twice, as static packs it and with one sample a microbatch (a full microbatch holds even shards, at its
    slowest rank's pace: more microbatches can be faster)."""
    model = inst.model
    layouts, n, cap = [], model.domain.world_size, model.domain.max_tokens_per_rank
    longest = int(batch.lengths.max())
    cp = static_cp_size(longest, model.domain, int(inst.footprint.min_degree().max()))
    first = True
    while cp <= n and n % cp == 0:
        total_s = float(inst.times(cp, model.is_intra(range(cp))).sum())
        if inst.nominal:
            mean_s = total_s * cp / n
        else:
            replicas = inst.speeds.reshape(-1, cp)
            mean_s = total_s / float((replicas.mean(axis=1) if model.uneven_shards else replicas.min(axis=1)).sum())
        if (first and inst.nominal) or mean_s < beat_s:  # (nominal: the first always, as it always was)
            groups = StaticPlanner(dataset_max_tokens=None if first else cp * cap).solve(batch, model)
            layouts.append(groups if inst.nominal else with_speed_shares(inst, groups))
            if not inst.nominal and model.uneven_shards:
                layouts.append(with_speed_shares(inst, [replace(g, microbatches=tuple((i,) for i in g.sample_ids))
                                                        for g in groups]))
        cp, first = 2 * cp, False
    return layouts


def with_speed_shares(inst: Instance, groups: Sequence[PlanGroup]) -> list[PlanGroup]:
    """`groups` with the shares their speeds ask for where those make them faster (`Instance.plan_groups`)."""
    index = inst.position
    return inst.plan_groups([(g.ranks, [[index[i] for i in mb] for mb in g.microbatches], g.phase) for g in groups])


def pipeline_groups(inst: Instance, draft: Draft) -> list[PlanGroup]:
    """A draft's groups for 1F1B: the bins in one last phase, each group's microbatches in `pipeline_order`."""
    last = 1 + max((g.phase for g in draft.groups[:draft.num_wide]), default=-1)
    return inst.plan_groups([(g.ranks, pipeline_order(inst, g), g.phase if k < draft.num_wide else last)
                             for k, g in enumerate(draft.groups)])


def pipeline_order(inst: Instance, group: DraftGroup) -> list[list[int]]:
    """The group's microbatches in 1F1B order: second shortest, the rest longest first, shortest."""
    times = inst.times(group.size, inst.model.is_intra(group.ranks))
    return pipeline_order_of(sorted(group.microbatches,
                                    key=lambda mb: (-float(times[mb].sum()), min(int(inst.ids[i]) for i in mb))))


def draft_plan(inst: Instance, batch: Batch, groups: list[PlanGroup], stages: int, virtual: int = 1) -> Plan:
    """A candidate layout as a plan under the instance's model (its cap and memory rule)."""
    domain, rule = inst.model.domain, inst.model.memory_rule()
    return Plan("dhp", domain.world_size, domain.gpus_per_node, batch.samples, tuple(groups),
                max_tokens_per_rank=domain.max_tokens_per_rank, pipeline_stages=stages, virtual_stages=virtual,
                **memory_fields(rule))


def valid(inst: Instance, batch: Batch, stages: int, groups: list[PlanGroup], virtual: int = 1) -> bool:
    """Whether the layout is a valid plan (the memory rule over what stage 0 keeps in flight included)."""
    try:
        draft_plan(inst, batch, groups, stages, virtual).validate()
    except PlanError:
        return False
    return True


def fastest(inst: Instance, batch: Batch, candidates: list[list[PlanGroup]], stages: int = 1,
            virtual: int = 1) -> list[PlanGroup]:
    """The candidate layout whose step is the shortest (the first of equals): simulated, or at P = `stages` > 1
    run by the 1F1B simulator with its microbatches priced from the instance's tables.

    Without PP the candidates are dhp's plan and static CP's layouts: a batch with little work and one sample
    that dominates it (a video of a CPU-sized multimodal batch) can make dhp give that sample a wide group
    whose collectives cost more than they save, where static CP's layout is faster."""
    plans = [draft_plan(inst, batch, groups, stages, virtual) for groups in candidates]
    times = [pipeline_step_time(plan, inst.model, dict(enumerate(inst.layout_times(plan.groups)))) if stages > 1
             else simulate(plan, inst.model).step_time_s for plan in plans]
    return candidates[times.index(min(times))]
