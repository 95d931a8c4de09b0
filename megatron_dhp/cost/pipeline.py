"""Price a plan under pipeline parallelism (P > 1 stages): 1F1B per stage over each position's slots.

How a microbatch's PP = 1 time T = m (+ lambda) + sum t splits: the cost model describes the whole model,
and each stage runs 1/P of its layers, so one microbatch costs T / P on every stage, a third of it in the
forward and two thirds in the backward (F = T / 3P, B = 2T / 3P). An idle slot is a one-token microbatch on
a group of one, priced the same way (m + t(1, 1), split alike). No cost key is added: at P = 1 this is the
plain sum of BENCHMARK.md section 2.

Stage s of a position runs its K slots in megatron-core's non-interleaved 1F1B order: min(P - s - 1, K)
warm-up forwards, then one forward and one backward alternately, then the remaining backwards. F(j, s)
starts after F(j, s - 1) and after the stage's previous op; B(j, s) after B(j, s + 1) and the previous op.
A group's microbatch runs as one op on all its members (their slot indices are equal by the layout), which
starts when all of them are ready. Every op starts at the step overhead sigma at the earliest.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from megatron_dhp.cost.model import CostModel
from megatron_dhp.plan.pipeline import pipeline_slots
from megatron_dhp.plan.plan import Plan, PlanError
from megatron_dhp.workload.sample import Sample

FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of a microbatch's time on a stage (the backward does the other two thirds)."""


def one_f_one_b(num_slots: int, stage: int, stages: int) -> list[tuple[int, int]]:
    """megatron-core's non-interleaved 1F1B order at one stage: (0 forward / 1 backward, slot index)."""
    warmup = min(stages - stage - 1, num_slots)
    order = [(0, j) for j in range(warmup)]
    for i in range(num_slots - warmup):
        order += [(0, warmup + i), (1, i)]
    return order + [(1, j) for j in range(num_slots - warmup, num_slots)]


def idle_slot_time(model: CostModel) -> float:
    """PP = 1 seconds of an idle slot: a one-token microbatch on a group of one."""
    return model.microbatch_time([Sample(0, 1)], [0])


def pipeline_ops(plan: Plan, model: CostModel, microbatch_s: dict[int, tuple[float, ...]]):
    """Each op's start and end (op = (unit, stage, F/B); a unit is one group's microbatch or one idle slot),
    each unit's PP = 1 seconds, each position's slots as unit ids, and the unit id of each real slot.

    Kahn's algorithm over the op graph: an op is done once its stage predecessor and each member's previous
    op are; an op left over is a cycle, which a plan laid out by `pipeline_slots` never has.
    """
    p = plan.pipeline_stages
    idle_s = idle_slot_time(model)
    unit_of: dict[tuple[int, int], int] = {}
    unit_time: list[float] = []
    rows: list[list[int]] = []
    for slots in pipeline_slots(plan):
        row = []
        for slot in slots:
            u = unit_of.get(slot) if slot is not None else None
            if u is None:
                u = len(unit_time)
                unit_time.append(idle_s if slot is None else microbatch_s[slot.group][slot.microbatch])
                if slot is not None:
                    unit_of[slot] = u
            row.append(u)
        rows.append(row)
    num_ops = len(unit_time) * p * 2
    succ: list[list[int]] = [[] for _ in range(num_ops)]
    indeg = [0] * num_ops

    def op(u: int, s: int, kind: int) -> int:
        return (u * p + s) * 2 + kind

    def edge(a: int, b: int) -> None:
        succ[a].append(b)
        indeg[b] += 1

    for u in range(len(unit_time)):
        for s in range(p):
            if s:
                edge(op(u, s - 1, 0), op(u, s, 0))
            edge(op(u, s + 1, 1) if s < p - 1 else op(u, s, 0), op(u, s, 1))
    for row in rows:
        for s in range(p):
            order = one_f_one_b(len(row), s, p)
            for (k0, j0), (k1, j1) in zip(order, order[1:]):
                edge(op(row[j0], s, k0), op(row[j1], s, k1))
    unit = np.asarray(unit_time)
    dur = np.empty(num_ops)
    dur[0::2] = np.repeat(unit * FORWARD_SHARE / p, p)
    dur[1::2] = np.repeat(unit * (1 - FORWARD_SHARE) / p, p)
    start = [model.step_overhead_s] * num_ops
    end = [0.0] * num_ops
    ready = deque(i for i in range(num_ops) if indeg[i] == 0)
    done = 0
    while ready:
        a = ready.popleft()
        done += 1
        end[a] = start[a] + dur[a]
        for b in succ[a]:
            if end[a] > start[b]:
                start[b] = end[a]
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    if done < num_ops:
        raise PlanError(f"the plan's pipeline slots wait on each other in a cycle ({num_ops - done} ops never run)")
    return np.asarray(start), np.asarray(end), unit, rows, unit_of


def lower_bound(model: CostModel, samples, stages: int) -> float:
    """A step time no plan beats at `stages` pipeline stages; the model's own bound at 1 stage.

    LB_P = sigma + W / P + (P - 1) m / P. Some position r carries W_r >= W seconds of PP = 1 slot time, so
    its last stage is busy W_r / P; it cannot start before its first slot's forward has passed the P - 1
    stages before it, nor finish before its last slot's backward has passed them back, and every slot, idle
    or not, costs at least m: (P - 1) (m / 3 + 2 m / 3) / P more. W is the PP = 1 bound without sigma,
    raised by the memory rule: P consecutive slots of a position hold at most M tokens per rank, so a
    position holding T_r tokens per rank runs K_r >= P T_r / M - (P - 1) slots, and over all positions
    sum K_r >= P sum L / M - N (P - 1) (each costing m on its position, against sum L / M in the PP = 1 bound).
    """
    if stages == 1:
        return model.lower_bound(samples)
    tokens = np.fromiter((s.tokens for s in samples), dtype=np.int64, count=len(samples))
    work = model.sample_work(samples)
    groups = model.lower_bound_arrays(tokens, work)
    n, cap, m = model.domain.world_size, model.domain.max_tokens_per_rank, model.microbatch_overhead(1)
    lo = model.min_degree(tokens)
    t_lo = model.sample_time(tokens, work, lo, lo <= model.domain.gpus_per_node)  # d t(L, d) is least at d = lo
    slots = max(float(tokens.sum()) / cap, stages * float(tokens.sum()) / cap - n * (stages - 1))
    area = (float((lo * t_lo).sum()) + m * slots) / n
    return model.step_overhead_s + max(groups, area) / stages + (stages - 1) * m / stages
