"""Draft groups on a per-rank skyline: where wide samples go and which rank runs become bins.

The domain is cut into cells of `cell` contiguous ranks that never straddle a node. Samples that need more
ranks than a cell (or would take too long on one) are *wide*: each becomes a group of its own degree,
placed skyline-style on the window of ranks that frees up first. What is left of every cell, once its
ranks finish their wide groups, splits into runs of ranks that are free at the same moment; each run is a
*bin* that later runs a sequence of packed microbatches as one group.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_dhp.solver.dhp import native
from megatron_dhp.solver.dhp.instance import Instance


@dataclass
class DraftGroup:
    """A group under construction: ranks [first, first + size), or the `members` a scattered wide group took
    (`scatter`), with its microbatches and timing."""

    first: int
    size: int
    phase: int
    start_s: float
    cap: int
    """Per-rank token cap: a microbatch's samples' loads (`Instance.load`) sum to at most size x cap."""
    overhead_s: float
    """What opening one more microbatch on this group costs."""
    speed: float = 1.0
    """The speed its slowest rank computes at (a bin's times are at this speed; a wide group's are each
    sample's on its window, `Instance.wide_seconds`)."""
    microbatches: list[list[int]] = field(default_factory=list)  # indices into the instance arrays
    rooms: list[int] = field(default_factory=list)  # tokens each microbatch can still take
    finish_s: float = 0.0
    members: tuple[int, ...] = ()
    """A scattered group's sorted domain positions (`first` is the least, `size` their count); empty: the
    window [first, first + size)."""

    def __post_init__(self) -> None:
        self.finish_s = max(self.finish_s, self.start_s)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's domain positions."""
        return self.members or tuple(range(self.first, self.first + self.size))


@dataclass
class Skyline:
    """When each rank is free and which phase its next group takes, while wide groups are placed (a plan's
    simulated replay is `cost.simulate.Timeline`)."""

    ready: np.ndarray
    phase: np.ndarray
    wide: list[DraftGroup] = field(default_factory=list)
    holes: list[tuple[int, float, float]] = field(default_factory=list)
    """(rank, free from, busy again at): where a rank waits for the other ranks of its next wide group."""

    @classmethod
    def empty(cls, num_ranks: int) -> Skyline:
        """All ranks free at time 0, phase 0."""
        return cls(np.zeros(num_ranks), np.zeros(num_ranks, dtype=np.int64))


@functools.cache
def window_starts(num_ranks: int, size: int, cell: int, gpus_per_node: int, straddle: bool = False) -> np.ndarray:
    """Starts of the windows a wide group may take: one end on a cell boundary, inside a node if it fits one;
    with `straddle` also the tiling at multiples of the size across nodes. A size that does not divide the
    node leaves ranks of every node idle inside nodes (one 6-wide group per 8-rank node); where comm
    overlaps, a straddling window costs no more (`place_wide` prices every window with its own links)."""
    starts = np.arange(num_ranks - size + 1)
    aligned = (starts % cell == 0) | ((starts + size) % cell == 0) | (starts + size == num_ranks)
    if size <= gpus_per_node:
        aligned &= starts // gpus_per_node == (starts + size - 1) // gpus_per_node
        aligned |= straddle & (starts % size == 0)
    out = starts[aligned]
    out.flags.writeable = False  # cached: every caller shares the array
    return out


@dataclass(frozen=True)
class Windows:
    """Every window a wide sample of some degree may take, flat and ordered by (size, start): for each its
    size, first rank, placement, slowest and fastest rank's speed, sum of speeds and microbatch overhead."""

    size: np.ndarray
    start: np.ndarray
    segment: np.ndarray
    """Index of the window's size among `sizes` (windows are sorted by it)."""
    sizes: list[int]
    firsts: np.ndarray
    """Where each size's windows begin."""
    intra: np.ndarray
    slowest: np.ndarray | float
    """Each window's slowest rank's speed (1.0 without rank speeds)."""
    fastest: np.ndarray | float
    """Each window's fastest rank's speed (1.0 without rank speeds)."""
    overhead: np.ndarray
    capacity: np.ndarray | None
    """With rank speeds, the sum of each window's speeds (None without)."""
    end: np.ndarray
    """start + size."""

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        """Each window's ranks as a row, padded with its last rank: all windows' latest-free ranks in one gather
        (the Python `choose_window`'s; the compiled one walks the windows)."""
        return np.minimum(self.start[:, None] + np.arange(int(self.size.max(initial=1)))[None, :], self.end[:, None] - 1)

    @classmethod
    def of(cls, inst: Instance, sizes: list[int], cell: int, straddle: bool) -> Windows:
        """The windows of the allowed `sizes` (with a family, its groups of those sizes): each size's, made
        once per solve (`size_windows`: a sample's sizes overlap the next degree's), side by side."""
        parts = [size_windows(inst, d, cell, straddle) for d in sizes]
        kept = [k for k, part in enumerate(parts) if len(part.start)]
        counts = [len(parts[k].start) for k in kept]
        size = np.repeat([sizes[k] for k in kept], counts).astype(np.int64)
        start = np.concatenate([parts[k].start for k in kept]).astype(np.int64)
        segment = np.repeat(np.arange(len(kept)), counts)
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(parts[k], field) for k in kept])

        nominal = inst.nominal
        return cls(size, start, segment, [sizes[k] for k in kept], firsts, joined("intra"),
                   1.0 if nominal else joined("slowest"), 1.0 if nominal else joined("fastest"), joined("overhead"),
                   None if nominal else joined("capacity"), start + size)


@dataclass(frozen=True)
class SizeWindows:
    """The windows of one size (`Windows` of one size, without the bookkeeping across sizes)."""

    start: np.ndarray
    intra: np.ndarray
    slowest: np.ndarray | None
    fastest: np.ndarray | None
    capacity: np.ndarray | None
    overhead: np.ndarray


def size_windows(inst: Instance, size: int, cell: int, straddle: bool) -> SizeWindows:
    """Every window of `size` ranks a wide group may take, with each one's placement, slowest and fastest
    rank's speed, sum of speeds and microbatch overhead; made once per solve."""
    key = ("size windows", size, cell, straddle)
    if key in inst.memo:
        return inst.memo[key]
    n, gpn = inst.num_ranks, inst.model.domain.gpus_per_node
    start = (inst.family.starts(size) if inst.family else window_starts(n, size, cell, gpn, straddle)).astype(np.int64)
    intra = (size <= gpn) & (start // gpn == (start + size - 1) // gpn)
    if inst.nominal:  # one overhead per size
        out = SizeWindows(start, intra, None, None, None, np.full(len(start), inst.overhead(size), dtype=np.float64))
    else:  # each window's slowest and fastest rank's speed, the sum of its speeds, and its slowest's overhead
        slides = np.lib.stride_tricks.sliding_window_view(inst.speeds, size)[start]
        slowest = slides.min(axis=1)
        total = np.concatenate([[0.0], np.cumsum(inst.speeds)])
        levels, level_of = np.unique(slowest, return_inverse=True)
        overhead = np.array([inst.overhead(size, v) for v in levels.tolist()], dtype=np.float64)[level_of]
        out = SizeWindows(start, intra, slowest, slides.max(axis=1), total[start + size] - total[start], overhead)
    inst.memo[key] = out
    return out


def place_wide(inst: Instance, skyline: Skyline, items: np.ndarray, degrees: np.ndarray, cell: int,
               grow: int = 1, limit_s: float | None = None, straddle: bool = False, bound_s: float | None = None,
               stop_s: float = math.inf) -> bool:
    """Place wide samples, widest first, each on the window where it ends earliest (then wastes the least
    rank time waiting for the window's last rank: ties as `native`'s [W1], [W2] state).

    With a family the windows are the family's groups of the sample's degree (a family size). With
    `grow` > 1 a sample may also take any allowed size up to `grow` times its degree, where that ends it
    earlier (by more than 0.1 %): a wider window free now beats waiting for a narrow one, which evens out
    a skyline of many wide groups. With `limit_s` (multifit, see `planner.multifit`) a sample takes the
    window that wastes the least among those that end it by then, so that columns fill
    up to the limit one after another and leave whole columns free for the rest; only where none does, the
    earliest end. Without a family, `straddle` lets groups that fit a node take windows across two
    (`window_starts`). With rank speeds and without a limit, a sample takes, among the windows that end it
    by `bound_s`, the one whose ranks give up the least speed-weighted time (each rank's speed times its
    wait and run): a sample that runs about as fast on slow ranks (communication-bound) takes slow ones and
    leaves the fast ranks to the work that needs them; a sample at its memory's minimum degree, where every
    window of that degree mixes speeds, may also take the next size up (`mixed_windows`: memory-full, it
    would hold even shards at its slowest rank's speed). Every window of every allowed size is priced at
    once (`Windows`). False, with the rest unplaced, as soon as a group ends at or after `stop_s`."""
    sizes = inst.sizes
    order = np.lexsort((inst.ids[items], -inst.work[items], -degrees)).tolist()  # widest, then longest first
    by = limit_s if limit_s is not None else None if inst.nominal else bound_s
    speeds = inst.speeds if by is not None and limit_s is None else None  # with speeds: a weighted cost
    choose = choose_window if native.draft is None else native_choose_window
    tops = grow * degrees  # each sample's widest size
    if speeds is not None:  # a sample at its memory's minimum degree holds even shards (at its window's slowest
        # rank's speed): where every window of that degree mixes speeds, the next size up, where shares can follow
        for k in np.flatnonzero(inst.min_degree[items] == degrees).tolist():
            if mixed_windows(inst, int(degrees[k]), cell, straddle):
                tops[k] = max(tops[k], sizes[min(np.searchsorted(sizes, degrees[k]) + 1, len(sizes) - 1)])
    for k in order:
        i, degree, top = int(items[k]), int(degrees[k]), int(tops[k])
        key = ("windows", degree, top, cell, straddle)
        if key not in inst.memo:
            inst.memo[key] = Windows.of(inst, sizes[(sizes >= degree) & (sizes <= top)].tolist(), cell, straddle)
        w = inst.memo[key]
        assert len(w.sizes), f"no window of {degree}+ ranks"  # every degree is an allowed size
        seconds = inst.memo.setdefault(("seconds", *key), {})  # per sample: its seconds on each window
        if i not in seconds:  # every draft of the solve asks again; priced for all its degree's samples at once
            todo = [int(j) for j in items[(degrees == degree) & (tops == top)] if int(j) not in seconds]
            table = inst.wide_seconds(np.array(todo), w.size, w.intra, w.capacity, w.slowest, w.fastest)
            seconds.update(zip(todo, table))
        time = seconds[i]
        j, begin = choose(w, skyline.ready, time, by, speeds)
        put(inst, skyline, i, int(w.start[j]), int(w.size[j]), begin, float(time[j]))
        if skyline.wide[-1].finish_s >= stop_s:
            return False
    return True


def mixed_windows(inst: Instance, degree: int, cell: int, straddle: bool) -> bool:
    """Whether every window of `degree` ranks holds ranks of different speeds: none starts a run of at least
    `degree` ranks of one speed."""
    key = ("mixed", degree, cell, straddle)
    if key not in inst.memo:
        n, gpn = inst.num_ranks, inst.model.domain.gpus_per_node
        if "run ends" not in inst.memo:  # each rank's end of its run of one speed
            changes = np.flatnonzero(np.diff(inst.speeds) != 0) + 1
            inst.memo["run ends"] = np.r_[changes, n][np.searchsorted(changes, np.arange(n), side="right")]
        starts = inst.family.starts(degree) if inst.family else window_starts(n, degree, cell, gpn, straddle)
        inst.memo[key] = not bool(np.any(inst.memo["run ends"][starts] >= starts + degree))
    return inst.memo[key]


def choose_window(w: Windows, ready: np.ndarray, time: np.ndarray, by: float | None,
                  speeds: np.ndarray | None) -> tuple[int, float]:
    """`place_wide`'s window for one sample (its index in `w`, and when its last rank is free): ranks free at
    `ready`, the sample's seconds on each window `time`; with `by`, windows that end by then first; with
    `speeds`, the speed-weighted rank time given up instead of the waste (`native.draft.choose_window` is
    this, compiled). Ties and the order of the arithmetic: `native`'s [W1] - [W3]."""
    begin = ready[w.ranks].max(axis=1)
    prefix = np.concatenate([[0.0], np.cumsum(ready)])  # ranks' free times summed over ranks [a, b)
    waste = w.size * begin - (prefix[w.end] - prefix[w.start])
    finish = begin + time + w.overhead
    # per size: the least-wasting window that ends by the limit, the earliest end where none does
    order_by, cost = finish, waste
    if by is not None:
        late = finish > by
        order_by = np.where(np.logical_and.reduceat(late, w.firsts)[w.segment], finish, late)
        if speeds is not None:  # the speed-weighted rank-seconds the window gives up
            weighted = np.concatenate([[0.0], np.cumsum(speeds * ready)])
            cost = finish * w.capacity - (weighted[w.end] - weighted[w.start])
    # [W1], sorted by segment first: each segment's best where it began (one size: no segment key)
    ranked = np.lexsort((w.start, cost, order_by) if len(w.sizes) == 1 else (w.start, cost, order_by, w.segment))
    firsts = ranked[w.firsts]
    j = int(firsts[0])
    for f in firsts[1:].tolist():  # [W2]: a wider size only where it ends the sample 0.1 % earlier
        if finish[f] < finish[j] * (1 - 1e-3):
            j = f
    return j, float(begin[j])


def native_choose_window(w: Windows, ready: np.ndarray, time: np.ndarray, by: float | None,
                         speeds: np.ndarray | None) -> tuple[int, float]:
    """`choose_window` in C, which weighs by `speeds` even without `by`: they go to it only with `by`, as the
    Python uses them."""
    if by is None:
        speeds = None
    return native.draft.choose_window(ready, w.start, w.size, w.firsts, time, w.overhead, by, speeds,
                                      None if speeds is None else w.capacity)


def place_columns(inst: Instance, skyline: Skyline, placed: list[tuple[int, int, int]]) -> None:
    """Run each (sample, start, size) after the last group on its window, in order (`columns.column_layout`)."""
    for i, s, d in placed:
        put(inst, skyline, i, s, d, float(skyline.ready[s : s + d].max()), inst.window_seconds(i, s, d))


def put(inst: Instance, skyline: Skyline, item: int, start: int, size: int, begin_s: float, time_s: float) -> None:
    """Run the wide sample on ranks [start, start + size) from `begin_s` (when the last of them is free) for
    `time_s`: after the same ranks' last group, in it (one group); else as a new group a phase later."""
    s, d = start, size
    last = skyline.wide[-1] if skyline.wide else None
    if last is not None and (last.first, last.size) == (s, d) and last.finish_s == begin_s:
        add_to_group(last, item, inst.load(item, d), time_s)
        if inst.model.uneven_shards and inst.speeds[s : s + d].min() < inst.speeds[s : s + d].max():
            # one split serves all its microbatches, as even as the fullest needs: each sample's own was priced
            last.finish_s = last.start_s + inst.shared_seconds(last.microbatches, s, d) + len(last.microbatches) * last.overhead_s
    else:
        phase = int(skyline.phase[s : s + d].max())
        skyline.holes += [(r, float(skyline.ready[r]), begin_s) for r in range(s, s + d) if skyline.ready[r] < begin_s]
        speed = inst.speed(s, d)
        group = DraftGroup(s, d, phase, begin_s, inst.footprint.cap, inst.overhead(d, speed), speed=speed)
        add_to_group(group, item, inst.load(item, d), time_s)
        skyline.wide.append(group)
        skyline.phase[s : s + d] = phase + 1
    skyline.ready[s : s + d] = skyline.wide[-1].finish_s


def add_to_group(group: DraftGroup, item: int, tokens: int, time_s: float) -> None:
    """Best-fit the item into an open microbatch of the group, or open a new one (paying the overhead)."""
    k, best = -1, math.inf  # the fullest microbatch it fits (`native` [B3], [B4])
    for j, room in enumerate(group.rooms):
        if tokens <= room < best:
            k, best = j, room
    if k >= 0:
        group.microbatches[k].append(item)
        group.rooms[k] -= tokens
    else:
        group.microbatches.append([item])
        group.rooms.append(group.size * group.cap - tokens)
        time_s += group.overhead_s
    group.finish_s += time_s


def fill_holes(inst: Instance, skyline: Skyline, items: np.ndarray) -> tuple[list[DraftGroup], np.ndarray]:
    """Run one-rank samples in the waits of the wide groups' ranks (`Skyline.holes`), longest first, each in
    the hole with the least time left that still ends it in time (a one-rank group is in every family; ties
    and order: `native`'s [H1], [H2]). Returns the holes' groups (start and finish inside their hole) and
    the items left for the bins."""
    holes = sorted(((end - start, rank, start) for rank, start, end in skyline.holes), reverse=True)  # [H1]
    if not holes:
        return [], items
    times, m = inst.times(1, True), inst.overhead(1)
    groups = [DraftGroup(rank, 1, 0, start, inst.footprint.cap, m) for _, rank, start in holes]
    order = items[np.lexsort((inst.ids[items], -times[items]))]  # [H1]
    if native.draft is not None:
        return native_fill_holes(inst, groups, order, [length for length, _, _ in holes])
    left = sorted((length, k) for k, (length, _, _) in enumerate(holes))  # [H2]
    rest = []
    for i in order.tolist():
        t = float(times[i]) + m
        k = bisect.bisect_left(left, (t, -1))
        if inst.min_degree[i] > 1 or k == len(left):
            rest.append(i)
            continue
        room, h = left.pop(k)
        group = groups[h]
        before = group.finish_s
        add_to_group(group, i, inst.load(i, 1), float(times[i]))
        bisect.insort(left, (room - (group.finish_s - before), h))
    return [g for g in groups if g.microbatches], np.array(sorted(rest), dtype=np.int64)


def native_fill_holes(inst: Instance, groups: list[DraftGroup], order: np.ndarray,
                      lengths: list[float]) -> tuple[list[DraftGroup], np.ndarray]:
    """`fill_holes` in C, its one-rank `groups` (empty, one per hole of `lengths` seconds) filled from `order`."""
    m = groups[0].overhead_s
    filled, rest = native.draft.hole_fill(*fill_arrays(inst, order, [(1, True, 1.0)], [0] * len(groups), groups, [m]),
                                          np.array(lengths))
    for h, microbatches, rooms, finish_s in filled:
        groups[h].microbatches, groups[h].rooms, groups[h].finish_s = microbatches, rooms, finish_s
    return [groups[h] for h, *_ in filled], np.array(sorted(rest), dtype=np.int64)


def fill_arrays(inst: Instance, order: np.ndarray, classes: list[tuple[int, bool, float]], class_of: list[int],
                bins: list[DraftGroup], class_overhead: list[float]) -> tuple[np.ndarray, ...]:
    """What the C fills (`native.draft.lpt_fill`, `hole_fill`) take: the items in `order`, every sample's memory
    and times on each (size, placement, speed) class, and each empty bin's class, size, cap, start, overhead."""
    as_int = functools.partial(np.asarray, dtype=np.int64)
    return (as_int(order), as_int(inst.min_degree), as_int(inst.footprint.shared), as_int(inst.footprint.held),
            np.stack([inst.times(*key) for key in classes]), as_int([size for size, _, _ in classes]),
            np.array(class_overhead, dtype=np.float64), as_int(class_of), as_int([b.size for b in bins]),
            as_int([b.cap for b in bins]), np.array([b.finish_s for b in bins]), np.array([b.overhead_s for b in bins]))


def renumber_phases(groups: list[DraftGroup]) -> None:
    """Phases from the groups' start times: each group one after the latest group before it on its ranks."""
    last: dict[int, int] = {}
    for g in sorted(groups, key=lambda g: (g.start_s, g.finish_s, g.first)):
        g.phase = 1 + max((last.get(r, -1) for r in g.ranks), default=-1)
        last.update(dict.fromkeys(g.ranks, g.phase))


def open_bins(inst: Instance, skyline: Skyline, cell: int) -> list[DraftGroup]:
    """Every maximal run of ranks inside one cell that is free at the same time and computes at one speed,
    as an empty group (so a slow rank runs its own samples instead of holding back fast ones).

    With a family a run is cut, from its first rank on, into the widest family groups that fit it."""
    num_ranks = inst.num_ranks
    speeds = inst.speeds
    if not inst.family:  # runs cut at cell starts and wherever the free time, phase or speed changes
        r = np.arange(num_ranks)
        cut = (r % cell == 0) | np.r_[True, (np.diff(skyline.ready) != 0) | (np.diff(skyline.phase) != 0)
                                      | (np.diff(speeds) != 0)]
        firsts = np.flatnonzero(cut)
        lengths = np.diff(np.r_[firsts, num_ranks])
        ready, phase, speed = skyline.ready[firsts].tolist(), skyline.phase[firsts].tolist(), speeds[firsts].tolist()
        overhead = {(d, v): inst.overhead(d, v) for d, v in set(zip(lengths.tolist(), speed))}
        return [DraftGroup(a, d, p, t, inst.footprint.cap, overhead[(d, v)], speed=v)
                for a, d, p, t, v in zip(firsts.tolist(), lengths.tolist(), phase, ready, speed)]
    bins: list[DraftGroup] = []
    for c0 in range(0, num_ranks, cell):
        c1 = min(c0 + cell, num_ranks)
        r = c0
        while r < c1:
            e = r + 1
            while (e < c1 and skyline.ready[e] == skyline.ready[r] and skyline.phase[e] == skyline.phase[r]
                   and speeds[e] == speeds[r]):
                e += 1
            e = r + inst.family.largest_at(r, e - r)
            speed = float(speeds[r])
            bins.append(DraftGroup(r, e - r, int(skyline.phase[r]), float(skyline.ready[r]), inst.footprint.cap,
                                   inst.overhead(e - r, speed), speed=speed))
            r = e
    return bins
