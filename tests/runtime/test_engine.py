"""The step engine's walk on one process: slot order, indices, the idle slot, where the reduction starts, and
the group each slot gets (a PeerRing under p2p, the pool's otherwise)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.plan.comm import CommPolicy
from megatron_dhp.plan.plan import Plan, PlanGroup
from megatron_dhp.runtime.attention.comm import PeerRing
from megatron_dhp.runtime.domain import DynamicDomain
from megatron_dhp.runtime.engine import OverlappedReduction, StepEngine
from megatron_dhp.runtime.group_pool import GroupPool
from megatron_dhp.runtime.layout import MicrobatchLayout
from megatron_dhp.runtime.step_data import MicrobatchInputs, StepInputs
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


def _policy(comm: str, n: int = 2) -> CommPolicy:
    return CommPolicy.resolve(comm, max_groups_per_rank=0, world_size=n, gpus_per_node=n)


def _engine(comm: str = "allgather", position: int = 0) -> StepEngine:
    domain = DynamicDomain(global_ranks=(0, 1), rank=position, all_domains=((0, 1),))
    return StepEngine(domain, GroupPool(domain), policy=_policy(comm))


def _inputs(*sample_ids: int) -> StepInputs:
    plan = Plan("t", 2, 2, Batch.from_lengths([4, 4, 4]).samples,
                (PlanGroup((0,), tuple((s,) for s in sample_ids)), PlanGroup((1,), ())))
    z = torch.zeros(4, dtype=torch.int64)
    mbs = tuple(MicrobatchInputs((0,), 0, MicrobatchLayout((s,), (4,), 1, 0), z, z, torch.ones(4), z) for s in sample_ids)
    return StepInputs(plan, mbs, 4 * len(sample_ids), 4 * len(sample_ids))


def test_walk_runs_each_slot_forward_then_backward_and_overlaps_only_the_last():
    work = Recorder()
    _engine().run(_inputs(0, 1, 2), work, overlap=work.overlap())
    assert work.log == [
        ("F", (0,), 0, 3, True), ("B", 0, True),
        ("F", (1,), 1, 3, True), ("B", 1, True),
        ("F", (2,), 2, 3, False), ("B", 2, False),  # outside no_sync: its backward starts the reduction
    ]


def test_an_idle_position_runs_one_idle_slot():
    work = Recorder()
    inputs = _inputs(0)
    _engine("ring", position=1).run(StepInputs(inputs.plan, (), 4, 4), work)
    assert work.log == [("F", (-1,), 0, 1, False), ("B", 0, False)]


def test_p2p_holds_the_reduction_back_until_the_walk_is_done():
    """The domain's communicator carries both p2p's ring and the gradient reduction: all ranks issue them in one
    order only if the reduction starts after every microbatch."""
    work = Recorder()
    _engine("p2p").run(_inputs(0, 1), work, overlap=work.overlap())
    assert work.log == [("F", (0,), 0, 2, True), ("B", 0, True), ("F", (1,), 1, 2, True), ("B", 1, True), ("start",)]


def test_p2p_slot_gets_a_peer_ring_on_the_domain_and_never_asks_the_pool():
    domain = DynamicDomain(global_ranks=(1, 3, 5, 7), rank=5, all_domains=((0, 2, 4, 6), (1, 3, 5, 7)))
    engine = StepEngine(domain, GroupPool(domain), policy=_policy("p2p", 4))
    z = torch.zeros(4, dtype=torch.int64)
    mb = MicrobatchInputs((0, 2, 3), 0, MicrobatchLayout((0,), (12,), 3, 1), z, z, torch.ones(4), z)
    ring = engine.slot(mb, 0, 1).context.group
    assert ring == PeerRing(members=(1, 5, 7), index=1, group=None)
    assert (ring.size(), ring.rank(), ring.next, ring.previous) == (3, 1, 7, 1)
    assert PeerRing.in_domain(domain, (2,)) is None  # one rank: nothing to send
    with pytest.raises(DhpError, match="group \\(0, 2, 3\\) was not prepared"):  # the other variants ask the pool
        StepEngine(domain, GroupPool(domain), policy=_policy("ring", 4)).slot(mb, 0, 1)
    with pytest.raises(DhpError, match="no comm policy, so it only moves tokens"):
        StepEngine(domain, GroupPool(domain)).slot(mb, 0, 1)
    with pytest.raises(DhpError, match="lacks the comm policy's start-up groups"):
        StepEngine(domain, GroupPool(domain), policy=CommPolicy.resolve("mixed", world_size=4, gpus_per_node=4))
