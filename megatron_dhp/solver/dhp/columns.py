"""Columns for wide samples: disjoint windows that tile part of the domain, each running a sequence of them.

When wide samples are most of the work (long videos under the `replicate` encoder placement: each needs
4 - 7 ranks for memory, and its encoder runs whole on every rank of its group, so more ranks barely shorten
it), the skyline's earliest-end placement mixes degrees on the same ranks, and the windows of one size then
block the family's tilings of another (a 6-wide window at ranks 6 - 11 holds no 5-wide one): ranks wait,
or idle at the end (multifit on windows alone does not fix it). Here the wide
samples are packed first-fit decreasing into columns opened at their own degree, to a height bisected as
multifit does (`pack`, `column_layout`), the columns laid on windows that tile the domain from its first
rank (`tiling`), and balanced by their real times (`balance`); the small samples then fill every column
once it is done, and the ranks no column holds.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import numpy as np

from megatron_dhp.solver.dhp.instance import Instance

BALANCE_MOVES = 64
"""At most this many moves or swaps in `balance` (a few columns of a few samples each need far fewer)."""


def pack(times: dict[int, list[tuple[float, int]]], num_ranks: int, height_s: float) -> list[tuple[int, list[int]]]:
    """Columns (width, samples) first-fit decreasing to `height_s`: widest degree first, longest first, each
    sample into the fullest column at least as wide that it fits by then (the narrowest of those: a wider
    column runs it on all its ranks), else into a new column of its degree while ranks are left, else where
    it ends first. `times[d]`: (seconds on d ranks, sample) of the samples of degree d, longest first."""
    columns: list[tuple[int, list[int]]] = []
    loads: list[float] = []
    used = 0
    for d in sorted(times, reverse=True):
        for t, i in times[d]:
            fits = [(w, -loads[k], k) for k, (w, _) in enumerate(columns) if w >= d and loads[k] + t <= height_s]
            if fits:
                k = min(fits)[2]
            elif used + d <= num_ranks:
                columns.append((d, []))
                loads.append(0.0)
                used += d
                k = len(columns) - 1
            else:
                k = min((loads[k], k) for k, (w, _) in enumerate(columns) if w >= d)[1]
            columns[k][1].append(i)
            loads[k] += t
    return columns


def tiling(num_ranks: int, counts: dict[int, int], is_window: Callable[[int, int], bool]) -> dict[int, list[int]] | None:
    """Disjoint windows, `counts[d]` of each size d, from position 0 on (wider columns first at each
    position, a rank left out only where none fits): a depth-first search that remembers dead ends."""
    spare = num_ranks - sum(d * c for d, c in counts.items())
    if spare < 0:
        return None
    sizes = sorted(counts, reverse=True)
    dead: set[tuple[int, tuple[int, ...]]] = set()

    def search(pos: int, left: tuple[int, ...], skipped: int) -> list[tuple[int, int]] | None:
        if not any(left):
            return []
        if (pos, left) in dead or pos >= num_ranks:
            return None
        for k, d in enumerate(sizes):
            if left[k] and pos + d <= num_ranks and is_window(pos, d):
                rest = search(pos + d, left[:k] + (left[k] - 1,) + left[k + 1:], skipped)
                if rest is not None:
                    return [(pos, d), *rest]
        if skipped < spare:
            rest = search(pos + 1, left, skipped + 1)
            if rest is not None:
                return rest
        dead.add((pos, left))
        return None

    found = search(0, tuple(counts[d] for d in sizes), 0)
    if found is None:
        return None
    return {d: [s for s, size in found if size == d] for d in sizes}


def column_layout(inst: Instance, items: np.ndarray, degrees: np.ndarray, bound_s: float, limit_s: float,
                  is_window: Callable[[int, int], bool], probes: int) -> list[tuple[int, int, int]] | None:
    """Where each wide sample runs, as (sample, start, size) in column order: the columns `pack` fills to a
    height bisected between `bound_s` and `limit_s` (multifit on columns: a height the columns all meet
    shrinks the range from above), the packing that ends first, on windows that tile the domain
    (`tiling`), each sample on the column's first ranks where they form a window of its degree, else on
    all of them; None where the columns tile no part of it."""
    times: dict[int, list[tuple[float, int]]] = {}
    for d in sorted(set(degrees.tolist())):
        members = items[degrees == d]
        t = inst.times(d, True)[members] + inst.overhead(d)
        times[d] = sorted(zip(t.tolist(), members.tolist()), key=lambda p: (-p[0], int(inst.ids[p[1]])))
    lo, hi = bound_s, limit_s
    best: tuple[float, list[tuple[int, list[int]]]] | None = None
    for _ in range(probes):
        height = (lo + hi) / 2
        columns = pack(times, inst.num_ranks, height)
        finish = max(column_time(inst, w, members) for w, members in columns)
        if best is None or finish < best[0]:
            best = (finish, columns)
        lo, hi = (lo, height) if finish <= height else (height, hi)
    if best is None:
        return None
    columns = best[1]
    starts = tiling(inst.num_ranks, Counter(w for w, _ in columns), is_window)
    if starts is None:
        return None
    degree_of = dict(zip(items.tolist(), degrees.tolist()))
    placed = []
    for w, members in columns:
        start, starts[w] = starts[w][0], starts[w][1:]
        placed.append((start, w, members))
    balance(inst, placed, degree_of, is_window)
    return [(i, start, run_size(start, w, degree_of[i], is_window)) for start, w, members in placed for i in members]


def run_size(start: int, width: int, degree: int, is_window: Callable[[int, int], bool]) -> int:
    """Ranks a sample of `degree` takes in the column: its first `degree` where they form a window, else all."""
    return degree if is_window(start, degree) else width


def balance(inst: Instance, columns: list[tuple[int, int, list[int]]], degree_of: dict[int, int],
            is_window: Callable[[int, int], bool]) -> None:
    """Move or swap samples between the column that ends last and another while that ends the pair
    sooner (packing to a height balances by estimate; this by the columns' real times)."""

    @functools.cache  # a sample's seconds in a column depend on the column's place, not on its members
    def seconds(i: int, column: int) -> float:
        start, w, _ = columns[column]
        d = run_size(start, w, degree_of[i], is_window)
        return float(inst.times(d, inst.model.is_intra(range(start, start + d)))[i]) + inst.overhead(d)

    heights = [sum(seconds(i, c) for i in members) for c, (_, _, members) in enumerate(columns)]
    for _ in range(BALANCE_MOVES):
        a = max(range(len(columns)), key=lambda c: (heights[c], -c))
        best: tuple[float, int, int, int | None] | None = None  # (pair's new end, column, sample out, sample in)
        for b, (_, wb, members_b) in enumerate(columns):
            if b == a:
                continue
            for x in columns[a][2]:
                if degree_of[x] > wb:
                    continue
                out_a, in_b = heights[a] - seconds(x, a), heights[b] + seconds(x, b)
                options = [(max(out_a, in_b), None)]
                options += [(max(out_a + seconds(y, a), in_b - seconds(y, b)), y) for y in members_b
                            if degree_of[y] <= columns[a][1]]
                end, y = min(options, key=lambda o: o[0])
                if end < heights[a] - 1e-9 and (best is None or end < best[0]):
                    best = (end, b, x, y)
        if best is None:
            return
        _, b, x, y = best
        columns[a][2].remove(x)
        columns[b][2].append(x)
        if y is not None:
            columns[b][2].remove(y)
            columns[a][2].append(y)
        heights[a] = sum(seconds(i, a) for i in columns[a][2])
        heights[b] = sum(seconds(i, b) for i in columns[b][2])


def column_time(inst: Instance, width: int, members: list[int]) -> float:
    """Seconds the column runs its samples, each on all its ranks."""
    return float(inst.times(width, True)[members].sum()) + len(members) * inst.overhead(width)
