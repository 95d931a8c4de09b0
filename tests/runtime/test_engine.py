"""The step engine's walk on one process: slot order, indices, the idle slot, where the reduction starts."""

from __future__ import annotations

import contextlib

import torch

from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.dispatch import MicrobatchInputs, StepInputs
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import OverlappedReduction, StepEngine
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.workload.sample import Batch


class Recorder:
    """A `MicrobatchWork` that logs every call, and whether the reduction was held back at the time."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.held = False

    def forward(self, slot):
        self.log.append(("F", slot.inputs.layout.sample_ids, slot.index, slot.count, self.held))
        return slot.index

    def backward(self, output):
        self.log.append(("B", output, self.held))

    def overlap(self) -> OverlappedReduction:
        @contextlib.contextmanager
        def no_sync():
            self.held = True
            yield
            self.held = False

        return OverlappedReduction(no_sync=no_sync, start=lambda: self.log.append(("start",)))


def _engine(position: int = 0) -> StepEngine:
    domain = DynamicDomain(global_ranks=(0, 1), rank=position, all_domains=((0, 1),))
    return StepEngine(domain, GroupPool(domain))


def _inputs(*sample_ids: int) -> StepInputs:
    plan = Plan("t", 2, 2, Batch.from_lengths([4, 4, 4]).samples,
                (PlanGroup((0,), tuple((s,) for s in sample_ids)), PlanGroup((1,), ())))
    z = torch.zeros(4, dtype=torch.int64)
    mbs = tuple(MicrobatchInputs((0,), 0, MicrobatchLayout((s,), (4,), 1, 0), z, z, torch.ones(4), z) for s in sample_ids)
    return StepInputs(plan, mbs, 4 * len(sample_ids), 4 * len(sample_ids))


def test_walk_runs_each_slot_forward_then_backward_and_overlaps_only_the_last():
    work = Recorder()
    _engine().run(_inputs(0, 1, 2), work, comm="allgather", overlap=work.overlap())
    assert work.log == [
        ("F", (0,), 0, 3, True), ("B", 0, True),
        ("F", (1,), 1, 3, True), ("B", 1, True),
        ("F", (2,), 2, 3, False), ("B", 2, False),  # outside no_sync: its backward starts the reduction
    ]


def test_an_idle_position_runs_one_idle_slot():
    work = Recorder()
    inputs = _inputs(0)
    _engine(position=1).run(StepInputs(inputs.plan, (), 4, 4), work, comm="ring")
    assert work.log == [("F", (-1,), 0, 1, False), ("B", 0, False)]
