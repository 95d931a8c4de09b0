"""Rounds for 1F1B: every phase a partition of the whole domain, each group running one microbatch.

Under pipeline parallelism every phase but the last is padded to its longest group's microbatch count
(`plan.pipeline_slots`), so a layout whose phases each cover every rank with one microbatch per group runs
no idle slot and gives every position the same slot count. The rounds are fcp-ref's (best-fit decreasing
into atomic groups, first-fit into rounds, a makespan DP over each round's degrees: `solver/fcp_ref.py`);
what 1F1B adds is their order and how full they are.

Order: the fill waits on the first slot's forward and the drain on the last slot's backward, twice as long,
so the shortest round goes last, the second shortest first, the rest longest first (as `pipeline_order`
does within a group).

Fullness: the memory rule bounds the tokens per rank over any P consecutive slots by M. Rounds of at most
M // P per rank are one way to meet it (`round_layouts`). The other (`spaced_round_groups`) runs rounds of
nearly M per rank, each followed by P - 1 *filler* slots: one group of the whole domain running the
batch's shortest samples, one per microbatch, so a window of P slots holds one full round and fillers.
Fewer, wider-packed rounds run their samples on fewer ranks; the fillers cost about an idle slot each.
"""

from __future__ import annotations

import math

from megatron_dhp.plan.family import GroupFamily
from megatron_dhp.plan.memory import Footprint
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.solver.dhp.instance import Instance
from megatron_dhp.solver.fcp_ref import FCPRefPlanner, bfd_pack, round_groups, split_rounds
from megatron_dhp.workload.sample import Batch


def round_layouts(inst: Instance, batch: Batch) -> list[list[PlanGroup]]:
    """fcp-ref's rounds of at most M // P tokens per rank (the instance's cap), in 1F1B order and in its
    own (longest bins first): the order heuristic is not always the faster one."""
    groups = FCPRefPlanner().solve(batch, inst.model.with_token_cap(inst.cap))
    phase_of = {q: k for k, q in enumerate(round_order(inst, groups))}
    return [[PlanGroup(ranks=g.ranks, microbatches=g.microbatches, phase=phase_of[g.phase]) for g in groups], groups]


def spaced_round_groups(inst: Instance, batch: Batch, stages: int) -> list[PlanGroup] | None:
    """Full rounds ordered for 1F1B with P - 1 filler slots between consecutive ones; None where the batch
    fits one round or has too few short samples to fill the gaps."""
    model = inst.model
    n = model.domain.world_size
    full = model.footprint(batch.samples)  # at M: a round and its fillers share the P slots' budget
    shortest = sorted(range(len(batch)), key=lambda i: (batch.samples[i].tokens, batch.samples[i].id))
    num_fillers = 0
    for _ in range(3):  # the fillers leave the rounds, which may then need fewer gaps
        if num_fillers >= len(shortest):
            return None
        fillers = shortest[:num_fillers]
        filler_cap = math.ceil(full.per_rank(fillers[-(stages - 1):], n)) if fillers else 0
        kept = sorted(set(range(len(batch))) - set(fillers))
        rest = Batch(tuple(batch.samples[i] for i in kept))
        footprint = Footprint(full.shared[kept], full.held[kept], full.cap - filler_cap)
        min_cp = footprint.min_degree()
        if filler_cap >= full.cap or int(min_cp.max()) > n:
            return None
        rounds = split_rounds(bfd_pack(footprint, min_cp), n)
        gaps = len(rounds) - 1
        if gaps * (stages - 1) <= num_fillers:
            break
        num_fillers = gaps * (stages - 1)
    else:
        return None
    if gaps < 1 or full.per_rank(fillers[-stages:], n) > full.cap:  # P fillers in a row hold M too
        return None
    groups = round_groups(model, rest, rounds, n)  # fcp-ref's groups of these rounds, as its solve makes them
    phase_of = {q: 2 * k for k, q in enumerate(round_order(inst, groups))}
    out = [PlanGroup(ranks=g.ranks, microbatches=g.microbatches, phase=phase_of[g.phase]) for g in groups]
    everyone = tuple(range(n))
    for k in range(gaps):  # the surplus fillers, if any, go to the first gaps
        share = [batch.samples[i] for i in fillers[k::gaps]]
        out.append(PlanGroup(ranks=everyone, microbatches=tuple((s.id,) for s in share), phase=2 * k + 1))
    return out


def round_order(inst: Instance, groups: list[PlanGroup]) -> list[int]:
    """The rounds (phases) of one-microbatch groups in 1F1B order of their longest microbatch."""
    span: dict[int, float] = {}
    for g, times in zip(groups, inst.layout_times(groups)):
        span[g.phase] = max(span.get(g.phase, 0.0), *times)
    return pipeline_order_of(sorted(span, key=lambda q: (-span[q], q)))


def pipeline_order_of(longest_first: list) -> list:
    """Items sorted longest first, reordered for 1F1B: second shortest, the rest longest first, shortest."""
    if len(longest_first) < 3:
        return longest_first[::-1]
    return [longest_first[-2], *longest_first[:-2], longest_first[-1]]


def fit_to_family(family: GroupFamily, groups: list[PlanGroup], inst: Instance) -> list[PlanGroup] | None:
    """The layout moved onto the family, phase by phase: each group, widest first, on the first free family
    window of the largest family size between its microbatches' memory minimum (the instance's footprint)
    and its own size (or the next family size up); ranks it leaves free sit the phase out. None where a
    phase does not fit."""
    position = inst.position
    out: list[PlanGroup] = []
    for phase in sorted({g.phase for g in groups}):
        members = sorted((g for g in groups if g.phase == phase), key=lambda g: (-g.size, g.ranks[0]))
        covered = sorted({r for g in members for r in g.ranks})
        free = (1 << family.world_size) - 1  # bit r: position r is free
        for g in members:
            need = max((inst.footprint.min_ranks([position[i] for i in mb]) for mb in g.microbatches), default=1)
            sizes = [s for s in family.sizes if need <= s <= g.size] or [family.ceil_size(g.size)]
            window = next(((a, s) for s in reversed(sizes) if (a := family.first_free(s, free)) is not None), None)
            if window is None:
                return None
            a, s = window
            free &= ~(((1 << s) - 1) << a)
            out.append(PlanGroup(ranks=tuple(range(a, a + s)), microbatches=g.microbatches, phase=phase))
        out += [PlanGroup(ranks=(r,), microbatches=(), phase=phase) for r in covered if free >> r & 1]
    return out
