"""Price a plan under pipeline parallelism (P > 1 stages): 1F1B per stage over each position's slots.

How a microbatch's PP = 1 time T = m (+ lambda) + sum t splits: the cost model describes the whole model,
and each stage runs 1/P of its layers, so one microbatch costs T / P on every stage, a third of it in the
forward and two thirds in the backward (F = T / 3P, B = 2T / 3P). An idle slot is a one-token microbatch on
a group of one, priced the same way (m + t(1, 1), split alike). No cost key is added: at P = 1 this is the
plain sum of the reference model (docs/cost-model.md).

Stage s of a position runs its K slots in megatron-core's non-interleaved 1F1B order: min(P - s - 1, K)
warm-up forwards, then one forward and one backward alternately, then the remaining backwards. F(j, s)
starts after F(j, s - 1) and after the stage's previous op; B(j, s) after B(j, s + 1) and the previous op.
A group's microbatch runs as one op on all its members (their slot indices are equal by the layout), which
starts when all of them are ready. Every op starts at the step overhead sigma at the earliest.

Interleaved (V > 1 chunks per stage, `interleaved_ops`): a microbatch costs T / PV per chunk and stage, split
alike; stage s runs megatron-core's interleaved order (`plan.pipeline.schedule_order`); chunk c's forward
leaves the last stage for stage 0's chunk c + 1, and its backward comes back the other way.
"""

from __future__ import annotations

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.plan.pipeline import chunk_table, padded_slot_count, schedule_order
from megatron_dhp.plan.plan import Plan
from megatron_dhp.workload.sample import Sample

FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of a microbatch's time on a stage (the backward does the other two thirds)."""


def idle_slot_time(model: CostModel) -> float:
    """PP = 1 seconds of an idle slot: a one-token microbatch on a group of one."""
    return model.microbatch_time([Sample(0, 1)], [0])


def pipeline_ops(plan: Plan, model: CostModel, microbatch_s: dict[int, tuple[float, ...]]):
    """Each op's start and end (op = (unit, stage, F/B); a unit is one group's microbatch or one idle slot),
    each unit's PP = 1 seconds, each position's slots as unit ids, and the unit id of each real slot.

    An op starts when its stage predecessor and each member's previous op at its stage have ended. Give
    F(j, s) the tick 2j + s and B(j, s) the tick 2j + 2P - 1 - s: every dependency, stage to stage and along
    any position's 1F1B order whatever its slot count, goes to a strictly later tick (the ops of a unit sit
    at the same slot j on all its members by the layout), so the ops are timed one tick at a time, each
    tick's ops at once. Interleaved plans are timed by `interleaved_ops`.
    """
    if plan.virtual_stages > 1:
        return interleaved_ops(plan, model, microbatch_s)
    p = plan.pipeline_stages
    unit, unit_slot, pair_unit, pair_row, rows, unit_of = slot_units(plan, microbatch_s, idle_slot_time(model))
    num_units, num_ops = len(unit), len(unit) * p * 2
    # op id (u * P + s) * 2 + kind, as arrays over all ops
    u_of = np.repeat(np.arange(num_units), 2 * p)
    s_of = np.tile(np.repeat(np.arange(p), 2), num_units)
    kind = np.tile([0, 1], num_units * p)
    j_of = unit_slot[u_of]
    tick = np.where(kind == 0, 2 * j_of + s_of, 2 * j_of + 2 * p - 1 - s_of)
    ids = np.arange(num_ops)
    pred = np.where(kind == 0, np.where(s_of > 0, ids - 2, num_ops), np.where(s_of < p - 1, ids + 2, ids - 1))
    dur = np.where(kind == 0, FORWARD_SHARE, 1 - FORWARD_SHARE) * unit[u_of] / p
    # each op's members as resources (row, stage): a unit's pairs, grouped by unit
    by_unit = np.argsort(pair_unit, kind="stable")
    member_rows = pair_row[by_unit]
    size = np.bincount(pair_unit, minlength=num_units)
    first = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    order = np.argsort(tick, kind="stable")
    count = size[u_of[order]]
    pair_at = np.repeat(first[u_of[order]] - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
    resource = member_rows[pair_at] * p + np.repeat(s_of[order], count)
    op_bounds = np.searchsorted(tick[order], np.arange(int(tick.max(initial=-1)) + 2)).tolist()
    pair_bounds = np.concatenate([[0], np.cumsum(count)]).tolist()
    # in tick order, so that each tick's ops and pairs are slices: pred as a position in that order too
    position = np.empty(num_ops + 1, dtype=np.int64)
    position[order], position[num_ops] = np.arange(num_ops), num_ops
    pred_at, dur_at = position[pred[order]], dur[order]
    offsets = np.asarray(pair_bounds[:-1], dtype=np.int64)
    begin = np.empty(num_ops)
    end = np.full(num_ops + 1, model.step_overhead_s)  # end[num_ops]: no predecessor
    free = np.full(len(rows) * p, model.step_overhead_s)
    for a, b in zip(op_bounds[:-1], op_bounds[1:]):
        if a == b:
            continue
        pa, pb = pair_bounds[a], pair_bounds[b]
        res = resource[pa:pb]
        begin[a:b] = t0 = np.maximum(end[pred_at[a:b]], np.maximum.reduceat(free[res], offsets[a:b] - pa))
        end[a:b] = t1 = t0 + dur_at[a:b]
        free[res] = np.repeat(t1, count[a:b])
    start, finish = np.empty(num_ops), np.empty(num_ops)
    start[order], finish[order] = begin, end[:num_ops]
    return start, finish, unit, rows, unit_of


def interleaved_ops(plan: Plan, model: CostModel, microbatch_s: dict[int, tuple[float, ...]]):
    """`pipeline_ops` under interleaved 1F1B: op id ((unit * P + stage) * V + chunk) * 2 + F/B.

    Every position runs the same K slots (`plan.pipeline.pipeline_slots`), so stage s's i-th op is the same
    (slot, chunk, F/B) on every position: the ops are timed one (stage, i) cell at a time, each cell's units
    at once (a unit starts when all its members' stage is free and its op on the neighbouring stage has
    ended), the cells in the order in which their neighbours' ops are done."""
    p, v = plan.pipeline_stages, plan.virtual_stages
    unit, _, _, _, rows, unit_of = slot_units(plan, microbatch_s, idle_slot_time(model))
    at = np.array(rows, dtype=np.int64)  # (position, slot) -> unit
    k = at.shape[1]
    table = chunk_table(k, p, v)
    sigma = model.step_overhead_s
    end = np.full((len(unit), p, v, 2), np.nan)
    begin = np.full_like(end, np.nan)
    free = np.full((plan.world_size, p), sigma)
    orders = [schedule_order(k, s, p, v) for s in range(p)]
    done = [0] * p
    while any(done[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while done[s] < len(orders[s]):
                kind, index = orders[s][done[s]]
                j, c = table[index]
                c = c if kind == 0 else v - 1 - c
                before = _neighbour(s, c, kind, p, v)
                units, inverse = np.unique(at[:, j], return_inverse=True)
                if before is None:
                    ready = np.full(len(units), sigma)
                else:
                    ready = end[(units,) + before]
                    if np.isnan(ready).any():
                        break
                np.maximum.at(ready, inverse, free[:, s])
                share = FORWARD_SHARE if kind == 0 else 1 - FORWARD_SHARE
                begin[units, s, c, kind] = ready
                end[units, s, c, kind] = ready + share * unit[units] / (p * v)
                free[:, s] = end[units, s, c, kind][inverse]
                done[s] += 1
                moved = True
        if not moved:
            raise AssertionError("the interleaved schedule has a cycle")  # megatron-core's order has none
    return begin.reshape(-1), end.reshape(-1), unit, rows, unit_of


def _neighbour(stage: int, chunk: int, kind: int, stages: int, virtual: int) -> tuple[int, int, int] | None:
    """(stage, chunk, F/B) of the op a unit's op must follow on another stage, None for its first forward."""
    if kind == 0:
        if stage > 0:
            return stage - 1, chunk, 0
        return (stages - 1, chunk - 1, 0) if chunk > 0 else None
    if stage < stages - 1:
        return stage + 1, chunk, 1
    return (0, chunk + 1, 1) if chunk < virtual - 1 else (stage, chunk, 0)


def slot_units(plan: Plan, microbatch_s: dict[int, tuple[float, ...]], idle_s: float):
    """The units of `pipeline_slots(plan)` as arrays: each unit's PP = 1 seconds and slot index, every
    (unit, position) pair, each position's slots as unit ids, and the unit id of each real slot.

    Built from the groups, not slot by slot: group g of phase q runs microbatch j at slot o_q + j on each of
    its ranks (one group per rank and phase, `Plan.validate`), and every slot before a position's end that
    no group fills is an idle unit of its own. Real units come first, group by group.
    """
    groups = plan.groups
    counts = np.array([len(g.microbatches) for g in groups], dtype=np.int64)
    phase = np.array([g.phase for g in groups], dtype=np.int64)
    widest = np.zeros(plan.num_phases, dtype=np.int64)
    np.maximum.at(widest, phase, counts)
    offset = np.concatenate([[0], np.cumsum(widest)[:-1]])[phase]  # o_q of each group's phase
    first_unit = np.cumsum(counts) - counts
    num_real = int(counts.sum())
    unit_group = np.repeat(np.arange(len(groups)), counts)
    unit_mb = np.arange(num_real) - first_unit[unit_group]
    real_slot = offset[unit_group] + unit_mb
    sizes = np.array([len(g.ranks) for g in groups], dtype=np.int64)
    ranks = np.fromiter((r for g in groups for r in g.ranks), dtype=np.int64, count=int(sizes.sum()))
    rank_group = np.repeat(np.arange(len(groups)), sizes)
    # every (real unit, member) pair: each rank of group g once per microbatch j of g
    per_rank = counts[rank_group]
    member = np.repeat(np.arange(len(ranks)), per_rank)
    j = np.arange(len(member)) - np.repeat(np.cumsum(per_rank) - per_rank, per_rank)
    pair_real = first_unit[rank_group[member]] + j
    last = plan.num_phases - 1
    end = np.full(plan.world_size, int(widest[:last].sum()))  # the last phase is not padded
    in_last = phase[rank_group] == last
    end[ranks[in_last]] += counts[rank_group[in_last]]
    if plan.virtual_stages > 1:  # interleaved: every position to the same count
        end[:] = padded_slot_count(int(end.max(initial=0)), plan.pipeline_stages)
    at = np.full((plan.world_size, int(end.max(initial=0))), -1, dtype=np.int64)
    at[ranks[member], real_slot[pair_real]] = pair_real
    filled = np.arange(at.shape[1])[None, :] < end[:, None]
    idle = filled & (at < 0)
    at[idle] = num_real + np.arange(int(idle.sum()))
    pair_row, pair_slot = np.nonzero(filled)
    pair_unit = at[pair_row, pair_slot]
    unit_time = np.concatenate([np.fromiter((t for gi in range(len(groups)) for t in microbatch_s[gi]),
                                            dtype=np.float64, count=num_real), np.full(int(idle.sum()), idle_s)])
    unit_slot = np.concatenate([real_slot, np.nonzero(idle)[1]])
    rows = [at[r, : end[r]].tolist() for r in range(plan.world_size)]
    unit_of = dict(zip(zip(unit_group.tolist(), unit_mb.tolist()), range(num_real)))
    return unit_time, unit_slot, pair_unit, pair_row, rows, unit_of


def pipeline_step_time(plan: Plan, model: CostModel, microbatch_s: dict[int, tuple[float, ...]]) -> float:
    """The plan's step time under 1F1B given each group's microbatch times (a planner comparing layouts
    prices them from its own tables; `simulate` gives the same number), `global`'s encoder phase included."""
    phase_s = model.with_placement(plan.encoder_placement).encoder_phase(plan.samples).total_s
    return float(pipeline_ops(plan, model, microbatch_s)[1].max(initial=model.step_overhead_s)) + phase_s


def lower_bound(model: CostModel, samples, stages: int, virtual: int = 1) -> float:
    """A step time no plan beats at `stages` pipeline stages of `virtual` chunks; the model's own bound at 1
    stage.

    LB_P = sigma + E + max(W / P + (P - 1) m / P, m + max_i min_d t(L_i, d)),

    E the bound on `global`'s encoder phase (0 under the other placements), which runs before the first and
    after the last slot on the first stage's N ranks, as at P = 1.

    The first term: some position r carries W_r >= W seconds of PP = 1 slot time, so its last stage is busy
    W_r / P; it cannot start before its first slot's forward has passed the P - 1 stages before it, nor
    finish before its last slot's backward has passed them back, and every slot, idle or not, costs at
    least m: (P - 1) (m / 3 + 2 m / 3) / P more. W is the PP = 1 bound without sigma, raised by the memory
    rule: P consecutive slots of a position hold at most M tokens per rank, so a position holding T_r tokens
    per rank runs K_r >= P T_r / M - (P - 1) slots, and over all positions sum K_r >= P sum L / M - N (P - 1)
    (each costing m on its position, against sum L / M in the PP = 1 bound).

    The second: every microbatch's forward passes all P stages and its backward all P stages back, one
    after the other (F(j, 0) .. F(j, P - 1), B(j, P - 1) .. B(j, 0)), T / 3P + 2T / 3P on each: its whole
    PP = 1 time T, not T / P. The microbatch holding sample i runs it on a group of d >= ceil(L_i / M) ranks
    (a single slot is within the memory rule), so T >= m + min_d t(L_i, d).

    The third, `in_flight_bound`, weighs the memory rule against the work: a microbatch holding X tokens
    on its group stays in flight at stage 0 for its whole PP = 1 time T or longer, and the microbatches
    that stage keeps in flight hold at most M tokens per rank together.

    Interleaved (V > 1): the fill and drain pass chunk 0 only, (P - 1) m / PV; stage 0 holds every group
    of P consecutive slots at once (its C >= PV chunks in flight cover a group's PV), so K_r >= P T_r / M;
    and chunk c of a microbatch stays in flight at stage 0 for (V - c) / V of T, X / V tokens each: the
    in-flight bound's memory-time by (V + 1) / 2V.
    """
    if stages == 1:
        return model.lower_bound(samples)
    if not model.domain.nominal:  # every time is at least the nominal one over the fastest rank's speed (if > 1)
        return (lower_bound(model.with_speeds(()), samples, stages, virtual)
                / max(1.0, float(model.domain.speeds.max())))
    phase_s = model.encoder_phase(samples, bound=True).total_s  # `global`'s, outside the pipeline (0 otherwise)
    tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
    work = model.sample_work(samples)
    footprint = model.footprint(samples)
    groups = model.lower_bound_arrays(tokens, work, footprint)
    n, m = model.domain.world_size, model.microbatch_overhead(1)
    lo = footprint.min_degree()
    t_lo = model.sample_time(tokens, work, lo, lo <= model.domain.gpus_per_node)  # d t(L, d) is least at d = lo
    held = float(footprint.shared.sum()) / footprint.cap  # memory per rank x ranks, over the cap: at least this
    slots = max(held, stages * held - n * (stages - 1)) if virtual == 1 else stages * held
    area = (float((lo * t_lo).sum()) + m * slots) / n
    longest = m + float(model.best_time(tokens, work, lo=lo, hi=n)[0].max(initial=0.0))
    fill_drain = (stages - 1) * m / (stages * virtual)
    mixed = in_flight_bound(model, tokens, work, footprint, stages, fill_drain + m * slots / (n * stages),
                            (virtual + 1) / (2 * virtual))
    return model.step_overhead_s + phase_s + max(max(groups, area) / stages + fill_drain, longest, mixed)


MIX_WEIGHTS = np.linspace(0.0, 1.0, 21)
"""The weights lambda at which `in_flight_bound` mixes its two bounds."""


def in_flight_bound(model: CostModel, tokens: np.ndarray, work: np.ndarray, footprint: Footprint, stages: int,
                    area_const: float, held_share: float = 1.0) -> float:
    """A bound (without sigma) from the memory rule over time, mixed with the area bound per sample degree.

    B: at every moment the microbatches stage 0 of a position keeps in flight are within P consecutive
    slots (1F1B), so they hold at most M tokens per rank; a microbatch is in flight there from the start of
    F(j, 0) to the end of B(j, 0), at least its PP = 1 time T. Integrated over the step and summed over the
    N positions, N M (step - sigma) >= sum over microbatches of X T >= sum_i L_i (m + t(L_i, d_i)), with
    d_i the degree sample i runs at. A: the area bound with those degrees, area_const + sum_i d_i t(L_i,
    d_i) / (N P). Both hold for the plan's own degrees, so for every lambda in [0, 1] the step is at least
    lambda A + (1 - lambda) B, and so at least its minimum over each sample's degree d >= its memory minimum
    (`Footprint.min_degree`; X counts encoder memory as the footprint does).
    lambda = 1 is the area term alone; B alone would let every sample take its fastest degree.
    `held_share` scales B's memory-time (interleaved: (V + 1) / 2V, see `lower_bound`).
    """
    n, cap, m = model.domain.world_size, footprint.cap, model.microbatch_overhead(1)
    ds = np.arange(1, n + 1)
    lo = footprint.min_degree()
    lam = MIX_WEIGHTS[:, None, None]
    total = np.zeros(len(MIX_WEIGHTS))
    step = max(1, 2**18 // n)  # bounded memory: weights x samples x N per chunk
    for begin in range(0, len(tokens), step):
        chunk = slice(begin, begin + step)
        t = model.time_table(tokens[chunk], work[chunk], ds)
        a = ds[None, :] * t / (n * stages)
        memory = footprint.shared[chunk, None] + ds[None, :] * footprint.held[chunk, None]  # x per rank x d
        b = held_share * memory * (m + t) / (n * cap)
        mix = np.where(ds[None, None, :] >= lo[chunk, None][None], lam * a + (1 - lam) * b, np.inf)
        total += mix.min(axis=2).sum(axis=1)
    return float((MIX_WEIGHTS * area_const + total).max())
