"""Fill bins with the remaining samples: longest-processing-time first, then moves off the latest bin.

A bin's finish time is its start plus, per microbatch, the overhead m and the times of its samples on the
bin's size. Samples are taken by decreasing work and each goes where it finishes earliest, best-fitting an
open microbatch when its tokens fit (no new overhead). Local moves then take samples off the bin that
ends last while that lowers the makespan.

Bins of one (size, placement, speed) class give a sample the same time, so each class keeps its bins sorted by
finish time: the earliest finish, or the earliest among bins with room, is a short scan from the front
(at most `SCAN` bins, so that a start with many empty bins stays linear).

The C of `csrc/solver/draft.c` does the same (`fill_in_order`); the ties and the order of the arithmetic
both keep are `native`'s [B1] - [B6], tagged where they are kept here.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from megatron_dhp.solver.dhp import native
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import DraftGroup, add_to_group, fill_arrays

SCAN = 32


def bin_classes(inst: Instance, bins: list[DraftGroup]) -> tuple[list[tuple[int, bool, float]], list[int]]:
    """The bins' (size, placement, speed) classes, sorted, and each bin's class."""
    gpn = inst.model.domain.gpus_per_node
    keys = [(b.size, b.first // gpn == (b.first + b.size - 1) // gpn, b.speed) for b in bins]
    classes = sorted(set(keys))
    return classes, [classes.index(k) for k in keys]


class BinSet:
    """Bins grouped by (size, placement, speed) class, each class sorted by finish time, then index ([B1])."""

    def __init__(self, inst: Instance, bins: list[DraftGroup]) -> None:
        self.inst = inst
        self.bins = bins
        self.shared, self.held = inst.loads
        self.min_degree = inst.min_degree.tolist()
        self.classes, self.class_of = bin_classes(inst, bins)
        self.sizes = [size for size, _, _ in self.classes]
        self.times = [inst.times(*key).tolist() for key in self.classes]
        self.class_overhead = [inst.overhead(s, speed) for s, _, speed in self.classes]
        self.room = [max(b.rooms, default=0) for b in bins]
        self.key = [(b.finish_s, k) for k, b in enumerate(bins)]
        self.by_class: list[list[tuple[float, int]]] = [[] for _ in self.classes]
        for k in range(len(bins)):
            self.by_class[self.class_of[k]].append(self.key[k])
        for lst in self.by_class:
            lst.sort()
        self.where: dict[int, int] = {}  # sample index -> bin

    def finish(self, b: int) -> float:
        """When bin b ends."""
        return self.bins[b].finish_s

    def makespan(self) -> tuple[float, int]:
        """The latest finish and its bin (the greatest (finish, bin): [B1])."""
        return max((lst[-1] for lst in self.by_class if lst), default=(0.0, -1))

    def best_bin(self, item: int, exclude: int = -1) -> tuple[float, int]:
        """The bin where `item` would finish earliest (and that finish), skipping bin `exclude` ([B2])."""
        lo, shared, held, room = self.min_degree[item], self.shared[item], self.held[item], self.room
        best = (math.inf, -1)
        for c, size in enumerate(self.sizes):
            if size < lo:
                continue
            length = shared + size * held  # `Instance.load`, inlined
            m = self.class_overhead[c]
            t = self.times[c][item]
            first = None
            for finish, b in itertools.islice(self.by_class[c], SCAN):
                if b == exclude:
                    continue
                if first is None:
                    first = finish
                    cand = (finish + t + (0.0 if room[b] >= length else m), b)
                    if room[b] >= length:
                        break
                elif finish >= first + m:
                    break
                elif room[b] >= length:
                    cand = min(cand, (finish + t, b))
                    break
            if first is not None and cand < best:
                best = cand
        return best

    def add(self, item: int, b: int) -> None:
        """Put the sample into bin b (best-fit microbatch: [B3], [B4])."""
        c = self.class_of[b]
        add_to_group(self.bins[b], item, self.inst.load(item, self.bins[b].size), self.times[c][item])
        self.where[item] = b
        self._refresh(b)

    def remove(self, item: int) -> float:
        """Take the sample out of its bin (an emptied microbatch goes, with its overhead: [B3], [B4]); return
        the saving."""
        b = self.where.pop(item)
        g = self.bins[b]
        k = next(k for k, mb in enumerate(g.microbatches) if item in mb)
        before = g.finish_s
        g.microbatches[k].remove(item)
        g.rooms[k] += self.inst.load(item, g.size)
        g.finish_s -= self.times[self.class_of[b]][item]
        if not g.microbatches[k]:
            del g.microbatches[k], g.rooms[k]
            g.finish_s -= g.overhead_s
        self._refresh(b)
        return before - g.finish_s

    def saving_out(self, item: int) -> float:
        """How much earlier the sample's bin would finish without it."""
        b = self.where[item]
        g = self.bins[b]
        alone = any(len(mb) == 1 and mb[0] == item for mb in g.microbatches)
        return self.times[self.class_of[b]][item] + (g.overhead_s if alone else 0.0)

    def _refresh(self, b: int) -> None:
        lst = self.by_class[self.class_of[b]]
        del lst[bisect.bisect_left(lst, self.key[b])]
        self.key[b] = (self.bins[b].finish_s, b)
        bisect.insort(lst, self.key[b])
        self.room[b] = max(self.bins[b].rooms, default=0)


def fill(inst: Instance, bins: list[DraftGroup], items: np.ndarray, *, floor_s: float = 0.0,
         max_moves: int = 200) -> None:
    """Assign `items` to the empty `bins` (LPT), then move samples off the latest bin while the makespan drops.

    `floor_s` is a finish time the bins need not beat (e.g. a wide group that ends later anyway).
    """
    order = items[np.lexsort((inst.ids[items], -inst.tokens[items], -inst.work[items]))]  # [B5]
    fill_in_order(inst, bins, order, floor_s=floor_s, max_moves=max_moves)


def fill_in_order(inst: Instance, bins: list[DraftGroup], order: np.ndarray, *, floor_s: float, max_moves: int) -> None:
    """`fill` with the items placed in `order`: each where it finishes earliest, then the local moves. In C where
    the install built it (`native`), the same bins to the last bit."""
    assert not any(b.microbatches for b in bins), "fill starts from empty bins"
    if native.draft is not None:
        native_fill(inst, bins, order, floor_s=floor_s, max_moves=max_moves)
        return
    binset = BinSet(inst, bins)
    for i in order.tolist():
        finish, b = binset.best_bin(i)
        assert b >= 0, f"no bin can hold sample index {i}"  # build() makes such samples wide
        binset.add(i, b)
    improve(binset, floor_s=floor_s, max_moves=max_moves)


def native_fill(inst: Instance, bins: list[DraftGroup], order: np.ndarray, *, floor_s: float, max_moves: int) -> None:
    """`fill_in_order` in C (`csrc/solver/draft.c`: `BinSet`, `fill` and `improve` there)."""
    classes, class_of = bin_classes(inst, bins)
    overhead = [inst.overhead(size, speed) for size, _, speed in classes]
    filled = native.draft.lpt_fill(*fill_arrays(inst, order, classes, class_of, bins, overhead), float(floor_s),
                                   max_moves, SCAN)
    for b, (microbatches, rooms, finish_s) in zip(bins, filled):
        b.microbatches, b.rooms, b.finish_s = microbatches, rooms, finish_s


def improve(binset: BinSet, *, floor_s: float, max_moves: int) -> None:
    """Move one sample at a time off the latest bin to where the pair's later finish is earliest ([B6])."""
    members: dict[int, list[int]] = {}
    for item, b in binset.where.items():
        members.setdefault(b, []).append(item)
    for _ in range(max_moves):
        makespan, worst = binset.makespan()
        if worst < 0 or makespan <= floor_s:
            return
        best = None
        for item in sorted(members.get(worst, ())):
            cost, target = binset.best_bin(item, exclude=worst)
            after = max(makespan - binset.saving_out(item), cost)
            if target >= 0 and after < makespan - 1e-12 and (best is None or after < best[0]):
                best = (after, item, target)
        if best is None:
            return
        _, item, target = best
        binset.remove(item)
        members[worst].remove(item)
        binset.add(item, target)
        members.setdefault(target, []).append(item)
