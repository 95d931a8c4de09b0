"""Pipeline slots: the microbatch list each domain position runs under pipeline parallelism (PP = P > 1).

Every (TP, PP) coordinate's domain applies the same plan, so a dynamic group is one pipeline and each domain
position runs megatron-core's non-interleaved 1F1B over its own list of *slots*, laid out phase by phase:
in every phase but the last, every position runs k_q = (the most microbatches any position has in phase q)
slots and fills the ones it has no microbatch for with idle slots (a one-token, zero-loss microbatch on a
group of one); the last phase is not padded. A group of phase p therefore runs its microbatch j at slot
o_p + j on every member, o_p = sum_{q<p} k_q, so all members meet each of its collectives at the same 1F1B
step (deadlock-free by construction; docs/cost-model.md). Stage s keeps up to min(P - s, K) microbatches in
flight, so the per-rank token cap must hold over any P consecutive slots of a position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from megatron_dhp.plan.memory import Footprint
    from megatron_dhp.plan.plan import Plan


def pipeline_token_cap(max_tokens_per_rank: int, stages: int) -> int:
    """Tokens per rank one microbatch may hold at `stages` pipeline stages: M // P, so that the P microbatches
    stage 0 keeps in flight under 1F1B hold at most M per rank (M itself without pipelining)."""
    return max_tokens_per_rank // stages


class SlotRef(NamedTuple):
    """One real microbatch of a position's slot list: `plan.groups[group].microbatches[microbatch]`."""

    group: int
    microbatch: int


def pipeline_slots(plan: Plan) -> list[list[SlotRef | None]]:
    """Each domain position's slots, in slot order; None is an idle slot (every phase but the last padded to
    the same offset on all positions)."""
    groups_by_phase: list[list[int]] = [[] for _ in range(plan.num_phases)]
    for gi, g in enumerate(plan.groups):
        groups_by_phase[g.phase].append(gi)
    slots: list[list[SlotRef | None]] = [[] for _ in range(plan.world_size)]
    offset, last = 0, plan.num_phases - 1
    for phase, members in enumerate(groups_by_phase):
        for gi in members:
            g = plan.groups[gi]
            for r in g.ranks:
                slots[r] += [SlotRef(gi, j) for j in range(len(g.microbatches))]
        if phase < last:
            offset += max((len(plan.groups[gi].microbatches) for gi in members), default=0)
            for row in slots:
                row += [None] * (offset - len(row))
    return slots


def slot_tokens_per_rank(plan: Plan, slots: list[SlotRef | None], footprint: Footprint) -> list[float]:
    """Tokens per rank of each slot of one position under the plan's `footprint` (an idle slot's single
    token is not counted: the cap is for the microbatches a plan places)."""
    out = []
    for slot in slots:
        if slot is None:
            out.append(0.0)
        else:
            g = plan.groups[slot.group]
            out.append(footprint.per_rank(plan.positions(g.microbatches[slot.microbatch]), g.size))
    return out
