"""The token move's send side without a process group: the same rows in the same order as laying out every
position's microbatches, while laying out only those that hold this rank's samples."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_dhp.cost.config import Domain
from megatron_dhp.runtime import dispatch
from megatron_dhp.runtime import layout as layouts
from megatron_dhp.runtime.layout import microbatches_of
from megatron_dhp.runtime.slots import aligned_slot_rows
from megatron_dhp.solver.random_plan import random_plan
from megatron_dhp.workload.sample import Batch


def every_layout_order(plan, me, owners, lengths, first_row, seq_multiple, slot_rows):
    """The send order as the dispatch computed it before: every destination's every microbatch laid out."""
    picks, send_rows = [torch.empty(0, dtype=torch.int64)], []
    for dest in range(plan.world_size):
        count = 0
        for layout, _, _ in microbatches_of(plan, dest, lengths, seq_multiple, slot_rows):
            for i, (sid, n) in enumerate(zip(layout.sample_ids, layout.lengths)):
                if owners[sid] == me:
                    held = layout.sample_positions(i)
                    picks.append(first_row[sid] + held[held < n])
                    count += picks[-1].numel()
        send_rows.append(count)
    return torch.cat(picks), send_rows


def problem(seed: int, world: int, samples: int):
    rng = random.Random(seed)
    batch = Batch.from_lengths([rng.randint(1, 200) for _ in range(samples)])
    plan = random_plan(batch, Domain(world_size=world, gpus_per_node=min(world, 8), max_tokens_per_rank=256), rng)
    lengths = {s.id: s.tokens for s in plan.samples}
    owners = {s.id: i % world for i, s in enumerate(plan.samples)}
    return plan, lengths, owners


@pytest.mark.parametrize("seq_multiple,aligned", [(1, False), (2, False), (1, True), (2, True)])
def test_send_order_is_the_layout_of_every_position(seq_multiple, aligned):
    for seed in range(12):
        plan, lengths, owners = problem(seed, 6, 14)
        rows = aligned_slot_rows(plan, seq_multiple) if aligned else None
        for me in range(plan.world_size):
            mine = [sid for sid in sorted(lengths) if owners[sid] == me]
            first_row = dict(zip(mine, itertools.accumulate((lengths[s] for s in mine), initial=0)))
            got = dispatch.send_order(plan, me, owners, lengths, first_row, seq_multiple, rows)
            want = every_layout_order(plan, me, owners, lengths, first_row, seq_multiple, rows)
            assert torch.equal(got[0], want[0]) and got[1] == want[1], (seed, me)


def test_a_rank_lays_out_only_its_own_samples_microbatches_at_1024_ranks(monkeypatch):
    """N = 1,024 ranks, 2,048 samples: one rank builds layouts for its 2 samples' groups only (at most one per
    member), where laying out every position's microbatches builds one per microbatch per member."""
    plan, lengths, owners = problem(3, 1024, 2048)
    built = []
    original = layouts.MicrobatchLayout

    def counted(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(layouts, "MicrobatchLayout", counted)  # what `layout.group_layout` builds
    mine = [sid for sid in sorted(lengths) if owners[sid] == 0]
    first_row = dict(zip(mine, itertools.accumulate((lengths[s] for s in mine), initial=0)))
    dispatch.send_order(plan, 0, owners, lengths, first_row)
    bound = sum(g.size for g in plan.groups for mb in g.microbatches if any(owners[s] == 0 for s in mb))
    assert len(built) == bound <= 2 * max(g.size for g in plan.groups), (len(built), bound)
    everything = sum(g.size * len(g.microbatches) for g in plan.groups)
    assert everything > 100 * len(built), everything
