"""The ordered work list of one domain position in one step: its microbatch slots and phase barriers.

This is the one rule for what a rank runs: its microbatches in phase order (microbatch order within its
group), a `PHASE_BARRIER` after every phase but the last when the plan separates phases by barriers (as
megatron-core's hybrid CP scheduler does), and, for a position the plan leaves idle, one *idle slot*: a
one-token microbatch with no loss on a group of one, so every rank runs the same per-step code and reports
a loss entry (it adds exactly zero to the gradients).

*Aligned* slots (expert parallelism): megatron-core's MoE token dispatcher runs collectives over the
expert-parallel group in every MoE layer of every microbatch, forward and backward, and a microbatch's
attention runs collectives over its CP group. Both stay matched only if every rank runs its k-th slot of a
phase at the same time as every rank it shares a group with; since EP groups and CP groups between them may
link any two positions, every phase is padded with idle slots to the most microbatches any position of the
domain runs in it. Then the k-th slot of a phase is the k-th slot everywhere, each idle slot still routes its
one token through the experts (with zero gradient), and no collective waits on one that comes later. Fully
sharded data parallelism (torch FSDP2) needs the same: it gathers every layer's weights in each microbatch's
forward and scatters its gradients in each backward, over the whole domain. Every walk over a step, the plain one of
`engine.StepEngine.run` and the pipeline schedule (`pipeline_work`, the rule of `plan.pipeline`), takes its
order from here.

*Equal rows* (the allgather MoE dispatcher): megatron-core's `MoEAllGatherTokenDispatcher` all-gathers
equally long token blocks over the TP x EP group, so aligned slots must also be equally long there. Every
rank pads its k-th slot of a phase to `aligned_slot_rows`, the most local rows any position of the domain
holds in that slot, known from the plan alone (under uneven shares the most any rank of it holds); the extra
rows extend the last sample's padding (`layout.MicrobatchLayout.rows`). They are routed through the experts like an idle slot's token, with
zero gradient.
"""

from __future__ import annotations

import math

import torch

from megatron_dhp.plan.pipeline import SlotRef, padded_slot_count, pipeline_slots
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.layout import MicrobatchLayout, SlotRows
from megatron_dhp.runtime.step_data import MicrobatchInputs, StepInputs

PHASE_BARRIER = None
"""An item of `work_items`: a barrier over the domain between two phases."""

WorkItem = MicrobatchInputs | None
"""A slot's microbatch, or `PHASE_BARRIER`."""


def work_items(inputs: StepInputs, position: int, *, aligned: bool = False) -> list[WorkItem]:
    """Domain position `position`'s slots of the step in execution order, with its phase barriers; `aligned`
    pads every phase with idle slots to `aligned_slot_counts` (expert parallelism), each idle slot to its
    slot's rows when the step equalises them (`StepInputs.slot_rows`)."""
    plan, rows = inputs.plan, inputs.slot_rows
    assert aligned or rows is None, "equal slot rows need aligned slots"
    microbatches = list(inputs.microbatches)
    if not aligned:
        microbatches = microbatches or [idle_microbatch(position, inputs.seq_multiple)]
        if not plan.phase_barrier:
            return microbatches
    counts = aligned_slot_counts(plan) if aligned else None
    work: list[WorkItem] = []
    for phase in range(plan.num_phases):
        mine = [mb for mb in microbatches if mb.phase == phase]
        if counts is not None:
            mine += [idle_microbatch(position, inputs.seq_multiple, None if rows is None else rows[phase][k])
                     for k in range(len(mine), counts[phase])]
        work += mine
        if plan.phase_barrier and phase < plan.num_phases - 1:
            work.append(PHASE_BARRIER)
    return work


def last_backward_shared(plan: Plan, *, aligned: bool = False, pipelined: bool = False) -> bool:
    """Whether every position may start an overlapped gradient reduction in its last slot's backward
    (megatron DDP's `overlap_grad_reduce`; megatron-core's 1F1B does so at each position's last backward).

    The reduction is a collective over the whole domain. A rank that starts its buckets inside a multi-rank
    microbatch queues them ahead of that microbatch's remaining attention kernels; if a peer of the group has
    slots after it, the peer reaches the buckets only after those, so the group waits on the bucket and the
    bucket on the group (with one hardware queue, `CUDA_DEVICE_MAX_CONNECTIONS=1`, a deadlock gloo cannot
    show). Safe when each position's last slot is idle, of a group of one, or the last slot of every member
    of its group. From the plan alone: the same answer on every rank. `pipelined`: the 1F1B slot lists
    (`plan.pipeline.pipeline_slots`) instead of the walk's; `aligned`: with the aligned slots' padding (which
    always keeps the rule: every position's last slot is then at one index, idle or its group's last)."""
    lasts = last_slots(plan, aligned=aligned, pipelined=pipelined)
    checked: set[SlotRef] = set()
    for last in lasts:
        if last is None or last in checked or plan.groups[last.group].size == 1:
            continue
        checked.add(last)
        if any(lasts[r] != last for r in plan.groups[last.group].ranks):
            return False
    return True


def last_slots(plan: Plan, *, aligned: bool = False, pipelined: bool = False) -> list[SlotRef | None]:
    """Each position's last slot (None: an idle one) of the walk (`work_items`) or, `pipelined`, of its 1F1B
    slot list (`plan.pipeline.pipeline_slots`), `aligned` with the aligned slots' padding: from one pass over
    the groups, without building the lists (it runs every step, on every rank)."""
    n, phases = plan.world_size, plan.num_phases
    counts = [[0] * phases for _ in range(n)]
    ends: list[list[SlotRef | None]] = [[None] * phases for _ in range(n)]
    for gi, group in enumerate(plan.groups):
        if group.microbatches:
            for r in group.ranks:
                counts[r][group.phase] = len(group.microbatches)
                ends[r][group.phase] = SlotRef(gi, len(group.microbatches) - 1)
    widest = [max(row[q] for row in counts) for q in range(phases)]  # a padded phase's slots

    def last_padded(p: int, phase_limit: int) -> SlotRef | None:
        """The end of position p's last non-empty padded phase before `phase_limit`: its own slot if it fills it."""
        q = next((q for q in reversed(range(phase_limit)) if widest[q]), None)
        return ends[p][q] if q is not None and counts[p][q] == widest[q] else None

    if not pipelined:
        if aligned:  # an all-idle phase 0's one idle slot (`aligned_slot_counts`) is idle, None, as no slot
            return [last_padded(p, phases) for p in range(n)]
        return [next((ends[p][q] for q in reversed(range(phases)) if counts[p][q]), None) for p in range(n)]
    last = phases - 1  # 1F1B pads every phase but the last to its widest, then the end where asked
    lengths = [sum(widest[:last]) + counts[p][last] for p in range(n)]
    end = (padded_slot_count(max(lengths), plan.pipeline_stages) if plan.virtual_stages > 1
           else max(lengths) if aligned else None)
    return [None if end is not None and lengths[p] < end else ends[p][last] if counts[p][last]
            else last_padded(p, last) for p in range(n)]


def slot_rules(expert_parallel: int, dispatcher: str | None, *, fully_sharded: bool = False) -> tuple[bool, bool]:
    """(aligned slots, equal rows) of a step under expert parallelism `expert_parallel` and, with
    `fully_sharded`, FSDP over the domain: the dispatcher's expert-parallel collectives and FSDP's per-layer
    domain collectives pair up only if every position runs the same slots, and megatron-core's `allgather`
    dispatcher also gathers equally long blocks, so its k-th slots must hold equal rows."""
    experts = expert_parallel > 1
    return experts or fully_sharded, experts and dispatcher == "allgather"


def aligned_slot_counts(plan: Plan) -> list[int]:
    """Slots per phase when aligned: the most microbatches any position runs in it (phase 0 at least one,
    the idle slot of a position the plan leaves idle)."""
    counts = [[0] * plan.num_phases for _ in range(plan.world_size)]
    for group in plan.groups:
        for rank in group.ranks:
            counts[rank][group.phase] += len(group.microbatches)
    return [max(max(per_rank[phase] for per_rank in counts), 1 if phase == 0 else 0)
            for phase in range(plan.num_phases)]


def aligned_slot_rows(plan: Plan, seq_multiple: int = 1) -> SlotRows:
    """Local rows of every aligned slot, `[phase][k]`: the most any position of the domain holds in it (an
    idle slot counts as one), rounded up to a multiple of every such layout's `row_multiple` so that each
    can pad to it. From the plan alone, the same on every rank."""
    lengths = {s.id: s.tokens for s in plan.samples}
    idle = _idle_layout(seq_multiple)
    table = []
    for phase, count in enumerate(aligned_slot_counts(plan)):
        slots = [[idle] * count for _ in range(plan.world_size)]
        for group in plan.groups:
            if group.phase == phase:
                for k, mb in enumerate(group.microbatches):
                    layout = MicrobatchLayout(mb, tuple(lengths[s] for s in mb), group.size, 0, seq_multiple,
                                              group.sorted_shares)
                    for rank in group.ranks:
                        slots[rank][k] = layout
        table.append(tuple(_common_rows([per_rank[k] for per_rank in slots]) for k in range(count)))
    return tuple(table)


def _common_rows(layouts: list[MicrobatchLayout]) -> int:
    step = math.lcm(*(layout.row_multiple for layout in layouts))
    return -(-max(max(layout.rank_slots) for layout in layouts) // step) * step


def pipeline_work(inputs: StepInputs, position: int, *, aligned: bool = False) -> list[MicrobatchInputs]:
    """Domain position `position`'s 1F1B slots under pipeline parallelism (`plan.pipeline.pipeline_slots`):
    its microbatches with idle slots where a phase pads, at least one slot. No barriers: slot alignment
    already orders the phases. `aligned` pads the end with idle slots to the most slots any position runs,
    so every position runs the same 1F1B schedule (expert parallelism)."""
    plan = inputs.plan
    by_samples = {mb.layout.sample_ids: mb for mb in inputs.microbatches}
    slots = pipeline_slots(plan)
    length = max(1, max(map(len, slots)) if aligned else len(slots[position]))
    mine = slots[position] + [None] * (length - len(slots[position]))
    return [
        idle_microbatch(position, inputs.seq_multiple) if slot is None
        else by_samples[tuple(plan.groups[slot.group].microbatches[slot.microbatch])]
        for slot in mine
    ]


def idle_microbatch(position: int, seq_multiple: int = 1, rows: int | None = None) -> MicrobatchInputs:
    """An idle slot: one token (id 0, sample id -1; padded to `seq_multiple` rows, or to `rows`) with loss
    mask 0, on a group of `position` alone."""
    layout = _idle_layout(seq_multiple)
    if rows is not None:
        layout = layout.with_rows(rows)
    zero = torch.zeros(layout.num_slots, dtype=torch.int64)
    return MicrobatchInputs(
        group_ranks=(position,),
        phase=0,
        layout=layout,
        input_ids=zero,
        labels=zero,
        loss_mask=torch.zeros(layout.num_slots),
        position_ids=layout.local_positions,
    )


def _idle_layout(seq_multiple: int) -> MicrobatchLayout:
    return MicrobatchLayout(sample_ids=(-1,), lengths=(1,), group_size=1, rank=0, seq_multiple=seq_multiple)
