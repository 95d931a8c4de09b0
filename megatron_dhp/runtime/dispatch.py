"""From each rank's slice of the global batch to each rank's zigzag shards of its microbatches.

Every rank starts with the samples a Megatron data loader would give it (`step_data.local_slice`: with
micro-batch size 1, domain position i holds samples i, i+N, i+2N, ...). Once every rank holds the gathered
batch and the same plan (`collectives`), `move_tokens` moves token ids, labels and loss mask with one
`all_to_all_single` (uneven splits) so each rank holds exactly its zigzag shards, packed per microbatch as
THD tensors. `engine.StepEngine` runs it, after the collectives, for every entry point.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.collectives import all_to_all_rows
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.fused import gather_rows, scatter_rows
from megatron_dhp.runtime.layout import MicrobatchLayout, SlotRows, group_layout, microbatches_of
from megatron_dhp.runtime.step_data import GatheredBatch, MicrobatchInputs, StepInputs, TokenSample


def move_tokens(local: Sequence[TokenSample], plan: Plan, gathered: GatheredBatch, domain: DynamicDomain, *,
                seq_multiple: int = 1, slot_rows: SlotRows | None = None) -> StepInputs:
    """Send every token to the rank that computes it and pack this rank's microbatches (each sample's shard
    padded to a multiple of `seq_multiple`, see `layout`; the k-th microbatch of a phase padded further to
    `slot_rows[phase][k]` rows when given). Collective."""
    me = domain.position
    lengths = {s.id: s.tokens for s in gathered.batch.samples}
    # this rank's samples back to back, one row (input id, label, loss mask) per token
    fields = [torch.stack([t.to(torch.int64) for t in (s.input_ids, s.labels, s.loss_mask)], 1) for s in local]
    rows = torch.cat([torch.empty(0, 3, dtype=torch.int64), *fields])
    first_row = dict(zip((s.id for s in local), itertools.accumulate((s.length for s in local), initial=0)))

    picks, send_rows = send_order(plan, me, gathered.owners, lengths, first_row, seq_multiple, slot_rows)
    send = gather_rows(rows, picks)

    mine = microbatches_of(plan, me, lengths, seq_multiple, slot_rows)
    owner_of_sample = [gathered.owners[sid] for layout, _, _ in mine for sid in layout.sample_ids]
    slots_of_sample = [n for layout, _, _ in mine for n in layout.local_lengths]
    sources = torch.repeat_interleave(
        torch.tensor(owner_of_sample, dtype=torch.int64), torch.tensor(slots_of_sample, dtype=torch.int64)
    )
    real = torch.cat([layout.real() for layout, _, _ in mine] or [torch.empty(0, dtype=torch.bool)])
    recv_counts = torch.bincount(sources[real], minlength=domain.size).tolist()
    received = all_to_all_rows(send, send_rows, recv_counts, domain, on_host=True).cpu()

    # received rows come grouped by source rank, each group in this rank's slot order; padding slots stay 0
    real_slots = torch.nonzero(real).view(-1)
    order = torch.argsort(sources[real], stable=True)
    slots = scatter_rows(received, real_slots[order], real.numel())
    return StepInputs(
        plan=plan,
        microbatches=tuple(_pack(mine, slots)),
        num_loss_tokens=gathered.num_loss_tokens,
        num_tokens=gathered.batch.num_tokens,
        seq_multiple=seq_multiple,
        slot_rows=slot_rows,
    )


def send_order(plan: Plan, me: int, owners: dict[int, int], lengths: dict[int, int], first_row: dict[int, int],
               seq_multiple: int = 1, slot_rows: SlotRows | None = None) -> tuple[torch.Tensor, list[int]]:
    """The rows of this rank's samples (`first_row`: where each starts in its local rows) in send order, and
    how many go to each position: per destination, in its slot order, the real rows of each shard it
    computes from here. Only the microbatches holding one of this rank's samples are laid out (for each
    member of their group), not every position's: O(own samples x group size), whatever N."""
    per_dest: list[list[tuple[tuple[int, int], torch.Tensor]]] = [[] for _ in range(plan.world_size)]
    for group in plan.groups:
        ranks = tuple(sorted(group.ranks))
        for k, mb in enumerate(group.microbatches):
            held_here = [i for i, sid in enumerate(mb) if owners[sid] == me]
            if not held_here:
                continue
            for index, dest in enumerate(ranks):
                layout = group_layout(group, k, index, lengths, seq_multiple, slot_rows)
                for i in held_here:
                    positions = layout.sample_positions(i)
                    per_dest[dest].append(((group.phase, k), first_row[mb[i]] + positions[positions < lengths[mb[i]]]))
    ordered = [sorted(parts, key=lambda part: part[0]) for parts in per_dest]  # stable: samples keep their order
    picks = [rows for parts in ordered for _, rows in parts]
    return torch.cat([torch.empty(0, dtype=torch.int64), *picks]), [sum(r.numel() for _, r in p) for p in ordered]


def _pack(mine: list[tuple[MicrobatchLayout, tuple[int, ...], int]], slots: torch.Tensor) -> list[MicrobatchInputs]:
    out, start = [], 0
    for layout, ranks, phase in mine:
        block = slots[start : start + layout.num_slots]
        start += layout.num_slots
        out.append(
            MicrobatchInputs(
                group_ranks=ranks,
                phase=phase,
                layout=layout,
                input_ids=block[:, 0].contiguous(),
                labels=block[:, 1].contiguous(),
                loss_mask=block[:, 2].to(torch.float32),
                position_ids=layout.local_positions,
            )
        )
    return out
