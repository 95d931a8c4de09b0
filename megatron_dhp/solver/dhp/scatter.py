"""Wide samples on the ranks that free up first: list schedules, the rest filled as every draft is.

Where the comm runs a group on any rank set (no group family: `mixed`'s and `p2p`'s ring on the domain's
communicator), a wide sample need not wait for a window aligned to a cell. A list schedule takes the wide
samples in some order and gives each exactly its degree of ranks: the ones that free up first anywhere in
the domain, or, where it fits a node and those span nodes, the ones of one node that free up first if that
ends it no later (intra-node links). A group across nodes is priced at the inter-node links, as every group
is (`CostModel.is_intra`). The rules, ties and arithmetic are `native`'s [L1] - [L4].

Which order packs best depends on the batch (on 5 % documents of 32K-128K tokens without overlap, the steps of
random orders near longest-first spread over 10 %), so a solve scores many orders by when their wide samples
end (`list_ends`: all orders at once, in C where it was built), climbs from the best by moving the sample that
ends last earlier, and builds drafts of the best few: what their ranks wait before a wide sample starts goes
to one-rank samples (`fill_holes`), every rank's time after its last wide group to the rest (`fill`, one bin
per rank), as `planner.build` does for windows.
"""

from __future__ import annotations

import numpy as np

from megatron_dhp.solver.dhp import native
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.dhp.layout import DraftGroup, Skyline, add_to_group

FIRST_ORDERS = ("longest", "slowest", "largest")
"""The first orders of `orders_of`: most tokens, most seconds, most rank-seconds first (ties: id)."""
NOISE = 0.3
"""Random orders perturb the first order's keys by up to this fraction (bench/no_overlap_gap.py's witness)."""
SEED = 0
"""The random orders' seed: the same batch gets the same orders, so the same plan, on every machine."""


def orders_of(inst: Instance, items: np.ndarray, degrees: np.ndarray, count: int) -> np.ndarray:
    """`count` orders of the wide `items` (rows of item indices): the `FIRST_ORDERS`, then longest first by
    keys perturbed by up to `NOISE`."""
    gpn = inst.model.domain.gpus_per_node
    seconds = inst.model.sample_time(inst.tokens[items], inst.work[items], degrees, degrees <= gpn)
    keys = [inst.tokens[items].astype(np.float64), seconds, seconds * degrees]
    noise = 1.0 + NOISE * np.random.default_rng(SEED).random((max(0, count - len(keys)), len(items)))
    keys = np.vstack([*keys, keys[0][None, :] * noise])[:count]
    return items[np.lexsort((np.broadcast_to(inst.ids[items], keys.shape), -keys), axis=-1)]


def list_ends(inst: Instance, orders: np.ndarray, degree_of: np.ndarray,
              spare_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every row of `orders` (orders of the same wide samples): when its last wide sample ends, that
    sample's place in the order, and the level to which `spare_s` seconds of one-rank work would fill the
    ranks' waits and ends (what the bins reach where the wide samples end sooner)."""
    items = np.unique(orders)
    return list_schedules(np.searchsorted(items, orders), *wide_tables(inst, items, degree_of), inst.num_ranks,
                          inst.model.domain.gpus_per_node, spare_s)


def climb(inst: Instance, order: np.ndarray, degree_of: np.ndarray, spare_s: float, rounds: int,
          budget: int) -> tuple[np.ndarray, ...]:
    """Up to `rounds` steps of a hill climb from `order`: its neighbours (the sample that ends last moved to
    each earlier place, each pair of neighbours before it swapped) scored at once, the best taken while it
    promises a shorter step (`list_ends`: the later of the end and the level), and no more rounds once
    `budget` (order, sample, rank) steps are spent. Every order scored, with its scores."""
    ends, critical, levels = list_ends(inst, order[None, :], degree_of, spare_s)
    best, promise, c = order, max(ends[0], levels[0]), int(critical[0])
    scored: list[tuple[np.ndarray, ...]] = []
    for _ in range(rounds):
        moved = [np.concatenate([best[:p], best[c : c + 1], best[p:c], best[c + 1 :]]) for p in range(c)]
        for p in range(c):
            swapped = best.copy()
            swapped[p], swapped[p + 1] = best[p + 1], best[p]
            moved.append(swapped)
        budget -= len(moved) * len(order) * inst.num_ranks
        if not moved or budget < 0:
            break
        orders = np.stack(moved)
        more = list_ends(inst, orders, degree_of, spare_s)
        scored.append((orders, *more))
        step = np.maximum(more[0], more[2])
        k = int(np.lexsort((more[0], step))[0])
        if not step[k] < promise:
            break
        best, promise, c = orders[k], float(step[k]), int(more[1][k])
    if not scored:
        return np.zeros((0, len(order)), dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0)
    return tuple(np.concatenate(part) for part in zip(*scored))


def list_schedules(orders: np.ndarray, degree: np.ndarray, t_in: np.ndarray, t_out: np.ndarray, overhead: np.ndarray,
                   num_ranks: int, gpn: int, spare_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`list_ends` over local indices into the per-sample tables (`wide_tables`), in C where the install
    built it ([L1] - [L4])."""
    if native.draft is not None:
        ends, critical, levels = native.draft.list_ends(np.ascontiguousarray(orders, dtype=np.int64), degree, t_in,
                                                        t_out, overhead, num_ranks, gpn, float(spare_s))
        return np.array(ends), np.array(critical, dtype=np.int64), np.array(levels)
    ready = blank_ranks(num_ranks, gpn, len(orders))
    rows = np.arange(len(orders))
    last, critical, waits = np.zeros(len(orders)), np.zeros(len(orders), dtype=np.int64), np.zeros(len(orders))
    for step in range(orders.shape[1]):
        col = orders[:, step]
        chosen, begin, finish = list_step(ready, degree[col], t_in[col], t_out[col], overhead[col], gpn)
        waits = waits + np.cumsum(np.where(chosen, begin[:, None] - ready, 0.0), axis=1)[:, -1]
        ready = np.where(chosen, finish[:, None], ready)
        later = finish > last  # [L3]
        last[later], critical[later] = finish[later], step
    ranked = np.sort(ready[:, :num_ranks], axis=1)  # [L4]
    level = ((spare_s - waits)[:, None] + np.cumsum(ranked, axis=1)) / np.arange(1, num_ranks + 1)
    below = level <= np.concatenate([ranked[:, 1:], np.full((len(rows), 1), np.inf)], axis=1)
    return last, critical, level[rows, np.argmax(below, axis=1)]


def list_placement(order: np.ndarray, degree: np.ndarray, t_in: np.ndarray, t_out: np.ndarray, overhead: np.ndarray,
                   num_ranks: int, gpn: int) -> list[tuple[tuple[int, ...], float]]:
    """One list schedule (`list_schedules`' rules) of local indices: each sample's ranks and start."""
    if native.draft is not None:
        placed: list[tuple[tuple[int, ...], float, float]] = []
        native.draft.list_ends(np.ascontiguousarray(order[None, :], dtype=np.int64), degree, t_in, t_out, overhead,
                               num_ranks, gpn, 0.0, placed)
        return [(ranks, begin) for ranks, begin, _ in placed]
    ready, steps = blank_ranks(num_ranks, gpn, 1), []
    for k in order.tolist():
        chosen, begin, finish = list_step(ready, degree[k : k + 1], t_in[k : k + 1], t_out[k : k + 1],
                                          overhead[k : k + 1], gpn)
        steps.append((tuple(np.flatnonzero(chosen[0]).tolist()), float(begin[0])))
        ready = np.where(chosen, finish[:, None], ready)
    return steps


def wide_tables(inst: Instance, items: np.ndarray, degree_of: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per wide item (sorted): its degree, seconds inside a node and across nodes, and one microbatch's overhead;
    made once per solve for each set of items and degrees (the climbs and drafts ask again)."""
    key = ("wide tables", items.tobytes(), degree_of[items].tobytes())
    if key not in inst.memo:
        inst.memo[key] = _wide_tables(inst, items, degree_of)
    return inst.memo[key]


def _wide_tables(inst: Instance, items: np.ndarray, degree_of: np.ndarray) -> tuple[np.ndarray, ...]:
    degree = np.ascontiguousarray(degree_of[items], dtype=np.int64)
    t_in, t_out = (np.ascontiguousarray(inst.model.sample_time(inst.tokens[items], inst.work[items], degree, intra),
                                        dtype=np.float64) for intra in (True, False))
    overhead = np.array([inst.overhead(int(d)) for d in degree], dtype=np.float64)
    return degree, t_in, t_out, overhead


def blank_ranks(n: int, gpn: int, rows: int) -> np.ndarray:
    """`rows` skylines of `n` free ranks, padded to whole nodes of `gpn` with ranks that are never free."""
    ready = np.zeros((rows, -(-n // gpn) * gpn))
    ready[:, n:] = np.inf
    return ready


def list_step(ready: np.ndarray, d: np.ndarray, t_in: np.ndarray, t_out: np.ndarray, overhead: np.ndarray,
              gpn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One wide sample per row of `ready` (rank skylines padded to whole nodes): the ranks it takes, as a
    mask, when it starts and when it ends ([L1], [L2])."""
    rows, width = ready.shape
    nodes = width // gpn
    node_of = np.arange(width) // gpn
    by = np.argsort(ready, axis=1, kind="stable")  # [L1]
    first = np.arange(width)[None, :] < d[:, None]
    begin = np.take_along_axis(ready, by, axis=1)[np.arange(rows), d - 1]
    spread = np.where(first, node_of[by], -1).max(axis=1) != np.where(first, node_of[by], nodes).min(axis=1)
    finish = begin + np.where(spread, t_out, t_in) + overhead
    chosen = np.zeros(ready.shape, dtype=bool)
    np.put_along_axis(chosen, by, first, axis=1)
    local = np.flatnonzero(spread & (d <= gpn))
    if len(local):  # [L2]
        dl = d[local]
        grid = ready[local].reshape(-1, nodes, gpn)
        inner = np.argsort(grid, axis=2, kind="stable")
        ordered = np.take_along_axis(grid, inner, axis=2)
        starts = np.take_along_axis(ordered, (dl - 1)[:, None, None], axis=2)[:, :, 0]
        sums = np.cumsum(ordered, axis=2)[np.arange(len(dl)), :, dl - 1]
        lowest = starts.min(axis=1, keepdims=True)
        with np.errstate(invalid="ignore"):  # a node short of d ranks: inf - inf, never the least start
            waste = np.where(starts == lowest, dl[:, None] * starts - sums, np.inf)
        node = np.argmin(waste, axis=1)
        start = starts[np.arange(len(dl)), node]
        end = start + t_in[local] + overhead[local]
        take = np.isfinite(start) & (end <= finish[local])
        if take.any():
            at, nd = local[take], node[take]
            mine = np.zeros((len(at), width), dtype=bool)
            ranks = nd[:, None] * gpn + inner[take, nd]
            np.put_along_axis(mine, ranks, np.arange(gpn)[None, :] < dl[take][:, None], axis=1)
            chosen[at] = mine
            finish[at], begin[at] = end[take], start[take]
    return chosen, begin, finish


def place_scattered(inst: Instance, skyline: Skyline, order: np.ndarray, degree_of: np.ndarray) -> None:
    """Run the wide samples of `order` as one list schedule (`list_placement`) on an empty skyline."""
    assert not skyline.wide, "a list schedule starts from free ranks"
    items = np.sort(order)
    local = np.searchsorted(items, order)
    degree, t_in, t_out, overhead = wide_tables(inst, items, degree_of)
    steps = list_placement(local, degree, t_in, t_out, overhead, inst.num_ranks, inst.model.domain.gpus_per_node)
    for k, (ranks, begin) in zip(local.tolist(), steps):
        seconds = t_in[k] if inst.model.is_intra(ranks) else t_out[k]
        put_on(inst, skyline, int(items[k]), ranks, begin, float(seconds))


def put_on(inst: Instance, skyline: Skyline, item: int, ranks: tuple[int, ...], begin_s: float, time_s: float) -> None:
    """Run the wide sample on `ranks` from `begin_s` for `time_s`: in the last wide group where that is the
    same ranks ending then (`layout.put`'s rule), else as a new group a phase later."""
    at = list(ranks)
    last = skyline.wide[-1] if skyline.wide else None
    d = len(ranks)
    if last is not None and last.ranks == ranks and last.finish_s == begin_s:
        add_to_group(last, item, inst.load(item, d), time_s)
    else:
        skyline.holes += [(r, float(skyline.ready[r]), begin_s) for r in at if skyline.ready[r] < begin_s]
        contiguous = ranks == tuple(range(ranks[0], ranks[0] + d))
        group = DraftGroup(ranks[0], d, int(skyline.phase[at].max()), begin_s, inst.footprint.cap, inst.overhead(d),
                           members=() if contiguous else ranks)
        add_to_group(group, item, inst.load(item, d), time_s)
        skyline.wide.append(group)
        skyline.phase[at] = group.phase + 1
    skyline.ready[at] = skyline.wide[-1].finish_s
