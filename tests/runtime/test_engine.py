"""The step engine's walk on one process: slot order, indices, the idle slot, where the reduction starts, and
the group each slot gets (a PeerRing under p2p, the pool's otherwise)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

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

    def finish(self):
        self.log.append(("finish",))

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
    """...and then the engine finishes the step's gradients itself (`MicrobatchWork.finish`), after the walk."""
    work = Recorder()
    _engine().run(_inputs(0, 1, 2), work, overlap=work.overlap())
    assert work.log == [
        ("F", (0,), 0, 3, True), ("B", 0, True),
        ("F", (1,), 1, 3, True), ("B", 1, True),
        ("F", (2,), 2, 3, False), ("B", 2, False),  # outside no_sync: its backward starts the reduction
        ("finish",),
    ]


def test_an_idle_position_runs_one_idle_slot():
    work = Recorder()
    inputs = _inputs(0)
    _engine("ring", position=1).run(StepInputs(inputs.plan, (), 4, 4), work)
    assert work.log == [("F", (-1,), 0, 1, False), ("B", 0, False), ("finish",)]


def test_p2p_holds_the_reduction_back_until_the_walk_is_done():
    """The domain's communicator carries both p2p's ring and the gradient reduction: all ranks issue them in one
    order only if the reduction starts after every microbatch."""
    work = Recorder()
    _engine("p2p").run(_inputs(0, 1), work, overlap=work.overlap())
    assert work.log == [("F", (0,), 0, 2, True), ("B", 0, True), ("F", (1,), 1, 2, True), ("B", 1, True), ("start",),
                        ("finish",)]


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


def _peer_has_more_after_the_shared_microbatch() -> StepInputs:
    """Position 0's last (and only) microbatch is in the group {0, 1}; position 1 runs one more after it."""
    plan = Plan("t", 2, 2, Batch.from_lengths([4, 4]).samples,
                (PlanGroup((0, 1), ((0,),)), PlanGroup((0,), (), phase=1), PlanGroup((1,), ((1,),), phase=1)))
    z = torch.zeros(2, dtype=torch.int64)
    mb = MicrobatchInputs((0, 1), 0, MicrobatchLayout((0,), (4,), 2, 0), z, z, torch.ones(2), z)
    return StepInputs(plan, (mb,), 8, 8)


def test_a_reduction_overlapping_a_group_a_peer_outlasts_waits_for_the_walk(monkeypatch):
    """Position 0's last backward is in a group whose other member still has a microbatch after it: starting
    the overlapped reduction there could queue its buckets ahead of the group's remaining kernels (a deadlock on
    one hardware queue), so the reduction starts after the walk; the rule is the plan's, the same everywhere."""
    from megatron_dhp.runtime.slots import last_backward_shared

    inputs = _peer_has_more_after_the_shared_microbatch()
    assert not last_backward_shared(inputs.plan)
    assert last_backward_shared(inputs.plan, aligned=True)  # aligned: position 0 ends on an idle slot
    assert last_backward_shared(_inputs(0, 1).plan)
    engine = _engine()
    monkeypatch.setattr(engine.pool, "get", lambda ranks: SimpleNamespace(size=lambda: len(ranks), rank=lambda: 0))
    work = Recorder()
    engine.run(inputs, work, overlap=work.overlap())
    assert work.log == [("F", (0,), 0, 1, True), ("B", 0, True), ("start",), ("finish",)]


def test_the_last_backward_rule_over_random_plans_walked_and_pipelined():
    """selftest's random valid plans break the rule often (a group's rank ends while a peer goes on); under
    1F1B equal slot counts (aligned) always keep it, which is what the pipelined engine then runs."""
    import random

    from megatron_dhp.cost.config import Domain
    from megatron_dhp.runtime.slots import last_backward_shared
    from megatron_dhp.solver.random_plan import random_plan

    broken = broken_1f1b = 0
    for seed in range(30):
        rng = random.Random(seed)
        batch = Batch.from_lengths([rng.randint(1, 60) for _ in range(8)])
        plan = random_plan(batch, Domain(world_size=4, gpus_per_node=4, max_tokens_per_rank=64), rng)
        broken += not last_backward_shared(plan)
        broken_1f1b += not last_backward_shared(plan, pipelined=True)
        assert last_backward_shared(plan, aligned=True)
        assert last_backward_shared(plan, aligned=True, pipelined=True)
    assert broken >= 3 and broken_1f1b >= 3, (broken, broken_1f1b)  # 5 and 4 of 30


def test_last_slots_are_the_last_entries_of_the_slot_lists_built_in_full():
    """`slots.last_slots` reads each position's last slot off the groups in one pass; laid out in full (the walk
    phase by phase, padded when aligned; 1F1B's `pipeline_slots`, end-padded when aligned or interleaved), the
    lists end in the same slots, on random plans with phases, idle positions, and 1 or 2 virtual stages."""
    import dataclasses
    import random

    from megatron_dhp.cost.config import Domain
    from megatron_dhp.plan.pipeline import SlotRef, pipeline_slots
    from megatron_dhp.runtime.slots import aligned_slot_counts, last_slots
    from megatron_dhp.solver.random_plan import random_plan

    def walk_rows(plan, aligned):
        counts = aligned_slot_counts(plan) if aligned else None
        rows = []
        for position in range(plan.world_size):
            row = []
            for phase in range(plan.num_phases):
                mine = [SlotRef(plan.groups.index(g), k) for g in plan.groups_of_rank(position) if g.phase == phase
                        for k in range(len(g.microbatches))]
                row += mine + ([None] * (counts[phase] - len(mine)) if counts is not None else [])
            rows.append(row)
        return rows

    def pipeline_rows(plan, aligned):
        rows = pipeline_slots(plan)
        return [row + [None] * (max(map(len, rows)) - len(row)) for row in rows] if aligned else rows

    for seed in range(40):
        rng = random.Random(seed)
        batch = Batch.from_lengths([rng.randint(1, 60) for _ in range(rng.randint(1, 9))])
        plan = random_plan(batch, Domain(world_size=4, gpus_per_node=4, max_tokens_per_rank=64), rng)
        for virtual in (1, 2):
            plan = dataclasses.replace(plan, pipeline_stages=2, virtual_stages=virtual)
            for aligned in (False, True):
                for pipelined, rows in ((False, walk_rows(plan, aligned)), (True, pipeline_rows(plan, aligned))):
                    if virtual > 1 and not pipelined:
                        continue
                    want = [row[-1] if row else None for row in rows]
                    assert last_slots(plan, aligned=aligned, pipelined=pipelined) == want, (seed, virtual, aligned)


@pytest.mark.parametrize("speeds", [(), (0.5,) + (1.0,) * 15], ids=["nominal", "a slow rank"])
def test_every_planner_s_plans_keep_the_overlap_the_last_backward_rule_allows(speeds, gpt7b_config):
    """The rule defers the reduction only for plans that need it: every planner's plans of long-tailed batches on
    16 ranks, with and without a slow rank, walked and under 1F1B, end each group on every member together."""
    from dataclasses import replace

    import numpy as np

    from megatron_dhp.cost import build_cost_model
    from megatron_dhp.runtime.slots import last_backward_shared
    from megatron_dhp.solver import build_planner, run_planner

    model = build_cost_model(replace(gpt7b_config, world_size=16, max_tokens_per_rank=8192,
                                     rank_speeds=speeds))
    for seed in range(2):
        rng = np.random.default_rng(seed)
        batch = Batch.from_lengths([int(x) for x in np.minimum(rng.pareto(1.2, 64) * 1500 + 100, 60000)])
        for name in ("dhp", "static", "fcp-ref", "megatron-hcp"):
            for stages in (1, 2):
                plan = run_planner(build_planner(name, {}), batch, model, pipeline_stages=stages)
                assert last_backward_shared(plan, pipelined=stages > 1), (name, seed, stages)
