"""Mixture of experts under dynamic plans: megatron-core's MoE layer with expert parallelism 2 on 4 gloo ranks
against the single-process oracle, and the slot alignment that keeps its collectives matched."""

from __future__ import annotations

import pytest

from megatron_dhp.runtime.dispatch import StepInputs
from megatron_dhp.runtime.launch import launch
from megatron_dhp.runtime.slots import PHASE_BARRIER, aligned_slot_counts, work_items
from tests.runtime import moe_workers
from tests.runtime.test_distributed import assert_exact


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    return launch(moe_workers.expert_parallel_checks, 4, timeout_s=500)


@pytest.mark.parametrize("plan", [*moe_workers.plans_of_four(), "ulysses"])
def test_expert_parallel_alltoall_matches_single_process(ep2, plan):
    for rank in ep2:
        assert rank["ep"] == 2
        assert_exact(rank["exact"][plan])


def test_each_rank_holds_its_half_of_the_experts(ep2):
    held = {tuple(rank["experts"]) for rank in ep2}
    assert len(held) == 2  # EP partners hold different experts, named by global index (compared with the oracle's)
    indices = {name.split("local_experts.")[1].split(".")[0] for names in held for name in names}
    assert indices == {"0", "1", "2", "3"}


def test_load_balancing_loss_is_exact_when_microbatches_are_samples(ep2):
    for rank in ep2:
        assert_exact(rank["aux"])
        # split differently, the router's per-microbatch statistics differ: only its gradient moves
        assert rank["aux_split"].max_loss_diff <= 1e-5 < rank["aux_split"].max_grad_diff
        assert "router" in rank["aux_split"].worst_param


def test_allgather_dispatcher_with_expert_parallelism_is_refused(ep2):
    for rank in ep2:
        assert "allgather token dispatcher" in rank["allgather"] and "alltoall" in rank["allgather"]


@pytest.mark.parametrize("name", list(moe_workers.plans_of_four()))
def test_aligned_slots_pad_every_phase_to_the_domain_maximum(name):
    plan = moe_workers.plans_of_four()[name]
    counts = aligned_slot_counts(plan)
    assert counts == {"1+1+2 then 2+2, counts 3/1/2/2": [3, 1], "2 across EP groups + idle, barrier": [3, 2]}[name]
    for position in range(4):
        inputs = StepInputs(plan=plan, microbatches=(), num_tokens=0, num_loss_tokens=0)
        items = work_items(inputs, position, aligned=True)
        phases = [[]]
        for item in items:
            if item is PHASE_BARRIER:
                phases.append([])
            else:
                phases[-1].append(item)
        assert [len(p) for p in phases] == (counts if plan.phase_barrier else [sum(counts)])
