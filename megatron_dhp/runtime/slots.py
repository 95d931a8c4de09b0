"""The ordered work list of one domain position in one step: its microbatch slots and phase barriers.

This is the one rule for what a rank runs: its microbatches in phase order (microbatch order within its
group), a `PHASE_BARRIER` after every phase but the last when the plan separates phases by barriers (as
megatron-core's hybrid CP scheduler does), and, for a position the plan leaves idle, one *idle slot*: a
one-token microbatch with no loss on a group of one, so every rank runs the same per-step code and reports
a loss entry (it adds exactly zero to the gradients). Every walk over a step, the plain one of
`engine.StepEngine.run` and the pipeline schedule (`pipeline_work`, the rule of `plan.pipeline`), takes its
order from here.
"""

from __future__ import annotations

import torch

from megatron_dhp.plan.pipeline import pipeline_slots
from megatron_dhp.runtime.dispatch import MicrobatchInputs, StepInputs
from megatron_dhp.runtime.layout import MicrobatchLayout

PHASE_BARRIER = None
"""An item of `work_items`: a barrier over the domain between two phases."""

WorkItem = MicrobatchInputs | None
"""A slot's microbatch, or `PHASE_BARRIER`."""


def work_items(inputs: StepInputs, position: int) -> list[WorkItem]:
    """Domain position `position`'s slots of the step in execution order, with its phase barriers."""
    microbatches = list(inputs.microbatches) or [idle_microbatch(position, inputs.seq_multiple)]
    plan = inputs.plan
    if not plan.phase_barrier:
        return microbatches
    work: list[WorkItem] = []
    for phase in range(plan.num_phases):
        work += [mb for mb in microbatches if mb.phase == phase]
        if phase < plan.num_phases - 1:
            work.append(PHASE_BARRIER)
    return work


def pipeline_work(inputs: StepInputs, position: int) -> list[MicrobatchInputs]:
    """Domain position `position`'s 1F1B slots under pipeline parallelism (`plan.pipeline.pipeline_slots`):
    its microbatches with idle slots where a phase pads, at least one slot. No barriers: slot alignment
    already orders the phases."""
    plan = inputs.plan
    by_samples = {mb.layout.sample_ids: mb for mb in inputs.microbatches}
    work = [
        idle_microbatch(position, inputs.seq_multiple) if slot is None
        else by_samples[tuple(plan.groups[slot.group].microbatches[slot.microbatch])]
        for slot in pipeline_slots(plan)[position]
    ]
    return work or [idle_microbatch(position, inputs.seq_multiple)]


def idle_microbatch(position: int, seq_multiple: int = 1) -> MicrobatchInputs:
    """An idle slot: one token (id 0, sample id -1; padded to `seq_multiple` rows) with loss mask 0, on a
    group of `position` alone."""
    layout = MicrobatchLayout(sample_ids=(-1,), lengths=(1,), group_size=1, rank=0, seq_multiple=seq_multiple)
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
